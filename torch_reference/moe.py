"""The mixture of experts of the llama family in PyTorch: the router, the experts held fused, the
load-balancing loss. ``llama.LlamaSparseMoeBlock`` puts them together (with Qwen2-MoE's shared expert);
GPT-OSS's block is ``GptOssMLP`` here (transformers' ``GptOssTopKRouter``, ``GptOssExperts``: names,
layouts and math, the experts' sum in grouped_mm's order), DeepSeek-V3's ``DeepseekV3MoE`` (its
``DeepseekV3TopkRouter``: sigmoid scores, group-limited choice with a correction bias; ``LlamaExperts``;
always-on ``shared_experts``).

Parameter names and layouts are transformers 5's in-memory ones: ``mlp.gate.weight`` (E, H),
``mlp.experts.gate_up_proj`` (E, 2I, H) with gate in the first I rows and up in the last, and
``mlp.experts.down_proj`` (E, H, I), so ``state_dict`` keys are transformers' (``hf_tables`` turns
the per-expert files into them).

The math is transformers' (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``grouped_mm_experts_forward``,
``load_balancing_loss_func``): softmax over every expert in float32 (float64 in a float64 model), the
top k, renormalised if asked; each token's k expert outputs weighted and summed over its k choices in
the order top-k returns them (transformers' default ``grouped_mm``; its ``eager`` loop adds them in
expert order, which differs in the last bits of bf16). Here every expert runs on the tokens routed to it
(a loop over experts: the reference, written for reading, not speed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flax_transformer.models.llama_config import LlamaConfig

from ._common import ACTIVATIONS, Module
from .llama_layers import LlamaMLP

__all__ = ["DeepseekV3MoE", "DeepseekV3TopkRouter", "GptOssExperts", "GptOssMLP", "GptOssTopKRouter", "LlamaExperts",
           "LlamaTopKRouter", "group_limited_route", "load_balancing_loss", "route"]


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, fp32_weights: bool):
    """Router logits (T, E) -> (weights (T, k), experts (T, k)): softmax over all experts in float32,
    the top k (largest first), divided by their sum if ``norm_topk_prob``; the weights stay float32 with
    ``fp32_weights`` (Mixtral), else they take the logits' dtype."""
    probs = F.softmax(logits.to(_statistics_dtype(logits.dtype)), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(logits.dtype)), experts


class LlamaTopKRouter(Module):
    """The gate: ``weight`` (E, H), no bias. (T, H) -> (logits (T, E), weights (T, k), experts (T, k))."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config):
        super().__init__()
        config = LlamaConfig.from_any(config)
        moe = config.moe
        self.top_k, self.num_experts = moe.num_experts_per_tok, moe.num_experts
        self.norm_topk_prob, self.fp32_weights = moe.norm_topk_prob, moe.fp32_routing_weights
        self.weight = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size).normal_(0.0, 0.02))

    def forward(self, x):
        logits = F.linear(x, self.weight)
        weights, experts = route(logits, self.top_k, self.norm_topk_prob, self.fp32_weights)
        return logits, weights, experts


class LlamaExperts(Module):
    """E gated MLPs held fused: ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I).

    ``forward(x (T, H), experts (T, k), weights (T, k))`` -> (T, H): for each token,
    sum_j weights[t, j] * down[e] @ (act(gate[e] @ x) * (up[e] @ x)) with e = experts[t, j].
    """

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config):
        super().__init__()
        config = LlamaConfig.from_any(config)
        moe = config.moe
        e, inner, hidden = moe.num_experts, moe.moe_intermediate_size, config.hidden_size
        self.num_experts, self.intermediate_size = e, inner
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inner, hidden).normal_(0.0, 0.02))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, inner).normal_(0.0, 0.02))
        self.act_fn = ACTIVATIONS[config.hidden_act]

    def forward(self, x, experts, weights):
        tokens, k = experts.shape
        out = torch.zeros(tokens, k, x.shape[-1], dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
        for e in range(self.num_experts):
            token, slot = torch.where(experts == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            out[token, slot] = h * weights[token, slot, None]
        return out.sum(dim=1).to(x.dtype)


class GptOssTopKRouter(Module):
    """GPT-OSS's router: ``weight`` (E, H), ``bias`` (E,). (T, H) -> (logits (T, E), scores (T, k), experts (T, k)):
    the k largest logits, then the softmax of those k alone, in the logits' dtype."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config):
        super().__init__()
        config = LlamaConfig.from_any(config)
        moe = config.moe
        self.top_k, self.num_experts = moe.num_experts_per_tok, moe.num_experts
        self.weight = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size).normal_(0.0, 0.02))
        self.bias = nn.Parameter(torch.empty(moe.num_experts).normal_(0.0, 0.02))

    def forward(self, x):
        logits = F.linear(x, self.weight, self.bias)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return logits, F.softmax(top, dim=-1, dtype=top.dtype), experts


