"""The llama family's mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): torch_reference
against transformers 5, Flax against torch_reference, and the MoE configs' checks.

Each kind is a tiny transformers model built from a config (no download), ``attn_implementation=
"eager"`` and its default experts backend ``grouped_mm``, every weight perturbed, with the odd
switches real checkpoints use or that catch convention bugs: uneven expert counts (5, 6, 7, 4), top-k
1 to 3, dense layers among sparse (``mlp_only_layers``, ``decoder_sparse_step=2``), a tied head,
Qwen3-MoE's head_dim unlike hidden / heads, OLMoE's ``clip_qkv``, Mixtral's sliding window and jitter.

Tolerance: max abs error <= 1e-5 in fp32 with matmul precision "highest" (TOL); gradients relative
to their scale (max(1, max |g|)), as ``test_llama``.
"""

import dataclasses

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
from flax_transformer.models.moe_config import MoeConfig
from flax_transformer.verification.compare import compare
from flax_transformer.verification.verify import perturb_torch
from parity_tests.conftest import TOL
from torch_reference import moe as tmoe

B, T, VOCAB = 3, 7, 64
COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, attn_implementation="eager", rms_norm_eps=1e-5)
# kind -> (transformers config class, switches)
KINDS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=12, num_local_experts=5, num_experts_per_tok=2,
                                      sliding_window=3, router_jitter_noise=0.2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=20, moe_intermediate_size=12, num_experts=6,
                                         num_experts_per_tok=3, shared_expert_intermediate_size=10,
                                         mlp_only_layers=[0], norm_topk_prob=False, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=20, moe_intermediate_size=12, num_experts=7,
                                         num_experts_per_tok=1, decoder_sparse_step=2, norm_topk_prob=True,
                                         head_dim=8)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=12, num_experts=4, num_experts_per_tok=3, clip_qkv=0.3,
                                  pad_token_id=None, eos_token_id=None)),
}


def hf_config(kind: str, **override):
    cls, switches = KINDS[kind]
    return getattr(transformers, cls)(**{**COMMON, **switches, **override})


def hf_model(kind: str, seed: int = 0, **override):
    """A transformers MoE model of a tiny random config, every weight moved (norms are ones fresh:
    a norm applied twice or skipped would hide; router weights spread, so top-k has no near ties)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **override)).eval()
    assert model.config._experts_implementation == "grouped_mm"  # the default this library matches
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    return model


def padded_inputs(seed=0):
    """ids (b, t) and a right-padded mask (row 0 whole, rows 1 and 2 shorter): every query sees a key."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, 5:] = 0
    mask[2, 2:] = 0
    return ids, mask


@pytest.fixture(scope="module", params=list(KINDS))
def kind_models(request):
    """(kind, transformers model, torch_reference twin loaded strictly from its state_dict)."""
    hf = hf_model(request.param)
    reference = tl.LlamaForCausalLM(LlamaConfig.from_hf(hf.config)).eval()
    reference.load_state_dict(hf.state_dict(), strict=True)
    return request.param, hf, reference


def _run(model, ids, mask, weights, *, hf: bool):
    """(logits, router logits, aux loss, gradients by name) of sum(logits * weights) + aux loss."""
    model.zero_grad(set_to_none=True)
    tids, tmask = torch.from_numpy(ids), torch.from_numpy(mask)
    if hf:
        out = model(input_ids=tids, attention_mask=tmask, output_router_logits=True, use_cache=False)
        logits, router, aux = out.logits, out.router_logits, out.aux_loss
    else:
        logits, router = model(tids, tmask, output_router_logits=True)
        moe = model.config.moe
        aux = tmoe.load_balancing_loss(router, moe.num_experts, moe.num_experts_per_tok, tmask)
    ((logits * torch.from_numpy(weights)).sum() + aux).backward()
    grads = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
    return logits.detach().numpy(), [r.detach().numpy() for r in router], aux.item(), grads


