"""The GPT from scratch of notebook 002, in Flax NNX.

The twin of ``torch_reference.gpt``: same class names, constructor arguments (plus
keyword-only ``rngs``, ``dtype``, ``param_dtype``), call signatures and parameter
paths, the notebook's ``Linear`` (``matrix`` (d_in, d_out) + ``bias``) and
``LayerNorm`` (``gamma``/``beta``, unbiased std, eps added to the std), and the
notebook's additive -1e20 masks. ``attention_mask`` is (b, l) with 1 = token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from flax_transformer.models.arg_checks import check_divisible, check_length
from flax_transformer.models.attention import attend, cache_mask, empty_cache, fused_attention, update_cache
from flax_transformer.models.configs import GPTConfig
from flax_transformer.models.constructor_records import RecordsInit
from flax_transformer.models.input_checks import check_features, check_token_ids, is_concrete
from flax_transformer.models.input_specs import InputSpec
from flax_transformer.models.layers import ACTIVATIONS, Embed, gather_rows, lookup
from flax_transformer.models.layers import LayerNorm as TorchLayerNorm
from flax_transformer.models.layers import Linear as TorchLinear

INF = 1e20  # the notebook's additive mask constant


def ReLU(x):
    """The notebook's ReLU."""
    return x * (x > 0).astype(x.dtype)


def check_attention_mask(attention_mask, batch: int, length: int) -> None:
    """(b, l) of 0/1 (bool, int or float); values checked when concrete."""
    if attention_mask is None:
        return
    if not hasattr(attention_mask, "shape") or not hasattr(attention_mask, "dtype"):
        raise TypeError(f"attention_mask must be an array, got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"attention_mask must have shape (batch, length)=({batch}, {length}), "
                         f"got {tuple(attention_mask.shape)}")
    if attention_mask.dtype != jnp.bool_ and is_concrete(attention_mask):
        values = jax.device_get(attention_mask)
        if not ((values == 0) | (values == 1)).all():
            raise ValueError("attention_mask must hold only 0 (pad) and 1 (token)")


def additive_mask(shape, attention_mask, causal: bool, dtype=jnp.float32):
    """The notebook's mask for scores of ``shape`` (b, [h,] q, k): -INF on future and padded keys."""
    q, k = shape[-2], shape[-1]
    mask = jnp.zeros(shape, dtype)
    if causal:
        mask = mask + jnp.triu(jnp.ones((q, k), dtype), k=1)
    if attention_mask is not None:
        pad = 1.0 - attention_mask.astype(dtype)  # (b, l): 1 on padding
        pad = pad[:, None, :] if len(shape) == 3 else pad[:, None, None, :]
        mask = mask + pad
    return mask * (-INF)


