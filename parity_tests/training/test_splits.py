"""Train, validation and test splits are disjoint and fixed by the seed (classify, lm, seq2seq).

Each test fails on a realistic planted bug the parity tests cannot see (issue 17, item 2).
"""

import numpy as np
import pytest

from flax_transformer.training.run_config import replace


def _write_packed_imdb(root, n_train, n_test):
    """A packed IMDB (imdb/{split}-{neg,pos}-00-of-01.jsonl.gz) whose every review is a distinct text."""
    import gzip
    import json

    (root / "imdb").mkdir(parents=True)
    for split, n in (("train", n_train), ("test", n_test)):
        for label, name in ((0, "neg"), (1, "pos")):
            with gzip.open(root / "imdb" / f"{split}-{name}-00-of-01.jsonl.gz", "wt") as f:
                for i in range(n // 2):
                    f.write(json.dumps({"id": i, "label": label, "text": f"{split} {name} review {i}"}) + "\n")
    return root


@pytest.fixture(scope="module")
def split_data(tmp_path_factory):
    root = _write_packed_imdb(tmp_path_factory.mktemp("splits"), 400, 200)
    folder = root / "rt-polarity"
    folder.mkdir()
    for name in ("neg", "pos"):
        (folder / f"rt-polarity.{name}").write_text("".join(f"{name} snippet {i}\n" for i in range(150)))
    return root


def _texts(rows):
    texts = [text for text, _ in rows]
    assert len(set(texts)) == len(texts), "an example appears twice in one split"
    return set(texts)


@pytest.mark.parametrize("dataset", ["imdb", "rt-polarity"])
def test_classify_splits_are_disjoint_and_fixed_by_the_seed(split_data, dataset):
    from flax_transformer.training import classify, data

    if dataset == "imdb":
        limits = dict(train_limit=300, test_limit=150, val_size=60)
        all_train, all_test = _texts(data.read_imdb(split_data, "train")), _texts(data.read_imdb(split_data, "test"))
    else:
        limits = dict(train_limit=None, test_limit=None, val_size=40)
        everything = _texts(data.read_rt_polarity(split_data))
    config = classify.ClassifyConfig.tiny(dataset=dataset, **limits)
    train, val, test = (_texts(rows) for rows in classify.load_splits(config, split_data))
    assert not train & val and not train & test and not val & test
    assert len(val) == config.val_size
    if dataset == "imdb":
        assert len(train) + len(val) == config.train_limit and len(test) == config.test_limit
        assert train | val <= all_train and test <= all_test
    else:  # 10% of the snippets are the test set; nothing is lost
        assert len(test) == 30 and train | val | test == everything
    again = [_texts(rows) for rows in classify.load_splits(config, split_data)]
    assert again == [train, val, test]
    other = [_texts(rows) for rows in classify.load_splits(replace(config, seed=1), split_data)]
    assert other[1] != val and other[0] != train
    if dataset == "rt-polarity":
        assert other[2] != test


def _capture_fit(monkeypatch, module):
    """Replace ``module.fit`` and ``module.batch_evaluator``: record what a run would train and
    evaluate on, and stop it there (an interrupted result, so nothing runs after)."""
    from flax_transformer.training.loop import FitResult

    seen = {}

    def evaluator(loss_fn, batches):
        seen["eval"] = batches
        return lambda model: {}

    def fit(model, optim, loss_fn, batches, **kw):
        seen["train"] = batches
        seen["steps"] = kw["steps"]
        return FitResult(model, 0, True, {})

    monkeypatch.setattr(module, "batch_evaluator", evaluator)
    monkeypatch.setattr(module, "fit", fit)
    monkeypatch.setattr(module, "build_model", lambda *args, **kwargs: None)  # not trained here
    return seen


def test_lm_validation_tail_overlaps_no_training_window(tmp_path, monkeypatch):
    from flax_transformer.training import lm

    text = "".join(f"line {i:05d} of the corpus\n" for i in range(400))  # every 25 characters are unique
    (tmp_path / "corpus.txt").write_text(text)

    def run(seed, name):
        config = lm.LMConfig.tiny(text=str(tmp_path / "corpus.txt"), context=32, batch_size=8, steps=60,
                                  eval_batches=100, prompt="line", seed=seed)
        seen = _capture_fit(monkeypatch, lm)
        lm.train_and_evaluate(config, tmp_path / name, progress=False)
        train = np.stack([np.concatenate([b["ids"], b["labels"][:, -1:]], axis=1)
                          for b in map(seen["train"].batch, range(seen["steps"]))]).reshape(-1, 33)
        val = np.concatenate([np.concatenate([b["ids"], b["labels"][:, -1:]], axis=1) for b in seen["eval"]()])
        return config, train, val

    config, train, val = run(0, "a")
    tokenizer = lm.build_tokenizer(config, text)
    stream = lm.encode(config, tokenizer, text)
    windows = np.lib.stride_tricks.sliding_window_view(stream, 33)
    where = lambda rows: np.array([np.flatnonzero((windows == row).all(axis=1)).item() for row in rows])  # noqa: E731
    train_at, val_at = where(train), where(val)
    cut = int(len(stream) * (1 - config.val_fraction))
    assert train_at.max() + 33 <= cut, "a training window reads the validation tail"
    assert val_at.min() >= cut, "a validation window reads the training part"
    assert val_at.max() + 33 > len(stream) - 33  # the validation windows tile the tail to its end
    np.testing.assert_array_equal(np.sort(val_at), cut + 32 * np.arange(len(val_at)))
    _, train_again, val_again = run(0, "b")
    np.testing.assert_array_equal(train_again, train)
    np.testing.assert_array_equal(val_again, val)
    _, train_other, val_other = run(1, "c")
    assert not np.array_equal(train_other, train)
    np.testing.assert_array_equal(val_other, val)  # the split itself does not depend on the seed


def test_seq2seq_held_out_strings_are_not_trained_on(tmp_path, monkeypatch):
    from flax_transformer.training import seq2seq

    def run(seed, name):
        # 8..12 digits: two independent draws share a string with probability ~1e-8
        config = seq2seq.Seq2SeqConfig.tiny(min_digits=8, max_digits=12, eval_size=200, batch_size=32, seed=seed)
        seen = _capture_fit(monkeypatch, seq2seq)
        seq2seq.train_and_evaluate(config, tmp_path / name, progress=False)
        as_strings = lambda b: ["".join(map(str, row[keep] - seq2seq.DIGIT0))  # noqa: E731
                                for row, keep in zip(b["src"], b["src_mask"], strict=True)]
        held_out = [s for b in seen["eval"]() for s in as_strings(b)]
        trained = {s for step in range(seen["steps"]) for s in as_strings(seen["train"].batch(step))}
        return config, held_out, trained

    config, held_out, trained = run(0, "a")
    assert len(held_out) == config.eval_size and len(set(held_out)) == config.eval_size
    assert not set(held_out) & trained, "held-out strings were trained on"
    assert run(0, "b")[1:] == (held_out, trained)
    _, held_other, trained_other = run(1, "c")
    assert held_other != held_out and trained_other != trained
