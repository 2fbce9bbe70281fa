"""The BERT-like encoder of notebook 001, in Flax NNX.

The twin of ``torch_reference.encoder``: same class names, the same ``config``
argument (an ``EncoderConfig`` or anything with BERT's attribute names; converted
once at the top of each constructor), plus keyword-only ``rngs``, ``dtype`` and
``param_dtype``; same call signatures and parameter paths.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from flax_transformer.models.arg_checks import check_length
from flax_transformer.models.attention import attend, normalize_mask
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.models.constructor_records import RecordsInit
from flax_transformer.models.input_checks import check_features, check_token_ids
from flax_transformer.models.input_specs import InputSpec
from flax_transformer.models.layers import (
    ACTIVATIONS,
    Embed,
    LayerNorm,
    Linear,
    lookup,
    masked_mean,
    stacked_projection,
)


class _ConfigModule(RecordsInit, nnx.Module):
    """Records its ``config`` as a frozen ``EncoderConfig``, whatever object was passed."""

    _init_converters = {"config": EncoderConfig.from_any}


def _mask_to_bool(mask, scores_shape):
    """The notebook's mask (0 = masked out, anything else = keep) as a bool, checked."""
    if not hasattr(mask, "shape"):
        raise TypeError(f"mask must be an array, got {type(mask).__name__}")
    try:
        jnp.broadcast_shapes(tuple(mask.shape), scores_shape)
    except ValueError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the scores {scores_shape}") from None
    return mask if mask.dtype == jnp.bool_ else mask != 0


def scaled_dot_product_attention(query, key, value, mask=None, *, return_weights: bool = False,
                                 implementation: str = "reference"):
    """softmax(q k^T / sqrt(d_k)) v, as in the notebook.

    Args:
        query: (..., q_len, d_k); key: (..., k_len, d_k); value: (..., k_len, d_v).
        mask: optional, broadcastable to (..., q_len, k_len); 0/False = masked out
            (the notebook's ``mask == 0`` convention). A fully masked row gives zeros.
        return_weights: also return the attention weights (..., q_len, k_len).

    Returns:
        (..., q_len, d_v), and the weights if asked.
    """
    dim_k = query.shape[-1]
    scores_shape = tuple(query.shape[:-1]) + (key.shape[-2],)
    mask = None if mask is None else _mask_to_bool(mask, scores_shape)
    out, weights = attend(query, key, value, mask, scale=1 / math.sqrt(dim_k), implementation=implementation,
                          need_weights=return_weights)
    return (out, weights) if return_weights else out


