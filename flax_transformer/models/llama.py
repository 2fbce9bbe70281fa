"""Llama-style decoders in Flax NNX: Llama, Mistral, Qwen2, Qwen3, Gemma, the MoEs and DeepSeek-V3, one family.

The twin of ``torch_reference.llama``: same class names, constructor arguments (plus
keyword-only ``rngs``, ``dtype``, ``param_dtype``), call signatures and parameter paths
(``model.layers.0.self_attn.q_proj.kernel``, ``...input_layernorm.scale``,
``model.embed_tokens.embedding``), so ``porting`` maps transformers' state_dict keys one to one.
The math is transformers': half-split RoPE (``rotate_half``) with the frequencies torch_reference
uses too (``rope_inverse_frequencies``), key/value heads repeated head by head (``jnp.repeat``,
not ``tile``), Gemma's ``1 + w`` norm in float32 and its embedding scale rounded to the compute
dtype.

``attention_mask`` is (b, t) with 1 = token (or any mask ``normalize_mask`` takes); it becomes
a boolean mask (True = may attend) with the causal mask and the sliding window here. A query
whose keys are all masked gets a zero output, never NaN. Norms, RoPE angles and softmax run in
float32 whatever ``dtype`` is; logits are float32. ``set_attention`` switches the attention to
``jax.nn.dot_product_attention``. Where this family differs from transformers on purpose (RoPE
frequencies rounded once, RoPE computed per attention, ``dynamic`` scaling read from each call
alone, packed sequences) is listed in ``torch_reference.llama``.

Decoding (``init_cache``, ``decode_step``, driven by ``generate``) caches per layer the keys and
values of the key/value heads only, after RoPE, and repeats them for their query heads when
attending, as transformers' cache does; ``torch_reference`` has no cache (its generation reruns
the prefix).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_transformer.models.attention import attend, empty_cache, normalize_mask, update_cache
from flax_transformer.models.input_checks import check_features, check_token_ids
from flax_transformer.models.input_specs import InputSpec
from flax_transformer.models.layers import Embed, Linear, lookup
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.llama_layers import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    _LlamaConfigModule,
    _normal,
    apply_rotary_pos_emb,
    attention_keep,
    cache_keep,
    check_no_mask_with_cache,
    check_position_ids,
    repeat_kv,
)
from flax_transformer.models.mla import DeepseekV3Attention, latent_cache
from flax_transformer.models.moe import DeepseekV3MoE, GptOssMLP, LlamaExperts, LlamaTopKRouter
from flax_transformer.models.ring_cache import ring_keep, ring_rewind, ring_slots, update_ring
from flax_transformer.models.rope import RopeScaling

__all__ = ["DeepseekV3Attention", "DeepseekV3MoE", "LlamaAttention", "LlamaConfig", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaModel",
           "LlamaRMSNorm", "LlamaRotaryEmbedding", "LlamaSparseMoeBlock", "RopeScaling"]


class LlamaAttention(_LlamaConfigModule):
    """Causal grouped-query attention with RoPE (and Qwen3's q/k norms, Mistral's window).

    ``num_attention_heads`` query heads share ``num_key_value_heads`` key/value heads: query head
    i reads key/value head i // groups.
    """

    def __init__(self, config, layer_idx=0, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        hidden, d, heads, kv = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.hidden_size, self.head_dim, self.num_key_value_groups = hidden, d, config.num_key_value_groups
        self.scaling, self.dtype = (config.query_pre_attn_scalar or d) ** -0.5, dtype
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.layer_window(layer_idx)
        self.attention_impl = "reference"  # see set_attention
        self.q_proj = Linear(hidden, heads * d, use_bias=config.attention_bias, **kw)
        self.k_proj = Linear(hidden, kv * d, use_bias=config.attention_bias, **kw)
        self.v_proj = Linear(hidden, kv * d, use_bias=config.attention_bias, **kw)
        self.o_proj = Linear(heads * d, hidden, use_bias=config.o_proj_bias, **kw)
        # per head over head_dim (Qwen3), or over the whole projection (OLMoE)
        whole = config.qk_norm_scope == "projection"
        self.qk_norm = config.qk_norm and config.qk_norm_scope
        self.clip_qkv = config.clip_qkv
        norm = dict(eps=config.rms_norm_eps, plus_one=config.norm_plus_one, **kw)
        self.q_norm = LlamaRMSNorm(heads * d if whole else d, **norm) if config.qk_norm else None
        self.k_norm = LlamaRMSNorm(kv * d if whole else d, **norm) if config.qk_norm else None
        # GPT-OSS: a logit per query head in each softmax's denominator (transformers' init: N(0, 0.02))
        self.sinks = nnx.Param(_normal(rngs.params(), (heads,), param_dtype)) if config.attention_sinks else None
        self.rotary_emb = LlamaRotaryEmbedding(config, config.layer_type(layer_idx), **kw)
        self.attn_dropout = nnx.Dropout(config.attention_dropout, rngs=rngs)

    def __call__(self, x, attention_mask=None, position_ids=None, *, cache=None, index=0, return_weights=False):
        """x (b, t, hidden); attention_mask (b, t), 1 = token; position_ids (b|1, t). Returns (b, t, hidden),
        and with ``return_weights`` the attention weights (b, h, t, t), one map per query head.

        With ``cache`` (keys, values (b, h_kv, max_len, d): only the key/value heads are kept,
        repeated for their query heads when attended), x holds positions [index, index + t) of
        every row, RoPE turns them by those positions, and keys not yet written (or outside the
        window) are hidden; a sliding layer's cache is a ring of R slots (``ring_cache.ring_slots``),
        position q at slot q % R. Returns (output, updated cache) then.
        """
        check_features(x, self.hidden_size)
        b, t, _ = x.shape
        if cache is not None and return_weights:
            raise ValueError("return_weights is not taken with a cache")
        if cache is None:
            position_ids = check_position_ids(position_ids, b, t)
            keep = attention_keep(attention_mask, b, t, self.sliding_window)
        else:
            check_no_mask_with_cache(attention_mask, position_ids)
            position_ids = index + jnp.arange(t)[None]  # (1, t)
            ring = self.sliding_window is not None  # a window's cache is a ring (ring_cache)
            keep = (ring_keep if ring else cache_keep)(t, cache[0].shape[2], index, self.sliding_window)
        x = x.astype(self.dtype)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "projection":  # OLMoE: over the whole projection, before the heads are split
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(y, -self.clip_qkv, self.clip_qkv) for y in (q, k, v))
        q = q.reshape(b, t, -1, self.head_dim)  # (b, t, h, d)
        k = k.reshape(b, t, -1, self.head_dim)  # (b, t, h_kv, d)
        v = v.reshape(b, t, -1, self.head_dim)
        if self.qk_norm == "head":  # per head, before RoPE, as Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        # (b, h|h_kv, t, d), in this attention's own dtype (RoPE, scores, weighted sum): a module's dtype is its
        # own compute's, whatever its projections' (``advisor.apply`` keeps some modules in float32)
        q, k, v = (y.transpose(0, 2, 1, 3).astype(self.dtype) for y in (q, k, v))
        cos, sin = self.rotary_emb(x, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None and ring and t == 1:  # one token: written at its slot, then the ring attended
            k, v = cache = update_cache(cache, k, v, index % cache[0].shape[2])  # (b, h_kv, R, d)
        elif cache is not None and ring:  # the ring's keys (before index), then the fresh ones: (b, h_kv, R + t, d)
            old, cache = cache, update_ring(cache, k, v, index)
            k, v = (jnp.concatenate((c, y.astype(c.dtype)), axis=2) for c, y in zip(old, (k, v)))
        elif cache is not None:  # keys already turned by RoPE: a cached key never moves again
            k, v = cache = update_cache(cache, k, v, index)  # (b, h_kv, max_len, d)
        k, v = repeat_kv(k, self.num_key_value_groups), repeat_kv(v, self.num_key_value_groups)  # (b, h, s, d)
        out, weights = attend(q, k, v, keep, scale=self.scaling, dropout=self.attn_dropout,
                              implementation=self.attention_impl, need_weights=return_weights, softcap=self.softcap,
                              sinks=None if self.sinks is None else self.sinks[...].astype(self.dtype))
        out = self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))  # (b, t, h * d) -> (b, t, hidden)
        if cache is not None:
            return out, cache
        return (out, weights) if return_weights else out


class LlamaSparseMoeBlock(_LlamaConfigModule):
    """The mixture of experts in place of the MLP: ``gate`` (the router), ``experts``, and Qwen2-MoE's
    ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``. (b, t, hidden) -> (b, t, hidden).

    In train mode, Mixtral's ``router_jitter_noise`` multiplies the input by U(1 - j, 1 + j) first
    (router and experts see it; the ``dropout`` stream draws it). ``router_logits``, a list, gets this
    block's (b * t, E) logits.
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        moe = config.moe
        self.hidden_size, self.jitter_noise, self.dtype = config.hidden_size, moe.router_jitter_noise, dtype
        self.deterministic = False  # model.eval() / model.train() switch it, as nnx.Dropout's
        self.rngs = rngs["dropout"].fork() if moe.router_jitter_noise > 0 else nnx.data(None)
        self.gate = LlamaTopKRouter(config, **kw)
        self.experts = LlamaExperts(config, **kw)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = None if shared is None else LlamaMLP(config, shared, **kw)
        self.shared_expert_gate = None if shared is None else Linear(config.hidden_size, 1, use_bias=False, **kw)

    def __call__(self, x, router_logits=None):
        b, t, _ = x.shape
        x = x.astype(self.dtype)
        if not self.deterministic and self.jitter_noise > 0:
            x = x * jax.random.uniform(self.rngs(), x.shape, jnp.float32, 1.0 - self.jitter_noise,
                                       1.0 + self.jitter_noise).astype(self.dtype)
        flat = x.reshape(-1, self.hidden_size)
        logits, weights, experts = self.gate(flat)
        if router_logits is not None:
            router_logits.append(logits)
        out = self.experts(flat, experts, weights)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(b, t, -1)


