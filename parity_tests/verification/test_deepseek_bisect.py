"""``bisect.bisect`` knows DeepSeek-V3's porting bugs (issue 35 item 5).

As in test_gemma_gpt_oss_bisect.py: each bug is planted in the Flax model after a correct port (a changed
attribute or weight, or a function of ``flax_transformer.models.moe`` replaced for one module,
``planting.patched_call``; the library is not edited), and ``bisect`` must name the module that introduced
it with nothing upstream flagged, the first wrong gradient (a parameter of that module) and the onset,
the first position whose error leaves the budget (``Bug.onset``, argued below).

One tiny layer of latent attention (4 heads, a query rank of 16, a latent of 12, 6 no-RoPE and 4 RoPE
features a head, RoPE interleaved, YaRN with ``mscale_all_dim``) and a sparse block (8 experts in 4 groups
of 2, the best 2 groups, 2 experts a token, a shared expert), width 32; every weight perturbed and the
correction bias drawn from N(0, 0.02^2), so that it changes the choice of some tokens (a third here) and
the groups those of others (``rerouted``, asserted); one batch of 2 rows of 12 tokens. The sparse block
alone, with a routing bug, runs by default; the model with each bug is slow, and
``python bench/llama_bugs.py --tests deepseek`` prints the table of all of them (docs/benchmarks.md).

transformers keeps ``e_score_correction_bias`` as a buffer and the Flax router as a parameter (its
gradient zero, the bias only chooses): ``bisect`` holds that parameter's gradient to exactly zero, so
nothing is left uncompared.
"""

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flax_transformer.models.mla as mla
import flax_transformer.models.moe as moe
import torch_reference.llama as tl
import torch_reference.moe as tm
from flax_transformer.interop import porting
from flax_transformer.models.attention import attend
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification import bisect, verify
from parity_tests.verification.planting import check_named, patched_call

B, T, BIAS_STD = 2, 12, 0.02
IDS = np.random.default_rng(0).integers(0, 64, (B, T))
CONFIG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128, model_type="deepseek_v3",
    rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, mscale=1.0,
                      mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0),
    mla=dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
             rope_interleave=True),
    moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, fp32_routing_weights=True,
             router_aux_loss_coef=0.0, n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1,
             first_k_dense_replace=0))
ATTN, GATE = "model.layers.0.self_attn", "model.layers.0.mlp.gate"
GRADIENTS = ("bias-dropped", "half-split-rope")  # the cases test_bisect_names_the_bug runs with gradients (the
# others forward only, for time: ``bench/llama_bugs.py --tests deepseek`` gives every first wrong gradient)


def pair():
    """(torch_reference model with every weight perturbed and the correction biases drawn, its correct Flax port)."""
    torch.manual_seed(0)
    torch_model = tl.LlamaForCausalLM(CONFIG).eval()
    verify.perturb_torch(torch_model, 0)
    with torch.no_grad():
        for name, buffer in torch_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(BIAS_STD * torch.randn(buffer.shape))
    flax_model = porting.torch_to_flax(torch_model)
    moe.set_experts(flax_model, "dense")  # one result; the grouped path's loops cost many small programs eagerly
    return torch_model, flax_model


# ------------------------------------------------------------------ the bugs, planted


def plant_bias_dropped(model):
    """A converter that reads parameters only: the correction bias, a buffer in torch, stays at its zeros."""
    for layer in model.model.layers:
        bias = layer.mlp.gate.e_score_correction_bias
        bias.set_value(jnp.zeros_like(bias[...]))
    return model


def plant_bias_weights(model):
    """The experts weighted by the corrected scores (scores + bias), as well as chosen by them."""
    route = moe.group_limited_route

    def weighted_by_corrected(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling):
        _, chosen = route(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling)
        weights = jnp.take_along_axis(jax.nn.sigmoid(logits) + bias, chosen, axis=-1)
        if norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * scaling, chosen

    for layer in model.model.layers:
        patched_call(layer.mlp.gate, moe, group_limited_route=weighted_by_corrected)
    return model


def plant_plain_top_k(model):
    """The top k of the corrected scores over every expert: the groups ignored (one group of all)."""
    route = moe.group_limited_route

    def plain(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling):
        return route(logits, bias, top_k, 1, 1, norm_topk_prob, scaling)

    for layer in model.model.layers:
        patched_call(layer.mlp.gate, moe, group_limited_route=plain)
    return model


