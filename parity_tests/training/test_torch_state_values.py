"""A torch training checkpoint checked as numbers, and a run read while it trains (issue 22 items 4, 7).

Every moment finite, ``exp_avg_sq`` >= 0, one ``step`` for every parameter, state for the groups'
parameters only, well-formed ``param_groups``: refused by ``import_torch_state`` and by
``--init-from-torch`` (one line, exit 2, naming the file and the entry, nothing created), never
written by ``save_torch_state``, and failing ``port --to torch-state --verify``. A reader of a run
(``load_run``, ``port RUN_DIR``) whose checkpoint is removed mid-read by the trainer's ``keep``
reads the newer one.
"""

import copy
import os
import re
import shutil

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import porting
from flax_transformer.training.optim import OptimConfig
from flax_transformer.training.torch_state.checks import TorchStateError
from flax_transformer.training.torch_state.to_jax import (
    _field_and_param,
    check_torch_state,
    import_torch_state,
    torch_optimizer,
)


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's bias correction mixes a Python float with its int32 step count (strict promotion refuses it)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


CONFIG = OptimConfig(optimizer="adamw", lr=1e-2, warmup_steps=3, weight_decay=0.1, clip_norm=1.0)


def _tiny(seed=0):
    from torch_reference.former import CTransformer

    torch.manual_seed(seed)
    return CTransformer(16, 2, 1, 8, 30, 2, max_pool=False)


def _trained(model, optim: OptimConfig, steps=2) -> dict:
    """A real torch training checkpoint: ``torch_optimizer``'s AdamW and LambdaLR after ``steps`` updates
    of a loss that reaches every parameter."""
    optimizer, scheduler = torch_optimizer(model, optim)
    for i in range(steps):
        optimizer.zero_grad()
        sum(((p - 0.1 * (i + 1)) ** 2).sum() for p in model.parameters()).backward()
        optimizer.step()
        scheduler.step()
    return {"model": model.state_dict(), "optimizer": copy.deepcopy(optimizer.state_dict()),
            "scheduler": scheduler.state_dict(), "step": steps}


def _first(tensor, value):
    tensor.view(-1)[0] = value


def _tamper(case: str, ckpt: dict) -> None:
    opt = ckpt["optimizer"]
    state, groups = opt["state"], opt["param_groups"]
    if case == "inf exp_avg_sq":
        _first(state[1]["exp_avg_sq"], float("inf"))
    elif case == "nan exp_avg_sq":
        _first(state[1]["exp_avg_sq"], float("nan"))
    elif case == "negative exp_avg_sq":
        _first(state[1]["exp_avg_sq"], -1e-3)
    elif case == "nan exp_avg":
        _first(state[1]["exp_avg"], float("nan"))
    elif case == "inf exp_avg":
        _first(state[1]["exp_avg"], -float("inf"))
    elif case == "one step behind":
        state[1]["step"] = torch.tensor(1.0)
    elif case == "step of two values":
        state[1]["step"] = torch.tensor([2.0, 2.0])
    elif case == "state[999]":
        state[999] = copy.deepcopy(state[0])
    elif case == "lr a string":
        groups[0]["lr"] = "fast"
    elif case == "betas of one":
        groups[1]["betas"] = (0.9,)
    elif case == "no eps":
        del groups[0]["eps"]
    elif case == "group a string":
        groups[1] = "group"
    elif case == "index in two groups":
        groups[1]["params"][0] = groups[0]["params"][0]
    elif case == "index a string":
        groups[1]["params"][0] = "a"
    elif case == "name in two groups":
        groups[1]["param_names"][0] = groups[0]["param_names"][0]
    elif case == "nan weight":
        _first(next(iter(ckpt["model"].values())), float("nan"))
    else:
        raise AssertionError(case)


