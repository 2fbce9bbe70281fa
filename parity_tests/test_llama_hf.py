"""HF folders of the llama family both ways: Llama, Mistral, Qwen2, Qwen3 and Gemma (issue 24 item 2).

Each ``model_type`` is a random tiny transformers model (no download), its weights perturbed
(fresh norms are ones, or Gemma's zeros: a wrong convention would hide), saved by transformers,
read by ``hf.from_pretrained``, written back by ``hf.save_pretrained`` and loaded by
transformers' ``AutoModelForCausalLM`` with no missing or unexpected keys. Logits are compared
at every position of a full and a right-padded row. Tolerance: 1e-5 in fp32 with matmul
precision "highest" (TOL).
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from flax_transformer.interop import hf
from flax_transformer.interop.safetensors_io import open_weights
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification import verify

from .conftest import TOL

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
}


def _batch():
    """ids (2, 7) and a mask: a full row and a right-padded one."""
    ids = np.random.default_rng(0).integers(1, BASE["vocab_size"], size=(2, 7))
    mask = np.ones((2, 7), np.int64)
    mask[1, 5:] = 0
    return ids, mask


def _logits(model, ids, mask) -> np.ndarray:
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
        getattr(transformers, f"{family}Config")(**{**BASE, **switches})).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    folder = tmp_path_factory.mktemp(kind) / "hf"
    reference.save_pretrained(folder)
    want = _logits(reference, *_batch())
    return kind, reference, folder, want, hf.from_pretrained(folder)


def test_folder_imports(case):
    """transformers' folder -> Flax and torch_reference, logits as transformers' at 1e-5."""
    kind, reference, folder, want, model = case
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.model_type == kind
    assert _err(_logits(model, *_batch()), want) <= TOL
    assert _err(_logits(hf.torch_from_pretrained(folder), *_batch()), want) <= TOL


def test_folder_exports(case, tmp_path):
    """Flax -> a folder transformers loads with nothing missing or unexpected, as the right class,
    computing the same logits; a tied model's file holds no lm_head.weight, as transformers writes it."""
    kind, reference, folder, want, model = case
    hf.save_pretrained(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == kind and config["architectures"] == [type(reference).__name__]
    again, report = _transformers_load(tmp_path / "out")
    assert report == {} and type(again) is type(reference)
    assert _err(_logits(again, *_batch()), _logits(model, *_batch())) <= TOL
    assert set(open_weights(tmp_path / "out")) == set(open_weights(folder))  # transformers' own names, no more
    assert ("lm_head.weight" in open_weights(tmp_path / "out")) == (not reference.config.tie_word_embeddings)


@pytest.mark.parametrize("case", ["llama"], indirect=True)  # the variant with llama3 scaling
def test_llama3_rope_scaling_reaches_older_readers(case, tmp_path):
    """The llama3 settings are written under rope_scaling (``rope_type`` and the older ``type``) and
    rope_theta as well as rope_parameters: a config.json with rope_scaling alone gives the same logits."""
    kind, reference, folder, want, model = case
    hf.save_pretrained(model, tmp_path / "out")
    file = tmp_path / "out" / "config.json"
    config = json.loads(file.read_text())
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    assert config["rope_scaling"] == {**scaling, "type": "llama3"} and config["rope_theta"] == LLAMA3["rope_theta"]
    assert config["rope_parameters"] == LLAMA3
    del config["rope_parameters"]  # what a reader older than transformers 5 takes
    file.write_text(json.dumps(config))
    older, report = _transformers_load(tmp_path / "out")
    assert report == {} and _err(_logits(older, *_batch()), want) <= TOL
    assert hf.from_pretrained(tmp_path / "out").config == model.config


def test_sharded_and_bf16_folders(tmp_path):
    """A sharded export of Qwen2 and a bf16 one of Gemma: transformers loads each, read back they give
    transformers' logits (the same bf16 weights in both at 1e-5)."""
    for kind, options in (("qwen2", dict(max_shard_size="8KB")), ("gemma", dict(dtype=jnp.bfloat16))):
        family, switches = VARIANTS[kind]
        torch.manual_seed(1)
        model = hf.from_pretrained(_save(getattr(transformers, f"{family}ForCausalLM")(
            getattr(transformers, f"{family}Config")(**{**BASE, **switches})), tmp_path / kind))
        out = tmp_path / f"{kind}-out"
        hf.save_pretrained(model, out, **options)
        stored = open_weights(out)
        if kind == "qwen2":
            shards = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
            assert len(shards) > 1 and not (out / "model.safetensors").exists()
        else:
            assert {str(v.dtype) for v in stored.values()} == {"bfloat16"}
            assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
        again, report = _transformers_load(out)
        assert report == {}
        assert _err(_logits(hf.from_pretrained(out), *_batch()), _logits(again, *_batch())) <= TOL


def _save(reference, folder):
    reference.save_pretrained(folder)
    return folder


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
    over rope_parameters, as in transformers; gemma2 is refused in one line."""
    gemma = LlamaConfig.from_hf(dict(model_type="gemma", hidden_act="gelu"))
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.to_hf_dict()["hidden_activation"] == "gelu_pytorch_tanh"
    both = LlamaConfig.from_hf(dict(model_type="llama", rope_theta=7.0, rope_scaling=dict(type="linear", factor=2.0),
                                    rope_parameters=dict(rope_type="default", rope_theta=7.0)))
    assert both.rope_scaling.rope_type == "linear" and both.rope_scaling.factor == 2.0
    (tmp_path / "g2").mkdir()
    (tmp_path / "g2" / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    with pytest.raises(ValueError, match="'gemma2' is not supported: its soft-capping"):
        hf.from_pretrained(tmp_path / "g2")
