"""Parity of the ``classic`` family (notebook 003, "Attention Is All You Need").

Masks of the attention modules are True = masked out (the notebook's convention).
Tolerance: max abs error <= 1e-5 in fp32 with matmul precision "highest" (TOL).
The multi-head attention, blocks and model under every mask case, both directions: the
spec-driven test_family_parity.py (family_specs.CLASSIC); here, what is special to the family.
"""

import logging

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_transformer.models.classic as fc
import torch_reference.classic as tc
from flax_transformer.interop import porting
from flax_transformer.verification.verify import padding_mask
from parity_tests.conftest import TOL, assert_both_directions

from . import notebook_classes as nb


@pytest.mark.slow(reason="test_both_directions (the classic family's spec: attention, blocks, encoder, decoder, "
                  "model, with masks)")
def test_cross_attention_and_single_pieces(rng):
    q = rng.standard_normal((2, 3, 12)).astype(np.float32)
    kv = rng.standard_normal((2, 6, 12)).astype(np.float32)
    src_pad = padding_mask(rng, 2, 6, empty_row=True) == 0  # True = masked out
    assert_both_directions(tc.MultiHeadAttention(12, 4, 3), (q, kv, kv, src_pad[:, None, :]))
    assert_both_directions(tc.AttentionHead(12, 5), (q, kv, kv, src_pad[:, None, :]))
    assert_both_directions(tc.ScaledDotProductAttention(), (q, kv, kv, src_pad[:, None, :]))
    assert_both_directions(tc.PositionalEmbedding(12, 9), (q,))


@pytest.mark.slow(reason="test_both_directions (the classic family's spec: attention, blocks, encoder, decoder, "
                  "model, with masks)")
def test_decoder_is_causal_and_source_padding_is_invisible(rng):
    model = porting.torch_to_flax(tc.Transformer(40, 30, 16, 4, 2, 24, max_len=12).eval())
    src, tgt = rng.integers(0, 40, size=(1, 6)), rng.integers(0, 30, size=(1, 8))
    base = np.asarray(model(jnp.asarray(src), jnp.asarray(tgt)))
    changed = tgt.copy()
    changed[0, 5:] = (changed[0, 5:] + 1) % 30
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(src), jnp.asarray(changed)))[:, :5], base[:, :5])
    padded = np.concatenate([src, rng.integers(0, 40, size=(1, 3))], 1)
    mask = np.array([[1] * 6 + [0] * 3])
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(padded), jnp.asarray(tgt), jnp.asarray(mask))), base,
                               atol=1e-5)


def test_sinusoids_are_the_papers():
    pe = tc.PositionalEmbedding(6, 50)(torch.zeros(1, 50, 6))[0].numpy()
    pos, i = 37, 1
    assert np.isclose(pe[pos, 2 * i], np.sin(pos / 10000 ** (2 * i / 6)), atol=1e-6)
    assert np.isclose(pe[pos, 2 * i + 1], np.cos(pos / 10000 ** (2 * i / 6)), atol=1e-6)
    assert "weight" not in tc.PositionalEmbedding(6, 50).state_dict()


def test_notebook_003_checkpoint_and_its_bugs(rng):
    """The notebook's MultiHeadAttention loads strictly and agrees; its mask and overflow bugs are fixed."""
    torch.manual_seed(8)
    notebook = nb.ClassicMultiHeadAttention(15, 5, 3).eval()
    reference = tc.MultiHeadAttention(15, 5, 3)
    reference.load_state_dict(notebook.state_dict(), strict=True)
    reference.eval()
    q, k = (torch.from_numpy(rng.standard_normal((2, n, 15)).astype(np.float32)) for n in (4, 6))
    want = notebook(q, k, k).detach().numpy()
    np.testing.assert_allclose(reference(q, k, k).detach().numpy(), want, atol=1e-6, rtol=0)
    got = np.asarray(porting.torch_to_flax(reference)(*(jnp.asarray(a.numpy()) for a in (q, k, k))))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    # the notebook's AttentionHead drops the mask: masking changes nothing there, but does here
    mask = torch.zeros(2, 1, 6, dtype=torch.bool)
    mask[:, :, 3:] = True
    assert np.allclose(notebook(q, k, k, mask).detach().numpy(), want)
    assert not np.allclose(reference(q, k, k, mask).detach().numpy(), want)
    # raw exp overflows to inf/NaN on large scores; the stable softmax does not
    big = torch.full((1, 2, 4), 60.0)
    assert torch.isnan(nb.ScaledDotProductAttention(0.0)(big, big, big)).any()
    assert torch.isfinite(tc.ScaledDotProductAttention(0.0)(big, big, big)).all()


def test_shape_logging_is_off_by_default_and_available(caplog, rng):
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    torch_mha, flax_mha = tc.MultiHeadAttention(8, 4, 2), fc.MultiHeadAttention(8, 4, 2, rngs=nnx.Rngs(0))
    with caplog.at_level(logging.WARNING, logger="tensor_shapes"):
        torch_mha(*(torch.from_numpy(x),) * 3)
    assert not caplog.records
    with caplog.at_level(tc.TensorLoggingLevels.attention, logger="tensor_shapes"):
        torch_mha(*(torch.from_numpy(x),) * 3)
        flax_mha(*(jnp.asarray(x),) * 3)
    messages = [r.getMessage() for r in caplog.records]
    assert "[MultiHeadAttention] Concatenated output: (2, 3, 8)" in messages
    assert sum("[MultiHeadAttention] projected output: (2, 3, 8)" == m for m in messages) == 2  # both frameworks
