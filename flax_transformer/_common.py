"""Pieces every flax_transformer family shares: torch-like layers, masks, attention, checks.

Masks: boolean, ``True`` = may attend, broadcastable to ``(batch, heads, q_len,
k_len)`` (Flax NNX's convention), built only by ``make_padding_mask``,
``make_causal_mask`` and ``combine_masks``. A family whose notebook uses another
convention converts at its module boundary and says so in its docstring.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ._shared import RecordsInit, check_divisible, check_length  # noqa: F401  (re-exported)

Dtype = jnp.dtype | type


# ------------------------------------------------------------ torch-like layers
# PyTorch's defaults, so that a model trained from scratch starts from the same
# distribution in both frameworks: nn.Linear draws weight and bias from
# U(-1/sqrt(fan_in), 1/sqrt(fan_in)); nn.Embedding from N(0, 1); nn.LayerNorm has
# ones and zeros.


def _uniform_fan_in(fan_in: int):
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


# ------------------------------------------------------------ matmuls XLA CPU differentiates fast
# XLA's CPU backend runs a dot on its fast (YNNPACK) kernels only when both operands are
# row-major and the left one contracts its last axis (``IsDotSupportedByYnn`` in
# xla/backends/cpu/ynn_support.cc). Autodiff of ``x @ w`` and of attention's ``q @ kᵀ``
# and ``p @ v`` gives weight gradients of the form ``aᵀ @ b``, which XLA folds into a dot
# contracting the left operand's *first* axis: a generic Eigen call, several times slower
# (``python bench/backward.py`` shows q·kᵀ's). The custom VJPs below compute
# ``aᵀ @ b`` as ``(bᵀ @ a)ᵀ`` with the small ``bᵀ`` materialised, and
# ``optimization_barrier`` keeps XLA from folding the transposes back. Same math: the
# gradients equal autodiff's (parity_tests/test_attention_impl.py) and torch's (verify --grads).


def _t(a):
    return jnp.swapaxes(a, -1, -2)


def _tn(a, b):
    """``aᵀ @ b`` over the last two axes, as ``(bᵀ @ a)ᵀ`` with ``bᵀ`` materialised (see above)."""
    return _t(jax.lax.optimization_barrier(jax.lax.optimization_barrier(_t(b)) @ a))


@jax.custom_vjp
def _dense(x, w):
    """``x @ w`` for x (..., i), w (i, o)."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def _dense_fwd(x, w):
    return _dense(x, w), (x, w)


def _dense_bwd(residuals, g):
    x, w = residuals
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())))  # g @ wᵀ: w is small, this one is fine
    flat_x, flat_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dw = jax.lax.optimization_barrier(flat_x.T) @ flat_g  # (i, n) @ (n, o), xᵀ materialised
    return dx.astype(x.dtype), dw.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def linear_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                       out_sharding=None, **kwargs):
    """``nnx.Linear``'s ``dot_general``: ``_dense`` for its plain ``x @ kernel``, ``lax.dot_general`` otherwise."""
    (lc, rc), (lb, rb) = dimension_numbers
    if (tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and not lb and not rb and rhs.ndim == 2
            and precision is None and preferred_element_type is None and out_sharding is None and not kwargs):
        return _dense(lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, out_sharding=out_sharding, **kwargs)


def Linear(d_in: int, d_out: int, *, use_bias: bool = True, rngs: nnx.Rngs, dtype=jnp.float32,
           param_dtype=jnp.float32) -> nnx.Linear:
    """``nnx.Linear`` initialised like ``torch.nn.Linear``; kernel is (d_in, d_out).

    Its matmul has the fast weight gradient of ``linear_dot_general``."""
    return nnx.Linear(d_in, d_out, use_bias=use_bias, kernel_init=_uniform_fan_in(d_in),
                      bias_init=_uniform_fan_in(d_in), dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                      dot_general=linear_dot_general)


