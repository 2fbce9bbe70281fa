"""The training runs end to end: entry points, bucketing, exact resume, Ctrl-C, NaN, bad input, export.

Runs use ``--preset tiny`` on a small synthetic IMDB (written in the packed format of
../shared/data/imdb) so they run anywhere; one test uses the real data when present.
"""

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_transformer.training import classify, lm, run_checkpoints, rundir, seq2seq
from flax_transformer.training.batching import Bucketed, Windows, default_buckets
from flax_transformer.training.errors import NonFiniteLoss, RunError
from flax_transformer.training.loop import fit
from flax_transformer.training.optim import OptimConfig
from flax_transformer.training.run_loading import load_model, load_run
from flax_transformer.training.rundir import create_run_dir
from flax_transformer.verification import certificate

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"

POSITIVE = "great wonderful loved excellent superb moving".split()
NEGATIVE = "awful boring hated terrible dull waste".split()
NEUTRAL = ("the a movie film plot actor scene story was is and of it this that with director music "
           "camera ending character time").split()


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's bias correction mixes a Python float with its int32 step count, which the suite's
    strict dtype promotion refuses; optax is not ours to change."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def write_fake_imdb(root: Path, n_train=1000, n_test=300, seed=0, label_of=None) -> Path:
    """A small IMDB in the packed layout (imdb/{split}-{neg,pos}-00-of-01.jsonl.gz); sentiment words decide the label."""
    rng = np.random.default_rng(seed)
    (root / "imdb").mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        for label, name in ((0, "neg"), (1, "pos")):
            with gzip.open(root / "imdb" / f"{split}-{name}-00-of-01.jsonl.gz", "wt") as f:
                for i in range(n // 2):
                    words = list(rng.choice(NEUTRAL, size=rng.integers(5, 120)))
                    for _ in range(rng.integers(1, 4)):
                        words.insert(rng.integers(0, len(words)), rng.choice(POSITIVE if label else NEGATIVE))
                    record = {"id": i, "label": label if label_of is None else label_of(label), "text": " ".join(words)}
                    f.write(json.dumps(record) + "\n")
    return root


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory):
    return write_fake_imdb(tmp_path_factory.mktemp("data"))


def records(run_dir, split):
    return [r for r in rundir.read_metrics(run_dir) if r["split"] == split]


def tree_of(run_dir, step=None):
    """The saved state of a run's checkpoint (default latest) as {path: numpy array}, whatever its sharding."""
    import orbax.checkpoint as ocp

    checkpoints = run_checkpoints.Checkpoints(run_dir)
    try:
        step = checkpoints.latest() if step is None else step
        path = checkpoints.directory / str(step) / "state"
        with ocp.PyTreeCheckpointer() as reader:
            metadata = reader.metadata(path).item_metadata.tree
            as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
            restored = reader.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    finally:
        checkpoints.close()
    leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------- batching


def test_buckets_bound_shapes_and_cover_every_example_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=333)
    seqs = [np.full(n, i, dtype=np.int32) for i, n in enumerate(lengths)]  # every token = its example's index
    buckets = default_buckets(200, 4)
    assert buckets == (25, 50, 100, 200)
    batches = Bucketed(seqs, np.arange(333) % 2, batch_size=16, buckets=buckets, pad_id=-1, seed=3)
    seen, shapes = [], set()
    for batch in batches.epoch(0):
        shapes.add(batch["ids"].shape)
        for row in range(16):
            n = batch["mask"][row].sum()
            if batch["weight"][row] == 0:  # filler row: nothing in it
                assert n == 0 and (batch["ids"][row] == -1).all()
                continue
            i = batch["ids"][row, 0]
            seen.append(i)
            assert n == lengths[i] and (batch["ids"][row, :n] == i).all() and (batch["ids"][row, n:] == -1).all()
            assert batch["labels"][row] == i % 2
            # the shortest bucket that holds it
            assert batch["ids"].shape[1] == min(b for b in buckets if b >= lengths[i])
    assert sorted(seen) == list(range(333))
    assert {s[1] for s in shapes} <= set(buckets) and all(s[0] == 16 for s in shapes)
    # seeded: the same seed and epoch give the same batches, another epoch another order
    again = Bucketed(seqs, None, batch_size=16, buckets=buckets, pad_id=-1, seed=3)
    assert all((a["ids"] == b["ids"]).all() for a, b in zip(batches.epoch(0), again.epoch(0)))
    assert any(a["ids"].shape != b["ids"].shape or (a["ids"] != b["ids"]).any()
               for a, b in zip(batches.epoch(0), batches.epoch(1)))
    with pytest.raises(ValueError, match="empty"):
        Bucketed([], batch_size=4, buckets=(8,))
    with pytest.raises(ValueError, match="largest bucket"):
        Bucketed([np.zeros(9)], batch_size=4, buckets=(8,))


