"""A training run as a PyTorch training checkpoint, and back: Adam moments, step, schedule, decay mask.

    optimizer, step = import_torch_state("ckpt.pt", model, optim)   # fills model; optax state at step N
    to_torch.save_torch_state("ckpt.pt", model, optimizer, optim)   # the way back, the same layout

The file is the usual torch layout (``torch.save``; read with ``torch.load(weights_only=True)``)::

    {"model": model.state_dict(),           # torch_reference names and layouts
     "optimizer": optimizer.state_dict(),   # torch.optim.Adam or AdamW
     "scheduler": scheduler.state_dict(),   # LambdaLR; None or absent for a constant learning rate
     "step": N,                             # optimizer updates done
     "config": {...},                       # optional: the model's constructor arguments (JSON-like)
     "class": "gpt.GPTTransformer",         # written by the export: the family and class
     "jax": {"rng": {path: int64 tensor}}}  # written by the export: the Flax model's dropout streams

How the states map. torch's Adam keeps, per parameter, ``step`` (a float tensor), ``exp_avg``
and ``exp_avg_sq``; optax's ``scale_by_adam`` keeps ``count``, ``mu`` and ``nu`` over the
parameter tree, and ``scale_by_schedule`` its own ``count``. Both count updates from 0 and
bias-correct with the count, so after N updates torch's step = optax's counts = N, exp_avg = mu
and exp_avg_sq = nu (in torch's layouts: a Linear's moments are transposed like its weight, by
``porting``'s tables), and the next update uses ``lr * lambda(N)`` in both. LambdaLR saves no
function, so the schedule comes from the ``OptimConfig``; it is checked against the file's base
and current learning rates and the scheduler's ``last_epoch``; the decay mask, from the groups'.
Buffers (``checks.buffer_shapes``) are in "model" only.

Which optimizer entry is which parameter: torch numbers parameters by position within its
groups, so the file must say, in one of three ways:
* every group carries ``"param_names"`` (torch >= 2.6 writes them for an optimizer built from named
  parameters, ``AdamW(model.named_parameters())``, as ``torch_optimizer`` does);
* one group of ``model.parameters()`` (the notebooks' ``Adam(model.parameters())``);
* ``torch_optimizer``'s two groups without names: the parameters ``decay_mask`` decays (2-D
  projection weights), then the rest, each in ``model.parameters()`` order.

Anything else is refused (``TorchStateError``, before anything is changed), as are optimizers
other than Adam/AdamW, ``amsgrad``, ``maximize``, Adam's coupled (L2) weight decay, scheduler
types other than LambdaLR, a model or optimizer state for another model, and a step that
disagrees with the optimizer's or the scheduler's own count. The file is checked as numbers too,
before anything reads it: malformed ``param_groups`` (a setting of the wrong type, a missing
one, a parameter index or name in two groups), state for an index no group holds (``state[999]``),
a per-parameter ``step`` that is not the checkpoint's (for any parameter), a moment that is not
finite or an ``exp_avg_sq`` below 0, a weight that is not finite. Each refusal is one line naming
the file and the entry (``ckpt.pt: the optimizer's state[3] (encoder.0.weight) exp_avg_sq holds
1 inf value (of 96): ...``). ``to_torch.save_torch_state`` refuses to write such numbers.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop import porting, targets
from flax_transformer.training.optim import OptimConfig, decay_mask, make_optimizer
from flax_transformer.training.torch_state.checks import (
    _ADAM_KEYS,
    TorchStateError,
    _check_groups,
    _check_moments,
    _check_scheduler,
    _check_weights,
    _close,
    _numpy,
    _refuse_finished,
    _shown,
    buffer_shapes,
    lr_factor,
    read_buffers,
)

# ----------------------------------------------------------------------------- the torch side


def _dotted(path) -> str:
    """The dotted parameter path of a tree path (dict keys and sequence indices; attributes skipped)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
    return ".".join(parts)


