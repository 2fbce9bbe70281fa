"""DeepSeek-V3 (issue 35, item 4): torch_reference against transformers 5's own classes
(``DeepseekV3TopkRouter``, ``DeepseekV3MoE``, ``DeepseekV3Attention``, ``DeepseekV3DecoderLayer``,
``DeepseekV3ForCausalLM``), forward and every parameter's gradient; then Flax against torch_reference,
both porting directions (``torch_to_flax``, ``flax_to_torch``), forward and gradients, padding and a
fully masked row, under jit and eagerly.

Two tiny random configs cover every switch between them (``VARIANTS``): queries through the low-rank
pair (``q_lora_rank``) or a plain ``q_proj``; RoPE interleaved or half-split; attention biases or none;
one or two shared experts; renormalised top-k or not. Both: YaRN by 4 with ``mscale`` and a different
``mscale_all_dim`` (the softmax scale changes) at positions up to 110, past the original context of 16;
8 experts in 4 groups, the best 2 groups kept, top 3 within them (``routed_scaling_factor`` 2.5); the
first layer dense (``first_k_dense_replace`` 1). The correction biases are drawn so that they change
the choice, and the group limit changes it too: ``test_router_and_moe_equal_transformers`` asserts
both on its own inputs.

The correction bias is a torch buffer (no gradient) and an ``nnx.Param`` in Flax whose gradient is zero
(``stop_gradient``): ``compare`` checks that Flax gradient against zero, exactly (a float64 reference of 0,
budget 0), and it is listed among the checked gradients.

Tolerance: max abs error <= 1e-5 in fp32 with matmul precision "highest" (TOL); gradients relative to
their scale (max(1, max |g|)), as ``compare`` reports them. Where transformers computes a query that
sees no key (left padding), it gives the mean of the values and this library zeros: those positions
are left out against transformers, and kept (with a fully masked row) Flax against torch_reference.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import torch_reference.llama as tl
from flax_transformer.interop import porting
from flax_transformer.models import moe as fmoe
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification.compare import compare
from flax_transformer.verification.verify import perturb_flax
from parity_tests.conftest import TOL
from torch_reference import moe as tmoe

B, T, VOCAB = 3, 9, 48
OFFSETS = np.array([0, 40, 101])  # each row's first position: YaRN's original context is 16
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0)
BASE = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=3, first_k_dense_replace=1, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=6, routed_scaling_factor=2.5, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_parameters=YARN)
VARIANTS = {
    "q-lora-interleaved-biases": dict(q_lora_rank=8, rope_interleave=True, attention_bias=True, n_shared_experts=1,
                                      norm_topk_prob=True),
    "q-proj-half-split": dict(q_lora_rank=None, rope_interleave=False, attention_bias=False, n_shared_experts=2,
                              norm_topk_prob=False),
}


def hf_model(variant: str, seed: int = 0):
    """transformers' DeepseekV3ForCausalLM of ``variant``, eager attention, every parameter moved (fresh
    norms are ones, the router's weight small) by N(0, 0.2^2), and correction biases from N(0, 0.4^2)."""
    config = transformers.DeepseekV3Config(**BASE, **VARIANTS[variant])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.4 * torch.randn(buffer.shape))
    return model


def reference_of(theirs):
    """torch_reference's twin of transformers' model, its state_dict loaded strictly."""
    ours = tl.LlamaForCausalLM(LlamaConfig.from_hf(theirs.config)).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request):
    """(variant, transformers' model, torch_reference's)."""
    theirs = hf_model(request.param)
    return request.param, theirs, reference_of(theirs)


def padded(*, empty_rows: bool):
    """ids, mask, positions (from OFFSETS): row 1 right-padded and row 2 left-padded; with ``empty_rows``
    row 0 has no token at all."""
    ids = np.random.default_rng(0).integers(0, VOCAB, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, 6:] = 0
    mask[2, :3] = 0
    if empty_rows:
        mask[0] = 0
    return ids, mask, OFFSETS[:, None] + np.arange(T)[None]


