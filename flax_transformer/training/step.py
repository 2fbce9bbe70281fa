"""One compiled train step and one eval step for any model and loss.

    train_step, eval_step = make_steps(loss_fn)       # loss_fn(model, batch) -> (loss, metrics)
    metrics = train_step(model, optimizer, batch)      # loss, grads, optax update, metrics: one program

The model and optimizer state are donated to the step (updated in place on device), and
the step is traced once per batch shape: with the bucketed padded lengths of the data
pipeline that is a handful of compilations, not one per step. Dropout draws from the
model's own ``dropout`` RNG stream (``nnx.Rngs(params=..., dropout=...)``), which the step
advances and which a checkpoint saves, so a resumed run draws the same masks.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def cross_entropy(logits, labels, mask=None):
    """Mean token cross-entropy in fp32; ``mask`` (same shape as ``labels``) picks the counted positions.

    Logits (..., V) may be log-probabilities (CTransformer/GTransformer): log_softmax is
    idempotent on them.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if mask is None:
        return nll.mean()
    mask = mask.astype(jnp.float32)
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def make_steps(loss_fn: Callable):
    """(train_step, eval_step) for ``loss_fn(model, batch) -> (scalar loss, dict of scalar metrics)``.

    ``train_step(model, optimizer, batch)`` applies one optax update and returns the metrics
    plus ``loss``, ``grad_norm`` (before clipping) and ``lr`` is left to the caller (it knows
    the schedule). ``eval_step(model, batch)`` returns the metrics and ``loss``. Put the model
    in ``train()`` / ``eval()`` mode outside the steps: the mode is part of the compiled program.
    """

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, batch):
        (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))

    @nnx.jit
    def eval_step(model, batch):
        loss, metrics = loss_fn(model, batch)
        return dict(metrics, loss=loss)

    return train_step, eval_step
