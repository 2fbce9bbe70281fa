"""``bisect`` names the right module and gradient: a NaN made in torch only, the first wrong gradient
in backward order and of the wrong module, the gradient budget over the model, a Flax twin holding only
some of a module's parameters, and a subclass that calls ``super().__call__`` recorded once.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
Tiny pairs (two Linears, a two-block classifier), eager bisects.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import torch_reference.former as tf
from flax_transformer.interop import porting
from flax_transformer.verification import bisect, bisect_report, bisect_rows, precision, verify

X = np.ones((2, 3), np.float32)


class TorchLog(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)  # NaN for x < 0


class TorchWithLog(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = TorchLog()

    def forward(self, x):
        return self.a(x) * 1.0


class FlaxLogAbs(nnx.Module):
    def __call__(self, x):
        return jnp.log(jnp.abs(x))


class FlaxWithLog(nnx.Module):
    def __init__(self):
        self.a = FlaxLogAbs()

    def __call__(self, x):
        return self.a(x) * 1.0


def test_bisect_names_the_module_that_made_a_nan_in_torch_only():
    # mutant B2: only JAX was asked whether a call produced the NaN
    report = bisect.bisect(TorchWithLog(), FlaxWithLog(), (-X,), use_jit=False)
    assert not report.passed and report.first_nonfinite == "a" == report.first_divergent, str(report)
    assert report._row("a").produced == "torch" and report._row("a").status == bisect_report.TORCH_NONFINITE
    assert "first produced at a" in report.summary()


@jax.custom_vjp
def _doubled_backward(x):
    return x


_doubled_backward.defvjp(lambda x: (x, None), lambda _, g: (2 * g,))


class TorchTwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.lin2(self.lin1(x))


class FlaxTwoLinearsWrongBackward(nnx.Module):
    """The right forward pass; every gradient doubled (the backward goes wrong after lin2)."""

    def __init__(self):
        self.lin1, self.lin2 = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 3, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return _doubled_backward(self.lin2(self.lin1(x)))


def test_first_divergent_grad_is_the_first_wrong_one_in_backward_order():
    # mutant B4: min for max took the first-called module's parameter (lin1), not where the backward first shows
    torch.manual_seed(0)
    torch_model, flax_model = TorchTwoLinears(), FlaxTwoLinearsWrongBackward()
    porting.load_state_dict(flax_model, {k: v.detach().numpy() for k, v in torch_model.state_dict().items()},
                            strict=True)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    report = bisect.bisect(torch_model, flax_model, (x,), grads=True, use_jit=False)
    assert report.first_divergent == bisect_report.GRADIENTS, str(report)  # the forward agrees
    assert all(g.status == "diverged" for g in report.grad_rows), str(report)
    assert report.first_divergent_grad.startswith("lin2."), str(report)


def test_grad_budget_takes_the_largest_torch_error_and_scale_over_the_model():
    # mutant B5: min for max on torch's gradient error made the budget too tight for correct ports
    scale, limit = precision.grad_budget({"a.weight": (1e-6, 1.0), "b.bias": (0.0, 2.0)})
    assert scale == 2.0 and limit == pytest.approx(precision.budget(1e-6, 2.0)) == pytest.approx(1e-5)


def test_a_module_whose_flax_twin_holds_only_some_of_its_parameters_is_skipped():
    # mutant B7: any() for all() called a Linear "covered" when Flax held its weight but no bias
    linear = torch.nn.Linear(4, 4)
    assert bisect_rows.not_called_status(linear, "emb", (set(), {"emb.weight"})).startswith("skipped")
    assert bisect_rows.not_called_status(linear, "emb", (set(), {"emb.weight", "emb.bias"})) == bisect_report.COVERED_READ


IDS = np.random.default_rng(0).integers(0, 20, (2, 8))


def _former():
    torch_model = tf.CTransformer(8, 2, 1, 8, 20, 3).eval()
    verify.perturb_torch(torch_model, 0)  # fresh LayerNorms are ones and zeros: noise makes them matter
    return torch_model, porting.torch_to_flax(torch_model)


def test_first_divergent_grad_is_the_first_wrong_parameter_of_the_wrong_module():
    """Guards ``_first_divergent_grad`` naming the *last* diverged parameter of the module where the
    forward first went wrong: both of ``toprobs``' parameters are wrong, the weight comes first."""
    torch_model, flax_model = _former()
    head = flax_model.toprobs
    head.kernel.set_value(head.kernel[...].at[0, 0].add(0.1))  # one class's score: not a shift of all
    head.bias.set_value(head.bias[...].at[1].add(0.1))
    report = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False)
    assert report.first_divergent == "toprobs", str(report)
    wrong = [g.name for g in report.grad_rows if g.status == "diverged"]
    assert {"toprobs.weight", "toprobs.bias"} <= set(wrong), str(report)
    assert report.first_divergent_grad == "toprobs.weight", str(report)


