"""Fault sweep: bad inputs, failing machines and broken models against the CLIs, the entry points and the library.

    python bench/faults.py [--out DIR] [--only SUBSTRING ...] [--keep]

Reproduces issue 12's figure (bad inputs tried, errors that were clean, data lost) and issue 22's
(verdicts that could be fooled). Every case runs in a fresh temp folder: one subprocess call of
``python -m flax_transformer ...``, ``python -m train.<task> ...`` or a short Python snippet (some
cases add a follow-up call), and is classified:

* clean: the documented outcome. For a bad input, exit 2 (130 for Ctrl-C, 3 for a NaN stop) and
  stderr of exactly one non-empty ``[PROG: ]error: ...`` line (plus ``warning:`` lines, argparse's
  ``usage:`` block and a training run's ``TASK: ...`` summary line); for a broken model, checkpoint
  or certificate, a failing verdict (exit 1, the verdict on stdout) or that one error line; exit 0
  where the input is legal and must simply work; for a library snippet, the expected exception
  with a message naming the problem (the snippet checks it and prints OK).
* traceback: a Python traceback on stderr (or stdout).
* unclean: any other wrong exit status, several error lines, or orbax's asyncio noise ("Event loop
  is closed", "... was never retrieved") on stderr.
* silent: a silent wrong result. The call exited 0 (a snippet's library call returned normally)
  for something broken, or exited 1 without reaching the failing verdict, or printed a figure it
  did not measure.
* data lost: a file of the case folder (its prepared inputs and outputs, sha256 before the call)
  changed or vanished although the call failed; or a temp file (``.ft-tmp-``/``.ft-old-``) left
  behind; or a half-made run folder (the call failed before training and left its ``--out``).

The machinery is ``faults_harness.py``, the fixtures ``faults_fixtures.py``, the cases
``faults_cases_*.py`` (the pairs that ``verify --pair`` loads: ``faults_pairs.py``). Read-only-folder
cases are skipped when running as root (root writes anyway). Prints a table and the totals;
``--out DIR`` also writes ``DIR/faults.jsonl``. Exits 1 if any case is not clean.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

# the cases register themselves on import, in this order
import faults_cases_files  # noqa: F401
import faults_cases_runs  # noqa: F401
import faults_cases_state  # noqa: F401
import faults_cases_verdicts  # noqa: F401
from faults_fixtures import build_fixtures
from faults_harness import CASES, ERROR_LINE, ROOT, SILENT, Case, has_traceback

COLUMNS = ("traceback", "unclean", "silent", "lost")


@dataclasses.dataclass
class Result:
    case: str
    klass: str
    outcome: str = "clean"  # clean, or the columns it counts in joined by "+": traceback+silent, lost, ...
    rc: int | None = None
    stderr: str = ""
    stderr_tail: str = ""
    stdout_tail: str = ""
    detail: str = ""
    command: str = ""
    seconds: float = 0.0


def classify(call, problems: list[str], lost: list[str]) -> tuple[str, str]:
    """(outcome, detail) of a case from its call and the problems its checks found."""
    notes = [p for p in problems if p.startswith("(")]
    silent = [p for p in problems if p.startswith(SILENT)]
    unclean = [p for p in problems if p not in notes and p not in silent]
    traceback = has_traceback(call) or any("traceback" in p for p in unclean)
    kinds = {"traceback": traceback, "unclean": unclean and not traceback, "silent": silent, "lost": lost}
    outcome = "+".join(k for k in COLUMNS if kinds[k]) or "clean"
    detail = "; ".join(unclean + silent + lost + notes)
    if has_traceback(call):
        detail += " | " + " / ".join(call.stderr.strip().splitlines()[-3:])
    return outcome, detail


def run_case(item: Case, fx: Path, base: Path) -> Result:
    folder = Path(tempfile.mkdtemp(prefix="case-", dir=base))
    result = Result(item.name, item.klass)
    start = time.perf_counter()
    try:
        call, problems, lost, command = item.function(folder, fx)
        result.rc, result.command = call.rc, command
        result.stderr_tail, result.stdout_tail = call.stderr[-2000:], call.stdout[-1000:]
        lines = [x for x in call.stderr.splitlines() if x.strip()]
        errors = [x for x in lines if ERROR_LINE.match(x) or "Error" in x]
        result.stderr = (errors[-1] if errors else lines[-1] if lines else "").strip()
        result.outcome, result.detail = classify(call, problems, lost)
    except Exception as error:  # a bug of the sweep itself: shown, not hidden
        result.outcome, result.detail = "unclean", f"sweep error: {type(error).__name__}: {error}"
    finally:
        result.seconds = time.perf_counter() - start
        for path in folder.rglob("*"):  # undo read-only folders before removing
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(folder, ignore_errors=True)
    return result


def report(results: list[Result], seconds: float) -> dict[str, int]:
    """Print the table, each case that is not clean, and the totals; return the totals."""
    width = max(len(r.case) for r in results)
    print(f"\n{'case':{width}s}  {'class':22s} {'outcome':16s} {'rc':>4s}  first stderr line")
    for r in results:
        print(f"{r.case:{width}s}  {r.klass:22s} {r.outcome:16s} {r.rc!s:>4s}  {r.stderr[:100]}")
    bad = [r for r in results if r.outcome != "clean"]
    if bad:
        print("\nnot clean:")
        for r in bad:
            err = "\n      ".join(r.stderr_tail.strip().splitlines()[-6:])
            out = "\n      ".join(r.stdout_tail.strip().splitlines()[-3:])
            print(f"- {r.case} [{r.outcome}]: {r.command[:300]}\n    {r.detail[:600]}\n    stderr:\n      {err}"
                  f"\n    stdout:\n      {out}")
    totals = {"cases": len(results), "clean": sum(r.outcome == "clean" for r in results)}
    totals.update({k: sum(k in r.outcome.split("+") for r in results) for k in COLUMNS})
    print(f"\n{totals['cases']} cases, {totals['clean']} clean, {totals['traceback']} tracebacks, "
          f"{totals['unclean']} other unclean (exit status, error lines, noise), {totals['silent']} silent wrong "
          f"results, {totals['lost']} with data lost  ({seconds:.0f} s"
          f"{'; as root: read-only folders not tried' if ROOT else ''})")
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write DIR/faults.jsonl")
    parser.add_argument("--only", nargs="+", help="run the cases whose name contains one of these")
    parser.add_argument("--keep", action="store_true", help="keep the fixtures folder (printed)")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.only or any(s in c.name for s in args.only)]
    if not cases:
        parser.error(f"no case name contains any of {args.only}")
    start = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="ft-faults-"))
    results = []
    try:
        fx = base / "fixtures"
        fx.mkdir()
        print(f"building fixtures in {fx} ...", flush=True)
        build_fixtures(fx)
        print(f"fixtures: {time.perf_counter() - start:.0f} s; {len(cases)} cases"
              f"{' (root: read-only-folder cases skipped)' if ROOT else ''}", flush=True)
        for i, item in enumerate(cases, 1):
            result = run_case(item, fx, base)
            results.append(result)
            print(f"[{i:3d}/{len(cases)}] {result.outcome:16s} rc={result.rc!s:4s} {result.seconds:5.1f}s  "
                  f"{item.name}", flush=True)
    finally:
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    totals = report(results, time.perf_counter() - start)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "faults.jsonl", "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
    return 1 if totals["clean"] != totals["cases"] else 0


if __name__ == "__main__":
    sys.exit(main())
