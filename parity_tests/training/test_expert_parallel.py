"""Expert parallelism: ``--mesh data=2,expert=4`` splits a mixture of experts' expert tensors (and their Adam
moments and LoRA adapters) along the expert axis over "expert", everything else as before, batches over
every axis. Loading onto such a mesh puts each expert where training uses it, reading from a fused
safetensors file only the experts each device holds.

The mesh tests run in a subprocess with 8 host devices (the device count is fixed at JAX start-up).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from flax_transformer.interop.placement import PlacementError, is_expert_tensor, param_spec
from flax_transformer.training import lm

from .test_runs import records, tree_of

REPO = Path(__file__).resolve().parents[2]
EIGHT = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")


def _spec(path, shape, **axes):
    return param_spec(path, jax.ShapeDtypeStruct(shape, np.float32), axes)


def test_param_spec_splits_expert_tensors_over_expert_and_the_rest_as_fsdp():
    """The rule alone, by path: expert weights, their LoRA adapters and their Adam moments (a JAX key path
    ending in ``.value``) on the expert axis; FSDP then on the largest other axis; other tensors as before."""
    experts = "model.layers.0.mlp.experts."
    assert _spec(experts + "gate_up_proj", (4, 32, 32), data=2, fsdp=1, expert=4) == P("expert", None, None)
    assert _spec(experts + "down_proj", (4, 16, 32), fsdp=2, expert=4) == P("expert", None, "fsdp")
    assert _spec(experts + "gate_up_proj_lora.lora_A", (4, 32, 8), fsdp=2, expert=2) == P("expert", "fsdp", None)
    assert _spec(experts + "down_proj_lora.lora_B", (4, 8, 32), expert=4) == P("expert", None, None)
    # an Adam moment's path, as tree_map_with_path gives it
    path = (jax.tree_util.DictKey("opt_state"), jax.tree_util.SequenceKey(0), jax.tree_util.DictKey("mu"),
            *map(jax.tree_util.DictKey, ["model", "layers", 0, "mlp", "experts", "down_proj"]),
            jax.tree_util.GetAttrKey("value"))
    assert is_expert_tensor(path) and param_spec(path, np.zeros((4, 16, 32)), {"expert": 4}) == P("expert", None, None)
    # not experts: the router (E, H), a dense MLP, the shared expert; an expert axis leaves them replicated
    for other in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.gate_proj.kernel",
                  "model.layers.0.mlp.shared_expert.down_proj.kernel"):
        assert not is_expert_tensor(other)
        assert _spec(other, (4, 32), data=2, expert=4) == P()
        assert _spec(other, (4, 32), fsdp=2, expert=4) == P(None, "fsdp")
    # with no expert axis the FSDP rule is today's: the largest divisible axis, the expert axis included
    assert _spec(experts + "gate_up_proj", (8, 12, 4), fsdp=8) == P("fsdp", None, None)
    assert _spec(experts + "gate_up_proj", (8, 12, 4), fsdp=2) == P(None, "fsdp", None)
    assert _spec(experts + "gate_up_proj", (8, 12, 4), fsdp=5) == P()
    with pytest.raises(PlacementError, match=r"model\.layers\.0\.mlp\.experts\.down_proj \[6, 16, 32\] has 6 experts, "
                                             r"which the mesh's expert axis of size 4 does not divide"):
        _spec(experts + "down_proj", (6, 16, 32), expert=4)


# Run with 8 host devices: placement of a fresh model, its optimizer and a LoRA model; a streamed load of a
# fused safetensors file (which rows of which tensor each read took) and of an HF folder (per-expert files);
# the refusals. Prints one JSON line; every check that needs the devices is an assert here.
MESH_SCRIPT = r'''
import json, sys, jax, numpy as np, optax
from pathlib import Path
from flax import nnx
from jax.sharding import PartitionSpec as P
from flax_transformer.interop import hf, safetensors_io, targets
from flax_transformer.interop.placement import PlacementError
from flax_transformer.models import llama, lora
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.moe_config import MoeConfig
from flax_transformer.training.distributed import batch_sharding, parse_mesh, place_state, state_shardings
from flax_transformer.training.errors import RunError

tmp = Path(sys.argv[1])
config = LlamaConfig.tiny(model_type="qwen3_moe", qk_norm=True,
                          moe=MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))
model = nnx.jit(lambda: llama.LlamaForCausalLM(config, rngs=nnx.Rngs(0)))()  # one compile, not one per op
out = {}

# training: model and Adam state on data=2,expert=4 and on fsdp=2,expert=4
for spec in ("data=2,expert=4", "fsdp=2,expert=4"):
    mesh = parse_mesh(spec)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    model_state, opt_state, (model_sh, opt_sh, _) = place_state(nnx.split(model)[1], nnx.split(optimizer)[1], mesh)
    specs = {}
    for tree in (model_state, opt_state):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if hasattr(leaf, "sharding") and leaf.ndim:
                specs[jax.tree_util.keystr(path)] = str(leaf.sharding.spec)
    out[spec] = specs
    gate_up = model_state["model"]["layers"][0]["mlp"]["experts"]["gate_up_proj"][...]
    held = {d.id: np.asarray(s.data) for s in gate_up.addressable_shards for d in [s.device]}
    whole = np.asarray(model.model.layers[0].mlp.experts.gate_up_proj[...])
    for s in gate_up.addressable_shards:  # each device holds its expert(s) whole in data=2,expert=4
        assert np.array_equal(np.asarray(s.data), whole[s.index]), s.index
    out[spec + " shard"] = [list(s.data.shape) for s in gate_up.addressable_shards][:1]
    out[spec + " batch"] = str(batch_sharding({"x": np.zeros((8, 3))}, mesh)["x"].spec)

# LoRA adapters on the experts: A and B split over "expert" as their weights
lora_model = nnx.clone(model)
lora.apply(lora_model, rank=2, targets=(), parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
           rngs=nnx.Rngs(1))
shardings = state_shardings(nnx.split(lora_model)[1], parse_mesh("data=2,expert=4"))
out["lora"] = {jax.tree_util.keystr(p): str(s.spec) for p, s in jax.tree_util.tree_leaves_with_path(shardings)
               if "lora" in jax.tree_util.keystr(p)}

# loading: a fused safetensors file, each read recorded as (name, rows)
safetensors_io.write_safetensors(safetensors_io.model_tensors(model), tmp / "fused.safetensors")
reads = []
def recorded(name, lazy):
    def whole():
        reads.append([name, None])
        return lazy.read()
    def rows(start, stop):
        reads.append([name, [start, stop]])
        return lazy.rows(start, stop).read()
    return safetensors_io.Lazy(lazy.shape, lazy.dtype, whole, rows)
state = {k: recorded(k, v) for k, v in safetensors_io.open_weights(tmp / "fused.safetensors").items()}
mesh = parse_mesh("data=2,expert=4")
loaded = targets.build_unfilled(llama.LlamaForCausalLM, dict(config=config))
safetensors_io.fill(loaded, state, sharding=mesh)
out["reads"] = sorted(r for r in reads if "experts" in r[0])
out["other reads"] = sorted({r[1] is None for r in reads if "experts" not in r[0]})
for (path, a), (_, b) in zip(nnx.iter_graph(model), nnx.iter_graph(loaded)):
    if isinstance(a, nnx.Param):
        assert np.array_equal(np.asarray(a[...]), np.asarray(b[...])), path
out["loaded"] = str(loaded.model.layers[1].mlp.experts.down_proj[...].sharding.spec)
for s in loaded.model.layers[1].mlp.experts.down_proj[...].addressable_shards:
    assert s.data.shape == (1, 16, 32)

# an HF folder (transformers' per-expert files) onto the mesh
hf.save_pretrained(model, tmp / "hf")
from_hf = hf.from_pretrained(tmp / "hf", sharding=mesh)
out["hf"] = str(from_hf.model.layers[0].mlp.experts.gate_up_proj[...].sharding.spec)
assert np.array_equal(np.asarray(from_hf.model.layers[0].mlp.experts.gate_up_proj[...]), whole)

# refusals, one line each
def refusal(call):
    try:
        call()
    except (RunError, PlacementError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"
reads.clear()
out["refused fill"] = refusal(lambda: safetensors_io.fill(
    targets.build_unfilled(llama.LlamaForCausalLM, dict(config=config)), state, sharding=parse_mesh("data=2,expert=3")))
out["reads before refusal"] = len(reads)
out["refused run"] = refusal(lambda: state_shardings(nnx.split(model)[1], parse_mesh("expert=8")))
dense = nnx.eval_shape(lambda: llama.LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
dense_optimizer = nnx.Optimizer(dense, optax.adamw(1e-3), wrt=nnx.Param)
out["refused dense"] = refusal(lambda: place_state(nnx.split(dense)[1], nnx.split(dense_optimizer)[1],
                                                   parse_mesh("data=4,expert=2")))
out["refused spec"] = refusal(lambda: parse_mesh("data=2,experts=4"))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def on_eight_devices(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("expert_mesh")
    done = subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(tmp)], cwd=REPO, env=EIGHT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_expert_tensors_and_their_adam_moments_are_split_over_expert(on_eight_devices):
    out, stderr = on_eight_devices
    assert "Sharded over {'data': 2, 'fsdp': 1, 'expert': 4}: batches over all 8 devices, 0 of 29 model arrays split " \
           "over fsdp, 4 split over expert" in stderr
    specs = out["data=2,expert=4"]
    experts = {k: v for k, v in specs.items() if "experts" in k}
    assert len(experts) == 12  # 2 layers x 2 weights x (the parameter, Adam's mu and nu)
    assert set(experts.values()) == {"P('expert', None, None)"}
    assert {v for k, v in specs.items() if "experts" not in k} == {"P()"}
    assert out["data=2,expert=4 shard"] == [[1, 32, 32]]
    assert out["data=2,expert=4 batch"] == "P(('data', 'fsdp', 'expert'),)"
    combined = out["fsdp=2,expert=4"]  # FSDP splits the experts' largest other axis, and the rest as before
    assert combined["['model']['layers'][0]['mlp']['experts']['down_proj'].value"] == \
        "P('expert', None, 'fsdp')"
    assert combined["['opt_state'][0]['nu']['model']['layers'][0]['mlp']['experts']['gate_up_proj'].value"] == \
        "P('expert', 'fsdp', None)"
    assert combined["['model']['embed_tokens']['embedding'].value"] == "P('fsdp', None)"
    assert out["lora"] and set(out["lora"].values()) == {"P('expert', None, None)"}, out["lora"]
    assert len(out["lora"]) == 8  # 2 layers x 2 weights x (A, B)


def test_streamed_load_reads_each_expert_where_it_is_held(on_eight_devices):
    """From a fused safetensors file, each expert tensor is read as 4 blocks of one expert (each block once,
    though two devices hold it), never whole; the other tensors whole; an HF folder's per-expert files load
    onto the expert axis too; values equal the model's."""
    out, _ = on_eight_devices
    names = [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("down_proj", "gate_up_proj")]
    assert out["reads"] == [[name, [e, e + 1]] for name in names for e in range(4)]
    assert out["other reads"] == [True]
    assert out["loaded"] == out["hf"] == "P('expert', None, None)"