def causal_4d(mask: np.ndarray) -> torch.Tensor:
    """transformers' additive (b, 1, t, t) mask: causal and the padded keys at float32's min."""
    keep = np.tril(np.ones((T, T), bool))[None] & mask.astype(bool)[:, None, :]
    return torch.from_numpy(np.where(keep, 0.0, np.finfo(np.float32).min).astype(np.float32))[:, None]


def _run(module, call, x, weights):
    """(output, d<output, weights>/d input, {name: d/d parameter}) of ``call(module, x)``."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = call(module, x)
    (out * weights).sum().backward()
    return out.detach().numpy(), x.grad.numpy(), {k: p.grad.numpy() for k, p in module.named_parameters()}


def assert_same(name, want, got, rows=None):
    """Outputs (on ``rows`` where given) and every parameter's gradient within TOL, the same keys."""
    pick = (lambda a: a[rows]) if rows is not None else (lambda a: a)
    err = np.abs(pick(want[0]) - pick(got[0])).max()
    assert err <= TOL, f"{name}: output {err:.3g}"
    assert np.abs(want[1] - got[1]).max() <= TOL, f"{name}: input gradient"
    assert want[2].keys() == got[2].keys(), (name, sorted(want[2]), sorted(got[2]))
    for key, g in want[2].items():
        gerr = np.abs(g - got[2][key]).max() / max(1.0, np.abs(g).max())
        assert gerr <= TOL and np.abs(g).max() > 0, f"{name}: {key} gradient {gerr:.3g} (max {np.abs(g).max():.3g})"


# ------------------------------------------------------------------ torch_reference against transformers


def routes(gate, x, *, bias=True, groups=None):
    """The experts (sorted) a DeepSeek router of torch_reference chooses for ``x``: with its bias or none,
    with its group limit or ``groups`` kept."""
    with torch.no_grad():
        logits = torch.nn.functional.linear(x, gate.weight)
        chosen = tmoe.group_limited_route(logits, gate.e_score_correction_bias * bias, gate.top_k, gate.n_group,
                                          groups or gate.topk_group, gate.norm_topk_prob, 1.0)[1]
    return chosen.sort(-1).values


def test_router_and_moe_equal_transformers(models):
    """The router (logits, and weights matched by expert: transformers' top-k is unsorted) and the sparse
    block (shared experts always on) against transformers', outputs and gradients; and on these inputs
    the correction bias and the group limit each change some token's experts."""
    variant, theirs, ours = models
    x = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(1))
    w = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(2))
    gate = ours.model.layers[1].mlp.gate
    flat = x.reshape(-1, 16)
    chosen = routes(gate, flat)
    assert (chosen != routes(gate, flat, bias=False)).any(1).sum() >= 3, "the correction bias must change choices"
    assert (chosen != routes(gate, flat, groups=gate.n_group)).any(1).sum() >= 3, "the group limit must bite"
    outputs = []
    for model in (theirs, ours):
        router = model.model.layers[1].mlp.gate
        logits, weights, experts = router(flat)
        order = experts.argsort(-1)
        outputs.append((logits.detach().numpy(), experts.gather(1, order).numpy(), weights.gather(1, order)))
        router.zero_grad(set_to_none=True)
        (outputs[-1][2] * torch.arange(1.0, 4.0)).sum().backward()  # the weights' gradient by expert order
        outputs[-1] += (router.weight.grad.numpy(),)
    (l1, e1, w1, g1), (l2, e2, w2, g2) = outputs
    assert np.abs(l1 - l2).max() <= TOL and np.array_equal(e1, e2) and np.array_equal(e2, chosen.numpy())
    assert np.abs(w1.detach().numpy() - w2.detach().numpy()).max() <= TOL
    assert np.abs(g1 - g2).max() / max(1.0, np.abs(g1).max()) <= TOL and np.abs(g1).max() > 0
    assert set(dict(theirs.model.layers[1].mlp.gate.named_buffers())) == {"e_score_correction_bias"}
    call = lambda m, h: m(h)  # noqa: E731
    assert_same(f"{variant} DeepseekV3MoE", _run(theirs.model.layers[1].mlp, call, x, w),
                _run(ours.model.layers[1].mlp, call, x, w))


