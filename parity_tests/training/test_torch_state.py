"""A training run crosses frameworks through a torch training checkpoint (``training/torch_state/``).

Trajectory continuity for every family's full model (both directions, ``continuity.continuity``),
every refusal (nothing changed), bf16 runs, and an exported JAX run imported again continuing
bit for bit.
"""

import copy
import dataclasses
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import porting
from flax_transformer.training import parity
from flax_transformer.training.optim import OptimConfig, make_optimizer
from flax_transformer.training.step import cross_entropy, make_steps
from flax_transformer.training.torch_state import continuity
from flax_transformer.training.torch_state.checks import TorchStateError
from flax_transformer.training.torch_state.to_jax import import_torch_state, library_decayed, torch_optimizer
from flax_transformer.training.torch_state.to_torch import save_torch_state, torch_training_state


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's bias correction mixes a Python float with its int32 step count (strict promotion refuses it)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@functools.cache
def _continuity(family):
    """``continuity.continuity(family, steps=2)``, computed once per test process (the CLI test reuses it)."""
    return continuity.continuity(family, steps=2)


@pytest.mark.parametrize("family", parity.MODELS)
@pytest.mark.keep_cases("llama", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_trajectory_continues_across_frameworks(family):
    """K torch steps, the file, K JAX steps == 2K torch steps; K JAX, the file, K torch == 2K JAX.
    Losses every step, parameters and Adam moments at the end; warmup + cosine decay across the switch."""
    for result in _continuity(family):
        report = continuity.format_continuity(result)
        assert result.loss_err <= 1e-5, report
        assert result.param_err <= 1e-5, report
        assert result.moment_err <= 1e-4, report
        assert result.passed, report
        # set aside only the zero-gradient key biases of the per-head attentions, as verify --train-steps does
        assert all(k.endswith(("k.bias", "key_tfm.bias")) for k in result.noise_params), sorted(result.noise_params)


# ----------------------------------------------------------------------------- refusals


CONFIG = OptimConfig(optimizer="adamw", lr=1e-2, warmup_steps=3, weight_decay=0.1, clip_norm=1.0)


def _tiny(emb=16, seed=0):
    from torch_reference.former import CTransformer

    torch.manual_seed(seed)
    return CTransformer(emb, 2, 1, 8, 30, 2, max_pool=False)


def _torch_checkpoint(model=None, steps=2, optimizer=None, scheduler=None):
    """A real torch training checkpoint of the tiny classifier after ``steps`` updates."""
    model = model or _tiny()
    if optimizer is None:
        optimizer, scheduler = torch_optimizer(model, CONFIG)
    ids = torch.randint(0, 30, (4, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.nll_loss(model(ids), torch.zeros(4, dtype=torch.long)).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {"model": model.state_dict(), "optimizer": copy.deepcopy(optimizer.state_dict()),
            "scheduler": scheduler.state_dict() if scheduler is not None else None, "step": steps}


def _flax_twin():
    model = porting.torch_to_flax(_tiny(seed=1))
    return model, copy.deepcopy(porting.state_dict(model))


def _refused(ckpt, match, config=CONFIG):
    model, before = _flax_twin()
    with pytest.raises(TorchStateError, match=match):
        import_torch_state(ckpt, model, config)
    after = porting.state_dict(model)
    assert all(np.array_equal(before[k], after[k]) for k in before), "a refused import changed the model"


def test_a_real_checkpoint_imports_with_its_moments_step_and_mask():
    ckpt = _torch_checkpoint()
    model, _ = _flax_twin()
    optimizer, step = import_torch_state(ckpt, model, CONFIG)
    assert step == 2 and int(optimizer.step[...]) == 2
    written = torch_training_state(model, optimizer, CONFIG)
    for key, value in ckpt["model"].items():
        np.testing.assert_array_equal(written["model"][key].numpy(), value.numpy())
    theirs, ours = ckpt["optimizer"], written["optimizer"]
    assert [g["param_names"] for g in ours["param_groups"]] == [g["param_names"] for g in theirs["param_groups"]]
    assert [g["weight_decay"] for g in ours["param_groups"]] == [0.1, 0.0]
    for i, state in theirs["state"].items():
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            np.testing.assert_array_equal(ours["state"][i][moment].numpy(), state[moment].numpy())
    assert written["scheduler"]["last_epoch"] == 2
    assert written["scheduler"]["_last_lr"] == pytest.approx(ckpt["scheduler"]["_last_lr"])


def test_a_tied_head_is_one_parameter_under_either_name_and_a_differing_copy_is_refused():
    """torch's state_dict of a tied llama holds the table twice (model.embed_tokens.weight, lm_head.weight):
    one parameter of the optimizer. Either name alone imports; a head that differs from the table is refused."""
    from flax_transformer.models.llama_config import LlamaConfig
    from torch_reference.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny(vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                              tie_word_embeddings=True))
    optimizer, scheduler = torch_optimizer(model, CONFIG)
    ids = torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(0))
    model(ids).logsumexp(-1).mean().backward()
    optimizer.step()
    scheduler.step()
    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": 1}
    table = ckpt["model"]["model.embed_tokens.weight"]
    for state in (ckpt["model"], {k: v for k, v in ckpt["model"].items() if k != "model.embed_tokens.weight"}):
        flax_model = porting.torch_to_flax(LlamaForCausalLM(model.config))
        import_torch_state({**ckpt, "model": state}, flax_model, CONFIG)
        np.testing.assert_array_equal(np.asarray(flax_model.model.embed_tokens.embedding[...]), table.numpy())
    differing = {**ckpt["model"], "lm_head.weight": table + 1}
    with pytest.raises(TorchStateError, match="lm_head.weight differs from model.embed_tokens.weight"):
        import_torch_state({**ckpt, "model": differing}, porting.torch_to_flax(model), CONFIG)


def test_the_layouts_without_names_one_group_and_the_library_groups():
    """The notebooks' Adam(model.parameters()) and torch_optimizer's groups built from bare parameters."""
    model = _tiny()
    adam = torch.optim.Adam(model.parameters(), lr=CONFIG.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(adam, lambda i: min(i / 3, 1.0))
    ckpt = _torch_checkpoint(model, optimizer=adam, scheduler=sched)
    assert "param_names" not in ckpt["optimizer"]["param_groups"][0]
    flax_model, _ = _flax_twin()
    optimizer, _ = import_torch_state(ckpt, flax_model, OptimConfig(optimizer="adam", lr=CONFIG.lr, warmup_steps=3))
    mu = torch_training_state(flax_model, optimizer, CONFIG)["optimizer"]
    by_name = {n: mu["state"][i] for g in mu["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    for i, (name, _) in enumerate(model.named_parameters()):
        np.testing.assert_array_equal(by_name[name]["exp_avg"].numpy(), ckpt["optimizer"]["state"][i]["exp_avg"].numpy())

    model = _tiny()
    decayed = library_decayed(model)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n in decayed], "weight_decay": 0.1},
                             {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}], lr=CONFIG.lr)
    ckpt = _torch_checkpoint(model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(i / 3, 1)))
    import_torch_state(ckpt, _flax_twin()[0], CONFIG)
    # the same group sizes in another order is a layout nobody documents
    opt.param_groups.reverse()
    ckpt["optimizer"] = copy.deepcopy(opt.state_dict())
    _refused(ckpt, "cannot tell which parameter each optimizer entry is")