def plant_half_split_rope(model):
    """The RoPE part turned as half-split pairs (i, i + d/2) where the config says interleaved."""
    for layer in model.model.layers:
        layer.self_attn.rope_interleave = False
    return model


def attention_split_at_rope(self, x, attention_mask=None, position_ids=None, *, rope_first=True, **_):
    """``DeepseekV3Attention.__call__`` without a cache, written out, with each head's query split at
    ``qk_rope_head_dim`` (``q_rot, q_pass = split(q, [rope, nope])``: the RoPE part read from the first
    features, not the last); ``rope_first=False``: the library's split at ``qk_nope_head_dim`` (the test
    checks that this copy is the library's then)."""
    b, t, _ = x.shape
    keep = mla.attention_keep(attention_mask, b, t, None)
    q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).reshape(b, t, self.num_heads, -1).transpose(0, 2, 1, 3)
    at = self.qk_rope_head_dim if rope_first else self.qk_nope_head_dim  # (b, h, t, nope + rope) split there
    q_pass, q_rot = (q[..., at:], q[..., :at]) if rope_first else (q[..., :at], q[..., at:])
    compressed = self.kv_a_proj_with_mqa(x)
    latent, k_rot = self.kv_a_layernorm(compressed[..., :self.kv_lora_rank]), compressed[:, None, :, self.kv_lora_rank:]
    cos, sin = self.rotary_emb(x, mla.check_position_ids(position_ids, b, t))
    q_rot, k_rot = mla.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    kv = self.kv_b_proj(latent).reshape(b, t, self.num_heads, -1).transpose(0, 2, 1, 3)  # (b, h, t, nope + v)
    k_pass, v = kv[..., :self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim:]
    k = jnp.concatenate((k_pass, jnp.broadcast_to(k_rot, (*k_pass.shape[:-1], self.qk_rope_head_dim))), axis=-1)
    out, _ = attend(jnp.concatenate((q_pass, q_rot), axis=-1), k, v, keep, scale=self.scaling, need_weights=False)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))  # (b, t, h * v) -> (b, t, hidden)


def plant_split_at_rope(model):
    for layer in model.model.layers:
        cls = type(layer.self_attn)
        layer.self_attn.__class__ = type(cls)("SplitAtRope", (cls,), {"__call__": attention_split_at_rope})
    return model


def plant_mscale_missing(model):
    """The scores scaled by qk_head_dim ** -0.5 alone, without YaRN's mscale(mscale_all_dim) squared."""
    for layer in model.model.layers:
        layer.self_attn.scaling = CONFIG.mla.qk_head_dim ** -0.5
    return model


def rerouted(torch_module, args: tuple, **overrides) -> np.ndarray:
    """(B, T) bool: the tokens whose set of experts changes when the router's choice takes ``overrides``
    (``group_limited_route``'s arguments), ``torch_module`` (the model, or the sparse block) run on ``args``
    in float64 torch."""
    module = copy.deepcopy(torch_module).double()
    gate, seen = next(m for m in module.modules() if isinstance(m, tm.DeepseekV3TopkRouter)), {}
    handle = gate.register_forward_hook(lambda _, inputs, out: seen.update(x=inputs[0]))
    with torch.no_grad():
        module(*(torch.as_tensor(a) if a.dtype.kind == "i" else torch.as_tensor(a, dtype=torch.float64) for a in args))
    handle.remove()
    route = dict(bias=gate.e_score_correction_bias, top_k=gate.top_k, n_group=gate.n_group,
                 topk_group=gate.topk_group, norm_topk_prob=gate.norm_topk_prob, scaling=gate.routed_scaling_factor)
    logits = F.linear(seen["x"], gate.weight)  # (B T, E)
    right, wrong = (tm.group_limited_route(logits, **{**route, **changed})[1].sort(-1)[0]
                    for changed in ({}, overrides))
    return (right != wrong).any(-1).reshape(B, T).numpy()


@dataclasses.dataclass(frozen=True)
class Bug:
    what: str
    plant: object  # plant(flax_model) -> the broken Flax model
    named: str  # the module bisect must name
    onset: tuple  # (the named module's onset, the logits'); "rerouted": the first position a token's experts change
    rerouted: dict | None = None  # the buggy choice's ``group_limited_route`` arguments (``rerouted``)


