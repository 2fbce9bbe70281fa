"""The optax chain the notebooks' PyTorch runs translate to.

Notebook 000/004 train with ``torch.optim.Adam``, a ``LambdaLR`` warmup
``lr * min(step / warmup, 1)`` and ``clip_grad_norm_(params, 1.0)``; notebook 002 with
``AdamW``. Here: ``optax.chain(clip_by_global_norm, adam | adamw(schedule, mask))``.

How the two map (the optimizer-parity test checks it step by step):
* The warmup: optax counts updates from 0 like LambdaLR, so update k uses
  ``lr * min(k / warmup, 1)``; the very first update has learning rate 0 in both.
* AdamW's weight decay is decoupled in both: torch multiplies the weights by
  ``1 - lr * wd`` before the Adam step, optax adds ``-lr * wd * w`` (the same weights)
  to it. Adam's eps sits outside the square root in both (``m / (sqrt(v) + eps)``).
* Clipping happens on the raw gradients, before Adam, in both. torch divides by
  ``norm + 1e-6``, optax by ``norm``: a relative difference of 1e-6 / norm.
* No weight decay on biases, LayerNorm scales and embeddings (nanoGPT's rule):
  ``decay_mask`` decays only 2-D projection weights (``kernel``, the notebook-002
  ``matrix``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import optax

from flax_transformer.training.config_bounds import check_config

_DECAYED = ("kernel", "matrix")


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate schedule.

    Attributes:
        optimizer: "adam" (notebooks 000/004) or "adamw" (notebook 002).
        lr: peak learning rate.
        warmup_steps: linear warmup from 0 (the notebooks' LambdaLR); 0 = none.
        decay: after warmup, "constant", "cosine" or "linear" down to ``end_lr_ratio * lr``
            at ``total_steps`` (required for cosine and linear).
        total_steps: the run's length, where the decay ends. None inside a task config: the
            run fills it in (``from_task``).
        weight_decay: AdamW's decoupled decay (only on ``decay_mask``'s leaves).
        clip_norm: clip the global gradient norm to this; None = no clipping.
    """

    optimizer: str = "adamw"
    lr: float = 1e-4
    warmup_steps: int = 0
    decay: str = "constant"
    total_steps: int | None = None
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float | None = 1.0

    def __post_init__(self):
        check_config(self)  # types and bounds (lr > 0, 0 <= b1 < 1, ...)
        if self.optimizer not in ("adam", "adamw"):
            raise ValueError(f"optimizer must be 'adam' or 'adamw', got {self.optimizer!r}")
        if self.decay not in ("constant", "cosine", "linear"):
            raise ValueError(f"decay must be 'constant', 'cosine' or 'linear', got {self.decay!r}")
        if self.decay != "constant" and self.total_steps is not None and self.total_steps <= self.warmup_steps:
            raise ValueError(f"decay={self.decay!r} needs total_steps > warmup_steps, got {self.total_steps!r}")


def from_task(config, total_steps: int) -> OptimConfig:
    """The ``OptimConfig`` a task config's run uses (``config.optim``) for a run of ``total_steps``:
    the decay ends there, and warmup is cut to fit a very short run."""
    optim = config.optim
    return dataclasses.replace(optim, total_steps=total_steps, warmup_steps=min(optim.warmup_steps, total_steps - 1))


DTYPES = {"float32": "float32", "fp32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def check_precision(dtype: str, attention: str) -> None:
    """Validate a task config's ``dtype`` and ``attention`` fields."""
    from flax_transformer.models.attention import ATTENTION_IMPLEMENTATIONS

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {attention!r}")


def compute_dtype(name: str):
    """``"bf16"`` -> ``jnp.bfloat16`` etc.: the models' ``dtype`` (compute), never their parameters'."""
    import jax.numpy as jnp

    return jnp.dtype(DTYPES[name])


def schedule(config: OptimConfig) -> optax.Schedule:
    """Learning rate per update count: linear warmup from 0, then constant, cosine or linear decay."""
    pieces, boundaries = [], []
    if config.warmup_steps:
        pieces.append(optax.linear_schedule(0.0, config.lr, config.warmup_steps))
        boundaries.append(config.warmup_steps)
    if config.decay == "constant":
        pieces.append(optax.constant_schedule(config.lr))
    else:
        if config.total_steps is None:
            raise ValueError(f"decay={config.decay!r} needs total_steps (the run's length), got None")
        steps = config.total_steps - config.warmup_steps
        end = config.lr * config.end_lr_ratio
        pieces.append(optax.cosine_decay_schedule(config.lr, steps, alpha=config.end_lr_ratio)
                      if config.decay == "cosine" else optax.linear_schedule(config.lr, end, steps))
    return pieces[0] if len(pieces) == 1 else optax.join_schedules(pieces, boundaries)


def _leaf_name(path) -> str | None:
    """The parameter's own name in an NNX state path (the last string key)."""
    for entry in reversed(path):
        key = getattr(entry, "key", None)
        if isinstance(key, str):
            return key
    return None


def decay_mask(params):
    """True on the leaves that get weight decay: 2-D projection weights, not biases, norms or embeddings."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _leaf_name(path) in _DECAYED, params)


def make_optimizer(config: OptimConfig, mask=None) -> optax.GradientTransformation:
    """``chain(clip_by_global_norm, adam | adamw(schedule, mask=decay_mask))``.

    ``mask`` (a function of the parameters, as ``decay_mask``) replaces ``decay_mask``: a run
    continued from a torch optimizer whose groups decay other parameters
    (``torch_state.to_jax.import_torch_state``)."""
    lr = schedule(config)
    if config.optimizer == "adam":
        core = optax.adam(lr, b1=config.b1, b2=config.b2, eps=config.eps)
    else:
        core = optax.adamw(lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay,
                           mask=decay_mask if mask is None else mask)
    return optax.chain(optax.clip_by_global_norm(config.clip_norm), core) if config.clip_norm else core
