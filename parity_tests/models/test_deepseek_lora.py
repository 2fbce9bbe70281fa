"""LoRA on DeepSeek-V3 against peft: multi-head latent attention's projections (``target_modules``) and the
routed experts' fused weights (``target_parameters``: transformers' ``DeepseekV3Experts`` hold them
(E, out, in), as Mixtral's, so peft swaps in and out), both ways through PEFT folders.

Reference: ``peft.PeftModel`` on a tiny random transformers ``DeepseekV3ForCausalLM`` (no download; random
correction biases that change the experts chosen; a dense first layer). Tolerance: TOL (1e-5, fp32,
"highest"); the comparisons (adapters, logits, every adapter's gradient, the experts' deltas) are
test_moe_lora's ``_compare``. alpha = rank (scale 1, not test_moe_lora's 3): the adapters' gradients here reach
~1.5 at scale 1 (~4.6 at scale 3, where float32 sums of peft and ours differ by 1.05e-5, 2e-6 of it, over
TOL's absolute 1e-5 on kv_a_proj_with_mqa's A). The default run checks the default targets a LoRA run takes for a
deepseek_v3 folder (with and without ``q_lora_rank``), without a forward.
"""

import json

import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import hf, peft, targets
from flax_transformer.models import lora, lora_experts
from flax_transformer.models.llama import LlamaForCausalLM
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.training import lora_runs
from parity_tests.conftest import TOL

from .test_moe_lora import IDS, _as_ours, _compare, _random_b

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
peft_lib = pytest.importorskip("peft", reason="peft is not installed (the test extra installs it)")

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=6, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=6, max_position_embeddings=32)
PARAMETERS = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]  # sorted, as peft writes them


def _transformers_model(q_lora_rank):
    config = transformers.DeepseekV3Config(q_lora_rank=q_lora_rank, **TINY)
    config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("q_lora_rank", [8, None])
def test_default_targets_are_the_latent_attention_s_projections(q_lora_rank):
    """A LoRA run on a deepseek_v3 folder adapts every attention projection of every layer (q_proj where
    q_lora_rank is null; our paths are transformers', which peft matches); the other query name matches none."""
    config = transformers.DeepseekV3Config(q_lora_rank=q_lora_rank, **TINY)
    expected = (["q_a_proj", "q_b_proj"] if q_lora_rank else ["q_proj"]) + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    defaults = lora_runs.default_targets(config.to_dict())
    assert sorted(defaults) == sorted(expected)
    model = targets.build_unfilled(LlamaForCausalLM, {"config": LlamaConfig.from_hf(config)})
    found = lora.find(model, defaults)
    assert sorted(found) == sorted(f"model.layers.{i}.self_attn.{t}" for i in range(2) for t in expected)
    other = "q_proj" if q_lora_rank else "q_a_proj"
    with pytest.raises(ValueError, match=rf"LoRA targets \['{other}'\] match no module"):
        lora.find(model, [*defaults, other])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("deepseek_lora") / "hf"
    _transformers_model(8).save_pretrained(path)
    return path


def _base(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    return model.eval()


@pytest.mark.slow(reason="test_moe_lora's test_moe_adapter_goes_both_ways_through_peft[qwen3_moe] (the same code on "
                         "the same expert layout) and test_default_targets_are_the_latent_attention_s_projections; "
                         "about 60 s: a forward and gradients compiled twice, peft's models")
def test_deepseek_adapter_goes_both_ways_through_peft(folder, tmp_path):
    """The default targets and both expert weights: ours saved and loaded by peft, then peft's own loaded by
    ours: adapters, logits and every adapter's gradient equal at 1e-5; our merge equals peft's
    merge_and_unload on the MLA projections and the experts; the correction bias untouched throughout."""
    modules = sorted(lora_runs.default_targets(hf.read_config(folder)))
    base_logits = _base(folder)(torch.from_numpy(IDS)).logits.detach().numpy()
    ours = lora.apply(hf.from_pretrained(folder), rank=2, alpha=2, targets=modules, parameters=PARAMETERS,
                      rngs=nnx.Rngs(0))
    ours.eval()
    layers = lora.layers(ours)
    assert sum(isinstance(v, lora_experts.ParamLoRA) for v in layers.values()) == 2  # layer 1's experts only
    assert len(layers) == 2 * len(modules) + 2
    _random_b(ours)
    peft.save_peft(ours, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == modules
    theirs = peft_lib.PeftModel.from_pretrained(_base(folder), tmp_path / "ours", is_trainable=True).eval()
    _compare(ours, theirs, base_logits, "deepseek_v3")
    lora.merge(ours)
    merged = theirs.merge_and_unload().model
    mine = ours.model.layers[1]
    for name in ("gate_up_proj", "down_proj"):
        assert float(np.abs(np.asarray(getattr(mine.mlp.experts, name)[...])
                            - _as_ours("deepseek_v3", getattr(merged.layers[1].mlp.experts, name))).max()) < TOL
    for name in modules:
        kernel = np.asarray(getattr(mine.self_attn, name).kernel[...])
        weight = getattr(merged.layers[1].self_attn, name).weight.detach().numpy().T
        assert float(np.abs(kernel - weight).max()) < TOL, name
    np.testing.assert_array_equal(np.asarray(mine.mlp.gate.e_score_correction_bias[...]),
                                  merged.layers[1].mlp.gate.e_score_correction_bias.numpy())

    torch.manual_seed(0)  # and back: an adapter peft made itself, loaded by ours
    theirs = peft_lib.get_peft_model(_base(folder), peft_lib.LoraConfig(
        r=2, lora_alpha=2, target_modules=modules, target_parameters=PARAMETERS))
    with torch.no_grad():
        for name, weight in theirs.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.2)
    theirs.save_pretrained(tmp_path / "theirs")
    ours = peft.load_peft(hf.from_pretrained(folder), tmp_path / "theirs")
    ours.eval()
    assert lora.config_of(ours).parameters == tuple(PARAMETERS)
    _compare(ours, theirs.eval(), base_logits, "deepseek_v3")
