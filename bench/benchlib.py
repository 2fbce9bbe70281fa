"""What the benchmark scripts share: timing, fair comparisons, the machine's settings, results files.

Run the scripts as ``python bench/<name>.py``. This module imports neither JAX nor torch, so
a script can fix the environment (threads, OpenMP wait policy) before either is loaded.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

# the environment variables that set threads, waiting and malloc for XLA, torch's OpenMP and MKL
THREAD_ENV = ("NPROC", "XLA_FLAGS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND",
              "MKL_NUM_THREADS", "KMP_BLOCKTIME", "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_",
              "MALLOC_TRIM_THRESHOLD_", "FLAX_TRANSFORMER_KEEP_FREED_MEMORY")


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


def interleaved_seconds(contenders: Mapping[str, Callable[[], object]], reps: int, *,
                        warmup: int = 3) -> dict[str, list[float]]:
    """Wall times of ``reps`` rounds in which every contender runs once, the order rotated each round.

    Each ``fn`` must block until its work is done (``jax.block_until_ready``; torch on CPU
    returns when it has finished). First every contender runs ``warmup`` untimed times, one
    after the other (compilation, caches, allocator). Then round ``i`` runs the contenders in
    the order of the list rotated by ``i`` (A B C, B C A, C A B, ...), so each framework follows
    each other one equally often and a slow stretch of the machine (another job, a frequency
    change) falls on all of them within a few hundred milliseconds instead of on one
    framework's whole block. Python's garbage collector is off while the rounds run.

    Returns ``{name: [seconds of round 0, round 1, ...]}``: the times of one round are pairs
    (triples) taken under the same conditions, for ``paired_ratio``.
    """
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(reps):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                fn = contenders[name]
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    finally:
        if enabled:
            gc.enable()
    return times


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (p25, p75, linear interpolation), min and max of ``values``."""
    p25, median, p75 = np.percentile(np.asarray(values, dtype=float), [25, 50, 75])
    return dict(median=float(median), p25=float(p25), p75=float(p75), min=float(min(values)),
                max=float(max(values)), n=len(values))


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """``spread`` of the per-round ratios ``numerator[i] / denominator[i]`` (e.g. torch time / JAX time).

    The ratio of two times taken in the same round, next to each other: the machine's slow
    and fast stretches cancel in it, where the ratio of two medians taken minutes apart does not."""
    if len(numerator) != len(denominator):
        raise ValueError(f"unpaired: {len(numerator)} and {len(denominator)} times")
    return spread([n / d for n, d in zip(numerator, denominator)])


# ----------------------------------------------------------------------------- the machine


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def load_line(when: str, *, warn: bool = True) -> str:
    """``load average at <when>: 1-min 5-min 15-min on N cores``, with a warning (``warn``) above 0.5 per core.

    Take it before the benchmark starts: later, the benchmark's own threads count in it."""
    load = load_average()
    if load is None:
        return f"load average at {when}: unknown"
    n = cores()
    line = f"load average at {when}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min) on {n} cores"
    if warn and load[0] > 0.5 * n:
        line += (f"\nWARNING: the 1-minute load ({load[0]:.2f}) is above 0.5 per core: other jobs share the "
                 "cores and the times are noisy (the paired ratios less so); compare their IQRs")
    return line


def threads_named(prefix: str) -> int | None:
    """How many of this process's threads have a name starting with ``prefix`` (Linux; None elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().startswith(prefix)
        except OSError:
            pass
    return count


def env_settings(names: Sequence[str] = THREAD_ENV) -> str:
    """``NAME=value`` for each of ``names`` in the environment, ``NAME unset`` for the others."""
    return ", ".join(f"{name}={os.environ[name]}" if name in os.environ else f"{name} unset" for name in names)


def exec_with_env(wanted: Mapping[str, str | None], script: str, argv: Sequence[str]) -> None:
    """Make sure this process runs with ``wanted`` in its environment (None: unset), restarting it if needed.

    Some settings are read once, when a library loads (libgomp reads ``OMP_WAIT_POLICY`` when
    torch is imported), so changing ``os.environ`` later does nothing. If any of ``wanted``
    differs, the process replaces itself (``os.execve``) with ``python script *argv`` under the
    new environment; otherwise this returns and the settings are in place."""
    if all(os.environ.get(name) == value for name, value in wanted.items()):
        return
    if os.environ.get("_BENCHLIB_REEXEC") == script:  # the restart did not take: stop instead of looping
        raise RuntimeError(f"could not set {dict(wanted)} in the environment")
    env = {name: value for name, value in os.environ.items() if wanted.get(name, value) is not None}
    env.update({name: value for name, value in wanted.items() if value is not None})
    env["_BENCHLIB_REEXEC"] = script
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, script, *argv], env)


# ----------------------------------------------------------------------------- results


def record(out: Path, row: dict, *, echo: bool = True) -> None:
    """Append ``row`` to ``out/results.jsonl`` and (``echo``) print it."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    if echo:
        print(json.dumps(row), flush=True)
