"""Flax NNX twins of the notebooks' Transformers, with weight porting and parity checks.

Families: ``former`` (notebooks 000/004) and ``encoder`` (notebook 001). Porting
between torch and Flax lives in ``porting`` (which imports torch lazily).
"""

__version__ = "0.1.0"

from ._common import ATTENTION_IMPLEMENTATIONS, set_attention  # noqa: E402

__all__ = ["ATTENTION_IMPLEMENTATIONS", "set_attention"]
