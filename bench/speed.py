"""JAX against PyTorch: training step and forward pass, each framework alone (default) or all in one process.

    python bench/speed.py [--config a b c] [--rounds 5] [--reps 10] [--warmup 3] [--no-compile]
                          [--default-malloc] [--out DIR]
    python bench/speed.py --in-process [--config a b c] [--reps 10] [--no-compile] [--default-malloc]
                          [--threads N] [--omp-wait-policy passive|active|default] [--out DIR]

The default (issue 21, item 7) runs each contender in a process of its own with its framework's
default threading, the processes alternated round by round: see ``bench/speed_isolated.py``
for its method, its FLOP formula and its roofline fraction. ``--in-process`` is the older mode
described below (issue 13): all contenders in this process, under shared thread settings.

Configurations (issue 6):
  a  notebook 000's CTransformer: emb 128, 8 heads, depth 3, length 256, batch 4, vocab 50k (train step)
  b  a GPT (notebook 002's GPTTransformer): d 256, 4 layers, 4 heads, d_ff 1024, length 128, batch 16,
     vocab 10k (train step)
  c  BERT-base shape (12 layers, 768 wide, 12 heads), length 128, batch 8, forward only (inference)

Contenders: JAX's jitted train step (loss, grads, the Adam update of the training library, one
compiled program, state donated) and jitted forward; torch eager and ``torch.compile`` (same
model, ported weights, Adam; the forward under ``torch.inference_mode()``). fp32 with matmul
precision "highest" on both sides.

Method of ``--in-process`` (issue 13, item 12). For each configuration and pass, every contender first runs 3
untimed times (compilation, caches). Then ``--reps`` rounds: round i runs each contender once,
the order rotated by i (JAX, eager, compile; eager, compile, JAX; ...), each call timed with
``time.perf_counter`` around a call that returns when the result is ready
(``jax.block_until_ready``; torch on CPU is synchronous), with Python's garbage collector off.
Reported per contender: median, interquartile range (p25-p75) and min over the rounds, tokens/s
and FLOP/s from the median (FLOPs from XLA's cost analysis of the JAX program, used for both);
per ratio (torch time / JAX time): the median and IQR of the per-round ratios, each the ratio of
two calls made next to each other. The old script timed all of JAX, then all of torch, so a busy
minute on the shared machine fell on one framework only: the GPT train step read 0.84x, 1.29x
and 1.59x torch eager in three runs within ten minutes.

Equal settings for both frameworks, printed at the top of the output with the load average:
  * threads: ``--threads N`` (default: the cores this process may use) for torch's intra-op
    pool (``torch.set_num_threads``) and for XLA's CPU pool (``NPROC=N``, read by XLA's CPU
    client when it starts; the script counts the ``tf_XLAEigen`` threads to check);
  * torch's OpenMP threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE``, the default of
    ``--omp-wait-policy``), as XLA's pool threads do after a short spin; libgomp reads the
    variable only when torch loads, so the script restarts itself with it set;
  * malloc: ``flax_transformer.training.malloc.keep_freed_memory`` for the whole process (both
    frameworks), unless ``--default-malloc``.

The torch-forward anomaly of the issue (630 ms for a forward in the combined run, 28 ms in a
process of its own) was libgomp's default wait policy: after each parallel region torch's 2
OpenMP threads spin, and with any other runnable thread on the 2 cores (another job, or JAX's
pool in the same process) the spinning thread holds a core the other one needs to reach the next
barrier, so each of the forward's few hundred small parallel ops can cost a scheduler time slice.
Config (a)'s torch-eager forward, medians of 8-15 at load 4.2-5.3 on the 2 cores: 132-289 ms
(single calls 31-844 ms) under the default policy, 21-65 ms under ``OMP_WAIT_POLICY=PASSIVE``,
43-60 ms with one thread; JAX's forward 21-32 ms throughout. JAX's forward right after a torch
call took 41 ms, against 31 ms after a 0.1 s pause and 24 ms after another JAX call (torch's
threads still spinning); under PASSIVE 22, 24 and 21 ms. Not the cause: autograd (the old
forward already ran under ``no_grad``; no_grad, inference_mode and grad mode measured alike),
subnormal numbers (none in any module's output), a second OpenMP runtime loaded by
``torch.compile`` (one libgomp in the process), malloc (the anomaly shows with and without
``keep_freed_memory``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from benchlib import (
    cores,
    cpu_model,
    env_settings,
    exec_with_env,
    interleaved_seconds,
    load_average,
    load_line,
    median_seconds,
    paired_ratio,
    record,
    spread,
    threads_named,
)
from flax import nnx
from speed_isolated import configs as _configs
from speed_isolated import run as run_isolated

from flax_transformer.interop import porting
from flax_transformer.training.malloc import keep_freed_memory
from flax_transformer.training.optim import OptimConfig, make_optimizer
from flax_transformer.training.step import cross_entropy

JAX = "jax (jit)"
WAIT_POLICIES = {"passive": "PASSIVE", "active": "ACTIVE", "default": None}  # None: leave it to libgomp


def _cost(compiled, key: str = "flops") -> float:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0]
    return float(analysis.get(key, float("nan")))


def _flops(compiled) -> float:
    return _cost(compiled, "flops")


def machine_peaks(reps: int = 5) -> tuple[float, float]:
    """(fp32 matmul FLOP/s, memory bandwidth in bytes/s) measured here with XLA: the floors' denominators."""
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x).lower(a).compile()
    flops = 2 * n ** 3 / median_seconds(lambda: jax.block_until_ready(matmul(a)), reps)
    # 256 MB, far beyond the caches, updated in place (donated): a fresh 256 MB output each call
    # would measure the kernel's page faults instead (7 GB/s here, against ~50 in place)
    holder = {"x": jnp.ones((64 * 1024 * 1024,), jnp.float32)}
    scale = jax.jit(lambda x: x * 1.5, donate_argnums=0)

    def run():
        holder["x"] = jax.block_until_ready(scale(holder["x"]))

    bandwidth = 2 * holder["x"].nbytes / median_seconds(run, reps)  # read + write
    return flops, bandwidth


