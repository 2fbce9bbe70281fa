"""Mixture-of-experts speed (issue 33): a Mixtral-shaped model's forward and AdamW train step in JAX
(the experts ``grouped``, ``ragged``, ``blocked``, ``dense``: ``moe.set_experts``) and in transformers 5's
``MixtralForCausalLM`` (eager with ``experts_implementation`` "grouped_mm", its default, or "eager";
and "grouped_mm" under ``torch.compile``).

    python bench/moe_speed.py [--device cpu|gpu] [--dtype fp32|bf16] [--preset cpu|gpu] [--layers N]
                              [--rounds 2] [--reps 5] [--warmup 2] [--jax grouped dense ...]
                              [--torch grouped_mm eager compile] [--out DIR]

How it measures (the machinery of ``bench/speed_isolated.py``):

* one process per framework and round, with the thread settings stripped from the environment
  (each framework's default threading); inside it, that framework's contenders are timed
  alternately call by call (``benchlib.interleaved_seconds``: the order rotated each round of
  calls), so a slow stretch of a shared machine falls on all of them;
* the JAX and torch processes alternate round by round, the order rotated each round; the
  torch / JAX ratios are per round (the medians of the two processes of that round);
* the same weights on both sides: the parent builds ``MixtralForCausalLM`` with
  ``torch.manual_seed(0)`` and saves it; torch loads it with ``from_pretrained``, JAX with
  ``flax_transformer.interop.hf.from_pretrained`` (so both route the tokens alike);
* the train step on both sides: loss = next-token cross-entropy + 0.001 * the load-balancing loss
  (transformers' ``aux_loss``; ``moe.load_balancing_loss``), gradients, clip to norm 1, AdamW
  (lr 1e-4, weight decay 0.01). JAX: one jitted program, the state donated. torch: zero_grad,
  loss, backward, ``clip_grad_norm_``, ``AdamW.step``. Forward: logits (torch under
  ``inference_mode``);
* fp32 means fp32 matmuls: JAX's ``jax_default_matmul_precision="highest"``; on the GPU torch's
  TF32 off (``torch.backends.cuda.matmul.allow_tf32 = False``, cuDNN's too,
  ``set_float32_matmul_precision("highest")``). bf16: parameters and compute in bf16 on both
  sides (JAX ``dtype=param_dtype=bfloat16``; torch ``dtype=torch.bfloat16``); the losses in fp32.

Model FLOPs (the same number for every contender, counted from the shapes; the dense path's
extra work is not counted): per layer 2 N H (q + 2 kv + q) for the projections, 4 B T^2 q for
the scores and their product with v (full T x T), 2 N H E for the router, 2 N k 3 H I for the k
chosen experts; the LM head 2 N H V (N = B T tokens, q = heads x head width, kv = kv heads x
head width). Train step = 3 x forward. Roofline fraction = model FLOPs / (median time x peak),
the peak the best matmul FLOP/s measured in the workers: ``jnp`` (jitted ``x @ x``) and
``torch.mm``, n x n in the compute dtype (n = 4096 on the CPU, 8192 on the GPU), the best of 3
after one untimed, the median over processes, the larger of the two libraries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import cores, cpu_model, interleaved_seconds, load_average, load_line, paired_ratio, record, spread

ROOT = Path(__file__).resolve().parents[1]
RESULT = "MOE_SPEED_RESULT "
PASSES = ("forward", "train step")
JAX_IMPLS = ("grouped", "ragged", "blocked", "dense")
TORCH_IMPLS = ("grouped_mm", "eager", "compile")
STRIPPED_ENV = ("NPROC", "XLA_FLAGS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND",
                "OMP_PLACES", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_BLOCKTIME", "_BENCHLIB_REEXEC")
PRESETS = {  # Mixtral's shape (8 experts, top 2, expert width 3.5 x hidden, 4 query heads per kv head), scaled
    "cpu": dict(hidden=512, inner=1792, experts=8, top_k=2, heads=8, kv_heads=2, layers=2, vocab=2048,
                batch=4, seq=256),
    "gpu": dict(hidden=1024, inner=3584, experts=8, top_k=2, heads=16, kv_heads=4, layers=4, vocab=32000,
                batch=8, seq=1024),
    "tiny": dict(hidden=64, inner=224, experts=8, top_k=2, heads=4, kv_heads=2, layers=1, vocab=256, batch=2,
                 seq=32),  # a smoke test of the script
}
AUX_COEF, LR, WEIGHT_DECAY = 0.001, 1e-4, 0.01
GOAL_EAGER, GOAL_COMPILE = 2.0, 1.0  # issue 33: JAX's train step >= 2x transformers eager, >= torch.compile


def model_flops(s: dict) -> float:
    """The forward's model FLOPs of shape ``s`` (the formula of the docstring)."""
    n, head = s["batch"] * s["seq"], s["hidden"] // s["heads"]
    q, kv = s["heads"] * head, s["kv_heads"] * head
    layer = (2 * n * s["hidden"] * (2 * q + 2 * kv) + 4 * s["batch"] * s["seq"] ** 2 * q
             + 2 * n * s["hidden"] * s["experts"] + 2 * n * s["top_k"] * 3 * s["hidden"] * s["inner"])
    return float(s["layers"] * layer + 2 * n * s["hidden"] * s["vocab"])


