"""A sliding-window layer's key/value cache as a ring buffer: memory O(window), not O(length).

Position q lives at slot q % R of a ring of R slots. A step at ``index`` attends over the ring (the
positions before index) and its own fresh keys side by side, masked by absolute position
(``ring_keep``), then writes the fresh keys into the ring (``update_ring``); one token is written
first, then the ring attended. A query needs the
W - 1 keys before it and its own, so R = W would do for a caller that never goes back; ``generate``
re-runs positions it has already written (the loop restarts at the shortest prompt's last token,
and its prefill chunks overlap), which a ring of W - 1 + C slots survives for up to C positions
back. C = ``ring_rewind(W)`` = min(W, ``MAX_RING_REWIND``): the ring is at most 2W - 1 and at most
W + 127 slots (Gemma 2's 4096-key window: 4223 slots at any length).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_RING_REWIND = 128


def ring_rewind(window: int) -> int:
    """How many already written positions a step may go back over in a ring for ``window`` (C above)."""
    return min(window, MAX_RING_REWIND)


def ring_slots(window: int) -> int:
    """The ring's size for a window of ``window`` keys: W - 1 + ``ring_rewind(W)``."""
    return window - 1 + ring_rewind(window)


def ring_positions(slots: int, index) -> jax.Array:
    """(slots,) int: the position each slot holds before a step at ``index``, the latest q < index
    with q % slots == slot (negative: none yet). A slot rewritten by a step that was later gone back
    over holds a position this reads as one ``slots`` earlier, out of every query's window then."""
    return index - 1 - jnp.mod(index - 1 - jnp.arange(slots), slots)


def ring_keep(n: int, slots: int, index, window: int) -> jax.Array:
    """bool (1, 1, n, slots + n) over [ring, the step's n fresh keys]: the query at position index + i
    sees key positions q with 0 <= q <= index + i and q > index + i - window. One token (n = 1) is
    written into the ring first and attends over it alone: (1, 1, 1, slots), a ring of W slots or more."""
    if n == 1:  # positions after its write
        keys = ring_positions(slots, index + 1)
    else:
        keys = jnp.concatenate((ring_positions(slots, index), index + jnp.arange(n)))  # (slots + n,)
    query = index + jnp.arange(n)[:, None]  # (n, 1)
    return ((keys >= 0) & (keys <= query) & (keys > query - window))[None, None]


def update_ring(cache, k, v, index):
    """Write k, v (b, h, n, d) for positions [index, index + n) into a ring (keys, values) of R slots:
    position q at slot q % R; of n > R positions the last R."""
    slots, n = cache[0].shape[2], k.shape[2]
    kept = min(n, slots)
    where = jnp.mod(index + n - kept + jnp.arange(kept), slots)  # distinct slots: kept <= slots
    keys = cache[0].at[:, :, where].set(k[:, :, n - kept:].astype(cache[0].dtype), unique_indices=True)
    values = cache[1].at[:, :, where].set(v[:, :, n - kept:].astype(cache[1].dtype), unique_indices=True)
    return keys, values
