"""The GPT from scratch of notebook 002, in PyTorch.

Class names, constructor arguments and attribute names are the notebook's, so a
notebook ``GPTTransformer(n_layers=1, ...)`` state_dict loads with ``strict=True`` and
gives the same logits in eval mode with dropout 0. The notebook's math is kept
(its own ``Linear`` with a ``matrix`` of shape (d_in, d_out), its ``LayerNorm`` with
the unbiased std and eps added to the std, the additive ``-1e20`` masks, and the
residual added again around each layer in ``GPTTransformer.forward``).

Bugs fixed (listed in the README): ``GPTTransformer`` built one layer whatever
``n_layers`` was; the basic ``Attention`` computed v with ``k_proj``; ``FeedForward``
and ``GPTTransformerLayer`` applied dropout in eval mode too; ``GPTMHAttention``
required an ``attention_mask`` (here optional) and the basic attentions ignored it.

Masks: ``attention_mask`` is (b, l) with 1 = token and 0 = pad, as the notebook's
collator builds it. It becomes the notebook's additive mask at the attention boundary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flax_transformer.models.arg_checks import check_divisible, check_length
from flax_transformer.models.configs import GPTConfig
from flax_transformer.models.input_specs import InputSpec

from ._common import Module, attend, check_features, check_token_ids, check_values

INF = 1e20  # the notebook's additive mask constant


def ReLU(x):
    """The notebook's ReLU (it may not use torch's modules)."""
    return x * (x > 0)


def check_attention_mask(attention_mask, batch: int, length: int) -> None:
    """(b, l) of 0/1 (bool, int or float), as the notebook's collator builds it."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"attention_mask must have shape (batch, length)=({batch}, {length}), "
                         f"got {tuple(attention_mask.shape)}")
    if attention_mask.dtype != torch.bool:  # a value check: no graph break, no sync (see _common)
        check_values((attention_mask == 0) | (attention_mask == 1), "attention_mask must hold only 0 (pad) and 1 (token)")


def additive_mask(scores, attention_mask, causal: bool):
    """The notebook's mask: -INF on future keys, and again on padded keys (they add up)."""
    mask = torch.zeros_like(scores)
    if causal:
        mask = torch.triu(torch.ones_like(scores), diagonal=1)
    if attention_mask is not None:
        pad = 1.0 - attention_mask.to(scores.dtype)  # (b, l): 1 on padding
        pad = pad[:, None, :] if scores.ndim == 3 else pad[:, None, None, :]
        mask = mask + pad
    return mask * (-INF)


class Embeddings(Module):
    """A lookup table, initialised N(0, 0.02^2) (the notebook's)."""

    def __init__(self, vocab_size, d):
        super().__init__()
        self.embeddings = nn.Parameter(0.02 * torch.randn(vocab_size, d))

    def forward(self, x):
        """(b, l) ids -> (b, l, d)."""
        check_token_ids(x, self.embeddings.shape[0], name="x")
        return self.embeddings[x]


class Linear(Module):
    """x @ matrix + bias, with ``matrix`` of shape (d_in, d_out), initialised N(0, 0.02^2)."""

    def __init__(self, d_in, d_out, bias=True):
        super().__init__()
        self.matrix = nn.Parameter(0.02 * torch.randn(d_in, d_out))
        if bias:
            self.bias = nn.Parameter(0.02 * torch.randn(d_out))

    def forward(self, x):
        """(..., d_in) -> (..., d_out)."""
        results = x @ self.matrix
        if hasattr(self, "bias"):
            results = results + self.bias
        return results


