"""``bisect.bisect`` knows the porting bugs of Gemma 2, Gemma 3 and GPT-OSS (issue 34 item 5).

As in test_llama_bisect.py: each bug is planted in the Flax model after a correct port (a changed
attribute or weight, or a function of ``flax_transformer.models.llama`` replaced for one module; the
library is not edited), and ``bisect`` must name the module that introduced it with nothing upstream
flagged, the first wrong gradient (a parameter of that module where it has parameters) and the
onset, the first position whose error leaves the budget (``Bug.onset``: where the bug starts, argued
per bug below).

Tiny models of two layers, a sliding one (window 4) then a full one (the bugs of one layer kind need
both), width 32, 4 query heads sharing 2 key/value heads of 16 features, one batch of 2 rows of 12
tokens at positions 0-5 and 8192-8197 (past GPT-OSS's original context of 4096). Eager, as
test_llama_bisect.py, for the same reason. One bug runs by default; ``python bench/llama_bugs.py --tests gemma_gpt_oss`` prints
the table of all of them (docs/benchmarks.md).
"""

import dataclasses

import numpy as np
import pytest
import torch

import flax_transformer.models.llama as fl
import torch_reference.llama as tl
from flax_transformer.interop import porting
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.moe_config import MoeConfig
from flax_transformer.verification import bisect, verify
from parity_tests.verification.planting import check_named, patched_call

B, T, WINDOW = 2, 12, 4
IDS = np.random.default_rng(0).integers(0, 64, (B, T))
LONG = np.concatenate([np.arange(6), 8192 + np.arange(6)])[None]
TWO_KINDS = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, sliding_window=WINDOW,
                 layer_types=("sliding_attention", "full_attention"))
GEMMA = dict(hidden_act="gelu_pytorch_tanh", norm_plus_one=True, embed_scale=32 ** 0.5, sandwich_norms=True,
             tie_word_embeddings=True)
# caps that bite: the scaled scores and the logits of these weights spread over the caps
GEMMA2 = dict(GEMMA, query_pre_attn_scalar=8.0, attn_logit_softcapping=1.0, final_logit_softcapping=0.5,
              model_type="gemma2")
GEMMA3 = dict(GEMMA, qk_norm=True, query_pre_attn_scalar=24.0, rope_theta=1e6, rope_local_base_freq=10000.0,
              rope_scaling=dict(rope_type="linear", factor=8.0), model_type="gemma3_text")
GPT_OSS = dict(attention_bias=True, attention_sinks=True, rope_theta=150000.0, max_position_embeddings=131072,
               rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                 original_max_position_embeddings=4096, truncate=False),
               moe=MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, swiglu_limit=1.0),
               model_type="gpt_oss")
LAYER0, LAYER1 = "model.layers.0", "model.layers.1"


def pair(switches):
    """(config, torch_reference model with every weight perturbed and sinks drawn from N(0, 2^2),
    its correct Flax port)."""
    config = LlamaConfig(**{**TWO_KINDS, **switches})
    torch.manual_seed(0)
    torch_model = tl.LlamaForCausalLM(config).eval()
    verify.perturb_torch(torch_model, 0)
    with torch.no_grad():
        for name, p in torch_model.named_parameters():
            if name.endswith(".sinks"):  # transformers' N(0, 0.02^2) sinks are all near zero
                p.copy_(2.0 * torch.randn(p.shape))
    return config, torch_model, porting.torch_to_flax(torch_model)


# ------------------------------------------------------------------ the bugs, planted


def plant_window_on_sliding_layers(config, model):
    """The sliding layers' window one key too wide (``>=`` for ``>``); the full layers untouched."""
    for i, layer in enumerate(model.model.layers):
        if config.layer_type(i) == "sliding_attention":
            layer.self_attn.sliding_window = config.sliding_window + 1
    return model


def plant_attention_cap_dropped(config, model):
    for layer in model.model.layers:
        layer.self_attn.softcap = None
    return model


def plant_final_cap_dropped(config, model):
    model.config = dataclasses.replace(config, final_logit_softcapping=None)
    return model


def plant_cap_before_scaling(config, model):
    """``scale * cap * tanh(q.k / cap)`` for ``cap * tanh(scale * q.k / cap)``: the library's attention
    with the cap ``cap * scale`` computes exactly that (``cap s tanh(s q.k / (cap s))``)."""
    for layer in model.model.layers:
        layer.self_attn.softcap = config.attn_logit_softcapping * layer.self_attn.scaling
    return model


def plant_sinks_ignored(config, model):
    def attend_without_sinks(*args, sinks=None, **kwargs):
        return attend(*args, **kwargs)

    attend = fl.attend
    for layer in model.model.layers:
        patched_call(layer.self_attn, fl, attend=attend_without_sinks)
    return model


def plant_yarn_factor_missing(config, model):
    """YaRN's frequencies, without its attention factor (0.1 ln(factor) + 1 on cos and sin)."""
    for layer in model.model.layers:
        layer.self_attn.rotary_emb.attention_scaling = 1.0
    return model


