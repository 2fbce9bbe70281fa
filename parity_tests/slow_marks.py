"""Slow marks at the tests: which tests the default run leaves out, and the checks that keep them honest.

The default run (pyproject's addopts: ``-m "not slow"``, the README's command) leaves out the heaviest
tests, so that it stays within about 15 minutes on 2 idle cores (issue 21); ``-m slow`` runs them
alone (CI runs both). Each is an end-to-end variant, or a second model, of something a lighter test of
the default run checks, and its mark names that test:

- ``@pytest.mark.slow(reason="test_lm_tiny_end_to_end")``: the whole test (every case);
- ``@pytest.mark.slow_cases({"True": "test_x[False]", ...})``: these cases of a parametrised test,
  each with the test that covers it;
- ``@pytest.mark.keep_cases("padding", "fully-masked-row", reason=...)``: a sweep whose default run
  keeps these cases (the hardest masks, one model of each family), which cover the others: those are slow.

Case ids are pytest's own (``test_x[narrow-1-1-1-none]`` is the case ``narrow-1-1-1-none``), so that
stacked parametrisations keep their ids. A reason must name a test (a ``test_*`` module or function
of ``parity_tests``; a sweep's kept cases are its cover) and every test it names must exist; a case named in ``slow_cases`` or
``keep_cases`` must exist. Otherwise the run stops (``pytest.UsageError``): a renamed test or case never
drops out of, or stays in, the default run silently.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
NAME = re.compile(r"\btest_\w+")
MARKERS = {
    "slow": "a heavy test left out of the default run; reason= names the lighter test that covers it (-m slow runs them)",
    "slow_cases": "slow_cases({case id: reason}): these cases of a parametrised test are slow",
    "keep_cases": "keep_cases(*case ids, reason=...): a sweep whose default run keeps these cases; the others are slow",
}


def known_test_names(root: Path = ROOT) -> set[str]:
    """Every test module's name and test function's name under ``root``, read from the source."""
    names = set()
    for path in root.rglob("test_*.py"):
        names.add(path.stem)
        names |= set(re.findall(r"^[ \t]*(?:async )?def (test_\w+)\(", path.read_text(encoding="utf-8"), re.M))
    return names


def reason_errors(reason, known: set[str], *, must_name=True) -> list[str]:
    """What is wrong with a slow mark's reason: none, no test named (where ``must_name``: a sweep's kept
    cases are its cover), or a test named that does not exist."""
    if not isinstance(reason, str) or not reason.strip():
        return ["a slow mark without a reason (name the test of the default run that covers it)"]
    named = NAME.findall(reason)
    if not named and must_name:
        return [f"the reason {reason!r} names no test"]
    return [f"the reason {reason!r} names {name}, which is no test" for name in named if name not in known]


def case_reason(case: str, slow_cases: dict[str, str], keep: set[str] | None, keep_reason: str | None):
    """Why ``case`` of a parametrised test is slow, or None when the default run keeps it."""
    if case in slow_cases:
        return slow_cases[case]
    if keep is not None and case not in keep:
        return keep_reason
    return None


def _case(item) -> str | None:
    return item.callspec.id if hasattr(item, "callspec") else None


def _all_cases(item) -> set[str]:
    """Every case id of ``item``'s test function, collected again from its module or class (a run that
    selects some cases, ``file.py::test[case]``, collects only those)."""
    return {_case(other) for other in item.parent.collect()
            if getattr(other, "originalname", None) == item.originalname} - {None}


def mark_slow(items, known: set[str] | None = None) -> None:
    """Add ``slow`` to the cases ``slow_cases`` and ``keep_cases`` name; check every slow mark's reason
    and every named case. Raises pytest.UsageError naming each problem."""
    errors, groups = [], {}
    for item in items:
        if hasattr(item, "originalname"):
            groups.setdefault((item.parent.nodeid, item.originalname), []).append(item)
    for group in groups.values():
        first = group[0]
        slow = list(first.iter_markers("slow"))
        cases_mark, keep_mark = first.get_closest_marker("slow_cases"), first.get_closest_marker("keep_cases")
        if not (slow or cases_mark or keep_mark):
            continue
        known = known_test_names() if known is None else known
        where = f"{first.nodeid.partition('[')[0]}: "
        slow_cases = dict(cases_mark.args[0]) if cases_mark else {}
        keep = set(keep_mark.args) if keep_mark else None
        keep_reason = keep_mark.kwargs.get("reason") if keep_mark else None
        reasons = [mark.kwargs.get("reason", mark.args[0] if mark.args else None) for mark in slow]
        reasons += slow_cases.values()
        errors += [where + e for reason in dict.fromkeys(reasons) for e in reason_errors(reason, known)]
        if keep_mark:
            errors += [where + e for e in reason_errors(keep_reason, known, must_name=False)]
        if keep_mark and not keep:
            errors.append(where + "keep_cases keeps no case")
        named = set(slow_cases) | (keep or set())
        cases = {_case(item) for item in group}
        if named - cases:
            cases = _all_cases(first)
        errors += [f"{where}names the case [{case}], which does not exist" for case in sorted(named - cases)]
        for item in group:
            reason = case_reason(_case(item), slow_cases, keep, keep_reason)
            if reason is not None:
                item.add_marker(pytest.mark.slow(reason=reason))
    if errors:
        raise pytest.UsageError("slow marks that name nothing real:\n  " + "\n  ".join(errors))
