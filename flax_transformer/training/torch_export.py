"""A JAX run as a PyTorch training checkpoint: the way back of ``torch_state``, and run directories.

    save_torch_state("ckpt.pt", model, optimizer, optim)     # a model and its nnx.Optimizer
    export_run("runs/lm", "ckpt.pt")                           # a run directory's latest checkpoint

The layout, and how optax's state maps to torch's, is ``torch_state``'s module docstring. The file
loads into ``torch_state.torch_optimizer``'s optimizer and scheduler for the torch_reference twin,
and a plain torch loop continues the run (docs/training.md shows it). An export of a JAX run also
carries its dropout streams (``"jax"``), so importing it again continues exactly as ``--resume``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from flax_transformer.interop import files, porting
from flax_transformer.training.optim import OptimConfig
from flax_transformer.training.torch_state import (
    TorchStateError,
    _config_json,
    _dotted,
    _field_and_param,
    _holder,
    _rng_variables,
    _torch_twin_on_meta,
    lr_factor,
    torch_optimizer,
)

# ----------------------------------------------------------------------------- writing


def torch_training_state(model, optimizer: nnx.Optimizer, optim: OptimConfig, *, decayed=None) -> dict:
    """The torch training checkpoint of a JAX run (the module docstring's layout), as torch tensors.

    ``optimizer`` runs ``make_optimizer(optim)`` over ``model``'s parameters (float32); ``decayed``
    (torch names) says which parameters its weight decay covers when its mask is not
    ``decay_mask``. The dict loads into ``torch_optimizer``'s optimizer and scheduler for the
    torch_reference twin: ``optimizer.load_state_dict(ckpt["optimizer"])`` etc.
    """
    import torch

    family = porting._family(model)
    step = int(optimizer.step[...])
    flat: dict[str, dict] = {"mu": {}, "nu": {}}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.as_pure(optimizer.opt_state))[0]:
        field, param = _field_and_param(path)
        if field == "count":
            if int(leaf) != step:
                raise TorchStateError(f"the optimizer's update count {int(leaf)} differs from its step {step}")
        elif field in ("mu", "nu"):
            flat[field][param] = leaf
        else:
            raise TorchStateError(f"the optax state holds {field} at {param}, which torch's Adam has not: only "
                                  "make_optimizer's chain (clipping, adam/adamw, schedule) can be written")
    weights = porting.state_dict(model)
    odd = sorted({str(v.dtype) for v in weights.values()} - {"float32"})
    if odd:
        raise TorchStateError(f"the parameters are {', '.join(odd)}; a torch training checkpoint is written from "
                              "float32 parameters (bf16 runs keep float32 parameters: --dtype bf16)")
    twin = _torch_twin_on_meta(model)
    names = [n for n, _ in twin.named_parameters()]
    try:
        moments = {field: porting.state_dict(_holder(model, lambda path, p, f=field: flat[f][_dotted(path)]))
                   for field in flat}
    except KeyError as missing:
        raise TorchStateError(f"the optimizer has no Adam moments for {missing}: not this model's optimizer") from None
    torch_opt, sched = torch_optimizer(twin, optim, decayed=decayed)
    lr = optim.lr * lr_factor(optim, step)
    opt_sd = torch_opt.state_dict()
    for group in opt_sd["param_groups"]:
        group["lr"] = lr
    position = {n: i for g in opt_sd["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    opt_sd["state"] = {position[n]: {"step": torch.tensor(float(step)),
                                     "exp_avg": torch.from_numpy(np.array(moments["mu"][n])),
                                     "exp_avg_sq": torch.from_numpy(np.array(moments["nu"][n]))}
                       for n in names} if step else {}
    sched_sd = copy.deepcopy(sched.state_dict())
    sched_sd.update(last_epoch=step, _step_count=step + 1, _last_lr=[lr] * len(opt_sd["param_groups"]))
    rng = {path: torch.from_numpy(np.asarray(jax.random.key_data(v.get_value()) if isinstance(v, nnx.RngKey)
                                             else v.get_value()).astype(np.int64))
           for path, v in _rng_variables(model).items()}
    return {"model": {n: torch.from_numpy(np.array(weights[n])) for n in names}, "optimizer": opt_sd, "scheduler": sched_sd,
            "step": step, "config": _config_json(model), "class": f"{family}.{type(model).__name__}",
            "jax": {"rng": rng}}


def save_torch_state(path, model, optimizer: nnx.Optimizer, optim: OptimConfig, *, decayed=None,
                     overwrite: bool = False) -> Path:
    """Write ``torch_training_state`` to ``path`` (``.pt``): the target is checked first, the file
    written whole and swapped in (``files``)."""
    files.check_target(path, kind="file", overwrite=overwrite)
    state = torch_training_state(model, optimizer, optim, decayed=decayed)
    return files.write_file(path, lambda tmp: files.save_torch_file(state, tmp), overwrite=overwrite)


# ----------------------------------------------------------------------------- run directories


def run_optim(config) -> OptimConfig:
    """The ``OptimConfig`` a task config's run trains with (its schedule needs the run's length)."""
    from flax_transformer.training.optim import from_task

    steps = config.run.steps
    if steps is None:
        raise TorchStateError("the run's length was set by --epochs, so its schedule depends on its data: give the "
                              "run a --steps to use a torch training checkpoint with it")
    return from_task(config, steps)


def restore_run(run_dir, *, step: int | None = None, optim: OptimConfig | None = None):
    """(model, optimizer, optim, step) of a run directory's checkpoint ``step`` (default: the latest),
    the model in train mode with its dropout streams, the optimizer as ``fit`` left it. ``optim``: the
    run's ``OptimConfig`` when the caller knows it (default: from ``run.json``, ``run_optim``)."""
    from flax_transformer.training.checkpointing import Checkpoints
    from flax_transformer.training.optim import make_optimizer
    from flax_transformer.training.runs import load_run

    run = load_run(run_dir, step=step)
    if getattr(run.config, "freeze_encoder", False):
        raise TorchStateError(f"{run_dir} trained a linear probe on a frozen encoder: its optimizer state covers the "
                              "probe alone, and has no torch_reference twin")
    optim = optim or run_optim(run.config)
    model = run.model
    model.train()
    optimizer = nnx.Optimizer(model, make_optimizer(optim), wrt=nnx.Param)
    model_state, opt_state = nnx.state(model), nnx.state(optimizer)
    checkpoints = Checkpoints(run_dir, read_only=True)
    try:
        step = checkpoints.latest() if step is None else step
        restored, _ = checkpoints.restore(step, {"model": nnx.to_pure_dict(model_state),
                                                 "optimizer": nnx.to_pure_dict(opt_state)})
    finally:
        checkpoints.close()
    nnx.replace_by_pure_dict(model_state, restored["model"])
    nnx.replace_by_pure_dict(opt_state, restored["optimizer"])
    nnx.update(model, model_state)
    nnx.update(optimizer, opt_state)
    return model, optimizer, optim, step


