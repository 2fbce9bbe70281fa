"""A char-level mixture of experts against the dense llama of equal active parameters, trained from scratch.

    python bench/moe_train.py [--preset small] [--steps 300] [--experts 4] [--experts-per-token 2] [--out runs/bench]

Two runs of ``python -m train.lm --model llama --preset P`` on Tiny Shakespeare, the same seed, batches and
schedule: the dense one, then the same with ``--experts E --experts-per-token K`` (each expert
``d_ff / K`` wide, so that a token goes through as many feed-forward weights as in the dense model:
equal active parameters, E / K times the feed-forward weights in all). Each row: parameters (all and
active), the final validation loss (the cross-entropy, nats per character), the last logged
``aux_loss``, train tokens per second (the median of the logged windows after the first, which holds
the compilation), and the wall time. Rows are appended to ``<out>/results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from benchlib import load_line, record
from flax import nnx

from flax_transformer.training import lm
from flax_transformer.training.malloc import keep_freed_memory


def parameters(config, vocab: int) -> tuple[int, int]:
    """(all parameters, those one token uses: k of the E experts)."""
    model = nnx.eval_shape(lambda: lm.build_model(config, vocab))
    sizes = {".".join(map(str, path)): int(np.prod(v.shape))
             for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    total = sum(sizes.values())
    moe = lm.moe_of(model)
    if moe is None:
        return total, total
    experts = sum(n for name, n in sizes.items() if ".experts." in name)
    return total, total - experts + experts * moe.num_experts_per_tok // moe.num_experts


def run(name: str, config, out: Path, data_dir) -> dict:
    run_dir = out / f"moe-train-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    start = time.perf_counter()
    with jax.numpy_dtype_promotion("standard"):
        metrics = lm.train_and_evaluate(config, run_dir, data_dir=data_dir, progress=False)
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if line["split"] == "train"]
    vocab = len(json.loads((run_dir / "tokenizer.json").read_text())["model"]["vocab"])
    total, active = parameters(config, vocab)
    return {"run": name, "params": total, "active_params": active, "steps": metrics["step"],
            "val_loss": round(metrics["val_loss"], 4), "train_loss": round(train[-1]["loss"], 4),
            "aux_loss": round(train[-1]["aux_loss"], 4) if "aux_loss" in train[-1] else None,
            "tokens_per_s": round(statistics.median(line["tokens_per_s"] for line in train[1:] or train)),
            "wall_s": round(wall, 1), "run_dir": str(run_dir)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=list(lm.PRESETS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--experts-per-token", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=None, help="default: the run's length (one evaluation)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the train/ entry points do
    every = args.eval_every or args.steps
    runs = {"dense": {}, f"moe-{args.experts}x{args.experts_per_token}": dict(
        experts=args.experts, experts_per_token=args.experts_per_token)}
    print(load_line("before"))
    rows = []
    for name, changes in runs.items():
        config = lm.presets("llama")[args.preset](steps=args.steps, eval_every=every, checkpoint_every=args.steps,
                                                  sample_tokens=40, **changes)
        row = run(name, config, args.out, args.data_dir) | {"preset": args.preset}
        rows.append(row)
        record(args.out, row)
    print(load_line("after"))
    print("\n| run | params | active | steps | val loss | train loss | aux loss | tokens/s | wall |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        aux = "" if row["aux_loss"] is None else f"{row['aux_loss']:.3f}"
        print(f"| {row['run']} ({row['preset']}) | {row['params']:,} | {row['active_params']:,} | {row['steps']} | "
              f"{row['val_loss']:.4f} | {row['train_loss']:.4f} | {aux} | {row['tokens_per_s']:,} | "
              f"{row['wall_s']:.0f} s |")


if __name__ == "__main__":
    main()
