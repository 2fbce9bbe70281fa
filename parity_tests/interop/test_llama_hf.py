"""HF folders of the llama family both ways: Llama, Mistral, Qwen2, Qwen3 and Gemma (issue 24 item 2).

Each ``model_type`` is a random tiny transformers model (no download), its weights perturbed
(fresh norms are ones, or Gemma's zeros: a wrong convention would hide), saved by transformers,
read by ``hf.from_pretrained``, written back by ``hf.save_pretrained`` and loaded by
transformers' ``AutoModelForCausalLM`` with no missing or unexpected keys. Logits are compared
at every position of a full and a right-padded row. Tolerance: 1e-5 in fp32 with matmul
precision "highest" (TOL).
"""

import json

import numpy as np
import pytest
import torch

from flax_transformer.interop import hf, porting
from flax_transformer.interop.safetensors_io import open_weights
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification import verify
from parity_tests.conftest import TOL

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
# a short original context, so that llama3's scaling changes the angles from position 1 on
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)

# model_type -> (transformers family, switches): each family's own conventions, and one switch each
# that config.json must carry for transformers to compute the same model
VARIANTS = {
    "llama": ("Llama", dict(rope_parameters=LLAMA3, tie_word_embeddings=True, mlp_bias=True)),
    "mistral": ("Mistral", dict(sliding_window=3, num_key_value_heads=1)),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=3, max_window_layers=1,
                            num_hidden_layers=2)),  # a full layer, then a sliding one
    "qwen3": ("Qwen3", dict(head_dim=16, attention_bias=True)),
    "gemma": ("Gemma", dict(head_dim=16, num_key_value_heads=1, pad_token_id=0)),
    # a 3-key window on layer 0 (the rows are 7 long), caps that bite (logits of a few units), a scalar
    # that is not head_dim, and positions past max_position_embeddings
    "gemma2": ("Gemma2", dict(head_dim=8, sliding_window=3, query_pre_attn_scalar=12, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0, num_hidden_layers=2, max_position_embeddings=4)),
    # linear scaling on the full layer only, the sliding layer's own base, and no soft-caps (null in the file)
    "gemma3_text": ("Gemma3", dict(head_dim=8, sliding_window=3, query_pre_attn_scalar=12, num_hidden_layers=2,
                                   layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4,
                                   rope_parameters=dict(full_attention=dict(rope_type="linear", factor=4.0,
                                                                            rope_theta=1e6),
                                                        sliding_attention=dict(rope_type="default", rope_theta=100.0)))),
}
CONFIGS = {"Gemma3": "Gemma3Text"}  # families whose config class is named otherwise than their *ForCausalLM


def _batch():
    """ids (2, 7) and a mask: a full row and a right-padded one."""
    ids = np.random.default_rng(0).integers(1, BASE["vocab_size"], size=(2, 7))
    mask = np.ones((2, 7), np.int64)
    mask[1, 5:] = 0
    return ids, mask


def logits(model, ids, mask) -> np.ndarray:
    """Logits of a transformers, torch_reference or Flax (jitted) model, float32 numpy."""
    if isinstance(model, transformers.PreTrainedModel):
        return hf.transformers_output(model, ids, mask)
    if isinstance(model, torch.nn.Module):
        with torch.no_grad():
            return model(torch.from_numpy(ids), torch.from_numpy(mask)).float().numpy()
    return np.asarray(verify.flax_module_call(model, ids, mask), np.float32)


def _err(a, b) -> float:
    assert a.shape == b.shape and np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.max(np.abs(a - b)))


