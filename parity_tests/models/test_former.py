"""Parity of the ``former`` family (notebooks 000/004): attention, block, model.

Tolerance: max abs error <= 1e-5 in fp32 with matmul precision "highest" (TOL).
The attention (narrow, wide, per-head scale), the block and both models under every mask case, both
directions: the spec-driven test_family_parity.py (family_specs.FORMER); here, what is special to the
family.
"""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import flax_transformer.models.former as ff
import torch_reference.former as tf
from flax_transformer.interop import porting
from flax_transformer.verification.verify import padding_mask
from parity_tests.conftest import TOL, assert_parameter_gradients_match

from . import notebook_classes as nb


def test_jit_matches_eager(rng):
    model = ff.GTransformer(16, 4, 2, 12, 40, rngs=nnx.Rngs(0))
    model.eval()
    ids = jnp.asarray(rng.integers(0, 40, size=(2, 9)))
    mask = jnp.asarray(padding_mask(rng, 2, 9))
    eager = model(ids, mask)
    jitted = nnx.jit(lambda m, i, k: m(i, k))(model, ids, mask)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ backward


@pytest.mark.parametrize("which", ["CTransformer", "GTransformer"])
def test_parameter_gradients(which, rng):
    """d loss / d every parameter agrees after porting (loss = <output, fixed weights>)."""
    torch.manual_seed(0)
    if which == "CTransformer":
        model = tf.CTransformer(16, 4, 2, 12, 40, 3, max_pool=False, attention=["narrow", "wide"])
    else:
        model = tf.GTransformer(16, 4, 2, 12, 40)
    ids, mask = rng.integers(0, 40, size=(3, 9)), padding_mask(rng, 3, 9, empty_row=False)
    assert_parameter_gradients_match(model, (ids, mask), rng)