class LlamaDecoderLayer(_LlamaConfigModule):
    """x + attn(norm(x)), then x + mlp(norm(x)); ``mlp`` is a ``LlamaSparseMoeBlock`` in a sparse layer.

    With ``sandwich_norms`` (Gemma 2/3) the attention's output is normalised too
    (``post_attention_layernorm``) and the MLP sits between ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm``: x + norm(attn(norm(x))), then x + norm(mlp(norm(x))).
    """

    def __init__(self, config, layer_idx=0, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        norm = dict(eps=config.rms_norm_eps, plus_one=config.norm_plus_one, **kw)
        self.dtype = dtype
        self.self_attn = (LlamaAttention if config.mla is None else DeepseekV3Attention)(config, layer_idx, **kw)
        sparse = config.moe is not None and config.moe.is_sparse(layer_idx)
        # GPT-OSS: router and experts with biases; DeepSeek-V3: sigmoid routing, shared experts
        block = {"gpt_oss": GptOssMLP, "deepseek_v3": DeepseekV3MoE}.get(config.model_type, LlamaSparseMoeBlock)
        self.mlp = block(config, **kw) if sparse else LlamaMLP(config, **kw)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, **norm)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, **norm)
        sandwich = config.sandwich_norms
        self.pre_feedforward_layernorm = LlamaRMSNorm(config.hidden_size, **norm) if sandwich else None
        self.post_feedforward_layernorm = LlamaRMSNorm(config.hidden_size, **norm) if sandwich else None

    def __call__(self, x, attention_mask=None, position_ids=None, *, cache=None, index=0, return_weights=False,
                 router_logits=None):
        """(b, t, hidden) -> (b, t, hidden) (and the layer's cache when decoding, or its attention
        weights (b, h, t, t) with ``return_weights``, as ``LlamaAttention``); a sparse layer appends
        its router logits to the list ``router_logits`` when given."""
        x = x.astype(self.dtype)  # the residual stream runs in the compute dtype
        attended = self.self_attn(self.input_layernorm(x), attention_mask, position_ids, cache=cache, index=index,
                                  return_weights=return_weights)
        if cache is not None or return_weights:
            attended, extra = attended  # the cache, or the weights
        if self.pre_feedforward_layernorm is None:
            x = x + attended.astype(self.dtype)  # the residual stream in this layer's dtype, whatever its parts'
            normed = self.post_attention_layernorm(x)
        else:  # Gemma 2/3's sandwich
            x = x + self.post_attention_layernorm(attended).astype(self.dtype)
            normed = self.pre_feedforward_layernorm(x)
        if isinstance(self.mlp, GptOssMLP):
            out, _ = self.mlp(normed, router_logits)  # and the router scores, as transformers'
        else:
            sparse = isinstance(self.mlp, (LlamaSparseMoeBlock, DeepseekV3MoE))
            out = self.mlp(normed, router_logits) if sparse else self.mlp(normed)
        out = out if self.post_feedforward_layernorm is None else self.post_feedforward_layernorm(out)
        x = x + out.astype(self.dtype)
        return (x, extra) if cache is not None or return_weights else x


