"""Zero-weight filler rows change no loss, metric or gradient, and evaluators weight batches by
their real count.

Each test fails on a realistic planted bug the parity tests cannot see (issue 17, item 4).
"""

import functools

import jax
import numpy as np
import pytest
import torch

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
    from flax_transformer.training.probe import Probe

    rng = np.random.default_rng(0)
    n = 5
    seqs = [rng.integers(1, 30, size=k) for k in (16, 3, 9, 1, 12)]
    labels = np.array([0, 1, 1, 0, 1], np.int32)
    model = _classifier("encoder-mean" if kind == "probe" else kind)
    if kind == "probe":
        features = rng.standard_normal((n, 16)).astype(np.float32)
        model = Probe(model)
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


@pytest.mark.slow(reason="test_filler_rows_change_no_classify_loss_metric_or_gradient (the same filler rows, "
                  "the classify steps)")
def test_filler_rows_change_no_seq2seq_loss_metric_or_gradient():
    from flax_transformer.training import seq2seq

    config = seq2seq.Seq2SeqConfig.tiny(d_model=16, d_ff=32)
    model = _seq2seq_model(config)
    batch = seq2seq.make_batch(config, np.random.default_rng(0), 5)
    filler = {k: np.concatenate([v, np.zeros((3, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}
    a = _loss_metrics_grads(seq2seq.loss_fn, model, batch)
    assert 0 < a[1]["token_accuracy"] < 1
    _assert_same(a, _loss_metrics_grads(seq2seq.loss_fn, model, filler))


@pytest.mark.slow(reason="test_filler_rows_change_no_classify_loss_metric_or_gradient (filler rows weigh nothing)")
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
