"""``trace.record`` and ``bisect`` from a recorded trace (``trace_bisect``): torch's side written in one
process, a Flax model bisected against it in another where torch cannot be imported.

The done-when of issue 37 item 1: a tiny model recorded with gradients here; a child process with
``sys.modules["torch"] = None`` builds the Flax model from numpy weights, plants a bug and names the
same first divergent module and first wrong gradient as ``bisect`` in this process, and names the
weights when they differ. By default a former CTransformer (width 16, a wrong attention scale), under
jit so the child loads the programs this process compiled; slow, a llama (one layer, width 32, its
key/value heads tiled, not repeated). A correct port passing from a trace: ``test_a_bf16_trace`` and
``test_trace_cli`` (a checkpoint). The other tests run eagerly.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_transformer.models.llama as fl
import torch_reference.former as tf
import torch_reference.llama as tl
from flax_transformer.interop import porting
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification import bisect, bisect_report, trace, verify
from parity_tests.verification.planting import patched_call

ROOT = Path(__file__).resolve().parents[2]
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
IDS = np.random.default_rng(0).integers(0, 20, (2, 8))
ATTN = "model.layers.0.self_attn"


def plant_tiled_heads(flax_model):
    """Key/value heads tiled (kv0, kv1, kv0, kv1) instead of repeated: query heads 1 and 2 see the wrong ones."""
    for layer in flax_model.model.layers:
        patched_call(layer.self_attn, fl, repeat_kv=lambda x, groups: jnp.tile(x, (1, groups, 1, 1)))
    return flax_model


# the other process: no torch; the Flax model built from numpy weights, bisected against the trace
CHILD = '''
import json, sys
sys.modules["torch"] = None  # any import of torch fails here
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
from flax import nnx
from flax_transformer.interop import porting
from flax_transformer.verification import bisect
from parity_tests.verification.planting import patched_call

family, config, weights, path, grads = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
if family == "llama":
    import flax_transformer.models.llama as fl
    from flax_transformer.models.llama_config import LlamaConfig

    build = lambda: fl.LlamaForCausalLM(LlamaConfig(**config), rngs=nnx.Rngs(0))

    def plant(model):  # the test's plant_tiled_heads
        for layer in model.model.layers:
            patched_call(layer.self_attn, fl, repeat_kv=lambda x, groups: jax.numpy.tile(x, (1, groups, 1, 1)))
else:
    from flax_transformer.models.former import CTransformer

    build = lambda: CTransformer(*config, rngs=nnx.Rngs(0))

    def plant(model):  # sqrt of the head width, not of emb: the weights unchanged
        model.tblocks[0].mhattention.scale = "head"
found = {}
for case in ("planted", "other weights"):
    model, state = build(), dict(np.load(weights))
    if case == "other weights":
        name = next(iter(state))
        state[name] = state[name] + 1e-3
    porting.load_state_dict(model, state)
    if case == "planted":
        plant(model)
    report = bisect.bisect(path, model, grads=case == "planted" and grads == "grads")  # jit: the cache the test filled
    found[case] = report.to_dict() | {"summary": report.summary(), "first_weight": next(iter(state))}
found["torch"] = sys.modules.get("torch") is not None
print(json.dumps(found))
'''


def _in_child(family, config, weights, path, grads, folder) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, family, json.dumps(config), str(weights), str(path),
                           "grads" if grads else ""], cwd=folder, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["torch"] is False  # torch was never imported there
    return found


def _check_child(found, in_process, named, grads):
    planted, other = found["planted"], found["other weights"]
    assert planted["first_divergent"] == in_process.first_divergent == named, planted["summary"]
    # the rows are bisect's: the same statuses, torch's rerun alone read back as it was measured
    in_rows = {r.path: r for r in in_process.rows}
    for row in planted["modules"]:
        assert row["status"] == in_rows[row["path"]].status, row
        assert row["local_torch_err"] == in_rows[row["path"]].local_torch_err, row
    if grads:
        assert planted["first_divergent_grad"] == in_process.first_divergent_grad, planted["summary"]
        assert planted["first_divergent_grad"].startswith(named + "."), planted["summary"]
    assert planted["trace"]["environment"]["device"] == "cpu" and planted["trace"]["precision"] == "float32"
    assert "trace: " in planted["summary"] and "on cpu" in planted["summary"]
    assert not other["passed"] and other["first_divergent"] == bisect_report.WEIGHTS and other["modules"] == []
    assert other["weights_differ"] == [other["first_weight"]], other["summary"]


FORMER = (16, 4, 2, 8, 20, 3)  # emb, heads, depth, seq_length, num_tokens, num_classes


def test_a_trace_bisects_in_another_process_without_torch(tmp_path):
    torch_model = tf.CTransformer(*FORMER).eval()
    verify.perturb_torch(torch_model, 0)
    flax_model = porting.torch_to_flax(torch_model)
    np.savez(tmp_path / "weights.npz", **porting.state_dict(flax_model))
    path = trace.record(torch_model, (IDS,), tmp_path / "trace", grads=True)
    flax_model.tblocks[0].mhattention.scale = "head"
    in_process = bisect.bisect(torch_model, flax_model, (IDS,), grads=True)  # compiled: the child loads the programs
    _check_child(_in_child("former", FORMER, tmp_path / "weights.npz", path, True, tmp_path), in_process,
                 "tblocks.0.mhattention", grads=True)


@pytest.mark.slow(reason="test_a_trace_bisects_in_another_process_without_torch")
def test_a_llama_trace_with_gradients_bisects_in_another_process(tmp_path):
    torch.manual_seed(0)
    torch_model = tl.LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    verify.perturb_torch(torch_model, 0)
    flax_model = porting.torch_to_flax(torch_model)
    np.savez(tmp_path / "weights.npz", **porting.state_dict(flax_model))
    ids = np.random.default_rng(0).integers(0, 64, (2, 12))
    path = trace.record(torch_model, (ids,), tmp_path / "trace", grads=True)
    in_process = bisect.bisect(torch_model, plant_tiled_heads(flax_model), (ids,), grads=True, use_jit=False)
    _check_child(_in_child("llama", LLAMA, tmp_path / "weights.npz", path, True, tmp_path), in_process, ATTN,
                 grads=True)


def _former():
    torch_model = tf.CTransformer(*FORMER).eval()
    verify.perturb_torch(torch_model, 0)
    return torch_model, porting.torch_to_flax(torch_model)


def test_record_writes_shards_an_index_and_hashes(tmp_path):
    torch_model, _ = _former()
    path = trace.record(torch_model, (IDS,), tmp_path / "t", max_shard_size=2000)
    index = json.loads((path / "trace.json").read_text())
    assert index["format"] == trace.FORMAT and index["version"] == trace.VERSION and index["precision"] == "float32"
    assert len(index["shards"]) > 2 and sorted(os.listdir(path)) == sorted([*index["shards"], "trace.json"])
    assert index["environment"]["device"] == "cpu" and index["environment"]["torch"] == torch.__version__
    labels = [c["label"] for c in index["calls"]]
    assert labels[-1] == "" and "tblocks.1.mhattention.tokeys" in labels
    weight = torch_model.tblocks[0].norm1.weight.detach().numpy()
    assert index["model"]["parameters"]["tblocks.0.norm1.weight"]["sha256"] == trace.weight_hash(weight)
    found = trace.read(path)
    first = found.calls("reference")["tblocks.1"]
    assert first.args[0].dtype == np.float64 and first.module.recorded_kind == "TransformerBlock"
    assert found.calls("reference")["tblocks.0"].output["output"].shape == (2, 8, 16)
    # a block's input is the previous block's output: written once
    entries = {c["label"]: c for c in index["calls"]}
    assert entries["tblocks.1"]["args"]["tuple"][0]["tensor"] == entries["tblocks.0"]["reference"]["output"]
    assert not [p for p in tmp_path.iterdir() if p.name != "t"]  # no temporary folder left


@pytest.mark.slow(reason="test_a_trace_bisects_in_another_process_without_torch")
def test_gradients_from_a_trace_are_those_of_bisect_in_process(tmp_path):
    torch_model, flax_model = _former()
    path = trace.record(torch_model, (IDS,), tmp_path / "t", grads=True, seed=3)
    flax_model.tblocks[0].mhattention.scale = "head"  # sqrt of the head width, not of emb: weights unchanged
    from_trace = bisect.bisect(str(path), flax_model, grads=True, use_jit=False)
    in_process = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, seed=3, use_jit=False)
    assert from_trace.first_divergent == in_process.first_divergent == "tblocks.0.mhattention", str(from_trace)
    assert [(r.path, r.status, r.torch_err, r.local_torch_err) for r in from_trace.rows] == \
        [(r.path, r.status, r.torch_err, r.local_torch_err) for r in in_process.rows]
    assert from_trace.first_divergent_grad == in_process.first_divergent_grad, str(from_trace)
    assert from_trace.first_divergent_grad.startswith("tblocks.0.mhattention."), str(from_trace)
    assert [(g.name, g.status, g.torch_err, g.jax_err) for g in from_trace.grad_rows] == \
        [(g.name, g.status, g.torch_err, g.jax_err) for g in in_process.grad_rows]


def test_weights_that_differ_are_named_and_nothing_runs(tmp_path):
    torch_model, flax_model = _former()
    path = trace.record(torch_model, (IDS,), tmp_path / "t")
    kernel = flax_model.tblocks[1].mhattention.tokeys.kernel
    kernel.set_value(kernel[...].T)
    for bias in (flax_model.toprobs.bias, flax_model.tblocks[0].norm2.bias):
        bias.set_value(bias[...] + 1.0)
    report = bisect.bisect(path, flax_model)
    assert report.first_divergent == bisect_report.WEIGHTS and not report.passed and report.rows == []
    assert sorted(report.weights_differ) == ["tblocks.0.norm2.bias", "tblocks.1.mhattention.tokeys.weight",
                                             "toprobs.bias"]
    assert "weights: FAIL: 3 differ" in report.summary() and "tblocks.1.mhattention.tokeys.weight" in str(report)
    assert json.loads(report.to_json())["weights_differ"] == report.weights_differ


def test_a_mixture_of_experts_is_said_not_forced(tmp_path):
    from flax_transformer.models.moe_config import MoeConfig

    torch.manual_seed(0)
    config = LlamaConfig.tiny(vocab_size=64, num_hidden_layers=1, model_type="qwen3_moe", moe=MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8))
    torch_model = tl.LlamaForCausalLM(config).eval()
    path = trace.record(torch_model, (np.random.default_rng(0).integers(0, 64, (1, 5)),), tmp_path / "t")
    flax_model = porting.torch_to_flax(torch_model)
    norm = flax_model.model.norm.scale
    norm.set_value(norm[...] * 2)  # other weights: nothing runs, and the report still says what a trace cannot do
    report = bisect.bisect(path, flax_model)
    assert report.weights_differ == ["model.norm.weight"] and "routing: NOT forced" in report.summary()
    assert report.routing is None and report.experts == {}


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing shard", "version", "index"])
def test_a_damaged_trace_is_refused_naming_the_file(tmp_path, damage):
    torch_model, flax_model = _former()
    path = trace.record(torch_model, (IDS,), tmp_path / "t")
    shard = path / "tensors-00001.safetensors"
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "flipped":
        data = bytearray(shard.read_bytes())
        data[-5] ^= 1
        shard.write_bytes(bytes(data))
    elif damage == "missing shard":
        shard.unlink()
    elif damage == "version":
        index = json.loads((path / "trace.json").read_text())
        (path / "trace.json").write_text(json.dumps(index | {"version": 99}))
    else:
        (path / "trace.json").write_text((path / "trace.json").read_text()[:100])
    named = "trace.json" if damage in ("version", "index") else shard.name
    with pytest.raises(ValueError, match=named):
        bisect.bisect(path, flax_model)
    with pytest.raises(ValueError, match="no trace at"):
        trace.read(tmp_path / "nothing")


def test_wrong_requests_are_refused_before_any_work(tmp_path):
    torch_model, flax_model = _former()
    path = trace.record(torch_model, (IDS,), tmp_path / "t")
    with pytest.raises(ValueError, match="recorded without gradients"):
        bisect.bisect(path, flax_model, grads=True)
    with pytest.raises(ValueError, match="takes no args"):
        bisect.bisect(path, flax_model, (IDS,))
    with pytest.raises(ValueError, match="recorded in float32"):
        bisect.bisect(path, flax_model, precision="bf16")
    with pytest.raises(FileExistsError):
        trace.record(torch_model, (IDS,), path)  # an existing trace is replaced only with overwrite=True
    with pytest.raises(ValueError, match="give the model's inputs"):
        bisect.bisect(torch_model, flax_model)
    bf16 = porting.torch_to_flax(torch_model, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="computes in bfloat16"):
        bisect.bisect(path, bf16)


def test_a_failed_record_leaves_nothing(tmp_path):
    torch_model, _ = _former()
    with pytest.raises(ValueError, match="must lie in"):
        trace.record(torch_model, (np.full((2, 8), 99),), tmp_path / "t")  # ids beyond the vocabulary
    assert list(tmp_path.iterdir()) == []


def test_a_bf16_trace(tmp_path):
    torch_model, _ = _former()
    path = trace.record(torch_model, (IDS,), tmp_path / "t", precision="bf16")
    found = trace.read(path)
    assert found.precision.name == "bfloat16"
    assert found.calls("low")["tblocks.0"].output["output"].dtype.name == "bfloat16"
    flax_model = porting.torch_to_flax(torch_model, dtype=jnp.bfloat16)
    report = bisect.bisect(path, flax_model, use_jit=False)
    assert report.passed and report.precision == "bfloat16", str(report)
    assert "in bfloat16 on cpu" in report.summary()
