"""Issue 7's benchmarks: all-MiniLM-L6-v2 on IMDB, as a linear probe and as a full fine-tune, timed end to end.

    python bench/finetune.py [--run probe finetune] [--preset small] [--out runs/bench] [--init PATH]

* ``probe``: ``python -m train.classify --model hf --freeze-encoder`` (``frozen_small``): the
  encoder's mean-pooled features of all 25k train and 25k test reviews (256 tokens),
  computed once, then the head for 20 epochs.
* ``finetune``: ``python -m train.classify --model hf`` (``hf_small``): every weight, on a
  seeded 4,000-review subset of the training set, 2 epochs, 256 tokens; tested on a
  seeded 5,000 of the 25k test reviews (a full test pass would take longer than training).
  ``--preset base`` is the full fine-tune on all 25k (sized for a GPU).

Each row: test accuracy, steps, wall time (data loading, tokenising, feature caching,
compiling, training and testing included) and the run directory. Rows are appended to
``<out>/results.jsonl``. Reference points on this split: TF-IDF uni+bigram logistic
regression 90.7%, binary bag-of-words logistic regression 88.0%, DistilBERT fine-tuned 91.4%.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchlib import record

from flax_transformer.training import classify
from flax_transformer.training.malloc import keep_freed_memory

RUNS = {"probe": True, "finetune": False}  # name -> freeze_encoder
REFERENCES = {"TF-IDF uni+bigram LR": 0.907, "binary bag-of-words LR": 0.880, "DistilBERT fine-tuned": 0.914}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--preset", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--init", default=None, help="the BERT folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the train/ entry points do
    rows = []
    for name in args.run:
        config = classify.presets_for("hf", RUNS[name])[args.preset](init=args.init)
        run_dir = args.out / f"minilm-{name}-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
        start = time.perf_counter()
        metrics = classify.train_and_evaluate(config, run_dir, data_dir=args.data_dir)
        seconds = time.perf_counter() - start
        row = {"run": name, "preset": args.preset, "test_accuracy": metrics["test_accuracy"],
               "val_accuracy": metrics.get("val_accuracy"), "steps": metrics["step"],
               "train_reviews": (config.train_limit or 25_000) - config.val_size,
               "test_reviews": config.test_limit or 25_000, "max_length": config.max_length,
               "wall_s": round(seconds, 1), "run_dir": str(run_dir)}
        rows.append(row)
        record(args.out, row)
    print("\n| run | train reviews | test reviews | test accuracy | steps | wall |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['run']} ({row['preset']}) | {row['train_reviews']:,} | {row['test_reviews']:,} | "
              f"{row['test_accuracy']:.2%} | {row['steps']} | {row['wall_s'] / 60:.1f} min |")
    for name, accuracy in REFERENCES.items():
        print(f"| {name} (reference) | 25,000 | 25,000 | {accuracy:.1%} | | |")


if __name__ == "__main__":
    main()
