"""``flax-transformer verify --bisect --repro DIR``: the first divergent module's reproducer (``repro``),
its folder checked before any work; the written script itself is run in ``test_repro``."""

import json

from flax_transformer.cli.commands import main

PAIR = '''
from pathlib import Path

import numpy as np
import torch
from flax import nnx

def make(bias=1e-3):
    Path(__file__).with_name("called").write_text("the factory ran")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).eval()
    flax_model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    flax_model.kernel.set_value(model.weight.detach().numpy().T)
    flax_model.bias.set_value(model.bias.detach().numpy() + np.array([bias, 0, 0], np.float32))
    return model, flax_model, (np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32),)

def right():
    return make(0.0)
'''


def test_verify_bisect_repro_writes_the_model_that_diverges(tmp_path, capsys):
    (tmp_path / "pair.py").write_text(PAIR)
    out = tmp_path / "repro"
    assert main(["verify", "--pair", f"{tmp_path}/pair.py:make", "--bisect", "--repro", str(out)]) == 1
    printed = capsys.readouterr().out
    assert f"wrote {out} (the reproducer of <model>" in printed, printed
    spec = json.loads((out / "module.json").read_text())
    assert spec["torch_path"] == "" and spec["measured"]["reproduces"] and (out / "repro.py").is_file()
    assert spec["constructor"]["torch"]["extra_repr"] == "in_features=4, out_features=3, bias=True"
    # a pair that agrees: the report passes, and no folder is written
    assert main(["verify", "--pair", f"{tmp_path}/pair.py:right", "--bisect", "--repro", str(tmp_path / "ok")]) == 0
    assert "no reproducer written" in capsys.readouterr().out and not (tmp_path / "ok").exists()


def test_verify_repro_refuses_its_folder_before_any_work(tmp_path, capsys):
    (tmp_path / "pair.py").write_text(PAIR)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    pair = f"{tmp_path}/pair.py:make"
    for argv, message in ((["--bisect", "--repro", str(busy)], "exists"),
                          (["--bisect", "--repro", str(tmp_path / "no" / "such")], "does not exist"),
                          (["--repro", str(tmp_path / "new")], "--repro DIR goes with --bisect")):
        assert main(["verify", "--pair", pair, *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "called").exists()  # the factory never ran
    assert [p.name for p in busy.iterdir()] == ["keep.txt"] and not (tmp_path / "new").exists()
