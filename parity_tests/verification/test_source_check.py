"""``source_check``'s parts that need no model (issue 36 item 2): the tensor-by-tensor comparison in canonical
names (what differs, what is only rounded), the grouping of the names the verdict gives, and what a torch
file's dict becomes as a source. The whole check, through the CLI, is ``parity_tests/cli/test_source_cli.py``."""

import ml_dtypes
import numpy as np
import pytest

from flax_transformer.verification import source_check

RNG = np.random.default_rng(0)
SOURCE = {f"model.layers.{i}.self_attn.{n}_proj.weight": RNG.normal(size=(8, 8)).astype(np.float32)
          for i in range(2) for n in "qkvo"} | {"model.norm.weight": RNG.normal(size=(8,)).astype(np.float32)}


def test_equal_tensors_pass():
    diff = source_check.diff(SOURCE, {k: v.copy() for k, v in SOURCE.items()})
    assert diff.passed and diff.compared == 9 and not diff.rounded


def test_a_permuted_and_a_transposed_tensor_are_named():
    wrong = dict(SOURCE)
    for i in range(2):
        wrong[f"model.layers.{i}.self_attn.q_proj.weight"] = SOURCE[f"model.layers.{i}.self_attn.q_proj.weight"][
            [0, 2, 4, 6, 1, 3, 5, 7]]
    wrong["model.layers.1.self_attn.o_proj.weight"] = SOURCE["model.layers.1.self_attn.o_proj.weight"].T
    diff = source_check.diff(SOURCE, wrong)
    assert not diff.passed
    assert diff.names() == ["model.layers.*.self_attn.q_proj.weight (layers 0, 1)",
                            "model.layers.*.self_attn.o_proj.weight (layers 1)"]


def test_a_tiny_change_is_a_difference():
    wrong = dict(SOURCE, **{"model.norm.weight": SOURCE["model.norm.weight"] * (1 + 1e-4)})
    assert source_check.diff(SOURCE, wrong).names() == ["model.norm.weight"]


@pytest.mark.parametrize("dtype, name", [(ml_dtypes.bfloat16, "bfloat16"), (np.float16, "float16")])
def test_rounded_to_a_lower_precision_is_not_a_difference(dtype, name):
    """A conversion that stored bf16 (or fp16) holds the source rounded: said, not failed; a value off by more
    than the rounding still fails."""
    rounded = {k: v.astype(dtype).astype(np.float32) for k, v in SOURCE.items()}
    diff = source_check.diff(SOURCE, rounded)
    assert diff.passed and diff.rounded == name
    off = dict(rounded, **{"model.norm.weight": rounded["model.norm.weight"] * 1.5})
    assert source_check.diff(SOURCE, off).names() == ["model.norm.weight"]


def test_keys_and_shapes_on_one_side():
    converted = {k: v for k, v in SOURCE.items() if k != "model.norm.weight"} | {"lm_head.weight": np.zeros((2, 8))}
    converted["model.layers.0.self_attn.v_proj.weight"] = np.zeros((4, 8), np.float32)
    diff = source_check.diff(SOURCE, converted)
    assert (diff.source_only, diff.converted_only) == (("model.norm.weight",), ("lm_head.weight",))
    assert diff.mis_shaped == (("model.layers.0.self_attn.v_proj.weight", (8, 8), (4, 8)),)
    assert diff.names() == ["model.layers.*.self_attn.v_proj.weight (layers 0)"] and not diff.passed


def test_a_tensor_only_in_the_converted_checkpoint_fails():
    """Every source tensor equal, one more converted (a head the source has not): not the source's model."""
    diff = source_check.diff(SOURCE, {**SOURCE, "lm_head.weight": np.zeros((2, 8), np.float32)})
    assert diff.converted_only == ("lm_head.weight",) and not diff.differ and not diff.passed
    assert any("only converted" in line for line in diff.lines()), diff.lines()

def test_a_training_checkpoint_of_a_compiled_model_unwraps():
    state, notes = source_check.unwrap({"model": {"_orig_mod.w": np.zeros(2)}, "optimizer": {}, "step": 1}, "f.pt")
    assert list(state) == ["w"]
    assert notes == ["a training checkpoint: its weights read from its 'model' entry (left out: optimizer, step)",
                     "keys start with `_orig_mod.` (a torch.compile'd model's state_dict): the prefix stripped"]
    with pytest.raises(ValueError, match="f.pt does not hold a state_dict .*: extra are not tensors"):
        source_check.unwrap({"w": np.zeros(2), "extra": "text"}, "f.pt")


def test_a_report_that_ran_nothing_fails():
    side = source_check.Side("x", "an HF folder", "transformers")
    report = source_check.SourceReport(side, side, source_check.diff(SOURCE, SOURCE), not_run="ValueError: shapes")
    assert not report.passed and report.summary().endswith("not compared: ValueError: shapes")


def test_a_nan_in_a_converted_tensor_is_a_difference():
    wrong = dict(SOURCE, **{"model.norm.weight": np.where(np.arange(8) == 3, np.nan, SOURCE["model.norm.weight"])})
    assert source_check.diff(SOURCE, wrong).names() == ["model.norm.weight"]


def test_equal_logits_with_a_differing_tensor_fail():
    """A tensor the logits do not use (changed here, the logits' report passing) still fails the check."""
    from types import SimpleNamespace

    side = source_check.Side("x", "an HF folder", "transformers")
    wrong = dict(SOURCE, **{"model.norm.weight": SOURCE["model.norm.weight"] + 1})
    same = source_check.SourceReport(side, side, source_check.diff(SOURCE, SOURCE), SimpleNamespace(passed=True))
    report = source_check.SourceReport(side, side, source_check.diff(SOURCE, wrong), SimpleNamespace(passed=True))
    assert same.passed and not report.passed
