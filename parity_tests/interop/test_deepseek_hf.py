"""DeepSeek-V3 folders both ways: the plain folder transformers 5 writes (experts per expert, the MLA projections,
the router's weight and ``e_score_correction_bias``, ``shared_experts``, dense first layers), the FP8 folder of the
released checkpoints (float8_e4m3fn ``weight`` + float32 ``weight_scale_inv`` per tile, ``quantization_config:
{"quant_method": "fp8", ...}``) and the multi-token-prediction (MTP) layers those hold after ``num_hidden_layers``.

The FP8 folders are written here by ``hf.save_pretrained(..., quantisation="fp8")`` from a random transformers
model; transformers 5 loads them on the CPU by dequantising (``Fp8Dequantize``: a float32 product, cast to the
parameter's dtype, float32 here), and our dequantised weights equal its parameters bit for bit. A weight whose
shape the tile does not divide (the released kv_a_proj_with_mqa: 576 rows, 4.5 tiles) is read with partial
edge tiles, as DeepSeek's reference ``weight_dequant`` (and transformers' own ``_dequantize_fp8_weight``) do;
transformers' load refuses such a folder. Tolerance: TOL (1e-5) times the logits' scale (at least 1) on the
real tokens of a right-padded batch of T = 13 > YaRN's original context of 8; fp32, matmul precision "highest".
"""

import json
import re
import shutil
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from flax_transformer.interop import hf, hf_tables
from flax_transformer.interop.converter import convert
from flax_transformer.interop.safetensors_io import Lazy, open_weights, read, write_safetensors
from flax_transformer.models.state_dict_errors import StateDictError
from parity_tests.conftest import TOL
from parity_tests.interop.test_llama_hf import logits
from parity_tests.models.deepseek_models import eager_deepseek

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")

B, T, VOCAB, LAYERS = 2, 13, 61, 2
CONFIGS = {  # each odd in its own way; all group-limited (n_group 4 of 8 experts), a dense first layer, YaRN
    "q_lora-interleaved": dict(q_lora_rank=16, rope_interleave=True),
    "no_q_lora-half_split": dict(q_lora_rank=None, rope_interleave=False),
    "q_lora-half_split-mscale": dict(q_lora_rank=24, rope_interleave=False, mscale=0.7),
}


def hf_model(q_lora_rank, rope_interleave, mscale=1.0, layers=LAYERS):
    """A random transformers DeepSeek-V3: 8 experts in 4 groups (top 2 groups, 3 experts a token), one dense
    first layer, q and kv through low ranks, YaRN x4 from 8 positions with mscale_all_dim, random correction
    biases (zero at init, which would hide their role in routing)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=3, first_k_dense_replace=1, q_lora_rank=q_lora_rank, kv_lora_rank=12,
        qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5, rope_interleave=rope_interleave,
        tie_word_embeddings=False, max_position_embeddings=64,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=mscale,
                             mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0, rope_theta=10000.0))
    return eager_deepseek(config)


def padded_inputs():
    ids = np.random.default_rng(1).integers(0, VOCAB, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, 9:] = 0
    return ids, mask


def _err(got, want) -> float:
    keep = padded_inputs()[1].astype(bool)
    assert got.shape == want.shape and np.isfinite(got[keep]).all()
    return float(np.abs(got - want)[keep].max() / max(1.0, np.abs(want[keep]).max()))


def transformers_load(folder):
    """transformers' own model of a folder (float32, eager attention; an FP8 folder dequantised on the CPU) and
    its loading report (only the lists that are not empty)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    return model.eval(), {k: list(v) for k, v in info.items() if v}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """(transformers' model, the folder it saved, its logits) of the first config."""
    reference = hf_model(**CONFIGS["q_lora-interleaved"])
    folder = tmp_path_factory.mktemp("deepseek") / "plain"
    reference.save_pretrained(folder)
    return reference, folder, logits(reference, *padded_inputs())


@pytest.fixture(scope="module")
def fp8(plain, tmp_path_factory):
    """An FP8 folder of the plain folder's model (``save_pretrained(..., quantisation="fp8")``)."""
    folder = tmp_path_factory.mktemp("deepseek") / "fp8"
    hf.save_pretrained(hf.torch_from_pretrained(plain[1]), folder, quantisation="fp8")
    return folder


