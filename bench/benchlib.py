"""What the benchmark scripts share: timing and recording results (run them as ``python bench/<name>.py``)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def median_seconds(fn, reps: int, *, warmup: int = 3) -> float:
    """Median wall time of ``reps`` calls of ``fn`` after ``warmup`` untimed ones (compilation, caches).

    ``fn`` must block until its work is done (``jax.block_until_ready`` for JAX)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def record(out: Path, row: dict) -> None:
    """Append ``row`` to ``out/results.jsonl`` and print it."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
