"""``compare``'s rows: NaN on one side fails even where NaN on both sides is allowed, NaN in the
float64 reference alone leaves the report incomplete, the output row is the one furthest beyond its budget.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
Tiny hand-made pairs (``x * 2`` in both frameworks).
"""

import numpy as np
import torch
from flax import nnx

from flax_transformer.verification.compare import TOLERANCE, Row, compare

X = np.ones((2, 3), np.float32)


class TorchTimes2(torch.nn.Module):
    """``x * 2`` (and ``x * 3`` with ``two``); ``nan64``: NaN in float64 only, as a model whose float64 copy breaks."""

    def __init__(self, *, two=False, nan64=False):
        super().__init__()
        self.two, self.nan64 = two, nan64

    def forward(self, x):
        y = x * 2
        if self.nan64 and x.dtype == torch.float64:
            y = y * float("nan")
        return (y, x * 3) if self.two else y


class FlaxTimes2(nnx.Module):
    """``x * 2 + err`` (and ``x * 3`` with ``two``)."""

    def __init__(self, *, two=False, err=0.0):
        self.two, self.err = two, err

    def __call__(self, x):
        y = x * 2 + self.err
        return (y, x * 3) if self.two else y


def test_a_row_with_nan_on_one_side_fails_even_when_nan_on_both_sides_is_allowed():
    # mutant C1: Row.passed looked at nonfinite_jax only
    for side in ("nonfinite_torch", "nonfinite_jax"):
        row = Row("f", "m", "c", "d", 0.0, False, nonfinite_both=1, allow_nonfinite=True, **{side: 1})
        assert not row.passed, side
    assert Row("f", "m", "c", "d", 0.0, False, nonfinite_both=1, allow_nonfinite=True).passed


def test_nan_in_the_float64_reference_alone_makes_compare_incomplete():
    # mutant C6: values NaN in the float64 copy but finite in both frameworks were dropped silently
    x = np.full((2, 3), 1e-3, np.float32)
    report = compare(TorchTimes2(nan64=True), FlaxTimes2(), (x,))
    assert not report.passed and report.incomplete, str(report)
    assert "NaN/inf in the float64 reference" in report.skipped[0], report.skipped
    assert compare(TorchTimes2(nan64=True), FlaxTimes2(), (x,), allow_skipped=True).passed


def test_the_output_row_holds_the_output_furthest_beyond_its_budget():
    # mutant C7: min for max picked the output nearest its budget, hiding the other one
    x = np.random.default_rng(0).uniform(-1e-3, 1e-3, (2, 3)).astype(np.float32)
    report = compare(TorchTimes2(two=True), FlaxTimes2(two=True, err=1e-7), (x,))  # 1e-7: far below 1e-5
    assert report.max_abs_err < TOLERANCE
    assert not report.passed, str(report)
    assert report.jax_err > report.budget  # the first output's figures, not the exact second one's
