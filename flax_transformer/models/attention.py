"""Attention, masks and the key/value cache, shared by every flax_transformer family.

Masks: boolean, ``True`` = may attend, broadcastable to ``(batch, heads, q_len,
k_len)`` (Flax NNX's convention), built only by ``make_padding_mask``,
``make_causal_mask`` and ``combine_masks``. A family whose notebook uses another
convention converts at its module boundary and says so in its docstring.

``attend`` is the reference math (fp32 softmax, fully masked rows zero), differentiated by
the hand-written backward of ``fast_backward``; ``set_attention`` switches modules to
``jax.nn.dot_product_attention`` instead.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.models.fast_backward import _attention, _attention_weights, _scores_matmul, _values_matmul
from flax_transformer.models.input_checks import _is_array, is_concrete


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
           implementation: str = "reference", need_weights: bool = True, softcap: float | None = None, sinks=None):
    """softmax(scale * q k^T) v with a boolean mask.

    Args:
        q: (b, h, q_len, d); k: (b, h, k_len, d); v: (b, h, k_len, d_v). Any leading
            dims that broadcast work.
        mask: bool, True = may attend, broadcastable to (b, h, q_len, k_len).
        scale: multiplies the scores; None when q and k already carry it.
        dropout: an ``nnx.Dropout`` applied to the weights.
        softcap: the scaled scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2).
        sinks: (h,) one logit per head that joins each row's softmax and takes its share of the
            probability, the rest going to the keys (GPT-OSS). With ``softcap`` or ``sinks`` the
            reference math runs (whatever ``implementation``), differentiated by JAX.

        implementation: see ``set_attention``; the fused path is taken only when the
            weights are not needed and dropout is inactive.

    Returns:
        out (b, h, q_len, d_v) and weights (b, h, q_len, k_len) (None from the fused path).
        A query row whose keys are all masked gets all-zero weights (so a zero output), never NaN.
    """
    dropout_active = dropout is not None and not dropout.deterministic and dropout.rate > 0
    if softcap is not None or sinks is not None:
        weights = _capped_weights(q, k, None if mask is None else jnp.asarray(mask).astype(jnp.bool_), scale,
                                  softcap, sinks).astype(q.dtype)
        if dropout is not None:
            weights = dropout(weights)
        return weights @ v, weights
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


def _capped_weights(q, k, mask, scale, softcap, sinks):
    """``attend``'s weights with Gemma 2's soft-capping and GPT-OSS's sinks: the scores scaled, capped
    (``softcap * tanh(scores / softcap)``), masked, then softmaxed in float32 with each head's sink as
    one more column, which is dropped after. Fully masked rows: all zero."""
    scores = q @ jnp.swapaxes(k, -1, -2)  # (b, h, q, k)
    if scale is not None:
        scores = scores * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = scores.astype(jnp.float32)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        weights = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(jnp.reshape(sinks.astype(jnp.float32), (-1, 1, 1)), scores.shape[:-1] + (1,))
        weights = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return weights if mask is None else jnp.where(mask, weights, 0.0)