class AttentionHead(RecordsInit, nnx.Module):
    """One head: its own q, k, v projections (embed_dim -> head_dim)."""

    def __init__(self, embed_dim, head_dim, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embed_dim, self.dtype = embed_dim, dtype
        self.attention_impl = "reference"  # see set_attention
        self.q = Linear(embed_dim, head_dim, **kw)
        self.k = Linear(embed_dim, head_dim, **kw)
        self.v = Linear(embed_dim, head_dim, **kw)

    def __call__(self, hidden_state, mask=None, *, return_weights: bool = False):
        """Args: hidden_state (b, t, embed_dim); mask (b, t) or (b, t, t), True/1 = attend.

        Returns: (b, t, head_dim), and the weights (b, t, t) if asked.
        """
        check_features(hidden_state, self.embed_dim, name="hidden_state")
        b, t, _ = hidden_state.shape
        mask = normalize_mask(mask, b, t, t, heads=1)
        if mask is not None:
            mask = mask[:, 0]  # (b, 1|t, t): no head axis here
        x = hidden_state.astype(self.dtype)
        return scaled_dot_product_attention(self.q(x), self.k(x), self.v(x), mask, return_weights=return_weights,
                                            implementation=self.attention_impl)


class MultiHeadAttention(_ConfigModule):
    """``num_attention_heads`` ``AttentionHead``s, concatenated, then ``output_linear``.

    The heads keep their own parameters (the notebook's layout: ``heads.<i>.q``), but
    the call stacks them into one projection per q/k/v: the same math as running each
    head and concatenating, in one matmul instead of ``3 * heads``.
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.attention_impl = "reference"  # see set_attention
        config = EncoderConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.heads = nnx.List([AttentionHead(config.hidden_size, config.head_dim, **kw)
                               for _ in range(config.num_attention_heads)])
        self.output_linear = Linear(config.hidden_size, config.hidden_size, **kw)
        self.attn_dropout = nnx.Dropout(config.attention_probs_dropout_prob, rngs=rngs)

    # transformers' names of the one projection over all heads that ``heads.<i>.q`` etc. are
    # slices of (BERT's and RoBERTa's ``query``, DistilBERT's ``q_lin``): ``lora.apply`` puts a LoRA
    # over all heads (``lora.FusedLoRA``, at ``q_lora``) where a target names one of them
    LORA_FUSED = {"q": ("query", "q_lin"), "k": ("key", "k_lin"), "v": ("value", "v_lin")}

    def head_layers(self, name) -> list:
        """Every head's ``name`` projection ("q", "k" or "v"), in head order."""
        return [getattr(head, name) for head in self.heads]

    def _project(self, x, name):
        """(b, t, e) -> (b, h, t, d) through every head's ``name`` projection at once (and their LoRA)."""
        b, t, _ = x.shape
        y = stacked_projection(x, self.head_layers(name), self.dtype, getattr(self, f"{name}_lora", None))
        return y.reshape(b, t, len(self.heads), y.shape[-1] // len(self.heads)).transpose(0, 2, 1, 3)

    def __call__(self, hidden_state, mask=None, *, return_weights: bool = False):
        """Args:
            hidden_state: (b, t, hidden_size).
            mask: (b, t) padding mask (1 = token), or (b, t, t) / (b, 1|h, 1|t, t); True = attend.
            return_weights: also return the attention weights (b, h, t, t).

        Returns: (b, t, hidden_size), and the weights if asked.
        """
        check_features(hidden_state, self.hidden_size, name="hidden_state")
        b, t, e = hidden_state.shape
        mask = normalize_mask(mask, b, t, t, heads=len(self.heads))
        x = hidden_state.astype(self.dtype)
        q, k, v = (self._project(x, n) for n in ("q", "k", "v"))  # (b, h, t, d)
        out, weights = attend(q, k, v, mask, scale=1 / math.sqrt(q.shape[-1]), dropout=self.attn_dropout,
                              implementation=self.attention_impl, need_weights=return_weights)
        out = self.output_linear(out.transpose(0, 2, 1, 3).reshape(b, t, e))  # (b, t, e)
        return (out, weights) if return_weights else out


class FeedForward(_ConfigModule):
    """linear_1 -> activation (``hidden_act``; "gelu" is the exact GELU) -> linear_2 -> dropout."""

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = EncoderConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.linear_1 = Linear(config.hidden_size, config.intermediate_size, **kw)
        self.linear_2 = Linear(config.intermediate_size, config.hidden_size, **kw)
        self.hidden_act = config.hidden_act
        self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)

    def __call__(self, x):
        """(b, t, hidden_size) -> (b, t, hidden_size)."""
        hidden = ACTIVATIONS[self.hidden_act](self.linear_1(x))
        return self.dropout(self.linear_2(hidden))


class TransformerEncoderLayer(_ConfigModule):
    """Attention and feed-forward with residuals.

    ``config.norm_first=True`` (the notebook): x + att(ln1(x)), then x + ff(ln2(x)).
    ``config.norm_first=False`` (BERT): ln1(x + dropout(att(x))), then ln2(x + ff(x)).
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = EncoderConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm_first, self.dtype = config.norm_first, dtype
        self.layer_norm_1 = LayerNorm(config.hidden_size, eps=config.block_eps, **kw)
        self.layer_norm_2 = LayerNorm(config.hidden_size, eps=config.block_eps, **kw)
        self.attention = MultiHeadAttention(config, **kw)
        self.feed_forward = FeedForward(config, **kw)
        self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)

    def _attend(self, x, mask, return_weights):
        if return_weights:
            return self.attention(x, mask, return_weights=True)
        return self.attention(x, mask), None

    def __call__(self, x, mask=None, *, return_weights: bool = False):
        """Args: x (b, t, hidden_size); mask as for ``MultiHeadAttention``.

        Returns: (b, t, hidden_size), and the attention weights (b, h, t, t) if asked.
        """
        x = x.astype(self.dtype)  # the residual stream runs in the compute dtype
        if self.norm_first:
            attended, weights = self._attend(self.layer_norm_1(x), mask, return_weights)
            x = x + attended
            x = x + self.feed_forward(self.layer_norm_2(x))
        else:
            attended, weights = self._attend(x, mask, return_weights)
            x = self.layer_norm_1(x + self.dropout(attended))
            x = self.layer_norm_2(x + self.feed_forward(x))
        return (x, weights) if return_weights else x


class Embeddings(_ConfigModule):
    """Token + learned position (+ BERT's token-type) embeddings, LayerNorm (config eps), dropout.

    Positions are 0, 1, ... (BERT, DistilBERT), or with ``config.position_padding_idx``
    RoBERTa's: real tokens count from ``position_padding_idx + 1``, and a token equal to
    ``position_padding_idx`` (padding, wherever it is) takes position ``position_padding_idx``.
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = EncoderConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.vocab_size, self.max_positions, self.dtype = config.vocab_size, config.max_position_embeddings, dtype
        self.max_length, self.position_padding_idx = config.max_length, config.position_padding_idx
        self.token_types = config.token_types
        self.token_embeddings = Embed(config.vocab_size, config.hidden_size, **kw)
        self.position_embeddings = Embed(config.max_position_embeddings, config.hidden_size, **kw)
        if config.token_types:
            self.token_type_embeddings = Embed(config.token_types, config.hidden_size, **kw)
        self.layer_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, **kw)
        self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)

    def check(self, input_ids, token_type_ids=None):
        """Every check of ``__call__``, so a caller can make them before computing anything."""
        check_token_ids(input_ids, self.vocab_size)
        check_length(input_ids.shape[1], self.max_length)
        if token_type_ids is not None:
            if not self.token_types:
                raise ValueError("token_type_ids given, but this encoder has no token-type embeddings "
                                 "(EncoderConfig.token_types = 0)")
            check_token_ids(token_type_ids, self.token_types, name="token_type_ids")
            if token_type_ids.shape != input_ids.shape:
                raise ValueError(f"token_type_ids has shape {tuple(token_type_ids.shape)}, "
                                 f"input_ids {tuple(input_ids.shape)}")

    def __call__(self, input_ids, token_type_ids=None):
        """(b, t) integer ids (and segment ids, default 0) -> (b, t, hidden_size)."""
        self.check(input_ids, token_type_ids)
        seq_length = input_ids.shape[1]
        if self.position_padding_idx is None:
            positions = jnp.arange(seq_length)[None]  # (1, t)
        else:  # RoBERTa (fairseq's make_positions): read from the ids, not from the attention mask
            real = (input_ids != self.position_padding_idx).astype(jnp.int32)  # (b, t)
            positions = jnp.cumsum(real, axis=1) * real + self.position_padding_idx  # (b, t)
        embeddings = (lookup(self.token_embeddings, input_ids, self.dtype)
                      + lookup(self.position_embeddings, positions, self.dtype))  # (b, t, e)
        if self.token_types:
            if token_type_ids is None:
                token_type_ids = jnp.zeros_like(input_ids)
            embeddings = embeddings + lookup(self.token_type_embeddings, token_type_ids, self.dtype)
        return self.dropout(self.layer_norm(embeddings))


