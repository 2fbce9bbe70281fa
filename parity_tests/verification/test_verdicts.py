"""Verdicts that cannot be fooled (issue 22): NaN never agrees with NaN, an incomplete report is
not a pass, a failed bisect names where, and ``compare`` holds JAX to torch's own float32 error
against a float64 copy (``bisect``'s budget rule), so an error far below 1e-5 on an output
with small values still fails.

Tiny models, run eagerly where nothing needs a compile.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference.encoder as te
import torch_reference.former as tf
from flax_transformer.interop import porting
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.verification import bisect, bisect_report, compare, reports, verify

IDS = np.random.default_rng(0).integers(0, 20, (2, 8))


def _former(**kw):
    torch_model = tf.CTransformer(16, 4, 2, 8, 20, 3, **kw).eval()
    verify.perturb_torch(torch_model, 0)
    return torch_model, porting.torch_to_flax(torch_model)


def _set(param, index, value):
    """One element of a Flax parameter set to ``value``."""
    param.set_value(param[...].at[index].set(value))


# ------------------------------------------------------------------ non-finite values never agree


def test_nan_on_both_sides_fails_compare_and_bisect_unless_allowed():
    torch_model, _ = _former()
    with torch.no_grad():
        torch_model.tblocks[1].ff[0].bias[3] = float("nan")  # a NaN weight in both frameworks
    flax_model = porting.torch_to_flax(torch_model)

    report = compare.compare(torch_model, flax_model, (IDS,), use_jit=False)
    row = report.rows[0]
    assert not report.passed and row.nonfinite_both > 0 and not row.nonfinite_jax and not row.nonfinite_torch
    assert "not finite in either framework" in report.summary()
    assert not report.finite
    assert compare.compare(torch_model, flax_model, (IDS,), use_jit=False, allow_nonfinite=True).passed

    found = bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False, allow_skipped=True)
    assert not found.passed, str(found)
    assert found.first_divergent == "tblocks.1.ff.0" == found.first_nonfinite, str(found)  # its inputs finite
    assert found._row("").status == bisect_report.BOTH_NONFINITE
    assert "not finite in either framework" in found.summary()
    allowed = bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False, allow_skipped=True, allow_nonfinite=True)
    assert allowed.passed and allowed.first_divergent is None, str(allowed)
    assert allowed.first_nonfinite == "tblocks.1.ff.0"  # still reported


def test_nan_only_in_jax_fails_and_bisect_names_the_producing_module():
    torch_model, flax_model = _former()
    _set(flax_model.tblocks[1].ff[0].bias, 3, jnp.nan)
    report = compare.compare(torch_model, flax_model, (IDS,), use_jit=False)
    assert not report.passed and report.rows[0].nonfinite_jax > 0, str(report)
    assert not compare.compare(torch_model, flax_model, (IDS,), use_jit=False, allow_nonfinite=True).passed

    found = bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False, allow_skipped=True, allow_nonfinite=True)
    assert not found.passed
    assert found.first_divergent == "tblocks.1.ff.0" == found.first_nonfinite, str(found)
    row = found._row("tblocks.1.ff.0")
    assert row.status == "introduced" and row.produced == "JAX" and row.jax_err == float("inf")
    upstream = found.rows[:found.rows.index(row)]
    assert all(r.status == "ok" or r.status.startswith(("skipped", "covered")) for r in upstream), str(found)


def test_inf_produced_inside_a_module_from_finite_inputs_is_named():
    """A module whose own computation (not a weight) makes the inf: its inputs are finite."""
    torch_model, flax_model = _former()
    norm = flax_model.tblocks[0].norm2
    cls = type(norm)
    norm.__class__ = type(cls)("Overflowing" + cls.__name__, (cls,),
                               {"__call__": lambda self, x: cls.__call__(self, x) * jnp.float32(1e38) * 10})
    found = bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False, allow_skipped=True)
    assert found.first_divergent == "tblocks.0.norm2" == found.first_nonfinite, str(found)
    assert not compare.compare(torch_model, flax_model, (IDS,), use_jit=False).passed


def test_nan_gradients_fail_in_compare_and_bisect():
    torch_model, flax_model = _former()
    # JAX only: one NaN in a weight's gradient path (a bias the outputs do not use stays finite)
    _set(flax_model.toprobs.kernel, (0, 0), jnp.nan)
    report = compare.compare(torch_model, flax_model, (IDS,), grads=True)
    assert not report.passed and sum(r.nonfinite_jax for r in report.rows[1:]) > 0, str(report)
    found = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False, allow_skipped=True)
    assert found.first_divergent == "toprobs" and found.first_divergent_grad is not None, str(found)
    # both frameworks: the same NaN weight in torch too
    with torch.no_grad():
        torch_model.toprobs.weight[0, 0] = float("nan")
    flax_model = porting.torch_to_flax(torch_model)
    report = compare.compare(torch_model, flax_model, (IDS,), grads=True)
    assert not report.passed and sum(r.nonfinite_both for r in report.rows[1:]) > 0, str(report)
    found = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False, allow_skipped=True)
    assert not found.passed and any(g.status == bisect_report.BOTH_NONFINITE for g in found.grad_rows), str(found)


# ------------------------------------------------------------------ incomplete is not passed


def test_skipped_module_calls_and_gradients_fail_unless_allowed():
    torch_model, flax_model = _former()

    class WithExtra(type(torch_model)):  # a torch layer with parameters and no Flax twin, called: not compared
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs) + 0 * self.extra(self.extra.weight.new_zeros(1, 2)).sum()

    torch_model.extra = torch.nn.Linear(2, 2)
    torch_model.__class__ = WithExtra
    report = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False)
    skipped_calls = [r.path for r in report.rows if r.status.startswith("skipped")]
    # the embeddings the Flax twin reads as tables are covered, not skipped (in their parent's row)
    assert any(r.status == bisect_report.COVERED_READ for r in report.rows), report.tree()
    assert skipped_calls == ["extra"] and report.incomplete == ["extra", "gradient extra.weight", "gradient extra.bias"]
    assert not report.passed and report.first_divergent == bisect_report.INCOMPLETE, str(report)
    first = report.summary().splitlines()[0]
    assert first.startswith(f"INCOMPLETE: {len(skipped_calls)} of {len(report.rows)} module calls and 2 of "
                            f"{len(report.grad_rows)} gradients not compared"), first
    assert all(name in first for name in report.incomplete)
    assert json.loads(report.to_json())["incomplete"] == report.incomplete

    allowed = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False, allow_skipped=True)
    assert allowed.passed and allowed.first_divergent is None, str(allowed)
    assert allowed.summary().splitlines()[0].startswith("ALLOWED INCOMPLETE (allow_skipped): ")


class _Tagged(torch.nn.Module):
    """A torch Linear whose call also returns a label, and one that cannot run in float64."""

    def __init__(self, float32_constant=False):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.float32_constant = float32_constant

    def forward(self, x):
        y = self.linear(x)
        if self.float32_constant:
            return y @ torch.ones(3, 3)  # a float32 constant: the float64 copy raises
        return y, np.array(["label"])  # an array of strings: not numeric, so not compared


def _flax_tagged(torch_module, label=True):
    from flax import nnx

    class Tagged(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            self.linear.kernel.set_value(jnp.asarray(torch_module.linear.weight.detach().numpy().T))
            self.linear.bias.set_value(jnp.asarray(torch_module.linear.bias.detach().numpy()))

        def __call__(self, x):
            y = self.linear(x)
            return (y, np.array(["label"])) if label else y @ jnp.ones((3, 3))

    return Tagged()


def test_compare_fails_on_what_it_could_not_compare_unless_allowed():
    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    pair = _Tagged()
    report = compare.compare(pair, _flax_tagged(pair), (x,), use_jit=False)
    assert report.skipped and "output[1]" in report.skipped[0] and not report.passed, str(report)
    assert report.summary().startswith("INCOMPLETE: 1 not compared: output[1]")
    allowed = compare.compare(pair, _flax_tagged(pair), (x,), use_jit=False, allow_skipped=True)
    assert allowed.passed and allowed.summary().startswith("ALLOWED INCOMPLETE (allow_skipped)"), str(allowed)

    no_fp64 = _Tagged(float32_constant=True)
    report = compare.compare(no_fp64, _flax_tagged(no_fp64, label=False), (x,), use_jit=False)
    assert not report.passed and "the float64 reference did not run" in report.skipped[0], str(report)
    assert report.rows[0].max_abs_err < 1e-6 and report.jax_err is None  # measured, but the verdict is incomplete:
    assert np.isnan(report.max_abs_err) and not report.finite  # the report's figures never read as agreement


def test_first_divergent_names_the_whole_model_when_only_it_is_wrong(tmp_path):
    from flax import nnx

    torch.manual_seed(0)
    torch_model = torch.nn.Linear(4, 3).eval()
    flax_model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    flax_model.kernel.set_value(jnp.asarray(torch_model.weight.detach().numpy().T))
    flax_model.bias.set_value(jnp.asarray(torch_model.bias.detach().numpy()) + 1e-3)  # the model's own row only
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    report = bisect.bisect(torch_model, flax_model, (x,), use_jit=False)
    assert not report.passed
    assert report.first_divergent == bisect_report.MODEL == "<model>" and report.first_divergent  # truthy
    assert json.loads(report.to_json())["first_divergent"] == "<model>"
    assert "error introduced in <model> (Linear)" in report.summary()
    assert "<-- first divergent" in report.tree()


def test_a_gradient_only_failure_names_gradients():
    torch_model, flax_model = _former()
    report = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False, allow_skipped=True)
    report.grad_rows[0] = bisect_report.GradRow(report.grad_rows[0].name, 1e-7, 1.0, 1.0, "diverged")
    report.first_divergent_grad = report.grad_rows[0].name
    assert report.settle().first_divergent == bisect_report.GRADIENTS and not report.passed


# ------------------------------------------------------------------ compare against float64


def _small_feed_forward(seed):
    """A feed-forward block (linear -> exact GELU -> linear) on inputs of about 0.2: its outputs are
    within about 0.25, so a tanh GELU's error (4e-6 to 6e-6 on these seeds) is below 1e-5, yet 9 to
    13 times JAX's float64 budget; a correct port uses at most 0.06 of it."""
    cfg = EncoderConfig.tiny(vocab_size=20, hidden_size=16, num_attention_heads=4, max_position_embeddings=8)
    torch.manual_seed(seed)
    torch_model = te.FeedForward(cfg).eval()
    x = 0.2 * np.random.default_rng(seed).standard_normal((2, 6, 16)).astype(np.float32)
    return torch_model, x


SEEDS = range(5)


@pytest.mark.parametrize("seed", SEEDS)
def test_small_activation_tanh_gelu_fails_compare_and_a_correct_port_passes(seed):
    torch_model, x = _small_feed_forward(seed)
    correct = compare.compare(torch_model, porting.torch_to_flax(torch_model), (x,), use_jit=False)
    assert correct.passed and correct.jax_err <= 0.5 * correct.budget, str(correct)
    broken = porting.torch_to_flax(torch_model)
    broken.hidden_act = "gelu_new"  # tanh GELU for exact GELU
    report = compare.compare(torch_model, broken, (x,), use_jit=False)
    assert report.max_abs_err < reports.TOLERANCE  # the absolute figure alone would pass it
    assert not report.passed and report.jax_err > 4 * report.budget, str(report)
