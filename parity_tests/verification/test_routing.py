"""Routers under ``compare`` and ``bisect``: near ties never fail a correct port, a divergent router is
named, and ``bisect`` names the module of each planted MoE converter bug, with each expert run alone.

One tiny Qwen2-MoE (a shared expert, top-2 of 5, renormalised) and one OLMoE-like model (top-2 of 5,
not renormalised: softmax before or after top-k then differ) of torch_reference, ported to Flax.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from flax_transformer.interop import porting
from flax_transformer.models import moe as fmoe
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.moe_config import MoeConfig
from flax_transformer.verification import routing
from flax_transformer.verification.bisect import bisect
from flax_transformer.verification.compare import compare
from torch_reference.llama import LlamaForCausalLM

INNER = 24


def _model(norm: bool, shared: int | None, seed: int = 0):
    torch.manual_seed(seed)
    kind = dict(model_type="qwen2_moe", attention_bias=True, o_proj_bias=False) if shared else dict(model_type="qwen3_moe",
                                                                                                   qk_norm=True)
    config = LlamaConfig.tiny(vocab_size=64, num_hidden_layers=2, **kind, moe=MoeConfig(
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=INNER, norm_topk_prob=norm,
        shared_expert_intermediate_size=shared))
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def qwen2():
    return _model(norm=True, shared=16)


@pytest.fixture(scope="module")
def inputs():
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0
    return np.random.default_rng(0).integers(0, 64, (2, 9)), mask


@pytest.mark.slow(reason="test_a_near_tie_is_reported_and_a_clear_margin_diverges (near ties judged), test_a_router_that_chooses_otherwise_is_named_with_its_tokens")
def test_exact_ties_everywhere_are_near_ties_and_a_correct_port_passes(inputs):
    tied = _model(norm=True, shared=16, seed=1)
    with torch.no_grad():
        gate = tied.model.layers[0].mlp.gate.weight
        gate[:] = gate[0]  # every expert scores the same for every token: torch and JAX break ties differently
    report = compare(tied, porting.torch_to_flax(tied), inputs)
    first = report.routing.routers[0]
    assert first.differ > 0 and first.near_ties == first.differ, first  # choices differed: all near ties
    assert report.routing.forced and report.passed, report.summary()
    assert report.max_abs_err <= 1e-5  # each token compared with torch run on JAX's choice
    assert "near ties (torch re-run with JAX's choices there)" in report.summary()
    assert bisect(tied, porting.torch_to_flax(tied), inputs).passed


def test_a_router_that_chooses_otherwise_is_named_with_its_tokens(qwen2, inputs):
    flax = porting.torch_to_flax(qwen2)
    gate = flax.model.layers[1].mlp.gate.weight
    gate.set_value(gate[...][jnp.array([2, 1, 0, 3, 4])])  # experts 0 and 2 of layer 1 swapped in the router
    report = compare(qwen2, flax, inputs)
    assert not report.passed
    bad = [r for r in report.routing.routers if r.diverged]
    assert [r.path for r in bad] == ["model.layers.1.mlp.gate"] and bad[0].worst_gap > bad[0].margin > 0
    assert report.summary().splitlines()[-1].startswith("FAIL (router model.layers.1.mlp.gate:")
    assert "DIVERGE" in report.summary() and report.to_dict()["routing"]["passed"] is False


@pytest.mark.slow(reason="test_a_router_that_chooses_otherwise_is_named_with_its_tokens (the same judging)")
def test_without_float64_differing_choices_are_not_judged(qwen2, inputs):
    flax = porting.torch_to_flax(qwen2)
    gate = flax.model.layers[0].mlp.gate.weight
    gate.set_value(gate[...][jnp.array([4, 3, 2, 1, 0])])
    report = compare(qwen2, flax, inputs, fp64=False)
    assert not report.passed and "NOT JUDGED" in report.summary()


def _swap_experts(flax):
    experts = flax.model.layers[0].mlp.experts
    for param in (experts.gate_up_proj, experts.down_proj):
        param.set_value(param[...][jnp.array([0, 3, 2, 1, 4])])


def _gate_up_swapped(flax):
    experts = flax.model.layers[1].mlp.experts
    w = experts.gate_up_proj[...]
    experts.gate_up_proj.set_value(w.at[2].set(jnp.concatenate([w[2][:, INNER:], w[2][:, :INNER]], axis=1)))


def _norm_ignored(flax):
    flax.model.layers[0].mlp.gate.norm_topk_prob = False


def _shared_gate_lost(flax):
    kernel = flax.model.layers[1].mlp.shared_expert_gate.kernel
    kernel.set_value(jnp.zeros_like(kernel[...]))  # a converter that left the shared expert's gate out


@pytest.mark.parametrize("plant, where, experts", [
    (_swap_experts, "model.layers.0.mlp.experts", {"model.layers.0.mlp.experts": [1, 3]}),
    (_gate_up_swapped, "model.layers.1.mlp.experts", {"model.layers.1.mlp.experts": [2]}),
    (_norm_ignored, "model.layers.0.mlp.gate", {}),
    (_shared_gate_lost, "model.layers.1.mlp.shared_expert_gate", {}),
], ids=["experts-swapped", "gate-up-swapped", "norm-topk-ignored", "shared-gate-lost"])
@pytest.mark.slow(reason="test_exact_ties_everywhere_are_near_ties_and_a_correct_port_passes (bisect on a mixture "
                  "of experts: the routing check and each expert run alone)")
def test_bisect_names_the_module_and_the_experts_of_a_planted_bug(qwen2, inputs, plant, where, experts):
    flax = porting.torch_to_flax(qwen2)
    plant(flax)
    report = bisect(qwen2, flax, inputs)
    assert not report.passed and report.first_divergent == where, report.summary()
    bad = {label: [r.expert for r in rows if not r.passed] for label, rows in report.experts.items()}
    assert {k: v for k, v in bad.items() if v} == experts
    assert set(report.to_dict()["experts"]) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    page = report.to_html()  # the picture's experts panel: a row per expert, the wrong ones marked
    for label, wrong in experts.items():
        for e in range(5):
            row = page.split(f'data-expert="{label}[{e}]"')[1].split("</g>")[0]
            assert ("diverged" in row) == (e in wrong), (e, row[:200])


@pytest.mark.slow(reason="test_bisect_names_the_module_and_the_experts_of_a_planted_bug (the router's weights)")
def test_softmax_after_top_k_is_named_at_the_router_where_it_changes_the_weights(inputs, monkeypatch):
    torch_model = _model(norm=False, shared=None)
    flax = porting.torch_to_flax(torch_model)

    def late_softmax(logits, top_k, norm_topk_prob, fp32_weights):
        values, experts = jax.lax.top_k(logits.astype(jnp.float32), top_k)
        return jax.nn.softmax(values, axis=-1).astype(logits.dtype), experts

    monkeypatch.setattr(fmoe, "route", late_softmax)
    report = bisect(torch_model, flax, inputs)
    assert report.first_divergent == "model.layers.0.mlp.gate", report.summary()


@pytest.mark.slow(reason="test_bisect_names_the_module_and_the_experts_of_a_planted_bug (each expert run alone)")
def test_an_expert_no_token_chose_is_still_checked(qwen2, inputs):
    flax = porting.torch_to_flax(qwen2)
    load = np.bincount(np.asarray(_routes(qwen2, inputs)["model.layers.0.mlp.gate"][1]).reshape(-1), minlength=5)
    unused = [e for e in range(5) if load[e] == 0]
    expert = unused[0] if unused else int(np.argmin(load))
    experts = flax.model.layers[0].mlp.experts
    experts.down_proj.set_value(experts.down_proj[...].at[expert].multiply(1.5))
    report = bisect(qwen2, flax, inputs)
    assert not report.passed
    assert [r.expert for r in report.experts["model.layers.0.mlp.experts"] if not r.passed] == [expert]


def _routes(torch_model, inputs):
    with torch.no_grad():
        return routing.torch_routes(torch_model, ["model.layers.0.mlp.gate"], tuple(map(torch.as_tensor, inputs)), {})


def test_a_dense_model_has_no_routing_report(inputs):
    config = LlamaConfig.tiny(vocab_size=64, num_hidden_layers=1)
    torch.manual_seed(0)
    dense = LlamaForCausalLM(config).eval()
    report = compare(dense, porting.torch_to_flax(dense), inputs)
    assert report.routing is None and "routing" not in report.summary() and report.passed
