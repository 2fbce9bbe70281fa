"""Llama-style decoders in PyTorch: Llama, Mistral, Qwen2, Qwen3, Gemma, the MoEs and DeepSeek-V3, one family.

Class names, module names and ``state_dict`` keys are transformers' own
(``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``, ``...mlp.gate_proj``,
``...input_layernorm``, ``model.norm.weight``, ``lm_head.weight``), so
``LlamaForCausalLM(config).load_state_dict(hf_model.state_dict())`` loads strictly for any of the
five ``model_type``s; ``LlamaConfig.from_hf`` reads their configs. The math is transformers'
(``modeling_llama``, ``modeling_gemma``, ``modeling_qwen3``, ``modeling_rope_utils``): RoPE on
half-split features (``rotate_half``), grouped key/value heads repeated head by head
(``repeat_kv``), Gemma's ``1 + w`` norm in float32 and its embedding scale.

Where this differs from transformers, on purpose:
    * RoPE's frequencies are rounded once from float64 (``rope_inverse_frequencies``), shared
      with the Flax twin; transformers' float32 pow is within one ulp of them, and differs
      between CPUs;
    * each attention computes its RoPE cos/sin from ``position_ids`` (its parameter-free
      ``rotary_emb``), where transformers computes them once in the model; the numbers are the same;
    * ``dynamic`` RoPE scaling depends on this call's largest position alone (transformers'
      module remembers the longest call it has seen);
    * a query whose keys are all masked gets a zero output (transformers': the mean of the
      values); real tokens never are;
    * position ids place tokens for RoPE only; the causal mask runs over the sequence, and
      restarting positions do not separate packed sequences (transformers does that without a mask).

Masks: ``attention_mask`` is (b, t) with 1 = token and 0 = pad (or any mask ``normalize_mask``
takes), combined here with the causal mask and the sliding window (boolean, True = may attend).
Statistics (norms, RoPE angles, softmax) run in float32, or float64 in a float64 model.
"""

from __future__ import annotations

import torch
from torch import nn

from flax_transformer.models.input_specs import InputSpec
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.rope import RopeScaling

from ._common import Module, attend, check_features, check_token_ids, normalize_mask
from .llama_layers import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    attention_keep,
    check_position_ids,
    repeat_kv,
)
from .mla import DeepseekV3Attention
from .moe import DeepseekV3MoE, GptOssMLP, LlamaExperts, LlamaTopKRouter

__all__ = ["DeepseekV3Attention", "DeepseekV3MoE", "LlamaAttention", "LlamaConfig", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaModel",
           "LlamaRMSNorm", "LlamaRotaryEmbedding", "LlamaSparseMoeBlock", "RopeScaling"]


