"""The llama family's building blocks in Flax NNX, shared by its attentions (``llama.LlamaAttention``,
``mla.DeepseekV3Attention``) and feed-forward blocks: position ids, masks and the cache's masks, RoPE
(half-split, with the scaling kinds of ``rope.py``), the RMSNorm and the gated MLP. The twins of
``torch_reference.llama_layers``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.models.attention import cache_mask, normalize_mask
from flax_transformer.models.constructor_records import RecordsInit
from flax_transformer.models.input_checks import is_concrete
from flax_transformer.models.layers import ACTIVATIONS, Linear
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.rope import attention_scaling, rope_for, rope_inverse_frequencies

__all__ = ["LlamaMLP", "LlamaRMSNorm", "LlamaRotaryEmbedding", "apply_rotary_pos_emb", "attention_keep", "cache_keep",
           "check_no_mask_with_cache", "check_position_ids", "inverse_frequencies", "repeat_kv", "rotate_half"]


def check_position_ids(position_ids, batch: int, length: int) -> jax.Array:
    """(b|1, t) integer positions >= 0 (values checked when concrete); None = 0, 1, ..., t - 1."""
    if position_ids is None:
        return jnp.arange(length)[None]
    if not hasattr(position_ids, "shape") or not hasattr(position_ids, "dtype"):
        raise TypeError(f"position_ids must be an array, got {type(position_ids).__name__}")
    if not jnp.issubdtype(position_ids.dtype, jnp.integer):
        raise TypeError(f"position_ids must hold integers, got dtype {position_ids.dtype}")
    if position_ids.ndim != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
        raise ValueError(f"position_ids must have shape (batch, length)=({batch}, {length}) or (1, {length}), "
                         f"got {tuple(position_ids.shape)}")
    if is_concrete(position_ids) and np.any(np.asarray(position_ids) < 0):
        raise ValueError("position_ids must be >= 0")
    return jnp.asarray(position_ids)


def attention_keep(attention_mask, batch: int, length: int, window: int | None) -> jax.Array:
    """bool (b|1, 1, t, t): key j <= query i, within the window (j > i - window), and a real token."""
    query, key = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
    keep = key <= query
    if window is not None:
        keep = keep & (key > query - window)
    padding = normalize_mask(attention_mask, batch, length, length, name="attention_mask")
    return keep[None, None] if padding is None else keep[None, None] & padding


def cache_keep(n: int, length: int, index, window: int | None) -> jax.Array:
    """bool (1, 1, n, length): the query at position index + i sees cached keys j <= index + i and,
    with a window, j > index + i - window (``attention_keep`` over the cache's positions)."""
    keep = cache_mask(n, length, index)
    if window is None:
        return keep
    query = index + jnp.arange(n)[:, None]
    return keep & (jnp.arange(length)[None, :] > query - window)[None, None]


def check_no_mask_with_cache(attention_mask, position_ids) -> None:
    """A cached step's positions are index, index + 1, ...: a mask or positions would be ignored, so refuse them."""
    if attention_mask is not None or position_ids is not None:
        raise ValueError("decoding with a cache reads positions index, index + 1, ... of contiguous rows: "
                         "attention_mask and position_ids are not taken then (generate right-pads the prompts)")


# ------------------------------------------------------------------------ RoPE


def inverse_frequencies(config: LlamaConfig, positions=None, layer_type: str = "full_attention") -> jax.Array:
    """RoPE's inverse frequencies (head_dim / 2,), float32, of the layers of ``layer_type``
    (``rope.rope_inverse_frequencies``).

    ``dynamic`` scaling reads the call's position ids: once their largest + 1 passes
    ``max_position_embeddings``, theta grows with it (transformers' NTK formula, float32 ops).
    """
    inv_freq = jnp.asarray(rope_inverse_frequencies(config, layer_type=layer_type))
    theta, scaling = rope_for(config, layer_type)
    if scaling is None or scaling.rope_type != "dynamic":
        return inv_freq
    dim, trained = config.head_dim, config.max_position_embeddings
    exponents = jnp.arange(0, dim, 2).astype(jnp.float32) / dim
    length = jnp.maximum(jnp.max(positions) + 1, trained)
    stretched = theta * ((scaling.factor * length.astype(jnp.float32) / trained) - (scaling.factor - 1)) ** (
        dim / (dim - 2))
    return jnp.where(length > trained, 1.0 / (stretched ** exponents), inv_freq)


_normal = nnx.initializers.normal(0.02)  # transformers' initializer_range


class _LlamaConfigModule(RecordsInit, nnx.Module):
    _init_converters = {"config": LlamaConfig.from_any}


class LlamaRotaryEmbedding(_LlamaConfigModule):
    """RoPE's cos and sin for given positions (no parameters), for the layers of ``layer_type`` (Gemma 3's
    sliding layers have their own base); YaRN's attention factor multiplies both."""

    def __init__(self, config, layer_type="full_attention", *, rngs: nnx.Rngs | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.config, self.layer_type = LlamaConfig.from_any(config), layer_type
        self.attention_scaling = attention_scaling(rope_for(self.config, layer_type)[1])

    def __call__(self, x, position_ids):
        """x: any array of the compute dtype; position_ids (b|1, t). Returns cos, sin (b|1, t, head_dim)."""
        inv_freq = inverse_frequencies(self.config, position_ids, self.layer_type)
        freqs = position_ids[..., None].astype(jnp.float32) * inv_freq  # (b, t, d / 2)
        angles = jnp.concatenate((freqs, freqs), axis=-1)  # (b, t, d): the two halves share frequencies
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.astype(x.dtype), sin.astype(x.dtype)


def rotate_half(x):
    """(..., d) -> (-x[d/2:], x[:d/2]): transformers' half-split layout (not Meta's interleaved pairs)."""
    half = x.shape[-1] // 2
    return jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q (b, h, t, d), k (b, h_kv, t, d); cos, sin (b, t, d). Returns q, k rotated."""
    cos, sin = cos[:, None], sin[:, None]  # (b, 1, t, d)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, groups: int):
    """(b, h_kv, t, d) -> (b, h_kv * groups, t, d), each key/value head repeated for its ``groups``
    consecutive query heads (``jnp.repeat``, not ``tile``)."""
    return x if groups == 1 else jnp.repeat(x, groups, axis=1)


# ------------------------------------------------------------------------ layers


class LlamaRMSNorm(RecordsInit, nnx.Module):
    """x / rms(x) * scale, statistics in float32.

    ``plus_one`` (Gemma): the scale is stored as ``w`` (initialised to zeros) and applied as
    ``1 + w``, and the product runs in float32 before the cast; Llama casts first, then scales.
    """

    def __init__(self, hidden_size, eps=1e-6, plus_one=False, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.scale = nnx.Param((jnp.zeros if plus_one else jnp.ones)((hidden_size,), param_dtype))
        self.variance_epsilon, self.plus_one, self.dtype = eps, plus_one, dtype

    def __call__(self, x):
        """(..., hidden_size) -> (..., hidden_size) in ``dtype``."""
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.variance_epsilon)
        if self.plus_one:
            return (h * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype)
        return self.scale[...].astype(self.dtype) * h.astype(self.dtype)


class LlamaMLP(_LlamaConfigModule):
    """down(act(gate(x)) * up(x)); ``intermediate_size`` None = the config's (a shared expert has its own)."""

    def __init__(self, config, intermediate_size=None, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        kw = dict(use_bias=config.mlp_bias, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        hidden = config.hidden_size
        inner = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = Linear(hidden, inner, **kw)
        self.up_proj = Linear(hidden, inner, **kw)
        self.down_proj = Linear(inner, hidden, **kw)
        self.hidden_act, self.dtype = config.hidden_act, dtype

    def __call__(self, x):
        """(b, t, hidden) -> (b, t, hidden); the activation and the product in ``dtype``, whatever the projections'."""
        gate, up = self.gate_proj(x).astype(self.dtype), self.up_proj(x).astype(self.dtype)
        return self.down_proj(ACTIVATIONS[self.hidden_act](gate) * up)
