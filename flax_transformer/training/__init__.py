"""The training library (issue 5, in progress): optimizers so far; the train step, data and
checkpointing come next. ``train/`` holds the thin entry points."""

from .optim import OptimConfig, decay_mask, make_optimizer, schedule

__all__ = ["OptimConfig", "decay_mask", "make_optimizer", "schedule"]
from .step import cross_entropy, make_steps  # noqa: E402

__all__ += ["cross_entropy", "make_steps"]
