"""A JAX model and its optimizer as a PyTorch training checkpoint: the way back of ``torch_state``.

    save_torch_state("ckpt.pt", model, optimizer, optim)          # a model and its nnx.Optimizer
    export_checkpoint(run_dir, "ckpt.pt", model, optim)             # a run's checkpoint, into a built model

The layout, and how optax's state maps to torch's, is ``torch_state``'s module docstring. The file
loads into ``torch_state.torch_optimizer``'s optimizer and scheduler for the torch_reference twin,
and a plain torch loop continues the run (docs/training.md shows it). An export of a JAX run also
carries its dropout streams (``"jax"``), so importing it again continues exactly as ``--resume``.

This module sits below the tasks (``classify``, ``lm``, ``seq2seq``), which export their run at
its end with ``export_checkpoint`` and check their flags with ``check_entry_flags``; a run
directory by its path alone (``export_run``, ``restore_run``: the task found in ``run.json``)
is ``run_export``'s, above the tasks.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from flax_transformer.interop import files, porting
from flax_transformer.training.optim import OptimConfig, from_task, make_optimizer
from flax_transformer.training.preflight import check_output
from flax_transformer.training.run_checkpoints import Checkpoints
from flax_transformer.training.torch_state.checks import TorchStateError, buffer_shapes, lr_factor, value_problem
from flax_transformer.training.torch_state.to_jax import (
    _config_json,
    _dotted,
    _field_and_param,
    _holder,
    _rng_variables,
    _torch_twin_on_meta,
    check_torch_state,
    torch_optimizer,
)

# ----------------------------------------------------------------------------- writing


def torch_training_state(model, optimizer: nnx.Optimizer, optim: OptimConfig, *, decayed=None) -> dict:
    """The torch training checkpoint of a JAX run (the module docstring's layout), as torch tensors.

    ``optimizer`` runs ``make_optimizer(optim)`` over ``model``'s parameters (float32); ``decayed``
    (torch names) says which parameters its weight decay covers when its mask is not
    ``decay_mask``. The dict loads into ``torch_optimizer``'s optimizer and scheduler for the
    torch_reference twin: ``optimizer.load_state_dict(ckpt["optimizer"])`` etc. A parameter or moment
    that is not finite, or an ``exp_avg_sq`` below 0, is refused (``TorchStateError`` naming it).
    """
    import torch

    family = porting.family_of(model)
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
    buffers = list(buffer_shapes(twin))
    try:
        moments = {field: porting.state_dict(_holder(model, lambda path, p, f=field: flat[f][_dotted(path)]))
                   for field in flat}
    except KeyError as missing:
        raise TorchStateError(f"the optimizer has no Adam moments for {missing}: not this model's optimizer") from None
    # numbers torch's Adam cannot continue from are not written (an import would refuse them: torch_state)
    for n in names:
        for what, values, second in ((f"the parameter {n}", weights[n], False),
                                     (f"the optimizer's exp_avg of {n}", moments["mu"][n], False),
                                     (f"the optimizer's exp_avg_sq of {n}", moments["nu"][n], True)):
            problem = value_problem(values, second_moment=second)
            if problem:
                raise TorchStateError(f"{what} {problem} at step {step}: a torch training checkpoint is not written "
                                      "with it (the run diverged, or its state was damaged)")
    for n in buffers:  # DeepSeek-V3's e_score_correction_bias: a torch buffer, which no optimizer updates
        problem = value_problem(weights[n])
        if problem:
            raise TorchStateError(f"the buffer {n} {problem} at step {step}: a torch training checkpoint is not "
                                  "written with it")
        if np.any(moments["mu"][n]) or np.any(moments["nu"][n]):
            raise TorchStateError(f"{n} is a buffer in torch, outside its optimizer, but its Adam moments here are not "
                                  f"zero at step {step}: it was trained, and torch's Adam cannot continue it")
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
    return {"model": {n: torch.from_numpy(np.array(weights[n])) for n in (*names, *buffers)}, "optimizer": opt_sd, "scheduler": sched_sd,
            "step": step, "config": _config_json(model), "class": f"{family}.{type(model).__name__}",
            "jax": {"rng": rng}}


def save_torch_state(path, model, optimizer: nnx.Optimizer, optim: OptimConfig, *, decayed=None,
                     overwrite: bool = False) -> Path:
    """Write ``torch_training_state`` to ``path`` (``.pt``): the target is checked first, the file
    written whole and swapped in (``files``)."""
    files.check_target(path, kind="file", overwrite=overwrite)
    state = torch_training_state(model, optimizer, optim, decayed=decayed)
    return files.write_file(path, lambda tmp: files.save_torch_file(state, tmp), overwrite=overwrite)


def run_optim(config) -> OptimConfig:
    """The ``OptimConfig`` a task config's run trains with (its schedule needs the run's length)."""
    steps = config.run.steps
    if steps is None:
        raise TorchStateError("the run's length was set by --epochs, so its schedule depends on its data: give the "
                              "run a --steps to use a torch training checkpoint with it")
    return from_task(config, steps)


# ----------------------------------------------------------------------------- a run's checkpoint


def restore_checkpoint(run_dir, model, optim: OptimConfig, *, step: int | None = None):
    """(model, optimizer, step): ``model`` (built as the run built it; its values do not matter) filled
    with the run's checkpoint ``step`` (default: the latest), in train mode with its dropout streams,
    and an optimizer over it as ``fit`` left it at that step."""
    model.train()
    optimizer = nnx.Optimizer(model, make_optimizer(optim), wrt=nnx.Param)
    model_state, opt_state = nnx.state(model), nnx.state(optimizer)
    checkpoints = Checkpoints(run_dir, read_only=True)
    try:
        like = {"model": nnx.to_pure_dict(model_state), "optimizer": nnx.to_pure_dict(opt_state)}
        if step is None:  # the newest, listed again if a run still training removes it meanwhile
            step, restored, _ = checkpoints.restore_newest(like)
        else:
            restored, _ = checkpoints.restore(step, like)
    finally:
        checkpoints.close()
    nnx.replace_by_pure_dict(model_state, restored["model"])
    nnx.replace_by_pure_dict(opt_state, restored["optimizer"])
    nnx.update(model, model_state)
    nnx.update(optimizer, opt_state)
    return model, optimizer, step


def export_checkpoint(run_dir, path, model, optim: OptimConfig, *, step: int | None = None,
                      overwrite: bool = False) -> Path:
    """Write the run's checkpoint ``step`` (default: the latest) as a torch training checkpoint,
    ``model`` being the run's model (``restore_checkpoint``); the target is checked first. What a
    task's ``--export-torch-state`` writes at the end of its run."""
    files.check_target(path, kind="file", overwrite=overwrite)
    model, optimizer, _ = restore_checkpoint(run_dir, model, optim, step=step)
    return save_torch_state(path, model, optimizer, optim, overwrite=overwrite)