def test_one_adamw_group_decays_every_parameter():
    """AdamW(model.named_parameters(), weight_decay=wd) decays biases and norms too: the mask read from
    the file does, so one more step in JAX equals one more step in torch."""
    model = _tiny()
    opt = torch.optim.AdamW(model.named_parameters(), lr=CONFIG.lr, weight_decay=0.1)
    ckpt = _torch_checkpoint(model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(i / 3, 1)))
    flax_model, _ = _flax_twin()
    optimizer, _ = import_torch_state(ckpt, flax_model, CONFIG)
    ids, labels = np.arange(32).reshape(4, 8) % 30, np.array([0, 1, 1, 0])
    opt.zero_grad()
    torch.nn.functional.nll_loss(model(torch.from_numpy(ids)), torch.from_numpy(labels)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG.clip_norm)
    opt.step()
    flax_model.train()
    train_step, _ = make_steps(lambda m, x: (cross_entropy(m(x["ids"]), x["labels"]), {}))
    train_step(flax_model, optimizer, {"ids": jnp.asarray(ids, jnp.int32), "labels": jnp.asarray(labels, jnp.int32)})
    ours = porting.state_dict(flax_model)
    for key, value in model.state_dict().items():
        err = np.abs(ours[key] - value.numpy()).max() / max(1.0, float(value.abs().max()))
        assert err <= 1e-5, (key, err)


