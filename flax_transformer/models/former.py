"""Peter Bloem's "former" (notebooks 000 and 004), in Flax NNX.

The twin of ``torch_reference.former``: same class names, constructor arguments
(plus keyword-only ``rngs``, ``dtype``, ``param_dtype``), call signatures and
parameter paths. See that module for the options the notebooks do not have
(``causal``, ``scale``, ``attention``, the padding ``mask``).

``dtype`` is the compute type and ``param_dtype`` the storage type; softmax and
LayerNorm statistics run in float32 whatever ``dtype`` is. ``model.eval()`` /
``model.train()`` switch dropout as in torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from flax_transformer.models.arg_checks import attention_variants, check_divisible, check_length
from flax_transformer.models.attention import (
    attend,
    cache_mask,
    combine_masks,
    empty_cache,
    make_causal_mask,
    normalize_mask,
    update_cache,
)
from flax_transformer.models.constructor_records import RecordsInit
from flax_transformer.models.input_checks import check_features, check_token_ids
from flax_transformer.models.input_specs import InputSpec
from flax_transformer.models.layers import Embed, LayerNorm, Linear, ReLU, Sequential, lookup, masked_mean

_SCALES = ("emb", "head")
_VARIANTS = ("narrow", "wide")


def _self_attention(module, x, mask, head_width: int, scale_width: int, cache=None, index=0):
    """Shared forward of the narrow and the wide attention (they differ in widths only).

    With ``cache`` (keys, values of shape (b, h, max_len, s)), x holds the positions
    [index, index + t); returns (output, updated cache).
    """
    b, t, _ = x.shape
    h = module.heads
    x = x.astype(module.dtype)
    # (b, t, h*s) -> (b, h, t, s)
    queries = module.toqueries(x).reshape(b, t, h, head_width).transpose(0, 2, 1, 3)
    keys = module.tokeys(x).reshape(b, t, h, head_width).transpose(0, 2, 1, 3)
    values = module.tovalues(x).reshape(b, t, h, head_width).transpose(0, 2, 1, 3)
    # Scale q and k by the fourth root each, as the notebooks do (not the scores).
    queries = queries / (scale_width ** (1 / 4))
    keys = keys / (scale_width ** (1 / 4))
    if cache is not None:
        keys, values = cache = update_cache(cache, keys, values, index)
        mask = cache_mask(t, keys.shape[2], index)  # causal over what has been written
    else:
        mask = combine_masks(normalize_mask(mask, b, t, t, heads=h), make_causal_mask(t) if module.causal else None)
    out, _ = attend(queries, keys, values, mask, implementation=module.attention_impl, need_weights=False)  # (b, h, t, s)
    out = module.unifyheads(out.transpose(0, 2, 1, 3).reshape(b, t, h * head_width))  # (b, t, e)
    return out if cache is None else (out, cache)


class MHSelfAttention(RecordsInit, nnx.Module):
    """Narrow multi-head self-attention (notebook 000): the heads split the embedding.

    Args:
        emb: embedding width; must be divisible by ``heads``.
        heads: number of heads; each sees ``emb // heads`` features.
        causal: mask future positions.
        scale: ``"emb"`` divides q and k by ``emb**(1/4)`` (notebook), ``"head"`` by
            ``(emb//heads)**(1/4)``.
    """

    def __init__(self, emb, heads=8, *, causal: bool = False, scale: str = "emb", rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        check_divisible(emb, heads)
        if scale not in _SCALES:
            raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
        self.emb, self.heads, self.causal, self.scale, self.dtype = emb, heads, causal, scale, dtype
        self.attention_impl = "reference"  # see set_attention
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.tokeys = Linear(emb, emb, **kw)
        self.toqueries = Linear(emb, emb, **kw)
        self.tovalues = Linear(emb, emb, **kw)
        self.unifyheads = Linear(emb, emb, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x, mask=None, *, cache=None, index=0):
        """Args: x (b, t, emb); mask (b, t) padding or (b, t, t) / (b, 1, t, t), True = attend;
        cache, index: decode with a key/value cache (see ``GTransformer.decode_step``).

        Returns: (b, t, emb) (and the updated cache when one is given).
        """
        check_features(x, self.emb)
        s = self.emb // self.heads
        return _self_attention(self, x, mask, s, self.emb if self.scale == "emb" else s, cache, index)


class SelfAttention(RecordsInit, nnx.Module):
    """Wide multi-head self-attention (notebook 004): every head projects to width ``k``.

    Args:
        k: embedding width.
        heads: number of heads, each of width ``k`` (projections are k -> k*heads).
        causal: mask future positions.
        scale: accepted for symmetry; the head width is ``k``, so both settings divide
            q and k by ``k**(1/4)``.
    """

    def __init__(self, k, heads=8, *, causal: bool = False, scale: str = "emb", rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        self.attention_impl = "reference"  # see set_attention
        if heads < 1:
            raise ValueError(f"number of heads must be >= 1, got {heads}")
        if scale not in _SCALES:
            raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
        self.k, self.heads, self.causal, self.scale, self.dtype = k, heads, causal, scale, dtype
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.tokeys = Linear(k, k * heads, **kw)
        self.toqueries = Linear(k, k * heads, **kw)
        self.tovalues = Linear(k, k * heads, **kw)
        self.unifyheads = Linear(heads * k, k, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x, mask=None, *, cache=None, index=0):
        """Args: x (b, t, k); mask, cache, index as for ``MHSelfAttention``. Returns: (b, t, k)."""
        check_features(x, self.k)
        return _self_attention(self, x, mask, self.k, self.k, cache, index)


class TransformerBlock(RecordsInit, nnx.Module):
    """Post-LN block: x = norm1(att(x) + x); x = norm2(ff(x) + x), dropout after each.

    The signature is notebook 000's. ``seq_length`` and ``pos_embedding`` are accepted
    and unused, as in the notebook; ``mask=True`` makes the attention causal.
    """

    def __init__(self, emb, heads, mask, seq_length, ff_hidden_mult=4, dropout=0.0, pos_embedding=None,
                 *, attention: str = "narrow", scale: str = "emb", rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        if attention not in _VARIANTS:
            raise ValueError(f"attention must be one of {_VARIANTS}, got {attention!r}")
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.dtype = dtype
        attention_cls = MHSelfAttention if attention == "narrow" else SelfAttention
        self.mhattention = attention_cls(emb, heads, causal=bool(mask), scale=scale, **kw)
        self.norm1 = LayerNorm(emb, **kw)
        self.norm2 = LayerNorm(emb, **kw)
        self.ff = Sequential([
            Linear(emb, ff_hidden_mult * emb, **kw),
            ReLU(),
            Linear(ff_hidden_mult * emb, emb, **kw),
        ])
        self.do = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x, mask=None, *, cache=None, index=0):
        """Args: x (b, t, emb); mask (b, t) padding mask, True = token; cache, index: decoding.

        Returns (b, t, emb) (and the updated cache when one is given).
        """
        x = x.astype(self.dtype)  # the residual stream runs in the compute dtype
        attended = self.mhattention(x, mask) if cache is None else self.mhattention(x, cache=cache, index=index)
        if cache is not None:
            attended, cache = attended
        x = self.do(self.norm1(attended + x))
        fedforward = self.ff(x)
        x = self.do(self.norm2(fedforward + x))
        return x if cache is None else (x, cache)


def _per_block(attention: str | Sequence[str], depth: int) -> list[str]:
    return attention_variants(attention, depth, _VARIANTS)


class _Former(nnx.Module):
    """Token + learned position embeddings and a stack of blocks (both models share it)."""

    def _build(self, emb, heads, depth, seq_length, num_tokens, causal, dropout, attention, scale, kw):
        self.num_tokens, self.seq_length, self.dtype = num_tokens, seq_length, kw["dtype"]
        self.token_embedding = Embed(num_tokens, emb, **kw)
        self.pos_embedding = Embed(seq_length, emb, **kw)
        self.tblocks = nnx.List([
            TransformerBlock(emb=emb, heads=heads, seq_length=seq_length, mask=causal, dropout=dropout,
                             attention=variant, scale=scale, **kw)
            for variant in _per_block(attention, depth)
        ])
        self.do = nnx.Dropout(dropout, rngs=kw["rngs"])

    def _embed_and_run(self, x, mask):
        check_token_ids(x, self.num_tokens, name="x")
        b, t = x.shape
        check_length(t, self.seq_length)
        pad = None
        if mask is not None:
            if not hasattr(mask, "shape") or tuple(mask.shape) != (b, t):
                got = tuple(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
                raise ValueError(f"mask must be a padding mask of shape (batch, length)=({b}, {t}), got {got}")
            pad = normalize_mask(mask, b, t, t)  # (b, 1, 1, t)
        tokens = lookup(self.token_embedding, x, self.dtype)  # (b, t, e)
        positions = lookup(self.pos_embedding, jnp.arange(t), self.dtype)[None]  # (1, t, e)
        x = self.do(tokens + positions)
        for block in self.tblocks:
            x = block(x, pad)
        return x, pad


def _max_over_time(x):
    """(b, t, e) -> (b, e) max over t, with torch's gradient: all of it to the arg-max position.

    Not ``x.max(axis=1)``: JAX differentiates a max by comparing the input with the result
    for equality, and under jit XLA may compute the two in different fusions with different
    rounding, so no position compares equal and the gradient comes out wrong or NaN
    (seen on CTransformer: relative error 0.25, NaN in places). A gather at the arg-max is exact.
    """
    where = jnp.argmax(x, axis=1)[:, None, :]  # (b, 1, e)
    return jnp.take_along_axis(x, where, axis=1)[:, 0, :]


class CTransformer(RecordsInit, _Former):
    """Sequence classifier (notebook 000): embeddings, blocks, pooling over time, linear.

    ``max_pool`` chooses global max pooling (True) or mean pooling (False); with a
    padding mask both pool over real tokens only (a row with no token pools to zeros).
    """

    def __init__(self, emb, heads, depth, seq_length, num_tokens, num_classes, max_pool=True, dropout=0.0,
                 *, attention: str | Sequence[str] = "narrow", scale: str = "emb", rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self._build(emb, heads, depth, seq_length, num_tokens, False, dropout, attention, scale, kw)
        self.max_pool = bool(max_pool)
        self.toprobs = Linear(emb, num_classes, **kw)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.num_tokens, self.seq_length)

    def __call__(self, x, mask=None):
        """Args:
            x: (b, t) integer token ids, t <= seq_length.
            mask: optional (b, t) padding mask, 1/True = token, 0/False = pad.

        Returns:
            (b, num_classes) log-probabilities (float32).
        """
        x, pad = self._embed_and_run(x, mask)  # (b, t, e)
        if not self.max_pool:
            x = masked_mean(x, None if pad is None else pad[:, 0, 0, :])  # over real tokens
        elif pad is None:
            x = _max_over_time(x)
        else:
            tok = pad[:, 0, 0, :, None]  # (b, t, 1)
            pooled = _max_over_time(jnp.where(tok, x, jnp.finfo(x.dtype).min))
            x = jnp.where(tok.any(axis=1), pooled, 0.0).astype(x.dtype)
        return jax.nn.log_softmax(self.toprobs(x).astype(jnp.float32), axis=1)


class GTransformer(RecordsInit, _Former):
    """Causal language model (notebook 004, section 1.5, after Bloem's ``former``)."""

    def __init__(self, emb, heads, depth, seq_length, num_tokens, *, attention: str | Sequence[str] = "narrow",
                 scale: str = "emb", dropout: float = 0.0, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self._build(emb, heads, depth, seq_length, num_tokens, True, dropout, attention, scale, kw)
        self.toprobs = Linear(emb, num_tokens, **kw)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.num_tokens, self.seq_length, generates=True)

    def __call__(self, x, mask=None):
        """Args: x (b, t) token ids; mask optional (b, t) padding mask, True = token.

        Returns: (b, t, num_tokens) log-probabilities (float32) of the next token.
        """
        x, _ = self._embed_and_run(x, mask)
        return jax.nn.log_softmax(self.toprobs(x).astype(jnp.float32), axis=2)

    def init_cache(self, batch: int, length: int):
        """An empty key/value cache for decoding up to ``length`` positions."""
        check_length(length, self.seq_length)
        widths = [(b.mhattention.heads, b.mhattention.emb // b.mhattention.heads)
                  if isinstance(b.mhattention, MHSelfAttention) else (b.mhattention.heads, b.mhattention.k)
                  for b in self.tblocks]
        return [empty_cache(1, batch, h, length, d, self.dtype)[0] for h, d in widths]

    def decode_step(self, tokens, index, cache):
        """Run the positions [index, index + n) with a cache of the earlier ones.

        Args: tokens (b, n) ids; index: first position (an int or a traced scalar); cache
        from ``init_cache`` or the previous step. Returns ((b, n, num_tokens) log-probs, cache).
        """
        n = tokens.shape[1]
        x = lookup(self.token_embedding, tokens, self.dtype)
        x = x + lookup(self.pos_embedding, index + jnp.arange(n), self.dtype)[None]
        x = self.do(x)
        new_cache = []
        for block, layer_cache in zip(self.tblocks, cache):
            x, layer_cache = block(x, cache=layer_cache, index=index)
            new_cache.append(layer_cache)
        return jax.nn.log_softmax(self.toprobs(x).astype(jnp.float32), axis=2), new_cache