def Embed(num_embeddings: int, features: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
          param_dtype=jnp.float32, std: float = 1.0) -> nnx.Embed:
    """``nnx.Embed`` initialised like ``torch.nn.Embedding`` (N(0, std^2), std 1 by default)."""
    return nnx.Embed(num_embeddings, features, embedding_init=jax.nn.initializers.normal(std),
                     dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class LayerNorm(nnx.Module):
    """``torch.nn.LayerNorm`` over the last axis: two-pass variance, statistics in fp32.

    Written out rather than ``nnx.LayerNorm`` so that the whole normalisation, not
    only the statistics, runs in float32 before the cast back to ``dtype``.
    Parameters are ``scale`` (ones) and ``bias`` (zeros), of shape (features,).
    """

    def __init__(self, features: int, *, eps: float = 1e-5, rngs: nnx.Rngs | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.eps, self.dtype = eps, dtype
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype))

    def __call__(self, x):
        """(..., features) -> (..., features) in ``dtype``."""
        x = x.astype(jnp.float32)
        mean = x.mean(axis=-1, keepdims=True)
        var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)


def lookup(embed: nnx.Embed, ids: jax.Array, dtype) -> jax.Array:
    """Gather rows of an embedding table.

    Out-of-range ids (negative ones too) give NaN rows instead of JAX's silent clamp
    to the last row or NumPy-style wrap from the end. The
    models check ids eagerly whenever the values are known; this is the guard that
    stays under ``jit``, where they are not.
    """
    return gather_rows(embed.embedding[...], ids).astype(dtype)


def gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] where an id outside [0, len(table)) gives a NaN row (negative ids do not wrap)."""
    return table.at[ids].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)


# activation by HF's ``hidden_act`` / ``activation_function`` name; "gelu" is the exact
# (erf) GELU, as torch's nn.GELU(); the "_new"/"_pytorch_tanh" names are the tanh form
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


class ReLU(nnx.Module):
    """Parameter-free, so that ``Sequential`` indices match torch's ``nn.Sequential``."""

    def __call__(self, x):
        return jax.nn.relu(x)


class Sequential(nnx.List):
    """A list of layers applied in order; parameter paths are ``name.<index>.*`` as in torch."""

    def __call__(self, x):
        for layer in self:
            x = layer(x)
        return x


# ------------------------------------------------------------------------- masks


def make_padding_mask(attention_mask: jax.Array) -> jax.Array:
    """(b, k_len) with 1/True = token, 0/False = pad  ->  bool (b, 1, 1, k_len)."""
    return jnp.asarray(attention_mask).astype(bool)[:, None, None, :]


def make_causal_mask(length: int) -> jax.Array:
    """bool (1, 1, length, length), True on and below the diagonal."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
    """Logical AND of the masks that are not None (None if all are)."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else jnp.logical_and(out, m)
    return out


def is_concrete(x) -> bool:
    """True when the values of ``x`` are known now (not a tracer inside jit/grad)."""
    return not isinstance(x, jax.core.Tracer)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def normalize_mask(mask, batch: int, q_len: int, k_len: int, *, heads: int | None = None, name: str = "mask") -> jax.Array | None:
    """Check a user mask and bring it to bool (b|1, 1|h, 1|q_len, k_len).

    Accepted shapes: (batch, k_len) padding mask (1 = token, 0 = pad); (batch, q_len,
    k_len); (batch, 1 or heads, 1 or q_len, k_len). Values must be bool or 0/1 (checked
    whenever they are concrete).
    """
    if mask is None:
        return None
    if not _is_array(mask):
        raise TypeError(f"{name} must be an array, got {type(mask).__name__}")
    shape = tuple(mask.shape)
    ok = (
        (mask.ndim == 2 and shape == (batch, k_len))
        or (mask.ndim == 3 and shape == (batch, q_len, k_len))
        or (mask.ndim == 4 and shape[0] in (1, batch) and shape[1] in (1, heads or shape[1])
            and shape[2] in (1, q_len) and shape[3] == k_len)
    )
    if not ok:
        raise ValueError(
            f"{name} has shape {shape}; expected (batch, length)=({batch}, {k_len}), "
            f"(batch, q_len, k_len)=({batch}, {q_len}, {k_len}) or (batch, 1|{heads or 'heads'}, 1|{q_len}, {k_len})"
        )
    if mask.dtype != jnp.bool_:
        if jnp.issubdtype(mask.dtype, jnp.complexfloating):
            raise ValueError(f"{name} must be boolean or hold only 0 and 1")
        if is_concrete(mask):
            values = np.asarray(mask)
            if not np.all((values == 0) | (values == 1)):
                raise ValueError(f"{name} must be boolean or hold only 0 and 1")
        mask = mask != 0
    if mask.ndim == 2:
        return make_padding_mask(mask)
    if mask.ndim == 3:
        return mask[:, None]
    return mask