def test_attention_and_layers_equal_transformers(models):
    """DeepseekV3Attention and the dense (layer 0) and sparse (layer 1) decoder layers against transformers',
    at positions past the original context, right- and left-padded rows (left padding's first queries see
    no key: left out), outputs and every parameter's gradient."""
    variant, theirs, ours = models
    ids, mask, positions = padded(empty_rows=False)
    x = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(3))
    w = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(4)) * torch.from_numpy(mask)[..., None]
    pos, mask4 = torch.from_numpy(positions), causal_4d(mask)
    rope = theirs.model.rotary_emb(x, pos)
    hf_attention = lambda m, h: m(h, position_embeddings=rope, attention_mask=mask4)[0]  # noqa: E731
    hf_layer = lambda m, h: m(h, attention_mask=mask4, position_ids=pos, position_embeddings=rope)  # noqa: E731
    ours_call = lambda m, h: m(h, torch.from_numpy(mask), pos)  # noqa: E731
    rows = mask.astype(bool)
    pairs = [("DeepseekV3Attention", theirs.model.layers[0].self_attn, ours.model.layers[0].self_attn, hf_attention)]
    pairs += [(f"DeepseekV3DecoderLayer {i}", theirs.model.layers[i], ours.model.layers[i], hf_layer) for i in (0, 1)]
    assert isinstance(ours.model.layers[0].mlp, tl.LlamaMLP) and isinstance(ours.model.layers[1].mlp, tmoe.DeepseekV3MoE)
    for name, a, b, hf_call in pairs:
        assert_same(f"{variant} {name}", _run(a, hf_call, x, w), _run(b, ours_call, x, w), rows)


