"""``python -m train.lm --model llama``: the llama family as a training run, end to end.

One tiny run (dropout on, so the saved RNG streams matter) is trained once per module, with
``--export-torch`` and ``--export-torch-state``; the tests read it: an interrupted run resumed
equals it bit for bit, its export's torch twin gives its logits at 1e-5, its torch training
checkpoint continues it exactly as ``--resume`` (``--init-from-torch``), and ``generate`` and
``load_run`` read it. The presets' parameter counts match the gpt presets'.
"""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.training import lm, run_checkpoints, rundir
from flax_transformer.training.run_loading import load_model, load_run

TEXT = "ROMEO: but soft, what light through yonder window breaks?\n" * 300
STEPS = 8


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's bias correction mixes a Python float with its int32 step count (strict promotion refuses it)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _config(text, **changes):
    return lm.LMConfig.tiny(**{"model": "llama", "text": str(text), "steps": STEPS, "dropout": 0.1, "eval_every": 4,
                               "checkpoint_every": 4, "sample_tokens": 20, **changes})


def _saved_state(run_dir, step=None) -> dict:
    """{path: array} of a run's checkpoint (default: the latest): model, optimizer, RNG streams, step."""
    import orbax.checkpoint as ocp

    checkpoints = run_checkpoints.Checkpoints(run_dir, read_only=True)
    try:
        path = checkpoints.directory / str(checkpoints.latest() if step is None else step) / "state"
        with ocp.PyTreeCheckpointer() as reader:
            tree = reader.metadata(path).item_metadata.tree
            as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            restored = reader.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    finally:
        checkpoints.close()
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(restored)[0]}


def _assert_same_state(a_dir, b_dir):
    a, b = _saved_state(a_dir), _saved_state(b_dir)
    assert a.keys() == b.keys() and any("rngs" in k for k in a)  # the dropout streams are saved too
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run, with both exports: (folder, metrics)."""
    folder = tmp_path_factory.mktemp("llama")
    (folder / "text.txt").write_text(TEXT)
    with jax.numpy_dtype_promotion("standard"):
        metrics = lm.train_and_evaluate(_config(folder / "text.txt"), folder / "whole", progress=False,
                                        export_torch=folder / "whole.safetensors",
                                        export_torch_state=folder / "whole.pt")
    return folder, metrics


@pytest.mark.slow(reason="test_lm_tiny_end_to_end (the same CLI and loop), "
                  "test_train_step_equals_transformers_and_continues_through_torch_state (a llama-family run through torch state)")
def test_the_run_trains_a_llama_and_records_its_kind(whole):
    folder, metrics = whole
    run = folder / "whole"
    assert metrics["step"] == STEPS and not metrics["interrupted"] and metrics["sample"].startswith("ROMEO:")
    saved = json.loads((run / "run.json").read_text())
    assert saved["model"] == "llama" and saved["kv_heads"] == 1 and saved["d_ff"] == 192
    loaded = load_run(run)
    assert metrics["val_loss"] < np.log(loaded.tokenizer.get_vocab_size()) - 1  # it learnt: chance is log(27)
    assert loaded.task == "lm" and type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.model.config.num_key_value_heads == 1 and type(load_model(run)).__name__ == "LlamaForCausalLM"

    # a run.json with no "model" (written before the field existed) is a gpt run
    old = folder / "old"
    old.mkdir()
    saved = {"task": "lm", **dataclasses.asdict(lm.LMConfig.tiny())}
    (old / "run.json").write_text(json.dumps({k: v for k, v in saved.items() if k not in ("model", "kv_heads")}))
    from flax_transformer.training.rundir import config_of_run

    assert config_of_run(old, "lm", lm.LMConfig).model == "gpt"


def test_presets_match_the_gpt_presets_parameter_counts():
    def count(config):
        model = nnx.eval_shape(lambda: lm.build_model(config, 65))  # Tiny Shakespeare's 65 characters
        return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

    for name in ("tiny", "small", "base"):
        gpt, llama = lm.PRESETS[name](), lm.presets("llama")[name]()
        assert llama.model == "llama" and lm.PRESETS[name](model="llama") == llama
        assert (llama.n_layers, llama.d_embed, llama.heads, llama.context) == (
            gpt.n_layers, gpt.d_embed, gpt.heads, gpt.context)
        assert abs(count(llama) / count(gpt) - 1) < 0.015, name
    assert (count(lm.PRESETS["small"]()), count(lm.presets("llama")["small"]())) == (759_105, 755_072)


@pytest.mark.slow(reason="test_runs' resume test")
def test_resume_equals_the_uninterrupted_run(whole, tmp_path):
    """The run as a process killed after its step-4 checkpoint leaves it (the checkpoint at 8 never
    written, its logs past step 4 cut back on resume), continued by ``--resume`` with no other flag
    (the config from run.json): every saved array, the logs and the sample equal the whole run's."""
    from train.lm import main

    folder, _ = whole
    split = tmp_path / "split"
    shutil.copytree(folder / "whole", split)
    shutil.rmtree(split / "checkpoints" / str(STEPS))
    (split / "sample.txt").unlink()
    assert run_checkpoints.Checkpoints(split, read_only=True).latest() == 4
    assert main(["--out", str(split), "--resume", "--no-progress"]) == 0
    _assert_same_state(folder / "whole", split)

    def losses(run):
        return [(r["step"], r["split"], r["loss"]) for r in rundir.read_metrics(run)]
    assert losses(folder / "whole") == losses(split)
    assert (split / "sample.txt").read_text() == (folder / "whole" / "sample.txt").read_text()


