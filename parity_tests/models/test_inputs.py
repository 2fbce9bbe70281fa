"""Bad input gets a clear error naming the problem, in both frameworks, before any computation."""

import functools
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_transformer.models.classic as fc
import flax_transformer.models.encoder as fe
import flax_transformer.models.former as ff
import flax_transformer.models.gpt as fg
import torch_reference.classic as tc
import torch_reference.encoder as te
import torch_reference.former as tf
import torch_reference.gpt as tg
from flax_transformer.models.configs import EncoderConfig

VOCAB, SEQ = 20, 8


# name -> (torch model, flax model), built when a test first asks (not at collection: every worker
# of every run collects this module)
_BUILDERS = {
    "CTransformer": lambda cfg: (tf.CTransformer(8, 2, 1, SEQ, VOCAB, 2),
                                 ff.CTransformer(8, 2, 1, SEQ, VOCAB, 2, rngs=nnx.Rngs(0))),
    "GTransformer": lambda cfg: (tf.GTransformer(8, 2, 1, SEQ, VOCAB), ff.GTransformer(8, 2, 1, SEQ, VOCAB, rngs=nnx.Rngs(0))),
    "TransformerEncoder": lambda cfg: (te.TransformerEncoder(cfg), fe.TransformerEncoder(cfg, rngs=nnx.Rngs(0))),
    "TransformerForSequenceClassification": lambda cfg: (te.TransformerForSequenceClassification(cfg),
                                                         fe.TransformerForSequenceClassification(cfg, rngs=nnx.Rngs(0))),
    "GPTTransformer": lambda cfg: (tg.GPTTransformer(1, 8, 16, 2, VOCAB, SEQ),
                                   fg.GPTTransformer(1, 8, 16, 2, VOCAB, SEQ, rngs=nnx.Rngs(0))),
}
MODELS = list(_BUILDERS)  # each model that takes token ids


@functools.cache
def built(name: str):
    """(torch model, flax model) of ``name``, built once per process."""
    return _BUILDERS[name](EncoderConfig.tiny(vocab_size=VOCAB, max_position_embeddings=SEQ))
IDS = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])


def _call(framework, model, ids, mask=None):
    if framework == "torch":
        conv = lambda a: a if a is None or isinstance(a, (list, float)) else torch.as_tensor(a)  # noqa: E731
    else:
        conv = lambda a: a if a is None or isinstance(a, (list, float)) else jnp.asarray(a)  # noqa: E731
    return model(conv(ids), conv(mask))


BAD_IDS = [
    ("id >= vocab", np.array([[1, VOCAB]]), ValueError, rf"\[0, {VOCAB}\)"),
    ("negative id", np.array([[-1, 3]]), ValueError, rf"\[0, {VOCAB}\)"),
    ("uint8 ids", np.array([[1, 2]], np.uint8), None, None),
    ("float ids", np.array([[1.0, 2.0]], np.float32), TypeError, "integer token ids"),
    ("1-d ids", np.array([1, 2, 3]), ValueError, r"\(batch, length\)"),
    ("too long", np.zeros((1, SEQ + 1), np.int64), ValueError, f"exceeds the position table size {SEQ}"),
]


@pytest.mark.parametrize("framework", ["torch", "flax"])
@pytest.mark.parametrize("what,ids,error,message", BAD_IDS, ids=[b[0] for b in BAD_IDS])
@pytest.mark.parametrize("name", MODELS)
def test_bad_ids(name, what, ids, error, message, framework, monkeypatch):
    model = built(name)[framework == "flax"]
    if error is None:  # uint8: nn.Embedding refuses it, so torch says so up front; JAX gathers it fine
        if framework == "flax":
            return
        error, message = TypeError, "int64 or int32"
    _forbid_embedding_lookups(framework, model, monkeypatch)
    with pytest.raises(error, match=message):
        _call(framework, model, ids)


def _fail(*args, **kwargs):
    raise AssertionError("computation started before the input was checked")


def _forbid_embedding_lookups(framework, model, monkeypatch):
    """Any embedding lookup before the input check fails loudly."""
    if framework == "torch":
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding):
                monkeypatch.setattr(m, "forward", _fail)
    else:
        for module in (ff, fe, fg):
            monkeypatch.setattr(module, "lookup", _fail)


BAD_MASKS = [
    ("wrong length", np.ones((2, 3)), ValueError, r"shape \(batch, length\)=\(2, 4\)|has shape \(2, 3\)"),
    ("wrong batch", np.ones((3, 4)), ValueError, r"shape \(batch, length\)=\(2, 4\)|has shape \(3, 4\)"),
    ("values other than 0/1", np.array([[1, 1, 2, 0], [1, 1, 1, 1]]), ValueError, "only 0"),
    ("3-d mask at model level", np.ones((2, 4, 4)), ValueError, r"\(batch, length\)"),
]


