"""The slow marks (parity_tests/slow_marks.py): which tests the default run leaves out, that every mark
names the test that covers it, and that a renamed test or case stops the run."""

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parity_tests import slow_marks

KNOWN = {"test_light", "test_heavy", "test_a"}


def test_a_reason_names_a_test_that_exists():
    assert slow_marks.reason_errors("test_light, the same model", KNOWN) == []
    assert slow_marks.reason_errors("test_a's other cases", KNOWN) == []  # a module
    assert "without a reason" in slow_marks.reason_errors("", KNOWN)[0]
    assert "without a reason" in slow_marks.reason_errors(None, KNOWN)[0]
    assert "names no test" in slow_marks.reason_errors("the same bound", KNOWN)[0]
    assert slow_marks.reason_errors("the kept cases", KNOWN, must_name=False) == []
    assert slow_marks.reason_errors("test_light, test_gone[x]", KNOWN) == [
        "the reason 'test_light, test_gone[x]' names test_gone, which is no test"]


def test_slow_cases_and_keep_cases_pick_the_cases():
    cases = {"heavy": "test_light"}
    assert slow_marks.case_reason("heavy", cases, None, None) == "test_light"
    assert slow_marks.case_reason("light", cases, None, None) is None
    assert slow_marks.case_reason("x", {}, {"y"}, "kept: y") == "kept: y"
    assert slow_marks.case_reason("y", {}, {"y"}, "kept: y") is None
    assert slow_marks.case_reason(None, {}, None, None) is None  # not parametrised


def _marks_in(path: Path):
    """Every slow, slow_cases and keep_cases mark written in a test file, with its reasons and cases."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        call = node if isinstance(node, ast.Call) else None
        func = ast.unparse(call.func) if call else ""
        if func in ("pytest.mark.slow", "pytest.mark.slow_cases", "pytest.mark.keep_cases"):
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            # cases computed at import (keep_cases(*family_specs.kept(...))): the collection checks them
            args = [ast.literal_eval(a) for a in call.args if not isinstance(a, ast.Starred)]
            yield func.rpartition(".")[2], args or [...], kwargs


def test_every_slow_mark_of_the_suite_names_the_test_that_covers_it():
    known = slow_marks.known_test_names()
    files = sorted(set(slow_marks.ROOT.rglob("test_*.py")) - {Path(__file__).resolve()})  # not this file's examples
    errors, marked, bare = [], 0, []
    for path in files:
        text = path.read_text(encoding="utf-8")
        bare += [f"{path.name}:{n}" for n, line in enumerate(text.splitlines(), 1)
                 if re.search(r"pytest\.mark\.slow(?![\w(])|pytest\.mark\.slow\(\)", line)]
        for kind, args, kwargs in _marks_in(path):
            if kind == "slow":
                reasons = [kwargs.get("reason", args[0] if args else None)]
            elif kind == "slow_cases":
                reasons = list(args[0].values())
                assert args[0], f"{path.name}: slow_cases names no case"
            else:
                assert args, f"{path.name}: keep_cases keeps no case"
                errors += slow_marks.reason_errors(kwargs.get("reason"), known, must_name=False)
                marked += 1
                continue
            marked += len(reasons)
            errors += [f"{path.name}: {e}" for reason in reasons for e in slow_marks.reason_errors(reason, known)]
    assert not bare, f"slow marks without a reason: {bare}"
    assert not errors, "\n".join(errors)
    assert marked > 50  # the marks were found: about 70 tests and cases and 22 sweeps


CONFTEST = """
from pathlib import Path
from parity_tests import slow_marks

def pytest_configure(config):
    for name, text in slow_marks.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")

def pytest_collection_modifyitems(config, items):
    slow_marks.mark_slow(items, slow_marks.known_test_names(Path(__file__).parent))
"""
TESTS = """
import pytest

def test_light():
    pass

@pytest.mark.slow(reason="test_light")
def test_heavy():
    pass

@pytest.mark.slow_cases({"2": "test_sweep[1]"})
@pytest.mark.parametrize("n", [1, 2, 3])
def test_sweep(n):
    pass

@pytest.mark.keep_cases("a-x", reason="the hardest case")
@pytest.mark.parametrize("m", ["x", "y"])
@pytest.mark.parametrize("k", ["a", "b"])
def test_stacked(k, m):
    pass
"""


def _run(tmp_path, tests, *args):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_a.py").write_text(textwrap.dedent(tests))
    env_root = str(Path(slow_marks.ROOT).parent)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *args], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": env_root, "PATH": "/usr/bin:/bin"})
    return done.returncode, done.stdout + done.stderr


def test_the_default_run_leaves_out_exactly_the_marked_tests_and_cases(tmp_path):
    code, out = _run(tmp_path, TESTS, "-m", "not slow")
    assert code == 0, out
    kept = {line.partition("::")[2] for line in out.splitlines() if line.startswith("test_a.py::")}
    assert kept == {"test_light", "test_sweep[1]", "test_sweep[3]", "test_stacked[a-x]"}
    code, out = _run(tmp_path, TESTS, "-m", "slow")
    slow = {line.partition("::")[2] for line in out.splitlines() if line.startswith("test_a.py::")}
    assert code == 0 and slow == {"test_heavy", "test_sweep[2]", "test_stacked[a-y]", "test_stacked[b-x]",
                                  "test_stacked[b-y]"}, out
    code, out = _run(tmp_path, TESTS, "test_a.py::test_sweep[3]")  # one case selected: the others still exist
    assert code == 0, out


@pytest.mark.parametrize("change, named", [
    (('"2": "test_sweep[1]"', '"4": "test_sweep[1]"'), "[4], which does not exist"),  # a renamed case
    (('keep_cases("a-x"', 'keep_cases("a-z"'), "[a-z], which does not exist"),
    (('reason="test_light"', 'reason="test_lite"'), "names test_lite, which is no test"),  # a renamed test
    (('reason="test_light"', 'reason="the light one"'), "names no test"),
    (('@pytest.mark.slow(reason="test_light")', "@pytest.mark.slow"), "without a reason"),
])
def test_a_mark_that_names_nothing_real_stops_the_run(tmp_path, change, named):
    assert change[0] in TESTS
    code, out = _run(tmp_path, TESTS.replace(*change))
    assert code == 4 and named in out, out
