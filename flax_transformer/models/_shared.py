"""Pure-Python helpers shared by flax_transformer and torch_reference.

No JAX and no torch here: torch_reference imports this module (torch_reference must
never import JAX, and flax_transformer must not need torch).
"""

from __future__ import annotations

import copy
import enum
import functools
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass

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

    ``flax_transformer.interop.porting`` rebuilds a module's twin in the other framework from
    them, so porting needs no per-class knowledge of signatures. The arguments are
    stored hashable (lists become tuples) because NNX keeps them in the static graph.
    A class may declare ``_init_converters = {"config": SomeConfig.from_any}`` to record
    an argument in a canonical, immutable form. Before ``__init__`` runs, the arguments
    are checked by name (``CONSTRUCTOR_CHECKS``: sizes, layer counts, dropout rates, eps).
    """

    _init_converters: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            return
        init = cls.__init__
        signature = inspect.signature(init)

        @functools.wraps(init)
        def recording_init(self, *args, **kw):
            try:
                bound = signature.bind(self, *args, **kw)
            except TypeError:
                bound = None  # wrong arguments: let __init__ raise its own TypeError
            if bound is not None:
                check_constructor_args(cls.__name__, bound.arguments)  # before anything is built
            init(self, *args, **kw)
            if type(self) is cls:
                del bound.arguments["self"]
                bound.arguments.pop("rngs", None)
                convert = type(self)._init_converters
                self._init_args = tuple((k, _freeze(convert[k](v) if k in convert else v))
                                        for k, v in bound.arguments.items())

        cls.__init__ = recording_init

    def init_kwargs(self) -> dict:
        """The constructor's keyword arguments, as given (without ``rngs``)."""
        return {k: _thaw(v) for k, v in self._init_args}



# ------------------------------------------------------------------ what a model reads


@dataclass(frozen=True)
class InputSpec:
    """What a whole model reads, so that tools (verify, port, generate) ask the model instead of
    switching on its class name. Every top-level model of both packages has ``input_spec()``.

    vocab_size: the ids it reads lie in [0, vocab_size) (an encoder-decoder's source ids).
    max_length: the longest sequence it has positions for.
    target_vocab_size: an encoder-decoder's decoder ids (and logits); None for one sequence.
    generates: it gives next-token logits, so ``generate`` can drive it.
    """

    vocab_size: int
    max_length: int
    target_vocab_size: int | None = None
    generates: bool = False

    @property
    def encoder_decoder(self) -> bool:
        return self.target_vocab_size is not None

    @property
    def output_vocab_size(self) -> int:
        """The size of the vocabulary its logits range over (for a generating model)."""
        return self.vocab_size if self.target_vocab_size is None else self.target_vocab_size


def input_spec(model) -> InputSpec:
    """``model.input_spec()``, or a clear error for a module that is not a whole model."""
    method = getattr(model, "input_spec", None)
    if method is None:
        raise TypeError(f"{type(model).__name__} is not a whole model (it has no input_spec()): this tool takes "
                        "the models that read token ids, e.g. CTransformer, GPTTransformer, TransformerEncoder")
    return method()


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


def check_state_dict_mapping(state) -> None:
    """A state_dict is a mapping with string keys (parameter names); anything else is a TypeError."""
    if not isinstance(state, Mapping):
        raise TypeError(f"a state_dict must be a mapping of parameter names to arrays, got {type(state).__name__}")
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise TypeError(f"state_dict keys must be strings (parameter names); got {len(bad)} other keys: "
                        f"{', '.join(repr(k) for k in bad[:5])}")


# ------------------------------------------------------------------ input checks


def check_length(length: int, max_length: int, *, what: str = "position table") -> None:
    if length > max_length:
        raise ValueError(f"sequence length {length} exceeds the {what} size {max_length}")
    if length == 0:
        raise ValueError("sequence length must be at least 1")


# ------------------------------------------------------------ argument checks
# One place for what a size, a probability or an epsilon may be, used by the config
# dataclasses and (through ``RecordsInit``) by every constructor of both packages.

MAX_SIZE = 2 ** 24  # any width, vocabulary or length; beyond it a table would not fit in memory
MAX_LAYERS = 4096  # any count of layers or blocks


def _is_integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _shown(value) -> str:
    return f"{value!r} ({type(value).__name__})" if isinstance(value, str) else repr(value)


def check_size(name: str, value, *, least: int = 1, most: int = MAX_SIZE) -> int:
    """An integer (not a bool, not a float) in [least, most]; returns it as an int."""
    if not _is_integer(value):
        raise ValueError(f"{name} must be an integer >= {least}, got {_shown(value)}")
    if value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if value > most:
        raise ValueError(f"{name} must be at most {most} (the library's limit, far beyond any real model), "
                         f"got {value!r}")
    return int(value)


