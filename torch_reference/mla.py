"""Multi-head latent attention (DeepSeek-V3) in PyTorch: transformers' ``DeepseekV3Attention``, its
names, parameter paths and math.

Queries: ``q_proj``, or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (``MlaConfig.q_lora_rank``);
keys and values: ``kv_a_proj_with_mqa`` gives each token a latent (``kv_lora_rank``), normalised by
``kv_a_layernorm``, and one RoPE key (``qk_rope_head_dim``) that every head shares; ``kv_b_proj``
expands the latent into each head's no-RoPE key and value. A head's query and key are the no-RoPE
part then the RoPE part; RoPE turns adjacent pairs and de-interleaves its output where
``rope_interleave`` says (transformers' ``apply_rotary_pos_emb_interleave``), half-split pairs
otherwise. The scores' scale is ``mla_config.mla_softmax_scale`` (YaRN's ``mscale_all_dim``).

Both norms take transformers' fixed eps of 1e-6, not ``rms_norm_eps``. Masks and positions are the
llama family's (``llama_layers``); a query whose keys are all masked gets a zero output. This package
has no cache: the Flax twin keeps the latent (``flax_transformer.models.mla``).
"""

from __future__ import annotations

import torch
from torch import nn

from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.mla_config import mla_softmax_scale

from ._common import Module, attend, check_features
from .llama_layers import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb, attention_keep, check_position_ids

__all__ = ["DeepseekV3Attention", "apply_rotary_pos_emb_interleave"]


def apply_rotary_pos_emb_interleave(q, k, cos, sin):
    """RoPE on adjacent pairs (2i, 2i + 1), written back half-split: q (b, h, t, d), k (b, 1, t, d);
    cos, sin (b, t, d) as ``LlamaRotaryEmbedding`` gives them (the two halves equal)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half][:, None], sin[..., :half][:, None]

    def turn(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

    return turn(q), turn(k)


class DeepseekV3Attention(Module):
    """Causal multi-head latent attention: (b, t, hidden) -> (b, t, hidden)."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, layer_idx=0):
        super().__init__()
        config = LlamaConfig.from_any(config)
        mla, hidden, heads = config.mla, config.hidden_size, config.num_attention_heads
        self.hidden_size, self.num_heads, self.q_lora_rank = hidden, heads, mla.q_lora_rank
        self.kv_lora_rank, self.qk_nope_head_dim = mla.kv_lora_rank, mla.qk_nope_head_dim
        self.qk_rope_head_dim, self.v_head_dim, self.rope_interleave = mla.qk_rope_head_dim, mla.v_head_dim, \
            mla.rope_interleave
        bias = config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = LlamaRMSNorm(mla.q_lora_rank)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = LlamaRMSNorm(mla.kv_lora_rank)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=config.o_proj_bias)
        self.scaling = mla_softmax_scale(config)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.attn_dropout = nn.Dropout(config.attention_dropout)

    def forward(self, x, attention_mask=None, position_ids=None, *, return_weights=False):
        """x (b, t, hidden); attention_mask (b, t), 1 = token; position_ids (b|1, t). Returns (b, t, hidden),
        and with ``return_weights`` the attention weights (b, h, t, t)."""
        check_features(x, self.hidden_size)
        b, t, _ = x.shape
        position_ids = check_position_ids(position_ids, b, t, x.device)
        keep = attention_keep(attention_mask, b, t, None, x.device)
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, self.num_heads, -1).transpose(1, 2)  # (b, h, t, nope + rope)
        q_pass, q_rot = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_layernorm(latent), k_rot[:, None]  # (b, t, r), (b, 1, t, rope)
        cos, sin = self.rotary_emb(x, position_ids)
        turn = apply_rotary_pos_emb_interleave if self.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = turn(q_rot, k_rot, cos, sin)
        kv = self.kv_b_proj(latent).view(b, t, self.num_heads, -1).transpose(1, 2)  # (b, h, t, nope + v)
        k_pass, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
        q = torch.cat((q_pass, q_rot), dim=-1)
        out, weights = attend(q, k, v, keep, scale=self.scaling, dropout=self.attn_dropout)
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # (b, t, h * v) -> (b, t, hidden)
        return (out, weights) if return_weights else out