def test_causal_lm_equals_transformers(models):
    """DeepseekV3ForCausalLM: logits on real tokens and every parameter's gradient (the correction biases
    are buffers on both sides), padded rows, positions past the original context."""
    variant, theirs, ours = models
    ids, mask, positions = padded(empty_rows=False)
    w = np.random.default_rng(5).standard_normal((B, T, VOCAB)).astype(np.float32) * mask[..., None]
    args = [torch.from_numpy(a) for a in (ids, mask, positions)]
    hf_call = lambda m, i: m(i, attention_mask=args[1], position_ids=args[2], use_cache=False).logits  # noqa: E731
    ours_call = lambda m, i: m(i, args[1], args[2])  # noqa: E731
    results = []
    for model, call in ((theirs, hf_call), (ours, ours_call)):
        model.zero_grad(set_to_none=True)
        logits = call(model, args[0])
        (logits * torch.from_numpy(w)).sum().backward()
        results.append((logits.detach().numpy(), {k: p.grad for k, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert np.abs(want - got)[mask.astype(bool)].max() <= TOL, f"{variant}: logits"
    assert want_grads.keys() == got_grads.keys()
    for key, g in want_grads.items():
        g = g.numpy()
        err = np.abs(g - got_grads[key].numpy()).max() / max(1.0, np.abs(g).max())
        assert err <= TOL, f"{variant}: {key} gradient {err:.3g}"


# ------------------------------------------------------------------ Flax against torch_reference


def flax_pairs(reference, seed=7):
    """[(direction, torch side, Flax side)]: torch -> Flax, and Flax -> torch from a copy whose every
    parameter (the correction biases too) moved by numpy noise."""
    flax_model = porting.torch_to_flax(reference)
    moved = nnx.clone(flax_model)
    perturb_flax(moved, seed)
    return [("torch -> Flax", reference, flax_model), ("Flax -> torch", porting.flax_to_torch(moved), moved)]


def _assert_bias_gradient_checked(report):
    checked = [r for r in report.rows if r.module.endswith("e_score_correction_bias")]
    assert checked and all(r.max_abs_err == 0.0 and not r.skipped for r in checked), report.summary()


@pytest.mark.parametrize("models", ["q-lora-interleaved-biases"], indirect=True)  # the other: with gradients
def test_flax_model_forward_both_ways(models):
    """The whole model under jit, torch -> Flax and Flax -> torch, forward only: logits with a fully masked
    row, a right- and a left-padded one (finite everywhere) at positions past the original context
    (``compare`` with its float64 budget and its routing check: the sparse layer's group-limited router
    judged, near ties apart)."""
    variant, _, ours = models
    args = padded(empty_rows=True)
    for direction, torch_side, flax_side in flax_pairs(ours):
        report = compare(torch_side, flax_side, args, tol=TOL)
        assert report.passed, f"{variant}, {direction}:\n{report}"
        routers = report.routing.routers
        assert [r.path for r in routers] == ["model.layers.1.mlp.gate"] and routers[0].group_margin > 0, report.summary()


@pytest.mark.slow(reason="test_flax_model_forward_both_ways (the same model forward), test_router_and_moe_equal_"
                         "transformers and test_causal_lm_equals_transformers (torch_reference's gradients)")
def test_flax_model_both_ways(models):
    """The whole model under jit, torch -> Flax and Flax -> torch: logits with a fully masked row, a right-
    and a left-padded one (finite everywhere) at positions past the original context, and every
    parameter's gradient (``compare`` with its float64 budget; the correction biases' gradients zero)."""
    variant, _, ours = models
    args = padded(empty_rows=True)
    for direction, torch_side, flax_side in flax_pairs(ours):
        report = compare(torch_side, flax_side, args, grads=True, tol=TOL)
        assert report.passed and report.grad_err <= TOL, f"{variant}, {direction}:\n{report}"
        _assert_bias_gradient_checked(report)


@pytest.mark.slow(reason="test_flax_model_forward_both_ways (the same layers under jit)")
def test_flax_layers_eagerly():
    """Eagerly (op by op): the attention and the sparse decoder layer, torch -> Flax and Flax -> torch,
    a fully masked row, padding, positions past the original context; outputs, and the sparse layer's
    gradients (the router's among them). One variant: the plain q_proj and half-split RoPE (the other's
    layers run under jit in ``test_flax_model_both_ways``)."""
    variant = "q-proj-half-split"
    ours = reference_of(hf_model(variant))
    _, mask, positions = padded(empty_rows=True)
    x = np.random.default_rng(8).standard_normal((B, T, 16)).astype(np.float32)
    for name, module in (("attention", ours.model.layers[0].self_attn), ("sparse layer", ours.model.layers[1])):
        for direction, torch_side, flax_side in flax_pairs(module):
            report = compare(torch_side, flax_side, (x, mask, positions), grads=name == "sparse layer",
                             use_jit=False, tol=TOL)
            assert report.passed and np.all(np.isfinite(report.max_abs_err)), f"{variant} {name}, {direction}:\n{report}"
            if name == "sparse layer":
                _assert_bias_gradient_checked(report)


def test_flax_router_bias_chooses_only():
    """Flax's router: the bias changes the choice on these inputs, the weights are the scores'
    (not the corrected scores'), renormalised and scaled, and the bias's gradient is exactly zero."""
    flax_model = porting.torch_to_flax(reference_of(hf_model("q-lora-interleaved-biases")))  # no random init
    flax_block = flax_model.model.layers[1].mlp
    assert isinstance(flax_block, fmoe.DeepseekV3MoE)
    x = np.random.default_rng(9).standard_normal((B, T, 16)).astype(np.float32)

    @nnx.jit
    def route_and_grad(gate, h):  # one compile: the router's outputs and d sum(weights) / d its parameters
        return nnx.grad(lambda g: g(h)[1].sum())(gate), gate(h)

    grad, (logits, weights, experts) = route_and_grad(flax_block.gate, jnp.asarray(x.reshape(-1, 16)))
    scores = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    picked = np.take_along_axis(scores, np.asarray(experts), 1)
    np.testing.assert_allclose(np.asarray(weights), 2.5 * picked / picked.sum(1, keepdims=True), rtol=1e-5)
    unbiased = tmoe.group_limited_route(torch.from_numpy(np.asarray(logits)), torch.zeros(8), 3, 4, 2, True, 2.5)[1]
    assert (np.sort(unbiased.numpy(), 1) != np.sort(np.asarray(experts), 1)).any(1).sum() >= 3
    assert np.all(np.asarray(grad.e_score_correction_bias[...]) == 0) and np.abs(grad.weight[...]).max() > 0
