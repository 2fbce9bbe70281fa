"""The original "Attention Is All You Need" Transformer, after notebook 003 (Kurita), in PyTorch.

Notebook 003 builds ``ScaledDotProductAttention``, ``AttentionHead`` and
``MultiHeadAttention``; its logging levels name the encoder-decoder blocks it builds
toward, which are completed here after the paper: sinusoidal ``PositionalEmbedding``,
post-LN ``EncoderBlock`` / ``DecoderBlock``, ``TransformerEncoder`` /
``TransformerDecoder`` and the full ``Transformer``.

Mask convention of this family (the notebook's): **True = masked out**, broadcastable
to the scores (b, q_len, k_len). The full ``Transformer`` takes padding masks in the
library's convention instead, ``(b, len)`` with 1 = token, and builds the family's masks
(padding, and causal for the decoder) itself.

Tensor shapes are logged through ``logging.getLogger("tensor_shapes")`` at the
notebook's ``TensorLoggingLevels``, off by default.

Fixed from the notebook (listed in the README): the softmax is computed stably (the
notebook exponentiates raw scores, which overflows) and a fully masked row gives zeros,
not NaN; ``AttentionHead`` passes its mask on to the attention (the notebook dropped it).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flax_transformer.models.arg_checks import check_length
from flax_transformer.models.input_specs import InputSpec
from flax_transformer.models.shape_logging import TensorLoggingLevels
from flax_transformer.models.shape_logging import log_size as _log_size

from ._common import Module, attend, check_features, check_token_ids, check_values, stacked_heads

__all__ = ["TensorLoggingLevels", "ScaledDotProductAttention", "AttentionHead", "MultiHeadAttention",
           "PositionalEmbedding", "EncoderBlock", "TransformerEncoder", "DecoderBlock", "TransformerDecoder",
           "Transformer"]


def log_size(module, shape, name: str) -> None:
    """The shared shape logging, skipped while ``torch.compile`` traces: a ``logging.Logger``
    call there is a graph break (one for each call in the forward pass), and a compiled graph
    would log once, when traced, not on every call anyway."""
    if not torch.compiler.is_compiling():
        _log_size(module, shape, name)


def keep_mask(mask, scores_shape):
    """The family's mask (True/nonzero = masked out) -> bool keep-mask, checked against the scores."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    try:
        torch.broadcast_shapes(tuple(mask.shape), tuple(scores_shape))
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the scores "
                         f"(batch, q_len, k_len)={tuple(scores_shape)}") from None
    if mask.dtype != torch.bool:  # a value check: no graph break, no sync (see _common)
        check_values((mask == 0) | (mask == 1), "mask must be boolean or hold only 0 and 1 (1 = masked out)")
    return ~mask.bool()