def _round_trip(reference, folder, want, tmp_path, flax: bool):
    ids, mask = padded_inputs()
    assert _err(logits(hf.torch_from_pretrained(folder), ids, mask), want) <= TOL
    model = hf.from_pretrained(folder) if flax else hf.torch_from_pretrained(folder)
    if flax:
        assert _err(logits(model, ids, mask), want) <= TOL
    hf.save_pretrained(model, tmp_path / "out", max_shard_size=20_000)  # sharded: an index and its shards
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert set(open_weights(tmp_path / "out")) == set(open_weights(folder))
    again, report = transformers_load(tmp_path / "out")
    assert report == {} and type(again) is type(reference)
    assert _err(logits(again, ids, mask), want) <= TOL


def test_folder_reads_and_writes_back(plain, tmp_path):
    """transformers' folder (q_lora_rank set, interleaved RoPE, YaRN past the original context) -> torch_reference
    with transformers' logits on a padded batch; back -> a sharded folder with exactly transformers' keys (per
    expert, the correction biases), which transformers loads with nothing missing, unexpected or mismatched, to
    the same logits."""
    _round_trip(*plain, tmp_path, flax=False)


@pytest.mark.slow(reason="test_folder_reads_and_writes_back (the same rows, through torch_reference)")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_odd_configs_read_and_write_back(name, tmp_path):
    """Every config (no q_lora_rank: ``q_proj``; half-split RoPE; YaRN's mscale) both ways, through the Flax
    model (``hf.from_pretrained``, exported from Flax) for the first two."""
    reference = hf_model(**CONFIGS[name])
    reference.save_pretrained(tmp_path / "hf")
    _round_trip(reference, tmp_path / "hf", logits(reference, *padded_inputs()), tmp_path,
                flax=name != "q_lora-half_split-mscale")


def _quantised_names(folder) -> list[str]:
    return sorted(k[:-len("_scale_inv")] for k in open_weights(folder) if k.endswith("weight_scale_inv"))


def test_fp8_folder_reads_as_transformers_dequantises_it(plain, fp8):
    """Every linear layer but the router and lm_head is float8 with a float32 scale per tile; read lazily, each
    dequantised weight equals transformers' parameter bit for bit, and the logits agree at TOL."""
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"] == hf_tables.FP8_CONFIG
    files = open_weights(fp8)
    names = _quantised_names(fp8)
    assert len(names) == 5 + 3 + 3 * 8 + 3 + 5  # attention x2, dense mlp, experts, shared experts
    assert all(files[n].dtype == ml_dtypes.float8_e4m3fn for n in names)
    assert not any("mlp.gate." in n or n.startswith(("lm_head", "model.embed")) for n in names)
    raw, kind, config, weights = hf.read_folder(fp8)
    assert all(isinstance(weights[n], Lazy) and weights[n].dtype == np.float32 for n in names)
    ours = hf_tables.hf_to_ours(kind, weights, config)
    theirs, report = transformers_load(fp8)
    assert report == {}
    state = theirs.state_dict()
    assert set(ours) == set(state)
    for key, value in ours.items():
        np.testing.assert_array_equal(read(value).astype(np.float32), state[key].numpy(), err_msg=key)
    ids, mask = padded_inputs()
    want = logits(theirs, ids, mask)
    assert _err(logits(hf.torch_from_pretrained(fp8), ids, mask), want) <= TOL
    assert _err(want, plain[2]) <= 0.05  # the float8 rounding itself, against the unquantised model


