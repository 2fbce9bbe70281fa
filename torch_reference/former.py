"""Peter Bloem's "former" (notebooks 000 and 004), in PyTorch.

Class names, constructor arguments and attribute names are the notebooks', so a
``state_dict()`` saved from notebook 000's ``CTransformer`` or notebook 004's
``SelfAttention`` loads here with ``strict=True`` and gives the same outputs in eval
mode. Everything the notebooks do not have is keyword-only, with defaults that
reproduce the notebooks:

* ``causal``: mask future positions (notebook 004, section 1.5). ``TransformerBlock``
  keeps notebook 000's ``mask`` argument, which the notebook accepted and ignored; here
  ``mask=True`` makes the block causal, as in Bloem's ``former`` library.
* ``scale``: notebook 000 divides q and k by ``emb ** (1/4)`` where ``emb`` is the full
  width, not the head width. That is kept as ``scale="emb"``; ``scale="head"`` uses the
  head width (the usual 1/sqrt(d_head) on the scores).
* ``attention``: ``"narrow"`` (``MHSelfAttention``: heads split the embedding) or
  ``"wide"`` (``SelfAttention``: each head projects to the full width), per model or as
  one entry per block.
* ``mask`` in ``forward``: an optional padding mask (batch, length), 1/True = token.
  Padded positions are excluded from attention and from pooling. The notebooks have
  none: they attend to and pool over ``<pad>``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flax_transformer.models.arg_checks import attention_variants, check_divisible, check_length
from flax_transformer.models.input_specs import InputSpec

from ._common import (
    Module,
    attend,
    check_features,
    check_token_ids,
    combine_masks,
    make_causal_mask,
    masked_mean,
    normalize_mask,
)

_SCALES = ("emb", "head")
_VARIANTS = ("narrow", "wide")


def _self_attention(module, x, mask, head_width: int, scale_width: int):
    """Shared forward of the narrow and the wide attention (they differ in widths only)."""
    b, t, _ = x.shape
    h = module.heads
    mask = combine_masks(
        normalize_mask(mask, b, t, t, heads=h),
        make_causal_mask(t, device=x.device) if module.causal else None,
    )
    # (b, t, h*s) -> (b, h, t, s)
    queries = module.toqueries(x).view(b, t, h, head_width).transpose(1, 2)
    keys = module.tokeys(x).view(b, t, h, head_width).transpose(1, 2)
    values = module.tovalues(x).view(b, t, h, head_width).transpose(1, 2)
    # Scale q and k by the fourth root each, as the notebooks do (not the scores).
    queries = queries / (scale_width ** (1 / 4))
    keys = keys / (scale_width ** (1 / 4))
    out, _ = attend(queries, keys, values, mask)  # (b, h, t, s)
    out = out.transpose(1, 2).reshape(b, t, h * head_width)  # (b, t, h*s)
    return module.unifyheads(out)


class MHSelfAttention(Module):
    """Narrow multi-head self-attention (notebook 000): the heads split the embedding.

    Args:
        emb: embedding width; must be divisible by ``heads``.
        heads: number of heads; each sees ``emb // heads`` features.
        causal: mask future positions.
        scale: ``"emb"`` divides q and k by ``emb**(1/4)`` (notebook), ``"head"`` by
            ``(emb//heads)**(1/4)``.
    """

    def __init__(self, emb, heads=8, *, causal: bool = False, scale: str = "emb"):
        super().__init__()
        check_divisible(emb, heads)
        if scale not in _SCALES:
            raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
        self.emb, self.heads, self.causal, self.scale = emb, heads, causal, scale
        self.tokeys = nn.Linear(emb, emb, bias=False)
        self.toqueries = nn.Linear(emb, emb, bias=False)
        self.tovalues = nn.Linear(emb, emb, bias=False)
        self.unifyheads = nn.Linear(emb, emb)

    def forward(self, x, mask=None):
        """Args: x (b, t, emb); mask (b, t) padding or (b, t, t) / (b, 1, t, t), True = attend.

        Returns: (b, t, emb).
        """
        check_features(x, self.emb)
        s = self.emb // self.heads
        return _self_attention(self, x, mask, s, self.emb if self.scale == "emb" else s)


class SelfAttention(Module):
    """Wide multi-head self-attention (notebook 004): every head projects to width ``k``.

    Args:
        k: embedding width.
        heads: number of heads, each of width ``k`` (so the projections are k -> k*heads).
        causal: mask future positions.
        scale: accepted for symmetry with ``MHSelfAttention``; the head width is ``k``
            here, so both settings divide q and k by ``k**(1/4)``.
    """

    def __init__(self, k, heads=8, *, causal: bool = False, scale: str = "emb"):
        super().__init__()
        if heads < 1:
            raise ValueError(f"number of heads must be >= 1, got {heads}")
        if scale not in _SCALES:
            raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
        self.k, self.heads, self.causal, self.scale = k, heads, causal, scale
        self.tokeys = nn.Linear(k, k * heads, bias=False)
        self.toqueries = nn.Linear(k, k * heads, bias=False)
        self.tovalues = nn.Linear(k, k * heads, bias=False)
        self.unifyheads = nn.Linear(heads * k, k)

    def forward(self, x, mask=None):
        """Args: x (b, t, k); mask as for ``MHSelfAttention``. Returns: (b, t, k)."""
        check_features(x, self.k)
        return _self_attention(self, x, mask, self.k, self.k)


class TransformerBlock(Module):
    """Post-LN block: x = norm1(att(x) + x); x = norm2(ff(x) + x), dropout after each.

    The signature is notebook 000's. ``seq_length`` and ``pos_embedding`` are accepted
    and unused, as in the notebook; ``mask=True`` makes the attention causal.
    """

    def __init__(self, emb, heads, mask, seq_length, ff_hidden_mult=4, dropout=0.0, pos_embedding=None,
                 *, attention: str = "narrow", scale: str = "emb"):
        super().__init__()
        if attention not in _VARIANTS:
            raise ValueError(f"attention must be one of {_VARIANTS}, got {attention!r}")
        attention_cls = MHSelfAttention if attention == "narrow" else SelfAttention
        self.mhattention = attention_cls(emb, heads, causal=bool(mask), scale=scale)
        self.norm1 = nn.LayerNorm(emb)
        self.norm2 = nn.LayerNorm(emb)
        self.ff = nn.Sequential(
            nn.Linear(emb, ff_hidden_mult * emb),
            nn.ReLU(),
            nn.Linear(ff_hidden_mult * emb, emb),
        )
        self.do = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        """Args: x (b, t, emb); mask (b, t) padding mask, True = token. Returns (b, t, emb)."""
        attended = self.mhattention(x, mask)
        x = self.do(self.norm1(attended + x))
        fedforward = self.ff(x)
        return self.do(self.norm2(fedforward + x))


def _per_block(attention: str | Sequence[str], depth: int) -> list[str]:
    return attention_variants(attention, depth, _VARIANTS)


class _Former(Module):
    """Token + learned position embeddings and a stack of blocks (both models share it)."""

    def _embed_and_run(self, x, mask):
        check_token_ids(x, self.num_tokens, name="x")
        b, t = x.shape
        check_length(t, self.pos_embedding.num_embeddings)
        pad = None
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (b, t):
                got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise ValueError(f"mask must be a padding mask of shape (batch, length)=({b}, {t}), got {got}")
            pad = normalize_mask(mask, b, t, t)  # (b, 1, 1, t)
        tokens = self.token_embedding(x)  # (b, t, e)
        positions = self.pos_embedding(torch.arange(t, device=x.device))[None, :, :]  # (1, t, e)
        x = self.do(tokens + positions)
        for block in self.tblocks:
            x = block(x, pad)
        return x, pad


class CTransformer(_Former):
    """Sequence classifier (notebook 000): embeddings, blocks, pooling over time, linear.

    ``max_pool`` chooses global max pooling (True) or mean pooling (False); with a
    padding mask both pool over real tokens only (a row with no token pools to zeros).
    """

    def __init__(self, emb, heads, depth, seq_length, num_tokens, num_classes, max_pool=True, dropout=0.0,
                 *, attention: str | Sequence[str] = "narrow", scale: str = "emb"):
        super().__init__()
        self.num_tokens, self.max_pool = num_tokens, max_pool
        self.token_embedding = nn.Embedding(embedding_dim=emb, num_embeddings=num_tokens)
        self.pos_embedding = nn.Embedding(embedding_dim=emb, num_embeddings=seq_length)
        self.tblocks = nn.Sequential(*[
            TransformerBlock(emb=emb, heads=heads, seq_length=seq_length, mask=False, dropout=dropout,
                             attention=variant, scale=scale)
            for variant in _per_block(attention, depth)
        ])
        self.toprobs = nn.Linear(emb, num_classes)
        self.do = nn.Dropout(dropout)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.num_tokens, self.pos_embedding.num_embeddings)

    def forward(self, x, mask=None):
        """Args:
            x: (b, t) integer token ids, t <= seq_length.
            mask: optional (b, t) padding mask, 1/True = token, 0/False = pad.

        Returns:
            (b, num_classes) log-probabilities.
        """
        x, pad = self._embed_and_run(x, mask)  # (b, t, e)
        if not self.max_pool:
            x = masked_mean(x, None if pad is None else pad[:, 0, 0, :])  # over real tokens
        elif pad is None:
            x = x.max(dim=1)[0]
        else:
            tok = pad[:, 0, 0, :, None]  # (b, t, 1)
            pooled = x.masked_fill(~tok, torch.finfo(x.dtype).min).max(dim=1)[0]
            x = torch.where(tok.any(dim=1), pooled, torch.zeros_like(pooled))
        return F.log_softmax(self.toprobs(x), dim=1)


class GTransformer(_Former):
    """Causal language model (notebook 004, section 1.5, after Bloem's ``former``).

    Same embeddings and blocks as ``CTransformer`` with a causal mask, and a
    per-token projection to the vocabulary.
    """

    def __init__(self, emb, heads, depth, seq_length, num_tokens, *, attention: str | Sequence[str] = "narrow",
                 scale: str = "emb", dropout: float = 0.0):
        super().__init__()
        self.num_tokens = num_tokens
        self.token_embedding = nn.Embedding(embedding_dim=emb, num_embeddings=num_tokens)
        self.pos_embedding = nn.Embedding(embedding_dim=emb, num_embeddings=seq_length)
        self.tblocks = nn.Sequential(*[
            TransformerBlock(emb=emb, heads=heads, seq_length=seq_length, mask=True, dropout=dropout,
                             attention=variant, scale=scale)
            for variant in _per_block(attention, depth)
        ])
        self.toprobs = nn.Linear(emb, num_tokens)
        self.do = nn.Dropout(dropout)

    def input_spec(self) -> InputSpec:
        """What the model reads (ids range, longest input), so tools need not know its class."""
        return InputSpec(self.num_tokens, self.pos_embedding.num_embeddings, generates=True)

    def forward(self, x, mask=None):
        """Args: x (b, t) token ids; mask optional (b, t) padding mask, True = token.

        Returns: (b, t, num_tokens) log-probabilities of the next token at each position.
        """
        x, _ = self._embed_and_run(x, mask)
        return F.log_softmax(self.toprobs(x), dim=2)