class GptOssExperts(Module):
    """GPT-OSS's experts, transformers' layout: ``gate_up_proj`` (E, H, 2I) with gate and up interleaved
    column by column, ``gate_up_proj_bias`` (E, 2I), ``down_proj`` (E, I, H), ``down_proj_bias`` (E, H).

    ``forward(x (T, H), experts (T, k), weights (T, k))`` -> (T, H): for each token, sum_j weights[t, j] *
    (swiglu(x @ gate_up[e] + gate_up_bias[e]) @ down[e] + down_bias[e]), e = experts[t, j], where
    swiglu(h) = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit).
    """

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config):
        super().__init__()
        config = LlamaConfig.from_any(config)
        moe = config.moe
        e, inner, hidden = moe.num_experts, moe.moe_intermediate_size, config.hidden_size
        self.num_experts, self.intermediate_size = e, inner
        self.limit, self.alpha = moe.swiglu_limit, moe.swiglu_alpha
        self.gate_up_proj = nn.Parameter(torch.empty(e, hidden, 2 * inner).normal_(0.0, 0.02))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * inner))
        self.down_proj = nn.Parameter(torch.empty(e, inner, hidden).normal_(0.0, 0.02))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, hidden))

    def _apply_gate(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # interleaved, column by column
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x, experts, weights):
        tokens, k = experts.shape
        out = torch.zeros(tokens, k, x.shape[-1], dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
        for e in range(self.num_experts):
            token, slot = torch.where(experts == e)
            if token.numel() == 0:
                continue
            h = self._apply_gate(x[token] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e])
            h = h @ self.down_proj[e] + self.down_proj_bias[e]
            out[token, slot] = h * weights[token, slot, None]
        return out.sum(dim=1).to(x.dtype)


