"""Multi-head latent attention (DeepSeek-V3) in Flax NNX, with a latent cache.

The twin of ``torch_reference.mla``: transformers' ``DeepseekV3Attention``, its names, parameter paths
(``self_attn.q_a_proj.kernel``, ``q_a_layernorm.scale``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``) and math; that module's docstring says how queries,
keys and values are made. Norms and softmax in float32.

Decoding keeps, per token, only what the keys and values are made from: the normalised latent
(``kv_lora_rank`` numbers) and the shared RoPE key after RoPE (``qk_rope_head_dim``) -- a cache of
``(b, 1, slots, kv_lora_rank)`` and ``(b, 1, slots, qk_rope_head_dim)`` per layer, the same for every
head, where grouped-query attention keeps heads x (key + value). A cached call computes one of two
ways (``DeepseekV3Attention.decode``, or ``set_mla_decode``), one result:

* ``"absorbed"`` (the default): ``kv_b_proj`` is folded into the query and the output. Each head's
  no-RoPE query is taken into the latent space (q_nope @ W_uk, W_uk its key rows of ``kv_b_proj``), the
  scores are that against the cached latents plus the RoPE query against the cached RoPE keys, the
  weights average the latents, and W_uv turns the result into the head's value space. Per step it reads
  the cache once and never expands it: O(slots * (kv_lora_rank + rope)) a head.
* ``"expanded"``: the cached latents are expanded through ``kv_b_proj`` into every head's keys and values
  at every step, as transformers' forward computes them (O(slots * kv_lora_rank * heads * (nope + v))).

A LoRA on ``kv_b_proj`` is folded in too (its update matrix added to the kernel) unless merged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_transformer.models.attention import attend, update_cache
from flax_transformer.models.input_checks import check_features
from flax_transformer.models.layers import Linear
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.llama_layers import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    _LlamaConfigModule,
    apply_rotary_pos_emb,
    attention_keep,
    cache_keep,
    check_no_mask_with_cache,
    check_position_ids,
)
from flax_transformer.models.mla_config import mla_softmax_scale

__all__ = ["DECODES", "DeepseekV3Attention", "apply_rotary_pos_emb_interleave", "latent_cache", "set_mla_decode"]

DECODES = ("absorbed", "expanded")


def set_mla_decode(model, decode: str) -> None:
    """Make every latent attention in ``model`` decode from its cache ``"absorbed"`` or ``"expanded"``
    (a static attribute: a jitted function is traced again for the other)."""
    if decode not in DECODES:
        raise ValueError(f"the latent attention's decode must be one of {DECODES}, got {decode!r}")
    if not any(isinstance(node, DeepseekV3Attention) for _, node in nnx.iter_graph(model)):
        raise ValueError(f"{type(model).__name__} has no latent attention (DeepseekV3Attention) to set")
    model.set_attributes(decode=decode, raise_if_not_found=False)


def apply_rotary_pos_emb_interleave(q, k, cos, sin):
    """RoPE on adjacent pairs (2i, 2i + 1), written back half-split: q (b, h, t, d), k (b, 1, t, d);
    cos, sin (b, t, d) as ``LlamaRotaryEmbedding`` gives them (the two halves equal)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half][:, None], sin[..., :half][:, None]

    def turn(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        return jnp.concatenate((even * cos - odd * sin, odd * cos + even * sin), axis=-1)

    return turn(q), turn(k)


def _kernel(layer, dtype):
    """A linear layer's (in, out) kernel in ``dtype``, with its LoRA's update added where it has an unmerged one."""
    kernel = layer.kernel[...]
    if getattr(layer, "lora_A", None) is not None and not layer.merged:
        kernel = kernel.astype(jnp.float32) + layer.update_matrix()
    return kernel.astype(dtype)


class DeepseekV3Attention(_LlamaConfigModule):
    """Causal multi-head latent attention: (b, t, hidden) -> (b, t, hidden)."""

    def __init__(self, config, layer_idx=0, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        mla, hidden, heads = config.mla, config.hidden_size, config.num_attention_heads
        self.hidden_size, self.num_heads, self.q_lora_rank, self.dtype = hidden, heads, mla.q_lora_rank, dtype
        self.kv_lora_rank, self.qk_nope_head_dim = mla.kv_lora_rank, mla.qk_nope_head_dim
        self.qk_rope_head_dim, self.v_head_dim = mla.qk_rope_head_dim, mla.v_head_dim
        self.rope_interleave, self.decode = mla.rope_interleave, "absorbed"
        self.attention_impl = "reference"  # see attention.set_attention
        bias = config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * mla.qk_head_dim, use_bias=False, **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, use_bias=bias, **kw)
            self.q_a_layernorm = LlamaRMSNorm(mla.q_lora_rank, **kw)  # transformers' fixed eps, 1e-6
            self.q_b_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim, use_bias=False, **kw)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, use_bias=bias, **kw)
        self.kv_a_layernorm = LlamaRMSNorm(mla.kv_lora_rank, **kw)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), use_bias=False,
                                **kw)
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, use_bias=config.o_proj_bias, **kw)
        self.scaling = mla_softmax_scale(config)
        self.rotary_emb = LlamaRotaryEmbedding(config, **kw)
        self.attn_dropout = nnx.Dropout(config.attention_dropout, rngs=rngs)

    def __call__(self, x, attention_mask=None, position_ids=None, *, cache=None, index=0, return_weights=False):
        """x (b, t, hidden); attention_mask (b, t), 1 = token; position_ids (b|1, t). Returns (b, t, hidden),
        and with ``return_weights`` the attention weights (b, h, t, t).

        With ``cache`` (latents (b, 1, slots, kv_lora_rank), RoPE keys (b, 1, slots, qk_rope_head_dim)), x
        holds positions [index, index + t) of every row; their latents and RoPE keys are written at
        ``index`` and the call attends over the cache (``decode``). Returns (output, updated cache) then.
        """
        check_features(x, self.hidden_size)
        b, t, _ = x.shape
        if cache is not None and return_weights:
            raise ValueError("return_weights is not taken with a cache")
        if cache is None:
            position_ids = check_position_ids(position_ids, b, t)
            keep = attention_keep(attention_mask, b, t, None)
        else:
            check_no_mask_with_cache(attention_mask, position_ids)
            if self.decode not in DECODES:  # set by hand, past set_mla_decode's check
                raise ValueError(f"DeepseekV3Attention.decode must be one of {DECODES}, got {self.decode!r}")
            position_ids = index + jnp.arange(t)[None]  # (1, t)
            keep = cache_keep(t, cache[0].shape[2], index, None)
        x = x.astype(self.dtype)
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, t, self.num_heads, -1).transpose(0, 2, 1, 3)  # (b, h, t, nope + rope)
        q_pass, q_rot = q[..., :self.qk_nope_head_dim], q[..., self.qk_nope_head_dim:]
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., :self.kv_lora_rank])  # (b, t, r)
        k_rot = compressed[:, None, :, self.kv_lora_rank:]  # (b, 1, t, rope)
        cos, sin = self.rotary_emb(x, position_ids)
        turn = apply_rotary_pos_emb_interleave if self.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = turn(q_rot, k_rot, cos, sin)
        if cache is not None:
            latents, k_rot = cache = update_cache(cache, latent[:, None], k_rot, index)  # (b, 1, slots, r | rope)
            latent = latents[:, 0]
            if self.decode == "absorbed":
                out = self._absorbed(q_pass, q_rot, latents, k_rot, keep)
                return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1)), cache
        s = latent.shape[1]
        kv = self.kv_b_proj(latent).reshape(b, s, self.num_heads, -1).transpose(0, 2, 1, 3)  # (b, h, s, nope + v)
        k_pass, v = kv[..., :self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim:]
        k = jnp.concatenate((k_pass, jnp.broadcast_to(k_rot.astype(k_pass.dtype), (*k_pass.shape[:-1],
                                                                                   self.qk_rope_head_dim))), axis=-1)
        q = jnp.concatenate((q_pass, q_rot), axis=-1)
        if self.attention_impl != "reference":  # a fused kernel takes one head width: zeros pad the narrower
            width = max(q.shape[-1], v.shape[-1])  # (zero features change no score, the scale is given)
            q, k, v = (jnp.pad(a, [(0, 0)] * 3 + [(0, width - a.shape[-1])]) for a in (q, k, v))
        out, weights = attend(q, k, v, keep, scale=self.scaling, dropout=self.attn_dropout,
                              implementation=self.attention_impl, need_weights=return_weights)
        out = out[..., :self.v_head_dim]
        out = self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))  # (b, t, h * v) -> (b, t, hidden)
        if cache is not None:
            return out, cache
        return (out, weights) if return_weights else out

    def _absorbed(self, q_pass, q_rot, latents, k_rot, keep):
        """Attention over the cache with ``kv_b_proj`` folded into the query and output: (b, h, t, v)."""
        w = _kernel(self.kv_b_proj, self.dtype).reshape(self.kv_lora_rank, self.num_heads, -1)  # (r, h, nope + v)
        w_uk, w_uv = w[..., :self.qk_nope_head_dim], w[..., self.qk_nope_head_dim:]
        q_latent = jnp.einsum("bhtd,rhd->bhtr", q_pass, w_uk)  # each head's no-RoPE query in the latent space
        q = jnp.concatenate((q_latent, q_rot.astype(q_latent.dtype)), axis=-1)  # (b, h, t, r + rope)
        k = jnp.concatenate((latents, k_rot), axis=-1).astype(q.dtype)  # (b, 1, slots, r + rope): every head's
        out, _ = attend(q, k, latents.astype(q.dtype), keep, scale=self.scaling, need_weights=False)  # (b, h, t, r)
        return jnp.einsum("bhtr,rhd->bhtd", out, w_uv)


def latent_cache(config: LlamaConfig, batch: int, slots: int, dtype) -> tuple[jax.Array, jax.Array]:
    """An empty latent cache of one layer: latents (batch, 1, slots, kv_lora_rank), RoPE keys (batch, 1, slots,
    qk_rope_head_dim)."""
    return (jnp.zeros((batch, 1, slots, config.mla.kv_lora_rank), dtype),
            jnp.zeros((batch, 1, slots, config.mla.qk_rope_head_dim), dtype))
