"""GPT-OSS's mixture of experts (``moe.GptOssMLP``: a router with a bias, top-k of the logits then a
softmax over the k; experts with biases, gate and up interleaved, the clamped SwiGLU): torch_reference
against transformers 5's ``GptOssMLP`` (its default ``grouped_mm`` experts and the ``eager`` loop), Flax
against torch_reference for every experts implementation, both porting directions, and a whole
2-layer ``GptOssForCausalLM`` (sinks, the sliding window, YaRN past the original context, padding) with
its router logits and ``aux_loss``.

Tiny configs, every bias moved away from zero, ``swiglu_limit`` small enough that the clamps bite
(checked). Tolerance: max abs error <= 1e-5 in fp32 with matmul precision "highest" (TOL); gradients
relative to their scale (max(1, max |g|)), as ``compare`` reports them.
"""

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import torch_reference.llama as tl
from flax_transformer.interop import porting
from flax_transformer.models import llama as fl
from flax_transformer.models import moe as fmoe
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification.compare import compare
from flax_transformer.verification.verify import perturb_flax, perturb_torch
from parity_tests.conftest import TOL
from torch_reference import moe as tmoe

B, T, VOCAB, LIMIT = 2, 13, 61, 0.6


def hf_config(**override):
    """A tiny GPT-OSS: 5 experts, top 2, a 4-key window on alternate layers, YaRN with an original
    context of 8 (positions beyond it in every test), sinks (transformers' init: normal)."""
    return transformers.GptOssConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=5, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, swiglu_limit=LIMIT, attn_implementation="eager",
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
                             original_max_position_embeddings=8, truncate=False)), **override})


