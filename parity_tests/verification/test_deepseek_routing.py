"""DeepSeek-V3's router under ``routing.py``: near ties told from divergences in both of its steps.

The router keeps the ``topk_group`` groups whose two best corrected scores (sigmoid + correction bias)
sum highest, then takes the top k corrected scores within them; the weights are the scores without the
bias. A near tie can be between two experts or between two groups (whose experts then differ by far
more than rounding). ``routing.judge`` on hand-built routes: a JAX choice float64 could have made is a
near tie, one a clear margin away is reported with its token; then ``compare`` on a tiny DeepSeek-V3
(``llama_specs.deepseek_configs``): every expert tied (torch re-run with JAX's choices and DeepSeek's own
weights: the port passes at 1e-5) and a correction bias dropped in JAX (the router named, its tokens).
"""

import numpy as np
import pytest
import torch

from flax_transformer.interop import porting
from flax_transformer.verification import routing
from flax_transformer.verification.compare import compare
from flax_transformer.verification.llama_specs import deepseek_configs
from torch_reference.llama import LlamaForCausalLM

# 8 experts in 4 groups of 2, the best 2 groups kept, top 3; a bias of -0.5 puts the corrected scores
# (sigmoid(logits) + bias) in (-0.5, 0.5)
GROUPS = routing.GroupLimited(np.full(8, -0.5), n_group=4, topk_group=2)


def routes(corrected: np.ndarray, torch_choice, jax_choice):
    """The three runs' routes of one token whose float64 corrected scores are ``corrected`` (E,): its
    logits, in float32 for torch and JAX."""
    logits = np.log((corrected + 0.5) / (0.5 - corrected))[None]  # sigmoid(logits) - 0.5 = corrected
    low = logits.astype(np.float32)
    return ({"gate": (low, np.array([torch_choice]), GROUPS)}, {"gate": (logits, np.array([torch_choice]), GROUPS)},
            {"gate": (low, np.array([jax_choice]), GROUPS)})


def scores(eps_expert: float, eps_group: float) -> np.ndarray:
    """Corrected scores of one token whose float64 choice is groups 0 and 2, experts 0, 1 and 4: expert 5
    trails expert 4 by ``eps_expert``; group 1 (experts 2: 0.39, and 3) sums ``eps_group`` less than
    group 2 (experts 4: 0.2, and 5)."""
    group2 = (0.2, 0.2 - eps_expert)
    group1 = (0.39, sum(group2) - eps_group - 0.39)
    return np.array([0.30, 0.29, *group1, *group2, -0.3, -0.31])


@pytest.mark.parametrize("kind, tie, jax_choice", [
    ("experts", True, [0, 1, 5]),  # expert 5 for 4, which it trails by 1e-9
    ("experts", False, [0, 1, 5]),  # ... which it trails by 0.05
    ("groups", True, [0, 1, 2]),  # group 1 for group 2, whose sum it trails by 1e-9 (expert 2 beats 4 by 0.19)
    ("groups", False, [0, 1, 2]),  # ... by 0.02
])
def test_a_near_tie_is_reported_and_a_clear_margin_diverges(kind, tie, jax_choice):
    gap = 1e-9 if tie else (0.05 if kind == "experts" else 0.02)
    corrected = scores(eps_expert=gap, eps_group=0.05) if kind == "experts" else scores(eps_expert=0.05, eps_group=gap)
    t32, t64, jax = routes(corrected, [0, 1, 4], jax_choice)
    check = routing.judge(t32, t64, jax).routers[0]
    assert check.differ == 1 and check.group_margin > 0 and check.margin > 0
    assert check.near_ties == (1 if tie else 0) and check.diverged == (not tie), check.line()
    if tie:
        assert check.worst_gap <= 1e-8 and "DIVERGE" not in check.line()
    else:  # the shortfall is the step's own: the experts' gap, or the groups' sums
        assert check.worst_gap == pytest.approx(gap, rel=1e-6), check.worst_gap
        assert f"token 0: torch [0, 1, 4], JAX {jax_choice}, float64 gap {gap:.2e}" in check.line()
    assert routing.judge(t32, t64, {"gate": (t32["gate"][0], np.array([[4, 0, 1]]), GROUPS)}).routers[0].differ == 0


def test_groups_beyond_topk_group_are_never_a_tie():
    """A choice drawing on three groups when two are kept: no rounding makes it."""
    t32, t64, jax = routes(scores(eps_expert=1e-9, eps_group=0.05), [0, 1, 4], [0, 2, 4])
    check = routing.judge(t32, t64, jax).routers[0]
    assert check.diverged and check.worst_gap == float("inf")


@pytest.fixture(scope="module")
def deepseek():
    torch.manual_seed(0)
    model = LlamaForCausalLM(deepseek_configs(vocab=40, emb=24)[0]).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(0.4 * torch.randn(8))
    return model


@pytest.mark.slow(reason="test_a_near_tie_is_reported_and_a_clear_margin_diverges (the judging), "
                         "test_a_dropped_correction_bias_is_named_with_its_tokens (compare's routing check)")