def hf_config(s: dict):
    from transformers import MixtralConfig

    return MixtralConfig(hidden_size=s["hidden"], intermediate_size=s["inner"], num_local_experts=s["experts"],
                         num_experts_per_tok=s["top_k"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], num_hidden_layers=s["layers"], vocab_size=s["vocab"],
                         max_position_embeddings=max(4096, s["seq"]), router_aux_loss_coef=AUX_COEF,
                         tie_word_embeddings=False)


def _ids(s: dict):
    import numpy as np

    return np.random.default_rng(0).integers(0, s["vocab"], (s["batch"], s["seq"])).astype(np.int64)


def _timed_peak(matmul, n: int, sync) -> float:
    matmul()
    sync()
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        matmul()
        sync()
        best = max(best, 2 * n ** 3 / (time.perf_counter() - start))
    return best


# ----------------------------------------------------------------------------- JAX's process


def jax_worker(task: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from flax_transformer.interop import hf
    from flax_transformer.models import moe
    from flax_transformer.training.step import cross_entropy

    jax.config.update("jax_default_matmul_precision", "highest")
    if task["device"] == "gpu" and jax.default_backend() != "gpu":
        raise RuntimeError(f"--device gpu, but JAX runs on {jax.default_backend()}: install jax with CUDA")
    s = task["shape"]
    dtype = jnp.bfloat16 if task["dtype"] == "bf16" else jnp.float32
    model = hf.from_pretrained(task["folder"], dtype=dtype, param_dtype=dtype)
    model.eval()  # no dropout; Mixtral's router jitter is 0
    ids = jnp.asarray(_ids(s), jnp.int32)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=WEIGHT_DECAY))

    def loss_fn(m, x):
        logits, router = m(x, output_router_logits=True)
        aux = moe.load_balancing_loss(router, s["experts"], s["top_k"])
        return cross_entropy(logits[:, :-1], x[:, 1:]) + AUX_COEF * aux.astype(jnp.float32)

    fwd, train, info = {}, {}, {}
    for impl in task["impls"]:
        moe.set_experts(model, impl)
        graphdef, state = nnx.split(model)
        forward = jax.jit(lambda st, x, g=graphdef: nnx.merge(g, st)(x)).lower(state, ids).compile()
        fwd[impl] = lambda f=forward, st=state: jax.block_until_ready(f(st, ids))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        opt_def, opt_state = nnx.split(optimizer)

        def step(model_state, opt_state, x, g=graphdef, od=opt_def):
            m, opt = nnx.merge(g, model_state), nnx.merge(od, opt_state)
            loss, grads = nnx.value_and_grad(loss_fn)(m, x)
            opt.update(m, grads)
            return nnx.state(m), nnx.state(opt), loss

        program = jax.jit(step, donate_argnums=(0, 1)).lower(state, opt_state, ids).compile()
        holder = {"m": jax.tree.map(jnp.copy, state), "o": jax.tree.map(jnp.copy, opt_state)}

        def train_step(p=program, h=holder):
            h["m"], h["o"], loss = p(h["m"], h["o"], ids)
            return float(loss)  # blocks: one program, its outputs ready together

        train[impl] = train_step
        info[impl] = dict(first_loss=train_step())
    times = {"forward": interleaved_seconds(fwd, task["reps"], warmup=task["warmup"]),
             "train step": interleaved_seconds(train, task["reps"], warmup=task["warmup"])}
    n = task["peak_n"]
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    mm = jax.jit(lambda x: x @ x).lower(a).compile()
    peak = _timed_peak(lambda: mm(a).block_until_ready(), n, lambda: None)
    return dict(times=times, info=info, peak={"jnp": peak}, device=str(jax.devices()[0]),
                versions=dict(jax=jax.__version__))


# ----------------------------------------------------------------------------- torch's process