class Embeddings(RecordsInit, nnx.Module):
    """A lookup table ``embeddings`` (vocab_size, d), initialised N(0, 0.02^2)."""

    def __init__(self, vocab_size, d, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.vocab_size, self.dtype = vocab_size, dtype
        self.embeddings = nnx.Param(0.02 * jax.random.normal(rngs.params(), (vocab_size, d), param_dtype))

    def __call__(self, x):
        """(b, l) ids -> (b, l, d)."""
        check_token_ids(x, self.vocab_size, name="x")
        return gather_rows(self.embeddings[...], x).astype(self.dtype)


class Linear(RecordsInit, nnx.Module):
    """x @ matrix + bias, with ``matrix`` (d_in, d_out), initialised N(0, 0.02^2)."""

    def __init__(self, d_in, d_out, bias=True, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.dtype = dtype
        self.matrix = nnx.Param(0.02 * jax.random.normal(rngs.params(), (d_in, d_out), param_dtype))
        self.bias = nnx.Param(0.02 * jax.random.normal(rngs.params(), (d_out,), param_dtype)) if bias else None

    def __call__(self, x):
        """(..., d_in) -> (..., d_out)."""
        results = x.astype(self.dtype) @ self.matrix[...].astype(self.dtype)
        if self.bias is not None:
            results = results + self.bias[...].astype(self.dtype)
        return results


class LayerNorm(RecordsInit, nnx.Module):
    """gamma * (x - mean) / (std + eps) + beta with the unbiased std; statistics in fp32."""

    def __init__(self, d, eps=1e-6, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32, param_dtype=jnp.float32):
        self.eps, self.dtype = eps, dtype
        self.gamma = nnx.Param(jnp.ones((d,), param_dtype))
        self.beta = nnx.Param(jnp.zeros((d,), param_dtype))

    def __call__(self, x):
        """(..., d) -> (..., d)."""
        x32 = x.astype(jnp.float32)
        mean = x32.mean(axis=-1, keepdims=True)
        std = jnp.std(x32, axis=-1, keepdims=True, ddof=1)
        y = self.gamma[...].astype(jnp.float32) * (x32 - mean) / (std + self.eps) + self.beta[...].astype(jnp.float32)
        return y.astype(self.dtype)


class FeedForward(RecordsInit, nnx.Module):
    """w1 -> ReLU -> dropout -> w2; dropout only in training mode."""

    def __init__(self, d_embed, d_ff, dropout=0.1, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.w1 = Linear(d_embed, d_ff, **kw)
        self.w2 = Linear(d_ff, d_embed, **kw)
        self.act_fn = ReLU
        self.dropout = dropout
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        """(b, l, d_embed) -> (b, l, d_embed)."""
        return self.w2(self.drop(self.act_fn(self.w1(x))))


def _softmax_attention(q, k, v, scores_mask, implementation: str = "reference"):
    """softmax(q k^T / sqrt(d) + additive mask) v; softmax in fp32."""
    d = k.shape[-1]
    if implementation != "reference":  # the additive mask is the fused kernel's bias: the same numbers
        return fused_attention(q, k, v, bias=scores_mask, scale=d ** (-0.5), implementation=implementation)
    s_ij = (q @ jnp.swapaxes(k, -1, -2) * d ** (-0.5)).astype(jnp.float32)
    if scores_mask is not None:
        s_ij = s_ij + scores_mask
    return jax.nn.softmax(s_ij, axis=-1).astype(q.dtype) @ v


class Attention(RecordsInit, nnx.Module):
    """Single-head attention with biased projections, no causal mask; padded keys masked."""

    def __init__(self, d, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.d = d
        self.attention_impl = "reference"  # see set_attention
        self.q_proj = Linear(d, d, **kw)
        self.k_proj = Linear(d, d, **kw)
        self.v_proj = Linear(d, d, **kw)

    def __call__(self, x, attention_mask=None):
        """(b, l, d) -> (b, l, d)."""
        check_features(x, self.d)
        check_attention_mask(attention_mask, x.shape[0], x.shape[1])
        mask = None if attention_mask is None else additive_mask((x.shape[0], x.shape[1], x.shape[1]),
                                                                 attention_mask, False)
        return _softmax_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), mask, self.attention_impl)


class TransformerLayer(RecordsInit, nnx.Module):
    """z = ln_att(att(ln_in(x)) + ln_in(x)); return ff(z) + z."""

    def __init__(self, d_embed, d_ff, dropout=0.1, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.attention = Attention(d_embed, **kw)
        self.feed_forward = FeedForward(d_embed, d_ff, dropout, **kw)
        self.input_layer_norm = LayerNorm(d_embed, **kw)
        self.attention_layer_norm = LayerNorm(d_embed, **kw)

    def __call__(self, x, attention_mask=None):
        normed_input = self.input_layer_norm(x)  # returns the compute dtype
        z = self.attention_layer_norm(self.attention(normed_input, attention_mask) + normed_input)
        return self.feed_forward(z) + z


class GPTAttention(RecordsInit, nnx.Module):
    """Single-head causal attention, projections without bias."""

    def __init__(self, d_embed, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.d_embed = d_embed
        self.attention_impl = "reference"  # see set_attention
        self.q = Linear(d_embed, d_embed, bias=False, **kw)
        self.k = Linear(d_embed, d_embed, bias=False, **kw)
        self.v = Linear(d_embed, d_embed, bias=False, **kw)

    def __call__(self, x, attention_mask=None):
        """(b, l, d) -> (b, l, d)."""
        check_features(x, self.d_embed)
        check_attention_mask(attention_mask, x.shape[0], x.shape[1])
        mask = additive_mask((x.shape[0], x.shape[1], x.shape[1]), attention_mask, True)
        return _softmax_attention(self.q(x), self.k(x), self.v(x), mask, self.attention_impl)


class GPTTransformerLayer(RecordsInit, nnx.Module):
    """x = ln_in(x); z = ln_att(dropout(att(x)) + x); return dropout(ff(z)) + z."""

    def __init__(self, d_embed, d_ff, dropout=0.1, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.dropout = dropout
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.attention = GPTAttention(d_embed, **kw)
        self.feed_forward = FeedForward(d_embed, d_ff, dropout=dropout, **kw)
        self.layer_norm_attention = TorchLayerNorm(d_embed, **kw)
        self.layer_norm_input = TorchLayerNorm(d_embed, **kw)

    def __call__(self, x, attention_mask=None):
        x = self.layer_norm_input(x)
        z = self.drop(self.attention(x, attention_mask=attention_mask)) + x
        z = self.layer_norm_attention(z)
        return self.drop(self.feed_forward(z)) + z


class GPTMHAttention(RecordsInit, nnx.Module):
    """Multi-head causal attention with the padding mask (the notebook's final attention).

    ``attention_mask`` (b, l), 1 = token, becomes the notebook's additive mask here.
    """

    def __init__(self, d_embed, n_heads, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        check_divisible(d_embed, n_heads)
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.d_embed, self.n_heads, self.dtype = d_embed, n_heads, dtype
        self.attention_impl = "reference"  # see set_attention
        self.q_proj = TorchLinear(d_embed, d_embed, **kw)
        self.k_proj = TorchLinear(d_embed, d_embed, **kw)
        self.v_proj = TorchLinear(d_embed, d_embed, **kw)

    def _heads(self, x):
        """(b, l, d) -> q, k, v each (b, h, l, d_h)."""
        b, l, _ = x.shape
        d_h = self.d_embed // self.n_heads
        split = lambda y: y.reshape(b, l, self.n_heads, d_h).transpose(0, 2, 1, 3)  # noqa: E731
        x = x.astype(self.dtype)
        return split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))

    def __call__(self, x, attention_mask=None, *, cache=None, index=0):
        """(b, l, d_embed) -> (b, l, d_embed).

        With ``cache`` (keys, values (b, h, max_len, d_h)), x holds positions
        [index, index + l); unwritten positions get the notebook's -1e20 like future
        ones. Returns (output, updated cache) then.
        """
        check_features(x, self.d_embed)
        b, l, d = x.shape
        q, k, v = self._heads(x)
        if cache is None:
            check_attention_mask(attention_mask, b, l)
            mask = additive_mask((b, self.n_heads, l, l), attention_mask, True)
        else:
            k, v = cache = update_cache(cache, k, v, index)
            mask = jnp.where(cache_mask(l, k.shape[2], index), 0.0, -INF)
        y = _softmax_attention(q, k, v, mask, self.attention_impl)  # (b, h, l, d_h)
        y = y.transpose(0, 2, 1, 3).reshape(b, l, d)
        return y if cache is None else (y, cache)


class GPTMHTransformerLayer(RecordsInit, nnx.Module):
    """Post-LN: z = ln_att(dropout(att(x)) + x); return ln_ff(ff(z) + z)."""

    def __init__(self, d_embed, d_ff, n_heads, dropout=0.1, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.dtype = dtype
        self.attention = GPTMHAttention(d_embed, n_heads, **kw)
        self.layer_norm_attention = LayerNorm(d_embed, **kw)
        self.layer_norm_feed_forward = LayerNorm(d_embed, **kw)
        self.dropout = dropout
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.feed_forward = FeedForward(d_embed, d_ff, dropout=dropout, **kw)

    def __call__(self, x, attention_mask=None, *, cache=None, index=0):
        x = x.astype(self.dtype)  # the residual stream runs in the compute dtype
        if cache is None:
            attended = self.attention(x, attention_mask)
        else:
            attended, cache = self.attention(x, cache=cache, index=index)
        z = self.layer_norm_attention(self.drop(attended) + x)
        y = self.layer_norm_feed_forward(self.feed_forward(z) + z)
        return y if cache is None else (y, cache)


class GPTTransformer(RecordsInit, nnx.Module):
    """The notebook's GPT: embeddings, LayerNorm, n_layers layers, LayerNorm, lm_head."""

    def __init__(self, n_layers, d_embed, d_ff, n_heads, voc_size, max_length, dropout=0.1, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.n_layers, self.d_embed, self.d_ff, self.num_heads = n_layers, d_embed, d_ff, n_heads
        self.max_length, self.voc_size, self.dropout, self.dtype = max_length, voc_size, dropout, dtype
        self.transformer_stack = nnx.List([
            GPTMHTransformerLayer(d_embed=d_embed, d_ff=d_ff, n_heads=n_heads, dropout=dropout, **kw)
            for _ in range(n_layers)
        ])
        self.token_embeddings = Embed(voc_size, d_embed, **kw)
        self.position_embeddings = Embed(max_length, d_embed, **kw)
        self.out_layer_norm = LayerNorm(d_embed, **kw)
        self.embedding_norm = LayerNorm(d_embed, **kw)
        self.lm_head = TorchLinear(d_embed, voc_size, **kw)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.voc_size, self.max_length, generates=True)

    def __call__(self, input_ids, attention_mask=None):
        """Args:
            input_ids: (b, l) token ids, l <= max_length.
            attention_mask: optional (b, l), 1 = token, 0 = pad.

        Returns:
            (b, l, voc_size) logits (float32).
        """
        check_token_ids(input_ids, self.voc_size)
        check_length(input_ids.shape[1], self.max_length)
        check_attention_mask(attention_mask, *input_ids.shape)
        positions = lookup(self.position_embeddings, jnp.arange(input_ids.shape[1]), self.dtype)[None]
        z = self.embedding_norm(lookup(self.token_embeddings, input_ids, self.dtype) + positions)  # (b, l, d)
        for layer in self.transformer_stack:
            z = layer(z, attention_mask) + z
        return self.lm_head(self.out_layer_norm(z)).astype(jnp.float32)

    def init_cache(self, batch: int, length: int):
        """An empty key/value cache for decoding up to ``length`` positions."""
        check_length(length, self.max_length)
        return empty_cache(self.n_layers, batch, self.num_heads, length, self.d_embed // self.num_heads, self.dtype)

    def decode_step(self, tokens, index, cache):
        """Run positions [index, index + n) given a cache of the earlier ones.

        Args: tokens (b, n) ids; index: first position (int or traced scalar); cache from
        ``init_cache`` or the previous step. Returns ((b, n, voc_size) logits, cache).
        """
        n = tokens.shape[1]
        positions = lookup(self.position_embeddings, index + jnp.arange(n), self.dtype)[None]
        z = self.embedding_norm(lookup(self.token_embeddings, tokens, self.dtype) + positions)
        new_cache = []
        for layer, layer_cache in zip(self.transformer_stack, cache):
            out, layer_cache = layer(z, cache=layer_cache, index=index)
            z = out + z
            new_cache.append(layer_cache)
        return self.lm_head(self.out_layer_norm(z)).astype(jnp.float32), new_cache


# ------------------------------------------------------------------------ GPT-2
# The twin of torch_reference.gpt's GPT-2 classes: HuggingFace's module names, the
# notebook's ``Linear`` for Conv1D (matrix (d_in, d_out)), tied output embeddings.

class _GPTConfigModule(RecordsInit, nnx.Module):
    _init_converters = {"config": GPTConfig.from_any}


class GPT2Attention(_GPTConfigModule):
    """Causal multi-head attention with fused q/k/v (``c_attn``) and ``c_proj``."""

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = GPTConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.n_head, self.n_embd, self.dtype = config.n_head, config.n_embd, dtype
        self.attention_impl = "reference"  # see set_attention
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, **kw)
        self.c_proj = Linear(config.n_embd, config.n_embd, **kw)
        self.attn_dropout = nnx.Dropout(config.attn_pdrop, rngs=rngs)
        self.resid_dropout = nnx.Dropout(config.resid_pdrop, rngs=rngs)

    def __call__(self, x, attention_mask=None, *, cache=None, index=0):
        """x (b, t, n_embd); attention_mask (b, t), 1 = token. Returns (b, t, n_embd)."""
        b, t, e = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=2)  # (b, t, e) each
        # (b, h, t, d) in this attention's own dtype, whatever c_attn's (``advisor.apply`` mixes them)
        q, k, v = (y.reshape(b, t, self.n_head, e // self.n_head).transpose(0, 2, 1, 3).astype(self.dtype)
                   for y in (q, k, v))
        if cache is None:
            keep = jnp.tril(jnp.ones((t, t), bool))[None, None]
            if attention_mask is not None:
                keep = keep & attention_mask.astype(bool)[:, None, None, :]
        else:
            k, v = cache = update_cache(cache, k, v, index)
            keep = cache_mask(t, k.shape[2], index)
        out, _ = attend(q, k, v, keep, scale=1 / math.sqrt(q.shape[-1]), dropout=self.attn_dropout,
                        implementation=self.attention_impl, need_weights=False)
        out = self.resid_dropout(self.c_proj(out.transpose(0, 2, 1, 3).reshape(b, t, e)))
        return out if cache is None else (out, cache)


class GPT2MLP(_GPTConfigModule):
    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = GPTConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.c_fc = Linear(config.n_embd, config.inner, **kw)
        self.c_proj = Linear(config.inner, config.n_embd, **kw)
        self.activation = config.activation_function
        self.dropout = nnx.Dropout(config.resid_pdrop, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.c_proj(ACTIVATIONS[self.activation](self.c_fc(x))))


class GPT2Block(_GPTConfigModule):
    """Pre-LN: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = GPTConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.dtype = dtype
        self.ln_1 = TorchLayerNorm(config.n_embd, eps=config.layer_norm_epsilon, **kw)
        self.attn = GPT2Attention(config, **kw)
        self.ln_2 = TorchLayerNorm(config.n_embd, eps=config.layer_norm_epsilon, **kw)
        self.mlp = GPT2MLP(config, **kw)

    def __call__(self, x, attention_mask=None, *, cache=None, index=0):
        x = x.astype(self.dtype)
        attended = self.attn(self.ln_1(x), attention_mask, cache=cache, index=index)
        if cache is not None:
            attended, cache = attended
        x = x + attended.astype(self.dtype)  # the residual stream in this block's dtype, whatever its parts'
        x = x + self.mlp(self.ln_2(x)).astype(self.dtype)
        return x if cache is None else (x, cache)


class GPT2Model(_GPTConfigModule):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm ``ln_f``."""

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = GPTConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.vocab_size, self.n_positions, self.dtype = config.vocab_size, config.n_positions, dtype
        self.wte = Embed(config.vocab_size, config.n_embd, std=0.02, **kw)  # GPT-2's initializer_range
        self.wpe = Embed(config.n_positions, config.n_embd, std=0.02, **kw)
        self.drop = nnx.Dropout(config.embd_pdrop, rngs=rngs)
        self.h = nnx.List([GPT2Block(config, **kw) for _ in range(config.n_layer)])
        self.ln_f = TorchLayerNorm(config.n_embd, eps=config.layer_norm_epsilon, **kw)

    def __call__(self, input_ids, attention_mask=None, *, cache=None, index=0):
        """(b, t) ids -> last hidden state (b, t, n_embd) (and the cache when decoding)."""
        check_token_ids(input_ids, self.vocab_size)
        check_length(cache[0][0].shape[2] if cache else input_ids.shape[1], self.n_positions)
        if cache is None:
            check_attention_mask(attention_mask, *input_ids.shape)
        positions = index + jnp.arange(input_ids.shape[1])
        x = self.drop(lookup(self.wte, input_ids, self.dtype) + lookup(self.wpe, positions, self.dtype)[None])
        new_cache = []
        for i, block in enumerate(self.h):
            if cache is None:
                x = block(x, attention_mask)
            else:
                x, layer_cache = block(x, cache=cache[i], index=index)
                new_cache.append(layer_cache)
        x = self.ln_f(x)
        return x if cache is None else (x, new_cache)


class GPT2LMHeadModel(_GPTConfigModule):
    """GPT-2 with its language-model head; called as ``model(input_ids, attention_mask=None)``.

    Returns float32 logits (b, t, vocab_size). The head is the token embedding
    transposed (``tie_word_embeddings``) or its own ``lm_head``.
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = GPTConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.config, self.dtype = config, dtype
        self.transformer = GPT2Model(config, **kw)
        self.lm_head = None if config.tie_word_embeddings else TorchLinear(
            config.n_embd, config.vocab_size, use_bias=False, **kw)

    @property
    def voc_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_length(self) -> int:
        return self.config.n_positions

    def _head(self, hidden):
        if self.lm_head is None:
            return (hidden.astype(self.dtype) @ self.transformer.wte.embedding[...].astype(self.dtype).T
                    ).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.voc_size, self.max_length, generates=True)

    def __call__(self, input_ids, attention_mask=None):
        return self._head(self.transformer(input_ids, attention_mask))

    def init_cache(self, batch: int, length: int):
        """An empty key/value cache for decoding up to ``length`` positions."""
        check_length(length, self.config.n_positions)
        c = self.config
        return empty_cache(c.n_layer, batch, c.n_head, length, c.n_embd // c.n_head, self.dtype)

    def decode_step(self, tokens, index, cache):
        """Positions [index, index + n) given the cache -> ((b, n, vocab) logits, cache)."""
        hidden, cache = self.transformer(tokens, cache=cache, index=index)
        return self._head(hidden), cache
