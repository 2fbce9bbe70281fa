"""The original "Attention Is All You Need" Transformer, after notebook 003, in Flax NNX.

The twin of ``torch_reference.classic`` (see there for the design): same class names,
constructor arguments (plus keyword-only ``rngs``, ``dtype``, ``param_dtype``), call
signatures and parameter paths. Mask convention of the attention modules: **True =
masked out** (the notebook's). The full ``Transformer`` takes (b, len) padding masks
with 1 = token. Shapes are logged to ``logging.getLogger("tensor_shapes")`` when traced.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.models.arg_checks import check_length
from flax_transformer.models.attention import attend, cache_mask, empty_cache, update_cache
from flax_transformer.models.constructor_records import RecordsInit
from flax_transformer.models.input_checks import check_features, check_token_ids, is_concrete
from flax_transformer.models.input_specs import InputSpec
from flax_transformer.models.layers import Embed, LayerNorm, Linear, ReLU, Sequential, lookup, stacked_projection
from flax_transformer.models.shape_logging import TensorLoggingLevels, log_size

__all__ = ["TensorLoggingLevels", "ScaledDotProductAttention", "AttentionHead", "MultiHeadAttention",
           "PositionalEmbedding", "EncoderBlock", "TransformerEncoder", "DecoderBlock", "TransformerDecoder",
           "Transformer"]


def keep_mask(mask, scores_shape):
    """The family's mask (True/nonzero = masked out) -> bool keep-mask, checked against the scores."""
    if mask is None:
        return None
    if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
        raise TypeError(f"mask must be an array, got {type(mask).__name__}")
    try:
        jnp.broadcast_shapes(tuple(mask.shape), tuple(scores_shape))
    except ValueError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the scores "
                         f"(batch, q_len, k_len)={tuple(scores_shape)}") from None
    if mask.dtype != jnp.bool_ and is_concrete(mask):
        values = np.asarray(mask)
        if not np.all((values == 0) | (values == 1)):
            raise ValueError("mask must be boolean or hold only 0 and 1 (1 = masked out)")
    return ~mask.astype(bool)