# what each refusal says: the entry, and what is wrong with it
CASES = {
    "inf exp_avg_sq": r"state\[1\] \([\w.]+\) exp_avg_sq holds 1 inf value \(of \d+\)",
    "nan exp_avg_sq": r"state\[1\] \([\w.]+\) exp_avg_sq holds 1 NaN value",
    "negative exp_avg_sq": r"state\[1\] \([\w.]+\) exp_avg_sq holds 1 negative value",
    "nan exp_avg": r"state\[1\] \([\w.]+\) exp_avg holds 1 NaN value",
    "inf exp_avg": r"state\[1\] \([\w.]+\) exp_avg holds 1 inf value",
    "one step behind": r'"step" is 2, but the optimizer has taken 1 steps for state\[1\] \([\w.]+\) \(its other '
                       r"parameters: 2\)",
    "step of two values": r"state\[1\] \([\w.]+\) step is a tensor of shape \(2,\)",
    "state[999]": r"state\[999\] is for no parameter",
    "lr a string": r"param_groups\[0\]\['lr'\] is 'fast'",
    "betas of one": r"param_groups\[1\]\['betas'\] is \(0.9,\)",
    "no eps": r"param_groups\[0\] has no 'eps'",
    "group a string": r"param_groups\[1\] is a str, not a parameter group",
    "index in two groups": r"params entry 0 is in param_groups\[0\] and param_groups\[1\]",
    "index a string": r"param_groups\[1\]\[\"params\"\] holds 'a', not a parameter index",
    "name in two groups": r"param_names entry '[\w.]+' is in param_groups\[0\] and param_groups\[1\]",
    "nan weight": r"\"model\" entry's [\w.]+ holds 1 NaN value",
}


@pytest.fixture(scope="module")
def tiny_checkpoint():
    return _trained(_tiny(), CONFIG)


@pytest.mark.parametrize("case", CASES)
def test_import_refuses_bad_numbers_naming_file_and_entry(case, tiny_checkpoint, tmp_path):
    ckpt = copy.deepcopy(tiny_checkpoint)
    _tamper(case, ckpt)
    path = tmp_path / "tampered.pt"
    torch.save(ckpt, path)
    model = porting.torch_to_flax(_tiny(seed=1))
    before = copy.deepcopy(porting.state_dict(model))
    for call in (lambda: check_torch_state(path, CONFIG), lambda: import_torch_state(path, model, CONFIG)):
        with pytest.raises(TorchStateError, match=CASES[case]) as refused:
            call()
        message = str(refused.value)
        assert message.startswith(f"{path}: ") and "\n" not in message, message
    after = porting.state_dict(model)
    assert all(np.array_equal(before[k], after[k]) for k in before), "a refused import changed the model"
    # the untampered checkpoint imports (the cases above are refused for what was changed)
    import_torch_state(copy.deepcopy(tiny_checkpoint), porting.torch_to_flax(_tiny(seed=1)), CONFIG)


# ----------------------------------------------------------------------------- --init-from-torch


@pytest.fixture(scope="module")
def seq2seq_checkpoint():
    """A torch training checkpoint of ``train.seq2seq --preset tiny --steps 8``'s model, at step 2."""
    from flax_transformer.training import seq2seq
    from flax_transformer.training.torch_state.to_torch import run_optim

    config = seq2seq.Seq2SeqConfig.tiny(steps=8)
    twin = porting.flax_to_torch(seq2seq.build_model(config))
    return _trained(twin, run_optim(config))