# Onsets. The first query sees only itself, so whatever changes the scores alone (the RoPE pairs, the
# split, the scale) cannot change position 0: one key takes all the probability; it shows from position 1.
# The router sees the tokens flattened, (b t, H): no positions of its own. A bias in the weights changes
# every token's weights (onset 0); a lost bias or lost groups change the output where a token's experts
# change, which ``rerouted`` finds in float64 torch (no hard-coded position).
BUGS = {
    "bias-dropped": Bug("the routers' correction bias dropped (a buffer in torch, left at zeros)", plant_bias_dropped,
                        GATE, (None, "rerouted"), dict(bias=torch.zeros(CONFIG.moe.num_experts, dtype=torch.float64))),
    "bias-weights": Bug("the correction bias used for weighting as well as choosing", plant_bias_weights, GATE,
                        (None, 0)),
    "plain-top-k": Bug("group-limited routing replaced by plain top-k", plant_plain_top_k, GATE, (None, "rerouted"),
                       dict(n_group=1, topk_group=1)),
    "half-split-rope": Bug("the RoPE part turned half-split where the config says interleaved",
                           plant_half_split_rope, ATTN, (1, 1)),
    "split-at-rope": Bug("each head's query split into no-RoPE/RoPE parts at the RoPE width (RoPE part first)",
                         plant_split_at_rope, ATTN, (1, 1)),
    "mscale-missing": Bug("YaRN's mscale missing from the softmax scale", plant_mscale_missing, ATTN, (1, 1)),
}


def run(name: str, grads: bool = True, models=None):
    """bisect's report on ``BUGS[name]`` (``models``: a fresh ``pair()`` when None), with gradients. Eager, as
    test_llama_bisect.py, for the same reason."""
    torch_model, flax_model = models or pair()
    return bisect.bisect(torch_model, BUGS[name].plant(flax_model), (IDS,), grads=grads,
                         use_jit=False)


def check(name: str, report, torch_module, args=(IDS,), named=None, grads: bool = True):
    """``report`` names ``BUGS[name]``'s module (``named``: its path in ``torch_module``) and its onsets; a
    rerouting bug shows on ``args`` (some token's experts change), and the output's error is beyond its
    budget exactly at the positions where one does."""
    bug = BUGS[name]
    named = named or bug.named
    check_named(report, named, grads)
    onset = bug.onset
    if bug.rerouted is not None:
        changed = rerouted(torch_module, args, **bug.rerouted).any(axis=0)  # (T,): in any row
        out = report.positions[""]
        assert changed.any() and np.array_equal(out.jax > out.budget, changed), (changed, out)
        onset = (onset[0], int(np.argmax(changed)))
    assert (report.onset(named), report.onset("")) == onset, str(report)


# ------------------------------------------------------------------ the tests


@pytest.mark.slow(reason="test_a_near_tie_is_reported_and_a_clear_margin_diverges (DeepSeek-V3's router judged), test_llama_bisect (planted bugs named)")
def test_plain_top_k_named_at_the_router():
    """The sparse block alone, forward only (test_bisect_names_the_bug runs the model with gradients): the
    groups change some tokens' experts, and bisect names the router, the block's error where they do."""
    torch_model, flax_model = pair()
    block, broken = torch_model.model.layers[0].mlp, BUGS["plain-top-k"].plant(flax_model).model.layers[0].mlp
    x = np.random.default_rng(1).standard_normal((B, T, CONFIG.hidden_size)).astype(np.float32)
    report = bisect.bisect(block, broken, (x,), use_jit=False)
    check("plain-top-k", report, block, (x,), named="gate", grads=False)


@pytest.mark.parametrize("name", list(BUGS))
@pytest.mark.slow(reason="test_plain_top_k_named_at_the_router names the router (the model with gradients: "
                  "test_gemma_gpt_oss_bisect's kept case, test_gemma_norm_without_plus_one)")
def test_bisect_names_the_bug(name):
    torch_model, flax_model = pair()
    if name == "split-at-rope":  # the planted attention is the library's but for the split
        attention = flax_model.model.layers[0].self_attn
        x = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, CONFIG.hidden_size)), jnp.float32)
        assert np.array_equal(attention_split_at_rope(attention, x, rope_first=False), attention(x))
    grads = name in GRADIENTS
    check(name, run(name, grads, (torch_model, flax_model)), torch_model, grads=grads)