class ScaledDotProductAttention(Module):
    """softmax(q k^T / sqrt(d_k)) v with dropout on the weights; ``mask`` True = masked out."""

    level = TensorLoggingLevels.attention

    def __init__(self, dropout=0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        """Args: q (b, q_len, d_k); k (b, k_len, d_k); v (b, k_len, d_v); mask broadcastable
        to (b, q_len, k_len), True = masked out. Returns (b, q_len, d_v)."""
        d_k = k.size(-1)
        if q.size(-1) != d_k:
            raise ValueError(f"queries have width {q.size(-1)} but keys {d_k}")
        keep = keep_mask(mask, (q.shape[0], q.shape[-2], k.shape[-2]))
        output, weights = attend(q, k, v, keep, scale=1 / math.sqrt(d_k), dropout=self.dropout)
        log_size(self, weights.shape, "attention weight")  # (b, q, k)
        log_size(self, output.shape, "attention output size")  # (b, q, d_v)
        return output


class AttentionHead(Module):
    """One head: query/key/value projections d_model -> d_feature, then attention."""

    level = TensorLoggingLevels.attention_head

    def __init__(self, d_model, d_feature, dropout=0.1):
        super().__init__()
        self.attn = ScaledDotProductAttention(dropout)
        self.query_tfm = nn.Linear(d_model, d_feature)
        self.key_tfm = nn.Linear(d_model, d_feature)
        self.value_tfm = nn.Linear(d_model, d_feature)

    def forward(self, queries, keys, values, mask=None):
        """(b, q_len, d_model), (b, k_len, d_model) x2 -> (b, q_len, d_feature)."""
        Q, K, V = self.query_tfm(queries), self.key_tfm(keys), self.value_tfm(values)
        log_size(self, Q.shape, "queries, keys, vals")
        return self.attn(Q, K, V, mask=mask)  # the notebook dropped the mask here


class MultiHeadAttention(Module):
    """``n_heads`` attention heads, concatenated, then ``projection``.

    Called as ``(queries, keys, values, mask=None)`` with ``mask`` broadcastable to
    (b, q_len, k_len) and **True = masked out** (the notebook's convention). The heads
    keep their own parameters (``attn_heads.<i>.query_tfm``...) but run as one stacked
    projection per q/k/v.
    """

    level = TensorLoggingLevels.multihead_attention_block

    def __init__(self, d_model, d_feature, n_heads, dropout=0.1):
        super().__init__()
        if d_model != d_feature * n_heads:
            raise ValueError(f"d_model ({d_model}) must equal d_feature ({d_feature}) * n_heads ({n_heads})")
        self.d_model, self.d_feature, self.n_heads = d_model, d_feature, n_heads
        self.attn_heads = nn.ModuleList([AttentionHead(d_model, d_feature, dropout) for _ in range(n_heads)])
        self.projection = nn.Linear(d_feature * n_heads, d_model)

    def _project(self, x, name):
        """(b, l, d_model) -> (b, h, l, d_feature) through every head's ``name`` at once."""
        b, l, _ = x.shape
        y = stacked_heads(x, [getattr(head, name) for head in self.attn_heads])  # (b, l, h*f)
        return y.view(b, l, self.n_heads, self.d_feature).transpose(1, 2)

    def forward(self, queries, keys, values, mask=None):
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
        q, k, v = self._project(queries, "query_tfm"), self._project(keys, "key_tfm"), self._project(values, "value_tfm")
        keep = None if keep is None else keep[:, None] if keep.ndim == 3 else keep  # head axis
        x, _ = attend(q, k, v, keep, scale=1 / math.sqrt(self.d_feature), dropout=self.attn_heads[0].attn.dropout)
        log_size(self, x[:, 0].shape, "Output of single head")
        x = x.transpose(1, 2).reshape(b, q_len, self.n_heads * self.d_feature)  # (b, q, h*f)
        log_size(self, x.shape, "Concatenated output")
        x = self.projection(x)
        log_size(self, x.shape, "projected output")
        return x


class PositionalEmbedding(Module):
    """Sinusoidal positions (the paper's); a constant, not in the state_dict."""

    level = TensorLoggingLevels.enc_dec

    def __init__(self, d_model, max_len=512):
        super().__init__()
        self.d_model, self.max_len = d_model, max_len
        self.register_buffer("weight", sinusoids(max_len, d_model), persistent=False)  # (1, max_len, d)

    def forward(self, x):
        """(b, l, ...) -> (1, l, d_model)."""
        check_length(x.size(1), self.max_len)
        return self.weight[:, :x.size(1), :]


def sinusoids(max_len: int, d_model: int) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...), as (1, max_len, d_model).

    Computed in float64 and rounded once, so both frameworks get the same table.
    """
    position = torch.arange(max_len, dtype=torch.float64)[:, None]
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)[:, : d_model // 2]
    return pe.float()[None]


def _feed_forward(d_model, d_ff):
    return nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))


class EncoderBlock(Module):
    """Post-LN: x = ln1(x + dropout(att(x, x, x))); x = ln2(x + dropout(ff(x)))."""

    level = TensorLoggingLevels.enc_dec_block

    def __init__(self, d_model=512, d_feature=64, d_ff=2048, n_heads=8, dropout=0.1):
        super().__init__()
        self.attn_head = MultiHeadAttention(d_model, d_feature, n_heads, dropout)
        self.layer_norm1 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.position_wise_feed_forward = _feed_forward(d_model, d_ff)
        self.layer_norm2 = nn.LayerNorm(d_model)

    def forward(self, x, mask=None):
        """(b, s, d_model) -> (b, s, d_model); mask True = masked out, e.g. padding (b, 1, s)."""
        att = self.attn_head(x, x, x, mask=mask)
        x = self.layer_norm1(x + self.dropout(att))
        x = self.layer_norm2(x + self.dropout(self.position_wise_feed_forward(x)))
        log_size(self, x.shape, "Encoder block output")
        return x


class TransformerEncoder(Module):
    level = TensorLoggingLevels.enc_dec

    def __init__(self, n_blocks=6, d_model=512, n_heads=8, d_ff=2048, dropout=0.1):
        super().__init__()
        self.encoders = nn.ModuleList([
            EncoderBlock(d_model=d_model, d_feature=d_model // n_heads, d_ff=d_ff, n_heads=n_heads, dropout=dropout)
            for _ in range(n_blocks)
        ])

    def forward(self, x, mask=None):
        """(b, s, d_model) -> (b, s, d_model)."""
        for encoder in self.encoders:
            x = encoder(x, mask=mask)
        return x


class DecoderBlock(Module):
    """Masked self-attention, cross-attention on the encoder output, feed-forward; post-LN."""

    level = TensorLoggingLevels.enc_dec_block

    def __init__(self, d_model=512, d_feature=64, d_ff=2048, n_heads=8, dropout=0.1):
        super().__init__()
        self.masked_attn_head = MultiHeadAttention(d_model, d_feature, n_heads, dropout)
        self.attn_head = MultiHeadAttention(d_model, d_feature, n_heads, dropout)
        self.position_wise_feed_forward = _feed_forward(d_model, d_ff)
        self.layer_norm1 = nn.LayerNorm(d_model)
        self.layer_norm2 = nn.LayerNorm(d_model)
        self.layer_norm3 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, enc_out, src_mask=None, tgt_mask=None):
        """Args:
            x: (b, t, d_model) target states; enc_out: (b, s, d_model).
            src_mask: True = masked out, broadcastable to (b, t, s) (source padding).
            tgt_mask: True = masked out, broadcastable to (b, t, t); give the causal part too.

        Returns: (b, t, d_model).
        """
        x = self.layer_norm1(x + self.dropout(self.masked_attn_head(x, x, x, mask=tgt_mask)))
        x = self.layer_norm2(x + self.dropout(self.attn_head(x, enc_out, enc_out, mask=src_mask)))
        x = self.layer_norm3(x + self.dropout(self.position_wise_feed_forward(x)))
        log_size(self, x.shape, "Decoder block output")
        return x


class TransformerDecoder(Module):
    level = TensorLoggingLevels.enc_dec

    def __init__(self, n_blocks=6, d_model=512, d_feature=64, d_ff=2048, n_heads=8, dropout=0.1):
        super().__init__()
        self.decoders = nn.ModuleList([
            DecoderBlock(d_model=d_model, d_feature=d_feature, d_ff=d_ff, n_heads=n_heads, dropout=dropout)
            for _ in range(n_blocks)
        ])

    def forward(self, x, enc_out, src_mask=None, tgt_mask=None):
        """(b, t, d_model), (b, s, d_model) -> (b, t, d_model)."""
        for decoder in self.decoders:
            x = decoder(x, enc_out, src_mask=src_mask, tgt_mask=tgt_mask)
        return x


def family_masks(src_attention_mask, tgt_len: int | None, tgt_attention_mask=None):
    """Padding masks (b, len), 1 = token, -> this family's masks (True = masked out).

    Returns (source mask (b, 1, s) or None, target mask (b|1, t, t) with the causal part).
    """
    src = None if src_attention_mask is None else (src_attention_mask == 0)[:, None, :]
    tgt = None
    if tgt_len is not None:
        device = None if src_attention_mask is None else src_attention_mask.device
        tgt = torch.ones(tgt_len, tgt_len, dtype=torch.bool, device=device).triu(1)[None]  # future
        if tgt_attention_mask is not None:
            tgt = tgt | (tgt_attention_mask == 0)[:, None, :]
    return src, tgt


def _check_padding_mask(mask, ids, name):
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name} must have shape (batch, length)={tuple(ids.shape)}, got {got}")
    if mask.dtype != torch.bool:
        check_values((mask == 0) | (mask == 1), f"{name} must hold only 0 (pad) and 1 (token)")


class Transformer(Module):
    """Encoder-decoder: embeddings * sqrt(d_model) + sinusoids, encoder, decoder, ``out``.

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes.
        d_model, n_heads, n_blocks, d_ff, dropout: the paper's (defaults are its base model).
        max_len: length of the sinusoid table (longest source or target).
    """

    level = TensorLoggingLevels.enc_dec

    def __init__(self, src_vocab_size, tgt_vocab_size, d_model=512, n_heads=8, n_blocks=6, d_ff=2048, dropout=0.1,
                 max_len=512):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by the number of heads ({n_heads})")
        self.src_vocab_size, self.tgt_vocab_size, self.d_model = src_vocab_size, tgt_vocab_size, d_model
        self.src_embedding = nn.Embedding(src_vocab_size, d_model)
        self.tgt_embedding = nn.Embedding(tgt_vocab_size, d_model)
        self.pos_embedding = PositionalEmbedding(d_model, max_len)
        self.encoder = TransformerEncoder(n_blocks, d_model, n_heads, d_ff, dropout)
        self.decoder = TransformerDecoder(n_blocks, d_model, d_model // n_heads, d_ff, n_heads, dropout)
        self.out = nn.Linear(d_model, tgt_vocab_size)
        self.dropout = nn.Dropout(dropout)

    def _embed(self, table, ids):
        return self.dropout(table(ids) * math.sqrt(self.d_model) + self.pos_embedding(ids))

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
        """(b, t) target ids and the encoder output -> logits (b, t, tgt_vocab_size)."""
        check_token_ids(tgt_ids, self.tgt_vocab_size, name="tgt_ids")
        check_length(tgt_ids.shape[1], self.pos_embedding.max_len)
        _check_padding_mask(tgt_attention_mask, tgt_ids, "tgt_attention_mask")
        src_mask, tgt_mask = family_masks(src_attention_mask, tgt_ids.shape[1], tgt_attention_mask)
        x = self.decoder(self._embed(self.tgt_embedding, tgt_ids), enc_out, src_mask=src_mask, tgt_mask=tgt_mask)
        return self.out(x)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.src_vocab_size, self.pos_embedding.max_len, target_vocab_size=self.tgt_vocab_size,
                         generates=True)

    def forward(self, src_ids, tgt_ids, src_attention_mask=None, tgt_attention_mask=None):
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