# ------------------------------------------------------------- key/value cache
# A decode cache is, per attention layer, a (keys, values) pair of static shape
# (b, h, max_len, d). A step writes the new positions at ``index`` and attends over
# the whole buffer with a mask that hides positions not yet written.


def update_cache(cache, k, v, index):
    """Write k, v (b, h, n, d) at positions [index, index + n) of cache = (keys, values)."""
    keys = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (0, 0, index, 0))
    values = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (0, 0, index, 0))
    return keys, values


def cache_mask(n: int, length: int, index) -> jax.Array:
    """bool (1, 1, n, length): the query at position index + i sees key positions <= index + i."""
    q_pos = index + jnp.arange(n)[:, None]
    return (jnp.arange(length)[None, :] <= q_pos)[None, None]


def empty_cache(layers: int, batch: int, heads: int, length: int, head_dim: int, dtype):
    """A zeroed cache for ``layers`` attention layers."""
    shape = (batch, heads, length, head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(layers)]


# --------------------------------------------------------------------- attention


ATTENTION_IMPLEMENTATIONS = ("reference", "xla", "cudnn")


def set_attention(model, implementation: str) -> None:
    """Make every attention module in ``model`` compute with ``implementation``:

    * ``"reference"`` (default): the notebooks' math written out (scores, fp32 softmax,
      weights @ v), which the parity tests hold to torch.
    * ``"xla"`` / ``"cudnn"``: ``jax.nn.dot_product_attention`` (cuDNN's fused flash
      attention on NVIDIA GPUs; XLA's fused version elsewhere), same masks and results
      within rounding. Modules fall back to the reference path when they must return the
      attention weights or apply attention dropout in training.

    The choice is a static attribute of the modules (``attention_impl``), so a jitted
    function compiled with one implementation is traced again for another.
    """
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {ATTENTION_IMPLEMENTATIONS}, got {implementation!r}")
    model.set_attributes(attention_impl=implementation, raise_if_not_found=False)


def fused_attention(q, k, v, mask=None, *, scale: float | None = None, bias=None, implementation: str = "xla"):
    """``jax.nn.dot_product_attention`` on (b, h, t, d) or (b, t, d) operands, our mask convention.

    A row whose keys are all masked gives zeros, as in ``attend`` (JAX's gives the mean of v).
    With an additive ``bias`` instead (notebook 002's -1e20 masks) the notebook's numbers are kept.
    """
    squeeze = q.ndim == 3
    if squeeze:  # one head, no head axis (notebook 001's AttentionHead)
        q, k, v = q[:, None], k[:, None], v[:, None]
        mask = None if mask is None else jnp.asarray(mask)[:, None]
        bias = None if bias is None else jnp.asarray(bias)[:, None]
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    to_bthd = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  (b, h, t, d) -> (b, t, h, d)
    full = None if mask is None else jnp.broadcast_to(mask, (b, h, tq, tk))
    if bias is not None:
        bias = jnp.broadcast_to(bias, (b, h, tq, tk)).astype(jnp.float32)
    out = jax.nn.dot_product_attention(to_bthd(q), to_bthd(k), to_bthd(v), bias=bias, mask=full,
                                       scale=1.0 if scale is None else scale,
                                       implementation=None if implementation == "xla" else implementation)
    out = to_bthd(out)  # (b, h, tq, d_v)
    if full is not None:
        out = jnp.where(full.any(axis=-1, keepdims=True), out, 0).astype(out.dtype)
    return out[:, 0] if squeeze else out