def _rows(key: str, what: str, contenders: dict, reps: int, **costs) -> list[dict]:
    """Time ``contenders`` interleaved; one row per contender, with its ratio to JAX over the rounds."""
    times = interleaved_seconds(contenders, reps)
    rows = []
    for name, seconds in times.items():
        s = spread(seconds)
        row = dict(config=key, what=what, framework=name, seconds=s["median"], median_s=s["median"],
                   p25_s=s["p25"], p75_s=s["p75"], min_s=s["min"], max_s=s["max"], times_s=seconds,
                   flops=costs["flops"])
        if name == JAX:
            row.update(bytes=costs["bytes"])
        if JAX in times:
            ratio = paired_ratio(seconds, times[JAX])
            row.update(ratio=ratio["median"], ratio_p25=ratio["p25"], ratio_p75=ratio["p75"])
        rows.append(row)
    return rows


def bench(key: str, spec: dict, reps: int, compile_torch: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    b, t = spec["b"], spec["t"]
    ids = rng.integers(0, spec["vocab"], (b, t)).astype(np.int64)
    labels = None if spec["labels"] is None else spec["labels"](rng, b, t).astype(np.int64)
    torch_model = spec["build"]().eval()
    flax_model = porting.torch_to_flax(torch_model)
    flax_model.eval()  # no dropout in either, so the two compute the same thing
    tokens = b * t

    # torch: eager, and torch.compile on a copy of its own (own parameters and Adam state)
    tids = torch.from_numpy(ids)
    torch_models = {"torch eager": (torch_model, torch_model)}
    if compile_torch:
        twin = copy.deepcopy(torch_model)
        torch_models["torch.compile"] = (torch.compile(twin), twin)

    def torch_forward(model):
        def run():
            with torch.inference_mode():  # no autograd bookkeeping: the forward pass of inference
                model(tids)
        return run

    def torch_train(model, module):
        opt = torch.optim.Adam(module.parameters(), lr=1e-4)
        tlabels = torch.from_numpy(labels)

        def run():
            opt.zero_grad(set_to_none=True)
            loss = spec["torch_loss"](model(tids), tlabels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()
        return run

    # JAX
    jids = jnp.asarray(ids, jnp.int32)
    graphdef, state = nnx.split(flax_model)

    @jax.jit
    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    fwd = forward.lower(state, jids).compile()
    contenders = {JAX: lambda: jax.block_until_ready(fwd(state, jids))}
    contenders.update({name: torch_forward(model) for name, (model, _) in torch_models.items()})
    rows = _rows(key, "forward", contenders, reps, flops=_flops(fwd), bytes=_cost(fwd, "bytes accessed"))

    if spec["train"]:
        optimizer = nnx.Optimizer(flax_model, make_optimizer(OptimConfig(optimizer="adam", lr=1e-4, clip_norm=1.0)),
                                  wrt=nnx.Param)
        opt_def, opt_state = nnx.split(optimizer)
        jlabels = jnp.asarray(labels, jnp.int32)

        def loss_fn(model, x, y):
            return cross_entropy(model(x), y)

        def step(model_state, opt_state, x, y):
            model = nnx.merge(graphdef, model_state)
            opt = nnx.merge(opt_def, opt_state)
            loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
            opt.update(model, grads)
            return nnx.state(model), nnx.state(opt), loss

        train = jax.jit(step, donate_argnums=(0, 1)).lower(state, opt_state, jids, jlabels).compile()

        # where the time goes: the optimizer update alone (clip + Adam over every parameter), JAX only
        def update_only(model_state, opt_state):
            model = nnx.merge(graphdef, model_state)
            opt = nnx.merge(opt_def, opt_state)
            opt.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
            return nnx.state(model), nnx.state(opt)

        update = jax.jit(update_only).lower(state, opt_state).compile()
        rows += _rows(key, "optimizer update only", {JAX: lambda: jax.block_until_ready(update(state, opt_state))},
                      reps, flops=_flops(update), bytes=_cost(update, "bytes accessed"))

        holder = {"m": jax.tree.map(jnp.copy, state), "o": jax.tree.map(jnp.copy, opt_state)}  # donated each step

        def jax_train():
            holder["m"], holder["o"], loss = train(holder["m"], holder["o"], jids, jlabels)
            jax.block_until_ready(loss)  # one program: its outputs are ready together

        contenders = {JAX: jax_train}
        contenders.update({name: torch_train(model, module) for name, (model, module) in torch_models.items()})
        rows += _rows(key, "train step", contenders, reps, flops=_flops(train), bytes=_cost(train, "bytes accessed"))
    for row in rows:
        row["tokens_per_s"] = tokens / row["seconds"]
        row["gflops_per_s"] = row["flops"] / row["seconds"] / 1e9
    return rows


def settings(kept: bool, threads: int, policy: str, load_start: str) -> str:
    """The settings both frameworks ran under, for the top of the output."""
    xla_threads = threads_named("tf_XLAEigen")  # XLA's CPU pool, started by the first computation
    counted = "" if xla_threads is None else f", {xla_threads} counted"
    if xla_threads is not None and xla_threads != threads:
        counted += f" (WARNING: not the {threads} asked for)"
    malloc = ("flax_transformer.training.malloc.keep_freed_memory (1 arena, mmap and trim thresholds 1 GiB)"
              if kept else "glibc's default")
    jax_precision = jax.config.jax_default_matmul_precision
    return "\n".join([
        f"machine: {cpu_model()}, {cores()} cores; python {sys.version.split()[0]}",
        f"jax {jax.__version__} ({jax.default_backend()}): XLA CPU pool NPROC={os.environ.get('NPROC')}{counted}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        f"torch {torch.__version__}: intra-op threads {torch.get_num_threads()} (OpenMP), inter-op "
        f"{torch.get_num_interop_threads()}, OMP_WAIT_POLICY {policy}",
        f"environment: {env_settings()}",
        f"malloc (both frameworks, one process): {malloc}",
        f"matmul precision: jax {jax_precision!r}, torch float32 {torch.get_float32_matmul_precision()!r} "
        "(fp32 on both sides)",
        load_start,
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    parser.add_argument("--in-process", action="store_true",
                        help="all contenders in this process under shared thread settings (the issue-13 mode); "
                             "by default each runs alone in a process of its own with its framework's defaults")
    parser.add_argument("--rounds", type=int, default=5,
                        help="isolated mode: rounds, each starting one process per contender and config")
    parser.add_argument("--reps", type=int, default=10,
                        help="isolated mode: timed calls per pass in each process; --in-process: interleaved "
                             "rounds (after 3 warm-up calls each)")
    parser.add_argument("--warmup", type=int, default=3, help="isolated mode: untimed calls per pass first")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc as it is (by default every process runs with "
                             "flax_transformer.training.malloc.keep_freed_memory, as the train/ entry points do)")
    parser.add_argument("--threads", type=int, default=None,
                        help="--in-process only: intra-op threads for both torch and XLA (default: the cores available)")
    parser.add_argument("--omp-wait-policy", choices=list(WAIT_POLICIES), default=None,
                        help="--in-process only: OMP_WAIT_POLICY for torch's OpenMP threads: passive (sleep when "
                             "idle, the default), active (spin), default (libgomp's own: spin a while, then sleep)")
    parser.add_argument("--out", type=Path, help="also append each row (isolated: each process's result) to "
                                                 "OUT/results.jsonl")
    args = parser.parse_args(argv)
    if not args.in_process:
        if args.threads is not None or args.omp_wait_policy is not None:
            parser.error("--threads and --omp-wait-policy set shared settings: use them with --in-process "
                         "(alone, each framework keeps its defaults)")
        run_isolated(args)
        return
    args.threads = args.threads or cores()
    args.omp_wait_policy = args.omp_wait_policy or "passive"
    load_start = load_line("start")
    policy = WAIT_POLICIES[args.omp_wait_policy]
    # both read once, when libgomp loads (import torch) and when XLA's CPU client starts
    exec_with_env({"OMP_WAIT_POLICY": policy, "NPROC": str(args.threads)}, os.path.abspath(__file__),
                  sys.argv[1:] if argv is None else list(argv))
    torch.set_num_threads(args.threads)
    kept = False if args.default_malloc else keep_freed_memory()
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 on both sides, as in the parity tests
    peak, bandwidth = machine_peaks()  # also starts XLA's CPU client and its pool
    print(settings(kept, args.threads, policy or "unset (libgomp's default)", load_start))
    print(f"measured here: fp32 matmul {peak / 1e9:.1f} GFLOP/s (2048^3), memory {bandwidth / 1e9:.1f} GB/s "
          "(256 MB scale)\n")
    print(f"{args.reps} interleaved rounds per pass; times in ms; ratio = torch time / JAX time in the same round, "
          "median [IQR] over rounds\n")
    configs = _configs()
    print("| config | pass | framework | median ms | IQR ms | min ms | tokens/s | GFLOP/s | time / JAX time "
          "| floor ms (of JAX) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in args.config:
        for row in bench(key, configs[key], args.reps, not args.no_compile):
            floor = ""
            if "bytes" in row:  # JAX rows: the larger of compute time at peak and traffic time at full bandwidth
                floor_s = max(row["flops"] / peak, row["bytes"] / bandwidth)
                floor = f"{floor_s * 1e3:.1f} ({floor_s / row['seconds']:.0%})"
            ratio = "" if row["framework"] == JAX else \
                f"{row['ratio']:.2f}x [{row['ratio_p25']:.2f}-{row['ratio_p75']:.2f}]"
            print(f"| {key}: {configs[key]['name']} | {row['what']} | {row['framework']} | "
                  f"{row['median_s'] * 1e3:.1f} | {row['p25_s'] * 1e3:.1f}-{row['p75_s'] * 1e3:.1f} | "
                  f"{row['min_s'] * 1e3:.1f} | {row['tokens_per_s']:,.0f} | {row['gflops_per_s']:.1f} | "
                  f"{ratio} | {floor} |", flush=True)
            if args.out is not None:
                record(args.out, dict(row, load=load_average(), threads=args.threads, omp_wait_policy=policy,
                                      malloc_kept=kept), echo=False)
    print("\n" + load_line("end", warn=False) + " (this run's own threads included)")


if __name__ == "__main__":
    main()