def test_refusals_change_nothing(tmp_path):
    ckpt = _torch_checkpoint()
    _refused({k: v for k, v in ckpt.items() if k != "optimizer"}, "weights alone")
    other = _torch_checkpoint(_tiny(emb=8))
    _refused(dict(ckpt, optimizer=other["optimizer"]), "another model.*shape")
    fewer = copy.deepcopy(ckpt)
    group = fewer["optimizer"]["param_groups"][1]
    del fewer["optimizer"]["state"][group["params"][0]]  # (state for no group's parameter: test_torch_state_values)
    group["params"], group["param_names"] = group["params"][1:], group["param_names"][1:]
    _refused(fewer, "another model: it holds")
    _refused(dict(ckpt, model=other["model"]), "another model")
    _refused(dict(ckpt, config={"emb": 8}), "another model: its config has emb=8")

    model = _tiny()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _refused(_torch_checkpoint(model, optimizer=sgd, scheduler=torch.optim.lr_scheduler.LambdaLR(sgd, lambda i: 1.0)),
             "not torch.optim.Adam or AdamW.*momentum")
    model = _tiny()
    ams = torch.optim.AdamW(model.named_parameters(), lr=CONFIG.lr, weight_decay=0.1, amsgrad=True)
    _refused(_torch_checkpoint(model, optimizer=ams, scheduler=torch.optim.lr_scheduler.LambdaLR(ams, lambda i: min(i / 3, 1))),
             "amsgrad")
    model = _tiny()
    opt, _ = torch_optimizer(model, CONFIG)
    _refused(_torch_checkpoint(model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 10)),
             "not a LambdaLR")
    _refused(dict(ckpt, step=3), 'the checkpoint\'s "step" is 3, but the scheduler has taken 2 steps')
    ahead = copy.deepcopy(ckpt)
    ahead["optimizer"]["state"][0]["step"] += 1
    _refused(ahead, 'the checkpoint\'s "step" is 2, but the optimizer has taken 3 steps')
    _refused(ckpt, "schedule gives", config=OptimConfig(lr=1e-2, warmup_steps=10, weight_decay=0.1))
    _refused(ckpt, "decays weights by 0.1", config=OptimConfig(lr=1e-2, warmup_steps=3, weight_decay=0.01))

    class Code:
        def __reduce__(self):  # unpickling would call Path.touch: code run by the load
            return (type(tmp_path).touch, (tmp_path / "ran",))

    torch.save(dict(ckpt, extra=Code()), tmp_path / "code.pt")
    _refused(tmp_path / "code.pt", "carries Python objects other than tensors")
    assert not (tmp_path / "ran").exists()
    (tmp_path / "notes.pt").write_text("hello world\n")  # torch's loader raises KeyError on text
    _refused(tmp_path / "notes.pt", "not a readable torch file")
    (tmp_path / "noise.pt").write_bytes(bytes(range(256)) * 4)
    _refused(tmp_path / "noise.pt", "not a readable torch file")


# ----------------------------------------------------------------------------- JAX -> file -> JAX, bf16


def test_a_finished_run_is_named_with_the_way_to_extend_it():
    """A file whose cosine decay ended (learning rate 0) given a longer schedule (a larger ``--steps``)
    is refused as a finished run, not as a learning-rate mismatch; once its optimizer steps on the
    longer schedule, the longer run accepts it."""
    from flax_transformer.training.torch_state.checks import lr_factor
    from flax_transformer.training.torch_state.to_jax import check_torch_state

    short = OptimConfig(lr=1e-2, warmup_steps=1, decay="cosine", total_steps=2, weight_decay=0.1)
    longer = dataclasses.replace(short, total_steps=10)
    model = _tiny()
    optimizer, scheduler = torch_optimizer(model, short)
    ckpt = _torch_checkpoint(model, optimizer=optimizer, scheduler=scheduler)  # 2 updates: the end, lr 0
    with pytest.raises(TorchStateError, match="is at step 2, and the run ends at step 2.*--steps larger than 2"):
        check_torch_state(ckpt, short, total_steps=2)
    with pytest.raises(TorchStateError, match="learning rate is 0.0 at step 2: its run has finished its schedule.*"
                                              "--steps 10 follows a longer schedule.*from_task"):
        check_torch_state(ckpt, longer, total_steps=10)
    for group in optimizer.param_groups:  # what docs/training.md's torch loop does, then one step
        group["lr"] = longer.lr * lr_factor(longer, 2)
    scheduler.lr_lambdas = [lambda i: lr_factor(longer, i)] * len(optimizer.param_groups)
    ckpt = _torch_checkpoint(model, steps=1, optimizer=optimizer, scheduler=scheduler)
    assert check_torch_state(dict(ckpt, step=3), longer, total_steps=10)["step"] == 3


