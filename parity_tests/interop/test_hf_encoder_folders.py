"""DistilBERT and RoBERTa folders both ways, sharded safetensors, streamed loading, bf16 export (issue 16).

Random small configs built with transformers (no downloads), odd sizes and one head,
right padding and a fully padded row. Tolerance: 1e-5 in fp32 with matmul precision
"highest" (TOL). A fully padded row has no token to compare: transformers attends
uniformly over its padding, this library gives zeros there (docs/conventions.md); the
test checks that it is finite and leaves the other rows alone.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import hf
from flax_transformer.interop.safetensors_io import Lazy, open_weights
from flax_transformer.training.probe import Probe
from flax_transformer.verification import certificate, export
from parity_tests.conftest import TOL

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")

VOCAB, PAD = 53, {"distilbert": 0, "roberta": 1}
BF16_TOL = hf.BF16_TOLERANCE  # docs/porting.md: bf16 weights against the fp32 model they were rounded from


def _config(kind: str, **kw):
    if kind == "distilbert":  # odd width, one head, relu
        return transformers.DistilBertConfig(vocab_size=VOCAB, dim=21, n_layers=2, n_heads=1, hidden_dim=37,
                                             max_position_embeddings=20, activation="relu", **kw)
    return transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=27, num_hidden_layers=2, num_attention_heads=3,
                                      intermediate_size=37, max_position_embeddings=20, type_vocab_size=1,
                                      layer_norm_eps=1e-5, pad_token_id=1, **kw)


def _folder(tmp_path, kind: str, cls: str = "AutoModel", sharded: bool = False, **kw):
    torch.manual_seed(3)
    reference = getattr(transformers, cls).from_config(_config(kind, **kw)).eval()
    folder = tmp_path / f"{kind}-{cls}"
    reference.save_pretrained(folder, max_shard_size="20KB" if sharded else "5GB")
    assert (folder / "model.safetensors.index.json").exists() == sharded
    return reference, folder


def _batch(kind: str):
    """Three rows: full, right-padded, fully padded (ids avoid the pad id except as padding)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, size=(3, 9))
    mask = np.ones((3, 9), np.int64)
    mask[1, 5:] = 0
    mask[2, :] = 0
    ids[mask == 0] = PAD[kind]
    return ids, mask


def _theirs(reference, ids, mask):
    with torch.no_grad():
        return reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))


def _close_on_tokens(got, want, mask):
    """Equal within TOL on real tokens; finite everywhere."""
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all()
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=TOL, rtol=0)


@pytest.mark.parametrize("kind,sharded", [("distilbert", True), ("roberta", False)])
@pytest.mark.slow_cases({
    "roberta-False": "test_sequence_classifier_heads[roberta]",
})
def test_encoder_folder_both_ways(tmp_path, kind, sharded):
    reference, folder = _folder(tmp_path, kind, sharded=sharded)
    ids, mask = _batch(kind)
    want = _theirs(reference, ids, mask)
    model = hf.from_pretrained(folder)
    hidden = model(ids, mask)
    _close_on_tokens(hidden, want.last_hidden_state, mask)
    twin = hf.torch_from_pretrained(folder)
    with torch.no_grad():
        _close_on_tokens(twin(torch.from_numpy(ids), torch.from_numpy(mask)).numpy(), want.last_hidden_state, mask)
    if kind == "roberta":  # RobertaModel has a pooler; its positions start at pad_token_id + 1
        np.testing.assert_allclose(np.asarray(model.pool(hidden))[:2], want.pooler_output[:2].numpy(),
                                   atol=TOL, rtol=0)
        assert model.input_spec().max_length == 20 - 2
    # Flax -> folder -> transformers: no missing or unexpected keys, the same outputs
    hf.save_pretrained(model, tmp_path / "ours")  # the certificate has its own tests
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == kind
    again, info = transformers.AutoModel.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert type(again) is type(reference)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    _close_on_tokens(_theirs(again.eval(), ids, mask).last_hidden_state, want.last_hidden_state, mask)


