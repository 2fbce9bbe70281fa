"""Sampling with ``eos_id`` on ragged prompts, Flax against torch_reference's loop on the same noise,
greedy and sampled; ``generate`` honours ``rng`` and leaves the model's mode as it was.

Each test fails on a realistic planted bug the parity tests cannot see (issue 17, item 1; mutation-testing
survivors).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

# Row 0 reads its 6-token prompt while rows 1 and 2 (3 and 1 tokens) already generate. eos is
# chosen as a token the sampler picks for row 0 *inside* its prompt: that pick must be ignored
# (the prompt token is kept), so row 0 is not done. The JAX loop is compared with the plain
# torch loop of torch_reference.generate, token for token.
#
# Sampling: torch draws with torch.multinomial and JAX with jax.random.categorical, which is
# argmax(logits + Gumbel noise from the key). The two cannot share a generator, so the torch
# side is given JAX's draws: torch.multinomial is replaced, for the test, by the Gumbel-max
# pick with the noise of the JAX loop's key chain (key = key(seed); per step key, sub =
# split(key); noise = gumbel(sub)). Temperature, top-k, top-p, the eos logic and the ragged
# prompts then run in each framework's own code on the same noise, and must give the same
# tokens. top_k=1 sampling (deterministic, no noise shared) is checked as well.

GEN_PROMPTS = np.array([[5, 9, 2, 7, 1, 3], [4, 8, 6, 0, 0, 0], [11, 0, 0, 0, 0, 0]])


GEN_MASK = (np.arange(6)[None] < np.array([[6], [3], [1]])).astype(np.int64)


GEN_NEW = 10


@pytest.fixture(scope="module")
def gpt_pair():
    import torch_reference.gpt as tg
    from flax_transformer.interop import porting

    torch.manual_seed(0)
    torch_model = tg.GPTTransformer(2, 16, 32, 4, 40, 24).eval()
    return torch_model, porting.torch_to_flax(torch_model)


class _JaxDraws:
    """torch.multinomial(probs, 1) replaced by argmax(log probs + g_i): g_i the Gumbel noise JAX's
    loop draws at its i-th step for ``seed``. Records each pick."""

    def __init__(self, seed):
        self.key, self.picks = jax.random.key(seed), []

    def __call__(self, probs, num_samples, generator=None):
        assert num_samples == 1
        self.key, sub = jax.random.split(self.key)
        noise = torch.from_numpy(np.array(jax.random.gumbel(sub, tuple(probs.shape), jnp.float32)))
        pick = (probs.log() + noise).argmax(dim=-1)
        self.picks.append(pick.numpy().copy())
        return pick[:, None]


SAMPLING = {
    "greedy": dict(greedy=True),
    "sampled": dict(temperature=0.8, top_k=8, top_p=0.9),  # on JAX's draws (_JaxDraws)
    "top_k=1": dict(temperature=1.3, top_k=1),  # sampling that needs no shared draws
}


def _torch_generate(torch_model, how, seed, eos_id, monkeypatch):
    """torch_reference.generate's tokens and logits, and the sampler's picks per step (sampled only)."""
    from torch_reference.generate import generate as torch_generate

    draws = _JaxDraws(seed)
    with monkeypatch.context() as patch:
        if how == "sampled":
            patch.setattr(torch, "multinomial", draws)
        out, logits = torch_generate(torch_model, torch.from_numpy(GEN_PROMPTS), GEN_NEW,
                                     attention_mask=torch.from_numpy(GEN_MASK), seed=seed, eos_id=eos_id,
                                     return_logits=True, **SAMPLING[how])
    return out.numpy(), logits.numpy(), draws.picks


def _flax_generate(flax_model, how, **kw):
    from flax_transformer.models.generate import generate

    tokens, logits = generate(flax_model, jnp.asarray(GEN_PROMPTS), GEN_NEW, attention_mask=jnp.asarray(GEN_MASK),
                              return_logits=True, **SAMPLING[how], **kw)
    return np.asarray(tokens), np.asarray(logits)


@pytest.mark.parametrize("how", SAMPLING)
@pytest.mark.slow_cases({
    "top_k=1": "test_generate::test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus",
})
def test_generation_with_eos_on_ragged_prompts_matches_torch(gpt_pair, how, monkeypatch):
    from parity_tests.conftest import TOL

    torch_model, flax_model = gpt_pair
    seed = 7  # row 0 also stops on eos later, and row 1 too (sampled)
    free, free_logits, picks = _torch_generate(torch_model, how, seed, None, monkeypatch)
    # eos := the token the sampler picks for row 0 at position 2, inside its 6-token prompt
    # (the loop starts at s = min(lengths) - 1 = 0, so step 1 picks position 2)
    if how == "sampled":
        eos = int(picks[1][0])
    else:
        with torch.no_grad():
            eos = int(torch_model(torch.from_numpy(GEN_PROMPTS[:1]))[0, 1].argmax())
    cases = [(eos, *_torch_generate(torch_model, how, seed, eos, monkeypatch)[:2])]
    assert not np.all(cases[0][1][0] == eos), "precondition: an eos picked inside row 0's prompt must not stop row 0"
    if how == "sampled":  # sampling without eos (greedy without eos: test_generate.py)
        cases.append((None, free, free_logits))
    if how == "greedy":  # an eos that stops every row early: the loop ends before the last position
        every = int(free[0, 0])
        cases.append((every, *_torch_generate(torch_model, how, seed, every, monkeypatch)[:2]))
        first = [np.flatnonzero(row == every) for row in cases[-1][1]]
        assert all(len(f) and f[0] < GEN_NEW - 2 for f in first), "precondition: every row stops early"
    for eos_id, want, want_logits in cases:
        got, got_logits = _flax_generate(flax_model, how, seed=seed, eos_id=eos_id)
        np.testing.assert_array_equal(got, want, err_msg=f"{how}, eos_id={eos_id}")
        # the logits each token was chosen from, also after a row's eos (it reads eos from then on)
        np.testing.assert_allclose(got_logits, want_logits, atol=TOL, rtol=0, err_msg=f"{how}, eos_id={eos_id}")


def test_generate_honours_rng_and_leaves_the_mode_as_it_was(gpt_pair):
    """(The arguments of the sampled case above: the compiled loop is reused.)"""
    from flax import nnx

    _, flax_model = gpt_pair
    by_seed = _flax_generate(flax_model, "sampled", seed=5)
    by_key = _flax_generate(flax_model, "sampled", rng=jax.random.key(5))
    np.testing.assert_array_equal(by_key[0], by_seed[0])
    assert not np.array_equal(_flax_generate(flax_model, "sampled", seed=6)[0], by_seed[0])
    dropouts = [m for _, m in nnx.iter_graph(flax_model) if isinstance(m, nnx.Dropout)]
    assert dropouts
    flax_model.train()
    try:
        in_train_mode = _flax_generate(flax_model, "sampled", seed=5)
        assert not any(d.deterministic for d in dropouts), "generate must leave a model in train mode in train mode"
    finally:
        flax_model.eval()
    np.testing.assert_array_equal(in_train_mode[0], by_seed[0])  # no dropout while generating
