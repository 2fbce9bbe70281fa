"""What every task config holds besides its model and data: a ``RunConfig`` and an ``OptimConfig``.

``ClassifyConfig``, ``LMConfig`` and ``Seq2SeqConfig`` each nest one of both (``config.run``,
``config.optim``) instead of copying the same fields; ``ClassifyConfig`` and ``LMConfig`` also nest
a ``LoRARunConfig`` (``config.lora``: off unless ``--lora-rank`` or ``--init-adapter`` is given). Flags and presets still name fields
flat (``--lr``, ``ClassifyConfig.tiny(steps=30)``): ``replace`` routes each name to the
config that holds it, so a field name means the same thing wherever it appears.

``run.json`` holds the nested form. One written before the nesting (flat: ``"lr": 0.001``
at the top) is read by ``nest`` into the nested form, so an old run still resumes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flax_transformer.training.config_bounds import check_config, flag
from flax_transformer.training.optim import OptimConfig, check_precision

# the sub-configs a task config nests, by field name
_NESTED = {"run": "RunConfig", "optim": "OptimConfig", "lora": "LoRARunConfig"}
_WITH_LORA = ("classify", "lm")  # the tasks whose configs nest a LoRARunConfig


@dataclass(frozen=True)
class RunConfig:
    """How long a run trains and how it is kept: the part of a task config no model sees.

    Attributes:
        batch_size: examples per optimizer update (over all devices).
        steps: optimizer updates; the classifier may leave it None and give ``epochs``.
        eval_every: evaluate every this many steps (None: the task's default).
        checkpoint_every: save every this many steps (None: 5 checkpoints per run).
        keep: how many checkpoints to keep.
        seed: parameters, dropout and the order of batches (a pure function of (seed, step)).
        dtype: compute dtype, "float32" or "bf16" (parameters and optimizer state stay float32).
        attention: "reference", "xla" or "cudnn" (see ``flax_transformer.models.attention.set_attention``).
    """

    batch_size: int = 32
    steps: int | None = None
    eval_every: int | None = None
    checkpoint_every: int | None = None
    keep: int = 3
    seed: int = 0
    dtype: str = "float32"
    attention: str = "reference"

    def __post_init__(self):
        check_config(self)
        check_precision(self.dtype, self.attention)


@dataclass(frozen=True)
class LoRARunConfig:
    """A LoRA fine-tune of a pretrained (``--model hf``) model: what ``lora.apply`` is given, or the PEFT
    adapter folder it starts from (whose ``adapter_config.json`` then decides rank, alpha, dropout, targets).

    Attributes:
        lora_rank: the adapters' rank r (None: no LoRA, unless ``init_adapter`` is given).
        lora_alpha: the scale's numerator (alpha / r); None: 2 * r.
        lora_dropout: dropout on the LoRA branch's input.
        lora_targets: module names or regexes (PEFT's ``target_modules``); None: PEFT's default for the model type.
        init_adapter: a PEFT LoRA adapter folder to start from (instead of ``lora_rank``).
    """

    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] | None = None
    init_adapter: str | None = None

    def __post_init__(self):
        if isinstance(self.lora_targets, list):  # from run.json
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        check_config(self)
        if self.init_adapter is not None:
            given = [name for name, unset in (("lora_rank", None), ("lora_alpha", None), ("lora_dropout", 0.0),
                                              ("lora_targets", None)) if getattr(self, name) != unset]
            if given:
                raise ValueError(f"--init-adapter takes rank, alpha, dropout and targets from the adapter's "
                                 f"adapter_config.json; drop {', '.join(flag(n) for n in given)}")
        elif self.lora_rank is None:
            given = [name for name, unset in (("lora_alpha", None), ("lora_dropout", 0.0), ("lora_targets", None))
                     if getattr(self, name) != unset]
            if given:
                raise ValueError(f"{', '.join(flag(n) for n in given)} set(s) up a LoRA run: give --lora-rank R too")

    @property
    def enabled(self) -> bool:
        return self.lora_rank is not None or self.init_adapter is not None


def _sub_fields() -> dict[str, str]:
    """flat field name -> the nested config holding it ("run", "optim" or "lora")."""
    out = {f.name: "run" for f in dataclasses.fields(RunConfig)}
    out.update({f.name: "lora" for f in dataclasses.fields(LoRARunConfig)})
    out.update({f.name: "optim" for f in dataclasses.fields(OptimConfig) if f.name != "total_steps"})
    return out


SUB_FIELDS = _sub_fields()


def field_names(config_cls) -> set[str]:
    """Every name ``replace`` accepts for ``config_cls``: its own fields and its sub-configs' fields."""
    own = {f.name for f in dataclasses.fields(config_cls)}
    return (own - set(_NESTED)) | {name for name, sub in SUB_FIELDS.items() if sub in own}


def replace(config, **changes):
    """``dataclasses.replace`` that also takes the nested configs' fields by their flat names:
    ``replace(config, lr=1e-3, steps=50)`` sets ``config.optim.lr`` and ``config.run.steps``."""
    own = {f.name for f in dataclasses.fields(config)}
    top, nested = {}, {}
    for name, value in changes.items():
        if name in own:
            top[name] = value
        elif SUB_FIELDS.get(name) in own:
            nested.setdefault(SUB_FIELDS[name], {})[name] = value
        else:
            raise TypeError(f"{type(config).__name__} has no field {name!r}")
    for sub, values in nested.items():
        top[sub] = dataclasses.replace(top.get(sub, getattr(config, sub)), **values)
    return dataclasses.replace(config, **top)


def nest(saved: dict) -> dict:
    """A run.json's config in the nested form; a flat one (written before the nesting) is converted.

    An old flat config had no b1, b2, eps or end_lr_ratio: its runs used ``OptimConfig``'s
    defaults, so the converted one holds those. A classify or lm config written before LoRA runs
    existed gets the default ``lora`` (no LoRA), which is what it ran with.
    """
    if "run" in saved or "optim" in saved:  # nested already
        out = dict(saved)
    else:
        out = {k: v for k, v in saved.items() if k not in SUB_FIELDS}
        run = {k: v for k, v in saved.items() if SUB_FIELDS.get(k) == "run"}
        optim = {k: v for k, v in saved.items() if SUB_FIELDS.get(k) == "optim"}
        if run:
            out["run"] = run
        if optim:
            out["optim"] = {**dataclasses.asdict(OptimConfig()), "total_steps": None, **optim}
    if out.get("task") in _WITH_LORA and "lora" not in out:
        out["lora"] = dataclasses.asdict(LoRARunConfig())
    return out


def from_dict(config_cls, saved: dict):
    """A task config from its ``dataclasses.asdict`` form (nested, or an old flat one).

    ``TypeError`` names an unknown field; the configs' own checks raise ``ValueError``.
    """
    values = nest(saved)
    classes = {"run": RunConfig, "optim": OptimConfig, "lora": LoRARunConfig}
    for sub, cls in classes.items():
        if isinstance(values.get(sub), dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(values[sub]) - known)
            if unknown:
                raise TypeError(f"{sub}: unknown field(s) {', '.join(unknown)}")
            values[sub] = cls(**values[sub])
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(config_cls)})
    if unknown:
        raise TypeError(f"unknown field(s) {', '.join(unknown)}")
    return config_cls(**values)
