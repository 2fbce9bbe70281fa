"""Values between torch, numpy and JAX, and the compiled calls both ``verify`` and ``bisect`` make.

torch is imported only inside ``to_torch``: a torch tensor is recognised by its type's module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def leaves(x):
    """The leaves of nested tuples and lists (a model's outputs), in order."""
    if isinstance(x, (tuple, list)):
        for item in x:
            yield from leaves(item)
    else:
        yield x


def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch") and hasattr(a, "detach")


def to_numpy(a):
    """A torch tensor, JAX or numpy array as numpy; anything else (None, a Python scalar) unchanged."""
    if _is_torch(a):
        return a.detach().cpu().numpy()
    return np.asarray(a) if isinstance(a, (np.ndarray, jax.Array)) else a


def to_torch(a):
    """numpy / JAX / torch -> a torch tensor (a copy of numpy's memory); anything else unchanged."""
    import torch

    if _is_torch(a):
        return a
    return torch.from_numpy(np.array(a)) if isinstance(a, (np.ndarray, jax.Array)) else a


def to_jax(a):
    """numpy / torch / JAX -> a JAX array; anything else unchanged."""
    a = to_numpy(a)
    return jnp.asarray(a) if isinstance(a, np.ndarray) else a


def max_abs_err(torch_out, flax_out) -> tuple[float, bool]:
    """Largest |torch - flax| over all outputs, and whether every value is finite."""
    err, finite = 0.0, True
    for a, b in zip(leaves(torch_out), leaves(flax_out), strict=True):
        a, b = np.asarray(to_numpy(a)), np.asarray(to_numpy(b))
        if a.shape != b.shape:
            raise AssertionError(f"output shapes differ: torch {a.shape} vs flax {b.shape}")
        finite &= bool(np.isfinite(a).all() and np.isfinite(b).all())
        err = max(err, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0)))
    return err, finite


@nnx.jit
def apply(module, args, kwargs):
    """One jitted wrapper for every comparison, so its compile cache is shared: the two
    directions of a check (same module structure, same shapes) compile once, not twice."""
    return module(*args, **kwargs)


@nnx.jit
def flax_grads(module, args, kwargs, weights):
    """(outputs, d sum_i <output_i, W_i> / d parameters), in one compiled function."""
    def loss(m):
        out = m(*args, **kwargs)
        return sum((leaf * w).sum() for leaf, w in zip(leaves(out), weights, strict=True)), out
    (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(module)
    return out, grads