@pytest.mark.slow(reason="test_filler_rows' tests: padding changes no loss, metric or gradient")
def test_bucket_padding_does_not_change_the_classifier_output():
    """Padding is masked in attention and in pooling: a review gives the same log-probs in every bucket."""
    from flax_transformer.models.former import CTransformer

    model = CTransformer(16, 2, 2, 64, 50, 2, max_pool=False, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(1).integers(0, 50, size=11).astype(np.int32)
    outs = []
    for length in (16, 32, 64):
        padded = np.zeros((1, length), np.int32)
        padded[0, :11] = ids
        outs.append(np.asarray(model(padded, np.arange(length)[None] < 11)))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-6)
    np.testing.assert_allclose(outs[0], outs[2], atol=1e-6)


def test_windows_are_shifted_pairs():
    w = Windows(np.arange(1000), batch_size=4, length=8, seed=0)
    b = w.batch(5)
    assert b["ids"].shape == (4, 8) and (b["labels"] == b["ids"] + 1).all()
    assert (w.batch(5)["ids"] == b["ids"]).all() and (w.batch(6)["ids"] != b["ids"]).any()
    fixed = list(w.fixed())
    assert fixed[0]["ids"][0, 0] == 0 and fixed[0]["ids"][1, 0] == 8
    with pytest.raises(ValueError, match="at least"):
        Windows(np.arange(5), batch_size=1, length=8)


# ------------------------------------------------------------------------- entry points end to end


def _main(module, argv):
    from importlib import import_module

    return import_module(f"train.{module}").main([str(a) for a in argv])


