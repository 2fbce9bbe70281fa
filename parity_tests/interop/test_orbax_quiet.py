"""orbax's stray output (``interop.orbax_quiet``): a failure's stragglers never reach stderr, a
success's output does, and the wait after a failure ends when the stragglers are through."""

import os
import sys
import threading
import time

import pytest

from flax_transformer.interop import orbax_quiet


def _straggler(delay_s: float, text: bytes) -> threading.Thread:
    """A thread that writes to fd 2 after ``delay_s``, as tensorstore's threads do after a failure."""
    def run():
        time.sleep(delay_s)
        os.write(2, text)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_late_straggler_of_a_failure_never_reaches_stderr(capfd):
    # 1.5 s: later than the fixed 1 s settle this module replaced, which let such output through
    with pytest.raises(OSError, match="disk full"):
        with orbax_quiet.errors_raised_not_logged():
            thread = _straggler(1.5, b"tensorstore spec tail\n")
            raise OSError("disk full")
    thread.join()
    assert "tensorstore" not in capfd.readouterr().err


def test_a_success_hands_its_output_on(capfd):
    with orbax_quiet.errors_raised_not_logged():
        os.write(2, b"a warning worth seeing\n")
    assert "a warning worth seeing" in capfd.readouterr().err


def test_the_wait_ends_with_the_stragglers_not_at_a_fixed_time(capfd):
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        with orbax_quiet.errors_raised_not_logged():
            raise RuntimeError("nothing in flight")
    assert time.monotonic() - start < 1.0  # no thread, no output: done after QUIET_S
    idle = threading.Event()
    pool = threading.Thread(target=idle.wait)  # a pool thread waiting for work never ends by itself
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        with orbax_quiet.errors_raised_not_logged():
            pool.start()
            raise RuntimeError("a pool thread lives on")
    waited = time.monotonic() - start
    idle.set()
    pool.join()
    assert waited < 1.0  # an idle thread is not waited for


def test_closed_loop_tracebacks_are_dropped_and_others_pass(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)  # the hook in place before: it gets the rest
    orbax_quiet.install_filters()
    orbax_quiet.install_filters()  # idempotent: one hook, not a chain of them
    hook = sys.unraisablehook
    assert hook._drops_closed_loops and hook.__closure__[0].cell_contents == seen.append  # wraps the one before

    class Unraisable:
        def __init__(self, error):
            self.exc_type, self.exc_value, self.exc_traceback = type(error), error, None
            self.err_msg, self.object = None, None

    hook(Unraisable(RuntimeError("Event loop is closed")))
    assert seen == []
    hook(Unraisable(ValueError("something else")))
    assert [str(u.exc_value) for u in seen] == ["something else"]


def test_never_retrieved_tensorstore_errors_with_no_python_frames_are_dropped(caplog):
    """What CI printed 290 lines of: tensorstore sets the future's exception from C++, so its
    traceback has no orbax frame; its text names the OCDBT database and orbax's temporary folder."""
    import asyncio
    import logging

    orbax_quiet.install_filters()
    log = logging.getLogger("asyncio")
    error = ValueError('OUT_OF_RANGE: Error writing "opt_state.mu/0" in OCDBT database at local file '
                       '"/r/checkpoints/10.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": '
                       "File too large [os_error_code='27']")
    future = asyncio.Future(loop=asyncio.new_event_loop())
    future.set_exception(error)
    future._log_traceback = False  # this test logs it itself
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        log.error(f"Future exception was never retrieved\nfuture: {future!r}", exc_info=(ValueError, error, None))
        other = KeyError("a user's own future")
        log.error("Future exception was never retrieved\nfuture: <Future finished exception=KeyError()>",
                  exc_info=(KeyError, other, None))
        log.error("Task was destroyed but it is pending! (orbax)")  # not a never-retrieved record: kept
    messages = [r.getMessage() for r in caplog.records]
    assert not any("OCDBT" in m for m in messages)
    assert any("KeyError" in m for m in messages) and any("Task was destroyed" in m for m in messages)
    future.get_loop().close()


def test_orbax_coroutines_left_unawaited_by_a_failed_save_warn_nothing_others_do():
    """CI saw "sys:1: RuntimeWarning: coroutine 'async_serialize_from_host.<locals>.write_fragment'
    was never awaited" after a full-disk save's one-line error; a user's own coroutine still warns."""
    import subprocess
    import textwrap
    code = textwrap.dedent("""
        import gc
        from flax_transformer.interop import orbax_quiet
        orbax_quiet.install_filters()
        def async_serialize_from_host():
            async def write_fragment():
                pass
            return write_fragment()
        async def mine():
            pass
        left = [async_serialize_from_host(), mine()]
        del left
        gc.collect()
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "write_fragment" not in result.stderr
    assert "coroutine 'mine' was never awaited" in result.stderr
