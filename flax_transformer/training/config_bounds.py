"""Bounds on the task configs' fields (``BOUNDS``), checked before anything runs: ``check_config``.

``check_config(config)`` (each task config, ``RunConfig`` and ``OptimConfig`` call it in
``__post_init__``) refuses a field of the wrong type or out of range with a ``ValueError``
naming its flag: ``--steps 0``, ``--batch-size 0``, ``--lr -1``, ``--lr nan``,
``--max-digits 10000``, a ``run.json`` edited to ``"steps": "10"``. It imports no config
(and nothing else of this package): the configs import it.
"""

from __future__ import annotations

import dataclasses
import math

BIG = 10**9
# field: (lowest, highest, lowest excluded): the same wherever a task config has the field
BOUNDS = {
    "steps": (1, BIG, False), "epochs": (0, 1e6, True), "batch_size": (1, 1 << 16, False),
    "lr": (0, 1e3, True), "warmup_steps": (0, BIG, False), "weight_decay": (0, 1e3, False),
    "clip_norm": (0, 1e9, True), "dropout": (0, 1, False), "eval_every": (1, BIG, False),
    "checkpoint_every": (1, BIG, False), "keep": (1, 1000, False), "seed": (0, 2**31 - 2, False),
    # sizes that decide the memory a step needs
    "max_digits": (1, 1024, False), "min_digits": (1, 1024, False), "context": (1, 1 << 16, False),
    "max_length": (1, 1 << 16, False), "buckets": (1, 16, False), "vocab_size": (1, 1 << 22, False),
    "n_layers": (1, 1024, False), "n_blocks": (1, 1024, False), "depth": (1, 1024, False),
    "d_embed": (1, 1 << 16, False), "d_model": (1, 1 << 16, False), "emb": (1, 1 << 16, False),
    "d_ff": (1, 1 << 18, False), "ff_mult": (1, 64, False), "heads": (1, 1024, False),
    "kv_heads": (1, 1024, False), "experts": (1, 1024, False), "experts_per_token": (1, 1024, False),
    "num_classes": (2, 1 << 16, False), "eval_size": (1, 1 << 20, False), "eval_batches": (1, 1 << 20, False),
    "train_limit": (1, BIG, False), "test_limit": (1, BIG, False), "val_size": (1, BIG, False),
    "sample_tokens": (1, 1 << 20, False), "temperature": (0, 1e6, False), "top_k": (1, 1 << 22, False),
    "val_fraction": (0, 1, True),
    # the optimizer's (config.optim)
    "b1": (0, 1, False), "b2": (0, 1, False), "eps": (0, 1, True), "end_lr_ratio": (0, 1, False),
    "total_steps": (1, BIG, False),
    # a LoRA run's (config.lora)
    "lora_rank": (1, 1 << 16, False), "lora_alpha": (0, 1e6, True), "lora_dropout": (0, 1, False),
}
# at most, not included (dropout 1 would drop everything)
_BELOW = {"dropout": 1.0, "lora_dropout": 1.0, "val_fraction": 1.0, "b1": 1.0, "b2": 1.0}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _types(annotation: str) -> tuple[set[str], bool]:
    """("int | None") -> ({"int"}, True)."""
    names = {part.strip() for part in str(annotation).split("|")}
    return names - {"None"}, "None" in names


def _check_type(name: str, value, annotation) -> None:
    kinds, optional = _types(annotation)
    if value is None:
        if not optional:
            raise ValueError(f"{flag(name)} must be given (got null)")
        return
    if "tuple[str, ...]" in kinds:  # a list of names (--lora-targets): non-empty strings, at least one
        if not (isinstance(value, tuple) and value and all(isinstance(v, str) and v for v in value)):
            raise ValueError(f"{flag(name)} must be one or more non-empty names, got {value!r}")
        return
    ok = ((isinstance(value, bool) and "bool" in kinds)
          or (not isinstance(value, bool) and isinstance(value, int) and kinds & {"int", "float"})
          or (isinstance(value, float) and "float" in kinds)
          or (isinstance(value, str) and "str" in kinds))
    if not ok:
        raise ValueError(f"{flag(name)} must be {' or '.join(sorted(kinds))}, got {value!r}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeError:
            raise ValueError(f"{flag(name)} {ascii(value)} is not UTF-8 text") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{flag(name)} must be a finite number, got {value!r}")


def _number(x) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def check_config(config) -> None:
    """``ValueError`` naming the flag of the first field of ``config`` (a task dataclass, with its
    nested ``run`` and ``optim`` configs) of the wrong type or outside ``BOUNDS``."""
    hints = {f.name: f.type for f in dataclasses.fields(config)}
    for name, annotation in hints.items():
        value = getattr(config, name)
        if dataclasses.is_dataclass(value):
            check_config(value)
            continue
        _check_type(name, value, annotation if isinstance(annotation, str)
                    else getattr(annotation, "__name__", None) or str(annotation))
        if name not in BOUNDS or value is None or isinstance(value, bool):
            continue
        low, high, open_low = BOUNDS[name]
        high_open = name in _BELOW
        if value < low or (open_low and value == low) or value > high or (high_open and value == high):
            span = (f"{'above' if open_low else 'at least'} {_number(low)} and {'below' if high_open else 'at most'} "
                    f"{_number(high)}")
            raise ValueError(f"{flag(name)} must be {span}, got {value!r}")
