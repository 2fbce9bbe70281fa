"""GPT-OSS folders both ways: the plain folder transformers 5 writes (``mlp.experts.gate_up_proj`` (E, H, 2I)
interleaved, ``..._bias``, ``mlp.router.*``, ``self_attn.sinks``) and the quantised one of the released
checkpoints (the experts' weights as MXFP4 ``*_blocks`` + ``*_scales``, ``quantization_config:
{"quant_method": "mxfp4"}``), built here with ``mxfp4_quantise`` from a random transformers model whose
expert weights MXFP4 holds exactly, so that both folders are one model.

Read against transformers 5 loading the same folder (on the CPU it dequantises MXFP4 into the parameters'
dtype, float32 here: the values are bf16-exact either way), dequantised bit for bit as
``convert_moe_packed_tensors``, lazily; exports plain by default (and MXFP4 when asked) that transformers
loads with nothing missing; malformed blocks or scales refused naming the tensor. Tolerance: TOL on the
logits (fp32, matmul precision "highest").
"""

import json
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from flax_transformer.interop import hf, hf_tables
from flax_transformer.interop.converter_ops import mxfp4_dequantise, mxfp4_quantise
from flax_transformer.interop.safetensors_io import Lazy, open_weights, read
from flax_transformer.models.state_dict_errors import StateDictError
from parity_tests.conftest import TOL

B, T, VOCAB = 2, 13, 61
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def hf_config():
    """Hidden and expert widths of 32 (MXFP4 blocks of 32 values along the input axis), a 4-key window on
    alternate layers, YaRN from an original context of 8 (T = 13 goes past both)."""
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, swiglu_limit=1.5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
                             original_max_position_embeddings=8, truncate=False))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(plain folder, quantised folder) of one random GPT-OSS: transformers' own save, then its expert
    weights replaced by their MXFP4 blocks and scales."""
    root = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn(p.shape))
            if name.endswith(EXPERT_WEIGHTS):  # MXFP4-exact, so that the two folders hold one model
                p.copy_(torch.from_numpy(mxfp4_dequantise(*mxfp4_quantise(p.numpy())).astype(np.float32)))
    plain, quantised = root / "plain", root / "mxfp4"
    model.save_pretrained(plain)
    weights = load_file(plain / "model.safetensors")
    out = {}
    for key, value in weights.items():
        if key.endswith(EXPERT_WEIGHTS):
            out[key + "_blocks"], out[key + "_scales"] = mxfp4_quantise(value)
        else:
            out[key] = value
    quantised.mkdir()
    save_file(out, quantised / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    (quantised / "config.json").write_text(json.dumps({**config, "quantization_config": hf_tables.MXFP4_CONFIG}))
    return plain, quantised


def inputs():
    ids = np.random.default_rng(1).integers(0, VOCAB, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, 10:] = 0
    return ids, mask


@nnx.jit
def _logits(model, ids, mask):
    return model(ids, attention_mask=mask)


def transformers_logits(folder, ids, mask):
    """transformers' own reading of the folder (float32, on the CPU: MXFP4 dequantised), with what it lacked
    and what it could not place."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                    output_loading_info=True)
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    return logits, sorted(info["missing_keys"]) + sorted(info["unexpected_keys"]), model


def assert_close(have, want, mask, what):
    err = np.abs(np.asarray(have) - want)[mask.astype(bool)].max()
    assert err <= TOL, f"{what}: {err:.3g}"


