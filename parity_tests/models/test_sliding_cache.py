"""A cache that slides (issue 34 item 3): a sliding layer's key/value cache is a ring of its window.

``ring_cache``: a sliding layer of window W keeps W - 1 + min(W, 128) slots, a full layer the whole
length. Decoding with the ring gives a full forward pass's logits (no cache) at every step, for a
Mistral-style model (every layer slides) and alternating layer kinds, prompts shorter and longer than
the window; it survives going back ``ring_rewind(W)`` positions and not one more (the bound
``generate``'s chunked prefill relies on). Greedy ``generate`` past the window equals its uncached
run on a right-padded batch, and transformers' ``generate`` token for token for 64 new tokens
(a Mistral and a Gemma 2, window 4, batch 1 and a padded batch; ``test_generate_hf``'s helpers).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import torch_reference.llama as tl
from flax_transformer.interop import porting
from flax_transformer.models.generate import generate
from flax_transformer.models.llama import LlamaForCausalLM
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.ring_cache import ring_rewind, ring_slots
from parity_tests.conftest import TOL

from .test_generate_hf import NEW, PAD, _assert_same_steps, _ours, _transformers_greedy

transformers = pytest.importorskip("transformers")

WINDOW, VOCAB, STEPS = 4, 64, 24
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
KINDS = {  # every layer slides (Mistral), or a sliding layer then a full one (Gemma 2, GPT-OSS)
    "mistral": dict(sliding_window=WINDOW, model_type="mistral"),
    "alternating": dict(sliding_window=WINDOW, layer_types=("sliding_attention", "full_attention")),
}


@pytest.fixture(scope="module", params=list(KINDS))
def tiny(request):
    """(kind, a random Flax model, its full forward's logits (2, STEPS, V) for random ids (2, STEPS))."""
    model = LlamaForCausalLM(LlamaConfig(**TINY, **KINDS[request.param]), rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(2, STEPS)).astype(np.int32)
    return request.param, model, ids, np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))


@nnx.jit
def _step(model, tokens, index, cache):
    return model.decode_step(tokens, index, cache)  # index traced: one program per tokens' shape


def _decode(model, ids, prefill, resume=None):
    """Logits (2, STEPS - resume, V) of positions resume.. decoded one by one after a prefill of ``prefill``."""
    resume = prefill if resume is None else resume
    _, cache = _step(model, jnp.asarray(ids[:, :prefill]), jnp.int32(0), model.init_cache(2, STEPS))
    out = []
    for s in range(resume, STEPS):
        logits, cache = _step(model, jnp.asarray(ids[:, s:s + 1]), jnp.int32(s), cache)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


def test_cache_shapes_ring_for_sliding_layers_whole_length_for_full():
    model = nnx.eval_shape(lambda: LlamaForCausalLM(LlamaConfig(**TINY, **KINDS["alternating"]), rngs=nnx.Rngs(0)))
    assert ring_slots(WINDOW) == 2 * WINDOW - 1 and ring_slots(4096) == 4096 - 1 + 128 and ring_rewind(4096) == 128
    sliding, full = model.init_cache(3, 40)
    assert [a.shape for a in sliding] == [(3, 2, ring_slots(WINDOW), 8)] * 2
    assert [a.shape for a in full] == [(3, 2, 40, 8)] * 2
    assert [c[0].shape[2] for c in model.init_cache(1, 5)] == [5, 5]  # shorter than the ring: the length
    assert model.cache_rewind() == ring_rewind(WINDOW)
    llama = nnx.eval_shape(lambda: LlamaForCausalLM(LlamaConfig(**TINY), rngs=nnx.Rngs(0)))
    assert llama.cache_rewind() is None  # no window, no ring: a step may start anywhere


@pytest.mark.parametrize("prefill", [2, 9], ids=["prompt<window", "prompt>window"])
@pytest.mark.keep_cases("alternating-prompt<window", "alternating-prompt>window", reason="the kept cases cover the others: the alternating kinds hold a ring and a full layer side by side")
def test_ring_decode_equals_the_full_forward_at_every_step(tiny, prefill):
    kind, model, ids, full = tiny
    got = _decode(model, ids, prefill)
    assert np.abs(got - full[:, prefill:]).max() <= TOL * max(1.0, np.abs(full).max()), kind


