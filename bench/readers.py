"""The reader matrix: which transformers versions read which of this library's exports, and with what error.

    python bench/readers.py --make-venvs DIR            # the readers' virtualenvs only (reused when there)
    python bench/readers.py --venvs DIR [--json OUT]    # make them if missing, then the matrix
    python bench/readers.py --reader PYTHON ...         # or readers you made yourself (each a Python with
                                                        # transformers and torch; peft for the adapter)

The readers are the oldest transformers 4.x this project supports (``reader_venvs.OLDEST``, pyproject's lower
bound) and the newest 5.x on PyPI (``pip index versions``), each a virtualenv of its own that borrows this
environment's torch (``parity_tests/interop/reader_venvs.py``). The exports, their references and the cells
are ``parity_tests/interop/readers_matrix.py``'s: rows are exports, columns reader versions, a cell the largest
logit error on the real tokens of a full and a right-padded row over the logits' scale, "refused: ..." or
"not in version". ``parity_tests/interop/test_readers_matrix.py`` asserts the same matrix (``-m slow``).
Exit 1 when a reader refuses an export, reports a missing or unexpected key, or computes another model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # parity_tests: the exports and their models


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-venvs", metavar="DIR", help="make the readers' virtualenvs under DIR and stop")
    parser.add_argument("--venvs", metavar="DIR", help="the readers' virtualenvs (made under DIR when missing)")
    parser.add_argument("--reader", action="append", default=[], metavar="PYTHON", help="a reader's Python instead")
    parser.add_argument("--json", metavar="OUT", help="also write the matrix as JSON")
    parser.add_argument("--keep", metavar="DIR", help="write the exports under DIR (kept) instead of a temporary one")
    args = parser.parse_args(argv)
    from parity_tests.interop import reader_venvs

    if args.make_venvs:
        start = time.perf_counter()
        for version, python in reader_venvs.make_venvs(args.make_venvs).items():
            print(f"transformers {version}: {python}")
        print(f"({time.perf_counter() - start:.0f} s)")
        return 0
    if not args.reader and not args.venvs:
        parser.error("give --venvs DIR (made when missing) or --reader PYTHON")
    pythons = list(args.reader) or list(reader_venvs.make_venvs(args.venvs).values())
    import transformers

    from parity_tests.interop import readers_matrix as rm

    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        rm.write_exports(root)
        print(f"{len(rm.NAMES)} exports written ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        start = time.perf_counter()
        readers = rm.read_all(pythons, root)
        print(f"read by {', '.join(r['version'] for r in readers)} ({time.perf_counter() - start:.0f} s)",
              file=sys.stderr)
    print(rm.table(readers))
    if args.json:
        Path(args.json).write_text(json.dumps(readers, indent=1) + "\n", encoding="utf-8")
    wrong = [line for reader in readers for line in rm.failures(reader)]
    for line in wrong:
        print(f"FAIL {line}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