@pytest.mark.parametrize("which", ["plain", "mxfp4"])
def test_folder_reads_as_transformers_reads_it(folders, which):
    """``hf.from_pretrained`` (Flax) and ``hf.torch_from_pretrained`` against transformers on the same folder:
    logits at TOL over a padded batch past the window and the original context."""
    folder = folders[0] if which == "plain" else folders[1]
    ids, mask = inputs()
    want, problems, _ = transformers_logits(folder, ids, mask)
    assert problems == []
    assert_close(_logits(hf.from_pretrained(folder), jnp.asarray(ids), jnp.asarray(mask)), want, mask, f"{which}: Flax")
    with torch.no_grad():
        ours = hf.torch_from_pretrained(folder)(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    assert_close(ours.numpy(), want, mask, f"{which}: torch_reference")


def test_mxfp4_dequantised_bit_for_bit_and_lazily(folders):
    """The experts read from the quantised folder are ``Lazy`` (read when written) and, read, equal
    transformers' ``convert_moe_packed_tensors`` bit for bit (bf16), and the float32 parameters transformers
    loads; the folder's other tensors pass as they are."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, quantised = folders
    raw, kind, config, weights = hf.read_folder(quantised)
    ours = hf_tables.hf_to_ours(kind, weights, config)
    _, _, theirs = transformers_logits(quantised, *inputs())
    files = load_file(quantised / "model.safetensors")
    for layer in range(2):
        for proj in EXPERT_WEIGHTS:
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            assert isinstance(ours[key], Lazy) and key + "_blocks" not in ours
            got = read(ours[key])
            want = convert_moe_packed_tensors(torch.from_numpy(files[key + "_blocks"]),
                                              torch.from_numpy(files[key + "_scales"]))
            assert got.dtype.name == "bfloat16" and want.dtype == torch.bfloat16
            np.testing.assert_array_equal(got.view(np.int16), want.view(torch.int16).numpy(), err_msg=key)
            loaded = theirs.get_parameter(key).detach().numpy()
            np.testing.assert_array_equal(got.astype(np.float32), loaded, err_msg=key)


def test_exports_load_in_transformers_plain_by_default_or_mxfp4(folders, tmp_path):
    """The model read from the MXFP4 folder exports plain tensors (the model's float32, no
    ``quantization_config``) unless asked; with ``quantisation="mxfp4"`` the blocks and scales are the
    source folder's bit for bit. transformers loads both with nothing missing or unexpected, to the same
    logits."""
    _, quantised = folders
    model = hf.from_pretrained(quantised)
    ids, mask = inputs()
    ours = _logits(model, jnp.asarray(ids), jnp.asarray(mask))
    source = load_file(quantised / "model.safetensors")
    for quantisation in (None, "mxfp4"):
        out = hf.save_pretrained(model, tmp_path / str(quantisation), quantisation=quantisation)
        written, config = load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())
        want, problems, _ = transformers_logits(out, ids, mask)
        assert problems == [], quantisation
        assert_close(ours, want, mask, f"export {quantisation}")
        assert {k for k in written if "sinks" in k} == {f"model.layers.{i}.self_attn.sinks" for i in range(2)}
        if quantisation is None:
            assert "quantization_config" not in config and not any(k.endswith(("_blocks", "_scales")) for k in written)
            assert written["model.layers.0.mlp.experts.gate_up_proj"].dtype == np.float32
        else:
            assert config["quantization_config"]["quant_method"] == "mxfp4"
            assert set(written) == set(source)
            for key in (k for k in source if k.endswith(("_blocks", "_scales"))):
                np.testing.assert_array_equal(written[key], source[key], err_msg=key)


def _broken(folder, tmp_path, change):
    out = tmp_path / "broken"
    shutil.copytree(folder, out)
    weights = load_file(out / "model.safetensors")
    change(weights)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


BLOCKS, SCALES = "model.layers.1.mlp.experts.gate_up_proj_blocks", "model.layers.1.mlp.experts.gate_up_proj_scales"
MALFORMED = {
    "scales of another shape": (lambda w: w.update({SCALES: w[SCALES][..., :0]}), BLOCKS),
    "blocks as floats": (lambda w: w.update({BLOCKS: w[BLOCKS].astype(np.float32)}), BLOCKS),
    "scales as int8": (lambda w: w.update({SCALES: w[SCALES].view(np.int8)}), BLOCKS),
    "scales missing": (lambda w: w.pop(SCALES), SCALES),
    "blocks of half the groups": (lambda w: w.update({BLOCKS: w[BLOCKS][:, :, :, :8],
                                                      SCALES: w[SCALES]}), "model.layers.1.mlp.experts.gate_up_proj"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_quantised_tensors_are_refused_naming_them(folders, tmp_path, case):
    """Blocks or scales of the wrong shape or dtype, or one without the other: refused before a model is
    built, naming the tensor."""
    change, named = MALFORMED[case]
    folder = _broken(folders[1], tmp_path, change)
    with pytest.raises(StateDictError, match=re.escape(named)):
        hf.from_pretrained(folder)


def test_unknown_quantisation_is_refused(folders, tmp_path):
    """A ``quant_method`` not dequantised here is named in one line (and an MXFP4 export of another model)."""
    folder = tmp_path / "other"
    shutil.copytree(folders[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' on a 'gpt_oss' model is not read"):
        hf.from_pretrained(folder)
    with pytest.raises(ValueError, match="quantisation 'mxfp4' is not written for a 'llama' model"):
        hf_tables.check_write_quantisation("llama", "mxfp4")
    assert isinstance(open_weights(folders[1])[BLOCKS], Lazy)
