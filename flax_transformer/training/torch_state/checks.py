"""A torch training checkpoint checked as numbers before anything reads it (``torch_state``'s checks).

Malformed ``param_groups`` (a setting of the wrong type, a missing one, a parameter in two groups),
state for an index no group holds, a per-parameter ``step`` that is not the checkpoint's, a moment
that is not finite or an ``exp_avg_sq`` below 0, a weight that is not finite: each is refused with
one line (``TorchStateError``) naming the entry; ``torch_state`` adds the file's name. Split from
``torch_state`` (which maps the states between the frameworks) so each stays one concern.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from flax_transformer.interop import values
from flax_transformer.training.optim import OptimConfig

# the group settings of torch's Adam/AdamW that this module reads or must see at their defaults
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
_STATE_KEYS = {"step", "exp_avg", "exp_avg_sq"}


class TorchStateError(ValueError):
    """A torch training checkpoint that cannot continue as this run (or be written); nothing was changed."""


def _numpy(value, what: str) -> np.ndarray:
    import torch

    if not isinstance(value, torch.Tensor):
        raise TorchStateError(f"{what} is a {type(value).__name__}, not a tensor")
    # a copy: JAX on CPU may keep a view of a numpy array, and torch updates its tensors in place
    return np.array(values.to_numpy(value))


def _close(a: float, b: float) -> bool:
    return math.isclose(float(a), float(b), rel_tol=1e-5, abs_tol=1e-12)


def value_problem(value, *, second_moment: bool = False) -> str | None:
    """What is wrong with the numbers of a moment or parameter (a torch tensor or an array), in words
    ("holds 2 NaN values (of 96)"), or None when they are fine: every value finite, and for an Adam
    second moment (``exp_avg_sq``, optax's ``nu``: a running mean of squared gradients) none below 0."""
    import torch

    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return f"is a {value.dtype} tensor, not floating point"
        nan, inf = int(torch.isnan(value).sum()), int(torch.isinf(value).sum())
        negative = int((value < 0).sum()) if second_moment else 0
        size = value.numel()
    else:
        value = np.asarray(value)
        if not np.issubdtype(value.dtype, np.floating) and value.dtype.name != "bfloat16":
            return f"is a {value.dtype} array, not floating point"
        as_float = value.astype(np.float32) if value.dtype.name == "bfloat16" else value
        nan, inf = int(np.isnan(as_float).sum()), int(np.isinf(as_float).sum())
        negative = int((as_float < 0).sum()) if second_moment else 0
        size = value.size
    found = [f"{count} {what}" for count, what in ((nan, "NaN"), (inf, "inf"), (negative, "negative")) if count]
    if not found:
        return None
    return f"holds {' and '.join(found)} value{'s' if nan + inf + negative > 1 else ''} (of {size})"


def _shown(value) -> str:
    """``repr(value)`` on one line, cut short (a tensor's repr spans lines)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _is_index(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _real(value):
    """``value`` as a float when it is a real number (or a one-element tensor), else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if type(value).__module__.startswith("torch") and hasattr(value, "numel") and value.numel() == 1 and not (
            value.dtype.is_complex or str(value.dtype) == "torch.bool"):
        return float(value.item())
    return None


def _check_groups(groups: list) -> None:
    """Each group a dict of Adam/AdamW settings of the right types, with a list of parameter indices
    (and, when given, as many distinct names); each index and name in one group only."""
    for i, g in enumerate(groups):
        where = f"the optimizer's param_groups[{i}]"
        if not isinstance(g, Mapping):
            raise TorchStateError(f"{where} is a {type(g).__name__}, not a parameter group (a dict)")
        if not isinstance(g.get("params"), list):
            raise TorchStateError(f"{where} has no \"params\" list (its entries are {sorted(map(str, g))})")
        odd = [p for p in g["params"] if not _is_index(p)]
        if odd:
            raise TorchStateError(f"{where}[\"params\"] holds {_shown(odd[0])}, not a parameter index (an int)")
        if "param_names" in g:
            names = g["param_names"]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise TorchStateError(f"{where}[\"param_names\"] is not a list of parameter names (str)")
            if len(names) != len(g["params"]):
                raise TorchStateError(f"the optimizer's param_names and params differ in length in param_groups[{i}] "
                                      f"({len(names)} names, {len(g['params'])} params)")
        if "amsgrad" not in g:  # only Adam and AdamW have amsgrad: another optimizer, said below
            continue
        missing = [k for k in _ADAM_KEYS if k not in g]
        if missing:
            raise TorchStateError(f"{where} has no {', '.join(repr(k) for k in missing)}: not a whole Adam/AdamW "
                                  "parameter group")
        for key, low, low_included in (("lr", 0.0, True), ("eps", 0.0, False), ("weight_decay", 0.0, True),
                                       ("initial_lr", 0.0, True)):
            if key not in g:
                continue
            value = _real(g[key])
            if value is None or not math.isfinite(value) or value < low or (value == low and not low_included):
                raise TorchStateError(f"{where}[{key!r}] is {_shown(g[key])}: it must be a finite number "
                                      f"{'>=' if low_included else '>'} {low:g}")
        betas = g["betas"]
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(_real(b) is not None and 0 <= _real(b) < 1 for b in betas)):
            raise TorchStateError(f"{where}['betas'] is {_shown(betas)}: it must be two numbers in [0, 1)")
        for key in ("amsgrad", "maximize", "decoupled_weight_decay"):
            if key in g and not isinstance(g[key], (bool, np.bool_)):
                raise TorchStateError(f"{where}[{key!r}] is {_shown(g[key])}, not True or False")
    for what in ("params", "param_names"):
        first = {}
        for i, g in enumerate(groups):
            for entry in g.get(what, []):
                if entry in first:
                    raise TorchStateError(f"the optimizer's {what} entry {_shown(entry)} is in param_groups[{first[entry]}] "
                                          f"and param_groups[{i}]: each parameter belongs to one group, once")
                first[entry] = i


