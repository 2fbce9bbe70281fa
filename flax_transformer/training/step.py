"""One compiled train step and one eval step for any model and loss.

    train_step, eval_step = make_steps(loss_fn)       # loss_fn(model, batch) -> (loss, metrics)
    metrics = train_step(model, optimizer, batch)      # loss, grads, optax update, metrics: one program

``make_steps`` wraps ``compiled_train_step``, the step ``fit`` runs: the parity checks
(``verify --train-steps``) and the tests exercise the step that training runs.

The model and optimizer state are donated to the step (updated in place on device), and
the step is traced once per batch shape: with the bucketed padded lengths of the data
pipeline that is a handful of compilations, not one per step. Dropout draws from the
model's own ``dropout`` RNG stream (``nnx.Rngs(params=..., dropout=...)``), which the step
advances and which a checkpoint saves, so a resumed run draws the same masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial

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


def compiled_train_step(loss_fn: Callable, train_def, opt_def, shardings=None):
    """The train step: one jitted program over (model state, optimizer state, batch).

    ``step(model_state, opt_state, batch) -> (model_state, opt_state, metrics)`` computes the
    loss, the gradients, the optax update and the metrics (``loss``, ``grad_norm`` before
    clipping, and ``loss_fn``'s own). Both states are donated (updated in place on device).
    ``fit``, ``make_steps`` (so ``verify --train-steps`` and the tests) all run this one.

    With ``shardings`` = (model state, optimizer state, replicated) the step keeps the
    parameters and optimizer state where they are (FSDP) and XLA's SPMD partitioner inserts
    the collectives. Without, the compiled step is cached per (loss_fn, graph definitions),
    so a new model of the same structure reuses it.
    """
    if shardings is None:
        return _cached_train_step(loss_fn, train_def, opt_def)
    return _train_step(loss_fn, train_def, opt_def, shardings)


def _train_step(loss_fn, train_def, opt_def, shardings):
    jit = partial(jax.jit, donate_argnums=(0, 1))
    if shardings is not None:
        model_sh, opt_sh, replicated = shardings
        jit = partial(jax.jit, donate_argnums=(0, 1), out_shardings=(model_sh, opt_sh, replicated))

    @jit
    def train_step(model_state, opt_state, batch):
        model = nnx.merge(train_def, model_state)
        optimizer = nnx.merge(opt_def, opt_state)
        # only what the optimizer trains (its ``wrt``: every nnx.Param, or a LoRA run's adapters) is
        # differentiated: a frozen base gets no gradient and no optimizer state
        wrt = nnx.DiffState(0, optimizer.wrt)
        (loss, metrics), grads = nnx.value_and_grad(loss_fn, argnums=wrt, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return nnx.state(model), nnx.state(optimizer), dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))

    return train_step


@functools.lru_cache(maxsize=64)
def _cached_train_step(loss_fn, train_def, opt_def):
    return _train_step(loss_fn, train_def, opt_def, None)


@functools.cache
def eval_step(loss_fn: Callable):
    """``loss_fn`` jitted, one per ``loss_fn``: evaluators of the same loss (validation, then
    test) share its compilations. Put the model in ``eval()`` mode first."""
    return nnx.jit(loss_fn)


def make_steps(loss_fn: Callable):
    """(train_step, eval_step) on NNX objects, for a loop of your own.

    ``train_step(model, optimizer, batch)`` runs ``compiled_train_step`` (the step ``fit``
    runs) and updates ``model`` and ``optimizer`` in place; it returns the metrics plus
    ``loss`` and ``grad_norm`` (before clipping); ``lr`` is left to the caller (it knows the
    schedule). ``eval_step(model, batch)`` returns the metrics and ``loss``. Put the model in
    ``train()`` / ``eval()`` mode outside the steps: the mode is part of the compiled program.
    """

    def train_step(model, optimizer, batch):
        train_def, model_state = nnx.split(model)
        opt_def, opt_state = nnx.split(optimizer)
        model_state, opt_state, metrics = compiled_train_step(loss_fn, train_def, opt_def)(model_state, opt_state, batch)
        nnx.update(model, model_state)
        nnx.update(optimizer, opt_state)
        return metrics

    def evaluate(model, batch):
        loss, metrics = eval_step(loss_fn)(model, batch)
        return dict(metrics, loss=loss)

    return train_step, evaluate