def export_run(run_dir, path, *, step: int | None = None, optim: OptimConfig | None = None,
               overwrite: bool = False) -> Path:
    """Write a run directory's checkpoint ``step`` (default: the latest) as a torch training checkpoint
    (``flax-transformer port RUN_DIR FILE.pt --to torch-state``); the target is checked first."""
    files.check_target(path, kind="file", overwrite=overwrite)
    model, optimizer, optim, _ = restore_run(run_dir, step=step, optim=optim)
    return save_torch_state(path, model, optimizer, optim, overwrite=overwrite)


def check_export(run_dir, path, *, step: int | None = None) -> list[str]:
    """Read a torch training checkpoint written from ``run_dir`` back both ways and list what differs
    (``port ... --to torch-state --verify``; an empty list means it checks out):

    * torch: the torch_reference twin, ``torch_optimizer``'s AdamW/Adam and ``LambdaLR`` load it
      with their own ``load_state_dict`` (what a plain torch loop does);
    * JAX: ``import_torch_state`` into a second copy of the run's model gives the run's parameters,
      Adam moments and counts again, bit for bit.
    """
    from flax_transformer.training.torch_state import import_torch_state, load_torch_state

    model, optimizer, optim, step = restore_run(run_dir, step=step)
    data = load_torch_state(path)
    problems = []
    twin = porting.flax_to_torch(model)
    torch_opt, torch_sched = torch_optimizer(twin, optim)
    for what, target, value in (("model", twin, data.get("model")), ("optimizer", torch_opt, data.get("optimizer")),
                                ("scheduler", torch_sched, data.get("scheduler"))):
        try:
            target.load_state_dict(value)
        except Exception as error:  # torch raises RuntimeError, ValueError, KeyError, TypeError
            problems.append(f"torch's {type(target).__name__}.load_state_dict refuses its {what!r}: "
                            f"{str(error).splitlines()[0][:200]}")
    fresh, _, _, _ = restore_run(run_dir, step=step)
    again, again_step = import_torch_state(data, fresh, optim)
    if again_step != step:
        problems.append(f"the file continues at step {again_step}, the run's checkpoint is step {step}")
    pairs = (("parameter", nnx.state(model, nnx.Param), nnx.state(fresh, nnx.Param)),
             ("optimizer state", nnx.state(optimizer.opt_state), nnx.state(again.opt_state)))
    for what, want, got in pairs:
        want, got = nnx.to_flat_state(want), nnx.to_flat_state(got)
        want = {"/".join(map(str, k)): v for k, v in want}
        got = {"/".join(map(str, k)): v for k, v in got}
        if want.keys() != got.keys():
            problems.append(f"{what}: other entries after the round trip: {sorted(set(want) ^ set(got))[:3]}")
            continue
        for key in want:
            a, b = np.asarray(want[key].get_value()), np.asarray(got[key].get_value())
            if a.shape != b.shape or not np.array_equal(a, b):
                problems.append(f"{what} {key} differs after the round trip")
    return problems


# ----------------------------------------------------------------------------- the entry points' flags


def check_entry_flags(config, *, init_from_torch=None, export_torch_state=None, overwrite: bool = False,
                      resume: bool = False) -> None:
    """``--init-from-torch FILE.pt`` and ``--export-torch-state FILE.pt``, checked before a run creates
    anything: the file is read (``weights_only``) and checked against the run's optimizer and schedule
    (``torch_state.check_torch_state``: kind, settings, step, updates left before ``--steps``); the
    export target must be writable. The checks that need the model run when ``fit`` starts, where a
    refusal removes the new run directory (as any failure before a run's first checkpoint)."""
    from flax_transformer.training.limits import check_output
    from flax_transformer.training.torch_state import check_torch_state

    if getattr(config, "freeze_encoder", False) and (init_from_torch or export_torch_state):
        raise TorchStateError("--freeze-encoder trains a linear probe on cached features, which has no torch_reference "
                              "twin: --init-from-torch and --export-torch-state take a run that trains the model")
    if init_from_torch is not None:
        if resume:
            raise TorchStateError("--init-from-torch starts a new run from a torch training checkpoint; --resume "
                                  "continues a run from its own checkpoints: give one of them")
        check_torch_state(init_from_torch, run_optim(config), total_steps=config.run.steps)
    check_output(export_torch_state, kind="file", overwrite=overwrite, flag="--export-torch-state")
