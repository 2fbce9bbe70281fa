"""What the docs name and state is so: every source path they name exists, and the README's timings
are the ones ``bench/verify_time.py`` last measured (``bench/timings.json``), word for word.

Nothing here runs ``verify`` or the tests: the script measures them (minutes), this only compares.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a path from the repository's root, or from flax_transformer/ by its layer's folder (`interop/hf.py`)
ROOTED = re.compile(r"(?<![\w./-])((?:flax_transformer|torch_reference|parity_tests|train|bench)/[\w/]+\.py)\b")
BY_LAYER = re.compile(r"(?<![\w./-])((?:models|interop|verification|training|cli)/[\w/]+\.py)\b")


def stale_paths(text: str) -> list[str]:
    """The source paths ``text`` names that do not exist."""
    missing = [p for p in ROOTED.findall(text) if not (ROOT / p).is_file()]
    return missing + [p for p in BY_LAYER.findall(text) if not (ROOT / "flax_transformer" / p).is_file()
                      and not (ROOT / "parity_tests" / p).is_file()]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_source_path_named_exists(path):
    missing = stale_paths(path.read_text(encoding="utf-8"))
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"


def test_a_stale_path_is_caught():
    """The layered tree moved ``flax_transformer/hf_tables.py`` to ``interop/``: the old path is caught."""
    assert stale_paths("see `flax_transformer/hf_tables.py`") == ["flax_transformer/hf_tables.py"]
    assert stale_paths("see `verification/hf_tables.py`") == ["verification/hf_tables.py"]
    assert stale_paths("see `flax_transformer/interop/hf_tables.py` and `interop/hf.py`") == []


def _bench():
    spec = importlib.util.spec_from_file_location("verify_time", ROOT / "bench" / "verify_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_states_the_measured_timings():
    """Each record of bench/timings.json is stated in README.md as the script prints it; ``verify``'s
    must be there (the test run's once the script has measured it: ``--tests``)."""
    bench, readme = _bench(), (ROOT / "README.md").read_text(encoding="utf-8")
    records = json.loads(bench.RECORD.read_text())
    assert "verify" in records, "bench/timings.json has no verify record: run python bench/verify_time.py"
    prose = " ".join(readme.split())  # a sentence may wrap
    for name, record in records.items():
        assert record["exit"] == 0 and record["failed"] == 0, f"the recorded {name} run failed: {record}"
        assert bench.stated(name, record) in prose, \
            f"README.md does not state the measured {name} figure: {bench.stated(name, record)!r}"
        planted = dict(record, wall_s=record["wall_s"] + 60)  # a figure one minute off is not stated
        assert bench.stated(name, planted) not in prose