@pytest.mark.keep_cases("alternating", reason="the kept cases cover the others: the alternating kinds hold a ring and a full layer side by side")
def test_going_back_over_written_positions_works_up_to_the_rewind_bound(tiny):
    """Prefill 12 positions, then decode again from 12 - C (C = ring_rewind): the full forward's
    logits. From 12 - C - 1 the ring has lost a key the first query needs: they differ."""
    kind, model, ids, full = tiny
    back = 12 - ring_rewind(WINDOW)
    np.testing.assert_allclose(_decode(model, ids, 12, back), full[:, back:], atol=TOL * np.abs(full).max())
    assert np.abs(_decode(model, ids, 12, back - 1) - full[:, back - 1:]).max() > 1e-3, kind


@pytest.mark.slow(reason="test_greedy_past_the_window_equals_transformers (generate with the ring on a padded batch, "
                        "against transformers) and test_ring_decode_equals_the_full_forward_at_every_step")
def test_generate_with_the_ring_equals_generate_without_a_cache_on_a_padded_batch(tiny):
    """Prompts 9, 2 and 5 long, right-padded, 20 new tokens: the bucket's 16-wide prefill is longer than
    the rewind bound, so generate prefills in chunks and the loop goes back to the shortest prompt."""
    kind, model, ids, _ = tiny
    lengths = np.array([9, 2, 5])
    prompts = np.where(np.arange(9)[None] < lengths[:, None], np.resize(ids[:, :9], (3, 9)), 0).astype(np.int32)
    mask = (np.arange(9)[None] < lengths[:, None]).astype(np.int32)
    runs = [generate(model, prompts, 20, attention_mask=mask, greedy=True, return_logits=True, use_cache=cached)
            for cached in (True, False)]
    np.testing.assert_array_equal(runs[0][0], runs[1][0], err_msg=kind)
    np.testing.assert_allclose(runs[0][1], runs[1][1], atol=TOL * np.abs(runs[1][1]).max())


# ---------------------------------------------------------------- against transformers' generate

HF = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
          pad_token_id=PAD, sliding_window=WINDOW, initializer_range=0.5)  # logits over +-10: no near ties
HF_FAMILIES = {
    "Mistral": {},
    # a sliding layer then a full one, caps that bite a little (scores of a few units against 5)
    # (untied: Gemma's tied, sqrt(hidden)-scaled table makes a random model repeat one token)
    "Gemma2": dict(attn_logit_softcapping=5.0, final_logit_softcapping=30.0, query_pre_attn_scalar=8,
                   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(HF_FAMILIES))
def hf_pair(request):
    """(name, transformers model with eager attention, our port through torch_reference's twin)."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{request.param}Config")(**HF, **HF_FAMILIES[request.param])
    config._attn_implementation = "eager"
    reference = getattr(transformers, f"{request.param}ForCausalLM")(config).eval()
    twin = tl.LlamaForCausalLM(LlamaConfig.from_hf(reference.config)).eval()
    twin.load_state_dict(reference.state_dict(), strict=True)
    return request.param, reference, porting.torch_to_flax(twin)


@pytest.mark.parametrize("lengths", [[9], [9, 3, 6]], ids=["batch1", "padded"])
@pytest.mark.keep_cases("Gemma2-padded", reason="the kept case covers the others: Gemma 2's padded batch (a ring "
                        "and a full layer, caps; the chunked prefill and the loop going back for the short rows)")
def test_greedy_past_the_window_equals_transformers(hf_pair, lengths):
    """64 new tokens, 16 times the window: tokens equal, log-probabilities within tolerance at every step."""
    name, reference, model = hf_pair
    assert [c[0].shape[2] for c in model.init_cache(1, 80)][0] == ring_slots(WINDOW)  # the ring is in use
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n) for n in lengths]
    theirs, their_logits = _transformers_greedy(reference, prompts)
    ours, our_logits = _ours(model, prompts)
    assert ours.shape == theirs.shape == (len(lengths), NEW)
    _assert_same_steps(ours, theirs, our_logits, their_logits, [NEW] * len(lengths))
    assert len(set(ours[0])) > 10, name  # not one token repeated: each step is a test
