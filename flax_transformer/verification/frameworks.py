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


def nonfinite(reference, other) -> tuple[int, int, int, int]:
    """Where two arrays of one shape hold NaN or inf: (in ``reference`` only, in ``other`` only,
    in both as the same value, in both as different values: NaN against inf, +inf against -inf).

    Non-finite values never agree: the verdicts fail on any of these counts, the third ("not
    finite in either framework") excepted only when the caller allows it explicitly."""
    a = np.atleast_1d(np.asarray(reference, np.float64))
    b = np.atleast_1d(np.asarray(other, np.float64))
    bad_a, bad_b = ~np.isfinite(a), ~np.isfinite(b)
    both = bad_a & bad_b
    same = both & ((np.isnan(a) & np.isnan(b)) | (a == b))
    return (int((bad_a & ~bad_b).sum()), int((bad_b & ~bad_a).sum()), int(same.sum()), int((both & ~same).sum()))


def finite_abs_err(a, b) -> float:
    """max |a - b| in float64 over the positions finite in both; inf when the two are not finite
    at the same positions (NaN or inf on one side, or different non-finite values)."""
    a64 = np.atleast_1d(np.asarray(a, np.float64))
    b64 = np.atleast_1d(np.asarray(b, np.float64))
    only_a, only_b, _, differ = nonfinite(a64, b64)
    if only_a or only_b or differ:
        return float("inf")
    keep = np.isfinite(a64) & np.isfinite(b64)
    return float(np.abs(a64[keep] - b64[keep]).max(initial=0.0))


def max_abs_err(torch_out, flax_out) -> tuple[float, bool]:
    """Largest |torch - flax| over all outputs (``finite_abs_err``: inf when NaN or inf appear on
    one side only), and whether every value is finite (False also for NaN on both sides: a
    caller that reads ``finite`` never passes a non-finite output)."""
    err, finite = 0.0, True
    for a, b in zip(leaves(torch_out), leaves(flax_out), strict=True):
        a, b = np.asarray(to_numpy(a)), np.asarray(to_numpy(b))
        if a.shape != b.shape:
            raise AssertionError(f"output shapes differ: torch {a.shape} vs flax {b.shape}")
        finite &= bool(np.isfinite(a).all() and np.isfinite(b).all())
        err = max(err, finite_abs_err(a, b))
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
