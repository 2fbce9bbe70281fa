"""The torch training checkpoint's checks: Adam's two moments of one shape, a parameter without
optimizer state after some steps refused, the round-trip check bit for bit.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
Hand-built checkpoints and a tiny CTransformer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import torch_reference.former as tf
from flax_transformer.interop import porting
from flax_transformer.models.former import CTransformer
from flax_transformer.training.optim import OptimConfig
from flax_transformer.training.torch_state import checks, to_jax


@pytest.fixture(scope="module")
def tiny_former():
    return CTransformer(8, 2, 1, 6, 5, 2, rngs=nnx.Rngs(0))


ADAM = OptimConfig(optimizer="adam", lr=1e-3, weight_decay=0.0)


def _checkpoint(**state_changes) -> dict:
    """A one-parameter torch training checkpoint at step 2 that the checks accept, its state[0] changed."""
    state = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)} | state_changes
    group = {"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
             "maximize": False}
    return {"model": {"w": torch.ones(3)}, "step": 2, "scheduler": None,
            "optimizer": {"state": {0: state}, "param_groups": [group]}}


def test_moments_are_adams_own_two_of_one_shape():
    to_jax.check_torch_state(_checkpoint(), ADAM)
    # mutant T10: an AMSGrad entry (or any other) was let through
    with pytest.raises(checks.TorchStateError, match=r"state\[0\] has .*max_exp_avg_sq.*not Adam's"):
        to_jax.check_torch_state(_checkpoint(max_exp_avg_sq=torch.zeros(3)), ADAM)
    # mutant T11: moments of two shapes passed the checks that run before anything is created
    with pytest.raises(checks.TorchStateError, match=r"state\[0\] exp_avg has shape \(3,\) and exp_avg_sq \(4,\)"):
        to_jax.check_torch_state(_checkpoint(exp_avg_sq=torch.zeros(4)), ADAM)


def test_a_parameter_without_optimizer_state_after_some_steps_is_refused(tiny_former):
    # mutant T9: its moments were taken as zeros, whatever the step
    torch_model = porting.flax_to_torch(tiny_former)
    optimizer, scheduler = to_jax.torch_optimizer(torch_model, ADAM)
    torch_model(torch.zeros(2, 6, dtype=torch.long)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    ckpt = {"model": torch_model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": 1}
    to_jax.read_torch_state(ckpt, tiny_former, ADAM)  # whole: accepted
    name = ckpt["optimizer"]["param_groups"][0]["param_names"][0]
    del ckpt["optimizer"]["state"][0]
    with pytest.raises(checks.TorchStateError, match=rf"no state for {name} after 1 steps"):
        to_jax.read_torch_state(ckpt, tiny_former, ADAM)


@pytest.fixture(scope="module")
def former():
    torch.manual_seed(0)
    return porting.torch_to_flax(tf.CTransformer(8, 2, 1, 8, 20, 2).eval())


def test_the_torch_state_round_trip_check_is_bit_for_bit(tmp_path, monkeypatch, former):
    """Guards ``run_export.check_export``'s round trip being bit for bit (``array_equal``), not
    ``allclose``: a parameter, or an Adam moment, one float32 step (``np.nextafter``) off is reported.
    The run is an in-memory one (Adam moments set as after a step), given to ``check_export`` in place
    of a run directory."""
    from flax_transformer.training.optim import OptimConfig, make_optimizer
    from flax_transformer.training.torch_state import run_export, to_torch

    optim = OptimConfig(optimizer="adamw", lr=1e-2, warmup_steps=2, weight_decay=0.1)
    model = nnx.clone(former)
    model.train()
    optimizer = nnx.Optimizer(model, make_optimizer(optim), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    for path, variable in nnx.to_flat_state(nnx.state(optimizer)):  # as after a step (an eager one costs ~10 s)
        value = variable.get_value()
        if "mu" in path or "nu" in path:
            mu = rng.standard_normal(value.shape).astype(np.float32) * 1e-2
            variable.set_value(jnp.asarray(mu if "mu" in path else mu**2 + 1e-6))
        else:  # the step and the counts
            variable.set_value(jnp.ones_like(value))

    def restore_run(run_dir, *, step=None, optim=optim):  # a fresh copy of the run's model and optimizer
        return *nnx.clone((model, optimizer)), optim, 1

    monkeypatch.setattr(run_export, "restore_run", restore_run)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes a Python float with its int32 count
        path = to_torch.save_torch_state(tmp_path / "run.pt", model, optimizer, optim)
        assert run_export.check_export("run", path) == []
        key = next(iter(torch.load(path, weights_only=True)["model"]))
        for what, where in (("parameter", ("model", key)), ("optimizer state", ("optimizer", "state", 0, "exp_avg"))):
            tampered = torch.load(path, weights_only=True)
            holder = tampered
            for name in where[:-1]:
                holder = holder[name]
            value = holder[where[-1]].numpy().copy()
            value.flat[0] = np.nextafter(value.flat[0], np.float32(np.inf), dtype=np.float32)  # one float32 step
            holder[where[-1]] = torch.from_numpy(value)
            torch.save(tampered, tmp_path / "tampered.pt")
            problems = run_export.check_export("run", tmp_path / "tampered.pt")
            assert len(problems) == 1 and problems[0].startswith(what) and "differs" in problems[0], problems
