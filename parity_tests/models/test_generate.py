"""Generation: cache vs no cache, torch vs JAX, ragged prompts, eos, seeds, bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference.classic as tc
import torch_reference.former as tf
import torch_reference.gpt as tg
from flax_transformer.interop import porting
from flax_transformer.models.generate import generate as flax_generate
from parity_tests.conftest import TOL
from torch_reference.generate import generate as torch_generate

PROMPTS = np.array([[5, 9, 2, 7, 1, 3], [4, 8, 6, 0, 0, 0], [11, 0, 0, 0, 0, 0]])
MASK = (np.arange(6)[None] < np.array([[6], [3], [1]])).astype(np.int64)


def _models():
    from flax_transformer.models.configs import GPTConfig

    torch.manual_seed(0)
    return {
        "gpt": tg.GPTTransformer(2, 16, 32, 4, 40, 24).eval(),
        "gpt2": tg.GPT2LMHeadModel(GPTConfig.tiny(vocab_size=40, n_positions=24)).eval(),
        "former": tf.GTransformer(16, 4, 2, 24, 40, attention=["narrow", "wide"]).eval(),
        "classic": tc.Transformer(30, 40, 16, 4, 2, 32, max_len=24).eval(),
    }


MODELS = _models()
SRC = np.random.default_rng(0).integers(0, 30, size=(3, 5))


def _kw(name, framework):
    if name != "classic":
        return {}
    return {"src_ids": torch.from_numpy(SRC) if framework == "torch" else jnp.asarray(SRC)}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.keep_cases("gpt", "gpt2", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_cache_gives_the_same_logits_at_every_step(name):
    model = porting.torch_to_flax(MODELS[name])
    ids, mask = jnp.asarray(PROMPTS), jnp.asarray(MASK)
    a, la = flax_generate(model, ids, 10, attention_mask=mask, greedy=True, return_logits=True, **_kw(name, "flax"))
    b, lb = flax_generate(model, ids, 10, attention_mask=mask, greedy=True, return_logits=True, use_cache=False,
                          **_kw(name, "flax"))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), atol=TOL, rtol=0)
    assert np.abs(np.asarray(la)).min(axis=-1).max() > 0  # every step's logits were filled


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_agree_across_frameworks(name):
    torch_model = MODELS[name]
    flax_model = porting.torch_to_flax(torch_model)
    t, lt = torch_generate(torch_model, torch.from_numpy(PROMPTS), 10, attention_mask=torch.from_numpy(MASK),
                           greedy=True, return_logits=True, **_kw(name, "torch"))
    f, lf = flax_generate(flax_model, jnp.asarray(PROMPTS), 10, attention_mask=jnp.asarray(MASK), greedy=True,
                          return_logits=True, **_kw(name, "flax"))
    np.testing.assert_array_equal(t.numpy(), np.asarray(f))
    np.testing.assert_allclose(lt.numpy(), np.asarray(lf), atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["gpt", "former"])
@pytest.mark.slow_cases({
    "former": "test_generate_hf's and test_llama_generate's ragged batches",
    "gpt": "test_generate_hf's and test_llama_generate's ragged batches",
})
def test_a_row_in_a_ragged_batch_equals_the_row_alone(name):
    model = porting.torch_to_flax(MODELS[name])
    batch = flax_generate(model, jnp.asarray(PROMPTS), 7, attention_mask=jnp.asarray(MASK), greedy=True)
    alone = flax_generate(model, jnp.asarray(PROMPTS[1:2, :3]), 7, greedy=True)
    np.testing.assert_array_equal(np.asarray(batch[1]), np.asarray(alone[0]))
    # and the model's own greedy continuation, computed the slow way
    seq = list(PROMPTS[1, :3])
    for _ in range(7):
        seq.append(int(np.argmax(np.asarray(model(jnp.asarray([seq])))[0, -1])))
    np.testing.assert_array_equal(np.asarray(alone[0]), seq[3:])


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_eos_stops_a_row(framework):
    torch_model = MODELS["gpt"]
    model = torch_model if framework == "torch" else porting.torch_to_flax(torch_model)
    conv = torch.from_numpy if framework == "torch" else jnp.asarray
    run = torch_generate if framework == "torch" else flax_generate
    free = np.asarray(run(model, conv(PROMPTS), 10, attention_mask=conv(MASK), greedy=True))
    eos = int(free[0, 2])  # row 0 produces this at step 2
    out = np.asarray(run(model, conv(PROMPTS), 10, attention_mask=conv(MASK), greedy=True, eos_id=eos))
    first = np.argmax(out[0] == eos)
    assert first <= 2 and np.all(out[0, first:] == eos)
    np.testing.assert_array_equal(out[0, :first], free[0, :first])


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_sampling_is_reproducible_with_a_seed(framework):
    torch_model = MODELS["former"]
    model = torch_model if framework == "torch" else porting.torch_to_flax(torch_model)
    conv = torch.from_numpy if framework == "torch" else jnp.asarray
    run = torch_generate if framework == "torch" else flax_generate
    kw = dict(attention_mask=conv(MASK), temperature=1.5, top_k=20, top_p=0.9)
    a = np.asarray(run(model, conv(PROMPTS), 12, seed=3, **kw))
    b = np.asarray(run(model, conv(PROMPTS), 12, seed=3, **kw))
    c = np.asarray(run(model, conv(PROMPTS), 12, seed=4, **kw))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus():
    from flax_transformer.models.generate import sample_logits

    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 200)
    top1 = [int(sample_logits(logits, k, temperature=1.0, top_k=1, top_p=None, greedy=False)[0]) for k in keys[:20]]
    assert set(top1) == {0}
    nucleus = {int(sample_logits(logits, k, temperature=1.0, top_k=None, top_p=0.7, greedy=False)[0]) for k in keys}
    assert nucleus == {0, 1}  # 0.5 < 0.7 needs the second token; the rest is cut


@pytest.mark.parametrize("framework", ["torch", "flax"])
@pytest.mark.parametrize("kwargs,message", [
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
    (dict(max_new_tokens=30), "exceeds the model's position table"),
    (dict(max_new_tokens=3, top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(max_new_tokens=3, top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (dict(max_new_tokens=3, temperature=0.0), "temperature must be > 0"),
    (dict(max_new_tokens=3, attention_mask=np.array([[1, 1, 0, 1, 1, 1]] * 3)), "right-padded"),
    (dict(max_new_tokens=3, attention_mask=np.ones((3, 5))), "shape"),
    (dict(max_new_tokens=3, attention_mask=np.full((3, 6), 2)), "only 0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=3, eos_id=3.0), "eos_id must be an integer"),
    (dict(max_new_tokens=3, top_k=2.5), "top_k must be an integer"),
])
def test_bad_arguments(framework, kwargs, message):
    torch_model = MODELS["gpt"]
    kwargs = dict(kwargs)
    max_new = kwargs.pop("max_new_tokens")
    if framework == "torch":
        model, ids = torch_model, torch.from_numpy(PROMPTS)
        kwargs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
        run = torch_generate
    else:
        model, ids = porting.torch_to_flax(torch_model), jnp.asarray(PROMPTS)
        kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
        run = flax_generate
    with pytest.raises(ValueError, match=message):
        run(model, ids, max_new, **kwargs)


def test_temperature_zero_is_fine_with_greedy_and_zero_new_tokens():
    model = porting.torch_to_flax(MODELS["gpt"])
    out = flax_generate(model, jnp.asarray(PROMPTS), 2, attention_mask=jnp.asarray(MASK), greedy=True, temperature=0)
    assert out.shape == (3, 2)
    assert flax_generate(model, jnp.asarray(PROMPTS), 0).shape == (3, 0)


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_empty_prompt_is_refused(framework):
    model = MODELS["gpt"] if framework == "torch" else porting.torch_to_flax(MODELS["gpt"])
    ids = torch.zeros(1, 0, dtype=torch.long) if framework == "torch" else jnp.zeros((1, 0), jnp.int32)
    run = torch_generate if framework == "torch" else flax_generate
    with pytest.raises(ValueError, match="at least one token|at least 1"):
        run(model, ids, 3)
