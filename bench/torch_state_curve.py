"""Issue 15's figure: a run's loss curve across the switch between PyTorch and JAX.

    python bench/torch_state_curve.py --out /tmp/torch_state_curve.png [--steps 200]
    python bench/torch_state_curve.py --both-ways --out /tmp/both_ways.png [--family gpt --steps 100]

Default: a torch user's run handed to the entry point with one flag. ``train.seq2seq``'s tiny
model (notebook 003's encoder-decoder, the torch_reference twin of the run's initial weights)
trains ``2 * steps`` updates in a plain torch loop (``torch_state.torch_optimizer``, the run's
schedule, clipping) on the run's own batches (``Examples``: a pure function of (seed, step)); at
update ``steps`` it saves a torch training checkpoint, and ``python -m train.seq2seq
--init-from-torch`` continues it in JAX to ``2 * steps``. The figure shows torch's curve and the
JAX run's logged curve (``metrics.jsonl``, 10-step means) after the switch.

``--both-ways``: the family's full model (``parity.setup``'s, dropout 0) learns a task it can learn (sequences
that count up). Left: ``steps`` updates in torch, the torch training
checkpoint (``torch.save``, ``import_torch_state``), ``steps`` in JAX, over ``2 * steps`` in torch
uninterrupted. Right: the way back (JAX, ``torch_training_state``, torch) over JAX uninterrupted.
AdamW, the library's warmup and cosine decay, clipping: ``continuity.continuity``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# the repository instead of bench/ first on the path: a bench/<name>.py must not shadow a standard module
sys.path[0] = str(Path(__file__).resolve().parents[1])


def counting_task(family: str):
    """Batches of the family's shapes whose sequences count up from a random token (mod the vocabulary):
    a next-token rule the model learns in a few hundred updates."""
    import numpy as np

    b, t, vocab = 4, 12, 60

    def make_batch(rng):
        ids = ((rng.integers(0, vocab, (b, 1)) + np.arange(t + 1)) % vocab).astype(np.int32)
        if family == "gpt":
            return {"ids": ids[:, :-1], "labels": ids[:, 1:]}
        if family == "classic":  # the decoder continues the count
            return {"src": ids[:, :t], "tgt": ids[:, :t], "out": ids[:, 1:]}
        return {"ids": ids[:, :t], "labels": (ids[:, 0] % 3).astype(np.int32)}  # classify by the first token

    return make_batch


def entry_point_figure(args) -> int:
    """The default figure: torch for ``2 * steps`` updates, and ``train.seq2seq --init-from-torch`` from ``steps``."""
    import json
    import subprocess
    import tempfile

    import numpy as np
    import torch

    from flax_transformer.interop import files, porting
    from flax_transformer.training import seq2seq
    from flax_transformer.training.optim import from_task
    from flax_transformer.training.torch_state.to_jax import torch_optimizer

    total = 2 * args.steps
    config = seq2seq.Seq2SeqConfig.tiny(steps=total)
    optim = from_task(config, total)
    model = porting.flax_to_torch(seq2seq.build_model(config)).train()  # the run's own initial weights
    opt, sched = torch_optimizer(model, optim)
    examples, losses = seq2seq.Examples(config), []
    work = Path(tempfile.mkdtemp(prefix="torch-state-curve-"))
    for step in range(total):
        if step == args.steps:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "step": step, "config": model.init_kwargs()}, work / "ckpt.pt")
        b = {k: torch.from_numpy(np.asarray(v)) for k, v in examples.batch(step).items()}
        logits = model(b["src"].long(), b["tgt_in"].long(), b["src_mask"].long(), (b["tgt_in"] != seq2seq.PAD).long())
        real = b["tgt_out"] != seq2seq.PAD
        loss = torch.nn.functional.cross_entropy(logits[real], b["tgt_out"][real].long())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_norm)
        opt.step()
        sched.step()
        losses.append(loss.item())
    def jax_run(name, *extra):
        """The logged (steps, 10-update mean losses) of a train.seq2seq run."""
        command = [sys.executable, "-m", "train.seq2seq", "--preset", "tiny", "--steps", str(total), "--out",
                   str(work / name), "--no-progress", *extra]
        print("$", " ".join(command[1:]), file=sys.stderr)
        subprocess.run(command, check=True, cwd=Path(__file__).resolve().parents[1])
        logged = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
        return [r["step"] for r in logged if r["split"] == "train"], [r["loss"] for r in logged if r["split"] == "train"]

    jax_steps, jax_losses = jax_run("switched", "--init-from-torch", str(work / "ckpt.pt"))
    native_steps, native_losses = jax_run("native")  # the same run in JAX from update 1: the control

    def gaps(steps, values):  # against torch's means over the same 10 updates
        return [abs(v - float(np.mean(losses[s - 10:s]))) for s, v in zip(steps, values)]

    switched, native = gaps(jax_steps, jax_losses), gaps(native_steps, native_losses)
    early = max(switched[:5])
    worst = max(switched)
    print(f"JAX from the torch checkpoint vs torch throughout (10-update means): {early:.1e} over the first 50 "
          f"updates after the switch, {worst:.1e} over all {len(jax_steps) * 10}; the same run in JAX from update 1 "
          f"(no switch) vs torch: {max(native[:len(native) // 2]):.1e} over the first {len(native) * 5} updates, "
          f"{max(native):.1e} over all")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(range(1, total + 1), losses, color="0.75", lw=0.8, label="PyTorch, every update (torch throughout)")
    means = [float(np.mean(losses[max(0, s - 10):s])) for s in range(10, total + 1, 10)]
    ax.plot(range(10, total + 1, 10), means, color="C0", lw=1.5, label="PyTorch, 10-update means")
    ax.plot(native_steps, native_losses, "s", color="C2", ms=3, mfc="none",
            label="JAX throughout: train.seq2seq (the control), logged means")
    ax.plot(jax_steps, jax_losses, "o", color="C3", ms=4,
            label=f"JAX: train.seq2seq --init-from-torch (step {args.steps}), logged means")
    ax.axvline(args.steps + 0.5, color="k", ls=":", lw=1)
    ax.text(args.steps + 2, max(losses) * 0.95, "torch training checkpoint", fontsize=8)
    ax.set_xlabel("update")
    ax.set_ylabel("training loss")
    ax.set_title(f"seq2seq (notebook 003, tiny): PyTorch, then JAX from update {args.steps + 1}\n"
                 f"|JAX - torch| of the means: {early:.0e} for 50 updates after the switch, {worst:.0e} at most "
                 f"(JAX throughout: {max(native):.0e})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.write_file(args.out, lambda tmp: fig.savefig(tmp, format="png", dpi=110), overwrite=args.overwrite)
    print(f"wrote {args.out}")
    return 0 if early <= 1e-4 else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--both-ways", action="store_true",
                        help="instead, continuity.continuity of --family on a counting task, both directions")
    parser.add_argument("--family", default="gpt", choices=["former", "encoder", "gpt", "classic"])
    parser.add_argument("--steps", type=int, default=None,
                        help="updates before the switch, as many after (default 200; 100 with --both-ways)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from flax_transformer.interop import files
    from flax_transformer.training.torch_state import continuity

    files.check_target(args.out, overwrite=args.overwrite)
    if not args.both_ways:
        args.steps = args.steps or 200
        return entry_point_figure(args)
    args.steps = args.steps or 100
    results = continuity.continuity(args.family, steps=args.steps, lr=3e-3, warmup_steps=args.steps // 5,
                                make_batch=counting_task(args.family))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, result in zip(axes, results):
        first, second = result.direction.split("->")
        steps = range(1, len(result.losses) + 1)
        k = result.switch
        ax.plot(steps, result.reference, color="0.7", lw=4, label=f"{first} throughout ({2 * k} updates)")
        ax.plot(steps[:k], result.losses[:k], color="C0", lw=1.2, label=f"{first}, updates 1..{k}")
        ax.plot(steps[k:], result.losses[k:], color="C3", lw=1.2, label=f"{second} from the checkpoint, {k + 1}..{2 * k}")
        ax.axvline(k + 0.5, color="k", ls=":", lw=1)
        ax.set_title(f"{args.family}: {first} -> torch training checkpoint -> {second}\n"
                     f"largest loss difference {result.loss_err:.1e}, parameters {result.param_err:.1e}")
        ax.set_xlabel("update")
        ax.legend(fontsize=8)
        print(continuity.format_continuity(result).splitlines()[-2 if result.noise_params else -1])
        print(f"{result.direction}: largest loss difference {result.loss_err:.2e}, passed {result.passed}")
    axes[0].set_ylabel("training loss")
    fig.tight_layout()
    files.write_file(args.out, lambda tmp: fig.savefig(tmp, format="png", dpi=110), overwrite=args.overwrite)
    print(f"wrote {args.out}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
