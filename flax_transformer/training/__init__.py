"""The training library: the optax chain, the jitted steps, the data readers and tokenizers,
length-bucketed batches, and the run loop (orbax checkpoints, exact resume, logs, curves).

The tasks (``classify``, ``lm``, ``seq2seq``) are library modules with frozen configs and
presets and a ``train_and_evaluate(config, run_dir)``; ``train/`` holds their thin
command-line entry points.
"""

from flax_transformer.training.batching import Bucketed, Windows, default_buckets
from flax_transformer.training.loop import (
                   Checkpoints,
                   FitResult,
                   NonFiniteLoss,
                   RunError,
                   batch_evaluator,
                   create_run_dir,
                   fit,
                   plot_curves,
                   prepare_run_dir,
)
from flax_transformer.training.optim import OptimConfig, decay_mask, make_optimizer, schedule
from flax_transformer.training.step import cross_entropy, make_steps

__all__ = ["Bucketed", "Windows", "default_buckets", "Checkpoints", "FitResult", "NonFiniteLoss", "RunError",
           "batch_evaluator", "create_run_dir", "fit", "plot_curves", "prepare_run_dir", "OptimConfig", "decay_mask", "make_optimizer",
           "schedule", "cross_entropy", "make_steps"]
