"""What a size, a probability, an epsilon or a flag may be: the argument checks of the configs and constructors.

One place for them, used by the config dataclasses and (through ``RecordsInit``) by every constructor of
both packages, and the one input check both share (a sequence length against the position table).
Pure Python (no JAX, no torch).
"""

from __future__ import annotations

import numpy as np


def check_length(length: int, max_length: int, *, what: str = "position table") -> None:
    if length > max_length:
        raise ValueError(f"sequence length {length} exceeds the {what} size {max_length}")
    if length == 0:
        raise ValueError("sequence length must be at least 1")


MAX_SIZE = 2 ** 24  # any width, vocabulary or length; beyond it a table would not fit in memory
MAX_LAYERS = 4096  # any count of layers or blocks


def is_integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def shown(value) -> str:
    return f"{value!r} ({type(value).__name__})" if isinstance(value, str) else repr(value)


def check_size(name: str, value, *, least: int = 1, most: int = MAX_SIZE) -> int:
    """An integer (not a bool, not a float) in [least, most]; returns it as an int."""
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer >= {least}, got {shown(value)}")
    if value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if value > most:
        raise ValueError(f"{name} must be at most {most} (the library's limit, far beyond any real model), "
                         f"got {value!r}")
    return int(value)


def check_probability(name: str, value) -> float:
    """A real number in [0, 1) (a dropout rate); returns it as a float."""
    if not is_real(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {shown(value)}")
    return float(value)


def check_positive_float(name: str, value) -> float:
    """A finite real number > 0 (an epsilon); returns it as a float."""
    if not is_real(value) or not 0.0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {shown(value)}")
    return float(value)


def check_flag(name: str, value) -> bool:
    """A bool (``"false"`` or 0.5 is not one)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {shown(value)}")
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
                         f"got {shown(attention)}")
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
