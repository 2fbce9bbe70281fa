"""Where a parameter lives on a ("data", "fsdp") mesh: the FSDP rule, shared by loading and training.

It sits here, in ``interop``, rather than in ``training.distributed``: loading a checkpoint
onto a mesh (``safetensors_io.fill(..., sharding=mesh)``) places each parameter as training
places it (``training.distributed.state_shardings``), so that a loaded model trains without
being moved, and ``interop`` may not import ``training`` (the layers import to the left only:
models <- interop <- verification <- training <- cli).
"""

from __future__ import annotations

import jax


def is_key(x) -> bool:
    """Whether ``x`` is an array of typed PRNG keys (never split: a key is one value)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def param_spec(x, fsdp: int):
    """FSDP: the ``PartitionSpec`` splitting a parameter (and its Adam moments) along its largest axis that
    ``fsdp`` (the size of the mesh's "fsdp" axis) divides; replicated (``P()``) when none does, when
    ``fsdp`` is 1, for a scalar and for PRNG keys. ``x``: an array or a ``jax.ShapeDtypeStruct``."""
    from jax.sharding import PartitionSpec as P

    shape = getattr(x, "shape", ())
    if fsdp == 1 or not shape or is_key(x):
        return P()
    axes = sorted(range(len(shape)), key=lambda i: -shape[i])
    for axis in axes:
        if shape[axis] % fsdp == 0:
            return P(*[("fsdp" if i == axis else None) for i in range(len(shape))])
    return P()  # too small to split: replicated
