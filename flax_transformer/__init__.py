"""Flax NNX twins of the notebooks' Transformers, with weight porting and parity checks.

Families: ``former`` (notebooks 000/004) and ``encoder`` (notebook 001). Porting
between torch and Flax lives in ``porting`` (which imports torch lazily).
"""

__version__ = "0.1.0"

__all__ = ["ATTENTION_IMPLEMENTATIONS", "set_attention"]


def __getattr__(name):
    # Lazily: torch_reference imports this package's pure-Python configs, and must not pull in JAX.
    if name in __all__:
        from . import attention

        return getattr(attention, name)
    raise AttributeError(f"module 'flax_transformer' has no attribute {name!r}")