class ScaledDotProductAttention(RecordsInit, nnx.Module):
    """softmax(q k^T / sqrt(d_k)) v with dropout on the weights; ``mask`` True = masked out."""

    level = TensorLoggingLevels.attention

    def __init__(self, dropout=0.1, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.attention_impl = "reference"  # see set_attention

    def __call__(self, q, k, v, mask=None):
        """Args: q (b, q_len, d_k); k (b, k_len, d_k); v (b, k_len, d_v); mask broadcastable
        to (b, q_len, k_len), True = masked out. Returns (b, q_len, d_v)."""
        d_k = k.shape[-1]
        if q.shape[-1] != d_k:
            raise ValueError(f"queries have width {q.shape[-1]} but keys {d_k}")
        keep = keep_mask(mask, (q.shape[0], q.shape[-2], k.shape[-2]))
        output, weights = attend(q, k, v, keep, scale=1 / math.sqrt(d_k), dropout=self.dropout,
                                 implementation=self.attention_impl, need_weights=False)
        if weights is not None:
            log_size(self, weights.shape, "attention weight")
        log_size(self, output.shape, "attention output size")
        return output


class AttentionHead(RecordsInit, nnx.Module):
    """One head: query/key/value projections d_model -> d_feature, then attention."""

    level = TensorLoggingLevels.attention_head

    def __init__(self, d_model, d_feature, dropout=0.1, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.attn = ScaledDotProductAttention(dropout, **kw)
        self.query_tfm = Linear(d_model, d_feature, **kw)
        self.key_tfm = Linear(d_model, d_feature, **kw)
        self.value_tfm = Linear(d_model, d_feature, **kw)

    def __call__(self, queries, keys, values, mask=None):
        """(b, q_len, d_model), (b, k_len, d_model) x2 -> (b, q_len, d_feature)."""
        Q, K, V = self.query_tfm(queries), self.key_tfm(keys), self.value_tfm(values)
        log_size(self, Q.shape, "queries, keys, vals")
        return self.attn(Q, K, V, mask=mask)


class MultiHeadAttention(RecordsInit, nnx.Module):
    """``n_heads`` attention heads, concatenated, then ``projection``; ``mask`` True = masked out."""

    level = TensorLoggingLevels.multihead_attention_block

    def __init__(self, d_model, d_feature, n_heads, dropout=0.1, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        if d_model != d_feature * n_heads:
            raise ValueError(f"d_model ({d_model}) must equal d_feature ({d_feature}) * n_heads ({n_heads})")
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.d_model, self.d_feature, self.n_heads, self.dtype = d_model, d_feature, n_heads, dtype
        self.attention_impl = "reference"  # see set_attention
        self.attn_heads = nnx.List([AttentionHead(d_model, d_feature, dropout, **kw) for _ in range(n_heads)])
        self.projection = Linear(d_feature * n_heads, d_model, **kw)

    def head_layers(self, name) -> list:
        """Every head's ``name`` projection ("query_tfm", "key_tfm" or "value_tfm"), in head order."""
        return [getattr(head, name) for head in self.attn_heads]

    def project(self, x, name):
        """(b, l, d_model) -> (b, h, l, d_feature) through every head's ``name`` at once (and their LoRA)."""
        b, l, _ = x.shape
        y = stacked_projection(x, self.head_layers(name), self.dtype)
        return y.reshape(b, l, self.n_heads, self.d_feature).transpose(0, 2, 1, 3)

    def attend_projected(self, q, k, v, keep, b, q_len):
        """Attention on projected (b, h, *, f) q/k/v with a keep-mask, then ``projection``."""
        keep = None if keep is None else keep[:, None] if keep.ndim == 3 else keep  # head axis
        x, _ = attend(q, k, v, keep, scale=1 / math.sqrt(self.d_feature), dropout=self.attn_heads[0].attn.dropout,
                      implementation=self.attention_impl, need_weights=False)
        log_size(self, x[:, 0].shape, "Output of single head")
        x = x.transpose(0, 2, 1, 3).reshape(b, q_len, self.n_heads * self.d_feature)  # (b, q, h*f)
        log_size(self, x.shape, "Concatenated output")
        x = self.projection(x)
        log_size(self, x.shape, "projected output")
        return x

    def __call__(self, queries, keys, values, mask=None):
        """Returns (b, q_len, d_model)."""
        check_features(queries, self.d_model, name="queries")
        check_features(keys, self.d_model, name="keys")
        check_features(values, self.d_model, name="values")
        if keys.shape[:2] != values.shape[:2] or keys.shape[0] != queries.shape[0]:
            raise ValueError(f"queries {tuple(queries.shape)}, keys {tuple(keys.shape)} and values "
                             f"{tuple(values.shape)} must share the batch, keys and values the length")
        b, q_len, _ = queries.shape
        keep = keep_mask(mask, (b, q_len, keys.shape[1]))
        log_size(self, queries.shape, "Input queries")
        q, k, v = self.project(queries, "query_tfm"), self.project(keys, "key_tfm"), self.project(values, "value_tfm")
        return self.attend_projected(q, k, v, keep, b, q_len)


def sinusoids(max_len: int, d_model: int) -> np.ndarray:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...), as (1, max_len, d_model).

    Computed in float64 with numpy and rounded once, the same table as torch_reference's.
    """
    position = np.arange(max_len, dtype=np.float64)[:, None]
    div_term = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * (-math.log(10000.0) / d_model))
    pe = np.zeros((max_len, d_model), np.float64)
    pe[:, 0::2] = np.sin(position * div_term)
    pe[:, 1::2] = np.cos(position * div_term)[:, : d_model // 2]
    return pe.astype(np.float32)[None]


class PositionalEmbedding(RecordsInit, nnx.Module):
    """Sinusoidal positions (the paper's); a constant, not a parameter."""

    level = TensorLoggingLevels.enc_dec

    def __init__(self, d_model, max_len=512, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.d_model, self.max_len, self.dtype = d_model, max_len, dtype

    def __call__(self, x):
        """(b, l, ...) -> (1, l, d_model)."""
        check_length(x.shape[1], self.max_len)
        return self.at(jnp.arange(x.shape[1]))[None]

    def at(self, positions):
        """Rows of the table at integer ``positions`` (any shape) -> (*positions.shape, d_model)."""
        table = jnp.asarray(sinusoids(self.max_len, self.d_model)[0], self.dtype)  # a compile-time constant
        return jnp.take(table, positions, axis=0)


def _feed_forward(d_model, d_ff, kw):
    return Sequential([Linear(d_model, d_ff, **kw), ReLU(), Linear(d_ff, d_model, **kw)])


class EncoderBlock(RecordsInit, nnx.Module):
    """Post-LN: x = ln1(x + dropout(att(x, x, x))); x = ln2(x + dropout(ff(x)))."""

    level = TensorLoggingLevels.enc_dec_block

    def __init__(self, d_model=512, d_feature=64, d_ff=2048, n_heads=8, dropout=0.1, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.dtype = dtype
        self.attn_head = MultiHeadAttention(d_model, d_feature, n_heads, dropout, **kw)
        self.layer_norm1 = LayerNorm(d_model, **kw)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.position_wise_feed_forward = _feed_forward(d_model, d_ff, kw)
        self.layer_norm2 = LayerNorm(d_model, **kw)

    def __call__(self, x, mask=None):
        x = x.astype(self.dtype)  # the residual stream runs in the compute dtype
        att = self.attn_head(x, x, x, mask=mask)
        x = self.layer_norm1(x + self.dropout(att))
        x = self.layer_norm2(x + self.dropout(self.position_wise_feed_forward(x)))
        log_size(self, x.shape, "Encoder block output")
        return x


class TransformerEncoder(RecordsInit, nnx.Module):
    level = TensorLoggingLevels.enc_dec

    def __init__(self, n_blocks=6, d_model=512, n_heads=8, d_ff=2048, dropout=0.1, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.encoders = nnx.List([
            EncoderBlock(d_model=d_model, d_feature=d_model // n_heads, d_ff=d_ff, n_heads=n_heads, dropout=dropout,
                         **kw)
            for _ in range(n_blocks)
        ])

    def __call__(self, x, mask=None):
        for encoder in self.encoders:
            x = encoder(x, mask=mask)
        return x


class DecoderBlock(RecordsInit, nnx.Module):
    """Masked self-attention, cross-attention on the encoder output, feed-forward; post-LN."""

    level = TensorLoggingLevels.enc_dec_block

    def __init__(self, d_model=512, d_feature=64, d_ff=2048, n_heads=8, dropout=0.1, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.dtype = dtype
        self.masked_attn_head = MultiHeadAttention(d_model, d_feature, n_heads, dropout, **kw)
        self.attn_head = MultiHeadAttention(d_model, d_feature, n_heads, dropout, **kw)
        self.position_wise_feed_forward = _feed_forward(d_model, d_ff, kw)
        self.layer_norm1 = LayerNorm(d_model, **kw)
        self.layer_norm2 = LayerNorm(d_model, **kw)
        self.layer_norm3 = LayerNorm(d_model, **kw)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x, enc_out, src_mask=None, tgt_mask=None):
        """x (b, t, d_model), enc_out (b, s, d_model); masks True = masked out. Returns (b, t, d_model)."""
        x, enc_out = x.astype(self.dtype), enc_out.astype(self.dtype)  # residual stream in the compute dtype
        x = self.layer_norm1(x + self.dropout(self.masked_attn_head(x, x, x, mask=tgt_mask)))
        x = self.layer_norm2(x + self.dropout(self.attn_head(x, enc_out, enc_out, mask=src_mask)))
        x = self.layer_norm3(x + self.dropout(self.position_wise_feed_forward(x)))
        log_size(self, x.shape, "Decoder block output")
        return x


    def step(self, x, index, cache, cross, src_keep):
        """Decode positions [index, index + n) of x (b, n, d_model) with a self-attention cache.

        ``cross`` is this block's projected encoder keys/values, ``src_keep`` the source
        keep-mask (b, 1, s) or None. Returns (output, updated cache).
        """
        x = x.astype(self.dtype)
        b, n, _ = x.shape
        mha = self.masked_attn_head
        q = mha.project(x, "query_tfm")
        k, v = cache = update_cache(cache, mha.project(x, "key_tfm"), mha.project(x, "value_tfm"), index)
        x = self.layer_norm1(x + self.dropout(mha.attend_projected(q, k, v, cache_mask(n, k.shape[2], index), b, n)))
        q = self.attn_head.project(x, "query_tfm")
        x = self.layer_norm2(x + self.dropout(self.attn_head.attend_projected(q, *cross, src_keep, b, n)))
        x = self.layer_norm3(x + self.dropout(self.position_wise_feed_forward(x)))
        return x, cache


class TransformerDecoder(RecordsInit, nnx.Module):
    level = TensorLoggingLevels.enc_dec

    def __init__(self, n_blocks=6, d_model=512, d_feature=64, d_ff=2048, n_heads=8, dropout=0.1, *,
                 rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.decoders = nnx.List([
            DecoderBlock(d_model=d_model, d_feature=d_feature, d_ff=d_ff, n_heads=n_heads, dropout=dropout, **kw)
            for _ in range(n_blocks)
        ])

    def __call__(self, x, enc_out, src_mask=None, tgt_mask=None):
        for decoder in self.decoders:
            x = decoder(x, enc_out, src_mask=src_mask, tgt_mask=tgt_mask)
        return x


def family_masks(src_attention_mask, tgt_len: int | None, tgt_attention_mask=None):
    """Padding masks (b, len), 1 = token -> this family's masks (True = masked out)."""
    # logical_not of a bool cast, not ``== 0``: a bool mask compared with an int is a dtype promotion
    src = None if src_attention_mask is None else jnp.logical_not(jnp.asarray(src_attention_mask).astype(bool))[:, None, :]
    tgt = None
    if tgt_len is not None:
        tgt = jnp.triu(jnp.ones((tgt_len, tgt_len), bool), 1)[None]  # future
        if tgt_attention_mask is not None:
            tgt = tgt | jnp.logical_not(jnp.asarray(tgt_attention_mask).astype(bool))[:, None, :]
    return src, tgt


def _check_padding_mask(mask, ids, name):
    if mask is None:
        return
    if not hasattr(mask, "shape") or tuple(mask.shape) != tuple(ids.shape):
        got = tuple(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
        raise ValueError(f"{name} must have shape (batch, length)={tuple(ids.shape)}, got {got}")
    if mask.dtype != jnp.bool_ and is_concrete(mask):
        values = np.asarray(mask)
        if not np.all((values == 0) | (values == 1)):
            raise ValueError(f"{name} must hold only 0 (pad) and 1 (token)")


class Transformer(RecordsInit, nnx.Module):
    """Encoder-decoder: embeddings * sqrt(d_model) + sinusoids, encoder, decoder, ``out``."""

    level = TensorLoggingLevels.enc_dec

    def __init__(self, src_vocab_size, tgt_vocab_size, d_model=512, n_heads=8, n_blocks=6, d_ff=2048, dropout=0.1,
                 max_len=512, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by the number of heads ({n_heads})")
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.src_vocab_size, self.tgt_vocab_size, self.d_model, self.dtype = src_vocab_size, tgt_vocab_size, d_model, dtype
        self.src_embedding = Embed(src_vocab_size, d_model, **kw)
        self.tgt_embedding = Embed(tgt_vocab_size, d_model, **kw)
        self.pos_embedding = PositionalEmbedding(d_model, max_len, **kw)
        self.encoder = TransformerEncoder(n_blocks, d_model, n_heads, d_ff, dropout, **kw)
        self.decoder = TransformerDecoder(n_blocks, d_model, d_model // n_heads, d_ff, n_heads, dropout, **kw)
        self.out = Linear(d_model, tgt_vocab_size, **kw)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def _embed(self, table, ids):
        return self.dropout(lookup(table, ids, self.dtype) * math.sqrt(self.d_model) + self.pos_embedding(ids))

    def encode(self, src_ids, src_attention_mask=None):
        """(b, s) ids -> encoder output (b, s, d_model)."""
        check_token_ids(src_ids, self.src_vocab_size, name="src_ids")
        check_length(src_ids.shape[1], self.pos_embedding.max_len)
        _check_padding_mask(src_attention_mask, src_ids, "src_attention_mask")
        src_mask, _ = family_masks(src_attention_mask, None)
        enc_out = self.encoder(self._embed(self.src_embedding, src_ids), mask=src_mask)
        log_size(self, enc_out.shape, "Encoder output")
        return enc_out

    def decode(self, tgt_ids, enc_out, src_attention_mask=None, tgt_attention_mask=None):
        """(b, t) target ids and the encoder output -> logits (b, t, tgt_vocab_size), float32."""
        check_token_ids(tgt_ids, self.tgt_vocab_size, name="tgt_ids")
        check_length(tgt_ids.shape[1], self.pos_embedding.max_len)
        _check_padding_mask(tgt_attention_mask, tgt_ids, "tgt_attention_mask")
        src_mask, tgt_mask = family_masks(src_attention_mask, tgt_ids.shape[1], tgt_attention_mask)
        x = self.decoder(self._embed(self.tgt_embedding, tgt_ids), enc_out, src_mask=src_mask, tgt_mask=tgt_mask)
        return self.out(x).astype(jnp.float32)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.src_vocab_size, self.pos_embedding.max_len, target_vocab_size=self.tgt_vocab_size,
                         generates=True)

    def __call__(self, src_ids, tgt_ids, src_attention_mask=None, tgt_attention_mask=None):
        """Args:
            src_ids: (b, s) source ids; tgt_ids: (b, t) target ids (shifted right by the caller).
            src_attention_mask, tgt_attention_mask: optional (b, len), 1 = token, 0 = pad.

        Returns: (b, t, tgt_vocab_size) logits; position i sees target positions <= i.
        """
        check_token_ids(src_ids, self.src_vocab_size, name="src_ids")
        check_token_ids(tgt_ids, self.tgt_vocab_size, name="tgt_ids")
        if src_ids.shape[0] != tgt_ids.shape[0]:
            raise ValueError(f"src_ids and tgt_ids have different batch sizes: {src_ids.shape[0]} vs {tgt_ids.shape[0]}")
        _check_padding_mask(src_attention_mask, src_ids, "src_attention_mask")
        _check_padding_mask(tgt_attention_mask, tgt_ids, "tgt_attention_mask")
        enc_out = self.encode(src_ids, src_attention_mask)
        return self.decode(tgt_ids, enc_out, src_attention_mask, tgt_attention_mask)

    def init_cache(self, batch: int, length: int):
        """An empty self-attention cache for decoding up to ``length`` target positions."""
        check_length(length, self.pos_embedding.max_len)
        if not self.decoder.decoders:  # no blocks (n_blocks=0): nothing to cache
            return []
        first = self.decoder.decoders[0].masked_attn_head
        return empty_cache(len(self.decoder.decoders), batch, first.n_heads, length, first.d_feature, self.dtype)

    def cross_cache(self, enc_out):
        """Every decoder block's cross-attention keys and values, projected once: [(b, h, s, f) x2]."""
        return [(block.attn_head.project(enc_out, "key_tfm"), block.attn_head.project(enc_out, "value_tfm"))
                for block in self.decoder.decoders]

    def decode_step(self, tokens, index, cache, cross, src_attention_mask=None):
        """Run target positions [index, index + n) given the cache of the earlier ones.

        Returns ((b, n, tgt_vocab_size) logits, cache).
        """
        n = tokens.shape[1]
        x = lookup(self.tgt_embedding, tokens, self.dtype) * math.sqrt(self.d_model)
        x = self.dropout(x + self.pos_embedding.at(index + jnp.arange(n))[None])
        src_keep = None if src_attention_mask is None else (src_attention_mask != 0)[:, None, :]
        new_cache = []
        for block, layer_cache, layer_cross in zip(self.decoder.decoders, cache, cross):
            x, layer_cache = block.step(x, index, layer_cache, layer_cross, src_keep)
            new_cache.append(layer_cache)
        return self.out(x).astype(jnp.float32), new_cache
