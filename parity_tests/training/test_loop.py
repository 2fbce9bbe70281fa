"""The run loop: ``fit`` logs what happened and ends with a checkpoint and an eval-mode model, an
infinite loss stops the run, ``make_steps`` reports the gradient norm, a cross-entropy with nothing to
count is zero, not NaN.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
One tiny fit whose every logged number is known in advance.
"""

import jax
import numpy as np
import pytest

# One tiny fit whose every logged number is known in advance: the loss is w·x, so the gradient
# is the batch's x (its norm is known), and each batch carries its own step number.


class _Linear:
    """Batches of x (4,) with a known gradient norm, plus the step number and a poison term."""

    def __init__(self, poison_at=None):
        self.poison_at = poison_at

    def batch(self, step):
        x = np.random.default_rng(step).standard_normal(4).astype(np.float32)
        poison = np.inf if step == self.poison_at else 0.0
        return {"x": x, "step": np.float32(step), "poison": np.float32(poison)}

    def position(self, step):
        return {"step": step}

    def count_tokens(self, batch):
        return 4


def _tiny_model():
    from flax import nnx

    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jax.numpy.zeros(4))
            self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    return Tiny()


def _linear_loss(model, batch):
    jnp = jax.numpy
    loss = jnp.sum(model.w[...] * batch["x"]) + batch["poison"]
    return loss, {"count": jnp.float32(1), "step_seen": batch["step"],
                  "train_mode": jnp.float32(not model.dropout.deterministic)}


def test_fit_logs_what_happened_and_ends_with_a_checkpoint_and_an_eval_mode_model(tmp_path):
    from flax_transformer.training import loop, run_checkpoints, rundir
    from flax_transformer.training.optim import OptimConfig, schedule

    modes = []

    def evaluate(model):
        modes.append(model.dropout.deterministic)
        return {"loss": 0.0, "count": 1.0}

    config = OptimConfig(lr=0.1, warmup_steps=4)
    rundir.create_run_dir(tmp_path, {"x": 1})
    with jax.numpy_dtype_promotion("standard"):  # optax's step count (see test_training.py)
        result = loop.fit(_tiny_model(), config, _linear_loss, _Linear(), run_dir=tmp_path, steps=6,
                          run_config={"x": 1}, evaluate=evaluate, eval_every=3, checkpoint_every=4, log_every=2,
                          progress=False, tensorboard=False)
    assert result.step == 6 and not result.interrupted
    assert result.model.dropout.deterministic, "fit returns its model in eval mode"
    assert modes == [True, True], "evaluation runs in eval mode, at step 3 and once at the end"
    records = rundir.read_metrics(tmp_path)
    assert [(r["step"], r["split"]) for r in records if r["split"] == "eval"] == [(3, "eval"), (6, "eval")]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    norms = [float(np.linalg.norm(_Linear().batch(s)["x"])) for s in range(6)]
    for r in train:  # each line: the mean over the steps since the last one
        s = r["step"]
        assert r["step_seen"] == pytest.approx(s - 1.5), "a train line averages its window of steps"
        assert r["train_mode"] == 1.0, "the train step runs in train mode"
        assert r["grad_norm"] == pytest.approx((norms[s - 2] + norms[s - 1]) / 2, rel=1e-5)
        assert r["lr"] == pytest.approx(float(schedule(config)(s - 1)), rel=1e-6), "lr of the step's update"
    checkpoints = run_checkpoints.Checkpoints(tmp_path)
    try:
        assert checkpoints.steps()[-1] == 6, "the last step is saved"
    finally:
        checkpoints.close()


def test_an_infinite_loss_stops_the_run(tmp_path):
    from flax_transformer.training import errors, loop, rundir
    from flax_transformer.training.optim import OptimConfig

    rundir.create_run_dir(tmp_path, {"x": 1})
    with jax.numpy_dtype_promotion("standard"), pytest.raises(errors.NonFiniteLoss, match="loss is inf at step 3"):
        loop.fit(_tiny_model(), OptimConfig(lr=0.1), _linear_loss, _Linear(poison_at=2), run_dir=tmp_path, steps=6,
                 run_config={"x": 1}, checkpoint_every=10, progress=False, tensorboard=False)


def test_make_steps_reports_the_gradient_norm():
    from flax import nnx

    from flax_transformer.training.optim import OptimConfig, make_optimizer
    from flax_transformer.training.step import make_steps

    model = _tiny_model()
    optimizer = nnx.Optimizer(model, make_optimizer(OptimConfig(lr=0.1)), wrt=nnx.Param)
    train_step, _ = make_steps(_linear_loss)
    for step in range(2):  # the gradient of w·x is x, whatever w
        batch = _Linear().batch(step)
        with jax.numpy_dtype_promotion("standard"):
            metrics = train_step(model, optimizer, batch)
        assert float(metrics["grad_norm"]) == pytest.approx(float(np.linalg.norm(batch["x"])), rel=1e-6)


def test_cross_entropy_with_nothing_to_count_is_zero_not_nan():
    from flax_transformer.training.step import cross_entropy

    logits, labels = jax.numpy.ones((2, 3, 5)), jax.numpy.zeros((2, 3), jax.numpy.int32)
    loss, grad = jax.value_and_grad(lambda x: cross_entropy(x, labels, jax.numpy.zeros((2, 3), bool)))(logits)
    assert float(loss) == 0.0 and not np.any(np.asarray(grad))
