"""Where the JAX train step's time goes, for ``bench/speed.py``'s configurations (issue 21, item 7).

    python bench/step_profile.py [--config a b] [--steps 10] [--top 12]

Run alone, with JAX's defaults and ``keep_freed_memory`` (as ``bench/speed.py``'s isolated mode runs it; this process
imports torch only to build the model whose weights JAX ports, and runs nothing on it after).

1. Sub-programs, each jitted on its own, median of ``--steps`` calls after 3 untimed: the
   forward; loss + gradients (``nnx.value_and_grad``, no update); the whole train step (+ clip +
   Adam, state donated) -- the program ``bench/speed.py`` times. Differences give the backward
   and the optimizer.
2. A trace of ``--steps`` train steps (``jax.profiler``, its perfetto JSON): the time of each
   HLO instruction's thunk, summed and divided by the steps, grouped by kind: matmul (``dot``,
   ``convolution`` and fusions holding one), gather/scatter (embedding lookups and their
   gradients, ``take_along_axis``), reduce (fusions holding a reduction: softmax, norms, sums),
   elementwise (other fusions), copy/transpose, other. XLA's CPU runtime runs independent
   thunks at once on its pool, so the sums can exceed the step's wall time.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import tempfile
from pathlib import Path

from benchlib import load_line, threads_named
from speed_isolated import _keep_freed_memory, configs, jax_programs


def _timed_median(fn, steps: int) -> float:
    import time

    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kinds(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """(kind, result shape, JAX op name) of every instruction, by name, from the compiled HLO text.

    A fusion is a matmul if its body holds a dot (with whatever XLA fused to it: YNNPACK's
    fusions hold q k^T together with the softmax)."""
    bodies: dict[str, str] = {}
    current = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(1)
            bodies[current] = ""
        elif current is not None:
            bodies[current] += line + "\n"
    kinds = {}
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(", line)
        if not m:
            continue
        name, opcode = m.groups()
        called = re.search(r"calls=%?([\w.\-]+)", line)
        body = bodies.get(called.group(1), "") if called else ""
        text = opcode + " " + body
        if re.search(r"\b(dot|convolution)\(", text) or opcode in ("dot", "convolution") or "__onednn$matmul" in line:
            kind = "matmul"
        elif re.search(r"\b(scatter|gather|dynamic-update-slice|dynamic-slice)\(", text) or opcode in (
                "scatter", "gather"):
            kind = "gather/scatter"
        elif re.search(r"\breduce(-window)?\(", text) or opcode == "reduce":
            kind = "reduce"
        elif opcode == "fusion":
            kind = "elementwise"
        elif opcode in ("copy", "transpose", "bitcast", "reshape"):
            kind = "copy/transpose"
        else:
            kind = "other"
        shape = re.match(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)", line).group(1).split("{")[0]
        op_name = re.search(r'op_name="([^"]*)"', line)
        kinds[name] = (kind, shape, op_name.group(1) if op_name else "")
    return kinds


def profile(key: str, steps: int, top: int) -> None:
    import jax

    spec = configs()[key]
    programs = jax_programs(spec, parts=True)
    print(f"({key}) {spec['name']}: matmul FLOPs forward {programs['flops_forward'] / 1e9:.2f} G (x3 for the step)")
    fwd = _timed_median(programs["forward"], steps)
    grad = _timed_median(programs["grad"], steps)
    step = _timed_median(programs["train step"], steps)
    update = _timed_median(programs["update"], steps)
    print(f"  forward {fwd * 1e3:.1f} ms; loss + gradients {grad * 1e3:.1f} ms (backward ~{(grad - fwd) * 1e3:.1f}); "
          f"whole step {step * 1e3:.1f} ms (clip + Adam ~{(step - grad) * 1e3:.1f}); clip + Adam alone "
          f"{update * 1e3:.1f} ms")

    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
        for _ in range(steps):
            programs["train step"]()
        jax.profiler.stop_trace()
        trace = next(Path(log_dir).rglob("perfetto_trace.json.gz"))
        events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    module = programs["train_compiled"]
    kinds = _kinds(module.as_text())
    per_op: collections.Counter = collections.Counter()
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in args and not e["name"].startswith("end:"):
            per_op[args["hlo_op"]] += e.get("dur", 0) / 1e3 / steps  # ms per step
    total = sum(per_op.values())
    by_kind: collections.Counter = collections.Counter()
    for op, ms in per_op.items():
        by_kind[kinds.get(op, ("other",))[0]] += ms
    print(f"  trace: {len(per_op)} thunks, {total:.1f} ms per step summed over them (wall {step * 1e3:.1f} ms)")
    print("  by kind: " + ", ".join(f"{k} {ms:.1f} ms ({ms / total:.0%})" for k, ms in by_kind.most_common()))
    print(f"  top {top}:")
    for op, ms in per_op.most_common(top):
        kind, shape, op_name = kinds.get(op, ("?", "", ""))
        print(f"    {ms:7.1f} ms {ms / total:4.0%}  {kind:14s} {op} {shape} {op_name}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", default=["a", "b"], choices=["a", "b"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    print(load_line("start"))
    print(f"malloc: keep_freed_memory {'applied' if _keep_freed_memory() else 'not applied'} (as in bench/speed.py)")
    for key in args.config:
        profile(key, args.steps, args.top)
    print(f"XLA pool threads: {threads_named('tf_XLAEigen')}")
    print(load_line("end", warn=False))


if __name__ == "__main__":
    main()
