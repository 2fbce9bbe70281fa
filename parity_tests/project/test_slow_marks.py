"""conftest.slow_tests: which tests the default run leaves out, and that a stale name stops the run."""

import pytest

from parity_tests.conftest import KEEP, SLOW, slow_tests

FUNCTIONS = {"test_a.py": {"test_sweep", "test_heavy", "test_light"}}
COLLECTED = {"test_a.py::test_sweep[x]", "test_a.py::test_sweep[y]", "test_a.py::test_sweep[z]",
             "test_a.py::test_heavy[1]", "test_a.py::test_heavy[2]", "test_a.py::test_light"}


def test_slow_names_a_test_or_one_case_and_keep_keeps_the_named_cases_of_a_sweep():
    marked = slow_tests(COLLECTED, FUNCTIONS, slow={"test_a.py::test_heavy[2]": "covered by [1]"},
                        keep={"test_a.py::test_sweep": {"y"}})
    assert marked == {"test_a.py::test_sweep[x]", "test_a.py::test_sweep[z]", "test_a.py::test_heavy[2]"}
    whole = slow_tests(COLLECTED, FUNCTIONS, slow={"test_a.py::test_heavy": "..."}, keep={})
    assert whole == {"test_a.py::test_heavy[1]", "test_a.py::test_heavy[2]"}  # a function's every case


@pytest.mark.parametrize("slow, keep, named", [
    ({"test_a.py::test_gone": ""}, {}, "test_a.py::test_gone"),  # a renamed test
    ({"test_a.py::test_heavy[3]": ""}, {}, "test_a.py::test_heavy[3]"),  # a renamed case
    ({}, {"test_a.py::test_sweep": {"y", "w"}}, "test_a.py::test_sweep[w]"),  # a kept case that is gone
    ({}, {"test_a.py::test_gone": {"y"}}, "test_a.py::test_gone"),
])
def test_a_name_that_matches_nothing_stops_the_run(slow, keep, named):
    with pytest.raises(pytest.UsageError, match=named.replace("[", r"\[").replace("]", r"\]")):
        slow_tests(COLLECTED, FUNCTIONS, slow=slow, keep=keep)


def test_a_file_left_out_of_the_run_is_not_checked():
    assert slow_tests(COLLECTED, FUNCTIONS, slow={"test_b.py::test_gone[1]": ""}, keep={}) == set()


def test_the_project_s_lists_name_real_tests_and_every_slow_entry_says_what_covers_it():
    assert all(isinstance(why, str) and why for why in SLOW.values())
    assert all(kept for kept in KEEP.values())  # a sweep keeps at least one case in the default run