class LlamaModel(_LlamaConfigModule):
    """Token embeddings (times ``embed_scale``), the decoder layers, the final norm."""

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.config, self.dtype = config, dtype
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, std=0.02, **kw)  # transformers' init
        if config.pad_token_id is not None:  # the pad row starts at zero, as nn.Embedding(padding_idx=) has it
            table = self.embed_tokens.embedding
            table.set_value(table[...].at[config.pad_token_id].set(0))
        self.layers = nnx.List([LlamaDecoderLayer(config, i, **kw) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, plus_one=config.norm_plus_one, **kw)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, index=0,
                 return_attentions=False, router_logits=None):
        """(b, t) ids -> last hidden state (b, t, hidden) (and the cache, one entry per layer, when decoding;
        or with ``return_attentions`` a tuple with each layer's weights (b, h, t, t)); the sparse
        layers append their router logits to the list ``router_logits`` when given."""
        check_token_ids(input_ids, self.config.vocab_size)
        b, t = input_ids.shape  # the masks and positions are checked before anything is computed
        if cache is None:
            normalize_mask(attention_mask, b, t, t, name="attention_mask")
            check_position_ids(position_ids, b, t)
        else:
            check_no_mask_with_cache(attention_mask, position_ids)
            if return_attentions:
                raise ValueError("return_attentions is not taken with a cache")
            if len(cache) != len(self.layers):
                raise ValueError(f"the cache has {len(cache)} layers, the model {len(self.layers)}")
        x = lookup(self.embed_tokens, input_ids, self.dtype)  # (b, t, hidden)
        if self.config.pad_token_id is not None:  # the pad row gets no gradient (nn.Embedding's padding_idx)
            x = jnp.where((input_ids == self.config.pad_token_id)[..., None], jax.lax.stop_gradient(x), x)
        if self.config.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to float32, then to the compute dtype
            x = x * jnp.asarray(self.config.embed_scale, jnp.float32).astype(self.dtype)
        if cache is None:
            attentions = []
            for layer in self.layers:
                x = layer(x, attention_mask, position_ids, return_weights=return_attentions,
                          router_logits=router_logits)
                if return_attentions:
                    x, weights = x
                    attentions.append(weights)
            return (self.norm(x), tuple(attentions)) if return_attentions else self.norm(x)
        new_cache = []
        for layer, layer_cache in zip(self.layers, cache):
            x, layer_cache = layer(x, cache=layer_cache, index=index)
            new_cache.append(layer_cache)
        return self.norm(x), new_cache