def _holder(model, values):
    """A model sharing ``model``'s structure whose parameters are ``values`` (a tree like the
    parameters', or a function of each parameter): ``porting`` then gives them torch names and
    layouts both ways, through its tables, without touching ``model``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if callable(values):
        values = jax.tree_util.tree_map_with_path(values, nnx.as_pure(params))
    return nnx.merge(graphdef, values, rest)


def _flax_twin(model):
    """``model`` if it is a Flax model, else the unfilled Flax twin of a torch_reference one."""
    if type(model).__module__.startswith("torch_reference"):
        return targets.build_unfilled(porting.flax_class(model), dict(model.init_kwargs()))
    return model


def library_decayed(model) -> frozenset[str]:
    """The torch names of the parameters ``decay_mask`` decays, for a Flax or torch_reference model
    (one definition: the mask's own rule, read through the porting tables)."""
    model = _flax_twin(model)
    flags = decay_mask(nnx.state(model, nnx.Param))
    flags = {_dotted(path): flag for path, flag in jax.tree_util.tree_flatten_with_path(flags)[0]}
    holder = _holder(model, lambda path, p: np.full(p.shape, float(flags[_dotted(path)]), np.float32))
    return frozenset(k for k, v in porting.state_dict(holder).items() if np.all(v == 1.0))


def torch_optimizer(torch_model, optim: OptimConfig, *, decayed=None):
    """(optimizer, scheduler): the notebooks' torch setup that ``make_optimizer(optim)`` reproduces.

    ``torch.optim.AdamW`` (or ``Adam``) over two named groups, the decayed parameters (by default
    ``decay_mask``'s: 2-D projection weights; ``decayed`` = a set of torch names) with
    ``optim.weight_decay``, then the rest with none, each in ``model.parameters()`` order, and
    ``LambdaLR(lambda i: lr_factor(optim, i))``. Clip with ``clip_grad_norm_(model.parameters(),
    optim.clip_norm)`` before each ``optimizer.step()``, and call ``scheduler.step()`` after it.
    """
    import torch

    named = list(torch_model.named_parameters())
    if decayed is None:
        decayed = library_decayed(torch_model)
    wd = optim.weight_decay if optim.optimizer == "adamw" else 0.0
    groups = [{"params": [(n, p) for n, p in named if n in decayed], "weight_decay": wd},
              {"params": [(n, p) for n, p in named if n not in decayed], "weight_decay": 0.0}]
    cls = torch.optim.AdamW if optim.optimizer == "adamw" else torch.optim.Adam
    optimizer = cls([g for g in groups if g["params"]], lr=optim.lr, betas=(optim.b1, optim.b2), eps=optim.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(optim, i))
    return optimizer, scheduler


def _torch_twin_on_meta(model):
    """The torch_reference twin of a Flax model with no memory behind it: its parameter names, order, shapes."""
    import torch

    from flax_transformer.interop.checkpoints import build, describe

    with torch.device("meta"):
        return build(describe(model), framework="torch")


def _config_json(model) -> dict:
    from flax_transformer.interop.checkpoints import describe

    return describe(model)["init_kwargs"]


# ----------------------------------------------------------------------------- reading


def load_torch_state(source) -> dict:
    """A torch training checkpoint as a dict: ``source`` is a path, a binary file, or the dict itself.

    Read with ``torch.load(weights_only=True)``: a pickle that carries code (any object other than
    tensors and plain containers) is refused, never run.
    """
    if isinstance(source, Mapping):
        return dict(source)
    import torch

    name = source if isinstance(source, (str, Path)) else getattr(source, "name", "the checkpoint")
    if isinstance(source, (str, Path)) and not Path(source).is_file():
        raise FileNotFoundError(f"no such torch checkpoint file: {source}")
    try:
        loaded = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for a file that is not one of its own (KeyError for text)
        first = (str(error).strip().splitlines() or [""])[0][:200]
        if isinstance(error, pickle.UnpicklingError) and "global" in str(error).lower():
            raise TorchStateError(f"{name}: refused: it carries Python objects other than tensors and plain "
                                  f"containers, which would run code when unpickled (torch.load(weights_only=True): "
                                  f"{first})") from None
        raise TorchStateError(f"{name}: not a readable torch file ({type(error).__name__}: {first})") from None
    if not isinstance(loaded, Mapping):
        raise TorchStateError(f"{name} holds a {type(loaded).__name__}, not a training checkpoint (a dict with "
                              '"model", "optimizer", "scheduler" and "step")')
    return dict(loaded)


@dataclass(frozen=True)
class TorchState:
    """A torch training checkpoint checked against a model and ``OptimConfig``; torch names and layouts.

    ``params``, ``exp_avg`` and ``exp_avg_sq`` map each torch parameter name to an array of the
    parameter's torch shape; ``decayed`` holds the names of the parameters with weight decay;
    ``rng`` the Flax dropout streams an export wrote (dotted path -> int64 array), else None.
    """

    step: int
    params: dict
    exp_avg: dict
    exp_avg_sq: dict
    decayed: frozenset
    rng: dict | None


def _source_name(source) -> str | None:
    """The file a checkpoint came from, for the messages (None for a dict handed over)."""
    if isinstance(source, Mapping):
        return None
    if isinstance(source, (str, Path)):
        return str(source)
    name = getattr(source, "name", None)
    return name if isinstance(name, str) else None


@contextlib.contextmanager
def _naming(name: str | None):
    """Every refusal raised inside names the file ``name`` (once)."""
    try:
        yield
    except TorchStateError as error:
        text = str(error)
        if name is None or text.startswith((f"{name}: ", f"{name} ")):
            raise
        raise TorchStateError(f"{name}: {text}") from None


def _group_names(groups: list, torch_names: list[str], library: frozenset) -> list[list[str]]:
    """The parameter name of every position of every group (see the module docstring), or refused."""
    sizes = [len(g["params"]) for g in groups]
    if all("param_names" in g for g in groups):
        names = [list(g["param_names"]) for g in groups]
        if [len(n) for n in names] != sizes:
            raise TorchStateError("the optimizer's param_names and params differ in length")
        return names
    if len(groups) == 1 and sizes[0] == len(torch_names):
        return [list(torch_names)]
    two = [[n for n in torch_names if n in library], [n for n in torch_names if n not in library]]
    if len(groups) == 2 and sizes == [len(two[0]), len(two[1])]:
        return two
    raise TorchStateError(
        f"cannot tell which parameter each optimizer entry is: {len(groups)} group(s) of {sizes} parameters without "
        f"param_names, for a model of {len(torch_names)} parameters. Build the optimizer from named parameters "
        "(AdamW(model.named_parameters()), or torch_state.torch_optimizer) so that its state_dict names them, or use "
        "one group of model.parameters()")


def check_torch_state(source, optim: OptimConfig, *, total_steps: int | None = None) -> dict:
    """The checks that need no model: the entries, the optimizer's kind and settings, the scheduler, the
    step (below ``total_steps`` when given: a run that continues must have updates left), and the
    numbers: the optimizer's state for the groups' parameters only, every parameter at the same
    ``step``, its moments finite and ``exp_avg_sq`` >= 0, the weights finite. Returns the checkpoint
    as a dict. The entry points run it before they create anything. A refusal names the file (when
    ``source`` is one) and the entry (``state[3] (encoder.0.weight) exp_avg_sq``)."""
    with _naming(_source_name(source)):
        return _check_torch_state(load_torch_state(source), optim, total_steps)


def _check_torch_state(ckpt: dict, optim: OptimConfig, total_steps: int | None) -> dict:
    if "optimizer" not in ckpt:
        raise TorchStateError('the checkpoint has no "optimizer" entry, so it cannot continue a run (Adam moments, '
                              "step, schedule). To start from its weights alone, load them as a fresh run's initial "
                              "weights: porting.load_state_dict(model, ckpt['model']), or convert the file with "
                              "`flax-transformer port FILE.pt OUT.safetensors --family F --class C --config JSON`")
    if not isinstance(ckpt.get("model"), Mapping):
        raise TorchStateError('the checkpoint has no "model" entry (the model.state_dict())')
    step = ckpt.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise TorchStateError(f'the checkpoint\'s "step" must be a count of optimizer updates >= 0, got {_shown(step)}')
    step = int(step)
    opt = ckpt["optimizer"]
    if not isinstance(opt, Mapping) or not isinstance(opt.get("param_groups"), list) or not isinstance(
            opt.get("state"), Mapping):
        raise TorchStateError('"optimizer" is not an optimizer.state_dict() (a dict with "state" and "param_groups")')
    groups = opt["param_groups"]
    _check_groups(groups)
    for g in groups:
        if not all(k in g for k in _ADAM_KEYS):  # only Adam and AdamW have amsgrad
            others = sorted(k for k in g if k not in ("params", "param_names", "initial_lr"))
            raise TorchStateError(f"the optimizer is not torch.optim.Adam or AdamW (its group settings are "
                                  f"{', '.join(others)}): only Adam/AdamW states map to the optax chain")
        if g["amsgrad"]:
            raise TorchStateError("the optimizer uses amsgrad=True, which the optax chain (adam/adamw) does not have")
        if g.get("maximize"):
            raise TorchStateError("the optimizer uses maximize=True, which the optax chain does not have")
    # what kind of optimizer and scheduler first: it explains any difference in their numbers
    _check_scheduler(ckpt.get("scheduler"), optim, step, len(groups))
    for i, g in enumerate(groups):
        if tuple(g["betas"]) != (optim.b1, optim.b2) or not _close(g["eps"], optim.eps):
            raise TorchStateError(f"optimizer group {i} has betas={tuple(g['betas'])}, eps={g['eps']}; the run's "
                                  f"are betas=({optim.b1}, {optim.b2}), eps={optim.eps}")
        base = g.get("initial_lr", g["lr"])
        if not _close(base, optim.lr):
            raise TorchStateError(f"optimizer group {i} has the peak learning rate {base}; the run's is {optim.lr}")
        if not _close(g["lr"], optim.lr * lr_factor(optim, step)):
            _refuse_finished(g["lr"], optim, step)
            raise TorchStateError(f"optimizer group {i}'s learning rate is {g['lr']} at step {step}; the run's "
                                  f"schedule gives {optim.lr * lr_factor(optim, step)} (another warmup or decay?)")
    _check_moments(opt, step)
    _check_weights(ckpt["model"])
    if total_steps is not None and step >= total_steps:
        raise TorchStateError(f"the checkpoint is at step {step}, and the run ends at step {total_steps} (--steps is "
                              f"the run's total): nothing is left to train. A run of --steps larger than {step} "
                              "has a longer schedule, which the file must follow too (docs/training.md: a finished "
                              "run, extended in torch)")
    return ckpt


def read_torch_state(source, model, optim: OptimConfig) -> TorchState:
    """Check a torch training checkpoint against ``model`` (a flax_transformer model, only read) and
    ``optim``; every refusal of the module docstring is raised here, before anything is changed."""
    ckpt = check_torch_state(source, optim)
    with _naming(_source_name(source)):
        return _read_checked(ckpt, model, optim)


def _read_checked(ckpt: dict, model, optim: OptimConfig) -> TorchState:
    step, opt = int(ckpt["step"]), ckpt["optimizer"]
    groups = opt["param_groups"]
    if ckpt.get("config") is not None:
        ours, theirs = _config_json(model), ckpt["config"]
        if not isinstance(theirs, Mapping):
            raise TorchStateError(f'the checkpoint\'s "config" is a {type(theirs).__name__}, not constructor arguments')
        differ = [f"{k}={theirs[k]!r} (this model: {ours.get(k)!r})" for k in theirs if ours.get(k) != theirs[k]]
        if differ:
            raise TorchStateError("the checkpoint is for another model: its config has " + ", ".join(differ[:4]))
    twin = _torch_twin_on_meta(model)
    shapes = {n: tuple(p.shape) for n, p in twin.named_parameters()}
    torch_names = list(shapes)
    # a tied head is one parameter (its first key) that torch's state_dict holds under each key: the others
    by_tensor = {}  # must equal it. The twin is on the meta device: one Parameter object, no storage to compare
    for name, p in twin.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    tied = {name: tuple(group) for group in by_tensor.values() if len(group) > 1 for name in group}
    model_state = ckpt["model"]
    problems = [f"{k} missing" for k in torch_names if not any(n in model_state for n in tied.get(k, (k,)))]
    buffers = buffer_shapes(twin)
    problems += [f"{k} unexpected" for k in model_state if k not in shapes and k not in tied and k not in buffers]
    params, wrong = read_buffers(model_state, buffers)
    problems += wrong
    for k in torch_names:
        present = [n for n in tied.get(k, (k,)) if n in model_state]
        if present:
            params[k] = _numpy(model_state[present[0]], f'"model"[{present[0]!r}]')
            if params[k].shape != shapes[k]:
                problems.append(f"{present[0]} has shape {params[k].shape}, the model's is {shapes[k]}")
            for other in present[1:]:
                if not np.array_equal(_numpy(model_state[other], f'"model"[{other!r}]'), params[k]):
                    problems.append(f"{other} differs from {present[0]}, which this model ties it to")
    if problems:
        raise TorchStateError(f'the "model" entry is for another model ({type(model).__name__}): '
                              + "; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""))

    names = _group_names(groups, torch_names, library_decayed(model))
    flat = [n for group in names for n in group]
    if sorted(flat) != sorted(torch_names):
        unknown = sorted(set(flat) - set(torch_names))
        raise TorchStateError(f"the optimizer is for another model: it holds {len(flat)} parameters"
                              + (f" (unknown: {', '.join(unknown[:3])})" if unknown else "")
                              + f", the model {len(torch_names)}")

    decayed = set()
    coupled = [g for g in groups if not g.get("decoupled_weight_decay", optim.optimizer == "adamw")]
    for group, group_names in zip(groups, names):
        if group["weight_decay"] == 0:
            continue
        if coupled:
            raise TorchStateError("the optimizer is Adam with weight_decay (an L2 term added to the gradient), "
                                  "which the optax chain does not have; AdamW's decoupled decay it has")
        if optim.optimizer != "adamw" or not _close(group["weight_decay"], optim.weight_decay):
            raise TorchStateError(f"the optimizer decays weights by {group['weight_decay']}; the run's "
                                  f"{optim.optimizer} decays them by "
                                  f"{optim.weight_decay if optim.optimizer == 'adamw' else 0}")
        decayed.update(group_names)

    exp_avg, exp_avg_sq = {}, {}
    index = {p: n for group, group_names in zip(groups, names) for p, n in zip(group["params"], group_names)}
    for position, name in index.items():
        state = opt["state"].get(position)
        if state is None and step == 0:
            exp_avg[name] = exp_avg_sq[name] = np.zeros(shapes[name], np.float32)
            continue
        if state is None:
            raise TorchStateError(f"the optimizer has no state for {name} after {step} steps (a parameter that got "
                                  "no gradient): the optax chain updates every parameter")
        # its entries, step and values were checked (check_torch_state: _check_moments)
        for key, out in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            out[name] = _numpy(state[key], f"the optimizer's {key} of {name}")
            if out[name].shape != shapes[name]:
                raise TorchStateError(f"the optimizer is for another model: {key} of {name} has shape "
                                      f"{out[name].shape}, the parameter {shapes[name]}")

    for name, shape in buffers.items():  # outside torch's optimizer; the Flax twin's parameter gets no gradient,
        exp_avg[name] = exp_avg_sq[name] = np.zeros(shape, np.float32)  # so its optax moments are zero
    rng = (ckpt.get("jax") or {}).get("rng") if isinstance(ckpt.get("jax"), Mapping) else None
    if rng is not None:
        rng = {k: _numpy(v, f"the dropout stream {k}").astype(np.int64) for k, v in rng.items()}
    return TorchState(step, params, exp_avg, exp_avg_sq, frozenset(decayed), rng)


# ----------------------------------------------------------------------------- the optax side


def _field_and_param(path) -> tuple[str | None, str]:
    """(namedtuple field, dotted parameter path after it) of a leaf of an optax state."""
    for i, key in enumerate(path):
        if isinstance(key, jax.tree_util.GetAttrKey):
            return key.name, _dotted(path[i + 1:])
    return None, ""


def _to_flax_tree(model, arrays: dict) -> dict:
    """{dotted Flax path: array in Flax layout} of torch-named arrays (``porting.load_state_dict``)."""
    holder = _holder(model, lambda path, p: np.zeros(p.shape, np.float32))  # numpy: no compilation per shape
    porting.load_state_dict(holder, arrays, strict=True)
    return {_dotted(path): leaf for path, leaf in
            jax.tree_util.tree_flatten_with_path(nnx.as_pure(nnx.state(holder, nnx.Param)))[0]}


def import_torch_state(source, model, optim: OptimConfig, *, tx=None, optimizer: nnx.Optimizer | None = None
                       ) -> tuple[nnx.Optimizer, int]:
    """Continue a torch training checkpoint in JAX: ``(optimizer, step)``.

    Args:
        source: a ``.pt`` path, binary file or dict with the module docstring's layout.
        model: the flax_transformer model to continue (built with the checkpoint's constructor
            arguments; dropout streams from ``nnx.Rngs``); its parameters are replaced.
        optim: the run's ``OptimConfig``: the schedule (checked against the file), betas, eps,
            clipping.
        tx: the chain to continue with, ``make_optimizer(optim)`` built once for several runs (their
            compiled train step is shared); then the file's groups must decay what ``decay_mask``
            decays. Default: ``make_optimizer(optim, mask=<the file's decayed parameters>)``.
        optimizer: instead, an ``nnx.Optimizer`` over ``model`` and ``make_optimizer(optim)`` to fill
            in place (``fit`` does: the run's own optimizer continues).

    Returns:
        An ``nnx.Optimizer`` over ``make_optimizer(optim, mask=<the file's decayed parameters>)``
        whose Adam moments, counts and ``step`` are the file's (fp32, the parameters' dtype), and
        the step N. Train it with ``make_steps``' step: update N+1 uses ``lr * lr_factor(optim, N)``.
    """
    with _naming(_source_name(source)):
        return _import_checked(read_torch_state(source, model, optim), model, optim, tx=tx, optimizer=optimizer)


def _import_checked(state: TorchState, model, optim: OptimConfig, *, tx, optimizer) -> tuple[nnx.Optimizer, int]:
    flax_of = {"mu": _to_flax_tree(model, state.exp_avg), "nu": _to_flax_tree(model, state.exp_avg_sq)}
    flags = _to_flax_tree(model, {k: np.full(v.shape, float(k in state.decayed), np.float32)
                                  for k, v in state.params.items()})
    decayed = frozenset(path for path, flag in flags.items() if bool(np.all(np.asarray(flag) == 1.0)))
    rng_vars = _rng_variables(model)
    if state.rng is not None and set(state.rng) != set(rng_vars):
        raise TorchStateError("the checkpoint's dropout streams (\"jax\" entry) are for another model: "
                              f"{sorted(state.rng)[:3]} vs {sorted(rng_vars)[:3]}")
    same = state.decayed == library_decayed(model) or optim.optimizer == "adam"
    if (tx is not None or optimizer is not None) and not same:
        raise TorchStateError("the checkpoint's optimizer decays other parameters than the library's chain (decay_mask: "
                              "2-D projection weights only), which the training entry points run; continue it in "
                              "your own loop with import_torch_state(FILE, model, optim), whose chain follows the file")
    # everything that can refuse runs before the first write: the dropout streams' values, the chain's state
    rng_values = {}
    for path, variable in (rng_vars.items() if state.rng is not None else ()):
        value = state.rng[path]
        try:
            if isinstance(variable, nnx.RngKey):
                rng_values[path] = jax.random.wrap_key_data(jnp.asarray(value, jnp.uint32),
                                                            impl=jax.random.key_impl(variable.get_value()))
            else:
                rng_values[path] = jnp.asarray(value, variable.get_value().dtype)
        except (TypeError, ValueError) as error:
            raise TorchStateError(f"the checkpoint's dropout stream {path} does not fit the model: {error}") from None
        if rng_values[path].shape != variable.get_value().shape:
            raise TorchStateError(f"the checkpoint's dropout stream {path} has shape {rng_values[path].shape}, the "
                                  f"model's {variable.get_value().shape}")

    def mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: _dotted(path) in decayed, params)

    if optimizer is None:
        optimizer = nnx.Optimizer(model, tx or make_optimizer(optim, mask=None if same else mask), wrt=nnx.Param)

    def fill(path, leaf):
        field, param = _field_and_param(path)
        if field == "count":
            return jnp.asarray(state.step, leaf.dtype)
        if field in ("mu", "nu"):
            return jnp.asarray(flax_of[field][param], leaf.dtype)
        raise TorchStateError(f"the optax chain has state the torch optimizer does not: {field} at {param}")

    pure = jax.tree_util.tree_map_with_path(fill, nnx.as_pure(optimizer.opt_state))
    porting.load_state_dict(model, state.params, strict=True)  # checks everything, then writes
    for path, value in rng_values.items():
        rng_vars[path].set_value(value)
    nnx.update(optimizer.opt_state, nnx.state(pure))
    optimizer.step[...] = state.step
    return optimizer, state.step


def _rng_variables(model) -> dict:
    """{dotted path: RngKey/RngCount variable} of a model's dropout streams."""
    return {".".join(str(p) for p in path): v for path, v in nnx.iter_graph(model)
            if isinstance(v, (nnx.RngKey, nnx.RngCount))}
