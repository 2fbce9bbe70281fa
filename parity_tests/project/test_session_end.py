"""A green run ends without a traceback: conftest's ``pytest_sessionfinish`` collects the garbage,
then freezes the heap, so that pytest's collections after an xdist worker has said it finished
take milliseconds, not the seconds after which execnet interrupts the worker (the conftest says how
that interrupt became a ``KeyboardInterrupt`` traceback from JAX's gc callback)."""

import gc

from parity_tests import conftest


def test_the_session_end_collects_then_freezes_the_heap(monkeypatch):
    frozen_when_collected = []
    monkeypatch.setattr(gc, "collect", lambda *args: frozen_when_collected.append(gc.get_freeze_count()) or 0)
    try:
        conftest.pytest_sessionfinish(None)
        assert frozen_when_collected == [0]  # collected first: garbage is freed and its errors reported
        assert gc.get_freeze_count() > 0  # then frozen: later full collections skip the heap
    finally:
        gc.unfreeze()  # the rest of this run collects as before