def _attention_weights(q, k, mask, scale, scores_matmul=None):
    """softmax(scale * q kᵀ) in float32, masked (True = may attend), fully masked rows all zero.

    ``scores_matmul(q, k)`` computes q kᵀ (default: plain ``q @ kᵀ``)."""
    scores = q @ _t(k) if scores_matmul is None else scores_matmul(q, k)  # (b, h, q, k)
    if scale is not None:
        scores = scores * scale
    scores = scores.astype(jnp.float32)  # softmax statistics in fp32 whatever the dtype
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)
    if mask is not None:
        # a fully masked row softmaxes to uniform weights over "min" scores: zero it
        weights = jnp.where(mask, weights, 0.0)
    return weights


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, mask, scale):
    """(weights @ v, weights), with a hand-written backward (see the section on matmuls above).

    The backward is the softmax's own, ``dS = W * (dW - sum(W * dW))``, on the saved
    weights: one pass, where autodiff of where/softmax/where makes about five over the
    (b, h, q, k) tensor, and masked entries get W = 0, so dS = 0 there.
    """
    weights = _attention_weights(q, k, mask, scale).astype(q.dtype)
    return weights @ v, weights


def _attention_fwd(q, k, v, mask, scale):
    weights32 = _attention_weights(q, k, mask, scale)
    weights = weights32.astype(q.dtype)
    return (weights @ v, weights), (q, k, v, mask, weights, None if weights.dtype == jnp.float32 else weights32)


def _attention_bwd(scale, residuals, cotangents):
    q, k, v, mask, weights, weights32 = residuals
    d_out, d_weights = cotangents
    weights32 = weights if weights32 is None else weights32
    dw = ((d_out @ _t(v)).astype(weights.dtype) + d_weights).astype(jnp.float32)
    ds = (weights32 * (dw - jnp.sum(weights32 * dw, axis=-1, keepdims=True))).astype(q.dtype)
    if scale is not None:
        ds = ds * scale
    d_mask = None if mask is None else np.zeros(mask.shape, jax.dtypes.float0)
    return ((ds @ k).astype(q.dtype), _tn(ds, q).astype(k.dtype), _tn(weights, d_out).astype(v.dtype), d_mask)


_attention.defvjp(_attention_fwd, _attention_bwd)


@jax.custom_vjp
def _scores_matmul(a, b):
    """``a @ bᵀ`` with the fast backward (attention with dropout)."""
    return a @ _t(b)


_scores_matmul.defvjp(lambda a, b: (_scores_matmul(a, b), (a, b)),
                      lambda r, g: ((g @ r[1]).astype(r[0].dtype), _tn(g, r[0]).astype(r[1].dtype)))


@jax.custom_vjp
def _values_matmul(p, v):
    """``p @ v`` with the fast backward (attention with dropout)."""
    return p @ v


_values_matmul.defvjp(lambda p, v: (_values_matmul(p, v), (p, v)),
                      lambda r, g: ((g @ _t(r[1])).astype(r[0].dtype), _tn(r[0], g).astype(r[1].dtype)))


