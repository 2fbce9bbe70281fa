"""One parity test for every family spec (family_specs.py): each level (attention, block, model) at
each shape and mask case, torch -> Flax and Flax -> torch within TOL (1e-5, matmul precision
"highest"), no NaN or inf, within the float64 budget; eagerly too where the spec asks.

Families on it: classic (notebook 003), gpt (notebook 002), encoder (notebook 001) and former (notebooks
000 and 004); what is special to a family (its
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
    assert_both_directions(level.module(shape, case), level.inputs(rng, case, shape), eager_too=level.eager(case))


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.family)
def test_each_family_runs_attention_and_model_with_padding_and_a_fully_masked_row(spec):
    kinds = [level.level_kind for level in spec.levels]
    assert {"attention", "block", "model"} <= set(kinds), kinds
    for level in spec.levels:
        assert {"none", "padding", "fully-masked-row"} <= set(level.masks), level.name
        if level.keep is not None:  # None: every case in the default run
            assert level.keep and all(shape in level.shapes and case in level.masks for shape, case in level.keep)
    attention = spec.levels[kinds.index("attention")]
    assert {"causal+padding"} <= set(attention.masks) and len(attention.shapes) >= 3