def _check_moments(opt: Mapping, step: int) -> None:
    """The optimizer's state as numbers, before anything reads it: an entry for a parameter of the groups
    only, with Adam's ``step`` (a number, the checkpoint's ``step`` for every parameter, as torch's
    Adam/AdamW keep it) and its moments (floating point tensors, finite, ``exp_avg_sq`` >= 0)."""
    import torch

    groups = opt["param_groups"]
    label = {}
    for g in groups:
        names = g.get("param_names") or [None] * len(g["params"])
        for position, name in zip(g["params"], names):
            label[position] = f"state[{position}]" + (f" ({name})" if name else "")
    state = opt["state"]
    unknown = [k for k in state if not _is_index(k) or k not in label]
    if unknown:
        known = sorted(label)
        held = f"{len(known)} parameter indices, {known[0]} to {known[-1]}" if known else "no parameter"
        raise TorchStateError(f"the optimizer's state[{_shown(unknown[0])}] is for no parameter: its param_groups hold "
                              f"{held}")
    steps = {}
    for position, entry in state.items():
        if not isinstance(entry, Mapping) or set(entry) != _STATE_KEYS:
            kind = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
            raise TorchStateError(f"the optimizer's {label[position]} has {kind}, not Adam's {sorted(_STATE_KEYS)}")
        own = entry["step"]
        if isinstance(own, torch.Tensor) and own.numel() != 1:
            raise TorchStateError(f"the optimizer's {label[position]} step is a tensor of shape {tuple(own.shape)}, "
                                  "not one count (torch's Adam keeps a scalar tensor)")
        value = _real(own)
        if value is None or not math.isfinite(value) or value < 0 or not value.is_integer():
            raise TorchStateError(f"the optimizer's {label[position]} step is {_shown(own)}, not a count of updates")
        steps[position] = value
    for position, own in steps.items():
        if own != step:
            others = sorted({v for p, v in steps.items() if p != position})
            besides = f" (its other parameters: {', '.join(f'{v:g}' for v in others)})" if others else ""
            raise TorchStateError(f'the checkpoint\'s "step" is {step}, but the optimizer has taken {own:g} steps '
                                  f"for {label[position]}{besides}")
    for position, entry in state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            value = entry[key]
            if not isinstance(value, torch.Tensor):
                raise TorchStateError(f"the optimizer's {label[position]} {key} is a {type(value).__name__}, not a "
                                      "tensor")
            problem = value_problem(value, second_moment=key == "exp_avg_sq")
            if problem:
                what = "an Adam second moment is finite and >= 0" if key == "exp_avg_sq" else \
                    "an Adam first moment is finite"
                raise TorchStateError(f"the optimizer's {label[position]} {key} {problem}: {what} (a damaged file, "
                                      "or a run that diverged), so the run cannot continue from it")
        if entry["exp_avg"].shape != entry["exp_avg_sq"].shape:
            raise TorchStateError(f"the optimizer's {label[position]} exp_avg has shape {tuple(entry['exp_avg'].shape)}"
                                  f" and exp_avg_sq {tuple(entry['exp_avg_sq'].shape)}: one parameter has one shape")


