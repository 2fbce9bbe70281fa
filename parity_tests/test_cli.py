"""``flax-transformer verify``: the whole cross-framework table, as a user runs it."""

import subprocess
import sys

from flax_transformer import verify


def test_verify_command_passes_and_covers_every_module():
    result = subprocess.run([sys.executable, "-m", "flax_transformer", "verify"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for spec in verify.specs():
        rows = [line for line in lines if f" {spec.name} " in f" {line} " and line.startswith(spec.family)]
        assert len(rows) == 2 * len(spec.cases), spec.name  # every mask case, both directions
        assert all(line.rstrip().endswith("pass") for line in rows)
    assert " 0 failed" in result.stdout


def test_verify_reports_a_broken_port(monkeypatch):
    """A wrong layout rule (no transpose) must show up as failures, not pass silently."""
    from flax_transformer import porting

    monkeypatch.setitem(porting.LEAF_RULES, "linear", {"weight": ("kernel", porting.AS_IS), "bias": ("bias", porting.AS_IS)})
    import numpy as np
    import torch_reference.former as tf

    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    results = verify.both_directions(tf.MHSelfAttention(8, 2), (x, None))  # square weights: shapes still fit
    assert all(err > verify.TOLERANCE for _, err, _ in results), results