def test_torch_reference_equals_transformers(kind_models):
    """Logits on real tokens (padded rows), each sparse layer's router logits, the load-balancing loss
    (with the padding mask) and every parameter's gradient of sum(logits * W) + aux: torch_reference
    against transformers' own class."""
    kind, hf, reference = kind_models
    ids, mask = padded_inputs()
    keep = mask.astype(bool)
    weights = np.random.default_rng(1).standard_normal((B, T, VOCAB)).astype(np.float32) * keep[..., None]
    want, got = _run(hf, ids, mask, weights, hf=True), _run(reference, ids, mask, weights, hf=False)
    assert np.abs(got[0] - want[0])[keep].max() <= TOL, f"{kind}: logits"
    sparse = [i for i in range(hf.config.num_hidden_layers) if reference.config.moe.is_sparse(i)]
    assert len(got[1]) == len(want[1]) == len(sparse) >= 1, f"{kind}: one router output per sparse layer"
    for layer, (a, b) in zip(sparse, zip(got[1], want[1])):
        assert a.shape == b.shape == (B * T, reference.config.moe.num_experts)
        assert np.abs(a - b)[keep.reshape(-1)].max() <= TOL, f"{kind}: layer {layer}'s router logits"
    assert abs(got[2] - want[2]) <= TOL, f"{kind}: aux loss {got[2]} vs transformers' {want[2]}"
    assert got[3].keys() == want[3].keys() and len(got[3]) == len(dict(hf.named_parameters()))
    for key, g in want[3].items():
        err = np.abs(got[3][key] - g).max() / max(1.0, np.abs(g).max())
        assert err <= TOL, f"{kind}: {key} gradient, torch_reference vs transformers: {err:.3g}"
        if ".mlp.gate.weight" in key:
            assert np.abs(g).max() > 0, f"{kind}: {key} gets a gradient (through the weights and the aux loss)"


def test_aux_loss_without_padding_equals_transformers(kind_models):
    """No mask: every row counts (transformers' ``aux_loss`` without ``attention_mask``), and the
    value differs from the masked one (padding is left out, not ignored)."""
    kind, hf, reference = kind_models
    ids, mask = padded_inputs()
    moe = reference.config.moe
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids), output_router_logits=True, use_cache=False).aux_loss.item()
        _, router = reference(torch.from_numpy(ids), output_router_logits=True)
        got = tmoe.load_balancing_loss(router, moe.num_experts, moe.num_experts_per_tok).item()
        masked = tmoe.load_balancing_loss(router, moe.num_experts, moe.num_experts_per_tok,
                                          torch.from_numpy(mask)).item()
    assert abs(got - want) <= TOL and abs(got - masked) > 1e-4, (kind, got, want, masked)
    k = moe.num_experts_per_tok  # E * sum f_e P_e with sum f_e = k: between 0 and E * k, k when balanced
    assert 0 < got <= moe.num_experts * k


# ------------------------------------------------------------------ Flax against torch_reference


def masked_inputs(seed=0):
    """ids and a mask with a fully masked row 0 (its queries see no key: zeros, never NaN), a
    right-padded and a left-padded row."""
    ids, mask = padded_inputs(seed)
    mask[0] = 0
    mask[2] = 0
    mask[2, 3:] = 1
    return ids, mask


def flax_to_torch_perturbed(flax_model, seed=2):
    """The Flax -> torch direction: a copy of ``flax_model`` with every weight moved (numpy noise, so
    nothing new compiles) and its torch twin from ``porting.flax_to_torch``."""
    copy, rng = nnx.clone(flax_model), np.random.default_rng(seed)
    for _, param in nnx.iter_graph(copy):
        if isinstance(param, nnx.Param):
            value = np.asarray(param[...])
            param.set_value(jnp.asarray(value + 0.1 * rng.standard_normal(value.shape).astype(value.dtype)))
    return porting.flax_to_torch(copy), copy


