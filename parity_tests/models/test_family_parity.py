"""One parity test for every family spec (family_specs.py): each level (attention, block, model) at
each shape and mask case, torch -> Flax and Flax -> torch within TOL (1e-5, matmul precision
"highest"), no NaN or inf, within the float64 budget; eagerly too where the spec asks.

Families on it: classic (notebook 003), gpt (notebook 002) and encoder (notebook 001); what is special to a family (its
tutorial steps, gradients, notebook checkpoints) stays in its own test file.
"""

import pytest

from parity_tests.conftest import assert_both_directions

from . import family_specs
from .family_specs import SPECS


@pytest.mark.parametrize("spec, level, shape, case", family_specs.cases(SPECS))
@pytest.mark.keep_cases(*family_specs.kept(SPECS), reason="the kept cases cover the others: the hardest masks "
                        "(padding, causal+padding, fully masked rows) at each level of each family")
def test_both_directions(spec, level, shape, case, rng):
    assert_both_directions(level.module(shape), level.inputs(rng, case, shape), eager_too=level.eager(case))


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.family)
def test_each_family_runs_attention_and_model_with_padding_and_a_fully_masked_row(spec):
    names = [level.name for level in spec.levels]
    assert "attention" in names and "model" in names and len(names) >= 3, names  # and a block between
    for level in spec.levels:
        assert {"none", "padding", "fully-masked-row"} <= set(level.masks), level.name
        if level.keep is not None:  # None: every case in the default run
            assert level.keep and all(shape in level.shapes and case in level.masks for shape, case in level.keep)
    attention = spec.levels[names.index("attention")]
    assert {"causal+padding"} <= set(attention.masks) and len(attention.shapes) >= 3