def test_fp8_export_rewrites_the_folder_bit_for_bit(fp8, tmp_path):
    """The model read from an FP8 folder exports plain float32 by default, and with ``quantisation="fp8"``
    the same float8 weights and scales bit for bit; with ``dtype=bf16`` too, in shards, the scales float32,
    which transformers loads with nothing missing."""
    model = hf.torch_from_pretrained(fp8)
    source = open_weights(fp8)
    written = open_weights(hf.save_pretrained(model, tmp_path / "fp8", quantisation="fp8"))
    assert set(written) == set(source)
    for key, value in source.items():
        np.testing.assert_array_equal(read(written[key]).view(np.uint8), read(value).view(np.uint8), err_msg=key)
    plain = hf.save_pretrained(model, tmp_path / "plain")
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    assert not any(k.endswith("_scale_inv") for k in open_weights(plain))
    bf16 = hf.save_pretrained(model, tmp_path / "bf16", quantisation="fp8", dtype=ml_dtypes.bfloat16,
                              max_shard_size=20_000)
    written = open_weights(bf16)
    assert {k for k, v in written.items() if v.dtype == np.float32} == {k for k in source if k.endswith("_scale_inv")}
    for key in (k for k, v in source.items() if v.dtype == ml_dtypes.float8_e4m3fn):
        np.testing.assert_array_equal(read(written[key]).view(np.uint8), read(source[key]).view(np.uint8), err_msg=key)
    assert transformers_load(bf16)[1] == {}
    sharded, whole = hf.read_folder(bf16)[3], hf.read_folder(fp8)[3]  # the shards' float8 read as the file's
    for key in _quantised_names(fp8):
        np.testing.assert_array_equal(read(sharded[key]), read(whole[key]), err_msg=key)
    with pytest.raises(ValueError, match="'fp8' for deepseek_v3"):
        hf.save_pretrained(hf.torch_from_pretrained(fp8), tmp_path / "x", quantisation="mxfp4")