def _check_weights(weights: Mapping) -> None:
    """Every floating point tensor of the ``"model"`` entry finite."""
    import torch

    for key, value in weights.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            problem = value_problem(value)
            if problem:
                raise TorchStateError(f'the "model" entry\'s {key} {problem}: the run cannot continue from it')


def lr_factor(optim: OptimConfig, step: int) -> float:
    """``optim``'s learning rate at update ``step`` (from 0) over its peak: the ``LambdaLR`` lambda of
    ``torch_optimizer``, in plain Python (``optim.schedule`` is the same curve in optax)."""
    if step < optim.warmup_steps:
        return step / optim.warmup_steps
    if optim.decay == "constant":
        return 1.0
    if optim.total_steps is None:
        raise ValueError(f"decay={optim.decay!r} needs total_steps (the run's length), got None")
    steps = optim.total_steps - optim.warmup_steps
    done = min(step - optim.warmup_steps, steps) / steps
    if optim.decay == "cosine":
        return (1 - optim.end_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done)) + optim.end_lr_ratio
    return 1.0 + (optim.end_lr_ratio - 1.0) * done


def _check_scheduler(sched, optim: OptimConfig, step: int, n_groups: int) -> None:
    constant = optim.warmup_steps == 0 and optim.decay == "constant"
    if sched is None:
        if not constant:
            raise TorchStateError('the checkpoint has no "scheduler", but the run\'s learning rate follows a schedule '
                                  f"(warmup {optim.warmup_steps}, decay {optim.decay})")
        return
    if not isinstance(sched, Mapping) or "lr_lambdas" not in sched or "last_epoch" not in sched:
        kind = sorted(sched) if isinstance(sched, Mapping) else type(sched).__name__
        raise TorchStateError(f"the scheduler is not a LambdaLR (its state has {kind}); the library represents "
                              "LambdaLR warmups and its own warmup + decay (torch_state.torch_optimizer)")
    if int(sched["last_epoch"]) != step:
        raise TorchStateError(f'the checkpoint\'s "step" is {step}, but the scheduler has taken '
                              f"{sched['last_epoch']} steps")
    for base in sched.get("base_lrs", []):
        if not _close(base, optim.lr):
            raise TorchStateError(f"the scheduler's base learning rate is {base}; the run's is {optim.lr}")
    for last in sched.get("_last_lr", []):
        if not _close(last, optim.lr * lr_factor(optim, step)):
            _refuse_finished(last, optim, step)
            raise TorchStateError(f"the scheduler's learning rate at step {step} is {last}; the run's schedule gives "
                                  f"{optim.lr * lr_factor(optim, step)}")


def _refuse_finished(lr: float, optim: OptimConfig, step: int) -> None:
    """A file whose learning rate has decayed to its end (``end_lr_ratio * lr``) where the run's schedule
    has not: a finished run given a larger ``--steps``. Say so, and how to go on."""
    if optim.decay != "constant" and step > 0 and _close(lr, optim.lr * optim.end_lr_ratio):
        raise TorchStateError(
            f"the checkpoint's learning rate is {lr} at step {step}: its run has finished its schedule (the "
            f"{optim.decay} decay ended there). A run of --steps {optim.total_steps} follows a longer schedule, "
            f"{optim.lr * lr_factor(optim, step):.3g} at step {step}, so this file cannot continue it as it is: "
            f"extend it in torch first (torch_optimizer(model, optim.from_task(config, {optim.total_steps})), a few "
            f"steps, docs/training.md: a finished run, extended in torch), then --init-from-torch the file that "
            f"writes with --steps {optim.total_steps}")


def buffer_shapes(twin) -> dict[str, tuple]:
    """{name: shape} of a torch model's persistent buffers (DeepSeek-V3's ``e_score_correction_bias``, an
    ``nnx.Param`` in Flax with no gradient): in a file's "model", never in its optimizer; their moments are
    zero (an export refuses a buffer whose are not)."""
    params = {n for n, _ in twin.named_parameters(remove_duplicate=False)}
    return {n: tuple(t.shape) for n, t in twin.state_dict().items() if n not in params}


def read_buffers(model_state: Mapping, buffers: dict) -> tuple[dict, list[str]]:
    """({name: array} of the ``buffers`` (``buffer_shapes``) a file's "model" holds, the problems: a buffer
    missing or of another shape)."""
    found, problems = {}, [f"{k} missing (a buffer)" for k in buffers if k not in model_state]
    for k in buffers.keys() & model_state.keys():
        found[k] = _numpy(model_state[k], f'"model"[{k!r}]')
        if found[k].shape != buffers[k]:
            problems.append(f"{k} has shape {found[k].shape}, the model's is {buffers[k]}")
    return found, problems
