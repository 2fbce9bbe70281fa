"""Keep freed memory in the process instead of handing it back to the kernel (glibc only).

Each jitted train step frees and reallocates its large temporaries. glibc's malloc serves
big blocks with ``mmap`` and returns freed memory to the kernel, so every step faults its
pages in again: notebook 000's CTransformer train step took 64.9 ms with
``python bench/speed.py --default-malloc`` and 46.6 ms without, on 2 CPU cores. Raising the
mmap and trim thresholds makes malloc reuse the blocks instead. The cost is a process that
keeps its peak memory until it exits, which is what a training run does anyway.

``keep_freed_memory()`` is called by the ``train/`` entry points and the benchmarks before
the first JAX computation (one arena must be set before XLA's threads start). Set
``FLAX_TRANSFORMER_KEEP_FREED_MEMORY=0`` to leave malloc alone; the environment variables
``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_ARENA_MAX=1``
set before the process starts do the same thing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters


def keep_freed_memory(threshold: int = 1 << 30) -> bool:
    """Ask glibc to keep freed blocks up to ``threshold`` bytes; True if it was applied."""
    if os.environ.get("FLAX_TRANSFORMER_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, ...): nothing to tune
        return False
    return all(mallopt(option, value) == 1 for option, value in
               ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, threshold), (_M_TRIM_THRESHOLD, threshold)))
