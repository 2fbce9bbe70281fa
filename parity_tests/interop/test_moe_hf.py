"""HF folders of the llama family's mixtures of experts both ways: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Each ``model_type`` is ``test_moe``'s tiny random transformers model (uneven expert counts, top-k 1 to
3, dense layers among sparse, a tied head, Qwen3-MoE's own head_dim, OLMoE's clip_qkv, Mixtral's
window), saved by transformers in its per-expert layout, read by ``hf.from_pretrained`` and
``hf.torch_from_pretrained``, written back by ``hf.save_pretrained`` and loaded by transformers with
nothing missing, unexpected or mismatched. Logits are compared on the real tokens of a right-padded
batch. Tolerance: TOL (1e-5) times the logits' scale (at least 1), fp32, matmul precision "highest".
"""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from flax_transformer.interop import hf
from flax_transformer.interop.safetensors_io import ShardError, open_weights
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.state_dict_errors import StateDictError
from parity_tests.conftest import TOL
from parity_tests.interop.test_llama_hf import logits
from parity_tests.models.test_moe import KINDS, hf_model, padded_inputs

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")


def _err(got, want) -> float:
    """Max abs error on the real tokens, relative to the logits' scale (at least 1)."""
    keep = padded_inputs()[1].astype(bool)
    assert got.shape == want.shape and np.isfinite(got[keep]).all()
    return float(np.abs(got - want)[keep].max() / max(1.0, np.abs(want[keep]).max()))


