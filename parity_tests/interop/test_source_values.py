"""NaN/inf in the weights is named as such, with the tensor, before any export (issue 22 item 7).

Without this check a NaN weight surfaced as "the export check failed ... between the model and what
was written", blaming the writer. Now the certified exports (``verification.export``) and ``port``
refuse it first, naming each tensor and saying the values come from the source; ``certify=False``
(``port --no-certify``) writes them anyway.
"""

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import torch_reference.former as tf
from flax_transformer.cli.commands import main
from flax_transformer.interop import hf, porting
from flax_transformer.interop.safetensors_io import Lazy
from flax_transformer.interop.values import nonfinite
from flax_transformer.models.configs import GPTConfig
from flax_transformer.verification import export
from torch_reference.gpt import GPT2LMHeadModel


def _poisoned():
    """A small CTransformer (Flax) with one NaN and one inf in ``toprobs.weight``."""
    torch.manual_seed(0)
    model = tf.CTransformer(8, 2, 1, 6, 20, 2).eval()
    with torch.no_grad():
        model.toprobs.weight[0, 0] = float("nan")
        model.toprobs.weight[1, 2] = float("inf")
    return porting.torch_to_flax(model)


def test_nonfinite_names_each_tensor_with_its_counts():
    values = {"a": np.array([1.0, np.nan, np.inf, -np.inf], np.float32), "ids": np.arange(3),
              "b16": np.array([np.nan, 1], ml_dtypes.bfloat16), "t": torch.tensor([1.0, float("inf")]),
              "ok": np.ones(2, np.float32), "lazy": Lazy((2,), np.float32, lambda: np.array([np.nan, 0], np.float32))}
    assert nonfinite(values) == ["a (1 NaN, 2 inf of 4 values)", "b16 (1 NaN of 2 values)",
                                         "t (1 inf of 2 values)", "lazy (1 NaN of 2 values)"]
    assert nonfinite([("x", np.zeros(3))]) == []


@pytest.mark.parametrize("writer,name", [(export.save_safetensors, "m.safetensors"), (export.save_torch, "m.pt"),
                                         (export.save_orbax, "m-orbax")])
def test_a_certified_export_names_the_nonfinite_tensor_and_writes_nothing(tmp_path, writer, name):
    with pytest.raises(export.NonFiniteWeights) as error:
        writer(_poisoned(), tmp_path / name)
    message = str(error.value)
    assert "\n" not in message and "toprobs.weight (1 NaN, 1 inf of 16 values)" in message, message
    assert "come from its source" in message and "not from the writer" in message and "certify=False" in message
    assert list(tmp_path.iterdir()) == []


def test_certify_false_writes_nonfinite_weights_as_they_are(tmp_path):
    export.save_safetensors(_poisoned(), tmp_path / "m.safetensors", certify=False)
    written = load_file(tmp_path / "m.safetensors")["toprobs.weight"]
    assert np.isnan(written[0, 0]) and np.isinf(written[1, 2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no certificate


def test_an_hf_export_names_the_tensor_too(tmp_path):
    model = GPT2LMHeadModel(GPTConfig.tiny()).eval()
    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[3] = float("-inf")
    with pytest.raises(export.NonFiniteWeights, match=r"\(1 inf of \d+ values\)"):
        export.save_pretrained(porting.torch_to_flax(model), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def nan_folder(tmp_path):
    """A tiny GPT-2 HF folder with a NaN in one of its tensors (the name it has in the folder)."""
    folder = hf.save_pretrained(GPT2LMHeadModel(GPTConfig.tiny()), tmp_path / "src")
    tensors = load_file(folder / "model.safetensors")
    name = "transformer.h.1.attn.c_attn.bias"
    tensors[name] = tensors[name].copy()
    tensors[name][5] = np.nan
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, name


def test_port_refuses_nonfinite_source_weights_in_one_line_with_exit_2(tmp_path, nan_folder, capsys):
    folder, name = nan_folder
    for dst in ("out", "out.safetensors"):
        assert main(["port", str(folder), str(tmp_path / dst), "--verify"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"{folder} holds NaN/inf in 1 tensor: {name} (1 NaN of " in lines[0], lines
        assert "the source's own values" in lines[0] and "--no-certify writes them anyway" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_port_no_certify_writes_them(tmp_path, nan_folder, capsys):
    folder, name = nan_folder
    assert main(["port", str(folder), str(tmp_path / "out"), "--no-certify"]) == 0
    assert "without a certificate (--no-certify)" in capsys.readouterr().out
    assert np.isnan(hf.read_weights(tmp_path / "out")[name][5])
    assert not (tmp_path / "out" / "verification.json").exists()
    # an orbax source is named by the model's tensors, and said to come from SRC
    assert main(["port", str(tmp_path / "out"), str(tmp_path / "orbax"), "--to", "orbax", "--no-certify"]) == 0
    assert main(["port", str(tmp_path / "orbax"), str(tmp_path / "again.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"the model read from {tmp_path / 'orbax'} holds NaN/inf in 1 tensor" in err and "(1 NaN of " in err
