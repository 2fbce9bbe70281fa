"""The progress figures of ``fit`` mean what they say (issue 21, item 6): ``tokens_per_s`` (the bar's
``tok_s``) is the train steps' rate, not lowered by an evaluation that falls in its window, and the
evaluation's own time is logged apart (``eval_s``).

The loop's clock is replaced by a fake one that moves 1 ms per reading and 1000 s per evaluation, so
that the figures are exact: every window trains at the same rate, whatever happened between its steps.
Before the fix, a window holding an evaluation showed about a millionth of the others' rate.
"""

import types

import jax
import pytest
from flax import nnx

from flax_transformer.training import loop, rundir
from flax_transformer.training.optim import OptimConfig
from parity_tests.training.test_run_faults import Batches, _loss  # the same tiny task

TOKENS = 4 * 8  # ids of every batch (test_run_faults.Batches): 4 rows of 8


class Clock:
    """``perf_counter`` moving 1 ms at each reading; ``wait`` moves it on as a slow evaluation would."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1e-3
        return self.now

    def wait(self, seconds):
        self.now += seconds


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax mixes a Python float with its int32 step count, which the suite's strict promotion refuses."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def test_an_evaluation_does_not_lower_the_logged_tokens_per_second(tmp_path, monkeypatch, capsys):
    from flax_transformer.models.former import CTransformer

    clock = Clock()
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))

    def slow_evaluation(model):
        clock.wait(1000.0)
        return {"loss": 0.5, "count": 4.0}

    model = CTransformer(8, 2, 1, 8, 20, 2, rngs=nnx.Rngs(params=0, dropout=1))
    result = loop.fit(model, OptimConfig(lr=1e-2), _loss, Batches(), run_dir=tmp_path, steps=30, run_config={"x": 1},
                      evaluate=slow_evaluation, eval_every=10, checkpoint_every=15, log_every=5, progress=False,
                      tensorboard=False)
    assert result.step == 30 and not result.interrupted
    records = rundir.read_metrics(tmp_path)
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    # the windows after an evaluation (steps 11-15, 21-25) and a checkpoint (16-20) train as fast as the others
    rates = {r["step"]: r["tokens_per_s"] for r in train}
    assert rates[15] == pytest.approx(rates[10], rel=1e-6) and rates[25] == pytest.approx(rates[10], rel=1e-6), rates
    # each step read the clock twice (1 ms apart): 5 steps of 32 tokens in 5 ms, in every window
    for record in train:
        assert record["tokens_per_s"] == pytest.approx(5 * TOKENS / 5e-3, rel=1e-6), record
    # the evaluations' time, apart: at steps 10 and 20, and the final one
    assert [r["step"] for r in evals] == [10, 20, 30]
    for record in evals:
        assert record["eval_s"] == pytest.approx(1000.0, abs=0.01), record
        assert record["loss"] == 0.5
    assert "eval_s" not in result.metrics  # the evaluation's own figures, as the evaluator gave them
    assert "step 10: loss 0.5000 (1000.0 s)" in capsys.readouterr().err