class LlamaAttention(Module):
    """Causal grouped-query attention with RoPE (and Qwen3's q/k norms, Mistral's window).

    ``num_attention_heads`` query heads share ``num_key_value_heads`` key/value heads: query head
    i reads key/value head i // groups.
    """

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, layer_idx=0):
        super().__init__()
        config = LlamaConfig.from_any(config)
        hidden, d, heads, kv = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.hidden_size, self.head_dim, self.num_key_value_groups = hidden, d, config.num_key_value_groups
        self.scaling = (config.query_pre_attn_scalar or d) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.layer_window(layer_idx)
        self.q_proj = nn.Linear(hidden, heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * d, hidden, bias=config.o_proj_bias)
        if config.qk_norm:  # per head over head_dim (Qwen3), or over the whole projection (OLMoE)
            whole = config.qk_norm_scope == "projection"
            norm = dict(eps=config.rms_norm_eps, plus_one=config.norm_plus_one)
            self.q_norm = LlamaRMSNorm(heads * d if whole else d, **norm)
            self.k_norm = LlamaRMSNorm(kv * d if whole else d, **norm)
        self.qk_norm = config.qk_norm and config.qk_norm_scope
        self.clip_qkv = config.clip_qkv
        if config.attention_sinks:  # GPT-OSS: a logit per query head in each softmax's denominator
            self.sinks = nn.Parameter(torch.empty(heads).normal_(0.0, 0.02))
        self.rotary_emb = LlamaRotaryEmbedding(config, config.layer_type(layer_idx))
        self.attn_dropout = nn.Dropout(config.attention_dropout)

    def forward(self, x, attention_mask=None, position_ids=None, *, return_weights=False):
        """x (b, t, hidden); attention_mask (b, t), 1 = token; position_ids (b|1, t). Returns (b, t, hidden),
        and with ``return_weights`` the attention weights (b, h, t, t), one map per query head."""
        check_features(x, self.hidden_size)
        b, t, _ = x.shape
        position_ids = check_position_ids(position_ids, b, t, x.device)
        keep = attention_keep(attention_mask, b, t, self.sliding_window, x.device)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "projection":  # OLMoE: over the whole projection, before the heads are split
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (y.clamp(-self.clip_qkv, self.clip_qkv) for y in (q, k, v))
        q = q.view(b, t, -1, self.head_dim)  # (b, t, h, d)
        k = k.view(b, t, -1, self.head_dim)  # (b, t, h_kv, d)
        v = v.view(b, t, -1, self.head_dim)
        if self.qk_norm == "head":  # per head, before RoPE, as Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))  # (b, h|h_kv, t, d)
        cos, sin = self.rotary_emb(x, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = repeat_kv(k, self.num_key_value_groups), repeat_kv(v, self.num_key_value_groups)  # (b, h, t, d)
        out, weights = attend(q, k, v, keep, scale=self.scaling, dropout=self.attn_dropout, softcap=self.softcap,
                              sinks=getattr(self, "sinks", None))
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # (b, t, h * d) -> (b, t, hidden)
        return (out, weights) if return_weights else out


class LlamaSparseMoeBlock(Module):
    """The mixture of experts in place of the MLP: ``gate`` (the router), ``experts``, and Qwen2-MoE's
    ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``. (b, t, hidden) -> (b, t, hidden).

    In train mode, Mixtral's ``router_jitter_noise`` multiplies the input by U(1 - j, 1 + j) first
    (router and experts see it). ``router_logits``, a list, gets this block's (b * t, E) logits.
    """

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config):
        super().__init__()
        config = LlamaConfig.from_any(config)
        moe = config.moe
        self.hidden_size, self.jitter_noise = config.hidden_size, moe.router_jitter_noise
        self.gate = LlamaTopKRouter(config)
        self.experts = LlamaExperts(config)
        if moe.shared_expert_intermediate_size is not None:
            self.shared_expert = LlamaMLP(config, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x, router_logits=None):
        b, t, _ = x.shape
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = x.reshape(-1, self.hidden_size)
        logits, weights, experts = self.gate(flat)
        if router_logits is not None:
            router_logits.append(logits)
        out = self.experts(flat, experts, weights)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(b, t, -1)


class LlamaDecoderLayer(Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); ``mlp`` is a ``LlamaSparseMoeBlock`` in a sparse layer.

    With ``sandwich_norms`` (Gemma 2/3) the attention's output is normalised too
    (``post_attention_layernorm``) and the MLP sits between ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm``: x + norm(attn(norm(x))), then x + norm(mlp(norm(x))).
    """

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, layer_idx=0):
        super().__init__()
        config = LlamaConfig.from_any(config)
        norm = dict(eps=config.rms_norm_eps, plus_one=config.norm_plus_one)
        self.self_attn = (LlamaAttention if config.mla is None else DeepseekV3Attention)(config, layer_idx)
        sparse = config.moe is not None and config.moe.is_sparse(layer_idx)
        # GPT-OSS: router and experts with biases; DeepSeek-V3: sigmoid routing, shared experts
        block = {"gpt_oss": GptOssMLP, "deepseek_v3": DeepseekV3MoE}.get(config.model_type, LlamaSparseMoeBlock)
        self.mlp = block(config) if sparse else LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, **norm)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, **norm)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = LlamaRMSNorm(config.hidden_size, **norm)
            self.post_feedforward_layernorm = LlamaRMSNorm(config.hidden_size, **norm)

    def forward(self, x, attention_mask=None, position_ids=None, *, return_weights=False, router_logits=None):
        """(b, t, hidden) -> (b, t, hidden) (and its attention weights (b, h, t, t) with ``return_weights``);
        a sparse layer appends its router logits to the list ``router_logits`` when given."""
        attended = self.self_attn(self.input_layernorm(x), attention_mask, position_ids, return_weights=return_weights)
        if return_weights:
            attended, weights = attended
        if self.sandwich:  # Gemma 2/3
            x = x + self.post_attention_layernorm(attended)
            normed = self.pre_feedforward_layernorm(x)
        else:
            x = x + attended
            normed = self.post_attention_layernorm(x)
        if isinstance(self.mlp, GptOssMLP):
            out, _ = self.mlp(normed, router_logits)  # and the router scores, as transformers'
        else:
            sparse = isinstance(self.mlp, (LlamaSparseMoeBlock, DeepseekV3MoE))
            out = self.mlp(normed, router_logits) if sparse else self.mlp(normed)
        x = x + (self.post_feedforward_layernorm(out) if self.sandwich else out)
        return (x, weights) if return_weights else x


class LlamaModel(Module):
    """Token embeddings (times ``embed_scale``), the decoder layers, the final norm."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config):
        super().__init__()
        config = LlamaConfig.from_any(config)
        self.config = config
        # the pad row gets no gradient (nn.Embedding's padding_idx, as transformers builds it)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        with torch.no_grad():  # transformers' initializer_range; the pad row stays zero
            self.embed_tokens.weight.normal_(0.0, 0.02)
            if config.pad_token_id is not None:
                self.embed_tokens.weight[config.pad_token_id].zero_()
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, plus_one=config.norm_plus_one)

    def forward(self, input_ids, attention_mask=None, position_ids=None, *, return_attentions=False,
                router_logits=None):
        """(b, t) ids -> last hidden state (b, t, hidden) (and with ``return_attentions`` a tuple with
        each layer's weights (b, h, t, t)); the sparse layers append their router logits to the list
        ``router_logits`` when given."""
        check_token_ids(input_ids, self.config.vocab_size)
        b, t = input_ids.shape  # the masks and positions are checked before anything is computed
        normalize_mask(attention_mask, b, t, t, name="attention_mask")
        check_position_ids(position_ids, b, t, input_ids.device)
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to float32, then to the model's dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=torch.float32).to(x.dtype)
        attentions = []
        for layer in self.layers:
            x = layer(x, attention_mask, position_ids, return_weights=return_attentions, router_logits=router_logits)
            if return_attentions:
                x, weights = x
                attentions.append(weights)
        return (self.norm(x), tuple(attentions)) if return_attentions else self.norm(x)


