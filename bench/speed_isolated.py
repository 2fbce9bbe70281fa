"""``bench/speed.py``'s headline mode: each framework alone, in a process of its own, with its own defaults.

    python bench/speed.py [--config a b c] [--rounds 5] [--reps 10] [--warmup 3] [--no-compile]
                          [--default-malloc] [--out DIR]

Why (issue 21, item 7). ``--in-process`` runs JAX and torch in one process under shared
settings: torch's OpenMP threads and XLA's pool share the cores, libgomp's spinning threads
slow torch badly beside XLA's pool, and ``OMP_WAIT_POLICY=PASSIVE`` costs torch about 1.4x on an
idle machine. Neither is how a torch user runs torch. Here every contender (JAX jit, torch
eager, ``torch.compile``) runs alone:

* one process per contender, configuration and round, started with the thread settings
  stripped from the environment (``NPROC``, ``XLA_FLAGS``, ``OMP_*``, ``GOMP_SPINCOUNT``,
  ``MKL_NUM_THREADS``, ``KMP_BLOCKTIME``; the stripped ones are printed): no forced thread
  count, no wait policy, each framework's defaults. What was in effect is read back in the
  process and printed (``torch.get_num_threads()``, its parallel backend, ``OMP_WAIT_POLICY``;
  ``XLA_FLAGS``, ``NPROC`` and the ``tf_XLAEigen`` threads XLA started);
* the same allocator setting for all: ``flax_transformer.training.malloc.keep_freed_memory``
  in every process (loaded by file path, so torch's processes never import JAX), unless
  ``--default-malloc``;
* fp32 on both sides: JAX's matmul precision "highest" (torch's float32 default is "highest");
* the processes alternate round by round, the order rotated each round (JAX, eager, compile;
  eager, compile, JAX; ...); this parent only waits;
* each process builds the model (``torch.manual_seed(0)``; JAX ports those weights), then per
  pass (forward, then train step) runs ``--warmup`` untimed calls (compilation, caches) and
  ``--reps`` timed ones (``time.perf_counter`` around a call that returns when the result is
  ready; garbage collector off), then measures its framework's matmul peak, and prints one
  JSON line. The work is the in-process mode's: JAX's jitted train step (loss, grads, the
  training library's clip + Adam, one program, state donated) and jitted forward; torch's
  forward under ``inference_mode``, its train step zero_grad, loss, backward, clip_grad_norm_,
  Adam.

Reported per contender and pass: median, IQR (p25-p75) and min over all timed calls of all
rounds; per torch contender the torch / JAX ratio of each round (the medians of the two
processes of that round, run minutes apart at most), its median and IQR over the rounds; the
roofline fraction. Also the versions and the load average at start and end.

FLOPs (``matmul_flops``): the model's matmul FLOPs, counted from its shapes, the same number for
every framework::

    forward = 2 * sum over the Linear layers used (rows * in * out)
              + 4 * L * B * T^2 * W          (q k^T and attention-weights v: L attention layers,
                                              width W = heads * head width, full T x T scores even
                                              when causal, as both frameworks compute them)
    train step = 3 * forward                  (the backward's two matmuls per forward matmul)

rows = B*T for a per-token layer, B for a per-sequence one (CTransformer's ``toprobs`` after
pooling); BERT's pooler is not in the forward. Not counted: embedding lookups and their
gradient, norms, softmax, the loss, clipping, Adam. (a) CTransformer: 3 blocks of 12 e^2 (q, k,
v, unify, 4e feed-forward), e = 128: 2*1024*589,824 + 4*3*4*256^2*128 = 1.21 + 0.40 = 1.61
GFLOP forward, 4.83 train. (b) GPT: 4 layers of 3 d^2 (q, k, v; no output projection) + 2 d d_ff,
lm head d*V: 2*2048*(2,883,584 + 2,560,000) + 4*4*16*128^2*256 = 22.30 + 1.07 = 23.37 GFLOP
forward, 70.1 train.

Roofline fraction = (FLOPs / median time) / peak. Peak: the best of ``PEAK_REPS`` fp32 matmuls of
``PEAK_N`` x ``PEAK_N`` in each process, after its timed passes, with its framework's defaults
(XLA in JAX's processes; torch.mm and numpy's BLAS in torch's), the median over processes per
library; the machine's peak is the largest of the three, and the table says which.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import cores, cpu_model, load_average, load_line, paired_ratio, record, spread, threads_named

JAX, EAGER, COMPILE = "jax (jit)", "torch eager", "torch.compile"
CONTENDERS = (JAX, EAGER, COMPILE)
PASSES = ("forward", "train step")
STRIPPED_ENV = ("NPROC", "XLA_FLAGS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND",
                "OMP_PLACES", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_BLOCKTIME", "_BENCHLIB_REEXEC")
RESULT = "SPEED_ISOLATED_RESULT "  # the worker's line on stdout
PEAK_N, PEAK_REPS = 4096, 3
GOAL = 1.3  # issue 21: JAX's train step >= 1.3x both torch contenders on (a) and (b)
ROOT = Path(__file__).resolve().parents[1]


def configs():
    """The benchmark's configurations (issue 6); imports torch and the reference models, never JAX."""
    import torch.nn.functional as F

    from flax_transformer.models.configs import EncoderConfig
    from torch_reference.encoder import TransformerEncoder
    from torch_reference.former import CTransformer
    from torch_reference.gpt import GPTTransformer

    def classify_loss_torch(out, labels):
        return F.nll_loss(out, labels)

    def lm_loss_torch(out, labels):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1))

    return {
        "a": dict(name="CTransformer emb128 h8 d3 len256 b4 V50k", train=True, b=4, t=256, vocab=50_000,
                  build=lambda: CTransformer(128, 8, 3, 256, 50_000, 2, max_pool=True),
                  labels=lambda rng, b, t: rng.integers(0, 2, b), torch_loss=classify_loss_torch,
                  attention=(3, 128), per_sequence=("toprobs",), unused=()),
        "b": dict(name="GPTTransformer d256 L4 len128 b16 V10k", train=True, b=16, t=128, vocab=10_000,
                  build=lambda: GPTTransformer(4, 256, 1024, 4, 10_000, 128, dropout=0.0),
                  labels=lambda rng, b, t: rng.integers(0, 10_000, (b, t)), torch_loss=lm_loss_torch,
                  attention=(4, 256), per_sequence=(), unused=()),
        "c": dict(name="BERT-base encoder len128 b8 (forward)", train=False, b=8, t=128, vocab=30_522,
                  build=lambda: TransformerEncoder(EncoderConfig.bert(EncoderConfig().__dict__)),
                  labels=None, torch_loss=None, attention=(12, 768), per_sequence=(), unused=("pooler",)),
    }