class LlamaForCausalLM(_LlamaConfigModule):
    """The decoder and its LM head; called as ``model(input_ids, attention_mask=None, position_ids=None)``.

    Returns float32 logits (b, t, vocab_size). With ``tie_word_embeddings`` there is no
    ``lm_head``: the head is the embedding table transposed, and porting gives torch's
    ``lm_head.weight`` (the same tensor there) to the table.
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.config, self.dtype = config, dtype
        self.model = LlamaModel(config, **kw)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, use_bias=False, **kw)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids, positions for RoPE's trained context), so tools need not know its class."""
        return InputSpec(self.config.vocab_size, self.config.max_position_embeddings, generates=True)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, return_attentions: bool = False,
                 output_router_logits: bool = False):
        """Args:
            input_ids: (b, t) token ids.
            attention_mask: optional (b, t), 1 = token, 0 = pad.
            position_ids: optional (b|1, t) positions for RoPE; default 0, 1, ..., t - 1.
            return_attentions: also return a tuple with each layer's weights (b, h, t, t), one map
                per query head (a key/value head's keys seen through each of its query heads).
            output_router_logits: also return a tuple with each sparse layer's router logits
                (b * t, E) (for ``moe.load_balancing_loss``); a dense model returns an empty tuple.

        Returns:
            (b, t, vocab_size) float32 logits, then the attentions and the router logits, each if asked.
        """
        logits = [] if output_router_logits else None
        hidden = self.model(input_ids, attention_mask, position_ids, return_attentions=return_attentions,
                            router_logits=logits)
        if return_attentions:
            hidden, attentions = hidden
        out = (self._head(hidden),) + ((attentions,) if return_attentions else ()) + (
            (tuple(logits),) if output_router_logits else ())
        return out if len(out) > 1 else out[0]

    def _head(self, hidden):
        """(b, t, hidden) -> (b, t, vocab_size) float32 logits: the LM head or the tied embedding."""
        if self.lm_head is None:
            logits = (hidden.astype(self.dtype) @ self.model.embed_tokens.embedding[...].astype(self.dtype).T
                      ).astype(jnp.float32)
        else:
            logits = self.lm_head(hidden).astype(jnp.float32)
        cap = self.config.final_logit_softcapping  # Gemma 2: cap * tanh(logits / cap)
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def init_cache(self, batch: int, length: int):
        """An empty key/value cache for decoding up to ``length`` positions: per layer, keys and values
        (batch, num_key_value_heads, slots, head_dim), the grouped heads only (a 1/groups of the
        query heads' size); slots = ``length`` for a full layer, and for a sliding layer of window W
        a ring of min(length, ``ring_cache.ring_slots(W)``) (W - 1 + min(W, 128)): O(W), not O(length).
        With latent attention (DeepSeek-V3), per layer the latents and RoPE keys (``mla.latent_cache``)."""
        c = self.config
        if c.mla is not None:  # DeepSeek-V3: the latent and the shared RoPE key (mla.latent_cache)
            return [latent_cache(c, batch, length, self.dtype) for _ in self.model.layers]
        windows = [layer.self_attn.sliding_window for layer in self.model.layers]
        return [empty_cache(1, batch, c.num_key_value_heads, length if w is None else min(length, ring_slots(w)),
                            c.head_dim, self.dtype)[0] for w in windows]

    def cache_rewind(self) -> int | None:
        """How far back a ``decode_step`` may start from the furthest position written (``generate``
        prefills in chunks no longer than this): the smallest ``ring_cache.ring_rewind`` of the sliding
        layers; None (any) without one."""
        windows = [getattr(layer.self_attn, "sliding_window", None) for layer in self.model.layers]
        return min((ring_rewind(w) for w in windows if w is not None), default=None)

    def decode_step(self, tokens, index, cache):
        """Run positions [index, index + n) of every row given a cache of the earlier ones.

        Args: tokens (b, n) ids; index: first position (int or traced scalar); cache from
        ``init_cache`` or the previous step. Returns ((b, n, vocab_size) float32 logits, cache).
        Rows are contiguous from position 0 (``generate`` right-pads prompts), so positions are
        what transformers derives from a left-padded mask (``cumsum(mask) - 1``).
        """
        hidden, cache = self.model(tokens, cache=cache, index=index)
        return self._head(hidden), cache
