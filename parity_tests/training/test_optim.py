"""The training library's optimizer against the notebooks' torch setup (Adam/AdamW, LambdaLR warmup, clipping)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.training.optim import OptimConfig, decay_mask, make_optimizer, schedule


def test_warmup_is_the_notebooks_lambda_lr():
    """LambdaLR(lambda i: min(i / warmup, 1)): update k (from 0) uses lr * min(k / warmup, 1)."""
    lr, warmup = 1e-3, 7
    torch_opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda i: min(i / warmup, 1.0))
    ours = schedule(OptimConfig(lr=lr, warmup_steps=warmup))
    for k in range(12):
        assert np.isclose(float(ours(k)), torch_opt.param_groups[0]["lr"], rtol=1e-6, atol=0), k
        torch_opt.step()
        sched.step()


def test_cosine_and_linear_decay_end_where_asked():
    cosine = schedule(OptimConfig(lr=1.0, warmup_steps=10, decay="cosine", total_steps=110, end_lr_ratio=0.1))
    linear = schedule(OptimConfig(lr=1.0, warmup_steps=10, decay="linear", total_steps=110))
    assert float(cosine(10)) == pytest.approx(1.0) and float(cosine(110)) == pytest.approx(0.1)
    assert float(cosine(60)) == pytest.approx(0.55, abs=1e-6)  # halfway down the cosine
    assert float(linear(60)) == pytest.approx(0.5) and float(linear(110)) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="needs total_steps > warmup_steps"):
        OptimConfig(decay="cosine", warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match="needs total_steps"):  # a task config's optim leaves it to the run
        schedule(OptimConfig(decay="cosine"))


def test_decay_mask_spares_biases_norms_and_embeddings():
    from flax_transformer.models.former import CTransformer

    model = CTransformer(8, 2, 1, 6, 20, 2, rngs=nnx.Rngs(0))
    mask = decay_mask(nnx.state(model, nnx.Param))
    decayed = {".".join(str(getattr(p, "key", p)) for p in path[:-1])
               for path, flag in jax.tree_util.tree_flatten_with_path(mask)[0] if flag}
    assert decayed == {"tblocks.0.mhattention.tokeys.kernel", "tblocks.0.mhattention.toqueries.kernel",
                       "tblocks.0.mhattention.tovalues.kernel", "tblocks.0.mhattention.unifyheads.kernel",
                       "tblocks.0.ff.0.kernel", "tblocks.0.ff.2.kernel", "toprobs.kernel"}


@pytest.fixture
def standard_promotion():
    """optax's bias correction mixes a Python float with its int32 step count, which the suite's
    strict dtype promotion refuses; optax is not ours to change."""
    import jax

    with jax.numpy_dtype_promotion("standard"):
        yield


def test_train_step_learns_compiles_once_and_follows_the_mode(standard_promotion):
    """A tiny classifier learns "does token 1 occur?"; the step is traced once for one batch shape."""
    from flax_transformer.models.former import CTransformer
    from flax_transformer.training.step import cross_entropy, make_steps

    traces = []

    def loss_fn(model, batch):
        traces.append(1)  # runs only while tracing
        logp = model(batch["ids"], batch["mask"])
        accuracy = (logp.argmax(-1) == batch["labels"]).mean()
        return cross_entropy(logp, batch["labels"]), {"accuracy": accuracy}

    model = CTransformer(16, 2, 1, 12, 20, 2, dropout=0.1, rngs=nnx.Rngs(params=0, dropout=1))
    optimizer = nnx.Optimizer(model, make_optimizer(OptimConfig(lr=3e-3, warmup_steps=5)), wrt=nnx.Param)
    train_step, eval_step = make_steps(loss_fn)
    rng = np.random.default_rng(0)

    def batch():
        ids = rng.integers(2, 20, size=(32, 12))
        labels = rng.integers(0, 2, size=32)
        ids[labels == 1, rng.integers(0, 12)] = 1
        return {"ids": jnp.asarray(ids), "mask": jnp.ones((32, 12), jnp.int32), "labels": jnp.asarray(labels)}

    model.train()
    first = [float(train_step(model, optimizer, batch())["loss"]) for _ in range(5)]
    for _ in range(150):
        metrics = train_step(model, optimizer, batch())
    assert len(traces) == 1, "the train step was traced more than once"
    assert float(metrics["loss"]) < 0.5 * np.mean(first) and np.isfinite(float(metrics["grad_norm"]))
    model.eval()
    held_out = eval_step(model, batch())
    assert float(held_out["accuracy"]) >= 0.9
    same = batch()
    assert float(eval_step(model, same)["loss"]) == float(eval_step(model, same)["loss"])  # no dropout in eval


@pytest.mark.parametrize("family", ["former", "encoder", "gpt", "classic", "gemma", "gpt_oss"])
@pytest.mark.keep_cases("former", "gpt", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_training_trajectories_match_torch_for_every_family(family):
    """``verify --train-steps``: the notebooks' torch setup and the optax chain, 4 AdamW steps with
    warmup and clipping, from the same weights on the same batches."""
    from flax_transformer.training import parity

    result = parity.trajectory(family, steps=4, optimizer="adamw")
    assert result.loss_err <= 1e-5, result.torch_losses + result.jax_losses
    assert result.param_err <= 1e-5, (result.worst_param, result.param_err)
    assert result.passed
    # only parameters with an exactly-zero gradient are set aside: the key biases of the per-head attentions
    assert all(k.endswith(("k.bias", "key_tfm.bias")) for k in result.noise_params), sorted(result.noise_params)


def test_training_trajectory_check_can_fail(monkeypatch):
    """An optax chain that differs from torch's (eps 1e-3 instead of 1e-8) is caught."""
    from flax_transformer.training import optim, parity

    real = optim.make_optimizer
    monkeypatch.setattr(parity, "make_optimizer",
                        lambda config: real(dataclasses.replace(config, eps=1e-3)))
    assert not parity.trajectory("gpt", steps=3, optimizer="adam").passed


