"""The training benchmarks of issue 5: each task's ``small`` preset on this machine, timed end to end.

    python bench/train.py [--task classify lm seq2seq] [--preset small] [--out runs/bench]

Runs ``train_and_evaluate`` exactly as ``python -m train.<task> --preset small`` does (data
loading, tokenising, compiling, training, evaluating) and prints one row per task: the
final metric, steps, wall time and the run directory (with metrics.jsonl and curves.png).
Results are also appended to ``<out>/results.jsonl``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchlib import record

from flax_transformer.training import classify, lm, seq2seq
from flax_transformer.training.malloc import keep_freed_memory

TASKS = {"classify": (classify, "test_accuracy"), "lm": (lm, "val_loss"), "seq2seq": (seq2seq, "exact_match")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--preset", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the train/ entry points do
    rows = []
    for task in args.task:
        module, metric = TASKS[task]
        run_dir = args.out / f"{task}-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
        start = time.perf_counter()
        metrics = module.train_and_evaluate(module.PRESETS[args.preset](), run_dir, data_dir=args.data_dir)
        seconds = time.perf_counter() - start
        row = {"task": task, "preset": args.preset, metric: metrics[metric], "steps": metrics["step"],
               "wall_s": round(seconds, 1), "run_dir": str(run_dir)}
        rows.append(row)
        record(args.out, row)
    print(f"\n| task | {'|'.join(['metric', 'value', 'steps', 'wall'])} |\n|---|---|---|---|---|")
    for row in rows:
        metric = TASKS[row["task"]][1]
        print(f"| {row['task']} ({row['preset']}) | {metric} | {row[metric]:.4f} | {row['steps']} | "
              f"{row['wall_s'] / 60:.1f} min |")


if __name__ == "__main__":
    main()
