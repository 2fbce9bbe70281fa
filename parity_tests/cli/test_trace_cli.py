"""``flax-transformer verify --record OUT`` and ``verify --bisect --trace FILE`` (``trace_cli``): a trace
written from a ``--pair``, bisected against a ``--pair`` with a bug and against a ``--checkpoint`` that is
right; the flags that do not go together refused in one line before any work."""

import json

import pytest

from flax_transformer.cli.commands import main

PAIR = '''
import numpy as np
import torch
import torch_reference.former as tf
from flax_transformer.interop import porting
from flax_transformer.verification import verify

def make():
    torch.manual_seed(0)
    model = tf.CTransformer(16, 4, 2, 8, 20, 3).eval()
    verify.perturb_torch(model, 0)
    return model, porting.torch_to_flax(model), (np.random.default_rng(0).integers(0, 20, (2, 8)),)

def broken():  # sqrt of the head width, not of emb: the weights are the same
    model, flax_model, args = make()
    flax_model.tblocks[0].mhattention.scale = "head"
    return model, flax_model, args
'''


def test_record_then_bisect_against_the_trace(tmp_path, capsys):
    (tmp_path / "pair.py").write_text(PAIR)
    trace = tmp_path / "trace"
    assert main(["verify", "--record", str(trace), "--pair", f"{tmp_path}/pair.py:make"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {trace}: " in printed and "float32" in printed and (trace / "trace.json").is_file()
    out = tmp_path / "report.json"
    assert main(["verify", "--bisect", "--trace", str(trace), "--pair", f"{tmp_path}/pair.py:broken", "--no-jit",
                 "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "error introduced in tblocks.0.mhattention" in printed and f"trace: {trace}" in printed, printed
    data = json.loads(out.read_text())
    assert data["first_divergent"] == "tblocks.0.mhattention" and data["trace"]["environment"]["device"] == "cpu"
    # the right weights in a checkpoint, loaded as a Flax model alone: it passes against the trace
    import importlib.util

    from flax_transformer.verification import export
    spec = importlib.util.spec_from_file_location("pair", tmp_path / "pair.py")
    pair = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pair)
    export.save_safetensors(pair.make()[1], tmp_path / "model.safetensors")
    assert main(["verify", "--bisect", "--trace", str(trace), "--checkpoint", str(tmp_path / "model.safetensors"),
                 "--no-jit"]) == 0
    assert "every module within budget" in capsys.readouterr().out
    assert main(["verify", "--bisect", "--trace", str(trace), "--checkpoint", str(tmp_path / "model.safetensors"),
                 "--grads"]) == 2  # recorded without gradients: said before any model is loaded
    assert "recorded without gradients" in capsys.readouterr().err
    assert main(["verify", "--record", str(trace), "--pair", f"{tmp_path}/pair.py:make"]) == 2
    assert "exists" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--record", "OUT"], "--record OUT needs one of --checkpoint PATH and --pair"),
    (["--record", "OUT", "--pair", "p.py:make", "--bisect"], "--record OUT takes no --bisect"),
    (["--record", "OUT", "--pair", "p.py:make", "--json", "x.json"], "--record OUT takes no --json"),
    (["--record", "OUT", "--trace", "T", "--pair", "p.py:make"], "give one of them"),
    (["--trace", "T", "--pair", "p.py:make"], "--trace FILE goes with --bisect"),
    (["--bisect", "--trace", "T"], "--trace FILE needs one of --checkpoint PATH and --pair"),
    (["--bisect", "--trace", "T", "--pair", "p.py:make", "--text", "hi"], "takes no --text"),
    (["--bisect", "--trace", "T", "--pair", "p.py:make", "--repro", "R"], "takes no --repro"),
    (["--bisect", "--trace", "T", "--pair", "p.py:make"], "no trace at T"),
    (["--record", "OUT", "--checkpoint", "C", "--source", "S"], "--record OUT takes no --source"),
    (["--record", "OUT", "--checkpoint", "C", "--bisect-generate", "--prompt", "hi"], "takes no --record"),
])
def test_flags_that_do_not_go_together_are_one_line(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    assert main(["verify", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "OUT").exists()
