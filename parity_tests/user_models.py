"""Models a user brings: torch modules outside the four families and their hand-written NNX twins.

Each pair has the same attribute names on both sides, so ``porting`` places every weight
by the Flax layer's type, with no table entry (``docs/porting.md``, "Your own model"):

* ``TorchConvTagger`` / ``FlaxConvTagger``: a small token tagger built from torch's and
  Flax's stock layers (Embedding, a grouped Conv1d, LayerNorm, RMSNorm, Linear), notebook
  002's ``Linear``/``LayerNorm`` (matrix, gamma/beta), a learned position table (a bare
  parameter) and a buffer (a constant on the Flax side).
* ``TorchPostCTransformer`` / ``FlaxPostCTransformer``: notebook 000's ``CTransformer``
  with one more layer, ``post``, a per-token ``Linear(emb, emb)`` between the blocks and
  the pooling (so before ``toprobs``): the user's modified model of the README's
  ``bisect.bisect`` example.

A plain module, not a test file: tests and docs import it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from flax import nnx
from torch import nn

import flax_transformer.models.former as flax_former
import flax_transformer.models.gpt as flax_gpt
import torch_reference.former as torch_former
import torch_reference.gpt as torch_gpt
from flax_transformer.models import layers


class TorchConvTagger(nn.Module):
    """(b, t) token ids -> (b, t, classes) scores; t <= length."""

    def __init__(self, vocab: int = 20, d: int = 8, length: int = 6, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(length, d))  # a learned position table, a bare parameter
        self.conv = nn.Conv1d(d, 2 * d, kernel_size=3, padding=1, groups=2)  # weight (2d, d/2, 3)
        self.norm = nn.LayerNorm(2 * d)
        self.proj = nn.Linear(2 * d, d)
        self.rms = nn.RMSNorm(d, eps=1e-6)
        self.mix = torch_gpt.Linear(d, d)  # notebook 002's layer: matrix (d_in, d_out)
        self.out_norm = torch_gpt.LayerNorm(d)  # gamma, beta
        self.head = nn.Linear(d, classes)
        self.register_buffer("temperature", torch.tensor(2.0))  # a constant that torch saves

    def forward(self, ids):
        x = self.embed(ids) + self.pos[: ids.shape[1]]  # (b, t, d)
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)  # torch convolves (b, d, t): (b, t, 2d)
        x = self.rms(self.proj(F.gelu(self.norm(x))))  # (b, t, d)
        return self.head(self.out_norm(self.mix(x))) / self.temperature  # (b, t, classes)


class FlaxConvTagger(nnx.Module):
    """The NNX twin of ``TorchConvTagger``: same attribute names, Flax's layers and layouts."""

    def __init__(self, vocab: int = 20, d: int = 8, length: int = 6, classes: int = 3, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (length, d)))
        self.conv = nnx.Conv(d, 2 * d, kernel_size=(3,), padding=[(1, 1)], feature_group_count=2,
                             rngs=rngs)  # kernel (3, d/2, 2d)
        self.norm = nnx.LayerNorm(2 * d, epsilon=1e-5, rngs=rngs)  # torch's eps
        self.proj = layers.Linear(2 * d, d, rngs=rngs)
        self.rms = nnx.RMSNorm(d, epsilon=1e-6, rngs=rngs)
        self.mix = flax_gpt.Linear(d, d, rngs=rngs)
        self.out_norm = flax_gpt.LayerNorm(d)
        self.head = nnx.Linear(d, classes, rngs=rngs)
        self.temperature = 2.0  # computed, not a parameter: torch_to_flax skips the buffer

    def __call__(self, ids):
        x = self.embed(ids) + self.pos[...][: ids.shape[1]]  # (b, t, d)
        x = self.conv(x)  # Flax convolves (b, t, d): (b, t, 2d)
        x = self.rms(self.proj(jax.nn.gelu(self.norm(x), approximate=False)))  # (b, t, d)
        return self.head(self.out_norm(self.mix(x))) / self.temperature  # (b, t, classes)


class TorchPostCTransformer(torch_former.CTransformer):
    """Notebook 000's classifier with ``post``: Linear(emb, emb) on every token after the blocks."""

    def __init__(self, emb, heads, depth, seq_length, num_tokens, num_classes, max_pool=True, dropout=0.0,
                 *, attention="narrow", scale="emb"):
        super().__init__(emb, heads, depth, seq_length, num_tokens, num_classes, max_pool, dropout,
                         attention=attention, scale=scale)
        self.post = nn.Linear(emb, emb)

    def _embed_and_run(self, x, mask):
        x, pad = super()._embed_and_run(x, mask)  # (b, t, emb)
        return self.post(x), pad  # pooled and fed to toprobs by CTransformer.forward


class FlaxPostCTransformer(flax_former.CTransformer):
    """The NNX twin of ``TorchPostCTransformer``: a subclass of the library's ``CTransformer``."""

    def __init__(self, emb, heads, depth, seq_length, num_tokens, num_classes, max_pool=True, dropout=0.0,
                 *, attention="narrow", scale="emb", rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        super().__init__(emb, heads, depth, seq_length, num_tokens, num_classes, max_pool, dropout,
                         attention=attention, scale=scale, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.post = layers.Linear(emb, emb, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def _embed_and_run(self, x, mask):
        x, pad = super()._embed_and_run(x, mask)  # (b, t, emb)
        return self.post(x), pad