class LayerNorm(Module):
    """The notebook's LayerNorm: gamma * (x - mean) / (std + eps) + beta, std unbiased."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(d))
        self.beta = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        """(..., d) -> (..., d); statistics in fp32."""
        x32 = x.float()
        mean = x32.mean(dim=-1, keepdim=True)
        std = x32.std(dim=-1, keepdim=True)  # unbiased (n - 1), as the notebook
        y = self.gamma.float() * (x32 - mean) / (std + self.eps) + self.beta.float()
        return y.to(x.dtype)


class FeedForward(Module):
    """w1 -> ReLU -> dropout -> w2 (dropout only in training mode: the notebook's bug fixed)."""

    def __init__(self, d_embed, d_ff, dropout=0.1):
        super().__init__()
        self.w1 = Linear(d_embed, d_ff)
        self.w2 = Linear(d_ff, d_embed)
        self.act_fn = ReLU
        self.dropout = dropout

    def forward(self, x):
        """(b, l, d_embed) -> (b, l, d_embed)."""
        z = self.act_fn(self.w1(x))
        z = F.dropout(z, p=self.dropout, training=self.training)
        return self.w2(z)


def _softmax_attention(q, k, v, scores_mask):
    """softmax(q k^T / sqrt(d) + additive mask) v; softmax in fp32."""
    d = k.shape[-1]
    s_ij = q @ k.transpose(-1, -2) * d ** (-0.5)
    if scores_mask is not None:
        s_ij = s_ij + scores_mask
    a_ij = torch.softmax(s_ij.float(), dim=-1).to(q.dtype)
    return a_ij @ v


class Attention(Module):
    """Single-head attention with biased projections, no causal mask (the tutorial's first step).

    ``attention_mask`` (b, l), 1 = token, masks padded keys additively (the notebook ignored it).
    """

    def __init__(self, d):
        super().__init__()
        self.q_proj = Linear(d, d)
        self.k_proj = Linear(d, d)
        self.v_proj = Linear(d, d)

    def forward(self, x, attention_mask=None):
        """(b, l, d) -> (b, l, d)."""
        check_features(x, self.q_proj.matrix.shape[0])
        check_attention_mask(attention_mask, x.shape[0], x.shape[1])
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # the notebook used k_proj for v
        scores_shape = (x.shape[0], x.shape[1], x.shape[1])
        mask = None if attention_mask is None else additive_mask(x.new_zeros(scores_shape), attention_mask, False)
        return _softmax_attention(q, k, v, mask)


class TransformerLayer(Module):
    """z = ln_att(att(ln_in(x)) + ln_in(x)); return ff(z) + z (the notebook's order)."""

    def __init__(self, d_embed, d_ff, dropout=0.1):
        super().__init__()
        self.attention = Attention(d_embed)
        self.feed_forward = FeedForward(d_embed, d_ff, dropout)
        self.input_layer_norm = LayerNorm(d_embed)
        self.attention_layer_norm = LayerNorm(d_embed)

    def forward(self, x, attention_mask=None):
        """(b, l, d_embed) -> (b, l, d_embed)."""
        normed_input = self.input_layer_norm(x)
        z = self.attention(normed_input, attention_mask) + normed_input
        z = self.attention_layer_norm(z)
        return self.feed_forward(z) + z


class GPTAttention(Module):
    """Single-head causal attention, projections without bias."""

    def __init__(self, d_embed):
        super().__init__()
        self.q = Linear(d_embed, d_embed, bias=False)
        self.k = Linear(d_embed, d_embed, bias=False)
        self.v = Linear(d_embed, d_embed, bias=False)

    def forward(self, x, attention_mask=None):
        """(b, l, d) -> (b, l, d); causal, plus padded keys masked if a mask is given."""
        check_features(x, self.q.matrix.shape[0])
        check_attention_mask(attention_mask, x.shape[0], x.shape[1])
        q, k, v = self.q(x), self.k(x), self.v(x)
        mask = additive_mask(x.new_zeros(x.shape[0], x.shape[1], x.shape[1]), attention_mask, True)
        return _softmax_attention(q, k, v, mask)


class GPTTransformerLayer(Module):
    """x = ln_in(x); z = ln_att(dropout(att(x)) + x); return dropout(ff(z)) + z."""

    def __init__(self, d_embed, d_ff, dropout=0.1):
        super().__init__()
        self.dropout = dropout
        self.attention = GPTAttention(d_embed)
        self.feed_forward = FeedForward(d_embed, d_ff, dropout=self.dropout)
        self.layer_norm_attention = nn.LayerNorm(d_embed)
        self.layer_norm_input = nn.LayerNorm(d_embed)

    def forward(self, x, attention_mask=None):
        """(b, l, d_embed) -> (b, l, d_embed)."""
        x = self.layer_norm_input(x)
        z = self.attention(x, attention_mask=attention_mask)
        z = F.dropout(z, p=self.dropout, training=self.training) + x
        z = self.layer_norm_attention(z)
        y = self.feed_forward(z)
        return F.dropout(y, p=self.dropout, training=self.training) + z


class GPTMHAttention(Module):
    """Multi-head causal attention with the padding mask (the notebook's final attention).

    Args of forward:
        x: (b, l, d_embed).
        attention_mask: optional (b, l), 1 = token, 0 = pad. Converted here to the
            notebook's additive mask: -1e20 on future keys and -1e20 on padded keys.
    """

    def __init__(self, d_embed, n_heads):
        super().__init__()
        check_divisible(d_embed, n_heads)
        self.q_proj = nn.Linear(d_embed, d_embed, bias=False)
        self.k_proj = nn.Linear(d_embed, d_embed, bias=False)
        self.v_proj = nn.Linear(d_embed, d_embed, bias=False)
        self.n_heads = n_heads

    def forward(self, x, attention_mask=None):
        """(b, l, d_embed) -> (b, l, d_embed)."""
        check_features(x, self.q_proj.in_features)
        batch_size, seq_len, d_embed = x.shape
        check_attention_mask(attention_mask, batch_size, seq_len)
        # (b, l, d) -> (b, h, l, d_h)
        q = self.q_proj(x).reshape(batch_size, seq_len, self.n_heads, d_embed // self.n_heads).transpose(1, 2)
        k = self.k_proj(x).reshape(batch_size, seq_len, self.n_heads, d_embed // self.n_heads).transpose(1, 2)
        v = self.v_proj(x).reshape(batch_size, seq_len, self.n_heads, d_embed // self.n_heads).transpose(1, 2)
        mask = additive_mask(x.new_zeros(batch_size, self.n_heads, seq_len, seq_len), attention_mask, True)
        y = _softmax_attention(q, k, v, mask)  # (b, h, l, d_h)
        return y.transpose(2, 1).reshape(batch_size, seq_len, d_embed)


class GPTMHTransformerLayer(Module):
    """Post-LN: z = ln_att(dropout(att(x)) + x); return ln_ff(ff(z) + z)."""

    def __init__(self, d_embed, d_ff, n_heads, dropout=0.1):
        super().__init__()
        self.attention = GPTMHAttention(d_embed, n_heads)
        self.layer_norm_attention = LayerNorm(d_embed)
        self.layer_norm_feed_forward = LayerNorm(d_embed)
        self.dropout = dropout
        self.feed_forward = FeedForward(d_embed, d_ff, dropout=self.dropout)

    def forward(self, x, attention_mask=None):
        """(b, l, d_embed) -> (b, l, d_embed)."""
        z = self.attention(x, attention_mask)
        z = F.dropout(z, p=self.dropout, training=self.training) + x
        z = self.layer_norm_attention(z)
        y = self.feed_forward(z) + z
        return self.layer_norm_feed_forward(y)


class GPTTransformer(Module):
    """The notebook's GPT: embeddings, LayerNorm, n_layers layers, LayerNorm, lm_head.

    Each layer's output gets its input added once more (``z = layer(z) + z``), as in the
    notebook.
    """

    def __init__(self, n_layers, d_embed, d_ff, n_heads, voc_size, max_length, dropout=0.1):
        super().__init__()
        self.n_layers = n_layers
        self.d_embed = d_embed
        self.d_ff = d_ff
        self.num_heads = n_heads
        self.max_length = max_length
        self.voc_size = voc_size
        self.dropout = dropout
        # the notebook built a single layer here whatever n_layers was
        self.transformer_stack = nn.ModuleList([
            GPTMHTransformerLayer(d_embed=d_embed, d_ff=d_ff, n_heads=n_heads, dropout=self.dropout)
            for _ in range(n_layers)
        ])
        self.token_embeddings = nn.Embedding(num_embeddings=self.voc_size, embedding_dim=self.d_embed)
        self.position_embeddings = nn.Embedding(num_embeddings=self.max_length, embedding_dim=self.d_embed)
        self.out_layer_norm = LayerNorm(self.d_embed)
        self.embedding_norm = LayerNorm(self.d_embed)
        self.lm_head = nn.Linear(self.d_embed, self.voc_size)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.voc_size, self.max_length, generates=True)

    def forward(self, input_ids, attention_mask=None):
        """Args:
            input_ids: (b, l) token ids, l <= max_length.
            attention_mask: optional (b, l), 1 = token, 0 = pad.

        Returns:
            (b, l, voc_size) logits.
        """
        check_token_ids(input_ids, self.voc_size)
        check_length(input_ids.shape[1], self.max_length)
        check_attention_mask(attention_mask, *input_ids.shape)
        token_vectors = self.token_embeddings(input_ids)
        position_vectors = self.position_embeddings(torch.arange(input_ids.shape[-1], device=input_ids.device))[None]
        z = self.embedding_norm(token_vectors + position_vectors)  # (b, l, d)
        for layer in self.transformer_stack:
            z = layer(z, attention_mask) + z
        return self.lm_head(self.out_layer_norm(z))  # (b, l, voc_size)


# ------------------------------------------------------------------------ GPT-2
# The gpt family with GPT-2's options: pre-LN, tanh GELU, a final LayerNorm, tied
# input/output embeddings and Conv1D weights, which are the notebook's ``Linear``
# layout (x @ matrix, matrix (d_in, d_out)). Module names are HuggingFace's, so the
# key map to a transformers checkpoint only renames Conv1D ``weight`` to ``matrix``.


_GPT2_ACTIVATIONS = {"gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                     "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                     "gelu": F.gelu, "relu": F.relu}


class _GPTConfigModule(Module):
    _init_converters = {"config": GPTConfig.from_any}


class GPT2Attention(_GPTConfigModule):
    """Causal multi-head attention with fused q/k/v (``c_attn``) and ``c_proj``."""

    def __init__(self, config):
        super().__init__()
        config = GPTConfig.from_any(config)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x, attention_mask=None):
        """x (b, t, n_embd); attention_mask (b, t), 1 = token. Returns (b, t, n_embd)."""
        b, t, e = x.shape
        q, k, v = self.c_attn(x).split(e, dim=2)  # (b, t, e) each
        q, k, v = (y.view(b, t, self.n_head, e // self.n_head).transpose(1, 2) for y in (q, k, v))  # (b, h, t, d)
        keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]
        if attention_mask is not None:
            keep = keep & attention_mask.bool()[:, None, None, :]
        out, _ = attend(q, k, v, keep, scale=1 / math.sqrt(q.shape[-1]), dropout=self.attn_dropout)
        return self.resid_dropout(self.c_proj(out.transpose(1, 2).reshape(b, t, e)))


class GPT2MLP(_GPTConfigModule):
    def __init__(self, config):
        super().__init__()
        config = GPTConfig.from_any(config)
        self.c_fc = Linear(config.n_embd, config.inner)
        self.c_proj = Linear(config.inner, config.n_embd)
        self.act = _GPT2_ACTIVATIONS[config.activation_function]
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(_GPTConfigModule):
    """Pre-LN: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config):
        super().__init__()
        config = GPTConfig.from_any(config)
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, x, attention_mask=None):
        x = x + self.attn(self.ln_1(x), attention_mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(_GPTConfigModule):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm ``ln_f``."""

    def __init__(self, config):
        super().__init__()
        config = GPTConfig.from_any(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        for table in (self.wte, self.wpe):
            nn.init.normal_(table.weight, std=0.02)  # GPT-2's initializer_range
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([GPT2Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, attention_mask=None):
        """(b, t) ids -> last hidden state (b, t, n_embd)."""
        check_token_ids(input_ids, self.wte.num_embeddings)
        check_length(input_ids.shape[1], self.wpe.num_embeddings)
        check_attention_mask(attention_mask, *input_ids.shape)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions)[None])
        for block in self.h:
            x = block(x, attention_mask)
        return self.ln_f(x)


class GPT2LMHeadModel(_GPTConfigModule):
    """GPT-2 with its language-model head; called as ``model(input_ids, attention_mask=None)``.

    Returns logits (b, t, vocab_size). The head is the token embedding transposed
    (``tie_word_embeddings``, GPT-2's default) or its own ``lm_head`` otherwise.
    """

    def __init__(self, config):
        super().__init__()
        config = GPTConfig.from_any(config)
        self.config = config
        self.transformer = GPT2Model(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    @property
    def voc_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_length(self) -> int:
        return self.config.n_positions

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.voc_size, self.max_length, generates=True)

    def forward(self, input_ids, attention_mask=None):
        hidden = self.transformer(input_ids, attention_mask)
        if self.config.tie_word_embeddings:
            return hidden @ self.transformer.wte.weight.T
        return self.lm_head(hidden)