@pytest.mark.slow(reason="test_trajectory_continues_across_frameworks (the same export and import in float32)")
def test_bf16_run_exported_and_imported_continues_bit_for_bit(tmp_path):
    """A bf16 run (fp32 parameters and moments) with dropout, exported at step K and imported into a
    fresh model (other initial weights, other dropout seed), continues exactly as the run does."""
    from flax_transformer.models.former import CTransformer

    def build(seed):
        return CTransformer(16, 2, 1, 8, 30, 2, dropout=0.2, max_pool=False, dtype=jnp.bfloat16,
                            param_dtype=jnp.float32, rngs=nnx.Rngs(params=seed, dropout=seed + 1))

    config = OptimConfig(lr=1e-2, warmup_steps=2, decay="cosine", total_steps=6, weight_decay=0.1, clip_norm=0.5)
    rng = np.random.default_rng(0)
    batches = [{"ids": jnp.asarray(rng.integers(0, 30, (4, 8)), jnp.int32),
                "labels": jnp.asarray(rng.integers(0, 2, 4), jnp.int32)} for _ in range(6)]
    train_step, _ = make_steps(lambda m, x: (cross_entropy(m(x["ids"]), x["labels"]), {}))
    model = build(0)
    model.train()
    tx = make_optimizer(config)  # one chain for both runs: one compiled step
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses = [float(train_step(model, optimizer, x)["loss"]) for x in batches[:3]]
    save_torch_state(tmp_path / "run.pt", model, optimizer, config)
    losses += [float(train_step(model, optimizer, x)["loss"]) for x in batches[3:]]

    saved = torch.load(tmp_path / "run.pt", weights_only=True)
    assert saved["step"] == 3 and {v.dtype for v in saved["model"].values()} == {torch.float32}
    assert {s[m].dtype for s in saved["optimizer"]["state"].values() for m in ("exp_avg", "exp_avg_sq")} == {torch.float32}
    again = build(5)
    again.train()
    continued, step = import_torch_state(tmp_path / "run.pt", again, config, tx=tx)
    assert step == 3
    assert {v.dtype for v in jax.tree.leaves(nnx.as_pure(continued.opt_state)) if v.ndim} == {jnp.dtype("float32")}
    tail = [float(train_step(again, continued, x)["loss"]) for x in batches[3:]]
    assert tail == losses[3:]
    ours, theirs = porting.state_dict(again), porting.state_dict(model)
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    for a, b in zip(jax.tree.leaves(nnx.as_pure(continued.opt_state)), jax.tree.leaves(nnx.as_pure(optimizer.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(FileExistsError):
        save_torch_state(tmp_path / "run.pt", model, optimizer, config)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    assert import_torch_state(buffer, build(7), config)[1] == 3  # a file object reads too


# ----------------------------------------------------------------------------- the command line


@pytest.mark.slow(reason="test_entry_point_continues_an_exported_run_exactly_as_resume (a run across the frameworks)")
def test_verify_through_torch_state_prints_both_curves_and_fails_on_a_break(monkeypatch, capsys):
    """``flax-transformer verify --train-steps K --through-torch-state``: the round trip for each family
    and optimizer, the curves side by side, exit 1 when one fails. (The continuity itself is tested
    above; here the real results of one family stand in for each, to spare the compilations.)"""
    from flax_transformer.cli import commands as cli

    results = _continuity("gpt")
    calls = []

    def once(family, *, steps, optimizer, seed):
        calls.append((family, steps, optimizer))
        return copy.deepcopy(results)

    monkeypatch.setattr(continuity, "continuity", once)
    assert cli.main(["verify", "--train-steps", "2", "--through-torch-state"]) == 0
    out = capsys.readouterr().out
    assert calls == [(f, 2, o) for f in parity.MODELS for o in ("adam", "adamw")]
    assert "torch->jax" in out and "jax->torch" in out and "<- switch" in out and "0 failed" in out
    broken = copy.deepcopy(results)
    broken[1].losses[-1] += 1e-3
    monkeypatch.setattr(continuity, "continuity", lambda family, **kw: copy.deepcopy(broken))
    assert cli.main(["verify", "--train-steps", "2", "--through-torch-state", "--family", "gpt"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert cli.main(["verify", "--through-torch-state"]) == 2
    assert "goes with --train-steps" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the entry points


def _saved_state(run_dir, step=None) -> dict:
    """{path: array} of a run's checkpoint (default: the latest)."""
    import orbax.checkpoint as ocp

    from flax_transformer.training.run_checkpoints import Checkpoints

    checkpoints = Checkpoints(run_dir, read_only=True)
    try:
        path = checkpoints.directory / str(checkpoints.latest() if step is None else step) / "state"
        with ocp.PyTreeCheckpointer() as reader:
            tree = reader.metadata(path).item_metadata.tree
            as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            restored = reader.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    finally:
        checkpoints.close()
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(restored)[0]}


@pytest.mark.slow(reason="test_trajectory_continues_across_frameworks")
def test_entry_point_continues_an_exported_run_exactly_as_resume(tmp_path, capsys):
    """The smallest task: a run exported at step 4 (``port --to torch-state``'s library function) and
    started again with ``--init-from-torch`` trains steps 5..8 exactly as the run did: the final
    checkpoints are equal bit for bit, and so are the two runs' ``--export-torch-state`` files.
    Refusals come before anything is created."""
    from flax_transformer.cli import commands as cli
    from flax_transformer.training import seq2seq
    from flax_transformer.training.torch_state.run_export import export_run
    from train.seq2seq import main

    flags = ["--preset", "tiny", "--steps", "8", "--no-progress"]
    whole, again = tmp_path / "whole", tmp_path / "again"
    seq2seq.train_and_evaluate(seq2seq.Seq2SeqConfig.tiny(steps=8, checkpoint_every=4), whole, progress=False)
    export_run(whole, tmp_path / "at4.pt", step=4)
    assert torch.load(tmp_path / "at4.pt", weights_only=True)["step"] == 4

    assert main([*flags, "--out", str(again), "--init-from-torch", str(tmp_path / "at4.pt"),
                 "--export-torch-state", str(tmp_path / "again.pt")]) == 0
    assert f"Exported {tmp_path / 'again.pt'}: a torch training checkpoint at step 8" in capsys.readouterr().err
    a, b = _saved_state(whole), _saved_state(again)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert cli.main(["port", str(whole), str(tmp_path / "whole.pt"), "--to", "torch-state", "--verify"]) == 0
    ours, theirs = torch.load(tmp_path / "again.pt", weights_only=True), torch.load(tmp_path / "whole.pt", weights_only=True)
    assert ours["step"] == theirs["step"] == 8
    for key, value in theirs["model"].items():
        assert torch.equal(ours["model"][key], value), key
    for i, state in theirs["optimizer"]["state"].items():
        assert all(torch.equal(ours["optimizer"]["state"][i][m], state[m]) for m in state), i
    # --verify reads the file back as torch and as the import do: a changed moment is caught
    from flax_transformer.training.torch_state import run_export

    theirs["optimizer"]["state"][0]["exp_avg"] *= 1.5
    torch.save(theirs, tmp_path / "tampered.pt")
    problems = run_export.check_export(whole, tmp_path / "tampered.pt")
    assert problems and all("optimizer state" in p for p in problems), problems
    capsys.readouterr()

    bad = tmp_path / "weights-only.pt"
    torch.save({"model": ours["model"], "step": 4}, bad)
    for extra, message in ((["--init-from-torch", str(bad)], "weights alone"),
                           (["--init-from-torch", str(tmp_path / "again.pt")], "nothing is left to train"),
                           (["--export-torch-state", str(tmp_path / "again.pt")], "exists")):
        assert main([*flags, "--out", str(tmp_path / "refused"), *extra]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "refused").exists()