def test_fp8_partial_edge_tiles_as_deepseek_reads_them(plain, tmp_path):
    """16 x 12 tiles: q_b_proj's 40 rows and 16 columns leave partial last tiles (as other weights). They read
    as DeepSeek's ``weight_dequant`` (ceil tiles) and transformers' ``_dequantize_fp8_weight`` compute them,
    bit for bit; transformers' from_pretrained refuses the folder (its load-time dequantiser needs whole tiles)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    folder = tmp_path / "fp8_16"
    shutil.copytree(plain[1], folder)
    plain_weights = {k: read(v) for k, v in open_weights(plain[1]).items()}
    quantised = {k: read(v) for k, v in convert(hf_tables.fp8_rows((16, 12)), plain_weights, forward=False,
                                                 keep_unknown=True).items()}
    write_safetensors(quantised, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {**hf_tables.FP8_CONFIG, "weight_block_size": [16, 12]}
    (folder / "config.json").write_text(json.dumps(config))
    key = "model.layers.1.self_attn.q_b_proj.weight"
    assert quantised[key].shape == (40, 16) and quantised[key + "_scale_inv"].shape == (3, 2)
    weights = hf.read_folder(folder)[3]
    for name in _quantised_names(folder):
        want = _dequantize_fp8_weight(torch.from_numpy(quantised[name].view(np.uint8)).view(torch.float8_e4m3fn),
                                      torch.from_numpy(quantised[name + "_scale_inv"]), [16, 12], torch.float32)
        np.testing.assert_array_equal(read(weights[name]), want.numpy(), err_msg=name)
    ids, mask = padded_inputs()
    assert _err(logits(hf.torch_from_pretrained(folder), ids, mask), plain[2]) <= 0.05  # float8's rounding
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):  # "not divisible by scale grid"
        transformers_load(folder)


def _broken(folder, tmp_path, change, config=None):
    out = tmp_path / "broken"
    shutil.copytree(folder, out)
    weights = {k: read(v) for k, v in open_weights(out).items()}
    change(weights)
    write_safetensors(weights, out / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(config(raw)))
    return out


W = "model.layers.1.self_attn.kv_b_proj.weight"
S = W + "_scale_inv"


def _scale(value):
    return lambda w: w.update({S: np.full_like(w[S], value)})


MALFORMED = {
    "scale of another tile count": (lambda w: w.update({S: np.ones((2, 1), np.float32)}), W),
    "scale as bfloat16": (lambda w: w.update({S: w[S].astype(ml_dtypes.bfloat16)}), W),
    "weight as float32": (lambda w: w.update({W: w[W].astype(np.float32)}), W),
    "weight as float8_e5m2": (lambda w: w.update({W: w[W].astype(ml_dtypes.float8_e5m2)}), W),
    "nan scale": (_scale(np.nan), W),
    "zero scale": (_scale(0.0), W),
    "negative scale": (_scale(-1.0), W),
    "scale without its weight": (lambda w: w.pop(W), W),
    "weight without its scale": (lambda w: w.pop(S), S),
    "a scale on the router": (lambda w: w.update({"model.layers.1.mlp.gate.weight_scale_inv": w[S]}),
                              "model.layers.1.mlp.gate.weight_scale_inv"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_fp8_tensors_are_refused_naming_them(fp8, tmp_path, case):
    """A scale of the wrong tile count or dtype, a weight that is not float8_e4m3fn, a scale that is not finite
    and positive, one without the other, a scale where no FP8 weight is: refused naming the tensor."""
    change, named = MALFORMED[case]
    with pytest.raises(StateDictError, match=re.escape(named)):
        hf.torch_from_pretrained(_broken(fp8, tmp_path, change))


@pytest.mark.parametrize("block", [[128], [0, 128], "128", [128.0, 128]])
def test_malformed_fp8_config_is_refused(fp8, tmp_path, block):
    folder = _broken(fp8, tmp_path, lambda w: None,
                     lambda raw: {**raw, "quantization_config": {**raw["quantization_config"], "weight_block_size": block}})
    with pytest.raises(ValueError, match="weight_block_size must be two positive integers"):
        hf.read_folder(folder)


def _with_mtp(fp8, tmp_path, layers, extra_layer=None):
    """The FP8 folder with ``layers`` MTP layers after the model's (as the released folders: enorm, hnorm,
    eh_proj, shared_head, embed_tokens and a decoder layer, quantised), and ``num_nextn_predict_layers``."""
    def add(weights):
        layer = {k[len("model.layers.1."):]: v for k, v in weights.items() if k.startswith("model.layers.1.")}
        for index in range(LAYERS, LAYERS + layers):
            weights.update({f"model.layers.{index}.{k}": v for k, v in layer.items()})
            weights.update({f"model.layers.{index}.{k}": weights[k2] for k, k2 in (
                ("enorm.weight", "model.norm.weight"), ("hnorm.weight", "model.norm.weight"),
                ("shared_head.norm.weight", "model.norm.weight"), ("shared_head.head.weight", "lm_head.weight"),
                ("embed_tokens.weight", "model.embed_tokens.weight"))})
            weights[f"model.layers.{index}.eh_proj.weight"] = np.ones((32, 64), np.float32)
        if extra_layer is not None:
            weights[f"model.layers.{extra_layer}.input_layernorm.weight"] = weights["model.norm.weight"]
    return _broken(fp8, tmp_path, add, lambda raw: {**raw, "num_nextn_predict_layers": layers})


def test_mtp_layers_are_skipped_with_a_statement(fp8, tmp_path):
    """The MTP layers are left out with one warning that counts them, names their layers and says what they are;
    the model is the folder's without them. A tensor of a layer beyond those is still refused, named."""
    per_layer = sum(1 for k in open_weights(fp8) if k.startswith("model.layers.1.")) + 6
    folder = _with_mtp(fp8, tmp_path, 2)
    with pytest.warns(UserWarning) as caught:
        model = hf.torch_from_pretrained(folder)
    statements = [str(w.message) for w in caught if "multi-token-prediction" in str(w.message)]
    assert len(statements) == 1 and f"{2 * per_layer} tensors of layers 2, 3" in statements[0], statements
    ids, mask = padded_inputs()
    np.testing.assert_array_equal(logits(model, ids, mask), logits(hf.torch_from_pretrained(fp8), ids, mask))
    shutil.rmtree(folder)
    with pytest.raises(StateDictError, match=re.escape("model.layers.4.input_layernorm.weight")), \
            pytest.warns(UserWarning, match="multi-token-prediction"):
        hf.torch_from_pretrained(_with_mtp(fp8, tmp_path, 2, extra_layer=4))
