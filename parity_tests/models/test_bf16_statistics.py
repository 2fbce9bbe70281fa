"""bf16 compute keeps float32 where it must: softmax, LayerNorm and pooling statistics stay float32
(read off the jaxpr), and the attention backward starts from the fp32 weights.

Each test fails on a realistic planted bug the parity tests cannot see (issue 17, item 5; a mutant of
issue 22's probe): the 3e-2 output bound of test_mixed_precision.py cannot see a bf16 softmax.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer.verification import verify

# Under ``dtype=bfloat16`` the matmuls and activations run in bf16, but softmax (max, exp,
# sum), LayerNorm (mean, variance, rsqrt) and mean pooling (sum) must run in float32. The
# 3e-2 output bound of test_mixed_precision.py cannot see a bf16 softmax; the jaxpr can:
# no reduction, exp, log or square root of the forward pass may take a bf16 operand.

STATISTICS = {"reduce_sum", "reduce_max", "reduce_min", "exp", "exp2", "log", "log1p", "rsqrt", "sqrt",
              "cumsum", "cumlogsumexp", "cummax"}


BF16_MODULES = ("TransformerLayer", "GPTTransformerLayer")  # notebook 002's Attention and GPTAttention


def _bf16_statistics(jaxpr, found):
    """Append (primitive, operand dtypes) of every statistic with a bf16 float operand, nested jaxprs too."""
    from jax.extend import core as jcore

    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    _bf16_statistics(sub.jaxpr, found)
                elif isinstance(sub, jcore.Jaxpr):
                    _bf16_statistics(sub, found)
        dtypes = [str(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype")]
        if eqn.primitive.name in STATISTICS and "bfloat16" in dtypes:
            found.append((eqn.primitive.name, dtypes))
    return found


@pytest.mark.parametrize("name", (*verify.MODELS, *BF16_MODULES))
def test_softmax_norm_and_pooling_statistics_are_float32_under_bf16(name):
    from flax import nnx

    from flax_transformer.interop import porting

    spec = next(s for s in verify.specs() if s.name == name)
    torch_module, args, kwargs = verify.case_inputs(spec, "padding" if "padding" in spec.cases else spec.cases[0], 0)
    cls, init = porting.flax_class(torch_module), torch_module.init_kwargs()
    model = nnx.eval_shape(lambda: cls(**init, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))  # shapes only: no compiling
    model.eval()
    graphdef, state = nnx.split(model)
    to = lambda a: None if a is None else jnp.asarray(a)  # noqa: E731
    args, kwargs = [to(a) for a in args], {k: to(v) for k, v in kwargs.items()}
    jaxpr = jax.make_jaxpr(lambda state: nnx.merge(graphdef, state)(*args, **kwargs))(state)
    primitives = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert "dot_general" in primitives or "custom_vjp_call" in primitives  # (the model was traced)
    assert _bf16_statistics(jaxpr.jaxpr, []) == []
    assert len(_bf16_statistics(jax.make_jaxpr(jax.nn.softmax)(jnp.ones((2, 3), jnp.bfloat16)).jaxpr, [])) >= 2


def test_bf16_attention_backward_starts_from_the_fp32_weights():
    """Guards ``fast_backward._attention``'s bf16 backward taking the softmax's backward over the fp32
    weights it saved (``dS = W32 * (dW - sum(W32 * dW))``), not over the bf16-rounded ones: the intended
    math in float64 from the fp32 weights and the documented rounding points (dW rounded to bf16, dS
    rounded to bf16 before the matmuls). Values that all equal one row make dW constant along each
    row, so the exact dS is 0: the fp32 weights sum to 1 within 1e-7, the bf16 ones only within ~1e-3."""
    from flax_transformer.models import fast_backward

    rng = np.random.default_rng(0)
    b, h, t, d = 2, 2, 6, 8
    q, k, d_out = (jnp.asarray(rng.standard_normal((b, h, t, d)), jnp.bfloat16) for _ in range(3))
    v = jnp.asarray(np.broadcast_to(rng.standard_normal((b, h, 1, d)), (b, h, t, d)), jnp.bfloat16)
    mask = jnp.broadcast_to(jnp.asarray(np.arange(t) < np.array([t, 4])[:, None])[:, None, None], (b, h, t, t))
    scale = 1 / d**0.5  # a Python float, as the layers pass it
    (_, weights), vjp = jax.vjp(lambda q, k, v: fast_backward._attention(q, k, v, mask, scale), q, k, v)
    dq, dk, dv = (np.asarray(g.astype(jnp.float32), np.float64) for g in vjp((d_out, jnp.zeros_like(weights))))

    f64 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)  # noqa: E731
    w32 = f64(fast_backward._attention_weights(q, k, mask, scale))  # the forward's fp32 softmax
    dw = f64((d_out @ jnp.swapaxes(v, -1, -2)).astype(jnp.float32))  # rounded to bf16 by the matmul
    assert (dw == dw[..., :1]).all()  # constant along each row of keys
    ds = w32 * (dw - (w32 * dw).sum(-1, keepdims=True)) * scale
    q64, k64 = f64(q), f64(k)
    want_dq, want_dk = ds @ k64, np.swapaxes(ds, -1, -2) @ q64
    want_dv = np.swapaxes(f64(weights), -1, -2) @ f64(d_out)  # the bf16 weights, as the forward used them
    size = np.abs(dw).max() * np.abs(k64).max()
    assert np.abs(want_dq).max() < 1e-6 * size and np.abs(want_dk).max() < 1e-6 * size
    np.testing.assert_allclose(dq, want_dq, atol=1e-5 * size, rtol=0)  # bf16-rounded weights: ~3e-4 * size
    np.testing.assert_allclose(dk, want_dk, atol=1e-5 * size, rtol=0)
    np.testing.assert_allclose(dv, want_dv, atol=1e-2 * np.abs(want_dv).max(), rtol=0)
