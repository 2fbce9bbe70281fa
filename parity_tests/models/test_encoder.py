"""Parity of the ``encoder`` family (notebook 001): attention, layer, model.

Tolerance: max abs error <= 1e-5 in fp32 with matmul precision "highest" (TOL).
The multi-head attention, the layer and the models under every mask case, both directions: the
spec-driven test_family_parity.py (family_specs.ENCODER); here, what is special to the family.
"""

import dataclasses
import io
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import flax_transformer.models.encoder as fe
import torch_reference.encoder as te
from flax_transformer.interop import porting
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.verification.verify import _mask_for, padding_mask
from parity_tests.conftest import TOL, assert_both_directions, assert_parameter_gradients_match

from . import notebook_classes as nb


def config(heads=4, head_dim=6, **kw):
    return EncoderConfig.tiny(hidden_size=heads * head_dim, num_attention_heads=heads, **kw)


@pytest.mark.parametrize("case", ["none", "padding", "fully-masked-row"])
def test_attention_head_with_padding_mask(case, rng):
    mask, _ = _mask_for(case, rng, 3, 6)
    x = rng.standard_normal((3, 6, 10)).astype(np.float32)
    assert_both_directions(te.AttentionHead(10, 4), (x, mask))


def test_scaled_dot_product_attention_function(rng):
    """The free function, with the notebook's mask convention and a fully masked row."""
    q, k, v = (rng.standard_normal((2, 5, 8)).astype(np.float32) for _ in range(3))
    mask = np.tril(np.ones((5, 5), np.int64))[None].repeat(2, 0)
    mask[1, 2] = 0  # row 2 of batch 1 attends to nothing
    want, w_t = te.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v, mask)), return_weights=True)
    got, w_f = fe.scaled_dot_product_attention(*map(jnp.asarray, (q, k, v, mask)), return_weights=True)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(w_f), w_t.numpy(), atol=TOL, rtol=0)
    assert np.all(np.asarray(got)[1, 2] == 0) and np.all(want.numpy()[1, 2] == 0)


def test_feed_forward_and_embeddings(rng):
    cfg = config(hidden_act="gelu")
    assert_both_directions(te.FeedForward(cfg), (rng.standard_normal((2, 5, cfg.hidden_size)).astype(np.float32),))
    assert_both_directions(te.Embeddings(cfg), (rng.integers(0, cfg.vocab_size, size=(2, 5)),))


@pytest.mark.parametrize("case", ["none", "padding", "fully-masked-row"])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.keep_cases("cls-padding", "mean-padding", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_bert_classifier_heads(pooling, case, rng):
    """HF's BertForSequenceClassification ([CLS] through the pooler) and mean pooling over real
    tokens: forward both directions, and every parameter's gradient (a fully masked row pools to zeros)."""
    torch.manual_seed(3)
    cfg = dataclasses.replace(EncoderConfig.bert(dataclasses.asdict(config())), classifier_pooling=pooling)
    mask, _ = _mask_for(case, rng, 3, 9)
    ids = rng.integers(0, cfg.vocab_size, size=(3, 9))
    model = te.TransformerForSequenceClassification(cfg)
    assert_both_directions(model, (ids, mask))
    if case == "fully-masked-row":  # the hardest case is enough for the gradients (verify --grads does all)
        assert_parameter_gradients_match(model, (ids, mask), rng)
    model.eval()
    if pooling == "mean" and mask is not None:  # the mean reads real tokens only
        changed = ids.copy()
        changed[np.asarray(mask) == 0] = (changed[np.asarray(mask) == 0] + 1) % cfg.vocab_size
        with torch.no_grad():
            a = model.features(torch.from_numpy(ids), torch.from_numpy(np.asarray(mask)))
            b = model.features(torch.from_numpy(changed), torch.from_numpy(np.asarray(mask)))
        assert torch.equal(a, b)


@pytest.mark.slow(reason="test_text_length's attention map, test_llama_cli's attention maps")
def test_returned_attentions_match(rng):
    cfg = config()
    model = te.TransformerEncoder(cfg).eval()
    flax_model = porting.torch_to_flax(model)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 6))
    mask = padding_mask(rng, 2, 6, empty_row=False)
    _, att_t = model(torch.from_numpy(ids), torch.from_numpy(mask), return_attentions=True)
    _, att_f = flax_model(jnp.asarray(ids), jnp.asarray(mask), return_attentions=True)
    assert len(att_t) == len(att_f) == cfg.num_hidden_layers
    for a, b in zip(att_t, att_f):
        assert a.shape == (2, cfg.num_attention_heads, 6, 6)
        np.testing.assert_allclose(np.asarray(b), a.detach().numpy(), atol=TOL, rtol=0)
        # weights of real queries sum to one over real keys, and are zero on padding
        np.testing.assert_allclose(a.detach().numpy().sum(-1), 1.0, atol=1e-5)
        pad = np.broadcast_to(mask[:, None, None, :] == 0, b.shape)
        assert np.all(np.asarray(b)[pad] == 0)


def test_parameter_gradients(rng):
    torch.manual_seed(0)
    cfg = config(norm_first=False)
    ids, mask = rng.integers(0, cfg.vocab_size, size=(3, 8)), padding_mask(rng, 3, 8, empty_row=False)
    assert_parameter_gradients_match(te.TransformerForSequenceClassification(cfg), (ids, mask), rng)


