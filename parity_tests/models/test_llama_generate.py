"""Greedy generation of the ``llama`` family against transformers' ``generate(do_sample=False)``.

A Llama (grouped-query attention; ``llama3`` RoPE scaling with an original context of 32, which
divides three of a head's four frequencies, so that it matters at these short positions), a Qwen3
(q/k norms, one key/value head, a sliding window of 8 keys) and a Gemma (``1 + w`` norms, scaled and tied embeddings, tanh GELU) of vocabulary 64 and width 32,
from random configs (no download): each transformers model's state_dict loaded strictly into
``torch_reference.llama`` and ported to Flax. 64 new tokens for one prompt and for a ragged batch
with an eos that stops a row; tokens equal, per-step log-probabilities within tolerance and the
top-two margins asserted at every compared step (``test_generate_hf``'s helpers); one compiled
loop per bucket. The conventions (transformers pads left, we pad right) are those of
``test_generate_hf`` and docs/generation.md.
"""

import jax
import numpy as np
import pytest
import torch

import torch_reference.llama as tl
from flax_transformer.interop import porting
from flax_transformer.models.generate import count_compiles
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.ring_cache import ring_slots
from torch_reference.generate import generate as torch_generate

from .test_generate_hf import (  # NEW = 64 new tokens, pad id 0: the same conventions as GPT-2's test
    NEW,
    PAD,
    _assert_same_steps,
    _ours,
    _padded,
    _transformers_greedy,
    no_persistent_cache,  # noqa: F401  (a fixture, used by name)
)

transformers = pytest.importorskip("transformers")

VOCAB = 64
LENGTHS = [9, 4, 6]  # a ragged batch: left-padded for transformers, right-padded for us
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
# transformers family -> config switches. initializer_range 0.5 (not 0.02) spreads the logits over
# about +-11 so that greedy's top two are never a near tie decided by fp32 noise (test_generate_hf)
FAMILIES = {
    # wavelengths above 32 positions divided by 4: with head_dim 8, three of the four frequencies
    "Llama": dict(num_hidden_layers=2, num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
    "Qwen3": dict(num_hidden_layers=1, num_key_value_heads=1, head_dim=16, use_sliding_window=True, sliding_window=8,
                  max_window_layers=0),  # its one layer slides: a window of 8 keys
    "Gemma": dict(num_hidden_layers=1, num_key_value_heads=1, head_dim=16, hidden_act="gelu_pytorch_tanh"),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch on one thread here: on these 32-wide models a second thread only adds its handoffs, which
    on a shared, loaded CPU cost more than the matmuls (a forward 8 ms on one thread, 110 ms on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(name, transformers model, torch_reference twin, Flax twin), built once per family."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{request.param}Config")(**BASE, **FAMILIES[request.param], initializer_range=0.5)
    reference = getattr(transformers, f"{request.param}ForCausalLM")(config).eval()
    twin = tl.LlamaForCausalLM(LlamaConfig.from_hf(reference.config)).eval()
    twin.load_state_dict(reference.state_dict(), strict=True)
    return request.param, reference, twin, porting.torch_to_flax(twin)


def _prompts(n_rows):
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB, size=n) for n in LENGTHS[:n_rows]]  # no pad, bos or eos inside


def _first_eos(tokens, eos):
    """Per row, the step of the first ``eos`` (NEW when there is none)."""
    return [int(np.argmax(row == eos)) if (row == eos).any() else NEW for row in tokens]


@pytest.mark.keep_cases("Qwen3", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_ragged_batch_with_eos_equals_transformers(family):
    """A right-padded batch of prompts 9, 4 and 6 long, with an eos that row 1 produces early and row 0
    never: each row's tokens and log-probabilities up to its eos equal transformers' (left-padded,
    positions cumsum(mask) - 1), row 0's for all 64 steps; transformers pads after a row's eos and
    we repeat it. The cache holds the key/value heads only, and a cached call refuses a mask.
    torch_reference's loop (no cache, the whole prefix each step) gives our tokens too."""
    name, reference, twin, model = family
    prompts = _prompts(3)
    ids, mask = _padded(prompts, "right")
    free = torch_generate(twin, torch.from_numpy(ids), NEW, attention_mask=torch.from_numpy(mask), greedy=True).numpy()
    # an eos from row 1's first steps that row 0 never produces: one row stops, another runs to the end
    eos = next(int(t) for t in free[1, 2:12] if t not in free[0])
    theirs, their_logits = _transformers_greedy(reference, prompts, eos=eos)
    ours, our_logits = _ours(model, prompts, eos_id=eos)
    firsts = _first_eos(ours, eos)
    assert firsts[0] == NEW and firsts[1] < 12, f"{name}: eos {eos} at steps {firsts}"
    assert ours.shape == theirs.shape == (3, NEW)  # row 0 never stops: transformers runs all 64 steps
    _assert_same_steps(ours, theirs, our_logits, their_logits, [min(f + 1, NEW) for f in firsts])
    for row, first in enumerate(firsts):
        assert np.all(theirs[row, first + 1:] == PAD) and np.all(ours[row, first + 1:] == eos)
        np.testing.assert_array_equal(ours[row, :first + 1], free[row, :first + 1],
                                      err_msg=f"torch_reference, row {row}")
    assert len(set(ours[0])) > 10  # not one token repeated: each step is a test
    config, cache = model.config, model.init_cache(3, 80)
    slots = 80 if config.layer_window(0) is None else ring_slots(config.layer_window(0))  # a window's: a ring
    assert [tuple(a.shape) for a in cache[0]] == [(3, config.num_key_value_heads, slots, config.head_dim)] * 2
    with pytest.raises(ValueError, match="attention_mask and position_ids are not taken"):  # they would be ignored
        model.model(ids, mask, cache=cache)


@pytest.mark.usefixtures("no_persistent_cache")  # count this process's compilations
@pytest.mark.keep_cases("Llama", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_one_prompt_equals_transformers_in_one_compiled_loop(family):
    """One prompt, 64 new tokens: transformers' tokens and log-probabilities. The loop compiles once
    for its bucket (1, 16): a prompt of another length in it compiles nothing and gives what that
    prompt gets inside the ragged batch (torch_reference's row)."""
    name, reference, twin, model = family
    first, second = _prompts(2)
    key = jax.random.key(0)  # made outside the count: creating a key compiles a program of its own
    with count_compiles() as compiles:
        ours, our_logits = _ours(model, [first], rng=key)
    theirs, their_logits = _transformers_greedy(reference, [first])
    assert ours.shape == theirs.shape == (1, NEW)
    _assert_same_steps(ours, theirs, our_logits, their_logits, [NEW])
    assert len(set(ours[0])) > 10
    with count_compiles() as again:
        alone, _ = _ours(model, [second], rng=key)
    assert (compiles.n, again.n) == (1, 0), f"{name}: compilations {compiles.n}, {again.n}"
    ids, mask = _padded(_prompts(3), "right")
    batch = torch_generate(twin, torch.from_numpy(ids), NEW, attention_mask=torch.from_numpy(mask), greedy=True)
    np.testing.assert_array_equal(alone[0], batch[1].numpy())
