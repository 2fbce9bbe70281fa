"""Peak host memory of loading and saving a large HF checkpoint, against its size (issue 16, part 2).

    python bench/memory.py [--workdir DIR] [--shard-size 500MB] [--keep] [--out FILE]

Builds BERT-large from ``transformers.BertConfig`` (24 layers, width 1024, 16 heads, 4096
intermediate: 335M parameters, 1.34 GB in fp32), writes it once as one ``model.safetensors``
and once sharded, then measures each case in a fresh process: peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and the baseline after the imports and
JAX's start-up. The checkpoints are built in a process of their own too: ``ru_maxrss``
survives fork and exec, so the process that starts the measurements must stay small. What a case adds to the baseline is compared with the goal: the model plus
its largest shard (the interpreter and libraries are the baseline).

Cases:
* ``load``: ``hf.from_pretrained`` (streams tensor by tensor, ``safetensors_io.fill``);
* ``load, read whole``: the way it was before, ``hf.read_weights`` + ``porting.load_state_dict``
  (every tensor as numpy, then every tensor as a JAX array), for comparison;
* ``save``: ``hf.save_pretrained`` of the loaded model, with and without shards. The save's own
  peak is measured after the load: the kernel's high-water mark is reset
  (``/proc/self/clear_refs``) once the model is resident, and read from ``VmHWM``.

Results: a table on stdout (and JSON with ``--out FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 1 << 20


def _hwm_mb() -> float:
    """The process's peak RSS since start or since the last reset (VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak RSS to the current RSS
        return True
    except OSError:
        return False


def _child(case: str, folder: str, out: str, shard_size: str) -> None:
    """One measurement, in a fresh process: prints a JSON line."""
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    from flax_transformer.interop import hf, hf_tables, porting, targets
    from flax_transformer.models.encoder import TransformerEncoder

    jax.block_until_ready(jnp.zeros(8) + 1)  # XLA's CPU client started: part of the baseline
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    if case == "load":
        model = hf.from_pretrained(folder)
    elif case == "load, read whole":
        _, kind, config, _ = hf.read_folder(folder)
        weights = hf_tables.hf_to_ours(kind, hf.read_weights(folder), config)
        model = targets.build_unfilled(TransformerEncoder, dict(config=config))
        porting.load_state_dict(model, weights)
        del weights
    else:
        model = hf.from_pretrained(folder)
    jax.block_until_ready(jax.tree.leaves(porting.flax_params(model)))
    row = {"case": case, "baseline_mb": baseline, "seconds": time.perf_counter() - start}
    if case.startswith("save"):
        resident = _hwm_mb()
        row["after_load_mb"] = resident
        row["reset"] = _reset_hwm()
        start = time.perf_counter()
        hf.save_pretrained(model, out,
                           max_shard_size=shard_size if case == "save, sharded" else None)
        row["seconds"] = time.perf_counter() - start
        row["peak_mb"] = _hwm_mb() if row["reset"] else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        row["peak_is_since"] = "the model was loaded" if row["reset"] else "process start"
    else:
        row["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(row))


def _prepare(workdir: Path, shard_size: str) -> dict:
    """BERT-large from transformers' config, saved once whole and once sharded (by transformers)."""
    import torch
    import transformers

    config = transformers.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                     intermediate_size=4096)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(workdir / "single", max_shard_size="100GB")
    model.save_pretrained(workdir / "sharded", max_shard_size=shard_size)
    del model
    single = workdir / "single" / "model.safetensors"
    shards = sorted((workdir / "sharded").glob("model-*.safetensors"))
    return {"model_mb": single.stat().st_size / MB, "shards": len(shards),
            "largest_shard_mb": max(s.stat().st_size for s in shards) / MB}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--shard-size", default="500MB", help="transformers' max_shard_size for the sharded copy")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--out", help="also write the figures to OUT (JSON)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    if args.prepare:
        print(json.dumps(_prepare(Path(args.prepare[0]), args.prepare[1])))
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ft-memory-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        # in a process of its own: ru_maxrss survives fork and exec, so this process stays small
        done = subprocess.run([sys.executable, __file__, "--prepare", str(workdir), args.shard_size],
                              capture_output=True, text=True, check=True)
        sizes = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"BERT-large: {sizes['model_mb']:.0f} MiB of fp32 safetensors; sharded copy: {sizes['shards']} shards, "
              f"largest {sizes['largest_shard_mb']:.0f} MiB", flush=True)
        cases = [("load", "single", sizes["model_mb"]), ("load", "sharded", sizes["largest_shard_mb"]),
                 ("load, read whole", "single", sizes["model_mb"]), ("save", "single", sizes["model_mb"]),
                 ("save, sharded", "single", sizes["largest_shard_mb"])]
        rows = []
        env = {**os.environ, "FLAX_TRANSFORMER_KEEP_FREED_MEMORY": "0"}
        for i, (case, source, shard_mb) in enumerate(cases):
            out = workdir / f"out-{i}"
            done = subprocess.run([sys.executable, __file__, "--child", case, str(workdir / source), str(out),
                                   args.shard_size], capture_output=True, text=True, env=env, check=False)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            row = json.loads(done.stdout.strip().splitlines()[-1]) | {"source": source}
            row["added_mb"] = row["peak_mb"] - row["baseline_mb"]
            row["goal_mb"] = sizes["model_mb"] + shard_mb
            row["within_goal"] = row["added_mb"] <= row["goal_mb"]
            rows.append(row)
            shutil.rmtree(out, ignore_errors=True)
        print(f"\n{'case':<18}{'from':<9}{'baseline':>10}{'peak':>9}{'added':>9}{'goal':>9}  within   seconds")
        for r in rows:
            print(f"{r['case']:<18}{r['source']:<9}{r['baseline_mb']:>8.0f}M{r['peak_mb']:>8.0f}M{r['added_mb']:>8.0f}M"
                  f"{r['goal_mb']:>8.0f}M  {'yes' if r['within_goal'] else 'NO':<7}{r['seconds']:>8.1f}")
        print("\nadded = peak RSS - baseline (the interpreter, JAX and the libraries after start-up); goal = model + "
              "largest shard. A save's peak counts from after its load (the model resident; VmHWM reset).")
        if args.out:
            Path(args.out).write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=1) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