@pytest.mark.slow(reason="test_torch_state's exports")
def test_the_torch_export_gives_the_same_logits(whole):
    from safetensors.torch import load_file

    from flax_transformer.interop import checkpoints
    from flax_transformer.verification import certificate

    folder, _ = whole
    export = folder / "whole.safetensors"
    assert certificate.recheck(export).passed
    _, description = checkpoints.read_safetensors(export)
    twin = checkpoints.build(description, framework="torch")
    assert type(twin).__module__ == "torch_reference.llama"
    twin.load_state_dict(load_file(export))
    twin.eval()
    model, tokenizer, _ = lm.load_run(folder / "whole")
    ids = np.asarray([tokenizer.encode(TEXT[i:i + 64]).ids for i in (0, 7, 30)], np.int32)
    with torch.no_grad():
        got = twin(torch.from_numpy(ids).long()).numpy()
    np.testing.assert_allclose(got, np.asarray(model(ids)), atol=1e-5, rtol=0)
    assert type(checkpoints.load(export)).__name__ == "LlamaForCausalLM"  # and back into Flax


@pytest.mark.slow(reason="test_lm_tiny_end_to_end (the same CLI and loop), "
                  "test_train_step_equals_transformers_and_continues_through_torch_state (a llama-family run through torch state)")
def test_torch_state_round_trip_continues_as_resume(whole, tmp_path):
    """Exported at step 4 and started again with ``init_from_torch`` (``--init-from-torch``), the run
    trains steps 5..8 exactly as the uninterrupted one; its ``--export-torch-state`` file equals the
    uninterrupted run's, and ``port --to torch-state --verify``'s check finds nothing."""
    from flax_transformer.training.torch_state.run_export import check_export, export_run

    folder, _ = whole
    export_run(folder / "whole", tmp_path / "at4.pt", step=4)
    saved = torch.load(tmp_path / "at4.pt", weights_only=True)
    assert saved["step"] == 4 and saved["class"] == "llama.LlamaForCausalLM"
    assert saved["model"]["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # one key/value head of 32
    lm.train_and_evaluate(_config(folder / "text.txt"), tmp_path / "again", progress=False,
                          init_from_torch=tmp_path / "at4.pt", export_torch_state=tmp_path / "again.pt")
    _assert_same_state(folder / "whole", tmp_path / "again")
    ours, theirs = torch.load(tmp_path / "again.pt", weights_only=True), torch.load(folder / "whole.pt", weights_only=True)
    assert ours["step"] == theirs["step"] == STEPS
    for key, value in theirs["model"].items():
        assert torch.equal(ours["model"][key], value), key
    for i, state in theirs["optimizer"]["state"].items():
        assert all(torch.equal(ours["optimizer"]["state"][i][m], state[m]) for m in state), i
    assert check_export(folder / "whole", folder / "whole.pt") == []


@pytest.mark.slow(reason="test_lm_tiny_end_to_end (the same CLI and loop), "
                  "test_train_step_equals_transformers_and_continues_through_torch_state (a llama-family run through torch state)")
def test_generate_reads_the_run(whole, capsys):
    from flax_transformer.cli.commands import main

    folder, _ = whole
    run = folder / "whole"
    model, tokenizer, config = lm.load_run(run)
    expected = lm.continue_text(config, model, tokenizer, "ROMEO: but", max_new_tokens=12, greedy=True)
    assert main(["generate", "--checkpoint", str(run), "--prompt", "ROMEO: but", "--max-new-tokens", "12",
                 "--greedy"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected.rstrip("\n")
    assert len(expected) == len("ROMEO: but") + 12


@pytest.mark.parametrize("flags, message", [
    (["--model", "llama", "--kv-heads", "3"], "--kv-heads 3 must divide the heads (2)"),
    (["--model", "gpt", "--kv-heads", "1"], "--kv-heads applies to --model llama only"),
    (["--model", "llama", "--kv-heads", "0"], "--kv-heads must be at least 1"),
    (["--model", "llama", "--experts", "4", "--experts-per-token", "5"], "--experts-per-token 5 must be at most --experts (4)"),
    (["--model", "llama", "--experts-per-token", "2"], "--experts-per-token needs --experts"),
    (["--model", "hf", "--init", "nowhere", "--experts", "4"], "--experts applies to --model llama only"),
    (["--model", "llama", "--experts", "8", "--experts-per-token", "5"], "the preset's d_ff (192) must be divisible by --experts-per-token 5"),
    (["--model", "gpt", "--experts", "4"], "--experts applies to --model llama only"),
    (["--model", "llama", "--experts", "0"], "--experts must be at least 1"),
])
def test_bad_flags_are_one_line_before_anything_is_made(tmp_path, capsys, flags, message):
    from train.lm import main

    with pytest.raises(SystemExit) as raised:
        main(["--preset", "tiny", "--out", str(tmp_path / "run"), *flags])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