def torch_worker(task: dict) -> dict:
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import MixtralForCausalLM

    gpu = task["device"] == "gpu"
    dev = torch.device("cuda" if gpu else "cpu")
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    dtype = torch.bfloat16 if task["dtype"] == "bf16" else torch.float32
    s = task["shape"]
    ids = torch.from_numpy(_ids(s)).to(dev)
    fwd, train, info = {}, {}, {}
    for impl in task["impls"]:
        experts = "grouped_mm" if impl == "compile" else impl
        module = MixtralForCausalLM.from_pretrained(task["folder"], dtype=dtype,
                                                    experts_implementation=experts).to(dev)
        module.train()  # dropout 0 and router jitter 0: the same math as eval
        model = torch.compile(module) if impl == "compile" else module
        opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

        def forward(m=model):
            with torch.inference_mode():
                m(ids)
            sync()

        def train_step(m=model, mod=module, o=opt):
            o.zero_grad(set_to_none=True)
            out = m(ids, output_router_logits=True)
            logits = out.logits[:, :-1].float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            loss = loss + AUX_COEF * out.aux_loss.float()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(mod.parameters(), 1.0)
            o.step()
            sync()
            return float(loss)

        try:
            info[impl] = dict(first_loss=train_step(), experts_implementation=module.config._experts_implementation)
            forward()
        except Exception as exc:  # a contender that cannot run here (torch.compile on a machine without a compiler)
            info[impl] = dict(failed=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        fwd[impl], train[impl] = forward, train_step
    times = {"forward": interleaved_seconds(fwd, task["reps"], warmup=task["warmup"]) if fwd else {},
             "train step": interleaved_seconds(train, task["reps"], warmup=task["warmup"]) if train else {}}
    n = task["peak_n"]
    a = torch.randn(n, n, device=dev, dtype=dtype)
    peak = _timed_peak(lambda: torch.mm(a, a), n, sync)
    threads = dict(get_num_threads=torch.get_num_threads())
    return dict(times=times, info=info, peak={"torch": peak}, threads=threads,
                device=torch.cuda.get_device_name() if gpu else "cpu",
                versions=dict(torch=torch.__version__, transformers=transformers.__version__))


def worker(task: dict) -> dict:
    started, load_start = time.perf_counter(), load_average()
    result = jax_worker(task) if task["framework"] == "jax" else torch_worker(task)
    result.update(task, load_start=load_start, load_end=load_average(), wall_s=time.perf_counter() - started)
    return result


# ----------------------------------------------------------------------------- the parent


def _spawn(task: dict, env: dict, timeout: float | None) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(task)], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    raise RuntimeError(f"the {task['framework']} process exited {proc.returncode} without a result:\n{tail}")


def _name(framework: str, impl: str) -> str:
    if framework == "jax":
        return f"jax {impl}"
    return "torch.compile (grouped_mm)" if impl == "compile" else f"torch eager ({impl})"


