"""DeepSeek-V3's latent cache: greedy generation against transformers' ``generate(do_sample=False)``, and
the cache's two ways of decoding against the uncached forward.

A random transformers ``DeepseekV3ForCausalLM`` (eager attention; vocabulary 64, width 32, 4 heads,
``kv_lora_rank`` 12, a dense first layer and a sparse one of 8 experts in 4 groups, the best 2 groups, 3
experts a token, a shared expert) whose ``e_score_correction_bias`` is drawn at random (std 0.3), so that
the bias changes which experts a token gets; its state_dict loaded strictly into ``torch_reference.llama``
and ported to Flax. YaRN with an original context of 32 (``mscale`` 1, ``mscale_all_dim`` 0.8): the
prompts (9, 4 and 6 long) and their 64 new tokens run to position 72, past it. The conventions (transformers
pads left, we pad right, 1e-5 of the logits' scale, a top-two margin asserted at each compared step) are
``test_generate_hf``'s.

``initializer_range`` 0.3 spreads the logits over about +-6 and the router's over about +-2. Besides
greedy's top two, the router's choices are checked to be no near ties either: for every token of each
final sequence, the float64 twin's corrected scores put the ``topk_group``-th group more than 1e-5 above
the next, and the k-th expert of the kept groups more than 1e-5 above the next (float32 moves a score by
about 1e-7), so that a routing flip cannot be hidden in equal tokens and cannot make the test flaky.
"""

import copy
import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import torch_reference.llama as tl
import torch_reference.moe as tm
from flax_transformer.interop import porting
from flax_transformer.models import lora
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.mla import DECODES, set_mla_decode

from .deepseek_models import eager_deepseek
from .test_generate_hf import NEW, PAD, _assert_same_steps, _ours, _transformers_greedy
from .test_llama_generate import one_torch_thread  # noqa: F401  (autouse: torch on one thread in this module)

transformers = pytest.importorskip("transformers")

VOCAB = 64
LENGTHS = [9, 4, 6]
ROUTING_MARGIN = 1e-5  # a hundred times float32's error on a corrected score (about 1e-7)
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=3, first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=12, qk_nope_head_dim=6,
            v_head_dim=5, max_position_embeddings=128, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
            pad_token_id=PAD)
CONFIGS = {
    # the default run's: a low-rank query, interleaved RoPE, YaRN past an original context of 32
    "lora-q-interleaved-yarn": dict(q_lora_rank=16, qk_rope_head_dim=4, rope_interleave=True, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.8,
        beta_fast=32, beta_slow=1, rope_theta=10000.0)),
    # a plain q_proj, half-split RoPE, DeepSeek-V3's own YaRN (mscale = mscale_all_dim = 1) past 16 positions
    "q-proj-half-split-yarn": dict(q_lora_rank=None, qk_rope_head_dim=8, rope_interleave=False, rope_parameters=dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0,
        beta_fast=32, beta_slow=1, rope_theta=10000.0)),
}