@pytest.mark.parametrize("variant", ["narrow", "wide"])
@pytest.mark.keep_cases("wide", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_input_gradients_with_fully_masked_row(variant, rng):
    """The gradient through a fully masked row is finite and the same in both frameworks."""
    module = tf.TransformerBlock(16, 4, True, 10, attention=variant).eval()
    flax_module = porting.torch_to_flax(module)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    mask = padding_mask(rng, 2, 5, left=True, empty_row=True)
    w = rng.standard_normal((2, 5, 16)).astype(np.float32)
    xt = torch.from_numpy(x).requires_grad_(True)
    (module(xt, torch.from_numpy(mask)) * torch.from_numpy(w)).sum().backward()
    gx = jax.grad(lambda a: (flax_module(a, jnp.asarray(mask)) * w).sum())(jnp.asarray(x))
    assert np.isfinite(np.asarray(gx)).all() and torch.isfinite(xt.grad).all()
    np.testing.assert_allclose(np.asarray(gx), xt.grad.numpy(), atol=TOL, rtol=0)


# ------------------------------------------------------------- semantics


def test_hand_computed_two_token_attention():
    """Two tokens, one head, identity projections: softmax on paper.

    scores = q.k / (emb ** 1/4)^2 with emb = 4: token 0 = (2,0,0,0), token 1 = (0,0,0,0).
    Row 0: scores (4/2, 0) = (2, 0) -> weights (e^2, 1) / (e^2 + 1).
    Row 1: scores (0, 0) -> weights (1/2, 1/2). With a causal mask row 0 attends to itself only.
    """
    x = np.array([[[2.0, 0, 0, 0], [0, 0, 0, 0]]], np.float32)
    w0 = np.exp(2) / (np.exp(2) + 1)
    expected = np.array([[[2 * w0, 0, 0, 0], [1.0, 0, 0, 0]]], np.float32)
    expected_causal = np.array([[[2.0, 0, 0, 0], [1.0, 0, 0, 0]]], np.float32)
    for causal, want in ((False, expected), (True, expected_causal)):
        module = tf.MHSelfAttention(4, 1, causal=causal)
        with torch.no_grad():
            for lin in (module.tokeys, module.toqueries, module.tovalues, module.unifyheads):
                lin.weight.copy_(torch.eye(4))
            module.unifyheads.bias.zero_()
        got_torch = module(torch.from_numpy(x)).detach().numpy()
        got_flax = np.asarray(porting.torch_to_flax(module)(jnp.asarray(x)))
        np.testing.assert_allclose(got_torch, want, atol=1e-6)
        np.testing.assert_allclose(got_flax, want, atol=1e-6)


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_padding_is_invisible(framework, rng):
    """A right-padded row with a mask gives what the unpadded row gives on its own."""
    torch.manual_seed(0)
    model = tf.CTransformer(16, 4, 2, 12, 40, 2, max_pool=True).eval()
    ids = rng.integers(0, 40, size=(1, 9))
    padded = np.concatenate([ids[:, :6], rng.integers(0, 40, size=(1, 3))], axis=1)
    mask = np.array([[1] * 6 + [0] * 3])
    if framework == "torch":
        run = lambda i, m=None: model(torch.from_numpy(i), None if m is None else torch.from_numpy(m)).detach().numpy()  # noqa: E731
    else:
        fm = porting.torch_to_flax(model)
        run = lambda i, m=None: np.asarray(fm(jnp.asarray(i), None if m is None else jnp.asarray(m)))  # noqa: E731
    np.testing.assert_allclose(run(padded, mask), run(ids[:, :6]), atol=1e-6)


def test_causal_model_ignores_the_future(rng):
    model = porting.torch_to_flax(tf.GTransformer(16, 4, 2, 12, 40).eval())
    ids = rng.integers(0, 40, size=(1, 10))
    changed = ids.copy()
    changed[0, 6:] = (changed[0, 6:] + 1) % 40
    a, b = np.asarray(model(jnp.asarray(ids))), np.asarray(model(jnp.asarray(changed)))
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-3


# ------------------------------------------------------- notebook checkpoints


def _roundtrip_file(module):
    """Save a state_dict as a notebook user would, load it the safe way."""
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("max_pool", [True, False])
@pytest.mark.slow_cases({
    "True": "test_notebook_000_ctransformer_checkpoint[False]",
})
def test_notebook_000_ctransformer_checkpoint(max_pool, rng):
    torch.manual_seed(3)
    args = dict(emb=20, heads=5, depth=2, seq_length=13, num_tokens=97, num_classes=3, max_pool=max_pool, dropout=0.2)
    notebook = nb.CTransformer(**args).eval()
    reference = tf.CTransformer(**args)
    reference.load_state_dict(_roundtrip_file(notebook), strict=True)
    reference.eval()
    ids = torch.from_numpy(rng.integers(0, 97, size=(4, 13)))
    want = notebook(ids).detach().numpy()
    np.testing.assert_allclose(reference(ids).detach().numpy(), want, atol=1e-6, rtol=0)
    got = np.asarray(porting.torch_to_flax(reference)(jnp.asarray(ids.numpy())))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_notebook_000_attention_and_004_self_attention_checkpoints(rng):
    torch.manual_seed(4)
    x = torch.from_numpy(rng.standard_normal((2, 6, 12)).astype(np.float32))
    for notebook, reference in ((nb.MHSelfAttention(12, 3), tf.MHSelfAttention(12, 3)),
                                (nb.SelfAttention(12, 3), tf.SelfAttention(12, 3))):
        reference.load_state_dict(_roundtrip_file(notebook), strict=True)
        want = notebook(x).detach().numpy()
        np.testing.assert_allclose(reference(x).detach().numpy(), want, atol=1e-6, rtol=0)
        got = np.asarray(porting.torch_to_flax(reference)(jnp.asarray(x.numpy())))
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


# ------------------------------------------------------------------ property


@settings(max_examples=5, deadline=None)
@given(
    heads=st.integers(1, 6),
    head_width=st.integers(1, 6),
    depth=st.integers(1, 3),
    b=st.integers(1, 3),
    t=st.integers(1, 9),
    max_pool=st.booleans(),
    variants=st.lists(st.sampled_from(["narrow", "wide"]), min_size=3, max_size=3),
    scale=st.sampled_from(["emb", "head"]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow(reason="test_family_parity's former cases: the parametrised parity tests (every attention, scale, pooling)")
def test_random_configurations(heads, head_width, depth, b, t, max_pool, variants, scale, seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = tf.CTransformer(heads * head_width, heads, depth, t + 2, 17, 2, max_pool=max_pool,
                            attention=variants[:depth], scale=scale).eval()
    flax_model = porting.torch_to_flax(model)
    ids = rng.integers(0, 17, size=(b, t))
    mask = padding_mask(rng, b, t)
    want = model(torch.from_numpy(ids), torch.from_numpy(mask)).detach().numpy()
    got = np.asarray(flax_model(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("padded", [False, True])
def test_max_pooling_gradients_under_jit(padded):
    """Max pooling's backward under jit: JAX's equality-based max gradient went wrong (relative
    error 0.25, NaN in places) when XLA recomputed the max in another fusion; the gather at the
    arg-max gives torch's gradient exactly."""
    from flax_transformer.verification import compare, verify

    torch.manual_seed(0)
    model = tf.CTransformer(24, 4, 2, 16, 50, 3, max_pool=True).eval()
    verify.perturb_torch(model, 0)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (3, 7)).astype(np.int32)
    mask = verify.padding_mask(rng, 3, 7) if padded else None
    err, finite, key = compare.gradient_errors(model, porting.torch_to_flax(model), (ids, mask), seed=0)
    assert finite and err <= TOL, f"{key}: {err:.3g}"
