"""The training library (issue 5, in progress): the optax chain, the jitted train/eval steps, the
dataset readers and the tokenizers so far; bucketing, checkpointing and the run loop come next.
``train/`` holds the thin entry points."""

from .optim import OptimConfig, decay_mask, make_optimizer, schedule

__all__ = ["OptimConfig", "decay_mask", "make_optimizer", "schedule"]
from .step import cross_entropy, make_steps  # noqa: E402

__all__ += ["cross_entropy", "make_steps"]