def test_every_expert_tied_passes_with_deepseek_weights(deepseek):
    """Every expert of the sparse layer scores the same (all gate rows equal, no bias): torch and JAX may
    take any 3 of any 2 groups. Their choices differ somewhere, each a near tie; torch re-runs with JAX's
    choices, weighted by DeepSeek's rule (sigmoid, renormalised, times 2.5), and the port passes."""
    tied = LlamaForCausalLM(deepseek.config).eval()
    tied.load_state_dict(deepseek.state_dict())
    with torch.no_grad():
        gate = tied.model.layers[1].mlp.gate
        gate.weight[:] = gate.weight[0]
        gate.e_score_correction_bias.zero_()
    ids = np.random.default_rng(0).integers(0, 40, (2, 9))
    report = compare(tied, porting.torch_to_flax(tied), (ids,))
    check = report.routing.routers[0]
    assert check.path == "model.layers.1.mlp.gate" and check.group_margin > 0
    assert check.differ > 0 and check.near_ties == check.differ, report.summary()
    assert report.routing.forced and report.passed and report.max_abs_err <= 1e-5, report.summary()


@pytest.mark.slow(reason="test_a_near_tie_is_reported_and_a_clear_margin_diverges (the judging), "
                         "test_flax_model_forward_both_ways (compare's routing check on a DeepSeek-V3)")
def test_a_dropped_correction_bias_is_named_with_its_tokens(deepseek):
    """A converter that left the correction bias at zero in JAX: the router diverges, named, a clear margin
    beyond its near-tie margins; the correct port passes with its routing checked."""
    ids = np.random.default_rng(1).integers(0, 40, (2, 9))
    flax = porting.torch_to_flax(deepseek)
    good = compare(deepseek, flax, (ids,))
    assert good.passed and good.routing is not None and not good.routing.routers[0].differ, good.summary()
    bias = flax.model.layers[1].mlp.gate.e_score_correction_bias
    bias.set_value(bias[...] * 0)
    report = compare(deepseek, flax, (ids,))
    bad = [r for r in report.routing.routers if r.diverged]
    assert not report.passed and [r.path for r in bad] == ["model.layers.1.mlp.gate"], report.summary()
    assert bad[0].worst_gap > 10 * max(bad[0].margin, bad[0].group_margin) and bad[0].examples
    assert "DIVERGE" in report.summary() and report.to_dict()["routing"]["routers"][0]["group_margin"] > 0


@pytest.mark.slow(reason="test_a_near_tie_is_reported_and_a_clear_margin_diverges (the routing judged), "
                         "test_flax_model_forward_both_ways (compare on a DeepSeek-V3)")
def test_the_same_experts_in_another_order_are_no_divergence(deepseek, monkeypatch):
    """A router that lists each token's experts in another order (two chosen experts closer than the
    precision orders them do that) changes no block's output, but its own outputs differ position by
    position: torch re-runs with JAX's order, and ``bisect`` passes the sparse layer. JAX's router is made to
    list them smallest first here (torch: largest first)."""
    from flax_transformer.models import moe
    from flax_transformer.verification import bisect

    plain = moe.group_limited_route

    def backwards(*args, **kwargs):
        weights, experts = plain(*args, **kwargs)
        return weights[:, ::-1], experts[:, ::-1]

    monkeypatch.setattr(moe, "group_limited_route", backwards)
    layer = deepseek.model.layers[1]  # the sparse one
    x = torch.from_numpy(np.random.default_rng(1).normal(size=(2, 9, 24)).astype(np.float32))
    found = bisect.bisect(layer, porting.torch_to_flax(layer), (x,), use_jit=False)
    assert found.routing.reordered == 18 and found.routing.forced, found.summary()
    assert found.first_divergent is None and found.passed, found.summary()
    assert "18 the same experts in another order" in "\n".join(found.routing.lines())


@pytest.mark.slow(reason="test_a_near_tie_is_reported_and_a_clear_margin_diverges (the routing judged)")
def test_a_bf16_port_passes_bisect_eagerly():
    """A correct DeepSeek-V3 port computing in bf16, bisected eagerly: the routing is judged on the eager run
    that bisect compares (a compiled one may order a bf16 near tie the other way, and forcing its choices
    left the experts' inputs apart: 8.7 budgets at ``mlp.experts``), so it passes."""
    import jax.numpy as jnp

    from flax_transformer.verification import bisect, verify

    spec = next(s for s in verify.specs() if s.family == "deepseek" and s.name in verify.MODELS)
    torch_model, args, kwargs = verify.case_inputs(spec, "causal", 0)
    verify.perturb_torch(torch_model, 0)
    flax = porting.torch_to_flax(torch_model, dtype=jnp.bfloat16)
    report = bisect.bisect(torch_model, flax, args, kwargs, use_jit=False)
    assert report.precision == "bfloat16" and report.first_divergent is None, report.summary()
    assert report.routing is not None and report.routing.passed, report.summary()
