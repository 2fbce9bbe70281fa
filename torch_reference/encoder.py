"""The BERT-like encoder of notebook 001, in PyTorch.

Class names, attribute names and the ``config`` constructor argument are the
notebook's, so ``TransformerForSequenceClassification(config).state_dict()`` from the
notebook loads here with ``strict=True`` and gives the same logits in eval mode.
``config`` is an ``EncoderConfig`` or anything with BERT's attribute names (a
``BertConfig``, a ``SimpleNamespace``); see ``EncoderConfig`` for the defaults.

Changes from the notebook (all listed in the README): no debug prints; the
embeddings' dropout uses ``hidden_dropout_prob`` (the notebook's ``nn.Dropout()`` is
p=0.5) and their LayerNorm the config's eps; position ids are created on the input's
device; attention takes an optional mask (masked rows give zeros, not NaN) and can
return its weights; ``norm_first=False`` gives BERT's post-LN layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flax_transformer.models.arg_checks import check_length
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.models.input_specs import InputSpec

from ._common import Module, attend, check_features, check_token_ids, masked_mean, normalize_mask, stacked_heads


class _ConfigModule(Module):
    """Records its ``config`` as a frozen ``EncoderConfig``, whatever object was passed."""

    _init_converters = {"config": EncoderConfig.from_any}


def _mask_to_bool(mask, scores_shape):
    """The notebook's mask (0 = masked out, anything else = keep) as a bool, checked."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    try:
        torch.broadcast_shapes(tuple(mask.shape), scores_shape)
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the scores {scores_shape}") from None
    return mask if mask.dtype == torch.bool else mask != 0


def scaled_dot_product_attention(query, key, value, mask=None, *, return_weights: bool = False):
    """softmax(q k^T / sqrt(d_k)) v, as in the notebook.

    Args:
        query: (..., q_len, d_k); key: (..., k_len, d_k); value: (..., k_len, d_v).
        mask: optional, broadcastable to (..., q_len, k_len); 0/False = masked out
            (the notebook's ``mask == 0`` convention). A fully masked row gives zeros.
        return_weights: also return the attention weights (..., q_len, k_len).

    Returns:
        (..., q_len, d_v), and the weights if asked.
    """
    dim_k = query.size(-1)
    scores_shape = tuple(query.shape[:-1]) + (key.shape[-2],)
    mask = None if mask is None else _mask_to_bool(mask, scores_shape)
    out, weights = attend(query, key, value, mask, scale=1 / math.sqrt(dim_k))
    return (out, weights) if return_weights else out


class AttentionHead(Module):
    """One head: its own q, k, v projections (embed_dim -> head_dim)."""

    def __init__(self, embed_dim, head_dim):
        super().__init__()
        self.q = nn.Linear(embed_dim, head_dim)
        self.k = nn.Linear(embed_dim, head_dim)
        self.v = nn.Linear(embed_dim, head_dim)

    def forward(self, hidden_state, mask=None, *, return_weights: bool = False):
        """Args: hidden_state (b, t, embed_dim); mask (b, t) or (b, t, t), True/1 = attend.

        Returns: (b, t, head_dim), and the weights (b, t, t) if asked.
        """
        check_features(hidden_state, self.q.in_features, name="hidden_state")
        b, t, _ = hidden_state.shape
        mask = normalize_mask(mask, b, t, t, heads=1)
        if mask is not None:
            mask = mask[:, 0]  # (b, 1|t, t): no head axis here
        return scaled_dot_product_attention(
            self.q(hidden_state), self.k(hidden_state), self.v(hidden_state), mask, return_weights=return_weights)


