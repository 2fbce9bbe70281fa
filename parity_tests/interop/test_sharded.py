"""Sharded HF folders are read as their index says, and as transformers reads them, or refused (issue 22).

transformers 5 (``modeling_utils.PreTrainedModel._load_pretrained_model``) opens the shards its index
names, in sorted order, and merges every tensor of each: a tensor in two shards takes the last copy,
a tensor in a listed shard loads whatever the index says of it, one its shard lacks is initialised at
random, and a shard the index does not name is never read. ``safetensors_io.check_shards`` refuses
each of those in one line naming the tensor and the shards (docs/porting.md). The folders are a tiny
GPT-2 written in 7 shards by ``hf.save_pretrained(..., max_shard_size=...)``, then edited by hand.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from flax_transformer.cli.commands import main
from flax_transformer.interop import hf
from flax_transformer.interop.safetensors_io import MissingShard, ShardError
from flax_transformer.models.configs import GPTConfig
from torch_reference.gpt import GPT2LMHeadModel

NAME = "transformer.h.0.ln_1.weight"  # in the first shard


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("sharded") / "gpt2"
    hf.save_pretrained(GPT2LMHeadModel(GPTConfig.tiny()), folder, max_shard_size="20KB")
    return folder


def _index(folder) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _shards(folder) -> list[str]:
    return sorted(set(_index(folder)["weight_map"].values()))


def _edit(folder, shard, change) -> None:
    tensors = load_file(folder / shard)
    change(tensors)
    save_file(tensors, folder / shard, metadata={"format": "pt"})


def _copy(base, tmp_path):
    return shutil.copytree(base, tmp_path / "gpt2")


def _two_copies(folder, last=True):
    """NAME also in another shard, with other values; returns that shard."""
    first = _index(folder)["weight_map"][NAME]
    other = [s for s in _shards(folder) if s != first][-1 if last else 0]
    value = load_file(folder / first)[NAME]
    _edit(folder, other, lambda t: t.update({NAME: np.full_like(value, 7.0)}))
    return first, other


def _moved(folder):
    """NAME taken out of its shard and put into another; the index still lists the first."""
    first = _index(folder)["weight_map"][NAME]
    other = _shards(folder)[-1]
    value = load_file(folder / first)[NAME]
    _edit(folder, first, lambda t: t.pop(NAME))
    _edit(folder, other, lambda t: t.update({NAME: value}))
    return first, other


def _unlisted(folder):
    index = _index(folder)
    shard = index["weight_map"].pop(NAME)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return (shard,)


def _missing(folder):
    shard = _index(folder)["weight_map"][NAME]
    _edit(folder, shard, lambda t: t.pop(NAME))
    return (shard,)


def _stray(folder):
    stray = "model-00008-of-00008.safetensors"
    save_file({NAME: np.full(32, 7.0, np.float32)}, folder / stray, metadata={"format": "pt"})
    return (stray,)


CASES = {
    "in two shards (the last one is not the index's)": (_two_copies, "is in 2 shards"),
    "in two shards (the first one is not the index's)": (lambda f: _two_copies(f, last=False), "is in 2 shards"),
    "in a shard the index does not list it in": (_moved, "but the index lists it in"),
    "in no index entry": (_unlisted, "but the index does not list it"),
    "listed but missing from its shard": (_missing, "which does not hold it"),
    "a shard file the index does not name": (_stray, "is not in the index"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_shard_that_disagrees_with_its_index_is_refused_in_one_line(base, tmp_path, case):
    make, words = CASES[case]
    folder = _copy(base, tmp_path)
    shards = make(folder)
    for read in (hf.from_pretrained, hf.torch_from_pretrained, hf.read_weights):
        with pytest.raises(ShardError) as error:
            read(folder)
        message = str(error.value)
        assert "\n" not in message and words in message and NAME in message, message
        assert all(shard in message for shard in shards), message


def test_an_index_naming_a_shard_that_does_not_exist_is_refused(base, tmp_path):
    folder = _copy(base, tmp_path)
    last = _shards(folder)[-1]
    held = sorted(k for k, v in _index(folder)["weight_map"].items() if v == last)
    (folder / last).unlink()
    with pytest.raises(MissingShard) as error:  # a FileNotFoundError too, as transformers raises
        hf.from_pretrained(folder)
    message = str(error.value)
    assert isinstance(error.value, FileNotFoundError) and "\n" not in message
    assert last in message and "does not exist" in message and held[0] in message


def test_the_same_rules_hold_for_sharded_torch_pickles(base, tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(base / "config.json", folder)
    weights = {k: torch.from_numpy(np.array(v)) for k, v in hf.read_weights(base).items()}
    keys = sorted(weights)
    names = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    parts = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    for name, part in zip(names, parts):
        torch.save({k: weights[k] for k in part}, folder / name)
    index = {"metadata": {}, "weight_map": {k: n for n, part in zip(names, parts) for k in part}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    hf.from_pretrained(folder)  # a correct one loads
    torch.save({parts[0][0]: weights[parts[0][0]] * 2}, folder / "pytorch_model-00003-of-00003.bin")
    with pytest.raises(ShardError, match=r"shard pytorch_model-00003-of-00003\.bin is not in the index"):
        hf.from_pretrained(folder)


def test_a_correct_sharded_folder_loads_as_the_single_file_does(base, tmp_path):
    single = hf.read_weights(hf.save_pretrained(hf.torch_from_pretrained(base), tmp_path / "single"))
    sharded = hf.read_weights(base)
    assert len(_shards(base)) > 3 and sharded.keys() == single.keys()
    assert all(np.array_equal(sharded[k], single[k]) for k in single)


def test_what_transformers_does_with_such_folders(base, tmp_path):
    """The rules docs/porting.md states, as the installed transformers behaves (a change shows here)."""
    transformers = pytest.importorskip("transformers")
    (tmp_path / "a").mkdir()
    two = _copy(base, tmp_path / "a")
    _, other = _two_copies(two)
    (tmp_path / "b").mkdir()
    unlisted = _copy(base, tmp_path / "b")
    _unlisted(unlisted)
    (tmp_path / "c").mkdir()
    stray = _copy(base, tmp_path / "c")
    _stray(stray)
    want = hf.read_weights(base)[NAME]
    for folder, expected in ((two, np.full_like(want, 7.0)), (unlisted, want), (stray, want)):
        model = transformers.GPT2LMHeadModel.from_pretrained(folder)
        np.testing.assert_array_equal(model.state_dict()[NAME].numpy(), expected)  # the last copy; loaded; ignored


def test_port_refuses_it_with_exit_2_and_one_line(base, tmp_path, capsys):
    folder = _copy(base, tmp_path)
    first, other = _two_copies(folder)
    assert main(["port", str(folder), str(tmp_path / "out"), "--verify"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and NAME in lines[0] and first in lines[0] and other in lines[0], captured.err
    assert not (tmp_path / "out").exists()


def test_port_verify_of_an_hf_folder_compares_with_what_transformers_loads(base, tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    assert main(["port", str(base), str(tmp_path / "out.safetensors"), "--verify", "--no-certify"]) == 0
    out = capsys.readouterr().out
    assert f"between {base} (transformers) and {tmp_path / 'out.safetensors'} (reloaded) -> pass (tolerance 1e-05)" \
        in out and out.rstrip().endswith(f"wrote {tmp_path / 'out.safetensors'} (safetensors) without a certificate "
                                          "(--no-certify)")
    # a folder transformers reads otherwise than this library (here: an index without "metadata",
    # which transformers refuses with a KeyError) fails the check
    folder = _copy(base, tmp_path)
    index = _index(folder)
    del index["metadata"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["port", str(folder), str(tmp_path / "out2.safetensors"), "--verify", "--no-certify"]) == 1
    out = capsys.readouterr().out
    assert "transformers cannot load" in out
    assert out.rstrip().endswith(f"port: --verify failed, so {tmp_path / 'out2.safetensors'} was not written "
                                 "(nothing is there)")
    assert not (tmp_path / "out2.safetensors").exists()  # and no staged copy beside it
    # and values that differ are measured: transformers' reading, made to differ, fails it
    import flax_transformer.interop.hf as hf_module

    real = hf_module.transformers_from_pretrained

    def shifted(path):
        model, missing = real(path)
        with torch.no_grad():
            model.transformer.ln_f.bias.add_(0.5)
        return model, missing

    assert main(["port", str(base), str(tmp_path / "out3.pt"), "--verify"]) == 0  # certified, and passes
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in tmp_path.glob("out3.pt*")}
    assert sorted(before) == ["out3.pt", "out3.pt.verification.json"]
    monkeypatch.setattr(hf_module, "transformers_from_pretrained", shifted)
    assert main(["port", str(base), str(tmp_path / "out3.pt"), "--verify", "--overwrite"]) == 1
    out = capsys.readouterr().out
    assert "(transformers) and" in out and "-> FAIL" in out
    assert out.rstrip().endswith(f"so {tmp_path / 'out3.pt'} was not written (the one there is as it was)")
    # nothing lost: the certified output of the run before, as it was, and no new output or staged copy
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith(("out3", ".out3"))} == before
