"""Input checks the models run before any computation (shapes, dtypes, id ranges, masks).

JAX clamps an out-of-range index silently, so ids are checked whenever their values are
known (outside ``jit``); ``layers.lookup`` is the guard that stays under ``jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
    """True when the values of ``x`` are known now (not a tracer inside jit/grad)."""
    return not isinstance(x, jax.core.Tracer)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def check_token_ids(ids, vocab_size: int, *, name: str = "input_ids") -> None:
    """Ids must be an integer (b, t) array with 0 <= id < vocab_size (values checked when concrete)."""
    if not _is_array(ids):
        raise TypeError(f"{name} must be an array of token ids, got {type(ids).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.ndim != 2:
        raise ValueError(f"{name} must have shape (batch, length), got {tuple(ids.shape)}")
    if is_concrete(ids) and ids.size:
        values = np.asarray(ids)
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must lie in [0, {vocab_size}); found values in [{lo}, {hi}]")


def check_features(x, features: int, *, name: str = "x") -> None:
    """A (b, t, features) floating-point array."""
    if not _is_array(x):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array of shape (batch, length, {features}), got {x.dtype}")
    if x.ndim != 3 or x.shape[-1] != features:
        raise ValueError(f"{name} must have shape (batch, length, {features}), got {tuple(x.shape)}")
