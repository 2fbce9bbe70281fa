"""What ``flax-transformer verify`` tells its user while its table runs, on stderr.

On a terminal, a progress bar (tqdm) that disappears when the table is printed. Otherwise (stderr
to a file or a pipe, as in CI or ``verify > table.txt 2> log.txt``), one line per family as its
rows end, so that a run of many minutes is never silent:

    verify: former: 68 rows, 68 passed (41.2 s)

``bench/verify_time.py`` reads these lines for each family's time.
"""

from __future__ import annotations

import sys
import time

LINE = "verify: {family}: {rows} rows, {passed} passed ({seconds:.1f} s)"


class FamilyProgress:
    """Counts the rows as they come; ``row(row)`` for each, ``close()`` at the end."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.bar = None
        if _isatty(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(desc="verifying", unit="check", leave=False, file=self.stream)
        self.family, self.rows, self.passed, self.started = None, 0, 0, time.perf_counter()

    def row(self, row) -> None:
        if self.bar is not None:
            self.bar.update()
            return
        if row.family != self.family:
            self._line()
            self.family, self.rows, self.passed, self.started = row.family, 0, 0, time.perf_counter()
        self.rows += 1
        self.passed += bool(row.passed)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self._line()
            self.family = None

    def _line(self) -> None:
        if self.family is not None:
            print(LINE.format(family=self.family, rows=self.rows, passed=self.passed,
                              seconds=time.perf_counter() - self.started), file=self.stream, flush=True)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: no bar
        return False
