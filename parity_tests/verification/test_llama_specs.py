"""``verification/llama_specs.py``: the gemma and gpt_oss rows of ``verify`` hold every switch of issue 34,
at positions where RoPE scaling acts, with caps that bite and sinks away from zero.

The rows themselves run in ``flax-transformer verify --family gemma --family gpt_oss`` (54 rows) and
``--grads`` (docs/benchmarks.md); here what they hold is checked, without compiling anything but one
small torch forward, and one row group runs (slow).
"""

import numpy as np
import pytest
import torch

from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification import llama_specs, verify

SPECS = {family: [s for s in verify.specs() if s.family == family] for family in ("gemma", "gpt_oss")}


def _built(spec):
    """(config, layer_idx or None for a whole model) of a spec's torch module."""
    module = spec.build(True)
    init = module.init_kwargs()
    return LlamaConfig.from_any(init["config"]), init.get("layer_idx")


def test_the_gemma_and_gpt_oss_rows_hold_every_switch_at_long_positions():
    built = {family: [_built(spec) for spec in specs] for family, specs in SPECS.items()}
    gemma = [c for c, _ in built["gemma"]]
    seen = {
        "sandwich norms": all(c.sandwich_norms for c in gemma),
        "query_pre_attn_scalar != head_dim": all(c.query_pre_attn_scalar not in (None, c.head_dim) for c in gemma),
        "attention and final caps": any(c.attn_logit_softcapping and c.final_logit_softcapping for c in gemma),
        "q/k norms in 1 + w": any(c.qk_norm and c.norm_plus_one for c in gemma),
        "local RoPE base, linear scaling on the full layer": any(
            c.rope_local_base_freq and c.rope_scaling.rope_type == "linear" for c in gemma),
        "both layer kinds": all(set(c.layer_types) == {"sliding_attention", "full_attention"} for c in gemma),
        # a layer of each kind on its own: Gemma 2's full layer, Gemma 3's sliding one
        "layers of each kind": {c.layer_type(i) for c, i in built["gemma"] if i is not None}
        == {"sliding_attention", "full_attention"},
        "sinks": all(c.attention_sinks for c, _ in built["gpt_oss"]),
        "YaRN": all(c.rope_scaling.rope_type == "yarn" for c, _ in built["gpt_oss"]),
        "GPT-OSS experts": all(c.model_type == "gpt_oss" and c.moe is not None for c, _ in built["gpt_oss"]),
    }
    assert all(seen.values()), seen
    for specs in SPECS.values():
        assert {s.name.split("(")[0] for s in specs} >= {"LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM"}
        assert all(s.cases == llama_specs.CASES for s in specs)
        assert {s.name for s in specs if s.name in verify.MODELS} == {s.name for s in specs if "ForCausalLM" in s.name}
    _, args, _ = verify.case_inputs(SPECS["gpt_oss"][0], "causal", 0)
    original = built["gpt_oss"][0][0].rope_scaling.original_max_position_embeddings
    assert args[2].max() > 4 * original  # YaRN's positions well past the original context


def test_caps_bite_and_sinks_are_away_from_zero():
    """The scaled scores of Gemma 2's attention row spread across its cap (tanh bends there), and the
    sinks of the GPT-OSS rows are not transformers' N(0, 0.02^2)."""
    import torch_reference.llama as tl

    spec = SPECS["gemma"][0]
    attention, args, _ = verify.case_inputs(spec, "causal", 0)
    verify.perturb_torch(attention, 0)  # as verify runs it
    config = _built(spec)[0]
    scores = []
    original = tl.attend

    def spy(q, k, v, mask=None, *, scale=None, **kwargs):
        scores.append((q @ k.transpose(-1, -2) * scale).abs().flatten())
        return original(q, k, v, mask, scale=scale, **kwargs)

    tl.attend = spy
    try:
        with torch.no_grad():
            attention(*(torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args))
    finally:
        tl.attend = original
    scores = torch.cat(scores).numpy()
    cap = config.attn_logit_softcapping
    assert np.mean(scores > cap / 2) > 0.1 and scores.max() > cap, np.quantile(scores, [0.5, 0.9, 1.0])
    sinks = [p for name, p in SPECS["gpt_oss"][0].build(True).named_parameters() if name.endswith("sinks")]
    assert sinks and float(sinks[0].detach().abs().max()) > 1.0


@pytest.mark.slow(reason="test_attention_and_block_equal_transformers: Gemma 2/3 and GPT-OSS against transformers; "
                  "test_the_gemma_and_gpt_oss_rows_hold_every_switch_at_long_positions")
def test_the_gpt_oss_layer_rows_pass():
    spec = next(s for s in SPECS["gpt_oss"] if s.name.startswith("LlamaDecoderLayer"))
    for case in spec.cases:
        module, args, kwargs = verify.case_inputs(spec, case, 0)
        for direction, report in verify.both_directions(module, args, kwargs, reports=True):
            assert report.passed, (case, direction, str(report))


def test_the_deepseek_rows_hold_every_switch_and_their_biases_choose():
    """The deepseek rows (``llama_specs.deepseek_specs``): both query forms, both RoPE layouts, attention
    biases and none, YaRN with ``mscale`` unlike ``mscale_all_dim`` at positions past the original context,
    group-limited routing, shared experts, a dense first layer and sparse layers on their own; and the
    correction biases the torch builds draw change which experts its router gives the sparse row's inputs."""
    from torch_reference import moe as tmoe

    specs = [s for s in verify.specs() if s.family == "deepseek"]
    built = [_built(spec) for spec in specs]
    configs = [c for c, _ in built]
    seen = {
        "q_lora_rank and q_proj": {c.mla.q_lora_rank is None for c in configs} == {True, False},
        "interleaved and half-split RoPE": {c.mla.rope_interleave for c in configs} == {True, False},
        "attention biases and none": {c.attention_bias for c in configs} == {True, False},
        "mscale != mscale_all_dim": all(c.rope_scaling.mscale != c.rope_scaling.mscale_all_dim for c in configs),
        "groups": all(1 < c.moe.topk_group < c.moe.n_group for c in configs),
        "shared experts": all(c.moe.n_shared_experts for c in configs),
        "a dense first layer": all(c.moe.first_k_dense_replace == 1 for c in configs),
    }
    layers = {s.name: i for s, (_, i) in zip(specs, built, strict=True) if s.name.startswith("LlamaDecoderLayer")}
    assert sorted(layers.values()) == [0, 1, 1] and all(seen.values()), (layers, seen)  # dense, sparse, sparse
    assert {s.name for s in specs if s.name in verify.MODELS} == {s.name for s in specs if "ForCausalLM" in s.name}
    assert all(s.cases == llama_specs.CASES for s in specs)
    sparse = next(s for s in specs if "top-3 of 8" in s.name)
    layer, args, _ = verify.case_inputs(sparse, "causal", 0)
    gate = layer.mlp.gate
    assert gate.e_score_correction_bias.abs().min() > 0
    assert args[2].max() > 4 * configs[0].rope_scaling.original_max_position_embeddings
    with torch.no_grad():
        logits = torch.nn.functional.linear(torch.from_numpy(args[0]).reshape(-1, args[0].shape[-1]), gate.weight)
        chosen = [tmoe.group_limited_route(logits, bias, 3, 4, 2, True, 1.0)[1].sort(-1).values
                  for bias in (gate.e_score_correction_bias, torch.zeros(8))]
    assert (chosen[0] != chosen[1]).any(-1).sum() >= 2, "the drawn biases must change some token's experts"