@pytest.mark.slow(reason="test_former::test_jit_matches_eager, test_family_parity's eager model rows (gpt-model)")
def test_jit_matches_eager(rng):
    model = fe.TransformerForSequenceClassification(config(), rngs=nnx.Rngs(1))
    model.eval()
    ids = jnp.asarray(rng.integers(0, 100, size=(2, 7)))
    mask = jnp.asarray(padding_mask(rng, 2, 7))
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, i, k: m(i, k))(model, ids, mask)),
                               np.asarray(model(ids, mask)), atol=1e-6, rtol=0)


def test_dropout_follows_train_and_eval(rng):
    cfg = config(hidden_dropout_prob=0.5)
    model = fe.TransformerEncoder(cfg, rngs=nnx.Rngs(0))
    ids = jnp.asarray(rng.integers(0, 100, size=(2, 7)))
    model.train()
    assert not np.allclose(np.asarray(model(ids)), np.asarray(model(ids)))  # fresh dropout masks
    model.eval()
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(model(ids)))
    torch_model = porting.flax_to_torch(model)
    assert not torch_model.training
    model.train()
    assert porting.flax_to_torch(model).training


# ------------------------------------------------------- notebook checkpoints


@pytest.mark.slow(reason="test_family_parity's encoder cases (the parity tests); notebooks 000 and 002's checkpoint tests")
def test_notebook_001_classifier_checkpoint(rng):
    """A notebook-001 model built from a BERT-style namespace loads strictly and agrees."""
    torch.manual_seed(5)
    cfg = types.SimpleNamespace(vocab_size=211, hidden_size=30, num_attention_heads=5, intermediate_size=44,
                                hidden_dropout_prob=0.1, max_position_embeddings=17, num_hidden_layers=3,
                                num_labels=4, layer_norm_eps=1e-12)
    notebook = nb.TransformerForSequenceClassification(cfg).eval()
    buffer = io.BytesIO()
    torch.save(notebook.state_dict(), buffer)
    buffer.seek(0)
    reference = te.TransformerForSequenceClassification(cfg)
    reference.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    reference.eval()
    ids = torch.from_numpy(rng.integers(0, 211, size=(3, 17)))
    want = notebook(ids).detach().numpy()
    np.testing.assert_allclose(reference(ids).detach().numpy(), want, atol=1e-6, rtol=0)
    got = np.asarray(porting.torch_to_flax(reference)(jnp.asarray(ids.numpy())))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_notebook_001_attention_without_mask_matches(rng):
    torch.manual_seed(6)
    cfg = types.SimpleNamespace(hidden_size=12, num_attention_heads=3)
    notebook = nb.MultiHeadAttention(cfg)
    reference = te.MultiHeadAttention(cfg)
    reference.load_state_dict(notebook.state_dict(), strict=True)
    x = torch.from_numpy(rng.standard_normal((2, 4, 12)).astype(np.float32))
    np.testing.assert_allclose(reference(x).detach().numpy(), notebook(x).detach().numpy(), atol=1e-6, rtol=0)


def test_notebook_masked_attention_gave_nan_and_ours_gives_zeros():
    """Notebook 001's masked attention fills -inf: a fully masked row is NaN. Fixed here."""
    q = k = v = torch.ones(1, 2, 4)
    mask = torch.tensor([[[1, 0], [0, 0]]])
    assert torch.isnan(nb.scaled_dot_product_attention(q, k, v, mask)[0, 1]).all()
    out = te.scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(out[0, 1], torch.zeros(4)) and torch.equal(out[0, 0], torch.ones(4))


def test_config_accepts_duck_types():
    ns = types.SimpleNamespace(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, vocab_size=10)
    cfg = EncoderConfig.from_any(ns)
    assert cfg.hidden_size == 16 and cfg.intermediate_size == 3072 and cfg.norm_first
    assert EncoderConfig.from_any(dataclasses.asdict(cfg)) == cfg
    assert cfg.block_eps == 1e-5 and dataclasses.replace(cfg, norm_first=False).block_eps == 1e-12
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 8


@settings(max_examples=4, deadline=None)
@given(heads=st.integers(1, 5), head_dim=st.integers(1, 5), layers=st.integers(1, 2), b=st.integers(1, 3),
       t=st.integers(1, 8), norm_first=st.booleans(), seed=st.integers(0, 2**16))
@pytest.mark.slow(reason="test_family_parity's encoder cases: the parametrised parity tests")
def test_random_configurations(heads, head_dim, layers, b, t, norm_first, seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    cfg = EncoderConfig(vocab_size=23, hidden_size=heads * head_dim, num_attention_heads=heads,
                        num_hidden_layers=layers, intermediate_size=7, max_position_embeddings=t + 1,
                        num_labels=3, norm_first=norm_first)
    model = te.TransformerForSequenceClassification(cfg).eval()
    ids, mask = rng.integers(0, 23, size=(b, t)), padding_mask(rng, b, t)
    want = model(torch.from_numpy(ids), torch.from_numpy(mask)).detach().numpy()
    got = jax.jit(lambda i, m, mod=porting.torch_to_flax(model): mod(i, m))(jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=0)
