"""Greedy GPT-2 generation against transformers' ``model.generate(do_sample=False)``, token for token.

transformers pads a batch of prompts on the left and derives positions from the attention
mask (``cumsum - 1``), so each row's first token sits at position 0; we pad on the right and
every row starts at position 0 by construction. Both then give each row what it gets alone.
After ``eos`` transformers writes ``pad_token_id`` and stops once every row is done; we
repeat ``eos`` and always return ``max_new_tokens`` columns. ``max_new_tokens`` counts the
new tokens only, in both.
"""

import jax
import numpy as np
import pytest
import torch

from flax_transformer.interop import hf
from flax_transformer.models.generate import bucket_shape, count_compiles, generate
from parity_tests.conftest import TOL

transformers = pytest.importorskip("transformers")

VOCAB, PAD, NEW = 97, 0, 64
LENGTHS = [9, 4, 6]  # a ragged batch: left-padded for transformers, right-padded for us


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(transformers model, our model) from one random GPT-2 folder.

    Random GPT-2 weights (std 0.02) give near-uniform logits, where greedy decoding would
    hinge on ties decided by fp32 noise. std 0.5 spreads the logits over about +-10 so that
    the top two differ by far more than the noise (each comparison asserts its margins), at
    the price of noise growing with the logits: hence ``_tol``.
    """
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=128,
                                     initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    reference = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    reference.save_pretrained(folder)
    return reference, hf.from_pretrained(folder)


def _prompts(n_rows):
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB, size=n) for n in LENGTHS[:n_rows]]  # no pad, bos or eos inside


def _padded(prompts, side):
    """(ids, mask) (b, longest) with pad id 0 on ``side``."""
    width = max(map(len, prompts))
    ids, mask = np.full((len(prompts), width), PAD, np.int64), np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        cols = slice(0, len(prompt)) if side == "right" else slice(width - len(prompt), width)
        ids[row, cols], mask[row, cols] = prompt, 1
    return ids, mask


def _transformers_greedy(reference, prompts, eos=None):
    """transformers' greedy continuation of left-padded prompts: (b, steps) new tokens, (b, steps, V) logits."""
    ids, mask = _padded(prompts, "left")
    with torch.no_grad():
        out = reference.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                                 max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, output_logits=True,
                                 return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:].numpy(), torch.stack(out.logits, dim=1).numpy()


@pytest.fixture(scope="module")
def free_runs(gpt2):
    """transformers' greedy runs without eos, for one prompt and for the ragged batch."""
    return {n_rows: _transformers_greedy(gpt2[0], _prompts(n_rows)) for n_rows in (1, 3)}


def _right_padded(ids, mask):
    """transformers' left-padded batch as ours: each row rolled left by its number of pads (docs/generation.md)."""
    pads = (mask == 0).sum(axis=1)
    return tuple(np.stack([np.roll(row, -int(k)) for row, k in zip(x, pads)]) for x in (ids, mask))


def _ours(model, prompts, **kw):
    ids, mask = _right_padded(*_padded(prompts, "left"))
    np.testing.assert_array_equal(ids, _padded(prompts, "right")[0])
    tokens, logits = generate(model, ids, NEW, attention_mask=mask, greedy=True, return_logits=True, **kw)
    return np.asarray(tokens), np.asarray(logits)


def _log_softmax(logits):
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def _tol(logits):
    # fp32 error grows with the weights and activations, whose size the logits' reflects (3.5e-5
    # at logits of +-10): TOL relative to max(1, max |logit|), as conftest does for gradients.
    return TOL * max(1.0, float(np.abs(logits).max()))


