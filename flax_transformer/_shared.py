"""Pure-Python helpers shared by flax_transformer and torch_reference.

No JAX and no torch here: torch_reference imports this module (torch_reference must
never import JAX, and flax_transformer must not need torch).
"""

from __future__ import annotations

import copy
import functools
import inspect

import numpy as np


# ------------------------------------------------------------- constructor records


class _Opaque:
    """Wraps an unhashable constructor argument so it can live in a module's static state."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"_Opaque({self.value!r})"


def _freeze(value):
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
        return value
    except TypeError:
        # a private copy: the caller may mutate its object later (notebook 001 sets
        # config.num_labels after building models)
        return _Opaque(copy.deepcopy(value))


def _thaw(value):
    if isinstance(value, _Opaque):
        return value.value
    if isinstance(value, tuple):
        return tuple(_thaw(v) for v in value)
    return value


class RecordsInit:
    """Mixin that remembers constructor arguments (minus ``rngs``), for porting.

    ``flax_transformer.porting`` rebuilds a module's twin in the other framework from
    them, so porting needs no per-class knowledge of signatures. The arguments are
    stored hashable (lists become tuples) because NNX keeps them in the static graph.
    A class may declare ``_init_converters = {"config": SomeConfig.from_any}`` to record
    an argument in a canonical, immutable form.
    """

    _init_converters: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            return
        init = cls.__init__

        @functools.wraps(init)
        def recording_init(self, *args, **kw):
            init(self, *args, **kw)
            if type(self) is cls:
                bound = inspect.signature(init).bind(self, *args, **kw)
                del bound.arguments["self"]
                bound.arguments.pop("rngs", None)
                convert = type(self)._init_converters
                self._init_args = tuple((k, _freeze(convert[k](v) if k in convert else v))
                                        for k, v in bound.arguments.items())

        cls.__init__ = recording_init

    def init_kwargs(self) -> dict:
        """The constructor's keyword arguments, as given (without ``rngs``)."""
        return {k: _thaw(v) for k, v in self._init_args}



class StateDictError(ValueError):
    """A state_dict does not fit a model; the message lists every problem."""

    def __init__(self, missing=(), unexpected=(), mismatched=()):
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)
        lines = []
        if self.missing:
            lines.append(f"missing keys ({len(self.missing)}): " + ", ".join(self.missing))
        if self.unexpected:
            lines.append(f"unexpected keys ({len(self.unexpected)}): " + ", ".join(self.unexpected))
        if self.mismatched:
            lines.append(f"shape mismatches ({len(self.mismatched)}): " + ", ".join(
                f"{k}: checkpoint {a} vs model {b}" for k, a, b in self.mismatched))
        super().__init__("state_dict does not match the model; nothing was loaded.\n  " + "\n  ".join(lines))


# ------------------------------------------------------------------ input checks


def check_length(length: int, max_length: int, *, what: str = "position table") -> None:
    if length > max_length:
        raise ValueError(f"sequence length {length} exceeds the {what} size {max_length}")
    if length == 0:
        raise ValueError("sequence length must be at least 1")


def check_divisible(width: int, heads: int, *, what: str = "embedding dimension") -> None:
    if heads < 1:
        raise ValueError(f"number of heads must be >= 1, got {heads}")
    if width % heads:
        raise ValueError(f"{what} ({width}) must be divisible by the number of heads ({heads})")


# ----------------------------------------------------------- tensor-shape logging
# Notebook 003 logs tensor shapes per class at a level per kind of module. Both
# frameworks log through the same logger, off by default: enable with
#   logging.basicConfig(); logging.getLogger("tensor_shapes").setLevel(1)
# In JAX the shapes are logged when a function is traced, not on every jitted call.

import enum
import logging

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


# ------------------------------------------------------------ generation checks


def check_generate_args(max_new_tokens, temperature, top_k, top_p, greedy, eos_id, vocab):
    """The sampling arguments, checked before anything runs (shared with the torch twin)."""
    def integer(value):
        return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))

    if not integer(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    for name, value in (("top_k", top_k), ("eos_id", eos_id)):
        if value is not None and not integer(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling (or pass greedy=True), got {temperature!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must lie in [1, {vocab}], got {top_k!r}")
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise ValueError(f"eos_id must lie in [0, {vocab}), got {eos_id!r}")


def prompt_lengths(input_ids, attention_mask) -> np.ndarray:
    """Per-row prompt length from a right-padded (b, p) mask (1 = token); checks the padding side."""
    b, p = input_ids.shape
    if p == 0:
        raise ValueError("every prompt needs at least one token (a start token for an empty prompt)")
    if attention_mask is None:
        return np.full(b, p, np.int32)
    mask = np.asarray(attention_mask)
    if mask.shape != (b, p):
        raise ValueError(f"attention_mask must have shape (batch, length)=({b}, {p}), got {mask.shape}")
    if not np.all((mask == 0) | (mask == 1)):
        raise ValueError("attention_mask must hold only 0 (pad) and 1 (token)")
    lengths = mask.sum(axis=1).astype(np.int32)
    if np.any(mask != (np.arange(p)[None] < lengths[:, None])):
        raise ValueError("prompts must be right-padded: attention_mask rows must be 1s followed by 0s")
    if np.any(lengths == 0):
        raise ValueError("every prompt needs at least one token (a start token for an empty prompt)")
    return lengths