def _wrong_backward_linear(module):
    """Give one ``nnx.Linear`` a right forward and a wrong backward: its weight and bias gradients doubled."""

    @jax.custom_vjp
    def dense(x, w, b):
        return x @ w + b

    def fwd(x, w, b):
        return dense(x, w, b), (x, w)

    def bwd(res, g):
        x, w = res
        flat_x, flat_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        return g @ w.T, 2 * flat_x.T @ flat_g, 2 * flat_g.sum(0)

    dense.defvjp(fwd, bwd)
    cls = type(module)
    module.__class__ = type(cls)(f"WrongBackward{cls.__name__}", (cls,),
                                 {"__call__": lambda self, x: dense(x, self.kernel[...], self.bias[...])})


def test_first_divergent_grad_with_a_right_forward_is_the_first_wrong_parameter():
    """The same bug on the other path: the forward agrees, one Linear's backward is wrong for both its
    parameters; the first in backward order (its weight, then its bias) is named, not the last."""
    torch_model, flax_model = _former()
    _wrong_backward_linear(flax_model.tblocks[0].ff[0])
    report = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False, allow_skipped=True)
    wrong = [g.name for g in report.grad_rows if g.status == "diverged"]
    assert wrong == ["tblocks.0.ff.0.weight", "tblocks.0.ff.0.bias"], str(report)
    assert report.first_divergent == bisect_report.GRADIENTS, str(report)
    assert report.first_divergent_grad == "tblocks.0.ff.0.weight", str(report)


class _Doubled(nnx.Linear):
    """A user's layer on top of a library one: its ``__call__`` calls ``super().__call__``."""

    def __call__(self, x):
        return 2.0 * super().__call__(x)


class _Pair(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 6, rngs=rngs)  # the parent class is in the model too
        self.b = _Doubled(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


class _TorchDoubled(torch.nn.Linear):
    def forward(self, x):
        return 2.0 * super().forward(x)


class _TorchPair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 6), _TorchDoubled(6, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("use_jit", [False, True])
def test_a_subclass_calling_super_is_recorded_once(use_jit):
    """Guards ``capture``'s wrapper recording a layer twice when its ``__call__`` calls ``super().__call__``
    and the parent class is also in the model (both classes wrapped): the inner call, without the
    subclass's own step, would be compared with torch's whole layer and flag a correct port."""
    from flax_transformer.verification import capture

    torch.manual_seed(0)
    torch_model = _TorchPair().eval()
    flax_model = _Pair(nnx.Rngs(0))
    porting.load_state_dict(flax_model, {k: v.numpy() for k, v in torch_model.state_dict().items()})
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    _, calls = capture.nnx_calls(flax_model, (jnp.asarray(x),), {}, use_jit=use_jit)
    assert [c.path for c in calls] == ["a", "b", ""]
    report = bisect.bisect(torch_model, flax_model, (x,), use_jit=use_jit)
    assert [r.path for r in report.rows] == ["a", "b", ""], str(report)
    assert report.passed and report.first_divergent is None, str(report)
    assert all(r.status == "ok" for r in report.rows), str(report)