@pytest.mark.parametrize("framework", ["torch", "flax"])
@pytest.mark.parametrize("what,mask,error,message", BAD_MASKS, ids=[b[0] for b in BAD_MASKS])
@pytest.mark.parametrize("name", MODELS)
def test_bad_masks(name, what, mask, error, message, framework, monkeypatch):
    model = built(name)[framework == "flax"]
    _forbid_embedding_lookups(framework, model, monkeypatch)
    with pytest.raises(error, match=message):
        _call(framework, model, IDS, mask)


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_attention_level_bad_inputs(framework):
    if framework == "torch":
        att, x = tf.MHSelfAttention(8, 2), torch.zeros(2, 5, 8)
        ids = torch.zeros(2, 5, dtype=torch.long)
    else:
        att, x = ff.MHSelfAttention(8, 2, rngs=nnx.Rngs(0)), jnp.zeros((2, 5, 8))
        ids = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match=r"\(batch, length, 8\)"):
        att(x[..., :6])
    with pytest.raises(TypeError, match="floating-point"):
        att(ids[..., None].expand(2, 5, 8) if framework == "torch" else jnp.repeat(ids[..., None], 8, -1))
    with pytest.raises(ValueError, match="has shape"):
        att(x, x[:, :, 0][:, :4] > 0)


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_heads_must_divide_the_width(framework):
    kw = {} if framework == "torch" else {"rngs": nnx.Rngs(0)}
    mod = tf if framework == "torch" else ff
    with pytest.raises(ValueError, match=r"embedding dimension \(10\) must be divisible by the number of heads \(3\)"):
        mod.MHSelfAttention(10, 3, **kw)
    with pytest.raises(ValueError, match=r"embedding dimension \(10\) must be divisible"):
        mod.CTransformer(10, 3, 1, 5, 7, 2, **kw)
    enc = te if framework == "torch" else fe
    with pytest.raises(ValueError, match=r"hidden_size \(10\) must be divisible by num_attention_heads \(3\)"):
        enc.MultiHeadAttention(types.SimpleNamespace(hidden_size=10, num_attention_heads=3), **kw)


def test_out_of_range_ids_under_jit_give_nan_not_a_clamped_row():
    """Under jit the values are unknown at trace time; the gather fills NaN instead of clamping."""
    model = ff.GTransformer(8, 2, 1, SEQ, VOCAB, rngs=nnx.Rngs(0))
    for bad in (VOCAB + 5, -1, -VOCAB):  # negative ids must not wrap around to the end of the table
        out = np.asarray(nnx.jit(lambda m, i: m(i))(model, jnp.array([[1, bad, 2]])))
        assert np.isnan(out[0, 1:]).all(), bad
    ok = nnx.jit(lambda m, i: m(i))(model, jnp.array([[1, 3, 2]]))
    assert np.isfinite(np.asarray(ok)).all()
    # shapes are static, so length and mask checks still raise under jit
    with pytest.raises(ValueError, match="exceeds the position table"):
        nnx.jit(lambda m, i: m(i))(model, jnp.zeros((1, SEQ + 1), jnp.int32))
    with pytest.raises(ValueError, match="padding mask"):
        nnx.jit(lambda m, i, k: m(i, k))(model, jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 4)))


def test_package_boundaries():
    """torch_reference never imports JAX; flax_transformer's models never import torch."""
    code = ("import sys, torch_reference.former, torch_reference.encoder, torch_reference.gpt, "
            "torch_reference.classic, torch_reference.llama, torch_reference.generate; "
            "assert 'jax' not in sys.modules and 'flax' not in sys.modules, 'torch_reference imported jax'")
    subprocess.run([sys.executable, "-c", code], check=True)
    code = ("import sys, flax_transformer.models.former, flax_transformer.models.encoder, flax_transformer.models.gpt, "
            "flax_transformer.models.classic, flax_transformer.models.generate, flax_transformer.interop.porting, flax_transformer.cli.commands; "
            "assert 'torch' not in sys.modules, 'flax_transformer imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_mask_head_axis_is_checked(framework):
    if framework == "torch":
        att, x, mask = tf.MHSelfAttention(8, 2), torch.zeros(2, 5, 8), torch.ones(2, 3, 5, 5)
    else:
        att, x, mask = ff.MHSelfAttention(8, 2, rngs=nnx.Rngs(0)), jnp.zeros((2, 5, 8)), jnp.ones((2, 3, 5, 5))
    with pytest.raises(ValueError, match=r"1\|2"):
        att(x, mask)


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_seq2seq_bad_inputs(framework):
    if framework == "torch":
        model, conv = tc.Transformer(VOCAB, VOCAB - 5, 8, 2, 1, 16, max_len=SEQ), torch.as_tensor
    else:
        model, conv = fc.Transformer(VOCAB, VOCAB - 5, 8, 2, 1, 16, max_len=SEQ, rngs=nnx.Rngs(0)), jnp.asarray
    src, tgt = conv(np.array([[1, 2, 3]])), conv(np.array([[1, 2]]))
    with pytest.raises(ValueError, match=r"tgt_ids must lie in \[0, 15\)"):
        model(src, conv(np.array([[1, VOCAB - 5]])))
    with pytest.raises(ValueError, match="different batch sizes"):
        model(src, conv(np.array([[1, 2], [3, 4]])))
    with pytest.raises(ValueError, match=r"src_attention_mask must have shape \(batch, length\)=\(1, 3\)"):
        model(src, tgt, conv(np.ones((1, 2))))
    with pytest.raises(ValueError, match="exceeds the position table"):
        model(conv(np.zeros((1, SEQ + 1), np.int64)), tgt)
    with pytest.raises(ValueError, match=r"d_model \(8\) must equal d_feature \(3\) \* n_heads \(2\)"):
        (tc if framework == "torch" else fc).MultiHeadAttention(8, 3, 2, **({} if framework == "torch" else {"rngs": nnx.Rngs(0)}))
