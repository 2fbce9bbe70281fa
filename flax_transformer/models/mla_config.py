"""Multi-head latent attention's settings (DeepSeek-V3, and the models that reuse its code).

Pure Python, like ``llama_config``: torch_reference reads it without JAX. ``LlamaConfig.mla`` holds one
``MlaConfig`` (None: the llama family's grouped-query attention); the field names are transformers'
``DeepseekV3Config``'s, and ``from_hf`` / ``to_hf`` read and write them.

Queries: ``q_proj`` (hidden -> heads * (nope + rope)), or with ``q_lora_rank`` the low-rank pair
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``. Keys and values come from one compressed latent per
token: ``kv_a_proj_with_mqa`` (hidden -> ``kv_lora_rank + qk_rope_head_dim``) splits into the latent,
normalised by ``kv_a_layernorm``, and one RoPE key shared by every head; ``kv_b_proj`` (latent ->
heads * (nope + ``v_head_dim``)) expands the latent into each head's no-RoPE key and its value. A
head's query and key are (no-RoPE part, RoPE part), ``qk_nope_head_dim + qk_rope_head_dim`` wide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flax_transformer.models.arg_checks import check_size, shown
from flax_transformer.models.configs import _check_fields, _set


@dataclass(frozen=True)
class MlaConfig:
    """Attributes:
        q_lora_rank: the queries' low-rank width (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``);
            None: one ``q_proj`` (DeepSeek-V2-Lite).
        kv_lora_rank: the compressed latent's width, what a decoding cache keeps per token.
        qk_nope_head_dim: each head's query/key features without RoPE.
        qk_rope_head_dim: each head's query features with RoPE, and the one RoPE key all heads share
            (the model's RoPE ``head_dim``).
        v_head_dim: each head's value width.
        rope_interleave: RoPE turns adjacent pairs (0, 1), (2, 3), ... of the RoPE part and its output
            is de-interleaved (transformers' ``apply_rotary_pos_emb_interleave``, the released weights'
            layout); False: half-split pairs (i, i + d/2), as the llama family.
    """

    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True

    def __post_init__(self):
        _check_fields(self, sizes=("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
                      flags=("rope_interleave",))
        if self.q_lora_rank is not None:
            _set(self, "q_lora_rank", check_size("MlaConfig.q_lora_rank", self.q_lora_rank))
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MlaConfig.qk_rope_head_dim must be even (RoPE turns pairs), got "
                             f"{shown(self.qk_rope_head_dim)}")

    @property
    def qk_head_dim(self) -> int:
        """A head's query and key width: no-RoPE plus RoPE features."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, get) -> MlaConfig:
        """From a transformers config's getter (``get(name, default)``), ``DeepseekV3Config``'s defaults."""
        rank = get("q_lora_rank", 1536)
        return cls(q_lora_rank=rank or None, kv_lora_rank=get("kv_lora_rank", 512),
                   qk_nope_head_dim=get("qk_nope_head_dim", 128), qk_rope_head_dim=get("qk_rope_head_dim", 64),
                   v_head_dim=get("v_head_dim", None) or 128, rope_interleave=bool(get("rope_interleave", True)))

    def to_hf(self) -> dict:
        """transformers' fields."""
        return dict(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                    qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                    v_head_dim=self.v_head_dim, rope_interleave=self.rope_interleave)


def mla_softmax_scale(config) -> float:
    """The scores' scale of a latent attention: ``qk_head_dim ** -0.5``, times YaRN's ``mscale`` squared
    when the RoPE scaling gives ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``:
    ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2``, 1 for a factor of at most 1)."""
    scale = config.mla.qk_head_dim ** -0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling.mscale_all_dim:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
        scale = scale * mscale * mscale
    return scale