def plant_feedforward_norms_swapped(config, model):
    """A converter that reads ``pre_feedforward_layernorm`` into ``post_feedforward_layernorm`` and back."""
    for layer in model.model.layers:
        pre, post = layer.pre_feedforward_layernorm.scale, layer.post_feedforward_layernorm.scale
        pre_value = pre[...]
        pre.set_value(post[...])
        post.set_value(pre_value)
    return model


def plant_local_rope_on_full_layers(config, model):
    """The full layers turned by the sliding layers' RoPE (``rope_local_base_freq``, unscaled)."""
    for i, layer in enumerate(model.model.layers):
        if config.layer_type(i) == "full_attention":
            layer.self_attn.rotary_emb.layer_type = "sliding_attention"
    return model


def plant_gate_up_as_halves(config, model):
    """GPT-OSS's ``gate_up_proj`` (E, H, 2I) interleaves gate and up column by column; a converter
    that reads the first I columns as gate and the last I as up puts them where the model reads them."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for param in (experts.gate_up_proj, experts.gate_up_proj_bias):
            value = np.asarray(param[...])
            inner = value.shape[-1] // 2
            misread = np.empty_like(value)
            misread[..., ::2], misread[..., 1::2] = value[..., :inner], value[..., inner:]
            param.set_value(misread)
    return model


@dataclasses.dataclass(frozen=True)
class Bug:
    what: str
    switches: dict  # the config, over TWO_KINDS
    plant: object  # plant(config, flax_model) -> the broken Flax model
    named: str  # the module bisect must name ("<model>": the model's own computation)
    onset: tuple  # (the named module's onset, the logits' onset)
    grads: bool = True  # the named module has parameters: the first wrong gradient is one of them


# Onsets. The first query sees only itself, so whatever changes the scores alone (a cap, the window,
# RoPE) cannot change position 0: one key takes all the probability. A sink takes its share there too,
# so sinks ignored start at 0, as does anything outside the scores (YaRN's factor scales q and k and the
# norms; the final cap, the expert weights). A window one key too wide starts at the query at position
# WINDOW, its first key that should be out of sight.
BUGS = {
    "window+1-sliding": Bug(f"sliding window {WINDOW} applied as {WINDOW + 1} on the sliding layers only "
                            "(Gemma 2)", GEMMA2, plant_window_on_sliding_layers, f"{LAYER0}.self_attn",
                            (WINDOW, WINDOW)),
    "attention-cap-dropped": Bug("attention logit soft-cap dropped (Gemma 2)", GEMMA2, plant_attention_cap_dropped,
                                 f"{LAYER0}.self_attn", (1, 1)),
    "final-cap-dropped": Bug("final logit soft-cap dropped (Gemma 2)", GEMMA2, plant_final_cap_dropped, "<model>",
                             (0, 0)),
    "cap-before-scaling": Bug("attention soft-cap applied before the scaling (Gemma 2)", GEMMA2,
                              plant_cap_before_scaling, f"{LAYER0}.self_attn", (1, 1)),
    "sinks-ignored": Bug("attention sinks ignored (GPT-OSS)", GPT_OSS, plant_sinks_ignored, f"{LAYER0}.self_attn",
                         (0, 0)),
    "yarn-factor-missing": Bug("YaRN's attention factor missing (GPT-OSS)", GPT_OSS, plant_yarn_factor_missing,
                               f"{LAYER0}.self_attn.rotary_emb", (0, 0), grads=False),
    "feedforward-norms-swapped": Bug("pre- and post-feed-forward norms swapped (Gemma 2)", GEMMA2,
                                     plant_feedforward_norms_swapped, f"{LAYER0}.pre_feedforward_layernorm", (0, 0)),
    "local-rope-on-full": Bug("Gemma 3's local RoPE base used on the full layer", GEMMA3,
                              plant_local_rope_on_full_layers, f"{LAYER1}.self_attn.rotary_emb", (1, 1), grads=False),
    # the experts see the tokens flattened, (b t, H): no positions, so no onset of their own
    "gate-up-halves": Bug("GPT-OSS's gate/up read as halves, not interleaved", GPT_OSS, plant_gate_up_as_halves,
                          f"{LAYER0}.mlp.experts", (None, 0)),
}


def run(name: str):
    """bisect's report on ``BUGS[name]`` (gradients too where the named module has parameters)."""
    bug = BUGS[name]
    config, torch_model, flax_model = pair(bug.switches)
    return bisect.bisect(torch_model, bug.plant(config, flax_model), (IDS,), {"position_ids": LONG},
                         grads=bug.grads, use_jit=False)


# ------------------------------------------------------------------ the test


@pytest.mark.parametrize("name", list(BUGS))
@pytest.mark.keep_cases("local-rope-on-full", reason="the kept case (Gemma 3's layers of two kinds: the second "
                        "layer's RoPE named, its onset) stands for the others, forward only (11 s; with gradients "
                        "20 s); test_gemma_norm_without_plus_one names a first wrong gradient by default")
def test_bisect_names_the_bug(name):
    bug = BUGS[name]
    report = run(name)
    check_named(report, bug.named, bug.grads)
    module = "" if bug.named == "<model>" else bug.named
    assert (report.onset(module), report.onset("")) == bug.onset, str(report)