def test_bad_expert_meshes_are_refused_in_one_line(on_eight_devices):
    out, _ = on_eight_devices
    assert out["refused fill"].startswith("PlacementError: model.layers.0.mlp.experts.")  # the first in graph order
    assert out["refused fill"].endswith(" has 4 experts, which the mesh's expert axis of size 3 does not divide (use an "
                                        "expert size dividing 4)")
    assert out["reads before refusal"] == 0
    assert out["refused run"].startswith("RunError: --mesh data=1,fsdp=1,expert=8: model.layers.0.mlp.experts.")
    assert "has 4 experts, which the mesh's expert axis of size 8 does not divide" in out["refused run"]
    assert out["refused dense"] == ("RunError: --mesh data=4,fsdp=1,expert=2: expert=2 needs a mixture of experts, and "
                                    "this model has no experts; put those devices on data= (or fsdp=) instead")
    assert out["refused spec"] == ("RunError: --mesh 'data=2,experts=4': expected data=N,fsdp=M (and expert=K for a "
                                   "mixture of experts)")
    for line in out.values():
        assert "\n" not in str(line)


@pytest.mark.slow(reason="test_expert_tensors_and_their_adam_moments_are_split_over_expert")
@pytest.mark.parametrize("mesh", ["data=2,expert=4", "fsdp=2,expert=4"])
def test_expert_parallel_run_equals_one_device(tmp_path, mesh):
    """``train.lm --model llama --experts 4 --mesh ...`` on 8 host devices: the losses and parameters (and
    Adam moments) of the one-device run within 1e-5, its experts split over "expert"."""
    text = tmp_path / "text.txt"
    text.write_text("ROMEO:\nBefore we proceed any further, hear me speak.\n" * 60)
    flags = ["--preset", "tiny", "--model", "llama", "--experts", "4", "--experts-per-token", "2", "--text",
             str(text), "--steps", "4", "--no-progress"]
    config = lm.LMConfig.tiny(model="llama", experts=4, experts_per_token=2, text=str(text), steps=4)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes a Python float and its int32 step
        lm.train_and_evaluate(config, tmp_path / "one", progress=False)
    done = subprocess.run([sys.executable, "-m", "train.lm", *flags, "--out", str(tmp_path / "eight"), "--mesh", mesh],
                          cwd=REPO, env=EIGHT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 split over expert" in done.stderr  # the tiny preset: one layer
    one, eight = records(tmp_path / "one", "train"), records(tmp_path / "eight", "train")
    assert [r["step"] for r in one] == [r["step"] for r in eight] and one
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(one, eight, strict=True)) <= 1e-5
    a, b = tree_of(tmp_path / "one"), tree_of(tmp_path / "eight")
    assert a.keys() == b.keys() and any("experts" in key for key in a)
    for key in a:
        if a[key].dtype.kind == "f":
            assert float(np.abs(a[key] - b[key]).max()) <= 1e-5 * max(1.0, float(np.abs(a[key]).max())), key