def _transformers_load(folder):
    """transformers' own model of a folder and its loading report (every list of it)."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                    output_loading_info=True)
    return model.eval(), {k: list(v) for k, v in info.items() if v}


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    """(model_type, transformers' model, its folder, its logits, our Flax model read from the folder)."""
    kind = request.param
    family, switches = VARIANTS[kind]
    torch.manual_seed(0)
    reference = getattr(transformers, f"{family}ForCausalLM")(
        getattr(transformers, f"{CONFIGS.get(family, family)}Config")(**{**BASE, **switches})).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    folder = tmp_path_factory.mktemp(kind) / "hf"
    reference.save_pretrained(folder)
    want = logits(reference, *_batch())
    return kind, reference, folder, want, hf.from_pretrained(folder)


def test_folder_imports(case):
    """transformers' folder -> Flax and torch_reference, logits as transformers' at 1e-5."""
    kind, reference, folder, want, model = case
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.model_type == kind
    assert _err(logits(model, *_batch()), want) <= TOL
    assert _err(logits(hf.torch_from_pretrained(folder), *_batch()), want) <= TOL


def test_folder_exports(case, tmp_path):
    """Flax and torch_reference -> a folder transformers loads with nothing missing or unexpected, as the
    right class, computing the same logits; a tied model's file holds no lm_head.weight, as transformers
    writes it (the torch twin holds the tensor under both names, the Flax model once)."""
    kind, reference, folder, want, model = case
    for name, ours in (("flax", model), ("torch", hf.torch_from_pretrained(folder))):
        hf.save_pretrained(ours, tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["model_type"] == kind and config["architectures"] == [type(reference).__name__]
        again, report = _transformers_load(tmp_path / name)
        assert report == {} and type(again) is type(reference)
        assert _err(logits(again, *_batch()), logits(ours, *_batch())) <= TOL
        assert set(open_weights(tmp_path / name)) == set(open_weights(folder)), name  # transformers' names, no more
    assert ("lm_head.weight" in open_weights(folder)) == (not reference.config.tie_word_embeddings)


# llama3 scaling; a full and a sliding layer; Gemma 2's alternating layers; Gemma 3's two RoPEs and its pattern
@pytest.mark.parametrize("case", ["llama", "qwen2", "gemma2", "gemma3_text"], indirect=True)
def test_older_readers_take_the_same_model(case, tmp_path):
    """What transformers 5 reads from newer keys is written for older readers too: llama3 RoPE under
    rope_scaling (``rope_type`` and the older ``type``) and rope_theta, Qwen's windows as
    use_sliding_window + max_window_layers, Gemma 3's full-layer scaling as rope_scaling, its sliding
    layers' base as rope_local_base_freq and its layers as sliding_window_pattern. Without
    rope_parameters and layer_types, transformers (which then reads the older keys) computes the same logits."""
    kind, reference, folder, want, model = case
    hf.save_pretrained(model, tmp_path / "out")
    file = tmp_path / "out" / "config.json"
    config = json.loads(file.read_text())
    if kind == "llama":
        scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
        assert config["rope_scaling"] == {**scaling, "type": "llama3"} and config["rope_theta"] == LLAMA3["rope_theta"]
        assert config["rope_parameters"] == LLAMA3
    elif kind == "qwen2":
        assert config["use_sliding_window"] and config["max_window_layers"] == 1 and config["sliding_window"] == 3
    elif kind == "gemma3_text":
        assert config["rope_scaling"] == {"rope_type": "linear", "type": "linear", "factor": 4.0}
        assert (config["rope_theta"], config["rope_local_base_freq"], config["sliding_window_pattern"]) == (1e6, 100.0, 2)
    config.pop("rope_parameters"), config.pop("layer_types", None)
    file.write_text(json.dumps(config))
    older, report = _transformers_load(tmp_path / "out")
    assert report == {} and _err(logits(older, *_batch()), want) <= TOL
    assert hf.from_pretrained(tmp_path / "out").config == model.config


@pytest.mark.parametrize("case", ["llama"], indirect=True)  # tied: a base model's folder lacks no head
def test_legacy_folders(case, tmp_path):
    """Older exports' RoPE buffers (``rotary_emb.inv_freq``, which transformers skips) are skipped, and a
    base ``LlamaModel`` folder's names (no ``model.``) are read; the weights are the folder's."""
    from safetensors.numpy import save_file

    kind, reference, folder, want, model = case
    state = {k: v.detach().numpy() for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    for name, tensors in (("buffers", {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}),
                          ("base", {k.removeprefix("model."): v for k, v in state.items()})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((folder / "config.json").read_text())
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        read = porting.state_dict(hf.from_pretrained(tmp_path / name))
        assert read.keys() == porting.state_dict(model).keys()
        assert all(np.array_equal(v, state[k]) for k, v in read.items()), name


def test_port_to_a_sharded_bf16_folder(tmp_path, capsys):
    """``flax-transformer port`` of a Qwen2 folder to bf16 shards, checked against transformers; transformers
    loads the result, and read back it gives transformers' logits (the same bf16 weights in both, 1e-5).
    The begin and end ids (two end ids, as Llama 3 has) and generation_config.json come across."""
    from flax_transformer.cli.commands import main

    family, switches = VARIANTS["qwen2"]
    torch.manual_seed(1)  # transformers' own initialisation: bf16 rounding stays within hf.BF16_TOLERANCE
    getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(
        **{**BASE, **switches, "bos_token_id": 3, "eos_token_id": [4, 5]})).save_pretrained(tmp_path / "src")
    generation = json.loads((tmp_path / "src" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [4, 5]
    out = tmp_path / "out"
    assert main(["port", str(tmp_path / "src"), str(out), "--dtype", "bf16", "--max-shard-size", "8KB",
                 "--no-certify", "--verify"]) == 0
    assert capsys.readouterr().out.count("(bf16 weights) (reloaded) -> pass") == 2  # vs torch and transformers
    shards = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert {str(v.dtype) for v in open_weights(out).values()} == {"bfloat16"}
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == "bfloat16" and written["bos_token_id"] == 3 and written["eos_token_id"] == [4, 5]
    assert json.loads((out / "generation_config.json").read_text()) == generation
    assert hf.from_pretrained(out).config.eos_token_id == (4, 5)
    again, report = _transformers_load(out)
    assert report == {} and _err(logits(hf.from_pretrained(out), *_batch()), logits(again, *_batch())) <= TOL


@pytest.mark.parametrize("config, message", [
    (dict(model_type="mistral", attention_bias=True), "attention_bias=True"),
    (dict(model_type="llama", qk_norm=True), "qk_norm=True"),
    (dict(model_type="qwen2", attention_bias=False), "attention_bias=False"),
    (dict(model_type="gemma"), "norm_plus_one=False"),
    (dict(model_type="llama", sliding_window=4), "sliding_window=4"),
])
def test_export_refuses_what_its_model_type_cannot_hold(config, message, tmp_path):
    """A switch transformers' class for the model_type lacks is named, and nothing is written."""
    from torch_reference.llama import LlamaForCausalLM

    with pytest.raises(ValueError, match=message):
        hf.save_pretrained(LlamaForCausalLM(LlamaConfig.tiny(**config)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_config_files_read_as_transformers_reads_them(tmp_path):
    """A Gemma config.json's legacy "gelu" is the tanh approximation (and exported so); rope_scaling wins
    over rope_parameters, as in transformers; an unknown model_type is refused in one line."""
    gemma = LlamaConfig.from_hf(dict(model_type="gemma", hidden_act="gelu"))
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.to_hf_dict()["hidden_activation"] == "gelu_pytorch_tanh"
    both = LlamaConfig.from_hf(dict(model_type="llama", rope_theta=7.0, rope_scaling=dict(type="linear", factor=2.0),
                                    rope_parameters=dict(rope_type="default", rope_theta=7.0)))
    assert both.rope_scaling.rope_type == "linear" and both.rope_scaling.factor == 2.0
    # Gemma 2: a cap left out is its class's default (50, 30); a null one is no cap, as transformers reads it
    left_out, null = (LlamaConfig.from_hf(dict(model_type="gemma2", **caps)) for caps in (
        {}, dict(attn_logit_softcapping=None, final_logit_softcapping=None)))
    assert (left_out.attn_logit_softcapping, left_out.final_logit_softcapping) == (50.0, 30.0)
    assert (null.attn_logit_softcapping, null.final_logit_softcapping) == (None, None)
    (tmp_path / "g4").mkdir()
    (tmp_path / "g4" / "config.json").write_text(json.dumps({"model_type": "gemma4_text"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gemma4_text'"):
        hf.from_pretrained(tmp_path / "g4")
