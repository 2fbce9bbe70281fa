"""The processes of ``bench/gpu.py``: one contender of one section each, alone in its process.

    python bench/gpu_workers.py TASK_JSON      (gpu.py starts them; the result is one line on stdout)

A task names its section (train, decode, bisect), its contender and the model folder the parent
wrote (a random transformers model in bf16). JAX's contenders load it with
``flax_transformer.interop.hf.from_pretrained`` in bf16 (parameters and compute), torch's with
``transformers.AutoModelForCausalLM.from_pretrained(dtype=torch.bfloat16)``. What each measures
and how is ``gpu.py``'s docstring.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from benchlib import load_average
from gpu import COMPILE, JAX, RESULT
from moe_speed import _timed_peak
from speed_isolated import _timed

LR, WEIGHT_DECAY = 1e-4, 0.01


def token_ids(task: dict, length: int) -> np.ndarray:
    """The batch's ids (seed 0): the same for every contender."""
    return np.random.default_rng(0).integers(0, task["shape"]["vocab"], (task["batch"], length)).astype(np.int64)


def _jax_device(device: str):
    import jax

    if device == "cuda" and jax.default_backend() != "gpu":
        raise RuntimeError(f"--device cuda, but JAX runs on {jax.default_backend()}: install jax with its CUDA plugin")
    return jax.devices()[0]


def _jax_model(task: dict):
    import jax.numpy as jnp

    from flax_transformer.interop import hf

    return hf.from_pretrained(task["folder"], dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _jax_peak(n: int) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x).lower(a).compile()
    return _timed_peak(lambda: mm(a).block_until_ready(), n, lambda: None)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def jax_train(task: dict) -> dict:
    """JAX's train step: one jitted program (loss, gradients, clip, AdamW), state donated."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from flax_transformer.models.attention import set_attention
    from flax_transformer.training.step import cross_entropy

    device = _jax_device(task["device"])
    model = _jax_model(task)
    x = jnp.asarray(token_ids(task, task["seq"]), jnp.int32)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=WEIGHT_DECAY))

    def loss_fn(m, x):
        return cross_entropy(m(x)[:, :-1], x[:, 1:])

    tried = []
    for attention in ("cudnn", "xla") if task["device"] == "cuda" else ("xla",):
        set_attention(model, attention)  # a static attribute: split after it
        graphdef, state = nnx.split(model)
        opt_def, opt_state = nnx.split(nnx.Optimizer(model, tx, wrt=nnx.Param))

        def step(model_state, opt_state, x, g=graphdef, od=opt_def):
            m, opt = nnx.merge(g, model_state), nnx.merge(od, opt_state)
            loss, grads = nnx.value_and_grad(loss_fn)(m, x)
            opt.update(m, grads)
            return nnx.state(m), nnx.state(opt), loss

        started = time.perf_counter()
        try:
            program = jax.jit(step, donate_argnums=(0, 1)).lower(state, opt_state, x).compile()
            holder = {"m": jax.tree.map(jnp.copy, state), "o": jax.tree.map(jnp.copy, opt_state)}

            def train_step(p=program, h=holder):
                h["m"], h["o"], loss = p(h["m"], h["o"], x)
                return float(loss)  # blocks: one program, its outputs ready together

            first = train_step()
        except Exception as exc:  # cuDNN's kernel refused for this model: XLA's fused attention instead
            tried.append(f"{attention} failed ({_first_line(exc)})")
            continue
        first_call = time.perf_counter() - started
        break
    else:
        raise RuntimeError("no attention implementation compiled: " + "; ".join(tried))
    times = _timed(train_step, task["warmup"], task["steps"])
    return dict(times=times, first_loss=first, first_call_s=first_call, attention=" ".join([attention, *tried]),
                device_name=device.device_kind, peak_flops=_jax_peak(task["peak_n"]), versions=_jax_versions())


def _jax_versions() -> dict:
    import flax
    import jax

    return dict(jax=jax.__version__, flax=flax.__version__)


def _torch(task: dict):
    import torch

    cuda = task["device"] == "cuda"
    return torch, torch.device("cuda" if cuda else "cpu"), (torch.cuda.synchronize if cuda else (lambda: None))


def _torch_model(task: dict, dev):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(task["folder"], dtype=torch.bfloat16).to(dev)


def _torch_info(task: dict, torch, dev, sync) -> dict:
    import transformers

    a = torch.randn(task["peak_n"], task["peak_n"], device=dev, dtype=torch.bfloat16)
    return dict(peak_flops=_timed_peak(lambda: torch.mm(a, a), task["peak_n"], sync),
                device_name=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                threads=torch.get_num_threads(),
                versions=dict(torch=torch.__version__, transformers=transformers.__version__))


def torch_train(task: dict) -> dict:
    """torch's train step, eager or the model under ``torch.compile``: zero_grad, loss, backward, clip, AdamW."""
    import torch.nn.functional as F

    torch, dev, sync = _torch(task)
    module = _torch_model(task, dev)
    module.train()  # dropout 0
    compiled = task["contender"] == COMPILE
    model = torch.compile(module, backend=task["compile_backend"]) if compiled else module
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x = torch.from_numpy(token_ids(task, task["seq"])).to(dev)

    def train_step():
        opt.zero_grad(set_to_none=True)
        logits = model(x).logits[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        sync()
        return float(loss)

    started = time.perf_counter()
    first = train_step()
    first_call = time.perf_counter() - started
    times = _timed(train_step, task["warmup"], task["steps"])
    attention = module.config._attn_implementation + (f", backend {task['compile_backend']}" if compiled else "")
    return dict(times=times, first_loss=first, first_call_s=first_call, attention=attention,
                **_torch_info(task, torch, dev, sync))


def jax_decode(task: dict) -> dict:
    """``generate`` (greedy, its key/value cache, one compiled loop) on the prompt; the new tokens."""
    from flax_transformer.models.generate import generate

    device = _jax_device(task["device"])
    model = _jax_model(task)
    prompt = token_ids(task, task["prompt"])

    def call():
        return np.asarray(generate(model, prompt, task["new"], greedy=True))

    started = time.perf_counter()
    tokens = call()
    first_call = time.perf_counter() - started
    times = _timed(call, task["warmup"], task["reps"])
    return dict(times=times, tokens=tokens.tolist(), first_call_s=first_call, device_name=device.device_kind,
                cache="the library's: key/value heads only, allocated once (prompt bucket + new tokens)",
                versions=_jax_versions())


def torch_decode(task: dict) -> dict:
    """``transformers.generate(do_sample=False)`` with its default cache (the class read back)."""
    torch, dev, sync = _torch(task)
    module = _torch_model(task, dev).eval()
    prompt = torch.from_numpy(token_ids(task, task["prompt"])).to(dev)

    def call(**kw):
        with torch.inference_mode():
            out = module.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=task["new"], eos_token_id=None, pad_token_id=0, **kw)
        sync()
        return out

    started = time.perf_counter()
    first = call(return_dict_in_generate=True)
    first_call = time.perf_counter() - started
    times = _timed(call, task["warmup"], task["reps"])
    return dict(times=times, tokens=first.sequences[:, task["prompt"]:].cpu().numpy().tolist(), first_call_s=first_call,
                cache=f"transformers' default: {type(_cache_of(first)).__name__}",
                **_torch_info(task, torch, dev, sync))