def matmul_flops(spec: dict, model) -> float:
    """The forward's matmul FLOPs of ``model`` (a torch module) for ``spec``: the formula of the docstring."""
    from torch import nn

    b, t = spec["b"], spec["t"]
    total = 0
    for name, module in model.named_modules():
        # torch's nn.Linear (weight) and notebook 002's own Linear (matrix, (in, out)): in * out weights
        if isinstance(module, nn.Linear):
            weights = module.weight.numel()
        elif type(module).__name__ == "Linear" and isinstance(getattr(module, "matrix", None), nn.Parameter):
            weights = module.matrix.numel()
        else:
            continue
        if name.split(".")[-1] not in spec["unused"]:
            rows = b if name.split(".")[-1] in spec["per_sequence"] else b * t
            total += 2 * rows * weights
    layers, width = spec["attention"]
    return float(total + 4 * layers * b * t * t * width)


# ----------------------------------------------------------------------------- one process, one contender


def _keep_freed_memory() -> bool:
    """``flax_transformer.training.malloc.keep_freed_memory()``, loaded by path: the package would import JAX."""
    path = ROOT / "flax_transformer" / "training" / "malloc.py"
    spec = importlib.util.spec_from_file_location("_speed_isolated_malloc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.keep_freed_memory()


def _timed(fn, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    gc.collect()
    gc.disable()
    try:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def _best_flops(matmul, n: int) -> float:
    """Best FLOP/s of ``PEAK_REPS`` calls of ``matmul`` (an n x n x n product that blocks), after one untimed."""
    matmul()
    return max(2 * n ** 3 / t for t in _timed(matmul, 0, PEAK_REPS))


def _inputs(spec: dict):
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    b, t = spec["b"], spec["t"]
    ids = rng.integers(0, spec["vocab"], (b, t)).astype(np.int64)
    labels = None if spec["labels"] is None else spec["labels"](rng, b, t).astype(np.int64)
    return ids, labels, spec["build"]().eval()


def _torch_worker(spec: dict, contender: str, warmup: int, reps: int) -> dict:
    import numpy as np
    import torch

    ids, labels, model = _inputs(spec)
    module = model
    if contender == COMPILE:
        model = torch.compile(model)
    tids = torch.from_numpy(ids)

    def forward():
        with torch.inference_mode():
            model(tids)

    times = {"forward": _timed(forward, warmup, reps)}
    if spec["train"]:
        opt = torch.optim.Adam(module.parameters(), lr=1e-4)
        tlabels = torch.from_numpy(labels)

        def train():
            opt.zero_grad(set_to_none=True)
            loss = spec["torch_loss"](model(tids), tlabels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()

        times["train step"] = _timed(train, warmup, reps)
    info = torch.__config__.parallel_info()
    backend = next((line.split(":", 1)[1].strip() for line in info.splitlines() if "parallel backend" in line), "?")
    threads = dict(get_num_threads=torch.get_num_threads(), get_num_interop_threads=torch.get_num_interop_threads(),
                   backend=backend, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "unset"),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "unset"))
    a = torch.randn(PEAK_N, PEAK_N)
    peaks = {"torch": _best_flops(lambda: torch.mm(a, a), PEAK_N)}
    x = np.random.default_rng(0).standard_normal((PEAK_N, PEAK_N), dtype=np.float32)
    peaks["numpy"] = _best_flops(lambda: x @ x, PEAK_N)
    return dict(times=times, threads=threads, peaks=peaks, flops_forward=matmul_flops(spec, module),
                versions=dict(torch=torch.__version__, numpy=np.__version__))


def jax_programs(spec: dict, *, parts: bool = False) -> dict:
    """JAX's programs for ``spec``, compiled, as calls that block: "forward" and "train step" (if it trains).

    Also the forward's matmul FLOPs (``matmul_flops``), XLA's cost analysis of each program
    ("xla_flops") and the compiled train step ("train_compiled"). ``parts``: also "grad" (loss
    and gradients, no update) and "update" (clip + Adam alone), for ``bench/step_profile.py``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from flax_transformer.interop import porting
    from flax_transformer.training.optim import OptimConfig, make_optimizer
    from flax_transformer.training.step import cross_entropy

    jax.config.update("jax_default_matmul_precision", "highest")
    ids, labels, torch_model = _inputs(spec)
    flops_forward = matmul_flops(spec, torch_model)
    flax_model = porting.torch_to_flax(torch_model)
    flax_model.eval()
    del torch_model
    jids = jnp.asarray(ids, jnp.int32)
    graphdef, state = nnx.split(flax_model)

    @jax.jit
    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    fwd = forward.lower(state, jids).compile()
    programs = {"forward": lambda: jax.block_until_ready(fwd(state, jids)), "flops_forward": flops_forward,
                "xla_flops": {"forward": _xla_flops(fwd)}}
    if not spec["train"]:
        return programs
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
    holder = {"m": jax.tree.map(jnp.copy, state), "o": jax.tree.map(jnp.copy, opt_state)}  # donated each step

    def train_step():
        holder["m"], holder["o"], loss = train(holder["m"], holder["o"], jids, jlabels)
        jax.block_until_ready(loss)  # one program: its outputs are ready together

    programs.update({"train step": train_step, "train_compiled": train})
    programs["xla_flops"]["train step"] = _xla_flops(train)
    if parts:
        def grads_only(model_state, x, y):
            return nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, model_state), x, y)

        def update_only(model_state, opt_state):
            model = nnx.merge(graphdef, model_state)
            opt = nnx.merge(opt_def, opt_state)
            opt.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
            return nnx.state(model), nnx.state(opt)

        grad = jax.jit(grads_only).lower(state, jids, jlabels).compile()
        update = jax.jit(update_only).lower(state, opt_state).compile()
        programs["grad"] = lambda: jax.block_until_ready(grad(state, jids, jlabels))
        programs["update"] = lambda: jax.block_until_ready(update(state, opt_state))
    return programs


def _jax_worker(spec: dict, warmup: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import jaxlib
    from flax import __version__ as flax_version

    programs = jax_programs(spec)
    times = {what: _timed(programs[what], warmup, reps) for what in PASSES if what in programs}
    a = jnp.asarray(jax.random.normal(jax.random.key(0), (PEAK_N, PEAK_N), jnp.float32))
    matmul = jax.jit(lambda x: x @ x).lower(a).compile()
    peaks = {"xla": _best_flops(lambda: jax.block_until_ready(matmul(a)), PEAK_N)}
    threads = dict(tf_XLAEigen=threads_named("tf_XLAEigen"), NPROC=os.environ.get("NPROC", "unset"),
                   XLA_FLAGS=os.environ.get("XLA_FLAGS", "unset"), devices=str(jax.devices()))
    return dict(times=times, threads=threads, peaks=peaks, flops_forward=programs["flops_forward"],
                xla_flops=programs["xla_flops"],
                versions=dict(jax=jax.__version__, jaxlib=jaxlib.__version__, flax=flax_version))


def _xla_flops(compiled) -> float:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0]
    return float(analysis.get("flops", float("nan")))


def worker(task: dict) -> dict:
    """Run one contender on one configuration in this process; the result as a dict (printed as JSON)."""
    load_start = load_average()
    started = time.perf_counter()
    kept = False if task["default_malloc"] else _keep_freed_memory()  # before any thread starts
    spec = configs()[task["config"]]
    if task["contender"] == JAX:
        result = _jax_worker(spec, task["warmup"], task["reps"])
    else:
        result = _torch_worker(spec, task["contender"], task["warmup"], task["reps"])
    result["threads"]["threads_in_process"] = threads_named("")
    result.update(task, config_name=spec["name"], malloc_kept=kept, load_start=load_start, load_end=load_average(),
                  wall_s=time.perf_counter() - started, pid=os.getpid(),
                  python=sys.version.split()[0])
    return result


# ----------------------------------------------------------------------------- the parent


def _environment() -> tuple[dict, list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
    return env, sorted(k for k in STRIPPED_ENV if k in os.environ and k != "_BENCHLIB_REEXEC")


def _spawn(task: dict, env: dict) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(task)],
                          env=env, capture_output=True, text=True, cwd=ROOT)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    raise RuntimeError(f"{task['contender']} on ({task['config']}) exited {proc.returncode} without a result:\n{tail}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def run(args) -> None:
    """The isolated mode of ``bench/speed.py`` (its ``args``: config, rounds, reps, warmup, no_compile, ...)."""
    env, stripped = _environment()
    contenders = [c for c in CONTENDERS if not (args.no_compile and c == COMPILE)]
    load_start = load_line("start")
    print(load_start)
    print(f"machine: {cpu_model()}, {cores()} cores; each contender alone in a process of its own, "
          f"{args.rounds} rounds x {len(contenders)} contenders x {len(args.config)} configs; per process "
          f"{args.warmup} warm-up + {args.reps} timed calls per pass")
    print(f"stripped from the workers' environment: {', '.join(stripped) or 'nothing (none was set)'}\n", flush=True)
    results = []
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for key in args.config:
            for contender in order:
                task = dict(contender=contender, config=key, round=r, warmup=args.warmup, reps=args.reps,
                            default_malloc=args.default_malloc)
                res = _spawn(task, env)
                results.append(res)
                med = "  ".join(f"{p} {_ms(statistics.median(ts))} ms" for p, ts in res["times"].items())
                print(f"round {r + 1}/{args.rounds} ({key}) {contender:13s} {med}  "
                      f"[process {res['wall_s']:.0f} s, load {res['load_start'][0]:.2f}]", flush=True)
                if args.out is not None:
                    record(args.out, dict(res, mode="isolated"), echo=False)
    load_end = load_line("end", warn=False)
    print()
    print(report(results, args.config, contenders, load_start, load_end, stripped))


def report(results: list[dict], keys, contenders, load_start: str, load_end: str, stripped) -> str:
    """Settings, the markdown table and the goal check, from the workers' results."""
    first = {c: next(r for r in results if r["contender"] == c) for c in contenders}
    versions = {}
    for c in contenders:
        versions.update(first[c]["versions"])
    lines = [f"versions: python {first[contenders[0]]['python']}, "
             + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))]
    for c in contenders:
        mine = [r["threads"] for r in results if r["contender"] == c]
        seen = {json.dumps({k: v for k, v in t.items() if k != "threads_in_process"}, sort_keys=True) for t in mine}
        note = "" if len(seen) == 1 else f" (WARNING: {len(seen)} different settings over the processes)"
        counts = sorted({t["threads_in_process"] for t in mine})
        lines.append(f"threads in effect, {c}: " + ", ".join(f"{k}={v}" for k, v in first[c]["threads"].items()
                                                             if k != "threads_in_process")
                     + f"; threads in the process at its end {counts[0]}"
                     + ("" if len(counts) == 1 else f"-{counts[-1]}")
                     + note)
    kept = {r["malloc_kept"] for r in results}
    lines.append("malloc: " + ("keep_freed_memory in every process" if kept == {True} else
                               "glibc's default" if kept == {False} else f"MIXED {kept}")
                 + f"; environment stripped of: {', '.join(stripped) or 'nothing'}")
    peaks = {}
    for lib in ("xla", "torch", "numpy"):
        values = [r["peaks"][lib] for r in results if lib in r["peaks"]]
        if values:
            peaks[lib] = statistics.median(values)
    best = max(peaks, key=peaks.get)
    peak = peaks[best]
    lines.append(f"fp32 matmul peak ({PEAK_N}^3, best of {PEAK_REPS} per process, median over processes): "
                 + ", ".join(f"{lib} {v / 1e9:.1f} GFLOP/s" for lib, v in peaks.items())
                 + f"; roofline uses {best}'s {peak / 1e9:.1f}")
    lines += [load_start, load_end + " (the benchmark's own process included)", ""]
    lines.append("| config | pass | framework | median ms | IQR ms | min ms | GFLOP/s | roofline | "
                 "torch / JAX per round, median [IQR] |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    goal = []
    for key in keys:
        rows = [r for r in results if r["config"] == key]
        flops_fwd = rows[0]["flops_forward"]
        for what in PASSES:
            if what not in rows[0]["times"]:
                continue
            flops = flops_fwd * (3 if what == "train step" else 1)
            per_round = {c: {r["round"]: statistics.median(r["times"][what]) for r in rows if r["contender"] == c}
                         for c in contenders}
            for c in contenders:
                pooled = [t for r in rows if r["contender"] == c for t in r["times"][what]]
                s = spread(pooled)
                ratio = ""
                if c != JAX and JAX in per_round:
                    common = sorted(set(per_round[c]) & set(per_round[JAX]))
                    pr = paired_ratio([per_round[c][i] for i in common], [per_round[JAX][i] for i in common])
                    ratio = f"{pr['median']:.2f}x [{pr['p25']:.2f}-{pr['p75']:.2f}]"
                    if what == "train step":
                        goal.append((key, c, pr["median"]))
                achieved = flops / s["median"]
                lines.append(f"| {key} | {what} | {c} | {_ms(s['median'])} | {_ms(s['p25'])}-{_ms(s['p75'])} | "
                             f"{_ms(s['min'])} | {achieved / 1e9:.1f} | {achieved / peak:.0%} | {ratio} |")
    lines.append("")
    names = {key: next(r for r in results if r["config"] == key)["config_name"] for key in keys}
    lines.append("configs: " + "; ".join(f"({k}) {n}" for k, n in names.items()))
    lines.append("FLOPs: matmuls counted from the shapes (bench/speed_isolated.py), train step = 3 x forward; "
                 + "; ".join(f"({k}) forward {next(r for r in results if r['config'] == k)['flops_forward'] / 1e9:.2f}"
                             " GFLOP" for k in keys))
    xla = [r for r in results if r["contender"] == JAX]
    if xla:
        lines.append("XLA's own cost analysis, for comparison: " + "; ".join(
            f"({k}) " + ", ".join(f"{p} {v / 1e9:.2f} GFLOP" for p, v in
                                  next(r for r in xla if r["config"] == k)["xla_flops"].items())
            for k in keys))
    if goal:
        held = [f"{c} ({k}) {ratio:.2f}x {'yes' if ratio >= GOAL else 'NO'}" for k, c, ratio in goal]
        lines.append(f"goal (JAX's train step >= {GOAL}x each torch contender, median per-round ratio): "
                     + "; ".join(held) + (" -> holds" if all(r >= GOAL for *_, r in goal) else " -> does not hold"))
    busiest = max(max(r["load_start"][0], r["load_end"][0]) for r in results)
    if busiest > 0.5 * cores():
        lines.append(f"CAUTION: 1-minute load up to {busiest:.1f} on {cores()} cores during the run. Other jobs slow "
                     "torch's default OpenMP threads (which spin, then wait at every barrier for a descheduled "
                     "peer) far more than XLA's pool, and the matmul peak measured under load is low, so the "
                     "ratios and roofline fractions are not those of a quiet machine: rerun there before "
                     "concluding")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        out = worker(json.loads(sys.argv[2]))
        print(RESULT + json.dumps(out), flush=True)
    else:
        sys.exit("run bench/speed.py (this module is its isolated mode and the worker it starts)")