def report(results: list[dict], s: dict, args) -> str:
    flops = model_flops(s)
    peaks = {}
    for lib in ("jnp", "torch"):
        values = [r["peak"][lib] for r in results if lib in r["peak"]]
        if values:
            peaks[lib] = statistics.median(values)
    best = max(peaks, key=peaks.get)
    devices = sorted({r["device"] for r in results})
    versions = {}
    for r in results:
        versions.update(r["versions"])
    lines = [f"device: {', '.join(devices)}; {args.dtype}; versions: "
             + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())),
             f"shape: {json.dumps(s)}; model FLOPs: forward {flops / 1e9:.1f} GFLOP, train step {3 * flops / 1e9:.1f}",
             f"{args.dtype} matmul peak ({args.peak_n}^3, best of 3, median over processes): "
             + ", ".join(f"{lib} {v / 1e9:,.1f} GFLOP/s" for lib, v in peaks.items())
             + f"; roofline uses {best}'s"]
    for r in results:
        for impl, i in r["info"].items():
            if "failed" in i:
                lines.append(f"FAILED round {r['round']}: {_name(r['framework'], impl)}: {i['failed']}")
    first = {(r["framework"], impl): i.get("first_loss") for r in results if r["round"] == 0
             for impl, i in r["info"].items()}
    lines.append("first train-step loss (the same weights and batch): "
                 + ", ".join(f"{_name(*key)} {v:.6f}" for key, v in first.items() if v is not None))
    lines += ["", "| pass | contender | median ms | IQR ms | min ms | model GFLOP/s | roofline | "
              "torch eager (grouped_mm) / this | torch.compile / this |", "|---|---|---|---|---|---|---|---|---|"]
    goal = []
    for what in PASSES:
        pass_flops = flops * (3 if what == "train step" else 1)
        per_round = {}  # contender -> {round: median}
        pooled = {}
        for r in results:
            for impl, ts in r["times"][what].items():
                key = _name(r["framework"], impl)
                per_round.setdefault(key, {})[r["round"]] = statistics.median(ts)
                pooled.setdefault(key, []).extend(ts)
        for key, ts in pooled.items():
            sp = spread(ts)
            cells = []
            for ref in ("torch eager (grouped_mm)", "torch.compile (grouped_mm)"):
                if ref not in per_round or key == ref:
                    cells.append("")
                    continue
                common = sorted(set(per_round[ref]) & set(per_round[key]))
                pr = paired_ratio([per_round[ref][i] for i in common], [per_round[key][i] for i in common])
                cells.append(f"{pr['median']:.2f}x [{pr['p25']:.2f}-{pr['p75']:.2f}]")
                if what == "train step" and key == "jax grouped":
                    goal.append((ref, pr["median"]))
            achieved = pass_flops / sp["median"]
            lines.append(f"| {what} | {key} | {sp['median'] * 1e3:,.1f} | {sp['p25'] * 1e3:,.1f}-"
                         f"{sp['p75'] * 1e3:,.1f} | {sp['min'] * 1e3:,.1f} | {achieved / 1e9:,.1f} | "
                         f"{achieved / peaks[best]:.1%} | {cells[0]} | {cells[1]} |")
    lines.append("")
    lines.append("ratios: per round, the median of the torch process over the median of the JAX process (or of "
                 "two contenders of one process), then the median [IQR] over rounds; > 1 means this one is faster")
    if goal:
        need = {"torch eager (grouped_mm)": GOAL_EAGER, "torch.compile (grouped_mm)": GOAL_COMPILE}
        lines.append("goal (issue 33: jax grouped's train step >= 2x torch eager, >= 1x torch.compile): "
                     + "; ".join(f"{ref} {ratio:.2f}x (need {need[ref]:.0f}x) {'yes' if ratio >= need[ref] else 'NO'}"
                                 for ref, ratio in goal))
    busiest = max(max(r["load_start"][0], r["load_end"][0]) for r in results if r["load_start"])
    if args.device == "cpu" and busiest > 0.5 * cores():
        lines.append(f"CAUTION: 1-minute load up to {busiest:.1f} on {cores()} cores: the machine was shared, "
                     "times and peaks are noisy (the per-round ratios less so)")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--preset", choices=tuple(PRESETS), default=None, help="the shape (default: the device's)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="timed calls per contender and pass in each process")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--jax", nargs="*", choices=JAX_IMPLS, default=None,
                   help="JAX's experts (default: grouped dense; on the GPU grouped (= ragged there) blocked dense)")
    p.add_argument("--torch", nargs="*", choices=TORCH_IMPLS, default=list(TORCH_IMPLS))
    p.add_argument("--timeout", type=float, default=None, help="seconds one process may run")
    p.add_argument("--out", type=Path, default=None, help="append each process's result to DIR/results.jsonl")
    args = p.parse_args(argv)
    s = dict(PRESETS[args.preset or args.device])
    s.update({k: v for k, v in (("layers", args.layers), ("batch", args.batch)) if v is not None})
    jax_impls = args.jax if args.jax is not None else (
        ["grouped", "blocked", "dense"] if args.device == "gpu" else ["grouped", "dense"])
    args.peak_n = 8192 if args.device == "gpu" else 4096
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    print(load_line("start"))
    print(f"machine: {cpu_model()}, {cores()} cores; {args.rounds} rounds, a JAX process ({', '.join(jax_impls)}) "
          f"and a torch process ({', '.join(args.torch)}) each, {args.warmup} warm-up + {args.reps} timed calls "
          "per contender and pass, the contenders of a process alternated call by call", flush=True)
    import torch

    torch.manual_seed(0)
    from transformers import MixtralForCausalLM

    frameworks = [f for f, impls in (("jax", jax_impls), ("torch", args.torch)) if impls]
    results = []
    with tempfile.TemporaryDirectory() as folder:
        MixtralForCausalLM(hf_config(s)).save_pretrained(folder)
        # round 2's JAX process reuses round 1's programs (torch's inductor has its own cache)
        env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(folder, "jax_cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        for r in range(args.rounds):
            for framework in frameworks[r % len(frameworks):] + frameworks[:r % len(frameworks)]:
                task = dict(framework=framework, impls=jax_impls if framework == "jax" else args.torch,
                            round=r, shape=s, folder=folder, device=args.device, dtype=args.dtype, reps=args.reps,
                            warmup=args.warmup, peak_n=args.peak_n)
                res = _spawn(task, env, args.timeout)
                results.append(res)
                med = "; ".join(f"{what} " + ", ".join(f"{impl} {statistics.median(ts) * 1e3:,.0f} ms"
                                                      for impl, ts in res["times"][what].items())
                                for what in PASSES)
                print(f"round {r + 1}/{args.rounds} {framework}: {med} [process {res['wall_s']:.0f} s]", flush=True)
                if args.out is not None:
                    record(args.out, res, echo=False)
    print(load_line("end", warn=False))
    print()
    print(report(results, s, args))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(RESULT + json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
    else:
        main()