@functools.cache
def _deepseek(name):
    """(transformers model, torch_reference twin, Flax twin) of ``CONFIGS[name]``, random correction biases."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**BASE, **CONFIGS[name])
    reference = eager_deepseek(config)
    twin = tl.LlamaForCausalLM(LlamaConfig.from_hf(reference.config)).eval()
    twin.load_state_dict(reference.state_dict(), strict=True)
    return reference, twin, porting.torch_to_flax(twin)


def _prompts(n_rows):
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB, size=n) for n in LENGTHS[:n_rows]]  # no pad, bos or eos inside


def _routing_margin(twin, sequences) -> float:
    """The smallest gap, over every token of ``sequences`` and every sparse layer, between what a router
    chose and what it passed over (the ``topk_group``-th group's score and the next; the k-th expert's
    corrected score in the kept groups and the next), in the float64 twin."""
    model = copy.deepcopy(twin).double()
    logits, hooks = [], [module.register_forward_hook(lambda m, args, out: logits.append((m, out[0])))
                         for module in model.modules() if isinstance(module, tm.DeepseekV3TopkRouter)]
    with torch.no_grad():
        for sequence in sequences:
            model(torch.as_tensor(np.asarray(sequence)[None], dtype=torch.long))
    for hook in hooks:
        hook.remove()
    gaps = []
    for router, scores in logits:
        choice = (scores.sigmoid() + router.e_score_correction_bias.double()).numpy()  # (T, E)
        tokens, experts = choice.shape
        grouped = choice.reshape(tokens, router.n_group, experts // router.n_group)
        group_scores = -np.sort(-np.sort(grouped, axis=-1)[..., -2:].sum(-1), axis=-1)  # (T, G), best first
        gaps.append(group_scores[:, router.topk_group - 1] - group_scores[:, router.topk_group])
        kept = np.argsort(-np.sort(grouped, axis=-1)[..., -2:].sum(-1), axis=-1)[:, :router.topk_group]
        inside = -np.sort(-np.take_along_axis(grouped, kept[..., None], axis=1).reshape(tokens, -1), axis=-1)
        gaps.append(inside[:, router.top_k - 1] - inside[:, router.top_k])
    assert logits, "no router ran"
    return float(np.min(np.concatenate(gaps)))


def _greedy_equals_transformers(name, decode, n_rows):
    """64 new tokens per row: transformers' tokens, log-probabilities within 1e-5 of the logits' scale, the
    top two apart by more than twice that at every step, and no router's choice a near tie."""
    reference, twin, model = _deepseek(name)
    prompts = _prompts(n_rows)
    theirs, their_logits = _transformers_greedy(reference, prompts)
    set_mla_decode(model, decode)
    try:
        ours, our_logits = _ours(model, prompts)
    finally:
        set_mla_decode(model, "absorbed")
    assert ours.shape == theirs.shape == (n_rows, NEW)
    _assert_same_steps(ours, theirs, our_logits, their_logits, [NEW] * n_rows)
    assert len(set(ours[0])) > 10, f"{name}: one token repeated, the steps test little"
    margin = _routing_margin(twin, [np.concatenate([p, t]) for p, t in zip(prompts, ours)])
    assert margin > ROUTING_MARGIN, f"{name}: a router's choice is a near tie ({margin:.2g}), decided by noise"


@pytest.mark.parametrize("n_rows", [1, 3], ids=["batch1", "ragged"])
@pytest.mark.keep_cases("ragged", reason="the kept case covers the other: its row 0 is batch1's prompt, and a "
                        "ragged batch gives each row what it gets alone (test_greedy_gpt2_equals_transformers_token_for_token)")
def test_greedy_deepseek_equals_transformers_token_for_token(n_rows):
    """The default decode ("absorbed"), one prompt and a right-padded batch of three, past YaRN's original context."""
    _greedy_equals_transformers("lora-q-interleaved-yarn", "absorbed", n_rows)


@pytest.mark.slow(reason="test_greedy_deepseek_equals_transformers_token_for_token (the same loop, the default "
                  "decode) and test_absorbed_equals_expanded_equals_forward (the expanded decode at every position)")
@pytest.mark.parametrize(("name", "decode", "n_rows"), [
    ("lora-q-interleaved-yarn", "expanded", 1), ("lora-q-interleaved-yarn", "expanded", 3),
    ("q-proj-half-split-yarn", "absorbed", 3), ("q-proj-half-split-yarn", "expanded", 1)])
def test_greedy_deepseek_other_decodes_and_config(name, decode, n_rows):
    """The expanded decode, and a plain q_proj with half-split RoPE and DeepSeek-V3's YaRN."""
    _greedy_equals_transformers(name, decode, n_rows)


@nnx.jit
def _call(attention, x, cache, index):
    """``attention`` on ``x`` (b, t, hidden) at positions [index, index + t) through ``cache``: (output, cache)."""
    return attention(x, cache=cache, index=index)


def _cached(attention, x, cache, prefill):
    """Outputs (b, t, hidden) of ``attention`` on ``x`` (b, t, hidden) through ``cache``: the first ``prefill``
    positions in one call, then one position a step (one program each); and the cache."""
    outs, cache = _call(attention, x[:, :prefill], cache, 0)
    outs = [outs]
    for s in range(prefill, x.shape[1]):
        out, cache = _call(attention, x[:, s:s + 1], cache, jnp.int32(s))
        outs.append(out)
    return np.concatenate([np.asarray(o) for o in outs], axis=1), cache


@functools.partial(nnx.jit, static_argnames="prefill")
def _decode_and_forward(attention, base, x, cache, prefill):
    """``attention``'s outputs (b, t, hidden) decoded through ``cache`` (a prefill, then one position a step,
    unrolled in one program), its uncached outputs and ``base``'s."""
    outs, cache = attention(x[:, :prefill], cache=cache, index=0)
    outs = [outs]
    for s in range(prefill, x.shape[1]):
        out, cache = attention(x[:, s:s + 1], cache=cache, index=s)
        outs.append(out)
    return jnp.concatenate(outs, axis=1), attention(x), base(x)