def test_task_configs_nest_one_run_and_one_optim_config():
    """Issue 13 item 5: the run's and the optimizer's fields live once, in ``RunConfig`` and
    ``OptimConfig``; flat names (flags, presets) are routed to them, and an old flat run.json reads back."""
    import dataclasses

    from flax_transformer.training import classify, lm, seq2seq
    from flax_transformer.training.optim import from_task
    from flax_transformer.training.run_config import RunConfig, field_names, from_dict, replace

    for cls in (classify.ClassifyConfig, lm.LMConfig, seq2seq.Seq2SeqConfig):
        own = {f.name for f in dataclasses.fields(cls)}
        assert {"run", "optim"} <= own and not own & {"lr", "steps", "seed", "batch_size", "clip_norm"}
        assert {"lr", "steps", "seed", "batch_size", "clip_norm", "b2"} <= field_names(cls)
    config = lm.LMConfig.tiny(steps=7, lr=0.5, seed=3, context=32)
    assert (config.run.steps, config.optim.lr, config.run.seed, config.context) == (7, 0.5, 3, 32)
    assert replace(config, b2=0.95).optim == dataclasses.replace(config.optim, b2=0.95)
    with pytest.raises(TypeError, match="no field 'nope'"):
        replace(config, nope=1)
    with pytest.raises(ValueError, match="--batch-size must be at least 1"):
        replace(config, batch_size=0)
    with pytest.raises(ValueError, match="--b1 must be at least 0 and below 1"):
        replace(config, b1=1.0)
    with pytest.raises(ValueError, match="--run must be RunConfig"):
        dataclasses.replace(config, run={"steps": 3})
    assert from_task(config, 7) == dataclasses.replace(config.optim, total_steps=7, warmup_steps=6)

    saved = dataclasses.asdict(config)
    assert from_dict(lm.LMConfig, saved) == config
    flat = {k: v for k, v in saved.items() if k not in ("run", "optim")}
    flat.update(saved["run"])
    flat.update({k: saved["optim"][k] for k in ("optimizer", "lr", "warmup_steps", "decay", "weight_decay",
                                                 "clip_norm")})
    assert from_dict(lm.LMConfig, flat) == config  # a run.json written before the nesting
    with pytest.raises(TypeError, match="unknown field"):
        from_dict(lm.LMConfig, {**flat, "lrr": 1})
    assert isinstance(seq2seq.Seq2SeqConfig().run, RunConfig)
