"""A user's GPT whose head is tied to its token embedding, written in plain torch, and two NNX twins.

``TorchTiedGPT`` is nanoGPT's shape at toy size: ``self.lm_head.weight = self.tok_emb.weight``, so
its state_dict holds ``lm_head.weight`` and ``tok_emb.weight``, one tensor. Its Flax twins use only
Flax's stock layers (nnx.Embed, nnx.Linear, nnx.LayerNorm, nnx.Dropout) under the same attribute
names, so porting places every weight by layer type:

* ``FlaxUntiedGPT`` keeps a head of its own (``lm_head``, an ``nnx.Linear``): two tensors where
  torch has one.
* ``FlaxTiedGPT`` computes the head with ``self.tok_emb.attend(x)`` and has no ``lm_head``; it
  declares the tie (``tied_keys``) so that checkpoints whose two copies no longer share memory load.

Self-contained (torch, JAX, Flax only): ``test_tied`` copies it beside a ``--pair`` file, which
imports it as a sibling module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from torch import nn

VOCAB, D, HEADS, LENGTH = 32, 16, 2, 8


class TorchBlock(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)  # (b, t, d) each
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (b, h, t, d/h)
        scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5  # (b, h, t, t)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        attn = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, t, d)  # (b, t, d)
        x = x + self.drop(self.c_proj(y))
        return x + self.drop(self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x)))))


class TorchTiedGPT(nn.Module):
    """(b, t) token ids -> (b, t, vocab) logits; the head is the token embedding, as in nanoGPT."""

    def __init__(self, vocab: int = VOCAB, d: int = D, heads: int = HEADS, depth: int = 1, length: int = LENGTH,
                 dropout: float = 0.1):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(length, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([TorchBlock(d, heads, dropout) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # one tensor, two names in the state_dict

    def forward(self, ids):
        x = self.drop(self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1])))  # (b, t, d)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (b, t, vocab)


class FlaxBlock(nnx.Module):
    def __init__(self, d: int, heads: int, dropout: float, *, rngs: nnx.Rngs):
        self.heads = heads
        self.ln_1 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)  # torch's eps
        self.c_attn = nnx.Linear(d, 3 * d, rngs=rngs)
        self.c_proj = nnx.Linear(d, d, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
        self.c_fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.mlp_proj = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)  # RNG state that nnx.eval_shape leaves abstract

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.c_attn(self.ln_1(x)), 3, axis=-1)  # (b, t, d) each
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(0, 2, 1, 3) for z in (q, k, v))
        scores = q @ k.transpose(0, 1, 3, 2) / (d // self.heads) ** 0.5  # (b, h, t, t)
        causal = jnp.tril(jnp.ones((t, t), bool))
        attn = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        y = (attn @ v).transpose(0, 2, 1, 3).reshape(b, t, d)  # (b, t, d)
        x = x + self.drop(self.c_proj(y))
        return x + self.drop(self.mlp_proj(jax.nn.gelu(self.c_fc(self.ln_2(x)), approximate=False)))


class _FlaxGPTBody(nnx.Module):
    """Everything but the head; the two twins differ only there."""

    def __init__(self, vocab: int = VOCAB, d: int = D, heads: int = HEADS, depth: int = 1, length: int = LENGTH,
                 dropout: float = 0.1, *, rngs: nnx.Rngs):
        self.tok_emb = nnx.Embed(vocab, d, rngs=rngs)
        self.pos_emb = nnx.Embed(length, d, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.blocks = nnx.List([FlaxBlock(d, heads, dropout, rngs=rngs) for _ in range(depth)])
        self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)

    def body(self, ids):
        x = self.drop(self.tok_emb(ids) + self.pos_emb(jnp.arange(ids.shape[1])))  # (b, t, d)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)  # (b, t, d)


class FlaxUntiedGPT(_FlaxGPTBody):
    """A head of its own: ``lm_head.kernel`` (d, vocab) beside ``tok_emb.embedding`` (vocab, d)."""

    def __init__(self, vocab: int = VOCAB, d: int = D, heads: int = HEADS, depth: int = 1, length: int = LENGTH,
                 dropout: float = 0.1, *, rngs: nnx.Rngs):
        super().__init__(vocab, d, heads, depth, length, dropout, rngs=rngs)
        self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        return self.lm_head(self.body(ids))  # (b, t, vocab)


class FlaxTiedGPT(_FlaxGPTBody):
    """The head is the token embedding, read with ``attend``: no ``lm_head`` parameter at all."""

    tied_keys = (("lm_head.weight", "tok_emb.weight"),)  # torch's two names of the one tensor

    def __call__(self, ids):
        return self.tok_emb.attend(self.body(ids))  # (b, t, vocab)


def make_pair():
    """A ``--pair`` factory: the torch GPT, its tied Flax twin built with ``nnx.eval_shape`` and ported, the ids."""
    from flax_transformer.interop import porting

    torch.manual_seed(0)
    torch_model = TorchTiedGPT().eval()
    target = nnx.eval_shape(lambda: FlaxTiedGPT(rngs=nnx.Rngs(0)))
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH))
    return torch_model, porting.torch_to_flax(torch_model, target), (ids,)