@pytest.mark.slow(reason="test_sparse_block_both_ways_grouped_and_dense[qwen2_moe] (the block's gradients), "
                        "test_model_router_logits_and_aux_loss (the model forward), test_llama (the dense parts)")
def test_model_gradients_both_ways(kind_models):
    """The whole model under jit, torch -> Flax and Flax -> torch: logits with a fully masked row, a
    right- and a left-padded one (no NaN) and every parameter's gradient (``compare``, with its float64
    budget and its routing check)."""
    kind, _, reference = kind_models
    flax_model = porting.torch_to_flax(reference)
    ids, mask = masked_inputs()
    for torch_side, flax_side in ((reference, flax_model), flax_to_torch_perturbed(flax_model)):
        report = compare(torch_side, flax_side, (ids, mask), grads=True, tol=TOL)
        assert report.passed and report.grad_err <= TOL, f"{kind}:\n{report}"


@pytest.mark.slow_cases({
    "mixtral": "test_folder_reads_and_writes_back (Flax logits against transformers), "
                            "test_model_router_logits_and_aux_loss[olmoe]",
    "qwen2_moe": "test_folder_reads_and_writes_back (Flax logits against transformers), "
                            "test_model_router_logits_and_aux_loss[olmoe]",
    "qwen3_moe": "test_folder_reads_and_writes_back (Flax logits against transformers), "
                 "test_model_router_logits_and_aux_loss[olmoe]",
})
def test_model_router_logits_and_aux_loss(kind_models):
    """Flax against torch_reference, the whole model under one jit: logits with a fully masked row, a
    right- and a left-padded one (finite everywhere), each sparse layer's router logits, and the
    load-balancing loss in JAX equal to torch's, with and without the mask."""
    kind, _, reference = kind_models
    flax_model = porting.torch_to_flax(reference)
    ids, mask = masked_inputs()
    # compare traces a keyword's Python bool; the router logits come from a jit of their own
    logits, router = nnx.jit(lambda m, i, a: m(i, a, output_router_logits=True))(
        flax_model, jnp.asarray(ids), jnp.asarray(mask))
    with torch.no_grad():
        t_logits, t_router = reference(torch.from_numpy(ids), torch.from_numpy(mask), output_router_logits=True)
    assert np.all(np.isfinite(np.asarray(logits))) and np.abs(np.asarray(logits) - t_logits.numpy()).max() <= TOL
    moe = reference.config.moe
    assert len(router) == len(t_router) == sum(map(moe.is_sparse, range(reference.config.num_hidden_layers)))
    for a, b in zip(router, t_router):
        assert np.abs(np.asarray(a) - b.numpy()).max() <= TOL, f"{kind}: router logits"
    for m in (None, mask):
        got = fmoe.load_balancing_loss(router, moe.num_experts, moe.num_experts_per_tok,
                                       None if m is None else jnp.asarray(m))
        want = tmoe.load_balancing_loss(t_router, moe.num_experts, moe.num_experts_per_tok,
                                        None if m is None else torch.from_numpy(m))
        assert abs(float(got) - want.item()) <= TOL, f"{kind}: aux loss, mask={m is not None}"