class MultiHeadAttention(_ConfigModule):
    """``num_attention_heads`` ``AttentionHead``s, concatenated, then ``output_linear``.

    The heads keep their own parameters (the notebook's state_dict layout), but the
    forward pass stacks them into one projection: the same math as running each head
    and concatenating, in one matmul instead of ``3 * heads``.
    """

    def __init__(self, config):
        super().__init__()
        config = EncoderConfig.from_any(config)
        embed_dim, num_heads = config.hidden_size, config.num_attention_heads
        self.heads = nn.ModuleList([AttentionHead(embed_dim, config.head_dim) for _ in range(num_heads)])
        self.output_linear = nn.Linear(embed_dim, embed_dim)
        self.attn_dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def _project(self, x, name):
        """(b, t, e) -> (b, h, t, d) through every head's ``name`` projection at once."""
        b, t, _ = x.shape
        y = stacked_heads(x, [getattr(head, name) for head in self.heads])  # (b, t, h*d)
        return y.view(b, t, len(self.heads), y.shape[-1] // len(self.heads)).transpose(1, 2)

    def forward(self, hidden_state, mask=None, *, return_weights: bool = False):
        """Args:
            hidden_state: (b, t, hidden_size).
            mask: (b, t) padding mask (1 = token), or (b, t, t) / (b, 1|h, 1|t, t); True = attend.
            return_weights: also return the attention weights (b, h, t, t).

        Returns: (b, t, hidden_size), and the weights if asked.
        """
        check_features(hidden_state, self.output_linear.in_features, name="hidden_state")
        b, t, e = hidden_state.shape
        mask = normalize_mask(mask, b, t, t, heads=len(self.heads))
        q, k, v = (self._project(hidden_state, n) for n in ("q", "k", "v"))  # (b, h, t, d)
        d = q.shape[-1]
        out, weights = attend(q, k, v, mask, scale=1 / math.sqrt(d), dropout=self.attn_dropout)
        out = self.output_linear(out.transpose(1, 2).reshape(b, t, e))  # (b, t, e)
        return (out, weights) if return_weights else out


_ACTIVATIONS = {"gelu": nn.GELU, "gelu_new": lambda: nn.GELU(approximate="tanh"),
                "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU, "silu": nn.SiLU}


class FeedForward(_ConfigModule):
    """linear_1 -> activation (``hidden_act``; "gelu" is the exact GELU) -> linear_2 -> dropout."""

    def __init__(self, config):
        super().__init__()
        config = EncoderConfig.from_any(config)
        self.linear_1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.gelu = _ACTIVATIONS[config.hidden_act]()  # named gelu, as the notebook's nn.GELU()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x):
        """(b, t, hidden_size) -> (b, t, hidden_size)."""
        return self.dropout(self.linear_2(self.gelu(self.linear_1(x))))


class TransformerEncoderLayer(_ConfigModule):
    """Attention and feed-forward with residuals.

    ``config.norm_first=True`` (the notebook): x + att(ln1(x)), then x + ff(ln2(x)).
    ``config.norm_first=False`` (BERT): ln1(x + dropout(att(x))), then ln2(x + ff(x)).
    """

    def __init__(self, config):
        super().__init__()
        config = EncoderConfig.from_any(config)
        self.norm_first = config.norm_first
        self.layer_norm_1 = nn.LayerNorm(config.hidden_size, eps=config.block_eps)
        self.layer_norm_2 = nn.LayerNorm(config.hidden_size, eps=config.block_eps)
        self.attention = MultiHeadAttention(config)
        self.feed_forward = FeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, mask=None, *, return_weights: bool = False):
        """Args: x (b, t, hidden_size); mask as for ``MultiHeadAttention``.

        Returns: (b, t, hidden_size), and the attention weights (b, h, t, t) if asked.
        """
        if self.norm_first:
            attended, weights = self.attention(self.layer_norm_1(x), mask, return_weights=True)
            x = x + attended
            x = x + self.feed_forward(self.layer_norm_2(x))
        else:
            attended, weights = self.attention(x, mask, return_weights=True)
            x = self.layer_norm_1(x + self.dropout(attended))
            x = self.layer_norm_2(x + self.feed_forward(x))
        return (x, weights) if return_weights else x


class Embeddings(_ConfigModule):
    """Token + learned position (+ BERT's token-type) embeddings, LayerNorm (config eps), dropout.

    Positions are 0, 1, ... (BERT, DistilBERT), or with ``config.position_padding_idx``
    RoBERTa's: real tokens count from ``position_padding_idx + 1``, and a token equal to
    ``position_padding_idx`` (padding, wherever it is) takes position ``position_padding_idx``.
    """

    def __init__(self, config):
        super().__init__()
        config = EncoderConfig.from_any(config)
        self.max_length, self.position_padding_idx = config.max_length, config.position_padding_idx
        self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        if config.token_types:
            self.token_type_embeddings = nn.Embedding(config.token_types, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def check(self, input_ids, token_type_ids=None):
        """Every check of ``forward``, so a caller can make them before computing anything."""
        check_token_ids(input_ids, self.token_embeddings.num_embeddings)
        check_length(input_ids.size(1), self.max_length)
        if token_type_ids is not None:
            if not hasattr(self, "token_type_embeddings"):
                raise ValueError("token_type_ids given, but this encoder has no token-type embeddings "
                                 "(EncoderConfig.token_types = 0)")
            check_token_ids(token_type_ids, self.token_type_embeddings.num_embeddings, name="token_type_ids")
            if token_type_ids.shape != input_ids.shape:
                raise ValueError(f"token_type_ids has shape {tuple(token_type_ids.shape)}, "
                                 f"input_ids {tuple(input_ids.shape)}")

    def forward(self, input_ids, token_type_ids=None):
        """(b, t) integer ids (and segment ids, default 0) -> (b, t, hidden_size)."""
        self.check(input_ids, token_type_ids)
        seq_length = input_ids.size(1)
        if self.position_padding_idx is None:
            position_ids = torch.arange(seq_length, dtype=torch.long, device=input_ids.device)[None]  # (1, t)
        else:  # RoBERTa (fairseq's make_positions): read from the ids, not from the attention mask
            real = (input_ids != self.position_padding_idx).long()  # (b, t)
            position_ids = torch.cumsum(real, dim=1) * real + self.position_padding_idx  # (b, t)
        embeddings = self.token_embeddings(input_ids) + self.position_embeddings(position_ids)
        if hasattr(self, "token_type_embeddings"):
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.layer_norm(embeddings))


class TransformerEncoder(_ConfigModule):
    """Embeddings and ``num_hidden_layers`` encoder layers (and BERT's pooler if configured).

    With ``EncoderConfig.bert(...)`` this is BERT's ``BertModel``: post-LN, token types,
    pooler; ``flax_transformer.interop.hf`` loads HuggingFace checkpoints into it.
    """

    def __init__(self, config):
        super().__init__()
        config = EncoderConfig.from_any(config)
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList([TransformerEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        if config.pooler:
            self.pooler = nn.Linear(config.hidden_size, config.hidden_size)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.embeddings.token_embeddings.num_embeddings, self.embeddings.max_length)

    def forward(self, x, attention_mask=None, token_type_ids=None, *, return_attentions: bool = False):
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
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2):
            got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
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
        if not hasattr(self, "pooler"):
            raise ValueError("this encoder has no pooler (EncoderConfig.pooler = False)")
        return torch.tanh(self.pooler(hidden[:, 0]))


class TransformerForSequenceClassification(_ConfigModule):
    """Encoder, then a pooled vector through dropout and a linear layer.

    ``config.classifier_pooling`` picks the vector: "cls", the first hidden state (the
    notebook's), through BERT's pooler when the encoder has one (``EncoderConfig.bert``:
    exactly HF's ``BertForSequenceClassification``); or "mean", the mean over real tokens.
    ``config.classifier_head`` adds a dense layer before ``classifier``: "relu" is
    ``DistilBertForSequenceClassification``'s ``pre_classifier``, "tanh" is
    ``RobertaClassificationHead`` (its ``dense`` is our ``pre_classifier``, ``out_proj`` our ``classifier``).
    """

    def __init__(self, config):
        super().__init__()
        config = EncoderConfig.from_any(config)
        self.pooling = config.classifier_pooling  # "cls" or "mean"
        self.classifier_head = config.classifier_head  # "linear", "relu" or "tanh"
        self.encoder = TransformerEncoder(config)
        self.dropout = nn.Dropout(config.head_dropout)
        if config.classifier_head != "linear":
            self.pre_classifier = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def features(self, x, attention_mask=None):
        """The pooled vector the classifier reads: (b, t) ids -> (b, hidden_size)."""
        hidden = self.encoder(x, attention_mask)  # (b, t, hidden)
        if self.pooling == "mean":
            return masked_mean(hidden, attention_mask)
        if hasattr(self.encoder, "pooler"):
            return self.encoder.pool(hidden)  # tanh(dense(hidden[:, 0]))
        return hidden[:, 0, :]  # [CLS] hidden state

    def classify(self, features):
        """(b, hidden_size) pooled vectors -> (b, num_labels) logits."""
        if self.classifier_head == "relu":  # DistilBERT: pre_classifier, ReLU, dropout, classifier
            features = torch.relu(self.pre_classifier(features))
        elif self.classifier_head == "tanh":  # RoBERTa: dropout, dense, tanh, dropout, out_proj
            features = torch.tanh(self.pre_classifier(self.dropout(features)))
        return self.classifier(self.dropout(features))

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return self.encoder.input_spec()

    def forward(self, x, attention_mask=None):
        """Args: x (b, t) token ids; attention_mask optional (b, t), 1 = token.

        Returns: (b, num_labels) logits.
        """
        return self.classify(self.features(x, attention_mask))

