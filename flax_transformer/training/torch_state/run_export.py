"""A run directory, by its path alone, as a PyTorch training checkpoint: ``to_torch``'s writing, and run directories.

    save_torch_state("ckpt.pt", model, optimizer, optim)     # a model and its nnx.Optimizer
    export_run("runs/lm", "ckpt.pt")                           # a run directory's latest checkpoint

The layout, and how optax's state maps to torch's, is ``torch_state``'s module docstring. The file
loads into ``torch_state.torch_optimizer``'s optimizer and scheduler for the torch_reference twin,
and a plain torch loop continues the run (docs/training.md shows it). An export of a JAX run also
carries its dropout streams (``"jax"``), so importing it again continues exactly as ``--resume``.

The writing itself (``torch_training_state``, ``save_torch_state``, ``check_entry_flags``, ...)
is ``to_torch``'s, below the tasks, and given here too. This module sits above the tasks:
``restore_run`` asks ``run_loading.load_run`` for the run's model (the task named in ``run.json``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from flax_transformer.interop import files, porting
from flax_transformer.training.optim import OptimConfig
from flax_transformer.training.run_loading import load_run
from flax_transformer.training.torch_state.checks import TorchStateError
from flax_transformer.training.torch_state.to_jax import import_torch_state, load_torch_state, torch_optimizer
from flax_transformer.training.torch_state.to_torch import (
    restore_checkpoint,
    run_optim,
    save_torch_state,
)

# ----------------------------------------------------------------------------- run directories


def restore_run(run_dir, *, step: int | None = None, optim: OptimConfig | None = None):
    """(model, optimizer, optim, step) of a run directory's checkpoint ``step`` (default: the latest),
    the model in train mode with its dropout streams, the optimizer as ``fit`` left it. ``optim``: the
    run's ``OptimConfig`` when the caller knows it (default: from ``run.json``, ``run_optim``)."""
    run = load_run(run_dir, step=step)
    if getattr(run.config, "freeze_encoder", False):
        raise TorchStateError(f"{run_dir} trained a linear probe on a frozen encoder: its optimizer state covers the "
                              "probe alone, and has no torch_reference twin")
    optim = optim or run_optim(run.config)
    model, optimizer, step = restore_checkpoint(run_dir, run.model, optim, step=step)
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
      Adam moments and counts again, bit for bit; its refusal (a moment that is not finite, an
      ``exp_avg_sq`` below 0, ...: ``torch_state.check_torch_state``) is the one problem listed then.
    """
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
    try:  # it checks the numbers too: a moment that is not finite, an exp_avg_sq below 0, state for no parameter
        again, again_step = import_torch_state(data, fresh, optim)
    except TorchStateError as error:
        return [*problems, f"import_torch_state refuses it: {error}"]
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