def block_of(kind: str, seed=3):
    """The sparse block of ``kind``'s config alone (torch_reference), its weights moved."""
    block = tl.LlamaSparseMoeBlock(LlamaConfig.from_hf(hf_config(kind))).eval()
    perturb_torch(block, seed=seed)
    return block


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.slow_cases({
    "mixtral": "test_sparse_block_both_ways_grouped_and_dense[qwen2_moe], test_model_gradients_both_ways",
    "qwen3_moe": "test_sparse_block_both_ways_grouped_and_dense[qwen2_moe], test_model_gradients_both_ways",
    "olmoe": "test_sparse_block_both_ways_grouped_and_dense[qwen2_moe], test_model_gradients_both_ways",
})
def test_sparse_block_both_ways_grouped_and_dense(kind, rng):
    """The sparse block alone (Qwen2-MoE's: top-3 of 6 unnormalised, the gated shared expert): torch
    -> Flax and Flax -> torch with jax.grad of every parameter against torch autograd, jitted; then
    ``dense`` against torch, and both eagerly."""
    block = block_of(kind)
    x = rng.standard_normal((B, T, block.hidden_size)).astype(np.float32)
    flax_block = porting.torch_to_flax(block)
    back, moved = flax_to_torch_perturbed(flax_block)
    for torch_side, flax_side in ((block, flax_block), (back, moved)):
        report = compare(torch_side, flax_side, (x,), grads=True, tol=TOL)
        assert report.passed and report.grad_err <= TOL, f"{kind}, grouped, gradients:\n{report}"
    for impl in fmoe.IMPLEMENTATIONS:
        assert fmoe.set_experts(flax_block, impl) == 1
        for use_jit in (True, False) if impl == "dense" else (False,):
            report = compare(block, flax_block, (x,), use_jit=use_jit, fp64=False, tol=TOL)
            assert report.passed, f"{kind}, {impl}, jit={use_jit}:\n{report}"


def test_router_jitter_in_train_mode_only(rng):
    """Mixtral's jitter: in train mode the block's output changes with the ``dropout`` rng (and the
    same rng gives the same output); in eval mode no rng changes it, and it equals torch's."""
    block = block_of("mixtral")
    assert block.jitter_noise == 0.2
    x = jnp.asarray(rng.standard_normal((B, T, block.hidden_size)).astype(np.float32))
    with torch.no_grad():
        want = block(torch.from_numpy(np.asarray(x))).numpy()

    forward = nnx.jit(lambda m, x: m(x))  # one compile per mode, not one per eager op; the rng still advances

    def run(seed, train):
        twin = porting.torch_to_flax(block, seed=seed)
        twin.train() if train else twin.eval()
        return np.asarray(forward(twin, x))

    evals = [run(s, False) for s in (0, 1)]
    assert np.array_equal(evals[0], evals[1]) and np.abs(evals[0] - want).max() <= TOL
    trains = [run(s, True) for s in (0, 1, 0)]
    assert np.array_equal(trains[0], trains[2]), "the same rng, the same jitter"
    assert np.abs(trains[0] - trains[1]).max() > 1e-3 and np.abs(trains[0] - evals[0]).max() > 1e-3
    twin = porting.torch_to_flax(block)
    twin.train()
    assert not np.array_equal(np.asarray(forward(twin, x)), np.asarray(forward(twin, x))), "each call draws new noise"


@pytest.mark.slow(reason="test_mixed_precision (bf16 compute of every family), "
                  "test_model_router_logits_and_aux_loss (the same model in float32)")