def _cache_of(output):
    """The cache a ``generate`` call returned (``cache`` in newer transformers, ``past_key_values`` before)."""
    cache = getattr(output, "cache", None)
    return output.past_key_values if cache is None else cache


def record_trace(task: dict) -> dict:
    """The float64 reference and the bf16 torch run of the torch twin, recorded on the CPU into a trace."""
    from flax_transformer.interop import hf
    from flax_transformer.verification import trace

    torch_model = hf.torch_from_pretrained(task["folder"])  # float32 holding the folder's bf16 values exactly
    trace.record(torch_model, (token_ids(task, task["seq"]),), task["trace"], precision="bf16")
    path = Path(task["trace"])
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
    return dict(trace_bytes=size)


def bisect_trace(task: dict) -> dict:
    """The bf16 JAX model bisected against the trace, on this process's device, torch not imported."""
    from flax_transformer.verification.bisect import bisect

    _jax_device(task["device"])
    report = bisect(task["trace"], _jax_model(task))
    rows = {row.path: row for row in report.rows}
    out, named = rows.get(""), rows.get(report.first_divergent_path)

    def line(where, row):
        if row is None or row.jax_err is None or row.budget is None:
            return f"{where}: not compared"
        return (f"{where}: JAX error {row.jax_err:.2e}, {row.jax_err / row.budget:.2g} x its budget "
                f"{row.budget:.2e} ({row.precision}'s rule)")

    budget_line = line("model output", out) + ("" if named is None or named is out else
                                               "; " + line(report.first_divergent, named))
    what = (f"{task['model']} shape, {task['layers']} layers, {task['batch']} x {task['seq']} tokens, "
            f"bf16 JAX on {task['device']} against the float64 CPU trace")
    return dict(report=dict(what=what, passed=report.passed, first_divergent=report.first_divergent,
                            budget=None if named is None else named.budget,
                            jax_err=None if named is None else named.jax_err,
                            model_budget=None if out is None else out.budget,
                            model_jax_err=None if out is None else out.jax_err, budget_line=budget_line,
                            torch_imported="torch" in sys.modules, summary=report.summary()))


WORKERS = {("train", JAX): jax_train, ("decode", JAX): jax_decode, ("decode", "transformers"): torch_decode}


def work(task: dict) -> dict:
    """Run ``task`` in this process; its result (the parent adds the task's own fields)."""
    started, load_start = time.perf_counter(), load_average()
    if task["section"] == "bisect":
        fn = record_trace if task["contender"].startswith("record") else bisect_trace
    else:
        fn = WORKERS.get((task["section"], task["contender"]), torch_train)
    result = fn(task)
    result.update(wall_s=time.perf_counter() - started, load_start=load_start, load_end=load_average(),
                  pid=os.getpid(), python=sys.version.split()[0])
    return result


if __name__ == "__main__":
    print(RESULT + json.dumps(work(json.loads(sys.argv[1]))), flush=True)