def _transformers_load(folder):
    """transformers' own model of a folder and its loading report (only the lists that are not empty)."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                    output_loading_info=True)
    return model.eval(), {k: list(v) for k, v in info.items() if v}


@pytest.fixture(scope="module", params=list(KINDS))
def case(request, tmp_path_factory):
    """(model_type, transformers' model, its folder, its logits, our Flax model read from the folder)."""
    kind = request.param
    reference = hf_model(kind)
    folder = tmp_path_factory.mktemp(kind) / "hf"
    reference.save_pretrained(folder)
    want = logits(reference, *padded_inputs())
    return kind, reference, folder, want, hf.from_pretrained(folder)


@pytest.mark.slow_cases({
    "qwen3_moe": "test_folder_reads_and_writes_back[qwen2_moe] (the same MOE_ROWS), test_model_router_logits_and_aux_loss",
    "olmoe": "test_folder_reads_and_writes_back[qwen2_moe] (the same MOE_ROWS), test_model_router_logits_and_aux_loss",
})
def test_folder_reads_and_writes_back(case, tmp_path):
    """transformers' folder -> Flax and torch_reference with transformers' logits; Flax -> a folder with
    exactly the keys transformers' own save wrote (per expert, Mixtral's ``block_sparse_moe.*.w1/w2/w3``,
    a tied head without ``lm_head.weight``), which transformers loads with nothing missing, unexpected
    or mismatched, as the right class, computing the same logits."""
    kind, reference, folder, want, model = case
    ids, mask = padded_inputs()
    assert model.config.model_type == kind and _err(logits(model, ids, mask), want) <= TOL
    assert _err(logits(hf.torch_from_pretrained(folder), ids, mask), want) <= TOL
    hf.save_pretrained(model, tmp_path / "out")
    assert set(open_weights(tmp_path / "out")) == set(open_weights(folder))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == kind and config["architectures"] == [type(reference).__name__]
    again, report = _transformers_load(tmp_path / "out")
    assert report == {} and type(again) is type(reference)
    assert _err(logits(again, ids, mask), want) <= TOL


@pytest.mark.slow_cases({
    "qwen3_moe": "test_fused_in_memory_layout_reads[mixtral], test_converter",
    "olmoe": "test_fused_in_memory_layout_reads[mixtral], test_converter",
})
def test_fused_in_memory_layout_reads(case, tmp_path):
    """A folder in transformers' in-memory layout (``model.state_dict()`` written as it is: fused
    ``mlp.experts.gate_up_proj`` (E, 2I, H), Mixtral's ``mlp.*`` names) reads to the same model."""
    kind, reference, folder, want, _ = case
    (tmp_path / "fused").mkdir()
    shutil.copy(folder / "config.json", tmp_path / "fused")
    state = {k: v.detach().clone().contiguous().numpy() for k, v in reference.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, tmp_path / "fused" / "model.safetensors")
    assert _err(logits(hf.from_pretrained(tmp_path / "fused"), *padded_inputs()), want) <= TOL


@pytest.mark.parametrize("case", ["qwen2_moe"], indirect=True)  # a shared expert, a dense layer, a tied head
def test_bf16_sharded_save(case, tmp_path):
    """``save_pretrained(dtype=jnp.bfloat16, max_shard_size=...)``: several shards, every tensor bf16, the
    config's dtype; transformers loads it with nothing missing, and read back here it gives the logits
    transformers computes from the same bf16 weights."""
    kind, reference, folder, want, model = case
    out = hf.save_pretrained(model, tmp_path / "out", dtype=jnp.bfloat16, max_shard_size="4KB")
    shards = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert {str(v.dtype) for v in open_weights(out).values()} == {"bfloat16"}
    assert set(open_weights(out)) == set(open_weights(folder))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    again, report = _transformers_load(out)
    assert report == {}
    ids, mask = padded_inputs()
    assert _err(logits(hf.from_pretrained(out), ids, mask), logits(again, ids, mask)) <= TOL


@pytest.mark.parametrize("kind", list(KINDS))
def test_to_hf_dict_round_trip(kind):
    """``LlamaConfig.from_hf`` -> ``to_hf_dict`` -> transformers' config class: the same LlamaConfig back,
    and transformers' model of it takes torch_reference's weights strictly (nothing missing or unexpected)."""
    import torch_reference.llama as tl

    cfg = LlamaConfig.from_hf(hf_model(kind).config)
    theirs = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    assert type(theirs).__name__ == KINDS[kind][0] and LlamaConfig.from_hf(theirs) == cfg
    torch.manual_seed(0)
    ours = tl.LlamaForCausalLM(cfg)
    model = transformers.AutoModelForCausalLM.from_config(theirs)
    result = model.load_state_dict(ours.state_dict(), strict=False)
    assert not result.missing_keys and not result.unexpected_keys


# ------------------------------------------------------------------ refusals


def _folder_with(tmp_path, folder, state, name="bad"):
    (tmp_path / name).mkdir()
    shutil.copy(folder / "config.json", tmp_path / name)
    save_file(state, tmp_path / name / "model.safetensors")
    return tmp_path / name


def _layer1(kind):
    """Layer 1's MoE prefix on disk and its weight names (gate, up, down): Mixtral's own, or the others'."""
    if kind == "mixtral":
        return "model.layers.1.block_sparse_moe", ("w1", "w3", "w2")
    return "model.layers.1.mlp", ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("case", ["mixtral", "olmoe"], indirect=True)
def test_broken_expert_files_are_refused_naming_layer_and_expert(case, tmp_path):
    """A file missing one expert's tensor, an expert given twice (per expert and fused), a router gate
    of the wrong width, an expert of another shape: each refused in one StateDictError that names the
    layer and the expert (or every expert's shape), before anything loads."""
    kind, _, folder, _, _ = case
    state = load_file(folder / "model.safetensors")
    prefix, (_, up, down) = _layer1(kind)
    experts = LlamaConfig.from_hf(json.loads((folder / "config.json").read_text())).moe.num_experts
    missing = f"{prefix}.experts.2.{up}.weight"
    cases = {
        "missing": ({k: v for k, v in state.items() if k != missing}, [missing]),
        "twice": ({**state, "model.layers.1.mlp.experts.down_proj": np.zeros((experts, 16, 12), np.float32)},
                  ["model.layers.1.mlp.experts.down_proj", "made twice", f"{prefix}.experts.0.{down}.weight"]),
        "gate width": ({**state, f"{prefix}.gate.weight": state[f"{prefix}.gate.weight"][:-1]},
                       ["layers.1.mlp.gate.weight", f"({experts - 1}, 16)"]),
        "expert shape": ({**state, f"{prefix}.experts.1.{down}.weight": np.zeros((16, 13), np.float32)},
                         [f"{prefix}.experts.{{e}}.{down}.weight", "1: [16, 13]", "0: [16, 12]"]),
    }
    for name, (bad, words) in cases.items():
        with pytest.raises(StateDictError) as error:
            hf.from_pretrained(_folder_with(tmp_path, folder, bad, name.replace(" ", "-")))
        assert all(word in str(error.value) for word in words), f"{name}: {error.value}"


def test_an_expert_in_two_shards_is_refused(tmp_path):
    """The per-expert layout, sharded, with one expert's tensor in two shards: refused naming it."""
    reference = hf_model("olmoe")
    reference.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    key = "model.layers.0.mlp.experts.1.gate_proj.weight"
    owner = index["weight_map"][key]
    other = next(s for s in shards if s != owner)
    tensor = load_file(tmp_path / "src" / owner)[key]
    save_file({**load_file(tmp_path / "src" / other), key: tensor}, tmp_path / "src" / other)
    with pytest.raises(ShardError, match=r"experts\.1\.gate_proj\.weight is in 2 shards"):
        hf.from_pretrained(tmp_path / "src")


# ------------------------------------------------------------------ the command line


@pytest.mark.slow(reason="test_folder_reads_and_writes_back: the same read and write, without the CLI's verify")
@pytest.mark.parametrize("case", ["qwen3_moe"], indirect=True)
def test_port_an_moe_folder(case, tmp_path, capsys):
    """``flax-transformer port FOLDER OUT --verify`` of a Qwen3-MoE folder (a dense layer, a head_dim of
    its own): the HF folder written has transformers' keys and loads in transformers with nothing
    missing, computing transformers' logits."""
    from flax_transformer.cli.commands import main

    kind, reference, folder, want, _ = case
    assert main(["port", str(folder), str(tmp_path / "out"), "--no-certify", "--verify"]) == 0
    assert "-> pass" in capsys.readouterr().out
    assert set(open_weights(tmp_path / "out")) == set(open_weights(folder))
    again, report = _transformers_load(tmp_path / "out")
    assert report == {} and _err(logits(again, *padded_inputs()), want) <= TOL