def test_bf16_compute_within_its_bound(kind_models):
    """``dtype=jnp.bfloat16`` (weights kept float32), jitted: the model runs, no NaN even on a fully
    masked row, and its logits stay within a bf16 bound of torch's float32 ones (64 bf16 ulps of the
    logits' scale: a few roundings per layer), while they do differ (bf16 really ran).

    A router's k-th and (k+1)-th experts closer than bf16's rounding may swap (OLMoE's has such a
    token: fp32 logits 0.0404 and 0.0342): each such token must be a near tie (within 16 bf16 ulps
    of its logits' scale), and it and the later tokens of its row, which attend to it, are left out."""
    kind, _, reference = kind_models
    flax_model = porting.torch_to_flax(reference, dtype=jnp.bfloat16)
    ids, mask = masked_inputs()
    got, router = nnx.jit(lambda m, i, a: m(i, a, output_router_logits=True))(
        flax_model, jnp.asarray(ids), jnp.asarray(mask))
    got = np.asarray(got)
    with torch.no_grad():
        want, t_router = reference(torch.from_numpy(ids), torch.from_numpy(mask), output_router_logits=True)
    keep, k = mask.astype(bool), reference.config.moe.num_experts_per_tok
    compared = keep.copy()
    for ours, theirs in zip(router, t_router):
        ours, theirs = np.asarray(ours, np.float32), theirs.numpy()
        chosen = [np.sort(np.argsort(-x, axis=1, kind="stable")[:, :k], axis=1) for x in (ours, theirs)]
        swapped = np.nonzero((chosen[0] != chosen[1]).any(1) & keep.reshape(-1))[0]
        ordered = -np.sort(-theirs[swapped], axis=1)
        margin = ordered[:, k - 1] - ordered[:, k]
        assert np.all(margin <= 16 * 2.0 ** -8 * np.abs(ordered).max(1)), f"{kind}: a swap that is no near tie"
        for token in swapped:
            compared[token // T, token % T:] = False
    assert got.dtype == np.float32 and np.all(np.isfinite(got)) and compared.sum() >= keep.sum() // 2
    want = want.numpy()
    err, scale = np.abs(got - want)[compared].max(), np.abs(want[keep]).max()
    assert 1e-4 * scale < err <= 64 * 2.0 ** -8 * scale, (kind, err, scale)


# ------------------------------------------------------------------ configs


@pytest.mark.parametrize("fields,named", [
    (dict(num_experts=5, num_experts_per_tok=6), "num_experts_per_tok"),
    (dict(router_aux_loss_coef=-0.01), "router_aux_loss_coef"),
    (dict(router_aux_loss_coef=float("nan")), "router_aux_loss_coef"),
    (dict(mlp_only_layers="0,1"), "mlp_only_layers"),
    (dict(mlp_only_layers=[0, 1.0]), "mlp_only_layers"),
    (dict(mlp_only_layers=[True]), "mlp_only_layers"),
    (dict(num_experts=0), "num_experts"),
    (dict(router_jitter_noise=1.5), "router_jitter_noise"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
])
def test_bad_moe_config_names_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        MoeConfig(**{**dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=8), **fields})


@pytest.mark.parametrize("kind,change,named", [
    ("qwen2_moe", dict(shared_expert_intermediate_size=None), "shared_expert_intermediate_size"),
    ("mixtral", dict(norm_topk_prob=False), "norm_topk_prob"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=8), "shared_expert_intermediate_size"),
    ("olmoe", dict(mlp_only_layers=(0,)), "mlp_only_layers"),
    ("olmoe", dict(router_jitter_noise=0.1), "router_jitter_noise"),
])
def test_export_refuses_what_transformers_cannot_hold(kind, change, named):
    """``to_hf_dict`` of a config its model_type's class cannot hold: one ValueError naming the field."""
    cfg = LlamaConfig.from_hf(hf_config(kind))
    bad = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **change))
    with pytest.raises(ValueError, match=named):
        bad.to_hf_dict()


@pytest.mark.parametrize("kind", list(KINDS))
def test_from_hf_reads_each_kind(kind):
    """``LlamaConfig.from_hf`` of each transformers config: the MoE fields under their per-kind names,
    and the sparse layers transformers builds."""
    config = hf_config(kind)
    cfg = LlamaConfig.from_hf(config)
    moe = cfg.moe
    assert cfg.model_type == kind and moe.num_experts == KINDS[kind][1].get("num_experts", 5)
    assert moe.num_experts_per_tok == config.num_experts_per_tok
    assert moe.router_aux_loss_coef == config.router_aux_loss_coef
    assert moe.norm_topk_prob == (True if kind == "mixtral" else config.norm_topk_prob)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    sparse = [hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert sparse == [moe.is_sparse(i) for i in range(cfg.num_hidden_layers)]
    assert (cfg.head_dim, cfg.clip_qkv, cfg.sliding_window) == (
        hf.model.layers[0].self_attn.head_dim, getattr(config, "clip_qkv", None), getattr(config, "sliding_window", None) or None)  # qwen2_moe: 0
