"""Where notebook 000's CTransformer train step spends its time on CPU: forward vs forward+backward, piece by piece.

    python bench/backward.py

Config (a) of bench/speed.py (emb 128, 8 heads of width 16, length 256, batch 4, vocab 50k).
Each line: median ms of 10 jitted runs (3 warm-up runs excluded) of the forward alone and of
forward+backward, for the whole model at depth 0/1/3, one attention module, ``attend`` alone,
q·kᵀ alone, LayerNorm and the embedding gradient, and with ``set_attention(model, "xla")``.
"q·kᵀ alone" is plain JAX autodiff (no custom VJP): it shows the cost of the transposed dots
that ``fast_backward``'s custom backward passes avoid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import median_seconds
from flax import nnx

from flax_transformer.models.attention import attend, set_attention
from flax_transformer.models.former import CTransformer, MHSelfAttention
from flax_transformer.models.layers import LayerNorm, gather_rows
from flax_transformer.training.step import cross_entropy


def ms(fn, *args) -> float:
    """Median milliseconds of 10 runs of ``fn(*args)`` after 3 warm-up runs."""
    return median_seconds(lambda: jax.block_until_ready(fn(*args)), 10) * 1e3


def module_times(module, *inputs, loss):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    forward = jax.jit(lambda p, *x: loss(nnx.merge(graphdef, p, rest)(*x)))
    backward = jax.jit(jax.grad(lambda p, *x: loss(nnx.merge(graphdef, p, rest)(*x))))
    return ms(forward, params, *inputs), ms(backward, params, *inputs)


def main():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 50_000, (4, 256)), jnp.int32)
    labels = jnp.asarray([0, 1, 0, 1], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (4, 256, 128))
    q = jax.random.normal(jax.random.key(1), (4, 8, 256, 16))
    rows = []
    for depth in (0, 1, 3):
        model = CTransformer(128, 8, depth, 256, 50_000, 2, rngs=nnx.Rngs(0))
        model.eval()
        rows.append((f"CTransformer depth {depth}", *module_times(model, ids, loss=lambda o: cross_entropy(o, labels))))
    set_attention(model, "xla")
    rows.append(("CTransformer depth 3, attention xla", *module_times(model, ids, loss=lambda o: cross_entropy(o, labels))))
    square = lambda o: (o ** 2).sum()  # noqa: E731
    rows.append(("MHSelfAttention", *module_times(MHSelfAttention(128, 8, rngs=nnx.Rngs(0)), x, loss=square)))
    rows.append(("LayerNorm", *module_times(LayerNorm(128, rngs=nnx.Rngs(0)), x, loss=square)))
    rows.append(("attend (4, 8, 256, 16)", ms(jax.jit(lambda q: square(attend(q, q, q)[0])), q),
                 ms(jax.jit(jax.grad(lambda q: square(attend(q, q, q)[0]))), q)))
    qk = lambda q: square(q @ jnp.swapaxes(q, -1, -2))  # noqa: E731
    rows.append(("q k^T (4, 8, 256, 16)", ms(jax.jit(qk), q), ms(jax.jit(jax.grad(qk)), q)))
    table = jnp.ones((50_000, 128), jnp.float32)
    gather = lambda tb: gather_rows(tb, ids).sum()  # noqa: E731
    rows.append(("embedding gather 50k x 128", ms(jax.jit(gather), table), ms(jax.jit(jax.grad(gather)), table)))
    print("| piece | forward ms | forward+backward ms | ratio |\n|---|---|---|---|")
    for name, forward, both in rows:
        print(f"| {name} | {forward:.2f} | {both:.2f} | {both / forward:.1f}x |")


if __name__ == "__main__":
    main()