@pytest.mark.parametrize("kind", ["distilbert", "roberta"])
@pytest.mark.slow_cases({
    "distilbert": "test_encoder_folder_both_ways[distilbert-True]",
})
def test_sequence_classifier_heads(tmp_path, kind):
    reference, folder = _folder(tmp_path, kind, "AutoModelForSequenceClassification", num_labels=3)
    ids, mask = _batch(kind)
    want = _theirs(reference, ids, mask).logits.numpy()
    model = hf.classifier_from_pretrained(folder)
    assert model.classifier_head == {"distilbert": "relu", "roberta": "tanh"}[kind]
    got = np.asarray(model(ids, mask))
    assert got.shape == (3, 3) and np.isfinite(got).all()
    np.testing.assert_allclose(got[:2], want[:2], atol=TOL, rtol=0)
    with torch.no_grad():
        twin = hf.torch_classifier_from_pretrained(folder)(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(twin[:2], want[:2], atol=TOL, rtol=0)
    hf.save_pretrained(model, tmp_path / "ours", labels=["a", "b", "c"])
    again, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours",
                                                                                  output_loading_info=True)
    assert type(again) is type(reference) and again.config.id2label[2] == "c"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    np.testing.assert_allclose(_theirs(again.eval(), ids, mask).logits.numpy()[:2], want[:2], atol=TOL, rtol=0)
    # a base-model folder gets a new head: pre_classifier and classifier, N(0, initializer_range)
    _, base = _folder(tmp_path, kind)
    fresh = hf.classifier_from_pretrained(base, num_labels=2)
    assert fresh.pre_classifier.kernel.shape == (reference.config.hidden_size,) * 2
    assert 0.005 < float(jnp.std(fresh.classifier.kernel[...])) < 0.05
    # --freeze-encoder trains a Probe: the same head (pre_classifier included), put back by attach
    probe = Probe(model, seed=0)
    probe.eval()
    features = jax.random.normal(jax.random.key(0), (4, model.classifier.kernel.shape[0]))
    np.testing.assert_array_equal(np.asarray(probe(features)), np.asarray(model.classify(features)))
    nnx.update(probe.pre_classifier, jax.tree.map(jnp.zeros_like, nnx.state(probe.pre_classifier, nnx.Param)))
    assert np.asarray(model.pre_classifier.kernel[...]).any()
    probe.attach(model)
    assert not np.asarray(model.pre_classifier.kernel[...]).any()


@pytest.mark.slow(reason="test_hf_encoder_folders::test_encoder_folder_both_ways[distilbert-True], test_sharded")
def test_sharded_save_streams_and_transformers_loads(tmp_path):
    reference, folder = _folder(tmp_path, "roberta")
    model = hf.from_pretrained(folder)
    with pytest.raises(ValueError, match="max_shard_size"):
        export.save_pretrained(model, tmp_path / "bad", max_shard_size="lots")
    assert not (tmp_path / "bad").exists()
    out = hf.save_pretrained(model, tmp_path / "sharded", max_shard_size="8KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    weights = open_weights(out)
    assert all(isinstance(v, Lazy) for v in weights.values())  # headers only: nothing read yet
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in weights.values())
    single = hf.read_weights(hf.save_pretrained(model, tmp_path / "single"))
    assert single.keys() == weights.keys() and all(np.array_equal(single[k], weights[k].read()) for k in single)
    again, info = transformers.AutoModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = _batch("roberta")
    _close_on_tokens(_theirs(again.eval(), ids, mask).last_hidden_state,
                     _theirs(reference, ids, mask).last_hidden_state, mask)
    # placed straight onto a sharding as each tensor is read
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    on_mesh = hf.from_pretrained(out, sharding=placed)
    assert on_mesh.embeddings.token_embeddings.embedding[...].sharding == placed
    np.testing.assert_array_equal(np.asarray(on_mesh(ids, mask)), np.asarray(model(ids, mask)))
    # a Mesh: each tensor split over "fsdp" as training places it (two CPU devices, in a fresh process)
    script = ("import jax, numpy as np, sys; from flax_transformer.interop import hf; "
              "mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, 2), ('data', 'fsdp')); "
              "table = hf.from_pretrained(sys.argv[1], sharding=mesh).embeddings.position_embeddings.embedding[...]; "
              "print(table.sharding.spec, [s.data.shape for s in table.addressable_shards])")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script, str(out)], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "P('fsdp', None) [(10, 27), (10, 27)]", done.stderr[-2000:]


