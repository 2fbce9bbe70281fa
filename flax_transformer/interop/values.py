"""Values between torch and numpy, and whether they survive a cast: what every loader checks.

``to_numpy`` takes a torch tensor of any dtype (bfloat16 too, through ``ml_dtypes``) or device;
``check_value`` refuses a value that a parameter's dtype cannot hold (complex, non-numeric, beyond its
range) before anything is written; ``nonfinite`` lists tensors holding NaN or inf for the exports.
torch is imported only when a torch tensor is given.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np


def to_numpy(value) -> np.ndarray:
    """A torch tensor (any dtype, any device, with or without grad) or array -> numpy."""
    if type(value).__module__.startswith("torch"):
        import torch

        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            import ml_dtypes

            return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return value.numpy()
    return np.asarray(value)


def check_value(key: str, array: np.ndarray, target) -> None:
    """Refuse a value that would not survive the cast to the parameter's dtype ``target``."""
    source = array.dtype
    if np.issubdtype(source, np.complexfloating):
        raise TypeError(f"state_dict[{key!r}] is complex ({source}); parameters are real, and casting would "
                        "drop the imaginary part; nothing was loaded")
    if not (jnp.issubdtype(source, jnp.floating) or jnp.issubdtype(source, jnp.integer)):
        raise TypeError(f"state_dict[{key!r}] has dtype {source}; parameters take real numbers; nothing was loaded")
    if not jnp.issubdtype(target, jnp.floating) or array.size == 0:
        return
    limit = float(jnp.finfo(target).max)
    widest = float(jnp.finfo(source).max if jnp.issubdtype(source, jnp.floating) else jnp.iinfo(source).max)
    if widest <= limit:
        return  # every value fits
    finite = np.isfinite(array) if jnp.issubdtype(source, jnp.floating) else True
    largest = float(np.max(np.abs(array), initial=0, where=finite))
    if largest > limit:
        raise ValueError(f"state_dict[{key!r}] holds {largest:.6g}, beyond the range of the parameter's dtype "
                         f"{jnp.dtype(target).name} (max {limit:.6g}); it would become inf; nothing was loaded")


def nonfinite(values) -> list[str]:
    """The tensors of ``values`` holding NaN or inf, in order, each as ``"name (2 NaN, 1 inf of 64 values)"``.

    A check of values only: loading takes NaN and inf as any value (a model may keep them on
    purpose); the certified exports and ``port`` refuse them with this (``verification.export``).
    ``values``: a mapping or (name, value) pairs; a value is a numpy array, a torch tensor or has
    ``read()`` (``safetensors_io.Lazy``), read in turn, so the host holds one tensor at a time.
    """
    out = []
    for name, value in (values.items() if isinstance(values, Mapping) else values):
        array = value.read() if hasattr(value, "read") else to_numpy(value)
        if not (jnp.issubdtype(array.dtype, jnp.floating) or np.issubdtype(array.dtype, np.complexfloating)):
            continue  # integers and booleans are always finite
        nans, infs = int(np.count_nonzero(np.isnan(array))), int(np.count_nonzero(np.isinf(array)))
        if nans or infs:
            counts = ", ".join(f"{n} {what}" for n, what in ((nans, "NaN"), (infs, "inf")) if n)
            out.append(f"{name} ({counts} of {array.size} values)")
        del array, value
    return out