class TransformerEncoder(_ConfigModule):
    """Embeddings and ``num_hidden_layers`` encoder layers (and BERT's pooler if configured).

    With ``EncoderConfig.bert(...)`` this is BERT's ``BertModel``: post-LN, token types,
    pooler; ``flax_transformer.interop.hf`` loads HuggingFace checkpoints into it.
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = EncoderConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embeddings = Embeddings(config, **kw)
        self.layers = nnx.List([TransformerEncoderLayer(config, **kw) for _ in range(config.num_hidden_layers)])
        self.pooler = Linear(config.hidden_size, config.hidden_size, **kw) if config.pooler else None

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.embeddings.vocab_size, self.embeddings.max_length)

    def __call__(self, x, attention_mask=None, token_type_ids=None, *, return_attentions: bool = False):
        """Args:
            x: (b, t) integer token ids.
            attention_mask: optional (b, t), 1 = token, 0 = padding (HF's convention).
            token_type_ids: optional (b, t) segment ids (needs ``token_types``); default 0.
            return_attentions: also return a tuple with each layer's weights (b, h, t, t).

        Returns: the last hidden state (b, t, hidden_size), and the attentions if asked.
        """
        # check everything before computing anything
        self.embeddings.check(x, token_type_ids)
        b, t = x.shape
        if attention_mask is not None and (not hasattr(attention_mask, "ndim") or attention_mask.ndim != 2):
            got = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
            raise ValueError(f"attention_mask must have shape (batch, length)=({b}, {t}), got {got}")
        mask = normalize_mask(attention_mask, b, t, t, name="attention_mask")
        hidden = self.embeddings(x, token_type_ids)
        attentions = []
        for layer in self.layers:
            hidden, weights = layer(hidden, mask, return_weights=True)
            attentions.append(weights)
        return (hidden, tuple(attentions)) if return_attentions else hidden

    def pool(self, hidden):
        """BERT's pooler output: tanh(dense(hidden[:, 0])), (b, hidden_size)."""
        if self.pooler is None:
            raise ValueError("this encoder has no pooler (EncoderConfig.pooler = False)")
        return jnp.tanh(self.pooler(hidden[:, 0]))


class TransformerForSequenceClassification(_ConfigModule):
    """Encoder, then a pooled vector through dropout and a linear layer.

    ``config.classifier_pooling`` picks the vector: "cls", the first hidden state (the
    notebook's), through BERT's pooler when the encoder has one (``EncoderConfig.bert``:
    exactly HF's ``BertForSequenceClassification``); or "mean", the mean over real tokens.
    ``config.classifier_head`` adds a dense layer before ``classifier``: "relu" is
    ``DistilBertForSequenceClassification``'s ``pre_classifier``, "tanh" is
    ``RobertaClassificationHead`` (its ``dense`` is our ``pre_classifier``, ``out_proj`` our ``classifier``).
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = EncoderConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.pooling = config.classifier_pooling  # "cls" or "mean"
        self.classifier_head = config.classifier_head  # "linear", "relu" or "tanh"
        self.encoder = TransformerEncoder(config, **kw)
        self.dropout = nnx.Dropout(config.head_dropout, rngs=rngs)
        if config.classifier_head != "linear":
            self.pre_classifier = Linear(config.hidden_size, config.hidden_size, **kw)
        self.classifier = Linear(config.hidden_size, config.num_labels, **kw)

    def features(self, x, attention_mask=None):
        """The pooled vector the classifier reads: (b, t) ids -> (b, hidden_size)."""
        hidden = self.encoder(x, attention_mask)  # (b, t, hidden)
        if self.pooling == "mean":
            return masked_mean(hidden, attention_mask)
        if self.encoder.pooler is not None:
            return self.encoder.pool(hidden)  # tanh(dense(hidden[:, 0]))
        return hidden[:, 0, :]  # [CLS] hidden state

    def classify(self, features):
        """(b, hidden_size) pooled vectors -> (b, num_labels) float32 logits."""
        if self.classifier_head == "relu":  # DistilBERT: pre_classifier, ReLU, dropout, classifier
            features = jax.nn.relu(self.pre_classifier(features))
        elif self.classifier_head == "tanh":  # RoBERTa: dropout, dense, tanh, dropout, out_proj
            features = jnp.tanh(self.pre_classifier(self.dropout(features)))
        return self.classifier(self.dropout(features)).astype(jnp.float32)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return self.encoder.input_spec()

    def __call__(self, x, attention_mask=None):
        """Args: x (b, t) token ids; attention_mask optional (b, t), 1 = token.

        Returns: (b, num_labels) logits (float32).
        """
        return self.classify(self.features(x, attention_mask))


__all__ = [
    "scaled_dot_product_attention", "AttentionHead", "MultiHeadAttention", "FeedForward",
    "TransformerEncoderLayer", "Embeddings", "TransformerEncoder", "TransformerForSequenceClassification", "masked_mean",
]
