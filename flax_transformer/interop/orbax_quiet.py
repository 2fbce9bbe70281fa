"""orbax's stray output, kept off stderr in one place.

A failed orbax save or restore (a full disk, a corrupt checkpoint) raises an exception that the
library reports itself, as one clear line. Around it orbax makes noise on three channels:

* absl logs a traceback at level ERROR (and warnings at other times): ``quiet_absl``;
* the writes still in flight in tensorstore's threads fail after the exception, and print their
  errors (with a spec of the array) straight to file descriptor 2, from C++ where Python cannot
  see them; their futures then fail into orbax's asyncio loop, already closed, and each prints a
  "RuntimeError: Event loop is closed" traceback through ``sys.unraisablehook``; and asyncio logs
  the never-retrieved exceptions of orbax's futures when they are collected, often at exit.

``errors_raised_not_logged()`` is the one context manager for all of it: absl quiet, the
process's fd 2 captured while the block runs (and handed on unchanged when the block succeeds),
and ``install_filters()`` for the late Python-level complaints. On failure it does not sleep a
fixed time: it waits until the threads the block started are done or idle and fd 2 has gone
quiet, with a bound, and only then puts fd 2 back, so a straggler's output lands in the capture
and is dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Iterator

QUIET_S = 0.25  # fd 2 unchanged this long, with the block's threads idle or done: the stragglers are through
WAIT_LIMIT_S = 10.0  # never wait longer than this on a failure


ORBAX_MARKS = ("OCDBT", "orbax-checkpoint-tmp", "tensorstore", "orbax")

# A save that failed leaves the coroutines of its writes that never ran (orbax's
# ``async_serialize_from_host.<locals>.write_fragment``, and the like); Python warns of each when it is
# collected, at exit, as "sys:1: RuntimeWarning: coroutine '...' was never awaited". The warning
# carries no module to filter on (it comes from "sys"), so orbax's serialization coroutines are
# matched by name.
UNAWAITED_ORBAX = r"coroutine '[^']*(serializ|write_fragment|_write_array|async_save)[^']*' was never awaited"


class OrbaxLeftovers(logging.Filter):
    """asyncio's "exception was never retrieved" for orbax's own futures, logged when they are
    collected (often at exit), after the clean error that reported the same failure."""

    def filter(self, record):
        message = record.getMessage()
        if "was never retrieved" not in message:
            return True
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and any("orbax" in frame.filename or "tensorstore" in frame.filename
                                     for frame in traceback.extract_tb(error.__traceback__)):
            return False
        # tensorstore sets the exception from C++: no Python frame to go by, so its text says whose it is
        # ("... in OCDBT database at local file .../10.orbax-checkpoint-tmp/...")
        text = f"{message} {error!r}"
        return not any(mark in text for mark in ORBAX_MARKS)


def install_filters() -> None:
    """Drop orbax's late Python-level complaints; everything else passes. Idempotent, and called
    on every use: a test runner may have put its own ``sys.unraisablehook`` back meanwhile."""
    if not any(f[1] is not None and f[1].pattern == UNAWAITED_ORBAX for f in warnings.filters):
        warnings.filterwarnings("ignore", message=UNAWAITED_ORBAX, category=RuntimeWarning)
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, OrbaxLeftovers) for f in asyncio_log.filters):
        asyncio_log.addFilter(OrbaxLeftovers())
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loops", False):
        return

    def hook(unraisable):
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        previous(unraisable)

    hook._drops_closed_loops = True
    sys.unraisablehook = hook


@contextlib.contextmanager
def quiet_absl() -> Iterator[None]:
    """orbax logs warnings and tracebacks through absl; the errors it raises say the same in one line."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _working(thread: threading.Thread) -> bool:
    """Whether a live thread is doing something, rather than waiting for work: a pool's idle thread
    (orbax's executors, asyncio's) sits in ``threading``'s or ``queue``'s wait, and never ends by itself."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return False
    code = frame.f_code
    return not (os.path.basename(code.co_filename) in ("threading.py", "queue.py") and code.co_name in ("wait", "get"))


def _wait_for_stragglers(started: list[threading.Thread], captured, limit_s: float) -> None:
    """Until no thread started in the block is still working and fd 2 has been quiet for
    ``QUIET_S`` (tensorstore's C++ threads are invisible to Python: their output is the sign), at
    most ``limit_s``."""
    deadline = time.monotonic() + limit_s
    size, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        sys.stderr.flush()
        now_size = os.fstat(captured.fileno()).st_size
        if now_size != size:
            size, since = now_size, time.monotonic()
        working = [t for t in started if t.is_alive() and _working(t)]
        if not working and time.monotonic() - since >= QUIET_S:
            return
        if working:  # sleep by joining one, so a finishing thread ends the wait early
            working[0].join(timeout=0.05)
        else:
            time.sleep(0.05)


@contextlib.contextmanager
def errors_raised_not_logged(*, wait_limit_s: float = WAIT_LIMIT_S) -> Iterator[None]:
    """Run an orbax save or restore whose failure the caller reports itself, as one clear error.

    On success the captured output is passed on to stderr unchanged; on failure, once the
    stragglers are through (``_wait_for_stragglers``), it is dropped and the exception carries
    the error. ``wait_limit_s=0`` drops what is there at once (a read that writes nothing).
    """
    install_filters()
    before = set(threading.enumerate())
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured, quiet_absl():
        os.dup2(captured.fileno(), 2)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            started = [t for t in threading.enumerate() if t not in before]
            _wait_for_stragglers(started, captured, wait_limit_s)
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not failed:
                captured.seek(0)
                text = captured.read()
                if text:
                    os.write(2, text)