class GptOssMLP(Module):
    """GPT-OSS's sparse block: ``router`` then ``experts``. (b, t, H) -> ((b, t, H), router scores (b t, k));
    ``router_logits``, a list, gets the (b t, E) logits, as transformers records them."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config):
        super().__init__()
        config = LlamaConfig.from_any(config)
        self.hidden_size = config.hidden_size
        self.router = GptOssTopKRouter(config)
        self.experts = GptOssExperts(config)

    def forward(self, x, router_logits=None):
        b, t, _ = x.shape
        flat = x.reshape(-1, self.hidden_size)  # (b t, H)
        logits, scores, experts = self.router(flat)
        if router_logits is not None:
            router_logits.append(logits)
        return self.experts(flat, experts, scores).reshape(b, t, -1), scores


def group_limited_route(logits, bias, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                        scaling: float):
    """DeepSeek-V3's choice, as transformers' ``DeepseekV3TopkRouter``: logits (T, E) -> (weights (T, k),
    experts (T, k)). Scores are ``sigmoid(logits)``; the experts are chosen by ``scores + bias`` (the
    correction bias) among the ``topk_group`` groups whose two best corrected scores sum highest, and
    weighted by the scores alone, divided by their sum (+ 1e-20) if ``norm_topk_prob``, times ``scaling``."""
    scores = logits.sigmoid()
    choice = scores + bias
    tokens, experts = scores.shape
    grouped = choice.view(tokens, n_group, experts // n_group)
    groups = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(topk_group, dim=-1)[1]  # (T, topk_group)
    kept = torch.zeros(tokens, n_group, dtype=torch.bool, device=logits.device).scatter_(1, groups, True)
    choice = choice.masked_fill(~kept[:, :, None].expand_as(grouped).reshape(tokens, experts), float("-inf"))
    chosen = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, chosen)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, chosen


class DeepseekV3TopkRouter(Module):
    """DeepSeek-V3's gate: ``weight`` (E, H) and the buffer ``e_score_correction_bias`` (E,), both float32
    as transformers keeps them. (T, H) -> (logits (T, E), weights (T, k), experts (T, k)), the logits and
    weights in float32 (float64 in a float64 model) whatever the input's dtype."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config):
        super().__init__()
        config = LlamaConfig.from_any(config)
        moe = config.moe
        self.top_k, self.num_experts, self.n_group, self.topk_group = (moe.num_experts_per_tok, moe.num_experts,
                                                                       moe.n_group, moe.topk_group)
        self.norm_topk_prob, self.routed_scaling_factor = moe.norm_topk_prob, moe.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size).normal_(0.0, 0.02))
        self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))

    def forward(self, x):
        dtype = _statistics_dtype(x.dtype)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        weights, experts = group_limited_route(logits, self.e_score_correction_bias.to(dtype), self.top_k,
                                               self.n_group, self.topk_group, self.norm_topk_prob,
                                               self.routed_scaling_factor)
        return logits, weights, experts


class DeepseekV3MoE(Module):
    """DeepSeek-V3's sparse block: ``gate``, ``experts`` and the always-on ``shared_experts`` (one gated MLP of
    ``n_shared_experts * moe_intermediate_size``, no gate). (b, t, H) -> (b, t, H); ``router_logits``, a
    list, gets the (b t, E) logits."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config):
        super().__init__()
        config = LlamaConfig.from_any(config)
        moe = config.moe
        self.hidden_size = config.hidden_size
        self.gate = DeepseekV3TopkRouter(config)
        self.experts = LlamaExperts(config)
        if moe.n_shared_experts:
            self.shared_experts = LlamaMLP(config, moe.moe_intermediate_size * moe.n_shared_experts)

    def forward(self, x, router_logits=None):
        b, t, _ = x.shape
        flat = x.reshape(-1, self.hidden_size)
        logits, weights, experts = self.gate(flat)
        if router_logits is not None:
            router_logits.append(logits)
        out = self.experts(flat, experts, weights)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
        return out.reshape(b, t, -1)


def load_balancing_loss(router_logits, num_experts: int, top_k: int, attention_mask=None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers computes it (``load_balancing_loss_func``).

    ``router_logits``: one (b * t, E) tensor per sparse layer. Over every layer's tokens (the padded
    ones left out when ``attention_mask`` (b, t) is given): ``E * sum_e f_e * P_e``, where f_e is the
    fraction of the k choices that went to expert e and P_e the mean router probability of e. It is
    k for a perfectly even load.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one sparse layer")
    counts = probs_sum = rows = 0
    for logits in router_logits:
        probs = F.softmax(logits, dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        hits = F.one_hot(chosen, num_experts).to(_statistics_dtype(logits.dtype)).sum(dim=1)  # (T, E)
        probs = probs.to(_statistics_dtype(logits.dtype))
        if attention_mask is None:
            counts, probs_sum, rows = counts + hits.sum(0), probs_sum + probs.sum(0), rows + logits.shape[0]
        else:
            keep = attention_mask.reshape(-1).to(probs.dtype)
            if keep.shape[0] != logits.shape[0]:
                raise ValueError(f"attention_mask has {keep.shape[0]} positions, the router logits {logits.shape[0]}")
            counts = counts + (hits * keep[:, None]).sum(0)
            probs_sum, rows = probs_sum + (probs * keep[:, None]).sum(0), rows + keep.sum()
    return num_experts * torch.sum((counts / rows) * (probs_sum / rows))
