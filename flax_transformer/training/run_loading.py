"""A finished (or interrupted) run directory back as a model: ``load_run(RUN_DIR)``.

``run.json`` says which task wrote the run; the task rebuilds its model and tokenizer and
restores the latest intact checkpoint. ``load_model(PATH)`` reads a run directory or any
checkpoint that ``checkpoints.load`` reads, and gives the model alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flax_transformer.training.errors import RunError
from flax_transformer.training.run_checkpoints import Checkpoints
from flax_transformer.training.rundir import config_of_run, read_run_config


@dataclass(frozen=True)
class Run:
    """A run's trained model (eval mode), its tokenizer (None for seq2seq, whose digits are ids)
    and its task config."""

    task: str
    model: object
    tokenizer: object
    config: object


def load_run(run_dir, *, step: int | None = None) -> Run:
    """The model of ``run_dir``'s latest intact checkpoint (or of ``step``), with its tokenizer and config."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunError(f"{run_dir} is not a run directory (no such folder)")
    task = read_run_config(run_dir).get("task")
    if task == "classify":
        from flax_transformer.training import classify

        return Run(task, *classify.load_run(run_dir, step=step))
    if task == "lm":
        from flax_transformer.training import lm

        return Run(task, *lm.load_run(run_dir, step=step))
    if task == "seq2seq":
        from flax_transformer.training import seq2seq

        config = config_of_run(run_dir, "seq2seq", seq2seq.Seq2SeqConfig)
        checkpoints = Checkpoints(run_dir, keep=config.run.keep, read_only=True)
        try:
            model, _ = checkpoints.restore_model(seq2seq.build_model(config), step)
        finally:
            checkpoints.close()
        model.eval()
        return Run(task, model, None, config)
    raise RunError(f"{run_dir / 'run.json'} names no task this library trains (task {task!r})")


def load_model(path, **kwargs):
    """A Flax model (eval mode) from a training run directory (its latest intact checkpoint) or from
    any checkpoint ``interop.checkpoints.load`` reads (``kwargs`` go to it): what the CLI's
    ``--checkpoint`` and ``port SRC`` take. A run is the training layer's to rebuild, so
    ``checkpoints.load`` below it refuses one and names this."""
    if (Path(path) / "run.json").is_file():
        return load_run(path).model
    from flax_transformer.interop import checkpoints

    return checkpoints.load(path, **kwargs)
