"""The training package's exceptions, at its bottom: every other training module may raise them.

``RunError`` is what a run that cannot start or go on raises (a clear message; the command
line prints it in one line); the others are the kinds a caller may want to tell apart.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A run cannot start or go on: a clear message, and nothing in the run directory was lost."""


class RunDirBusy(RunError):
    """Another process holds the run directory's lock."""


class NonFiniteLoss(RunError):
    """The loss became NaN or infinite; the run stopped before saving the bad state."""
