"""The llama family's building blocks in PyTorch, shared by its attentions (``llama.LlamaAttention``,
``mla.DeepseekV3Attention``) and feed-forward blocks: position ids and masks, RoPE (half-split, with
the scaling kinds of ``rope.py``), the RMSNorm and the gated MLP. transformers' names and math, as
``llama``'s docstring says.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.rope import attention_scaling, rope_for, rope_inverse_frequencies

from ._common import ACTIVATIONS, Module, check_values, normalize_mask

__all__ = ["LlamaMLP", "LlamaRMSNorm", "LlamaRotaryEmbedding", "apply_rotary_pos_emb", "attention_keep",
           "check_position_ids", "inverse_frequencies", "repeat_kv", "rotate_half"]


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and narrower models, float64 for a float64 one (the verification's reference)."""
    return torch.promote_types(dtype, torch.float32)


def check_position_ids(position_ids, batch: int, length: int, device) -> torch.Tensor:
    """(b|1, t) integer positions >= 0; None = 0, 1, ..., t - 1. Returns (b|1, t) int64."""
    if position_ids is None:
        return torch.arange(length, device=device)[None]
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
    if position_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"position_ids must hold integers (int64 or int32), got dtype {position_ids.dtype}")
    if position_ids.ndim != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
        raise ValueError(f"position_ids must have shape (batch, length)=({batch}, {length}) or (1, {length}), "
                         f"got {tuple(position_ids.shape)}")
    check_values(position_ids >= 0, "position_ids must be >= 0")
    return position_ids.long()


def attention_keep(attention_mask, batch: int, length: int, window: int | None, device) -> torch.Tensor:
    """bool (b|1, 1, t, t): key j <= query i, within the window (j > i - window), and a real token."""
    query, key = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)[None, :]
    keep = key <= query
    if window is not None:
        keep = keep & (key > query - window)
    padding = normalize_mask(attention_mask, batch, length, length, name="attention_mask")
    return keep[None, None] if padding is None else keep[None, None] & padding


# ------------------------------------------------------------------------ RoPE


def inverse_frequencies(config: LlamaConfig, dtype: torch.dtype, device, positions=None,
                        layer_type: str = "full_attention") -> torch.Tensor:
    """RoPE's inverse frequencies (head_dim / 2,) in ``dtype`` of the layers of ``layer_type``
    (``rope.rope_inverse_frequencies``).

    ``dynamic`` scaling reads the call's position ids: once their largest + 1 passes
    ``max_position_embeddings``, theta grows with it (transformers' NTK formula, float32 torch ops).
    """
    table = torch.from_numpy(rope_inverse_frequencies(config, np.float64 if dtype == torch.float64 else np.float32,
                                                      layer_type))
    inv_freq = table.to(device=device, dtype=dtype)
    theta, scaling = rope_for(config, layer_type)
    if scaling is None or scaling.rope_type != "dynamic":
        return inv_freq
    dim, trained = config.head_dim, config.max_position_embeddings
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(dtype) / dim
    length = torch.clamp(positions.max() + 1, min=trained)
    stretched = theta * ((scaling.factor * length.to(dtype) / trained) - (scaling.factor - 1)) ** (
        dim / (dim - 2))
    return torch.where(length > trained, 1.0 / (stretched ** exponents), inv_freq)


class LlamaRotaryEmbedding(Module):
    """RoPE's cos and sin for given positions (no parameters), for the layers of ``layer_type`` (Gemma 3's
    sliding layers have their own base); YaRN's attention factor multiplies both."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, layer_type="full_attention"):
        super().__init__()
        self.config, self.layer_type = LlamaConfig.from_any(config), layer_type
        self.attention_scaling = attention_scaling(rope_for(self.config, layer_type)[1])

    def forward(self, x, position_ids):
        """x: any tensor of the compute dtype; position_ids (b|1, t). Returns cos, sin (b|1, t, head_dim)."""
        dtype = _statistics_dtype(x.dtype)
        inv_freq = inverse_frequencies(self.config, dtype, x.device, position_ids, self.layer_type)
        freqs = position_ids[..., None].to(dtype) * inv_freq  # (b, t, d / 2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (b, t, d): the two halves share frequencies
        cos, sin = angles.cos(), angles.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x):
    """(..., d) -> (-x[d/2:], x[:d/2]): transformers' half-split layout (not Meta's interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q (b, h, t, d), k (b, h_kv, t, d); cos, sin (b, t, d). Returns q, k rotated."""
    cos, sin = cos[:, None], sin[:, None]  # (b, 1, t, d)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, groups: int):
    """(b, h_kv, t, d) -> (b, h_kv * groups, t, d), each key/value head repeated for its ``groups``
    consecutive query heads (``repeat_interleave``, not ``tile``)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# ------------------------------------------------------------------------ layers


class LlamaRMSNorm(Module):
    """x / rms(x) * weight, statistics in float32.

    ``plus_one`` (Gemma): the weight is stored as ``w`` (initialised to zeros) and applied as
    ``1 + w``, and the product runs in float32 before the cast; Llama casts first, then scales.
    """

    def __init__(self, hidden_size, eps=1e-6, plus_one=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if plus_one else torch.ones(hidden_size))
        self.variance_epsilon, self.plus_one = eps, plus_one

    def forward(self, x):
        """(..., hidden_size) -> (..., hidden_size)."""
        h = x.to(_statistics_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.plus_one:
            return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)
        return self.weight * h.to(x.dtype)


class LlamaMLP(Module):
    """down(act(gate(x)) * up(x)); ``intermediate_size`` None = the config's (a shared expert has its own)."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, intermediate_size=None):
        super().__init__()
        config = LlamaConfig.from_any(config)
        hidden, bias = config.hidden_size, config.mlp_bias
        inner = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        """(b, t, hidden) -> (b, t, hidden)."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
