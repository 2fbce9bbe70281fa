"""Hand-written backward passes (``jax.custom_vjp``) for the matmuls of ``Linear`` and attention.

Why they exist: XLA's CPU backend runs a dot on its fast (YNNPACK) kernels only when both
operands are row-major and the left one contracts its last axis (``IsDotSupportedByYnn`` in
xla/backends/cpu/ynn_support.cc). Autodiff of ``x @ w`` and of attention's ``q @ kᵀ`` and
``p @ v`` gives weight gradients of the form ``aᵀ @ b``, which XLA folds into a dot
contracting the left operand's *first* axis: a generic Eigen call, several times slower
(``python bench/backward.py`` shows q·kᵀ's). The VJPs here compute ``aᵀ @ b`` as
``(bᵀ @ a)ᵀ`` with the small ``bᵀ`` materialised, and ``optimization_barrier`` keeps XLA
from folding the transposes back. The softmax backward is one pass over the saved weights.

Which backends need them: XLA CPU (measured). On GPU/TPU the vendor matmuls take either
layout at full speed, so there the VJPs are the same math at the same speed, neither a gain
nor a loss measured here (no GPU run was made for this). Same math everywhere: the
gradients equal autodiff's (parity_tests/models/test_attention_impl.py) and torch's (verify --grads).
``jax.jvp``/``jacfwd`` through them are not supported (custom VJP).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _t(a):
    return jnp.swapaxes(a, -1, -2)


def _tn(a, b):
    """``aᵀ @ b`` over the last two axes, as ``(bᵀ @ a)ᵀ`` with ``bᵀ`` materialised (see the module docstring)."""
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
    """(weights @ v, weights), with a hand-written backward (see the module docstring).

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