def test_absorbed_decode_adds_an_unmerged_lora_on_kv_b_proj():
    """The default run's check of what the slow test below checks at every position: the default config's
    sparse layer's latent attention with an unmerged LoRA on ``kv_b_proj`` (B drawn, not zero), a prefill of 3
    and 3 absorbed steps, each within 1e-5 of the uncached attention with the LoRA. The absorbed decode folds
    kv_b_proj's kernel into the query and output; without the LoRA's update it is off by the update's
    effect (> 1e-2 at the uncached output, asserted)."""
    _, _, model = _deepseek("lora-q-interleaved-yarn")
    base = model.model.layers[1].self_attn
    attention = lora.apply(nnx.clone(base), rank=2, targets="kv_b_proj", rngs=nnx.Rngs(1))
    assert attention.decode == "absorbed" and not attention.kv_b_proj.merged
    rng = np.random.default_rng(2)
    attention.kv_b_proj.lora_B[...] = rng.normal(0.0, 0.3, attention.kv_b_proj.lora_B.shape).astype(np.float32)
    x = rng.normal(size=(2, 6, model.config.hidden_size)).astype(np.float32)
    out, full, without = (np.asarray(a) for a in _decode_and_forward(
        attention, base, x, model.init_cache(2, 6)[1], prefill=3))
    assert np.abs(full - without).max() > 1e-2, "the LoRA changes nothing: a dropped one would pass"
    err = np.abs(out - full).max(axis=(0, 2))  # per position
    assert err.max() <= 1e-5, f"position {int(err.argmax())} off by {err.max():.3g}"


@pytest.mark.slow(reason="test_greedy_deepseek_equals_transformers_token_for_token (the absorbed decode against "
                         "transformers) and test_flax_model_forward_both_ways (the uncached forward)")
def test_absorbed_equals_expanded_equals_forward():
    """The latent cache holds (b, 1, slots, kv_lora_rank) latents and (b, 1, slots, qk_rope_head_dim) RoPE keys
    a layer. Both decodes give the uncached attention's output at every position (a prefill of 5, then one
    position a step, to 40: past YaRN's original context of 32) within 1e-5, with an unmerged LoRA on
    ``kv_b_proj`` (B drawn, not zero), which the absorbed decode folds into its kernel. (The whole model's
    decodes: the generation tests above.)"""
    _, _, base = _deepseek("lora-q-interleaved-yarn")
    config = base.config.mla
    cache = base.init_cache(3, 40)
    assert len(cache) == base.config.num_hidden_layers
    for latents, keys in cache:
        assert latents.shape == (3, 1, 40, config.kv_lora_rank) and keys.shape == (3, 1, 40, config.qk_rope_head_dim)
        assert latents.dtype == keys.dtype == jnp.float32
    model = lora.apply(nnx.clone(base), rank=2, targets="kv_b_proj", rngs=nnx.Rngs(1))
    rng = np.random.default_rng(1)
    absorbed = model.model.layers[1].self_attn
    assert absorbed.decode == "absorbed" and not absorbed.kv_b_proj.merged
    absorbed.kv_b_proj.lora_B[...] = rng.normal(0.0, 0.3, absorbed.kv_b_proj.lora_B.shape).astype(np.float32)
    expanded = nnx.clone(absorbed)
    set_mla_decode(expanded, "expanded")
    x = rng.normal(size=(3, 40, base.config.hidden_size)).astype(np.float32)
    full = np.asarray(nnx.jit(lambda a, b, x: (a(x), b(x)))(absorbed, base.model.layers[1].self_attn, x))
    assert np.abs(full[0] - full[1]).max() > 1e-2, "the LoRA changes nothing: a dropped one would pass"
    full = full[0]
    decoded = [_cached(attention, x, cache[1], 5) for attention in (absorbed, expanded)]
    for decode, (out, _) in zip(DECODES, decoded):
        err = np.abs(np.asarray(out) - full).max(axis=(0, 2))  # per position
        assert err.max() <= 1e-5, f"{decode}: position {int(err.argmax())} off by {err.max():.3g}"
    for a, b in zip(decoded[0][1], decoded[1][1]):  # the same writes, whichever way it reads (float32 noise)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="decode must be one of"):
        set_mla_decode(model, "latent")
