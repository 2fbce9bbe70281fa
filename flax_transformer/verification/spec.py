"""What one row group of ``flax-transformer verify`` is: a ``Spec`` (a module built in torch and the
inputs it reads), and the random inputs the families' specs draw (``floats``, ``ids``).

``verify.specs()`` lists the specs of every family; ``llama_specs`` holds the llama family's
(llama, moe, gemma, gpt_oss, deepseek).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spec:
    """One module to verify: how to build it (in torch) and what to feed it."""

    family: str
    name: str
    build: Callable[[bool], object]  # causal -> torch module
    inputs: Callable[[np.random.Generator, np.ndarray | None], tuple[tuple, dict]]
    cases: tuple[str, ...]
    causal_via_mask: bool = False  # no causal switch: causal cases pass a (b, t, t) mask


def floats(rng: np.random.Generator, *shape) -> np.ndarray:
    """Standard normal float32 of ``shape``."""
    return rng.standard_normal(shape).astype(np.float32)


def ids(rng: np.random.Generator, vocab: int, b: int, t: int) -> np.ndarray:
    """(b, t) int64 token ids below ``vocab``."""
    return rng.integers(0, vocab, size=(b, t)).astype(np.int64)
