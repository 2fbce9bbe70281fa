"""Issue 25's step benchmark: a LoRA step against a full fine-tuning step of all-MiniLM-L6-v2 on IMDB.

    python bench/lora.py [--rounds 3] [--steps 40] [--rank 8] [--out runs/bench-lora]

Each round runs ``python -m train.classify --model hf`` twice, each in a process of its own (the
default threading), for ``--steps`` steps of the ``hf_small`` preset (batch 16, 256 tokens, the
4,000-review subset): once training every weight, once with ``--lora-rank R`` (the adapters on
``query``/``value`` and the head). The order alternates round by round, so that a slow spell of the
machine falls on both. Per run it reads the run's ``metrics.jsonl`` train records (10 steps each;
the first, which holds the compilation, left out) and the process's peak resident memory
(``wait4``). It prints, per mode, the median tokens/s with its spread over the records, the peak
memory, and what the optimizer holds: Adam keeps 2 numbers per trained parameter, so its state is
``2 * 4 bytes * trained`` (LoRA's run prints the same count at its start).

Whole runs (accuracy, wall time) are ``python -m train.classify --model hf [--lora-rank 8]``
themselves: docs/benchmarks.md, "LoRA against full fine-tuning".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = {"full": [], "lora": ["--lora-rank"]}


def _run(mode: str, steps: int, rank: int, out: Path, data_dir) -> dict:
    args = [sys.executable, "-m", "train.classify", "--model", "hf", "--steps", str(steps), "--out", str(out),
            "--no-progress", "--test-limit", "16"]
    if mode == "lora":
        args += ["--lora-rank", str(rank), "--lr", "1e-3"]
    if data_dir is not None:
        args += ["--data-dir", str(data_dir)]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{mode} run failed ({process.returncode}):\n{output[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if r.get("split") == "train" and "tokens_per_s" in r][1:]
    trained = next((line for line in output.splitlines() if line.startswith("training ")), None)
    return {"tokens_per_s": speeds, "peak_rss_mb": usage.ru_maxrss / 1024, "trained_line": trained}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 20:
        raise SystemExit("--steps must be >= 20: the first 10-step record (the compilation) is left out")
    results = {mode: {"tokens_per_s": [], "peak_rss_mb": []} for mode in MODES}
    lines = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
            for mode in order:
                got = _run(mode, args.steps, args.rank, Path(tmp) / f"{mode}-{round_}", args.data_dir)
                results[mode]["tokens_per_s"] += got["tokens_per_s"]
                results[mode]["peak_rss_mb"].append(got["peak_rss_mb"])
                lines[mode] = got["trained_line"]
                print(f"round {round_ + 1} {mode}: tokens/s {[round(s) for s in got['tokens_per_s']]}, "
                      f"peak RSS {got['peak_rss_mb']:.0f} MB", file=sys.stderr)
    print("\n| mode | tokens/s median [min-max] (train records of 10 steps) | peak RSS (MB) | trained |\n|---|---|---|---|")
    for mode, r in results.items():
        s = r["tokens_per_s"]
        print(f"| {mode} | {statistics.median(s):,.0f} [{min(s):,.0f}-{max(s):,.0f}] ({len(s)} records) | "
              f"{statistics.median(r['peak_rss_mb']):,.0f} | {lines[mode] or 'every parameter'} |")
    ratio = statistics.median(results["lora"]["tokens_per_s"]) / statistics.median(results["full"]["tokens_per_s"])
    print(f"\nLoRA / full tokens/s: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