# ----------------------------------------------------------------------------- the entry points' flags


def check_entry_flags(config, *, init_from_torch=None, export_torch_state=None, overwrite: bool = False,
                      resume: bool = False) -> None:
    """``--init-from-torch FILE.pt`` and ``--export-torch-state FILE.pt``, checked before a run creates
    anything: the file is read (``weights_only``) and checked against the run's optimizer and schedule
    (``torch_state.check_torch_state``: kind, settings, step, updates left before ``--steps``); the
    export target must be writable. The checks that need the model run when ``fit`` starts, where a
    refusal removes the new run directory (as any failure before a run's first checkpoint)."""
    if getattr(config, "freeze_encoder", False) and (init_from_torch or export_torch_state):
        raise TorchStateError("--freeze-encoder trains a linear probe on cached features, which has no torch_reference "
                              "twin: --init-from-torch and --export-torch-state take a run that trains the model")
    if init_from_torch is not None:
        if resume:
            raise TorchStateError("--init-from-torch starts a new run from a torch training checkpoint; --resume "
                                  "continues a run from its own checkpoints: give one of them")
        check_torch_state(init_from_torch, run_optim(config), total_steps=config.run.steps)
    check_output(export_torch_state, kind="file", overwrite=overwrite, flag="--export-torch-state")