class LlamaForCausalLM(Module):
    """The decoder and its LM head; called as ``model(input_ids, attention_mask=None, position_ids=None)``.

    Returns logits (b, t, vocab_size). With ``tie_word_embeddings`` the head's weight is the
    embedding itself, one tensor under both names (``lm_head.weight``, ``model.embed_tokens.weight``),
    as transformers keeps it.
    """

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config):
        super().__init__()
        config = LlamaConfig.from_any(config)
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def input_spec(self) -> InputSpec:
        """What the model reads (ids, positions for RoPE's trained context), so tools need not know its class."""
        return InputSpec(self.config.vocab_size, self.config.max_position_embeddings, generates=True)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """All or nothing, as every torch_reference model. A tied model takes a checkpoint that holds
        its one tensor under either name or both (transformers' files keep it once), and refuses one
        whose head differs from its embedding (an untied checkpoint would load one over the other)."""
        names = ("lm_head.weight", "model.embed_tokens.weight")
        if self.config.tie_word_embeddings and hasattr(state_dict, "get"):
            head, table = (state_dict.get(name) for name in names)
            if (isinstance(head, torch.Tensor) and isinstance(table, torch.Tensor) and head.shape == table.shape
                    and not torch.equal(head, table)):
                raise ValueError("lm_head.weight differs from model.embed_tokens.weight, but this model ties them "
                                 "(tie_word_embeddings=True): the checkpoint has its own head; build the model "
                                 "with tie_word_embeddings=False; nothing was loaded")
            if (head is None) != (table is None):
                state_dict = {**state_dict, **({names[0]: table} if head is None else {names[1]: head})}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, input_ids, attention_mask=None, position_ids=None, *, return_attentions=False,
                output_router_logits=False):
        """Args:
            input_ids: (b, t) token ids.
            attention_mask: optional (b, t), 1 = token, 0 = pad.
            position_ids: optional (b|1, t) positions for RoPE; default 0, 1, ..., t - 1.
            return_attentions: also return a tuple with each layer's weights (b, h, t, t), one map
                per query head (a key/value head's keys seen through each of its query heads).
            output_router_logits: also return a tuple with each sparse layer's router logits
                (b * t, E) (for ``moe.load_balancing_loss``); a dense model returns an empty tuple.

        Returns:
            (b, t, vocab_size) logits, then the attentions and the router logits, each if asked.
        """
        logits = [] if output_router_logits else None
        hidden = self.model(input_ids, attention_mask, position_ids, return_attentions=return_attentions,
                            router_logits=logits)
        if return_attentions:
            hidden, attentions = hidden
        scores = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping  # Gemma 2: cap * tanh(logits / cap)
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        out = (scores,) + ((attentions,) if return_attentions else ()) + (
            (tuple(logits),) if output_router_logits else ())
        return out if len(out) > 1 else out[0]
