"""Tensor-shape logging, as notebook 003 does it: one logger for both frameworks, a level per kind of module.

Pure Python (no JAX, no torch).
"""

from __future__ import annotations

import enum
import logging

# Notebook 003 logs tensor shapes per class at a level per kind of module. Both
# frameworks log through the same logger, off by default: enable with
#   logging.basicConfig(); logging.getLogger("tensor_shapes").setLevel(1)
# In JAX the shapes are logged when a function is traced, not on every jitted call.


shape_logger = logging.getLogger("tensor_shapes")


class TensorLoggingLevels(enum.IntEnum):
    attention = 1
    attention_head = 2
    multihead_attention_block = 3
    enc_dec_block = 4
    enc_dec = 5


def log_size(module, shape, name: str) -> None:
    """Log ``[class, name, shape]`` at the module class's ``level``, as notebook 003 does."""
    level = type(module).level
    if shape_logger.isEnabledFor(level):
        shape_logger.log(level, "[%s] %s: %s", type(module).__name__, name, tuple(shape))