def check_probability(name: str, value) -> float:
    """A real number in [0, 1) (a dropout rate); returns it as a float."""
    if not _is_real(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {_shown(value)}")
    return float(value)


def check_positive_float(name: str, value) -> float:
    """A finite real number > 0 (an epsilon); returns it as a float."""
    if not _is_real(value) or not 0.0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {_shown(value)}")
    return float(value)


def check_flag(name: str, value) -> bool:
    """A bool (``"false"`` or 0.5 is not one)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {_shown(value)}")
    return bool(value)


def _count(name, value):
    return check_size(name, value, least=0, most=MAX_LAYERS)


# Constructor arguments of the model classes, by name: both packages' classes share
# names and arguments, so one table checks them all before anything is built.
CONSTRUCTOR_CHECKS = {
    **dict.fromkeys((
        "emb", "heads", "k", "seq_length", "num_tokens", "num_classes", "ff_hidden_mult",  # former
        "embed_dim", "head_dim",  # encoder
        "vocab_size", "d", "d_in", "d_out", "d_embed", "d_ff", "n_heads", "voc_size", "max_length",  # gpt
        "d_model", "d_feature", "max_len", "src_vocab_size", "tgt_vocab_size",  # classic
    ), check_size),
    **dict.fromkeys(("depth", "n_layers", "n_blocks"), _count),
    "dropout": check_probability,
    "eps": check_positive_float,
    **dict.fromkeys(("causal", "max_pool", "bias"), check_flag),
}


def check_constructor_args(owner: str, arguments: dict) -> None:
    """Check the bound constructor arguments of class ``owner`` by ``CONSTRUCTOR_CHECKS``."""
    for name, value in arguments.items():
        check = CONSTRUCTOR_CHECKS.get(name)
        if check is not None:
            check(f"{owner}: {name}", value)


def attention_variants(attention, depth: int, variants=("narrow", "wide")) -> list[str]:
    """former's ``attention`` argument: one variant for every block, or a list of one per block."""
    if isinstance(attention, str):
        attention = [attention] * depth
    elif not isinstance(attention, (list, tuple)):
        raise ValueError(f"attention must be one of {variants} or a list of them, one per block, "
                         f"got {_shown(attention)}")
    if len(attention) != depth:
        raise ValueError(f"attention lists {len(attention)} variants for depth {depth}")
    for variant in attention:
        if variant not in variants:
            raise ValueError(f"attention must be one of {variants}, got {variant!r}")
    return list(attention)


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


# Below this temperature sampling is greedy decoding (its limit): float32's smallest normal
# number. Dividing logits by a smaller (subnormal) temperature overflows, or divides by a
# zero where denormals are flushed, and gave tokens that differ from greedy.
GREEDY_BELOW = float(np.finfo(np.float32).tiny)


def is_greedy(greedy: bool, temperature) -> bool:
    """Whether to decode greedily: asked for, or a temperature too small to divide by in float32."""
    return bool(greedy) or temperature < GREEDY_BELOW


def check_generate_args(max_new_tokens, temperature, top_k, top_p, greedy, eos_id, vocab, seed=0):
    """The sampling arguments, checked before anything runs (shared with the torch twin)."""
    integer = _is_integer

    if not integer(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {_shown(max_new_tokens)}")
    for name, value in (("top_k", top_k), ("eos_id", eos_id)):
        if value is not None and not integer(value):
            raise ValueError(f"{name} must be an integer, got {_shown(value)}")
    if not integer(seed):
        raise ValueError(f"seed must be an integer, got {_shown(seed)}")
    if not isinstance(greedy, (bool, np.bool_)):
        raise ValueError(f"greedy must be True or False, got {_shown(greedy)}")
    if not _is_real(temperature) or not 0 < temperature < float("inf"):
        if not (greedy and _is_real(temperature)):
            raise ValueError(f"temperature must be > 0 and finite when sampling (or pass greedy=True), "
                             f"got {_shown(temperature)}")
    if top_p is not None and (not _is_real(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {_shown(top_p)}")
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must lie in [1, {vocab}], got {top_k!r}")
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise ValueError(f"eos_id must lie in [0, {vocab}), got {eos_id!r}")


def check_padding_mask(mask, shape, name: str) -> None:
    """A (batch, length) padding mask of exactly ``shape`` holding only 0 and 1 (or booleans)."""
    values = np.asarray(mask)
    if values.shape != tuple(shape):
        raise ValueError(f"{name} must have shape (batch, length)={tuple(shape)}, got {values.shape}")
    if not np.all((values == 0) | (values == 1)):
        raise ValueError(f"{name} must hold only 0 (pad) and 1 (token)")


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