def _assert_same_steps(ours, theirs, our_logits, their_logits, steps):
    """Tokens equal and log-probabilities within ``_tol`` for the first ``steps[row]`` steps of each row.

    Argmax is decided by fp32 noise unless the top two logits differ by more than twice the
    largest error; checked at each compared step, so that equal tokens are not luck."""
    tol = _tol(their_logits)
    for row, n in enumerate(steps):
        np.testing.assert_array_equal(ours[row, :n], theirs[row, :n], err_msg=f"row {row}")
        err = np.abs(_log_softmax(our_logits[row, :n]) - _log_softmax(their_logits[row, :n])).max()
        assert err <= tol, f"row {row}: log-probabilities differ by {err:.3g} > {tol:.3g}"
        top2 = np.sort(their_logits[row, :n], axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 2 * tol, f"row {row}: a near tie, greedy is decided by noise"


@pytest.mark.parametrize("n_rows", [1, 3], ids=["batch1", "ragged"])
def test_greedy_gpt2_equals_transformers_token_for_token(gpt2, free_runs, n_rows):
    theirs, their_logits = free_runs[n_rows]
    ours, our_logits = _ours(gpt2[1], _prompts(n_rows))
    # max_new_tokens: new tokens per row, whatever the padding, in both
    assert ours.shape == theirs.shape == (n_rows, NEW)
    _assert_same_steps(ours, theirs, our_logits, their_logits, [NEW] * n_rows)
    assert len(set(ours.ravel())) > 10  # not one token repeated: each step is a test


def test_eos_transformers_pads_after_it_and_we_repeat_it(gpt2, free_runs):
    reference, model = gpt2
    prompts = _prompts(3)
    free = free_runs[3][0]
    eos = int(free[1, 3])  # row 1 produces it at step 3
    theirs, their_logits = _transformers_greedy(reference, prompts, eos=eos)
    ours, our_logits = _ours(model, prompts, eos_id=eos)
    firsts = [int(np.argmax(row == eos)) if (row == eos).any() else NEW for row in ours]
    assert firsts[1] <= 3 and max(firsts) < NEW - 1  # every row stops, one early
    # transformers stops once every row has produced eos; we fill the rest with eos
    assert ours.shape == (3, NEW) and theirs.shape[1] == max(firsts) + 1
    _assert_same_steps(ours, theirs, our_logits, their_logits, [f + 1 for f in firsts])
    for row, first in enumerate(firsts):
        assert np.all(theirs[row, first + 1:] == PAD) and np.all(ours[row, first + 1:] == eos)


def test_bucket_shape(gpt2):
    with pytest.raises(ValueError, match="bucket must be True or False"):
        generate(gpt2[1], np.ones((1, 2), np.int32), 3, bucket="no")
    assert bucket_shape(1, 1, 64, 1024) == (1, 16)
    assert bucket_shape(3, 17, 64, 1024) == (4, 32)
    assert bucket_shape(8, 100, 64, 1024) == (8, 128)
    assert bucket_shape(5, 70, 50, 128) == (8, 78)  # no longer than the position table allows
    assert bucket_shape(2, 78, 50, 128) == (2, 78)
    assert bucket_shape(64, 128, 64, 1024) == (64, 128)
    assert bucket_shape(65, 129, 64, 1024) == (128, 256)  # then steps of 64 rows, 128 tokens
    assert bucket_shape(520, 300, 64, 1024) == (576, 384)


@pytest.fixture
def no_persistent_cache():
    """Compilations counted in this process: the persistent cache (conftest) off, or it would load
    some of these programs that another worker compiled."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)


def test_one_compile_per_bucket_and_padding_changes_nothing(gpt2, no_persistent_cache):
    _, model = gpt2
    rng = np.random.default_rng(1)
    new = 5  # a max_new_tokens no other test uses: these programs are compiled here
    # sampled: row i's noise is the same slice of a (4, V) draw as of a (3, V) one (threefry
    # draws by position), so the extra rows change nothing there either
    how = dict(temperature=0.7, top_k=10, seed=3)
    prompts = [rng.integers(3, VOCAB, size=shape) for shape in [(3, 5), (4, 9)]]  # both in bucket (4, 16)
    runs, counts = [], []
    for bucket in (True, False):
        for ids in prompts:
            with count_compiles() as compiles:
                runs.append(generate(model, ids, new, return_logits=True, bucket=bucket, **how))
            counts.append(compiles.n)
    assert counts == [1, 0, 1, 1]  # bucketed: the second shape reuses the first's program
    for (tokens, logits), (exact_tokens, exact_logits) in zip(runs[:2], runs[2:]):
        assert tokens.shape == exact_tokens.shape and logits.shape == exact_logits.shape
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(exact_tokens))
        # not bit for bit: the prefill's matrices have other shapes, so XLA may sum in another order
        np.testing.assert_allclose(np.asarray(logits), np.asarray(exact_logits), atol=_tol(exact_logits), rtol=0)
