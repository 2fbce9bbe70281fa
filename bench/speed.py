"""JAX against PyTorch, side by side, in one process: training step and forward pass.

    python bench/speed.py [--config a b c] [--reps 10] [--no-compile]

Configurations (issue 6):
  a  notebook 000's CTransformer: emb 128, 8 heads, depth 3, length 256, batch 4, vocab 50k (train step)
  b  a GPT (notebook 002's GPTTransformer): d 256, 4 layers, 4 heads, d_ff 1024, length 128, batch 16,
     vocab 10k (train step)
  c  BERT-base shape (12 layers, 768 wide, 12 heads), length 128, batch 8, forward only (inference)

For each: JAX's jitted train step (loss, grads, the Adam update of the training library, one
compiled program, state donated) and jitted forward; torch eager and ``torch.compile``
(same model, ported weights, Adam). Compilation and warm-up are excluded (3 untimed runs),
then the median of ``--reps`` timed runs is reported with tokens/s, the JAX/torch ratio
and the achieved FLOP/s (FLOPs from XLA's cost analysis of the compiled JAX program, used
for both frameworks).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from flax import nnx

from benchlib import median_seconds

from flax_transformer import porting
from flax_transformer.training.malloc import keep_freed_memory
from flax_transformer.training.optim import OptimConfig, make_optimizer
from flax_transformer.training.step import cross_entropy


def _configs():
    from torch_reference.encoder import TransformerEncoder
    from torch_reference.former import CTransformer
    from torch_reference.gpt import GPTTransformer

    from flax_transformer.configs import EncoderConfig

    def classify_loss_torch(out, labels):
        return F.nll_loss(out, labels)

    def lm_loss_torch(out, labels):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1))

    return {
        "a": dict(name="CTransformer emb128 h8 d3 len256 b4 V50k", train=True, b=4, t=256, vocab=50_000,
                  build=lambda: CTransformer(128, 8, 3, 256, 50_000, 2, max_pool=True),
                  labels=lambda rng, b, t: rng.integers(0, 2, b), torch_loss=classify_loss_torch),
        "b": dict(name="GPTTransformer d256 L4 len128 b16 V10k", train=True, b=16, t=128, vocab=10_000,
                  build=lambda: GPTTransformer(4, 256, 1024, 4, 10_000, 128, dropout=0.0),
                  labels=lambda rng, b, t: rng.integers(0, 10_000, (b, t)), torch_loss=lm_loss_torch),
        "c": dict(name="BERT-base encoder len128 b8 (forward)", train=False, b=8, t=128, vocab=30_522,
                  build=lambda: TransformerEncoder(EncoderConfig.bert(EncoderConfig().__dict__)),
                  labels=None, torch_loss=None),
    }


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
    rows = []

    # --------------------------------------------------------------- JAX
    jids = jnp.asarray(ids, jnp.int32)
    graphdef, state = nnx.split(flax_model)

    @jax.jit
    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    fwd = forward.lower(state, jids).compile()
    fwd_flops, fwd_bytes = _flops(fwd), _cost(fwd, "bytes accessed")
    seconds = median_seconds(lambda: jax.block_until_ready(fwd(state, jids)), reps)
    rows.append(dict(config=key, what="forward", framework="jax (jit)", seconds=seconds, flops=fwd_flops,
                     bytes=fwd_bytes))
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
        train_flops, train_bytes = _flops(train), _cost(train, "bytes accessed")

        # where the time goes: the optimizer update alone (clip + Adam over every parameter)
        def update_only(model_state, opt_state):
            model = nnx.merge(graphdef, model_state)
            opt = nnx.merge(opt_def, opt_state)
            opt.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
            return nnx.state(model), nnx.state(opt)

        update = jax.jit(update_only).lower(state, opt_state).compile()
        seconds = median_seconds(lambda: jax.block_until_ready(update(state, opt_state)), reps)
        rows.append(dict(config=key, what="optimizer update only", framework="jax (jit)", seconds=seconds,
                         flops=_flops(update), bytes=_cost(update, "bytes accessed")))
        holder = {"m": state, "o": opt_state}

        def run():
            holder["m"], holder["o"], loss = train(holder["m"], holder["o"], jids, jlabels)
            jax.block_until_ready(loss)

        seconds = median_seconds(run, reps)
        rows.append(dict(config=key, what="train step", framework="jax (jit)", seconds=seconds, flops=train_flops,
                         bytes=train_bytes))

    # --------------------------------------------------------------- torch
    tids = torch.from_numpy(ids)
    variants = [("torch eager", torch_model)]
    if compile_torch:
        variants.append(("torch.compile", torch.compile(torch_model)))
    for name, model in variants:
        with torch.no_grad():
            seconds = median_seconds(lambda: model(tids), reps)
        rows.append(dict(config=key, what="forward", framework=name, seconds=seconds, flops=fwd_flops))
        if spec["train"]:
            tlabels = torch.from_numpy(labels)
            opt = torch.optim.Adam(torch_model.parameters(), lr=1e-4)

            def run():
                opt.zero_grad(set_to_none=True)
                loss = spec["torch_loss"](model(tids), tlabels)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 1.0)
                opt.step()

            seconds = median_seconds(run, reps)
            rows.append(dict(config=key, what="train step", framework=name, seconds=seconds, flops=train_flops))
    for row in rows:
        row["tokens_per_s"] = tokens / row["seconds"]
        row["gflops_per_s"] = row["flops"] / row["seconds"] / 1e9
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc as it is (by default both frameworks run with "
                             "flax_transformer.training.malloc.keep_freed_memory, as the train/ entry points do)")
    args = parser.parse_args(argv)
    kept = False if args.default_malloc else keep_freed_memory()
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 on both sides, as in the parity tests
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), malloc keeps freed memory: {kept}")
    peak, bandwidth = machine_peaks()
    print(f"measured here: fp32 matmul {peak / 1e9:.1f} GFLOP/s (2048^3), memory {bandwidth / 1e9:.1f} GB/s "
          "(256 MB scale)\n")
    configs = _configs()
    print("| config | pass | framework | median ms | tokens/s | GFLOP/s | torch time / JAX time | floor ms (of JAX) |")
    print("|---|---|---|---|---|---|---|---|")
    for key in args.config:
        rows = bench(key, configs[key], args.reps, not args.no_compile)
        for row in rows:
            jax_row = next(r for r in rows if r["what"] == row["what"] and r["framework"].startswith("jax"))
            ratio = row["seconds"] / jax_row["seconds"]
            floor = ""
            if "bytes" in row:  # JAX rows: the larger of compute time at peak and traffic time at full bandwidth
                floor_s = max(row["flops"] / peak, row["bytes"] / bandwidth)
                floor = f"{floor_s * 1e3:.1f} ({floor_s / row['seconds']:.0%})"
            print(f"| {key}: {configs[key]['name']} | {row['what']} | {row['framework']} | "
                  f"{row['seconds'] * 1e3:.1f} | {row['tokens_per_s']:,.0f} | {row['gflops_per_s']:.1f} | "
                  f"{ratio:.2f}x | {floor} |", flush=True)


if __name__ == "__main__":
    main()