def _assert_run_files(run_dir):
    for name in ("run.json", "metrics.jsonl", "curves.png"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert run_checkpoints.Checkpoints(run_dir).steps()


@pytest.mark.slow(reason="test_lm_tiny_end_to_end and test_seq2seq_tiny_end_to_end (the same CLI and loop), test_filler_rows' classify steps, test_certificate's exports")
def test_classify_tiny_end_to_end_then_predict_and_export(fake_data, tmp_path, capsys):
    run, export = tmp_path / "run", tmp_path / "model.safetensors"
    assert _main("classify", ["--preset", "tiny", "--out", run, "--data-dir", fake_data, "--no-progress",
                              "--export-torch", export]) == 0
    out, err = capsys.readouterr()
    assert f"Exported {export}: the trained weights" in err  # as --export-hf says what it wrote
    assert "test accuracy" in out
    assert certificate.recheck(export).passed  # the export's certificate (model.safetensors.verification.json)
    _assert_run_files(run)
    assert (run / "tokenizer.json").is_file()
    train = records(run, "train")
    assert train[-1]["loss"] < train[0]["loss"] - 0.1, [r["loss"] for r in train]
    assert records(run, "test")[0]["accuracy"] > 0.7  # the synthetic task is easy
    assert {"lr", "tokens_per_s", "grad_norm", "accuracy"} <= set(train[0])

    # --predict reads the run's tokenizer and latest checkpoint
    assert _main("classify", ["--predict", "a wonderful superb loved film", "--predict", "awful dull boring waste",
                              "--checkpoint", run]) == 0
    header, *lines = capsys.readouterr().out.strip().splitlines()
    assert header == "label\tprobability\ttext"
    assert lines[0].startswith("positive\t") and lines[1].startswith("negative\t")
    assert 0.5 < float(lines[0].split("\t")[1]) <= 1.0

    # the export is a torch_reference state_dict giving the same predictions
    import torch
    from safetensors.torch import load_file

    from flax_transformer.interop import checkpoints

    model, tokenizer, config = classify.load_run(run)
    _, description = checkpoints.read_safetensors(export)
    torch_model = checkpoints.build(description, framework="torch")
    torch_model.load_state_dict(load_file(export))
    torch_model.eval()
    texts = ["the plot was dull and the acting awful", "loved it, superb music", "it"]
    enc = [tokenizer.encode(t).ids for t in texts]
    length = max(map(len, enc))
    ids = np.array([e + [1] * (length - len(e)) for e in enc], np.int32)
    mask = np.array([[1] * len(e) + [0] * (length - len(e)) for e in enc], bool)
    want = np.asarray(model(ids, mask))
    with torch.no_grad():
        got = torch_model(torch.from_numpy(ids).long(), torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.slow(reason="test_filler_rows_change_no_classify_loss_metric_or_gradient[encoder-mean], test_encoder")
def test_classify_encoder_model(fake_data, tmp_path):
    config = classify.ClassifyConfig.tiny(model="encoder", lr=3e-3, eval_every=None)
    metrics = classify.train_and_evaluate(config, tmp_path / "run", data_dir=fake_data, progress=False)
    train = records(tmp_path / "run", "train")
    assert train[-1]["loss"] < train[0]["loss"] and metrics["test_accuracy"] > 0.55  # [CLS] alone learns slower
    tokenizer, _ = classify.load_run(tmp_path / "run")[1:]
    assert tokenizer.encode("great film").ids[0] == tokenizer.token_to_id("<cls>")  # read by the classifier


@pytest.mark.skipif(not (SHARED / "imdb").is_dir(), reason="needs ../shared/data/imdb")
@pytest.mark.slow(reason="test_classify_tiny_end_to_end_then_predict_and_export, fake data")
def test_classify_tiny_on_the_real_imdb(tmp_path):
    metrics = classify.train_and_evaluate(classify.ClassifyConfig.tiny(), tmp_path / "run", progress=False)
    train = records(tmp_path / "run", "train")
    assert train[-1]["loss"] < train[0]["loss"] and metrics["test_accuracy"] > 0.5


def test_lm_tiny_end_to_end(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("ROMEO: but soft, what light through yonder window breaks?\n" * 300)
    run = tmp_path / "run"
    assert _main("lm", ["--preset", "tiny", "--out", run, "--text", text, "--no-progress", "--steps", 60]) == 0
    out = capsys.readouterr().out
    assert "validation loss" in out and "--- sample ---\nROMEO:" in out
    _assert_run_files(run)
    train = records(run, "train")
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert (run / "sample.txt").read_text().startswith("ROMEO:")

    # the finished run back: as a model, as a Run, and through `flax-transformer generate`
    from flax_transformer.cli.commands import main
    from flax_transformer.interop import checkpoints

    loaded = load_run(run)
    assert loaded.task == "lm" and type(load_model(run)).__name__ == type(loaded.model).__name__
    with pytest.raises(ValueError, match=r"training run directory.*training.run_loading.load_run"):
        checkpoints.load(run)  # the I/O layer does not rebuild runs: it names the function that does
    expected = lm.continue_text(loaded.config, loaded.model, loaded.tokenizer, "ROMEO: but", max_new_tokens=12,
                                greedy=True)
    assert main(["generate", "--checkpoint", str(run), "--prompt", "ROMEO: but", "--max-new-tokens", "12",
                 "--greedy"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip("\n") == expected.rstrip("\n") and len(expected) == len("ROMEO: but") + 12
    assert main(["generate", "--checkpoint", str(run), "--prompt", "ROMEO: \u00e9", "--greedy"]) == 2  # no such char
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 2  # not a run
    assert "error:" in capsys.readouterr().err


@pytest.mark.slow(reason="test_lm_tiny_end_to_end")
def test_lm_former_at_word_level(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat . the dog sat on the log .\n" * 200)
    config = lm.LMConfig.tiny(model="former", level="word", text=str(text), prompt="the cat", steps=40,
                              context=16, eval_every=None)
    metrics = lm.train_and_evaluate(config, tmp_path / "run", progress=False)
    assert metrics["val_loss"] < 1.0 and metrics["sample"].startswith("the cat")


@pytest.mark.slow(reason="test_lm_tiny_end_to_end (the same CLI and loop), test_seq2seq_examples_and_exact_match")
def test_seq2seq_tiny_end_to_end(tmp_path, capsys):
    run = tmp_path / "run"
    assert _main("seq2seq", ["--preset", "tiny", "--out", run, "--no-progress"]) == 0
    assert "exact match" in capsys.readouterr().out
    _assert_run_files(run)
    train = records(run, "train")
    assert train[-1]["loss"] < train[0]["loss"] - 0.3


def test_seq2seq_examples_and_exact_match():
    config = seq2seq.Seq2SeqConfig.tiny()
    b = seq2seq.make_batch(config, np.random.default_rng(0), 64)
    for src, keep, tin, tout in zip(b["src"], b["src_mask"], b["tgt_in"], b["tgt_out"]):
        digits = src[keep]
        n = len(digits)
        assert (tout[:n] == digits[::-1]).all() and tout[n] == seq2seq.EOS and (tout[n + 1:] == seq2seq.PAD).all()
        assert tin[0] == seq2seq.BOS and (tin[1:n + 1] == digits[::-1]).all() and (tin[n + 1:] == seq2seq.PAD).all()

    # a row counts only if every digit and the <eos> are right; what follows <eos> is not compared
    target = b["tgt_out"][:3]
    perfect = np.where(target == seq2seq.PAD, seq2seq.EOS, target)
    wrong_digit = perfect.copy()
    wrong_digit[1, 0] = seq2seq.DIGIT0 + (wrong_digit[1, 0] - seq2seq.DIGIT0 + 1) % 10
    no_eos = perfect.copy()
    n = int((target[2] != seq2seq.PAD).sum()) - 1  # position of row 2's <eos>
    no_eos[2, n] = seq2seq.DIGIT0
    assert seq2seq.exact_match_of(perfect, target) == 1.0
    assert seq2seq.exact_match_of(wrong_digit, target) == pytest.approx(2 / 3)
    assert seq2seq.exact_match_of(no_eos, target) == pytest.approx(2 / 3)
    assert 0.0 <= seq2seq.exact_match(config, seq2seq.build_model(config), b) < 0.2  # untrained: almost never right


# ------------------------------------------------------------------------- resume, Ctrl-C, NaN


def _interrupt_at(batches, step):
    """Wrap a batcher so that fetching batch ``step`` delivers a real SIGINT to this process."""

    class Interrupting:
        def __getattr__(self, name):
            return getattr(batches, name)

        def batch(self, s):
            if s == step:
                signal.raise_signal(signal.SIGINT)
            return batches.batch(s)

    return Interrupting()


@pytest.mark.slow(reason="test_a_resumed_run_equals_the_uninterrupted_one (the loop's checkpoints and resume), "
                  "test_fine_tune_resume_equals_an_uninterrupted_run (an interrupted run resumed)")
def test_interrupt_and_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    """With dropout on (so the saved RNG streams matter) and a warmup+cosine schedule."""
    config = seq2seq.Seq2SeqConfig.tiny(dropout=0.2, steps=40, eval_every=15, checkpoint_every=25)
    whole = seq2seq.train_and_evaluate(config, tmp_path / "whole", progress=False)

    real_examples = seq2seq.Examples
    monkeypatch.setattr(seq2seq, "Examples", lambda c: _interrupt_at(real_examples(c), 17))
    first = seq2seq.train_and_evaluate(config, tmp_path / "split", progress=False)
    assert first["interrupted"] and first["step"] == 18  # stopped after the step in flight, and saved
    assert run_checkpoints.Checkpoints(tmp_path / "split").latest() == 18
    monkeypatch.setattr(seq2seq, "Examples", real_examples)
    # a run.json written before the task configs nested run/optim (flat fields) still resumes, exactly
    saved = json.loads((tmp_path / "split" / "run.json").read_text())
    flat = {k: v for k, v in saved.items() if k not in ("run", "optim")}
    flat.update(saved["run"])
    flat.update({k: saved["optim"][k] for k in ("optimizer", "lr", "warmup_steps", "decay", "weight_decay", "clip_norm")})
    (tmp_path / "split" / "run.json").write_text(json.dumps(flat))
    second = seq2seq.train_and_evaluate(config, tmp_path / "split", resume=True, progress=False)
    assert second["step"] == 40 and not second["interrupted"]

    a, b = tree_of(tmp_path / "whole"), tree_of(tmp_path / "split")
    assert a.keys() == b.keys() and any("rngs" in k for k in a)  # dropout streams are saved
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert second["exact_match"] == whole["exact_match"]
    # the logs read like one run: the same steps, the same losses
    def strip(rs):
        return [(r["step"], r["split"], r["loss"]) for r in rs]
    assert strip(rundir.read_metrics(tmp_path / "whole")) == strip(rundir.read_metrics(tmp_path / "split"))


@pytest.mark.slow(reason="test_fine_tune_resume_equals_an_uninterrupted_run (an interrupted run), test_run_faults' killed runs (test_a_run_killed_before_its_first_checkpoint_can_be_resumed)")
def test_ctrl_c_in_a_subprocess_saves_and_exits_cleanly(tmp_path):
    """A real Ctrl-C (SIGINT) to `python -m train.seq2seq`: exit 130, a checkpoint, and --resume finishes it."""
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "train.seq2seq", "--preset", "tiny", "--out", str(run), "--steps", "100000",
            "--no-progress"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120  # wait until the loop is running (its first log line), then Ctrl-C
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and records(run, "train"):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Saved a checkpoint at step" in err
    step = run_checkpoints.Checkpoints(run).latest()
    assert step is not None and step >= 10
    assert json.loads((run / "run.json").read_text())["run"]["steps"] == 100000


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    from flax_transformer.models.former import CTransformer

    model = CTransformer(8, 2, 1, 8, 20, 2, rngs=nnx.Rngs(params=0, dropout=1))

    class Poisoned:
        def batch(self, step):
            rng = np.random.default_rng(step)
            return {"ids": rng.integers(0, 20, (4, 8)).astype(np.int32), "labels": rng.integers(0, 2, 4).astype(np.int32),
                    "poison": np.float32(np.nan if step >= 13 else 0.0)}

        def position(self, step):
            return {"step": step}

    def loss_fn(m, batch):
        logp = m(batch["ids"])
        loss = -jnp.take_along_axis(logp, batch["labels"][:, None], axis=1).mean() + batch["poison"]
        return loss, {"count": jnp.float32(4)}

    create_run_dir(tmp_path, {"x": 1})
    with pytest.raises(NonFiniteLoss, match=r"loss is nan at step 14.*checkpoints/10"):
        fit(model, OptimConfig(lr=1e-3), loss_fn, Poisoned(), run_dir=tmp_path, steps=30, run_config={"x": 1},
            checkpoint_every=5, progress=False, tensorboard=False)
    assert run_checkpoints.Checkpoints(tmp_path).steps() == [5, 10]
    assert all(np.isfinite(v).all() for k, v in tree_of(tmp_path).items() if v.dtype.kind == "f")


# ------------------------------------------------------------------------- bad input


def test_missing_data_directory_is_a_clear_error(tmp_path, capsys):
    assert _main("classify", ["--preset", "tiny", "--out", tmp_path / "run", "--data-dir", tmp_path / "nope",
                              "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--data-dir" in err and "does not exist" in err
    assert not (tmp_path / "run").exists()  # a run that fails on its input leaves no run directory


def test_empty_dataset_and_bad_labels_are_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "imdb").mkdir(parents=True)
    for name in ("train-neg", "train-pos", "test-neg", "test-pos"):
        with gzip.open(empty / "imdb" / f"{name}-00-of-01.jsonl.gz", "wt"):
            pass
    assert _main("classify", ["--preset", "tiny", "--out", tmp_path / "r1", "--data-dir", empty, "--no-progress"]) == 2
    assert "empty" in capsys.readouterr().err

    bad = write_fake_imdb(tmp_path / "bad", n_train=40, n_test=20, label_of=lambda label: label * 5)
    assert _main("classify", ["--preset", "tiny", "--out", tmp_path / "r2", "--data-dir", bad, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "labels [5] outside 0..1" in err
    assert not (tmp_path / "r2").exists()


@pytest.mark.slow(reason="test_a_resumed_run_equals_the_uninterrupted_one (resume restores the run's own configuration)")
def test_resume_with_another_configuration_changes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert _main("seq2seq", ["--preset", "tiny", "--out", run, "--no-progress", "--steps", 10]) == 0
    before = digest(run)
    capsys.readouterr()
    assert _main("seq2seq", ["--preset", "tiny", "--out", run, "--resume", "--no-progress", "--max-digits", 7]) == 2
    err = capsys.readouterr().err
    assert "different configuration" in err and "max_digits: 5 (checkpoint) vs 7 (now)" in err
    # without --resume, an existing run is not overwritten
    assert _main("seq2seq", ["--preset", "tiny", "--out", run, "--no-progress", "--steps", 10]) == 2
    assert "--resume" in capsys.readouterr().err
    assert digest(run) == before


@pytest.mark.slow(reason="test_run_faults::test_a_corrupted_checkpoint_is_named_and_resume_falls_back_to_the_one_before")
def test_unreadable_checkpoint_is_a_clear_error(tmp_path, capsys):
    """A checkpoint that cannot be read is named; when none can, --resume changes nothing. (With an intact
    earlier one, --resume falls back to it: test_run_faults.py.)"""
    run = tmp_path / "run"
    assert _main("seq2seq", ["--preset", "tiny", "--out", run, "--no-progress", "--steps", 80]) == 0
    for step in (80, 40):
        victims = [p for p in (run / "checkpoints" / str(step)).rglob("*")
                   if p.is_file() and "state" in p.parts and p.stat().st_size > 100]
        assert victims
        for p in victims:
            p.write_bytes(b"\0" * 7)
        if step == 80:
            with pytest.raises(RunError, match="checkpoints/80 is unreadable"):
                run_checkpoints.Checkpoints(run).restore_model(seq2seq.build_model(seq2seq.Seq2SeqConfig.tiny()))
    before = digest(run)
    capsys.readouterr()
    assert _main("seq2seq", ["--preset", "tiny", "--out", run, "--resume", "--no-progress", "--steps", 80]) == 2
    err = capsys.readouterr().err
    assert "checkpoints/80 is unreadable" in err and "checkpoints/40 is unreadable" in err
    assert "Nothing was changed" in err and "Traceback" not in err
    assert digest(run) == before


@pytest.mark.slow(reason="test_torch_state::test_bf16_run_exported_and_imported_continues_bit_for_bit (a bf16 run), test_attention_impl (the fused attention), test_mixed_precision")
def test_bf16_and_fused_attention_runs(tmp_path, capsys):
    """``--dtype bf16 --attention xla``: the run trains in mixed precision with JAX's fused attention."""
    run = tmp_path / "run"
    assert _main("seq2seq", ["--preset", "tiny", "--out", run, "--no-progress", "--dtype", "bf16",
                             "--attention", "xla"]) == 0
    saved = json.loads((run / "run.json").read_text())
    assert saved["run"]["dtype"] == "bf16" and saved["run"]["attention"] == "xla"
    train = records(run, "train")
    assert train[-1]["loss"] < train[0]["loss"] - 0.3
    params = tree_of(run)
    assert all(v.dtype != np.dtype("bfloat16") for v in params.values())  # parameters (and Adam moments) stay fp32


@pytest.mark.slow(reason="test_sharded")
def test_sharded_run_on_8_host_devices_equals_one_device(tmp_path):
    """``--mesh data=4,fsdp=2`` on 8 CPU devices (a subprocess: the device count is fixed at JAX start-up)
    gives the losses and parameters of the one-device run, up to float rounding."""
    config = seq2seq.Seq2SeqConfig.tiny(steps=30, eval_every=None, checkpoint_every=30)
    seq2seq.train_and_evaluate(config, tmp_path / "one", progress=False)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    result = subprocess.run([sys.executable, "-m", "train.seq2seq", "--preset", "tiny", "--steps", "30",
                             "--out", str(tmp_path / "eight"), "--mesh", "data=4,fsdp=2", "--no-progress"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Sharded over {'data': 4, 'fsdp': 2}" in result.stderr
    assert "model arrays split over fsdp" in result.stderr and " 0 of " not in result.stderr
    one, eight = records(tmp_path / "one", "train"), records(tmp_path / "eight", "train")
    assert [r["step"] for r in one] == [r["step"] for r in eight]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(one, eight)) <= 1e-5
    a, b = tree_of(tmp_path / "one"), tree_of(tmp_path / "eight")
    assert a.keys() == b.keys()
    for key in a:
        if a[key].dtype.kind != "f" or "key_tfm" in key:
            # key biases have an exactly-zero gradient: Adam turns rounding noise into steps of up to lr
            # (see training/parity.py); they are not comparable run to run
            continue
        scale = max(1.0, float(np.abs(a[key]).max()))
        assert float(np.abs(a[key] - b[key]).max()) <= 1e-5 * scale, key


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow(reason="test_sharded")
def test_two_processes_equal_one_process(tmp_path):
    """Two processes on localhost (``--coordinator``: jax.distributed, CPU collectives over gloo), each with
    one CPU device, ``--mesh data=2``: exactly the losses, parameters and exact match of one process with 2
    host devices, and process 0 alone writes the run's files. Any process failing, or no result in time (a
    busy port, no gloo), kills the others and fails the test with their output."""
    argv = [sys.executable, "-m", "train.seq2seq", "--preset", "tiny", "--steps", "20", "--mesh", "data=2",
            "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    port = _free_port()
    commands = {f"process {i}": (argv + ["--out", tmp_path / "two", "--coordinator", f"127.0.0.1:{port}",
                                         "--num-processes", "2", "--process-id", str(i)], env) for i in range(2)}
    commands["one process"] = (argv + ["--out", tmp_path / "one"],
                               env | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    procs, logs = {}, {}
    try:
        for name, (command, environment) in commands.items():  # all at once: the one-process run as well
            logs[name] = (tmp_path / f"{name}.out", tmp_path / f"{name}.err")
            with open(logs[name][0], "w") as out, open(logs[name][1], "w") as err:
                procs[name] = subprocess.Popen([str(a) for a in command], cwd=REPO, env=environment, stdout=out,
                                               stderr=err)
        deadline = time.time() + 240
        while time.time() < deadline and any(p.poll() is None for p in procs.values()):
            if any(p.returncode not in (None, 0) for p in procs.values()):
                break  # one failed: the other process would wait for it until jax.distributed's timeout
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    output = {name: (out.read_text(), err.read_text()) for name, (out, err) in logs.items()}
    report = "\n".join(f"--- {name}: exit {procs[name].returncode}\n{output[name][1][-1500:]}" for name in procs)
    assert all(p.returncode == 0 for p in procs.values()), f"(port {port})\n{report}"

    two, one = tmp_path / "two", tmp_path / "one"
    _assert_run_files(two)
    assert len(list((two / "tensorboard").glob("events.out.tfevents.*"))) == 1  # process 0's only
    for name in ("process 0", "process 1"):
        assert "Sharded over {'data': 2, 'fsdp': 1}" in output[name][1]
        def last_line(out):  # gloo prints to stdout too
            return out.strip().splitlines()[-1].split("run:")[0]
        assert last_line(output[name][0]) == last_line(output["one process"][0])  # the same exact match
    def strip(rs):
        return [(r["step"], r["split"], r["loss"]) for r in rs]
    assert strip(rundir.read_metrics(two)) == strip(rundir.read_metrics(one))
    assert [r["step"] for r in records(two, "train")] == [10, 20]
    # the all-reduce of two partial gradients is exact (a + b), so the runs agree bit for bit
    a, b = tree_of(one), tree_of(two)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_mesh_errors_are_clear(capsys, tmp_path):
    assert _main("seq2seq", ["--preset", "tiny", "--out", tmp_path / "r", "--mesh", "data=64", "--no-progress"]) == 2
    assert "needs 64 devices" in capsys.readouterr().err
    assert _main("seq2seq", ["--preset", "tiny", "--out", tmp_path / "r2", "--mesh", "model=2", "--no-progress"]) == 2
    assert "expected data=N,fsdp=M" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="missing --num-processes --process-id"):
        _main("seq2seq", ["--preset", "tiny", "--out", tmp_path / "r3", "--coordinator", "127.0.0.1:1234"])


def test_a_failed_download_is_one_clear_line(tmp_path, monkeypatch, capsys):
    """No data folder and no network: a one-line error naming --data-dir, and no run directory left."""
    from flax_transformer.training import data

    monkeypatch.setattr(data, "REPO_ROOT", tmp_path / "nowhere" / "repo")  # no ../shared/data beside it
    monkeypatch.setattr(data, "IMDB_URL", (tmp_path / "missing.tar.gz").as_uri())
    monkeypatch.setattr(data.Path, "home", lambda: tmp_path / "home")
    monkeypatch.setattr(data, "download_imdb", lambda cache, **kw: data.extract_tar(
        data.download((tmp_path / "missing.tar.gz").as_uri(), cache), cache))
    assert _main("classify", ["--preset", "tiny", "--out", tmp_path / "run", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not download") and "--data-dir" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    assert not list((tmp_path / "home").rglob("*.tar.gz*"))  # no partial download left in the cache