def _same_batch_dims(q, k, v, mask) -> bool:
    """The custom VJPs need q, k, v with equal leading axes and a mask that broadcasts to the scores."""
    if not (q.ndim == k.ndim == v.ndim >= 2 and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        return False
    if mask is None:
        return True
    shape = (*q.shape[:-1], k.shape[-2])
    try:
        return jnp.broadcast_shapes(mask.shape, shape) == shape
    except ValueError:
        return False


def attend(q, k, v, mask=None, *, scale: float | None = None, dropout: nnx.Dropout | None = None,
           implementation: str = "reference", need_weights: bool = True):
    """softmax(scale * q k^T) v with a boolean mask.

    Args:
        q: (b, h, q_len, d); k: (b, h, k_len, d); v: (b, h, k_len, d_v). Any leading
            dims that broadcast work.
        mask: bool, True = may attend, broadcastable to (b, h, q_len, k_len).
        scale: multiplies the scores; None when q and k already carry it.
        dropout: an ``nnx.Dropout`` applied to the weights.

        implementation: see ``set_attention``; the fused path is taken only when the
            weights are not needed and dropout is inactive.

    Returns:
        out (b, h, q_len, d_v) and weights (b, h, q_len, k_len) (None from the fused path).
        A query row whose keys are all masked gets all-zero weights (so a zero output), never NaN.
    """
    dropout_active = dropout is not None and not dropout.deterministic and dropout.rate > 0
    if implementation != "reference" and not need_weights and not dropout_active and q.ndim in (3, 4):
        return fused_attention(q, k, v, mask, scale=scale, implementation=implementation), None
    if mask is not None:
        mask = jnp.asarray(mask).astype(jnp.bool_)
    same = _same_batch_dims(q, k, v, mask)
    static_scale = scale is None or isinstance(scale, numbers.Real)  # not a traced array
    if same and static_scale and not dropout_active:
        return _attention(q, k, v, mask, None if scale is None else float(scale))
    # dropout (or broadcast leading axes, or a traced scale): the same math, differentiated by
    # JAX through the softmax, with the fast matmul backward where the shapes allow it
    scores_matmul, values_matmul = (_scores_matmul, _values_matmul) if same else (None, jnp.matmul)
    weights = _attention_weights(q, k, mask, scale, scores_matmul).astype(q.dtype)
    if dropout is not None:
        weights = dropout(weights)
    return values_matmul(weights, v), weights


def masked_mean(hidden, attention_mask=None):
    """Mean of (b, t, d) over the tokens whose mask is nonzero -> (b, d); a row with no token gives zeros.

    Summed in float32 whatever the compute dtype (a statistic, like LayerNorm's)."""
    if attention_mask is None:
        return hidden.astype(jnp.float32).mean(axis=1).astype(hidden.dtype)
    weight = jnp.asarray(attention_mask).astype(jnp.bool_).astype(jnp.float32)[..., None]  # (b, t, 1)
    total = (hidden.astype(jnp.float32) * weight).sum(axis=1)
    return (total / jnp.maximum(weight.sum(axis=1), 1.0)).astype(hidden.dtype)


# ------------------------------------------------------------------ input checks


def check_token_ids(ids, vocab_size: int, *, name: str = "input_ids") -> None:
    """Ids must be an integer (b, t) array with 0 <= id < vocab_size (values checked when concrete)."""
    if not _is_array(ids):
        raise TypeError(f"{name} must be an array of token ids, got {type(ids).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.ndim != 2:
        raise ValueError(f"{name} must have shape (batch, length), got {tuple(ids.shape)}")
    if is_concrete(ids) and ids.size:
        values = np.asarray(ids)
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must lie in [0, {vocab_size}); found values in [{lo}, {hi}]")


def check_features(x, features: int, *, name: str = "x") -> None:
    """A (b, t, features) floating-point array."""
    if not _is_array(x):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array of shape (batch, length, {features}), got {x.dtype}")
    if x.ndim != 3 or x.shape[-1] != features:
        raise ValueError(f"{name} must have shape (batch, length, {features}), got {tuple(x.shape)}")