@pytest.mark.slow(reason="test_llama_hf's bf16 shards, test_porting's bf16 cases")
def test_bf16_export_and_import(tmp_path):
    reference, folder = _folder(tmp_path, "distilbert", "AutoModelForSequenceClassification", num_labels=2)
    model = hf.classifier_from_pretrained(folder)
    out = hf.save_pretrained(model, tmp_path / "bf16", dtype=jnp.bfloat16, max_shard_size="30KB")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {str(v.dtype) for v in open_weights(out).values()} == {"bfloat16"}
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert {p.dtype for p in theirs.parameters()} == {torch.bfloat16}
    widened = hf.classifier_from_pretrained(out)  # bf16 file -> fp32 parameters, exactly
    assert widened.classifier.kernel.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(widened.classifier.kernel[...]),
                                  np.asarray(model.classifier.kernel[...].astype(jnp.bfloat16).astype(jnp.float32)))
    half = hf.classifier_from_pretrained(out, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    assert half.classifier.kernel.dtype == jnp.bfloat16
    ids, mask = _batch("distilbert")
    fp32 = np.asarray(model(ids, mask))
    assert np.abs(np.asarray(widened(ids, mask)) - fp32).max() <= BF16_TOL
    assert np.abs(np.asarray(half(ids, mask)) - fp32).max() <= BF16_TOL
    with torch.no_grad():  # transformers on the bf16 folder, computing in fp32, equals ours on the same weights
        theirs32 = theirs.float()(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(widened(ids, mask))[:2], theirs32[:2], atol=TOL, rtol=0)


@pytest.mark.slow(reason="test_hf::test_verify_checkpoint_command_compares_with_transformers")
def test_verify_checkpoint_and_port_on_each(tmp_path, capsys):
    """``verify --checkpoint`` on a sharded DistilBERT and a RoBERTa classifier folder; ``port`` to a sharded bf16 folder."""
    from flax_transformer.cli.commands import main

    def verified(folder):
        assert main(["verify", "--checkpoint", str(folder)]) == 0
        rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("encoder")]
        assert len(rows) == 4 and all(line.rstrip().endswith("pass") for line in rows)
        assert sum("transformers vs flax" in line for line in rows) == 2

    _, distilbert = _folder(tmp_path, "distilbert", sharded=True)
    verified(distilbert)
    _, roberta = _folder(tmp_path, "roberta", "AutoModelForSequenceClassification")
    assert main(["port", str(roberta), str(tmp_path / "port"), "--dtype", "bf16", "--max-shard-size", "10KB",
                 "--verify"]) == 0  # certified on the bf16 values it wrote
    out = capsys.readouterr().out
    assert "(bf16 weights)" in out and "pass" in out
    assert (tmp_path / "port" / "model.safetensors.index.json").is_file()
    assert {str(v.dtype) for v in open_weights(tmp_path / "port").values()} == {"bfloat16"}
    # the same bf16 weights in both frameworks and in transformers agree at 1e-5; the certificate re-checks
    verified(tmp_path / "port")


def _tiny_roberta_with_tokenizer(root):
    """A random RoBERTa folder with a small byte-level BPE tokenizer (``<s>`` ... ``</s>``, ``<pad>`` = 1)."""
    from tokenizers import ByteLevelBPETokenizer, processors

    from parity_tests.training.test_runs import NEGATIVE, NEUTRAL, POSITIVE

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(NEUTRAL + POSITIVE + NEGATIVE)] * 4, vocab_size=300,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=40,
                                        type_vocab_size=1)
    transformers.RobertaModel(config).save_pretrained(root / "roberta")
    bpe.save(str(root / "roberta" / "tokenizer.json"))
    (root / "roberta" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "RobertaTokenizer"}))
    return root / "roberta"


@pytest.mark.slow(reason="test_hf_encoder_folders::test_sequence_classifier_heads[roberta], test_finetune's cases")
def test_classify_fine_tunes_a_roberta_folder_and_exports_it(tmp_path, capsys, monkeypatch):
    """``train.classify --model hf --init ROBERTA --export-hf``: the export loads in transformers with no missing or
    unexpected keys, AutoTokenizer gives our ids and the logits match (``hf_init.check_classifier_export``, 1e-4)."""
    from parity_tests.training.test_runs import _main, write_fake_imdb

    folder, data = _tiny_roberta_with_tokenizer(tmp_path), write_fake_imdb(tmp_path / "data", n_train=40, n_test=16)
    monkeypatch.setattr(certificate, "sidecar", lambda *args, **kwargs: lambda tmp, final: {})  # tested above, and costly
    with jax.numpy_dtype_promotion("standard"):  # optax mixes a Python float with its int32 step count
        assert _main("classify", ["--model", "hf", "--init", folder, "--preset", "tiny", "--steps", 1, "--max-length",
                                  24, "--out", tmp_path / "run", "--data-dir", data, "--export-hf", tmp_path / "export",
                                  "--no-progress"]) == 0
    assert "no missing or unexpected keys, AutoTokenizer gives the same ids" in capsys.readouterr().err
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["RobertaForSequenceClassification"] and config["pad_token_id"] == 1


@pytest.mark.slow(reason="test_porting's rename tests, test_hf_masked_lm's folders")
def test_tf_era_layer_norm_names_load(tmp_path):
    """The hub's bert-base-uncased names LayerNorm parameters gamma/beta (transformers renames them on
    load); a folder with those names loads, with the same outputs."""
    from safetensors.numpy import load_file, save_file

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=20)
    reference = transformers.BertModel(config).eval()
    reference.save_pretrained(tmp_path / "bert")
    weights = load_file(tmp_path / "bert" / "model.safetensors")
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in weights.items()}
    assert sum("gamma" in k for k in renamed) == 3
    save_file(renamed, tmp_path / "bert" / "model.safetensors", metadata={"format": "pt"})
    ours = hf.from_pretrained(tmp_path / "bert")
    ids = np.array([[2, 5, 7, 9]])
    with torch.no_grad():
        want = reference(torch.from_numpy(ids)).last_hidden_state.numpy()
    out = ours(ids)
    got = np.asarray(out[0] if isinstance(out, tuple) else out)
    np.testing.assert_allclose(got, want, atol=1e-5)
