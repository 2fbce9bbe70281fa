"""Whether a run's step fits in memory, and whether its export targets can be written: checked before anything runs.

``check_memory`` refuses a run whose one training step would not fit in the memory of the
device it runs on (an estimate of the attention and activations), instead of an
out-of-memory traceback from XLA. ``check_output`` refuses, before training, an export
target that could not be written at the end. The fields' bounds (``BOUNDS``,
``check_config``) are ``config_bounds``'s.
"""

from __future__ import annotations

import os

from flax_transformer.interop import files
from flax_transformer.training.errors import RunError

# ----------------------------------------------------------------------------- memory


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def device_memory() -> int | None:
    """Bytes of memory one device of this run has: the accelerator's, else the machine's (or its cgroup's)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # not every backend reports it
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None
    limit = _cgroup_limit()
    return min(total, limit) if limit else total


def step_bytes(*, batch: int, length: int, width: int, heads: int, layers: int, vocab: int,
               attention_layers: int | None = None, devices: int = 1, attention: str = "reference") -> int:
    """A low estimate of the memory one training step needs on one device: the attention weights
    (fp32, kept for the backward pass; none with cuDNN's fused attention), the activations of
    every layer, the output logits."""
    rows = -(-batch // devices)
    fused = attention == "cudnn"
    attention = 0 if fused else rows * heads * length * length * 4 * 2 * (attention_layers or layers)
    activations = rows * length * width * 4 * 8 * layers
    logits = rows * length * vocab * 4 * 2
    return attention + activations + logits


def check_memory(needed: int, flags: str) -> None:
    """``ValueError`` when a step needing ``needed`` bytes cannot fit in a device's memory; ``flags``
    names what to lower."""
    have = device_memory()
    if have is not None and needed > have:
        raise ValueError(f"one training step needs about {needed / 2**30:,.1f} GiB of memory, more than the "
                         f"{have / 2**30:,.1f} GiB here: lower {flags}")


def check_output(path, *, kind: str, overwrite: bool, flag: str) -> None:
    """Refuse, before training, an export target that could not be written at the end
    (``files.check_target``: a missing folder, a wrong kind, an existing output without ``--overwrite``)."""
    if path is None:
        return
    try:
        files.check_target(path, kind=kind, overwrite=overwrite)
    except files.OutputError as error:
        raise RunError(f"{flag}: {error}") from None
