"""Guards for bugs the parity tests cannot see (issue 17), training library: each test fails
on a realistic planted bug that the rest of the suite let through.

2. train / validation / test splits are disjoint and fixed by the seed (classify, lm, seq2seq);
4. zero-weight filler rows change no loss, metric or gradient, and evaluators weight by count;
6. the weight-decay mask, hard-coded per family (the torch trajectory test derives torch's
   groups from the mask itself, so it cannot see a wrong one).

Then small tests for the mutants (planted bugs) that survived the suite: the run loop's logs,
evaluation mode, final checkpoint and infinite-loss stop; make_steps' gradient norm; an
all-masked cross-entropy; batching's shuffles and window offsets; data readers; the HF export's
config. Models and generation: test_guards.py.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
import torch

from flax_transformer.training.run_config import replace
from flax_transformer.verification import export

# ---------------------------------------------------------------- 2. splits: disjoint, fixed by the seed


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


# ---------------------------------------------------------------- 4. filler rows change nothing
# Bucketed and Rows fill a short last batch with rows of weight 0 (and seq2seq's padding rows
# have no real target token). A batch with such rows must give the loss, every metric and the
# gradients of the same examples alone; an evaluator's result must not depend on how the
# examples are cut into batches.


@functools.cache
def _jitted_loss_and_grads(loss_fn):
    from flax import nnx

    @nnx.jit
    def run(model, batch):
        (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        return loss, metrics, grads

    return run


def _loss_metrics_grads(loss_fn, model, batch):
    loss, metrics, grads = _jitted_loss_and_grads(loss_fn)(model, batch)
    return float(loss), {k: float(v) for k, v in metrics.items()}, jax.tree.leaves(grads)


def _assert_same(a, b, *, grads=True):
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = a, b
    assert np.isfinite(loss_a) and loss_a == pytest.approx(loss_b, rel=1e-6, abs=1e-7)
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-6, abs=1e-7), key
    if grads:
        assert len(grads_a) == len(grads_b)
        for x, y in zip(grads_a, grads_b, strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def _classifier(kind):
    """A tiny classifier in eval mode (dropout would draw other masks for another batch shape).
    Built in torch and ported: built in JAX, every initialiser would compile eagerly."""
    import torch_reference.encoder as te
    import torch_reference.former as tf
    from flax_transformer.interop import porting
    from flax_transformer.models.configs import EncoderConfig

    torch.manual_seed(0)
    if kind.startswith("former"):
        torch_model = tf.CTransformer(16, 2, 1, 16, 30, 2, max_pool=kind == "former-max")
    else:
        torch_model = te.TransformerForSequenceClassification(EncoderConfig.tiny(
            vocab_size=30, hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32,
            max_position_embeddings=16, num_labels=2, classifier_pooling="mean" if kind == "encoder-mean" else "cls"))
    return porting.torch_to_flax(torch_model.eval())


def _seq2seq_model(config):
    import torch_reference.classic as tc
    from flax_transformer.interop import porting
    from flax_transformer.training import seq2seq

    torch.manual_seed(0)
    return porting.torch_to_flax(tc.Transformer(seq2seq.VOCAB, seq2seq.VOCAB, config.d_model, config.heads,
                                                config.n_blocks, config.d_ff, 0.0, max_len=config.max_digits + 2).eval())


# max pooling and mean pooling over a row with no token (the evaluator test has the former's mean)
@pytest.mark.parametrize("kind", ["former-max", "encoder-mean", "probe"])
def test_filler_rows_change_no_classify_loss_metric_or_gradient(kind):
    from flax_transformer.training import classify
    from flax_transformer.training.batching import Bucketed, Rows

    rng = np.random.default_rng(0)
    n = 5
    seqs = [rng.integers(1, 30, size=k) for k in (16, 3, 9, 1, 12)]
    labels = np.array([0, 1, 1, 0, 1], np.int32)
    model = _classifier("encoder-mean" if kind == "probe" else kind)
    if kind == "probe":
        features = rng.standard_normal((n, 16)).astype(np.float32)
        model = classify.Probe(model)
        model.eval()
        make = lambda size: Rows({"features": features, "labels": labels}, batch_size=size, shuffle=False)  # noqa: E731
    else:
        make = lambda size: Bucketed(seqs, labels, batch_size=size, buckets=(16,), shuffle=False)  # noqa: E731
    alone, padded = make(n).batch(0), make(n + 3).batch(0)
    assert padded["weight"].tolist() == [1.0] * n + [0.0] * 3
    a = _loss_metrics_grads(classify.loss_fn, model, alone)
    # some right, some wrong: then counting the 3 filler rows changes the accuracy, whatever they predict
    assert 0 < a[1]["accuracy"] < 1 and a[1]["count"] == n
    _assert_same(a, _loss_metrics_grads(classify.loss_fn, model, padded))


def test_filler_rows_change_no_seq2seq_loss_metric_or_gradient():
    from flax_transformer.training import seq2seq

    config = seq2seq.Seq2SeqConfig.tiny(d_model=16, d_ff=32)
    model = _seq2seq_model(config)
    batch = seq2seq.make_batch(config, np.random.default_rng(0), 5)
    filler = {k: np.concatenate([v, np.zeros((3, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}
    a = _loss_metrics_grads(seq2seq.loss_fn, model, batch)
    assert 0 < a[1]["token_accuracy"] < 1
    _assert_same(a, _loss_metrics_grads(seq2seq.loss_fn, model, filler))


def test_evaluators_weight_batches_by_their_real_count():
    """Validation and test metrics equal those of all the examples in one batch, whatever the
    bucketing, the filler rows and a short last batch."""
    from flax_transformer.training import classify, seq2seq
    from flax_transformer.training.batching import Bucketed
    from flax_transformer.training.loop import batch_evaluator

    def same(loss_fn, model, batches, whole):
        got = batch_evaluator(loss_fn, lambda: batches)(model)
        want = batch_evaluator(loss_fn, lambda: [whole])(model)
        assert got.keys() == want.keys()
        for key in got:
            assert got[key] == pytest.approx(want[key], rel=1e-6), key
        return want

    rng = np.random.default_rng(1)
    n = 11
    seqs = [rng.integers(1, 30, size=k) for k in rng.integers(1, 17, size=n)]
    labels = rng.integers(0, 2, size=n).astype(np.int32)
    bucketed = list(Bucketed(seqs, labels, batch_size=4, buckets=(8, 16), shuffle=False).epoch())
    assert sum(b["weight"].min() == 0 for b in bucketed) == 2  # filler rows in play
    whole = Bucketed(seqs, labels, batch_size=n, buckets=(16,), shuffle=False).batch(0)
    want = same(classify.loss_fn, _classifier("former-mean"), bucketed, whole)
    assert want["count"] == n and 0 < want["accuracy"] < 1

    # seq2seq: batches with different numbers of real target tokens
    config = seq2seq.Seq2SeqConfig.tiny(d_model=16, d_ff=32)
    model = _seq2seq_model(config)
    held_out = seq2seq.make_batch(config, np.random.default_rng(2), 10)
    cut = [{k: v[i:i + 5] for k, v in held_out.items()} for i in (0, 5)]
    assert cut[0]["src_mask"].sum() != cut[1]["src_mask"].sum()
    same(seq2seq.loss_fn, model, cut, held_out)


# ---------------------------------------------------------------- 6. weight decay: the mask, hard-coded
# No decay on biases, norms and embeddings; decay on every 2-D projection (kernel, and the
# notebook-002 / GPT-2 ``matrix``). Written out per family, one layer and one head each.

NO_DECAY = {
    "former": """pos_embedding.embedding token_embedding.embedding toprobs.bias tblocks.0.ff.0.bias tblocks.0.ff.2.bias
        tblocks.0.mhattention.unifyheads.bias tblocks.0.norm1.bias tblocks.0.norm1.scale tblocks.0.norm2.bias
        tblocks.0.norm2.scale""",
    "encoder": """classifier.bias encoder.embeddings.layer_norm.bias encoder.embeddings.layer_norm.scale
        encoder.embeddings.position_embeddings.embedding encoder.embeddings.token_embeddings.embedding
        encoder.layers.0.attention.heads.0.k.bias encoder.layers.0.attention.heads.0.q.bias
        encoder.layers.0.attention.heads.0.v.bias encoder.layers.0.attention.output_linear.bias
        encoder.layers.0.feed_forward.linear_1.bias encoder.layers.0.feed_forward.linear_2.bias
        encoder.layers.0.layer_norm_1.bias encoder.layers.0.layer_norm_1.scale encoder.layers.0.layer_norm_2.bias
        encoder.layers.0.layer_norm_2.scale""",
    "bert": """classifier.bias encoder.embeddings.layer_norm.bias encoder.embeddings.layer_norm.scale
        encoder.embeddings.position_embeddings.embedding encoder.embeddings.token_embeddings.embedding
        encoder.embeddings.token_type_embeddings.embedding encoder.pooler.bias
        encoder.layers.0.attention.heads.0.k.bias encoder.layers.0.attention.heads.0.q.bias
        encoder.layers.0.attention.heads.0.v.bias encoder.layers.0.attention.output_linear.bias
        encoder.layers.0.feed_forward.linear_1.bias encoder.layers.0.feed_forward.linear_2.bias
        encoder.layers.0.layer_norm_1.bias encoder.layers.0.layer_norm_1.scale encoder.layers.0.layer_norm_2.bias
        encoder.layers.0.layer_norm_2.scale""",
    "gpt": """embedding_norm.beta embedding_norm.gamma out_layer_norm.beta out_layer_norm.gamma lm_head.bias
        position_embeddings.embedding token_embeddings.embedding transformer_stack.0.feed_forward.w1.bias
        transformer_stack.0.feed_forward.w2.bias transformer_stack.0.layer_norm_attention.beta
        transformer_stack.0.layer_norm_attention.gamma transformer_stack.0.layer_norm_feed_forward.beta
        transformer_stack.0.layer_norm_feed_forward.gamma""",
    "gpt2": """transformer.wpe.embedding transformer.wte.embedding transformer.ln_f.bias transformer.ln_f.scale
        transformer.h.0.attn.c_attn.bias transformer.h.0.attn.c_proj.bias transformer.h.0.mlp.c_fc.bias
        transformer.h.0.mlp.c_proj.bias transformer.h.0.ln_1.bias transformer.h.0.ln_1.scale
        transformer.h.0.ln_2.bias transformer.h.0.ln_2.scale""",
    "classic": " ".join(
        [f"{side}.{block}.{part}.bias" for side, block in (("encoder", "encoders.0"), ("decoder", "decoders.0"))
         for part in ("attn_head.attn_heads.0.key_tfm", "attn_head.attn_heads.0.query_tfm",
                      "attn_head.attn_heads.0.value_tfm", "attn_head.projection", "position_wise_feed_forward.0",
                      "position_wise_feed_forward.2", "layer_norm1", "layer_norm2")]
        + [f"decoder.decoders.0.{part}" for part in (
            "layer_norm1.scale", "layer_norm2.scale", "layer_norm3.scale", "layer_norm3.bias",
            "masked_attn_head.attn_heads.0.key_tfm.bias", "masked_attn_head.attn_heads.0.query_tfm.bias",
            "masked_attn_head.attn_heads.0.value_tfm.bias", "masked_attn_head.projection.bias")]
        + ["encoder.encoders.0.layer_norm1.scale", "encoder.encoders.0.layer_norm2.scale", "out.bias",
           "src_embedding.embedding", "tgt_embedding.embedding"]),
}
DECAYED_PROJECTIONS = {"former": 7, "encoder": 7, "bert": 8, "gpt": 6, "gpt2": 4, "classic": 17}


def _one_layer_model(family):
    from flax import nnx

    from flax_transformer.models import classic, encoder, former, gpt
    from flax_transformer.models.configs import EncoderConfig, GPTConfig

    enc = EncoderConfig.tiny(vocab_size=20, hidden_size=8, num_attention_heads=1, num_hidden_layers=1,
                             intermediate_size=16, max_position_embeddings=6, num_labels=2)
    build = {
        "former": lambda: former.CTransformer(8, 1, 1, 6, 20, 2, rngs=nnx.Rngs(0)),
        "encoder": lambda: encoder.TransformerForSequenceClassification(enc, rngs=nnx.Rngs(0)),
        "bert": lambda: encoder.TransformerForSequenceClassification(
            EncoderConfig.bert(dataclasses.asdict(enc)), rngs=nnx.Rngs(0)),
        "gpt": lambda: gpt.GPTTransformer(1, 8, 16, 1, 20, 6, rngs=nnx.Rngs(0)),
        "gpt2": lambda: gpt.GPT2LMHeadModel(GPTConfig.tiny(vocab_size=20, n_positions=6, n_embd=8, n_head=1,
                                                           n_layer=1), rngs=nnx.Rngs(0)),
        "classic": lambda: classic.Transformer(20, 20, 8, 1, 1, 16, max_len=6, rngs=nnx.Rngs(0)),
    }[family]
    return nnx.eval_shape(build)


@pytest.mark.parametrize("family", NO_DECAY)
def test_weight_decay_spares_exactly_these_parameters(family):
    from flax import nnx

    from flax_transformer.training.optim import decay_mask

    mask = decay_mask(nnx.state(_one_layer_model(family), nnx.Param))
    flags = {".".join(str(getattr(p, "key", p)) for p in path[:-1]): bool(flag)
             for path, flag in jax.tree_util.tree_flatten_with_path(mask)[0]}
    spared = {name for name, flag in flags.items() if not flag}
    assert spared == set(NO_DECAY[family].split())
    decayed = {name for name, flag in flags.items() if flag}
    assert len(decayed) == DECAYED_PROJECTIONS[family]
    assert all(name.endswith((".kernel", ".matrix")) for name in decayed), sorted(decayed)


# ---------------------------------------------------------------- mutation-testing survivors: the run loop
# One tiny fit whose every logged number is known in advance: the loss is w·x, so the gradient
# is the batch's x (its norm is known), and each batch carries its own step number.


class _Linear:
    """Batches of x (4,) with a known gradient norm, plus the step number and a poison term."""

    def __init__(self, poison_at=None):
        self.poison_at = poison_at

    def batch(self, step):
        x = np.random.default_rng(step).standard_normal(4).astype(np.float32)
        poison = np.inf if step == self.poison_at else 0.0
        return {"x": x, "step": np.float32(step), "poison": np.float32(poison)}

    def position(self, step):
        return {"step": step}

    def count_tokens(self, batch):
        return 4


def _tiny_model():
    from flax import nnx

    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jax.numpy.zeros(4))
            self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    return Tiny()


def _linear_loss(model, batch):
    jnp = jax.numpy
    loss = jnp.sum(model.w[...] * batch["x"]) + batch["poison"]
    return loss, {"count": jnp.float32(1), "step_seen": batch["step"],
                  "train_mode": jnp.float32(not model.dropout.deterministic)}


def test_fit_logs_what_happened_and_ends_with_a_checkpoint_and_an_eval_mode_model(tmp_path):
    from flax_transformer.training import loop
    from flax_transformer.training.optim import OptimConfig, schedule

    modes = []

    def evaluate(model):
        modes.append(model.dropout.deterministic)
        return {"loss": 0.0, "count": 1.0}

    config = OptimConfig(lr=0.1, warmup_steps=4)
    loop.create_run_dir(tmp_path, {"x": 1})
    with jax.numpy_dtype_promotion("standard"):  # optax's step count (see test_training.py)
        result = loop.fit(_tiny_model(), config, _linear_loss, _Linear(), run_dir=tmp_path, steps=6,
                          run_config={"x": 1}, evaluate=evaluate, eval_every=3, checkpoint_every=4, log_every=2,
                          progress=False, tensorboard=False)
    assert result.step == 6 and not result.interrupted
    assert result.model.dropout.deterministic, "fit returns its model in eval mode"
    assert modes == [True, True], "evaluation runs in eval mode, at step 3 and once at the end"
    records = loop.read_metrics(tmp_path)
    assert [(r["step"], r["split"]) for r in records if r["split"] == "eval"] == [(3, "eval"), (6, "eval")]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    norms = [float(np.linalg.norm(_Linear().batch(s)["x"])) for s in range(6)]
    for r in train:  # each line: the mean over the steps since the last one
        s = r["step"]
        assert r["step_seen"] == pytest.approx(s - 1.5), "a train line averages its window of steps"
        assert r["train_mode"] == 1.0, "the train step runs in train mode"
        assert r["grad_norm"] == pytest.approx((norms[s - 2] + norms[s - 1]) / 2, rel=1e-5)
        assert r["lr"] == pytest.approx(float(schedule(config)(s - 1)), rel=1e-6), "lr of the step's update"
    checkpoints = loop.Checkpoints(tmp_path)
    try:
        assert checkpoints.steps()[-1] == 6, "the last step is saved"
    finally:
        checkpoints.close()


def test_an_infinite_loss_stops_the_run(tmp_path):
    from flax_transformer.training import loop
    from flax_transformer.training.optim import OptimConfig

    loop.create_run_dir(tmp_path, {"x": 1})
    with jax.numpy_dtype_promotion("standard"), pytest.raises(loop.NonFiniteLoss, match="loss is inf at step 3"):
        loop.fit(_tiny_model(), OptimConfig(lr=0.1), _linear_loss, _Linear(poison_at=2), run_dir=tmp_path, steps=6,
                 run_config={"x": 1}, checkpoint_every=10, progress=False, tensorboard=False)


def test_make_steps_reports_the_gradient_norm():
    from flax import nnx

    from flax_transformer.training import make_optimizer, make_steps
    from flax_transformer.training.optim import OptimConfig

    model = _tiny_model()
    optimizer = nnx.Optimizer(model, make_optimizer(OptimConfig(lr=0.1)), wrt=nnx.Param)
    train_step, _ = make_steps(_linear_loss)
    for step in range(2):  # the gradient of w·x is x, whatever w
        batch = _Linear().batch(step)
        with jax.numpy_dtype_promotion("standard"):
            metrics = train_step(model, optimizer, batch)
        assert float(metrics["grad_norm"]) == pytest.approx(float(np.linalg.norm(batch["x"])), rel=1e-6)


def test_cross_entropy_with_nothing_to_count_is_zero_not_nan():
    from flax_transformer.training import cross_entropy

    logits, labels = jax.numpy.ones((2, 3, 5)), jax.numpy.zeros((2, 3), jax.numpy.int32)
    loss, grad = jax.value_and_grad(lambda x: cross_entropy(x, labels, jax.numpy.zeros((2, 3), bool)))(logits)
    assert float(loss) == 0.0 and not np.any(np.asarray(grad))


# ---------------------------------------------------------------- mutation-testing survivors: batching, data, export


def test_windows_draw_every_start_offset():
    from flax_transformer.training.batching import Windows

    windows = Windows(np.arange(10), batch_size=64, length=8, seed=0)  # starts 0 and 1 only
    starts = {int(s) for step in range(3) for s in windows.batch(step)["ids"][:, 0]}
    assert starts == {0, 1}


def test_bucketed_examples_meet_other_examples_each_epoch():
    """Each epoch shuffles which examples share a batch, not only the order of the batches."""
    from flax_transformer.training.batching import Bucketed

    seqs = [np.full(5, i) for i in range(40)]
    batches = Bucketed(seqs, np.zeros(40), batch_size=8, buckets=(8,), seed=0)
    groups = [{frozenset(b["ids"][:, 0].tolist()) for b in batches.epoch(e)} for e in (0, 1)]
    assert groups[0] != groups[1]
    again = Bucketed(seqs, np.zeros(40), batch_size=8, buckets=(8,), seed=0)
    assert {frozenset(b["ids"][:, 0].tolist()) for b in again.epoch(0)} == groups[0]


def test_blank_lines_are_not_snippets(tmp_path):
    from flax_transformer.training import data

    (tmp_path / "rt-polarity").mkdir()
    for name in ("neg", "pos"):
        (tmp_path / "rt-polarity" / f"rt-polarity.{name}").write_text(f"{name} one\n\n  \n{name} two \n")
    assert data.read_rt_polarity(tmp_path) == [("neg one", 0), ("neg two", 0), ("pos one", 1), ("pos two", 1)]


def test_a_packed_imdb_shard_that_differs_from_its_checksum_is_refused(tmp_path):
    import gzip
    import hashlib

    from flax_transformer.training import data

    _write_packed_imdb(tmp_path, 4, 4)
    folder = tmp_path / "imdb"
    sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.jsonl.gz"))}
    (folder / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in sums.items()))
    assert len(data.read_imdb(tmp_path, "train")) == 4
    shard = folder / "train-pos-00-of-01.jsonl.gz"  # rewritten: valid gzip and JSON, other reviews
    with gzip.open(shard, "wt") as f:
        f.write('{"id": 0, "label": 1, "text": "something else"}\n{"id": 1, "label": 1, "text": "and more"}\n')
    with pytest.raises(data.DataError, match="SHA-256"):
        data.read_imdb(tmp_path, "train")


def test_archives_with_links_are_refused(tmp_path):
    import io
    import tarfile

    from flax_transformer.training import data

    for kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        archive = tmp_path / f"links-{kind!r}.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            payload = b"review"
            info = tarfile.TarInfo("aclImdb/train/pos/0_9.txt")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
            link = tarfile.TarInfo("aclImdb/train/pos/1_9.txt")
            link.type, link.linkname = kind, "aclImdb/train/pos/0_9.txt" if kind == tarfile.LNKTYPE else "/etc/passwd"
            tar.addfile(link)
        out = tmp_path / f"out-{kind!r}"
        with pytest.raises(ValueError, match="unsafe member"):
            data.extract_tar(archive, out)
        assert not (out / "aclImdb").exists()


def test_exported_bert_classifier_config_round_trips(tmp_path):
    """hf.save_pretrained writes the model's own options and the label names in order."""
    import json

    import torch_reference.encoder as te
    from flax_transformer.models.configs import EncoderConfig

    config = dataclasses.replace(EncoderConfig.bert(dict(
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=12, layer_norm_eps=1e-7, hidden_act="relu", type_vocab_size=3,
        hidden_dropout_prob=0.05, attention_probs_dropout_prob=0.02)), num_labels=3)
    export.save_pretrained(te.TransformerForSequenceClassification(config), tmp_path / "out",
                       labels=["neg", "mixed", "pos"])
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["id2label"] == {"0": "neg", "1": "mixed", "2": "pos"}
    assert written["label2id"] == {"neg": 0, "mixed": 1, "pos": 2}
    assert dataclasses.replace(EncoderConfig.bert(written), num_labels=3) == config