def moved(model, seed, *, fresh=False):
    """Every parameter moved (the biases start at zero in transformers, the norms at one); ``fresh``: set
    (a block built alone holds ``torch.empty`` until a model's ``post_init``)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = 0.3 * torch.randn(p.shape, generator=generator)
            p.copy_(noise) if fresh else p.add_(noise)
    return model


@pytest.fixture(scope="module")
def blocks():
    """(transformers' GptOssMLP, the torch_reference twin with its weights, the config)."""
    config = hf_config()
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    theirs = moved(transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(config), seed=1, fresh=True)
    ours = tmoe.GptOssMLP(LlamaConfig.from_hf(config))
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours, config


def _run(block, x, weights):
    """(output, router scores, d<output, weights>/d(input and every parameter))."""
    block.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, scores = block(x)
    ((out * weights).sum() + scores.sum() * 0.5).backward()
    grads = {k: p.grad.numpy() for k, p in block.named_parameters()}
    return out.detach().numpy(), scores.detach().numpy(), x.grad.numpy(), grads


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_torch_reference_block_equals_transformers(blocks, implementation):
    """Outputs, router scores and the gradients of the input and of every parameter (router weight and
    bias, both expert weights and biases) against transformers' GptOssMLP, each experts backend."""
    theirs, ours, config = blocks
    config._experts_implementation = implementation
    x = torch.randn(B, T, config.hidden_size, generator=torch.Generator().manual_seed(2))
    weights = torch.randn(B, T, config.hidden_size, generator=torch.Generator().manual_seed(3))
    try:
        expected, got = _run(theirs, x, weights), _run(ours, x, weights)
    finally:
        config._experts_implementation = "grouped_mm"
    gate_up = (x.reshape(-1, config.hidden_size) @ ours.experts.gate_up_proj[0] + ours.experts.gate_up_proj_bias[0])
    assert (gate_up[:, ::2] > LIMIT).any() and (gate_up[:, 1::2].abs() > LIMIT).any(), "the clamps must bite"
    for name, want, have in zip(("output", "router scores", "input gradient"), expected[:3], got[:3], strict=True):
        assert np.abs(want - have).max() <= TOL, f"{implementation}: {name}: {np.abs(want - have).max():.3g}"
    assert set(expected[3]) == set(got[3]) == {"router.weight", "router.bias", "experts.gate_up_proj",
                                               "experts.gate_up_proj_bias", "experts.down_proj",
                                               "experts.down_proj_bias"}
    for key, want in expected[3].items():
        err = np.abs(want - got[3][key]).max() / max(1.0, np.abs(want).max())
        assert err <= TOL and np.abs(want).max() > 0, f"{implementation}: {key} gradient: {err:.3g}"


@pytest.mark.parametrize("implementation", fmoe.IMPLEMENTATIONS)
@pytest.mark.slow_cases({"blocked": "test_flax_block_equals_torch_reference[grouped] (blocked on the CPU)",
                         "dense": "test_flax_block_equals_torch_reference[grouped] and [ragged] (the same gating "
                                  "and biases through run_experts; dense is the slow reference)"})
def test_flax_block_equals_torch_reference(blocks, implementation):
    """torch -> Flax (``porting.torch_to_flax`` into a ``moe.GptOssMLP``: the experts' arrays as they are)
    for each experts implementation, and for "grouped" also Flax -> torch (every Flax weight moved,
    ``porting.flax_to_torch``): outputs, router scores and every parameter's gradient under jit
    (``compare``, with its float64 budget)."""
    _, ours, config = blocks
    x = np.random.default_rng(4).standard_normal((B, T, config.hidden_size)).astype(np.float32)
    cfg = LlamaConfig.from_hf(config)
    flax_block = porting.torch_to_flax(ours, fmoe.GptOssMLP(cfg, rngs=nnx.Rngs(0)))
    assert fmoe.set_experts(flax_block, implementation) == 1
    np.testing.assert_array_equal(np.asarray(flax_block.experts.gate_up_proj[...]),
                                  ours.experts.gate_up_proj.detach().numpy())  # no transpose: the same layout
    pairs = [("torch -> Flax", ours, flax_block)]
    if implementation == "grouped":  # the other direction once: the port is the same for every implementation
        moved_flax = nnx.clone(flax_block)
        perturb_flax(moved_flax, seed=5)
        pairs.append(("Flax -> torch", porting.flax_to_torch(moved_flax, tmoe.GptOssMLP(cfg)), moved_flax))
    for direction, torch_side, flax_side in pairs:
        report = compare(torch_side, flax_side, (x,), grads=True, tol=TOL)
        assert report.passed and report.grad_err <= TOL, f"{implementation}, {direction}:\n{report}"


def test_routing_is_gpt_oss_own():
    """Hand-set router: softmax over the top k logits only (not over all experts, then top k), the bias
    counted; and the clamped SwiGLU on interleaved (gate, up) columns, both clamps at work."""
    cfg = LlamaConfig.from_hf(hf_config(num_local_experts=3, num_experts_per_tok=2, hidden_size=32))
    block = tmoe.GptOssMLP(cfg)
    with torch.no_grad():
        block.router.weight.zero_()
        block.router.bias.copy_(torch.tensor([1.0, 0.0, 3.0]))
    with torch.no_grad():
        logits, scores, experts = block.router(torch.zeros(1, 32))
    assert experts.tolist() == [[2, 0]]
    np.testing.assert_allclose(scores.numpy(), [[1 / (1 + np.exp(-2.0)), 1 / (1 + np.exp(2.0))]], rtol=1e-6)
    flax_router = porting.torch_to_flax(block.router, fmoe.GptOssTopKRouter(cfg, rngs=nnx.Rngs(0)))
    np.testing.assert_allclose(np.asarray(flax_router(np.zeros((1, 32), np.float32))[1]), scores.numpy(), rtol=1e-6)
    h = torch.tensor([[0.1, 5.0, 0.2, -5.0]])  # (gate, up) pairs: (0.1, 5.0), (0.2, -5.0)
    gate, up = torch.tensor([0.1, 0.2]), torch.tensor([LIMIT, -LIMIT])
    want = (up + 1) * gate * torch.sigmoid(gate * 1.702)
    h[0, 0] = 0.1  # gate 0.1 (under the limit), up 5.0 (clamped to the limit); gate 9.0 would be clamped too
    torch.testing.assert_close(block.experts._apply_gate(h)[0], want)
    over = block.experts._apply_gate(torch.tensor([[9.0, 0.0]]))[0, 0]
    torch.testing.assert_close(over, torch.tensor(LIMIT * torch.sigmoid(torch.tensor(LIMIT * 1.702)).item()))
    jax_gate = fmoe._clamped_swiglu(h.numpy(), LIMIT, 1.702)
    np.testing.assert_allclose(np.asarray(jax_gate)[0], want.numpy(), rtol=1e-6)


@pytest.fixture(scope="module")
def causal_lms():
    """(transformers' GptOssForCausalLM, torch_reference's, Flax's), one random set of weights."""
    torch.manual_seed(6)
    theirs = moved(transformers.GptOssForCausalLM(hf_config()).eval(), seed=7)
    cfg = LlamaConfig.from_hf(theirs.config)
    ours = tl.LlamaForCausalLM(cfg).eval()
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours, porting.torch_to_flax(ours)


def padded():
    ids = np.random.default_rng(8).integers(0, VOCAB, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, 9:] = 0  # right padding: every query sees a key
    return ids, mask


@nnx.jit
def _flax_forward(model, ids, mask):
    return model(ids, attention_mask=mask, output_router_logits=True)


def test_causal_lm_logits_router_logits_and_aux_loss(causal_lms):
    """Two layers (a sliding one and a full one, sinks, YaRN past the original context of 8), a padded
    batch: logits, every layer's (b t, E) router logits and ``aux_loss`` (GPT-OSS's load_balancing_loss_func
    is Mixtral's: ``moe.load_balancing_loss``) against transformers: torch_reference with and without the
    mask, Flax with it."""
    theirs, ours, flax_model = causal_lms
    assert isinstance(flax_model.model.layers[0].mlp, fmoe.GptOssMLP) and isinstance(ours.model.layers[1].mlp,
                                                                                      tmoe.GptOssMLP)
    ids, mask = padded()
    kept = mask.astype(bool)
    for attention_mask in (mask, None):
        tm = None if attention_mask is None else torch.from_numpy(attention_mask)
        with torch.no_grad():
            want = theirs(torch.from_numpy(ids), attention_mask=tm, output_router_logits=True)
            logits, router = ours(torch.from_numpy(ids), attention_mask=tm, output_router_logits=True)
        # Flax once, with the mask (jitted: eagerly each op would compile on its own)
        flax_logits, flax_router = (_flax_forward(flax_model, ids, attention_mask) if attention_mask is not None
                                    else (logits, router))
        rows = kept if attention_mask is not None else np.ones_like(kept)
        for name, have in (("torch_reference", logits.numpy()), ("Flax", np.asarray(flax_logits))):
            err = np.abs(have - want.logits.numpy())[rows].max()
            assert err <= TOL, f"{name} logits (mask={attention_mask is not None}): {err:.3g}"
        assert len(router) == len(flax_router) == len(want.router_logits) == 2
        for layer, (a, b, c) in enumerate(zip(want.router_logits, router, flax_router, strict=True)):
            assert a.shape == (B * T, 5)
            assert np.abs(a.numpy() - b.numpy()).max() <= TOL and np.abs(a.numpy() - np.asarray(c)).max() <= TOL, layer
        aux_ours = tmoe.load_balancing_loss(list(router), 5, 2, tm)
        aux_flax = fmoe.load_balancing_loss([np.asarray(r) for r in flax_router], 5, 2, attention_mask)
        assert abs(aux_ours.item() - want.aux_loss.item()) <= TOL and abs(float(aux_flax) - want.aux_loss.item()) <= TOL


def test_every_layer_sparse_and_set_experts_reaches_them(causal_lms):
    """Every GPT-OSS layer holds a GptOssMLP (no dense layers), and ``set_experts`` counts their experts."""
    _, ours, flax_model = causal_lms
    assert all(isinstance(layer.mlp, tmoe.GptOssMLP) for layer in ours.model.layers)
    assert fmoe.set_experts(flax_model, "dense") == 2
    assert fmoe.set_experts(flax_model, "grouped") == 2
    assert all(isinstance(layer.mlp, fl.LlamaSparseMoeBlock) is False for layer in flax_model.model.layers)


@pytest.mark.slow(reason="test_flax_block_equals_torch_reference[grouped] (the block's gradients both ways), "
                         "test_causal_lm_logits_router_logits_and_aux_loss (the model forward)")
def test_causal_lm_gradients_both_ways(causal_lms):
    """The whole model under jit, torch -> Flax and Flax -> torch: logits and every parameter's gradient
    (``compare``, with its float64 budget)."""
    _, ours, flax_model = causal_lms
    ids, mask = padded()
    moved_flax = nnx.clone(flax_model)
    perturb_flax(moved_flax, seed=9)
    back = porting.flax_to_torch(moved_flax)
    perturb_torch(back, seed=0)  # the torch side then moves again: a fresh pair
    flax_again = porting.torch_to_flax(back)
    for torch_side, flax_side in ((ours, flax_model), (back, flax_again)):
        report = compare(torch_side, flax_side, (ids, mask), grads=True, tol=TOL)
        assert report.passed and report.grad_err <= TOL, str(report)
