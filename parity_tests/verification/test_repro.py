"""``repro``: the first divergent module alone, a folder whose ``repro.py`` reproduces the divergence
with only jax, torch and numpy, in a fresh interpreter where this library cannot be imported.

The fresh interpreter is ``python -I -c FRESH`` in the folder: ``-I`` drops PYTHONPATH, the user's site
and the current folder from ``sys.path``, but the library is installed editable (a finder in
site-packages), so ``FRESH`` also sets ``sys.modules['flax_transformer']`` and ``['torch_reference']``
to None before it runs ``repro.py`` (``runpy``): importing either raises ImportError. It checks that
first, and after the run that no module of either was loaded.
"""

import json
import runpy
import subprocess
import sys

import numpy as np
import pytest

import torch_reference.former as tf
from flax_transformer.interop import files, porting
from flax_transformer.verification import bisect, repro, verify
from flax_transformer.verification.bisect_report import GRADIENTS, INCOMPLETE, BisectReport

IDS = np.random.default_rng(0).integers(0, 20, (2, 8))
BUG = "tblocks.0.mhattention.tokeys"
FRESH = """
import runpy, sys
for name in ("flax_transformer", "torch_reference"):
    sys.modules[name] = None  # importing it raises ImportError
try:
    import flax_transformer  # noqa
except ImportError:
    print("flax_transformer: not importable")
else:
    sys.exit("flax_transformer was imported")
try:
    runpy.run_path("repro.py", run_name="__main__")
finally:
    assert not [m for m in sys.modules if m.startswith(("flax_transformer.", "torch_reference."))]
"""
FILES = {"README.txt", "repro.py", "module.json", "jax_module.jaxexport", "jax_module.mlir", "torch_module.pt2",
         "flax_weights.npz", "torch_weights.npz", "inputs.npz", "outputs.npz"}


def _planted():
    """A one-block classifier pair whose Flax keys projection has its square kernel transposed."""
    torch_model = tf.CTransformer(16, 4, 1, 8, 20, 3).eval()
    verify.perturb_torch(torch_model, 0)
    flax_model = porting.torch_to_flax(torch_model)
    kernel = flax_model.tblocks[0].mhattention.tokeys.kernel
    kernel.set_value(kernel[...].T)
    return torch_model, flax_model


def run_fresh(folder) -> subprocess.CompletedProcess:
    """``repro.py`` of ``folder`` in a fresh interpreter without this library (module docstring)."""
    return subprocess.run([sys.executable, "-I", "-c", FRESH], cwd=folder, capture_output=True, text=True,
                          timeout=600)


def test_bisect_writes_a_reproducer_that_reproduces_without_the_library(tmp_path):
    torch_model, flax_model = _planted()
    report = bisect.bisect(torch_model, flax_model, (IDS,), repro=tmp_path / "repro")
    assert report.first_divergent == BUG, str(report)
    folder = tmp_path / "repro"
    assert {p.name for p in folder.iterdir()} == FILES
    spec = json.loads((folder / "module.json").read_text())
    assert spec["torch_path"] == spec["flax_path"] == BUG and spec["bisect"]["status"] == "introduced"
    assert spec["constructor"]["torch"]["extra_repr"] == "in_features=16, out_features=16, bias=False"
    assert spec["constructor"]["flax"]["attributes"]["in_features"] == 16 and spec["measured"]["reproduces"]
    assert "stablehlo.dot_general" in (folder / "jax_module.mlir").read_text()
    inputs = np.load(folder / "inputs.npz")
    assert inputs["jax.0"].dtype == np.float32 and inputs["jax.0"].shape == (2, 8, 16)
    done = run_fresh(folder)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "flax_transformer: not importable" in done.stdout
    assert "DIVERGENCE REPRODUCED" in done.stdout and f"module {BUG}" in done.stdout, done.stdout
    assert f"vs float64: max abs error {spec['measured']['jax_err']:.3e}" in done.stdout  # the same number


def test_a_module_that_computes_right_does_not_reproduce(tmp_path, capsys):
    """norm1 takes the wrong keys' output in the whole model (bisect: inherited), but on the float64
    reference's input it computes right: its reproducer says so and exits 0."""
    torch_model, flax_model = _planted()
    folder = repro.write(tmp_path / "norm1", torch_model, flax_model, (IDS,), path="tblocks.0.norm1", use_jit=False)
    spec = json.loads((folder / "module.json").read_text())
    assert spec["bisect"] is None and not spec["measured"]["reproduces"]
    assert spec["constructor"]["torch"]["init_kwargs"] is None and "eps" in spec["constructor"]["torch"]["extra_repr"]
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(folder / "repro.py"), run_name="__main__")
    assert stop.value.code == 0
    assert "no divergence" in capsys.readouterr().out


@pytest.mark.slow(reason="test_a_module_that_computes_right_does_not_reproduce "
                  "(run in this process), test_bisect_writes_a_reproducer_that_reproduces_without_the_library")
def test_a_right_module_and_the_whole_model_in_a_fresh_interpreter(tmp_path):
    torch_model, flax_model = _planted()
    right = repro.write(tmp_path / "ff", torch_model, flax_model, (IDS,), path="tblocks.0.ff")
    done = run_fresh(right)
    assert done.returncode == 0 and "no divergence" in done.stdout, done.stdout + done.stderr
    whole = repro.write(tmp_path / "model", torch_model, flax_model, (IDS,), path="<model>")
    spec = json.loads((whole / "module.json").read_text())
    assert spec["constructor"]["torch"]["init_kwargs"]["emb"] == 16  # RecordsInit's record
    done = run_fresh(whole)
    assert done.returncode == 1 and "DIVERGENCE REPRODUCED" in done.stdout, done.stdout + done.stderr


def test_refusals_come_before_any_work(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    nothing = object()  # a model: any work would fail on it with another error
    with pytest.raises(files.OutputExists):
        bisect.bisect(nothing, nothing, (IDS,), repro=busy)
    with pytest.raises(files.OutputFolderMissing):
        bisect.bisect(nothing, nothing, (IDS,), repro=tmp_path / "no" / "such")
    with pytest.raises(files.OutputExists):
        repro.write(busy, nothing, nothing, (IDS,), path="")
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    for report, message in ((BisectReport([], None), "the report passed"),
                            (BisectReport([], GRADIENTS), "only gradients diverged"),
                            (BisectReport([], INCOMPLETE), "incomplete")):
        with pytest.raises(repro.ReproError, match=message):
            repro.write(tmp_path / "out", nothing, nothing, (IDS,), report=report)
        assert repro.from_report(tmp_path / "out", report, nothing, nothing, (IDS,)) is None
    with pytest.raises(repro.ReproError, match="one of them"):
        repro.write(tmp_path / "out", nothing, nothing, (IDS,))
    assert not (tmp_path / "out").exists()


def test_a_path_neither_model_calls_is_refused_and_leaves_nothing(tmp_path):
    torch_model, flax_model = _planted()
    with pytest.raises(repro.ReproError, match="no call 'tblocks.7'"):
        repro.write(tmp_path / "out", torch_model, flax_model, (IDS,), path="tblocks.7", use_jit=False)
    assert list(tmp_path.iterdir()) == []