@pytest.mark.parametrize("case", CASES)
def test_init_from_torch_refuses_bad_numbers_in_one_line(case, seq2seq_checkpoint, tmp_path, capsys):
    from train.seq2seq import main

    ckpt = copy.deepcopy(seq2seq_checkpoint)
    _tamper(case, ckpt)
    path = tmp_path / "tampered.pt"
    torch.save(ckpt, path)
    run = tmp_path / "run"
    assert main(["--preset", "tiny", "--steps", "8", "--no-progress", "--out", str(run),
                 "--init-from-torch", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert str(path) in errors[0] and re.search(CASES[case], errors[0]), errors[0]
    assert not run.exists()


# ----------------------------------------------------------------------------- writing


def _poisoned(optimizer, field: str, value: float) -> str:
    """Set the first value of the first ``field`` ("mu" or "nu") leaf of ``optimizer`` to ``value``; its parameter path."""
    hit = []

    def poison(path, leaf):
        name, param = _field_and_param(path)
        if name == field and not hit and leaf.ndim:
            hit.append(param)
            return leaf.at[(0,) * leaf.ndim].set(value)
        return leaf

    pure = jax.tree_util.tree_map_with_path(poison, nnx.as_pure(optimizer.opt_state))
    nnx.update(optimizer.opt_state, nnx.state(pure))
    return hit[0]


@pytest.mark.parametrize("field, value, match", [
    ("nu", float("inf"), r"the optimizer's exp_avg_sq of [\w.]+ holds 1 inf value \(of \d+\) at step 2"),
    ("nu", -1.0, r"the optimizer's exp_avg_sq of [\w.]+ holds 1 negative value"),
    ("mu", float("nan"), r"the optimizer's exp_avg of [\w.]+ holds 1 NaN value"),
])
def test_save_torch_state_refuses_a_bad_moment(field, value, match, tiny_checkpoint, tmp_path):
    from flax_transformer.training.torch_state.to_torch import save_torch_state

    model = porting.torch_to_flax(_tiny(seed=1))
    optimizer, _ = import_torch_state(copy.deepcopy(tiny_checkpoint), model, CONFIG)
    _poisoned(optimizer, field, value)
    with pytest.raises(TorchStateError, match=match):
        save_torch_state(tmp_path / "out.pt", model, optimizer, CONFIG)
    assert not (tmp_path / "out.pt").exists()


# ----------------------------------------------------------------------------- a run directory


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny seq2seq run with checkpoints at steps 2, 4 and 6."""
    from flax_transformer.training import seq2seq

    run = tmp_path_factory.mktemp("runs") / "run"
    with jax.numpy_dtype_promotion("standard"):  # (module scope: before the autouse fixture)
        seq2seq.train_and_evaluate(seq2seq.Seq2SeqConfig.tiny(steps=6, checkpoint_every=2, eval_every=6), run,
                                   progress=False)
    return run


def _steps(run) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow(reason="test_port_refuses_to_write_a_run_whose_moment_is_inf, test_save_torch_state_refuses_a_bad_moment")
def test_verify_fails_on_a_bad_moment_naming_it(trained_run, tmp_path):
    """``port --to torch-state --verify``'s check: a file whose exp_avg_sq went below 0 fails, and says so."""
    from flax_transformer.training.torch_state.run_export import check_export, export_run

    export_run(trained_run, tmp_path / "good.pt")
    assert check_export(trained_run, tmp_path / "good.pt") == []
    ckpt = torch.load(tmp_path / "good.pt", weights_only=True)
    _first(ckpt["optimizer"]["state"][0]["exp_avg_sq"], -1e-6)
    torch.save(ckpt, tmp_path / "tampered.pt")
    problems = check_export(trained_run, tmp_path / "tampered.pt")
    assert len(problems) == 1, problems
    assert re.search(r"import_torch_state refuses it: .*state\[0\] \([\w.]+\) exp_avg_sq holds 1 negative value",
                     problems[0]), problems


@pytest.mark.slow(reason="test_save_torch_state_refuses_a_bad_moment (the same check, without training a run)")
def test_port_refuses_to_write_a_run_whose_moment_is_inf(trained_run, tmp_path, capsys):
    """The fault sweep's run: an inf exp_avg_sq in the run's checkpoint. ``port --to torch-state --verify``
    refuses to write it (one line naming the moment, exit 2) instead of passing."""
    from flax_transformer.cli import commands as cli
    from flax_transformer.training.run_checkpoints import Checkpoints
    from flax_transformer.training.torch_state.run_export import restore_run

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    model, optimizer, _, step = restore_run(run)
    like = {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
    reader = Checkpoints(run, read_only=True)
    _, meta = reader.restore(step, like)
    reader.close()
    _poisoned(optimizer, "nu", float("inf"))
    shutil.rmtree(run / "checkpoints" / str(step))
    writer = Checkpoints(run)
    writer.save(step, {"model": nnx.to_pure_dict(nnx.state(model)),
                       "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}, meta)
    writer.close()

    assert cli.main(["port", str(run), str(tmp_path / "bad.pt"), "--to", "torch-state", "--verify"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(r"exp_avg_sq of [\w.]+ holds 1 inf value .* at step 6", err), err
    assert not (tmp_path / "bad.pt").exists()


# ----------------------------------------------------------------------------- a run read while it trains


@pytest.fixture
def training_run(trained_run, tmp_path, monkeypatch):
    """A copy of the run as a reader lists it while the run trains: checkpoints 2 and 4, with 6 being
    written. The first checkpoint read is where the trainer then finishes 6 and removes 4 (its keep of 2)."""
    import orbax.checkpoint as ocp

    run = tmp_path / "live"
    shutil.copytree(trained_run, run)
    os.rename(run / "checkpoints" / "6", tmp_path / "6")
    restore, events = ocp.CheckpointManager.restore, []

    def trainer_moves_on(manager, step, *args, **kwargs):
        if not events:  # between the reader's listing and its read
            events.append(step)
            os.rename(tmp_path / "6", run / "checkpoints" / "6")
            shutil.rmtree(run / "checkpoints" / "4")
        return restore(manager, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", trainer_moves_on)
    return run, events


def test_a_reader_reads_the_newer_checkpoint_when_the_trainer_removes_the_one_it_reads(training_run, trained_run):
    from flax_transformer.training import seq2seq
    from flax_transformer.training.run_checkpoints import Checkpoints

    run, events = training_run
    reader = Checkpoints(run, read_only=True)
    assert reader.steps() == [2, 4]
    model, step = reader.restore_model(seq2seq.build_model(seq2seq.Seq2SeqConfig.tiny()))
    reader.close()
    assert events == [4] and step == 6 and _steps(run) == [2, 6]
    whole = Checkpoints(trained_run, read_only=True)
    want, _ = whole.restore_model(seq2seq.build_model(seq2seq.Seq2SeqConfig.tiny()), 6)
    whole.close()
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(want, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_run_reads_the_newer_checkpoint(training_run, trained_run):
    from flax_transformer.training.run_loading import load_run

    run, events = training_run
    got, want = load_run(run).model, load_run(trained_run).model
    assert events == [4]
    for a, b in zip(jax.tree.leaves(nnx.state(got, nnx.Param)), jax.tree.leaves(nnx.state(want, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_port_reads_the_newer_checkpoint(training_run):
    """``port RUN_DIR --to torch-state`` restores model and optimizer (``restore_checkpoint``) the same way."""
    from flax_transformer.training import seq2seq
    from flax_transformer.training.torch_state.to_torch import restore_checkpoint, run_optim

    run, events = training_run
    config = seq2seq.Seq2SeqConfig.tiny(steps=6)
    _, optimizer, step = restore_checkpoint(run, seq2seq.build_model(config), run_optim(config))
    assert events == [4] and step == 6 and int(optimizer.step[...]) == 6


def test_a_checkpoint_removed_twice_is_one_clear_error(trained_run, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    from flax_transformer.training import seq2seq
    from flax_transformer.training.errors import RunError
    from flax_transformer.training.run_checkpoints import Checkpoints

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    restore = ocp.CheckpointManager.restore

    def removed(manager, step, *args, **kwargs):
        shutil.rmtree(run / "checkpoints" / str(step))
        return restore(manager, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", removed)
    reader = Checkpoints(run, read_only=True)
    with pytest.raises(RunError, match=r"checkpoints/4 was removed while it was read .*and so was checkpoint 6 before it"):
        reader.restore_model(seq2seq.build_model(seq2seq.Seq2SeqConfig.tiny()))
    reader.close()
    assert _steps(run) == [2]
