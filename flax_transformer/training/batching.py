"""Batches with a bounded number of shapes, in an order fixed by (seed, step).

A jitted step compiles once per input shape. Padding every review to 512 tokens wastes
most of the work on short ones; padding each batch to its own longest review compiles a
new program for almost every batch. ``Bucketed`` takes the middle road: a few fixed
padded lengths (by default 4, each half the next), each sequence in the shortest that
holds it, so a run compiles at most ``len(buckets)`` train programs.

Every batch is a pure function of ``(seed, step)``: epoch ``e`` shuffles with
``default_rng([seed, e])``. A checkpoint therefore only needs the step to resume the
data stream exactly; ``position(step)`` spells it out (epoch, batch in epoch) for people.
Batches always have ``batch_size`` rows; a bucket's last, short batch is filled with
empty rows of ``weight`` 0 that the losses skip, so no example is dropped and no shape is added.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def default_buckets(max_length: int, n: int = 4, *, smallest: int = 16) -> tuple[int, ...]:
    """``n`` padded lengths ending at ``max_length``, each half the next (not below ``smallest``)."""
    if max_length < 1 or n < 1:
        raise ValueError(f"max_length and n must be >= 1, got {max_length}, {n}")
    lengths = {max_length}
    for i in range(1, n):
        lengths.add(max(max_length >> i, min(smallest, max_length)))
    return tuple(sorted(lengths))


class Bucketed:
    """Length-bucketed, seeded batches of token sequences (for classification, or any per-sequence label).

    Args:
        sequences: list of 1-D integer id arrays (already truncated to ``buckets[-1]``).
        labels: (n,) integer labels, or None.
        batch_size: rows per batch.
        buckets: the padded lengths, ascending.
        pad_id: id written into padding positions (masked out anyway).
        seed: fixes every epoch's order; shuffle=False keeps the input order (evaluation).

    A batch is a dict of numpy arrays: ``ids`` (b, L) int32, ``mask`` (b, L) bool (True =
    token), ``weight`` (b,) float32 (0 for filler rows) and ``labels`` (b,) int32.
    """

    def __init__(self, sequences, labels=None, *, batch_size: int, buckets, pad_id: int = 0, seed: int = 0,
                 shuffle: bool = True):
        if len(sequences) == 0:
            raise ValueError("no examples to batch: the dataset is empty")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.buckets = tuple(sorted(int(b) for b in buckets))
        self.sequences = [np.asarray(s, dtype=np.int32) for s in sequences]
        lengths = np.array([len(s) for s in self.sequences])
        if lengths.max() > self.buckets[-1]:
            raise ValueError(f"a sequence has {lengths.max()} tokens, more than the largest bucket "
                             f"({self.buckets[-1]}): truncate first")
        self.labels = None if labels is None else np.asarray(labels, dtype=np.int32)
        if self.labels is not None and len(self.labels) != len(self.sequences):
            raise ValueError(f"{len(self.sequences)} sequences but {len(self.labels)} labels")
        self.batch_size, self.pad_id, self.seed, self.shuffle = batch_size, pad_id, seed, shuffle
        self.bucket_of = np.searchsorted(self.buckets, lengths)  # the shortest bucket that holds each
        counts = np.bincount(self.bucket_of, minlength=len(self.buckets))
        self.steps_per_epoch = int(sum(-(-c // batch_size) for c in counts))
        self.num_tokens = int(lengths.sum())

    def __len__(self):
        return self.steps_per_epoch

    @lru_cache(maxsize=2)  # noqa: B019  (a batcher lives as long as its run; the cache holds 2 epochs)
    def _plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """[(padded length, example indices)] for one epoch."""
        rng = np.random.default_rng([self.seed, epoch])
        plan = []
        for b, length in enumerate(self.buckets):
            members = np.flatnonzero(self.bucket_of == b)
            if self.shuffle:
                members = rng.permutation(members)
            plan += [(length, members[i:i + self.batch_size]) for i in range(0, len(members), self.batch_size)]
        if self.shuffle:  # mix the buckets, so the loss curve is not a staircase of lengths
            plan = [plan[i] for i in rng.permutation(len(plan))]
        return plan

    def position(self, step: int) -> dict:
        epoch, index = divmod(step, self.steps_per_epoch)
        return {"epoch": epoch, "batch_in_epoch": index, "steps_per_epoch": self.steps_per_epoch}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The batch at global step ``step`` (epoch ``step // steps_per_epoch``)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        return self._fill(*self._plan(epoch)[index])

    def with_members(self, epoch: int = 0):
        """Each batch of an epoch with the indices of the examples in its first rows: (members, batch).

        For per-example outputs (``classify.pooled_features``): ``out[members] = f(batch)[:len(members)]``."""
        for length, members in self._plan(epoch):
            yield members, self._fill(length, members)

    def _fill(self, length: int, members) -> dict[str, np.ndarray]:
        ids = np.full((self.batch_size, length), self.pad_id, dtype=np.int32)
        mask = np.zeros((self.batch_size, length), dtype=bool)
        for row, i in enumerate(members):
            seq = self.sequences[i]
            ids[row, :len(seq)] = seq
            mask[row, :len(seq)] = True
        weight = np.zeros(self.batch_size, dtype=np.float32)
        weight[:len(members)] = 1.0
        batch = {"ids": ids, "mask": mask, "weight": weight}
        if self.labels is not None:
            labels = np.zeros(self.batch_size, dtype=np.int32)
            labels[:len(members)] = self.labels[members]
            batch["labels"] = labels
        return batch

    def epoch(self, epoch: int = 0):
        """The batches of one epoch, in order (for evaluation: every example exactly once)."""
        for index in range(self.steps_per_epoch):
            yield self.batch(epoch * self.steps_per_epoch + index)


class Windows:
    """Random contiguous windows of a token stream, for language modelling.

    Step ``s`` draws ``batch_size`` start offsets from ``default_rng([seed, s])``; a batch is
    ``ids`` (b, length) and ``labels`` (b, length), the same windows shifted by one token.
    ``fixed(n)`` gives n batches that tile the stream in order (evaluation).
    """

    def __init__(self, tokens, *, batch_size: int, length: int, seed: int = 0):
        self.tokens = np.asarray(tokens, dtype=np.int32)
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {self.tokens.shape}")
        if len(self.tokens) < length + 1:
            raise ValueError(f"the text has {len(self.tokens)} tokens; windows of {length} need at least {length + 1}")
        self.batch_size, self.length, self.seed = batch_size, length, seed
        self.steps_per_epoch = max(1, (len(self.tokens) - 1) // (batch_size * length))

    def _gather(self, starts):
        offsets = starts[:, None] + np.arange(self.length + 1)[None]  # (b, length + 1)
        window = self.tokens[offsets]
        return {"ids": window[:, :-1], "labels": window[:, 1:]}

    def position(self, step: int) -> dict:
        return {"step": step, "tokens_seen": step * self.batch_size * self.length}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
        return self._gather(rng.integers(0, len(self.tokens) - self.length, size=self.batch_size))

    def fixed(self, max_batches: int | None = None):
        """Consecutive non-overlapping windows from the start of the stream."""
        n = (len(self.tokens) - 1) // self.length
        starts = np.arange(n) * self.length
        for count, i in enumerate(range(0, n, self.batch_size)):  # the last one may be smaller
            if max_batches is not None and count >= max_batches:
                return
            yield self._gather(starts[i:i + self.batch_size])


class Rows:
    """Seeded batches of precomputed per-example rows (``--freeze-encoder``'s cached features).

    Args:
        arrays: name -> (n, ...) array, e.g. ``{"features": (n, d), "labels": (n,)}``.
        batch_size: rows per batch; the last batch of an epoch is filled with zero rows of ``weight`` 0.
        seed: epoch ``e`` shuffles with ``default_rng([seed, e])``; shuffle=False keeps the order.

    A batch is the arrays' rows plus ``weight`` (b,) float32.
    """

    def __init__(self, arrays: dict, *, batch_size: int, seed: int = 0, shuffle: bool = True):
        sizes = {name: len(a) for name, a in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"the arrays must have one length, got {sizes}")
        self.size = next(iter(sizes.values()))
        if self.size == 0:
            raise ValueError("no rows to batch")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.arrays = {name: np.asarray(a) for name, a in arrays.items()}
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.steps_per_epoch = -(-self.size // batch_size)

    @lru_cache(maxsize=2)  # noqa: B019  (as above)
    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def position(self, step: int) -> dict:
        epoch, index = divmod(step, self.steps_per_epoch)
        return {"epoch": epoch, "batch_in_epoch": index, "steps_per_epoch": self.steps_per_epoch}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        epoch, index = divmod(step, self.steps_per_epoch)
        members = self._order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        out = {}
        for name, array in self.arrays.items():
            rows = np.zeros((self.batch_size, *array.shape[1:]), dtype=array.dtype)
            rows[:len(members)] = array[members]
            out[name] = rows
        out["weight"] = (np.arange(self.batch_size) < len(members)).astype(np.float32)
        return out

    def count_tokens(self, batch) -> int:
        """Real rows (the progress bar's rate is rows/s here)."""
        return int(batch["weight"].sum())

    def epoch(self, epoch: int = 0):
        for index in range(self.steps_per_epoch):
            yield self.batch(epoch * self.steps_per_epoch + index)
