"""``fit(..., wrt=FILTER)``: only the variables the filter names train (a LoRA run's adapters and
head); the rest of the model gets no gradient, keeps its values bit for bit, and has no optimizer
state, and a resumed run equals the uninterrupted one."""

import jax
import numpy as np
from flax import nnx

from flax_transformer.training import errors, loop
from flax_transformer.training.optim import OptimConfig
from parity_tests.training.test_run_faults import Batches, _loss, _raw_restore

HEAD = nnx.All(nnx.Param, nnx.PathContains("toprobs"))  # the classifier's output layer alone


def _fit(run_dir, *, steps=6, resume=False, wrt=HEAD):
    from flax_transformer.models.former import CTransformer

    model = CTransformer(8, 2, 1, 8, 64, 2, rngs=nnx.Rngs(params=0, dropout=1))
    before = {k: np.asarray(v) for k, v in _flat(model).items()}
    with jax.numpy_dtype_promotion("standard"):  # optax mixes a Python float with its int32 step count
        result = loop.fit(model, OptimConfig(lr=1e-1), _loss, Batches(), run_dir=run_dir, steps=steps,
                          run_config={"x": 1}, checkpoint_every=3, resume=resume, progress=False, tensorboard=False,
                          wrt=wrt)
    return before, result


def _flat(model) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in
            jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]}


def test_only_the_filtered_variables_train_and_hold_optimizer_state(tmp_path):
    before, result = _fit(tmp_path / "run")
    after = {k: np.asarray(v) for k, v in _flat(result.model).items()}
    moved = sorted(k for k in after if not np.array_equal(after[k], before[k]))
    assert moved and all("toprobs" in k for k in moved), moved
    assert all(np.array_equal(after[k], before[k]) for k in after if "toprobs" not in k)
    saved = _raw_restore(tmp_path / "run" / "checkpoints" / "6")
    moments = [k for k in saved if k.startswith("['optimizer']['opt_state']") and ("['mu']" in k or "['nu']" in k)]
    assert moments and all("toprobs" in k for k in moments), moments  # nothing for the frozen encoder


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    _, whole = _fit(tmp_path / "whole")
    _fit(tmp_path / "run", steps=3)
    _, resumed = _fit(tmp_path / "run", resume=True)
    got, want = _flat(resumed.model), _flat(whole.model)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_the_step_differentiates_only_what_trains():
    """The step's gradient (its ``grad_norm``) is the trained variables' alone: the frozen encoder's
    weight gradients are not computed, which is what makes a LoRA step cheaper than a full one."""
    import optax

    from flax_transformer.models.former import CTransformer
    from flax_transformer.training.optim import make_optimizer
    from flax_transformer.training.step import make_steps

    model = CTransformer(8, 2, 1, 8, 64, 2, rngs=nnx.Rngs(params=0, dropout=1))
    model.eval()  # no dropout: the manual gradient below sees the same function
    batch = Batches().batch(0)
    head = nnx.grad(lambda m: _loss(m, batch)[0], argnums=nnx.DiffState(0, HEAD))(model)
    with jax.numpy_dtype_promotion("standard"):
        optimizer = nnx.Optimizer(model, make_optimizer(OptimConfig(lr=1e-1)), wrt=HEAD)
        metrics = make_steps(_loss)[0](model, optimizer, batch)
    assert np.isclose(float(metrics["grad_norm"]), float(optax.tree.norm(head)), rtol=1e-5, atol=0)


def test_a_torch_training_checkpoint_cannot_start_a_partial_run(tmp_path):
    import pytest

    from flax_transformer.models.former import CTransformer

    model = CTransformer(8, 2, 1, 8, 64, 2, rngs=nnx.Rngs(params=0, dropout=1))
    with pytest.raises(errors.RunError, match="trains a part"):
        loop.fit(model, OptimConfig(lr=1e-1), _loss, Batches(), run_dir=tmp_path / "run", steps=2, run_config={},
                 init_from_torch=tmp_path / "ckpt.pt", wrt=HEAD, progress=False)
