"""Sentiment classification (notebooks 000 and 001) as a library: ``train_and_evaluate(config, run_dir)``.

The model is ``former.CTransformer`` (notebook 000, default) or
``encoder.TransformerForSequenceClassification`` (notebook 001, reading a ``<cls>`` token
put in front of every review). Text goes through notebook 000's tokenizer (lower-cased
words, 50k vocabulary), reviews longer than ``max_length`` are truncated, and batches are
bucketed by length with padding masked in attention and pooling.

Of the training reviews, ``val_size`` (chosen with the seed) are held out to watch
during training; the test set is only read at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import checkpoints as ckpt
from ..configs import EncoderConfig
from . import data, tokenizers
from .batching import Bucketed, default_buckets
from .loop import Checkpoints, RunError, batch_evaluator, create_run_dir, fit, plot_curves, prepare_run_dir
from .optim import OptimConfig, check_precision, compute_dtype, from_task

LABELS = ("negative", "positive")


@dataclass(frozen=True)
class ClassifyConfig:
    """One classification run. ``steps`` (if set) overrides ``epochs``."""

    model: str = "former"  # "former" (CTransformer) or "encoder" (TransformerForSequenceClassification)
    dataset: str = "imdb"  # "imdb" or "rt-polarity" (10% held out as its test set)
    tokenizer: str = "notebook_000"  # notebook 000's lower-cased words, or "notebook_002"'s cleaned-up words
    vocab_size: int = 50_000
    max_length: int = 512
    buckets: int = 4
    emb: int = 128
    heads: int = 8
    depth: int = 6
    ff_mult: int = 4
    dropout: float = 0.1
    max_pool: bool = False  # CTransformer's pooling; mean pooling over real tokens otherwise
    num_classes: int = 2
    batch_size: int = 32
    epochs: float = 1.0
    steps: int | None = None
    optimizer: str = "adamw"
    lr: float = 1e-3
    warmup_steps: int = 100
    decay: str = "cosine"
    weight_decay: float = 0.01
    clip_norm: float | None = 1.0
    train_limit: int | None = None  # use a seeded subset of the training reviews
    test_limit: int | None = None
    val_size: int = 2500
    eval_every: int | None = None  # default: once per epoch
    checkpoint_every: int | None = None  # default: 5 checkpoints per run
    keep: int = 3
    seed: int = 0
    dtype: str = "float32"  # compute dtype: "float32" or "bf16" (parameters stay float32)
    attention: str = "reference"  # "reference", "xla" or "cudnn" (see flax_transformer.set_attention)

    def __post_init__(self):
        check_precision(self.dtype, self.attention)
        if self.model not in ("former", "encoder"):
            raise ValueError(f"model must be 'former' or 'encoder', got {self.model!r}")
        if self.dataset not in ("imdb", "rt-polarity"):
            raise ValueError(f"dataset must be 'imdb' or 'rt-polarity', got {self.dataset!r}")
        if self.emb % self.heads:
            raise ValueError(f"emb ({self.emb}) must be divisible by heads ({self.heads})")
        if self.tokenizer not in ("notebook_000", "notebook_002"):
            raise ValueError(f"tokenizer must be 'notebook_000' or 'notebook_002', got {self.tokenizer!r}")

    @classmethod
    def tiny(cls, **changes):
        """Seconds on 2 CPU cores, for tests: 2,000 reviews, one small block."""
        return dataclasses.replace(cls(vocab_size=5000, max_length=128, emb=32, heads=2, depth=1, dropout=0.0,
                                       batch_size=32, steps=60, lr=1e-2, warmup_steps=10, train_limit=2000,
                                       test_limit=500, val_size=256, eval_every=30, checkpoint_every=20), **changes)

    @classmethod
    def small(cls, **changes):
        """The 2-core CPU benchmark: the full IMDB train/test split, 2 blocks of width 128."""
        return dataclasses.replace(cls(vocab_size=50_000, max_length=512, emb=128, heads=8, depth=2, dropout=0.1,
                                       batch_size=32, epochs=3, lr=1e-3, warmup_steps=200), **changes)

    @classmethod
    def base(cls, **changes):
        """Notebook 000's model (6 blocks of width 128, 512 tokens), sized for a GPU."""
        return dataclasses.replace(cls(depth=6, batch_size=64, epochs=10, lr=5e-4, warmup_steps=1000), **changes)

    def optim(self, total_steps: int) -> OptimConfig:
        return from_task(self, total_steps)


PRESETS = {"tiny": ClassifyConfig.tiny, "small": ClassifyConfig.small, "base": ClassifyConfig.base}


# ------------------------------------------------------------------------------- data


def _subset(rows, limit, rng):
    if limit is None or limit >= len(rows):
        return rows
    return [rows[i] for i in sorted(rng.choice(len(rows), size=limit, replace=False))]


def load_splits(config: ClassifyConfig, data_dir=None):
    """(train, val, test) lists of (text, label), with ``val`` carved from train by the seed."""
    rng = np.random.default_rng([config.seed, 7])
    if config.dataset == "imdb":
        train, test = data.imdb(data_dir, "train"), data.imdb(data_dir, "test")
    else:
        rows = data.rt_polarity(data_dir)
        order = rng.permutation(len(rows))
        cut = len(rows) // 10
        test, train = [rows[i] for i in order[:cut]], [rows[i] for i in order[cut:]]
    for name, rows in (("train", train), ("test", test)):
        if not rows:
            raise RunError(f"the {config.dataset} {name} set is empty")
        bad = sorted({label for _, label in rows if not 0 <= label < config.num_classes})
        if bad:
            raise RunError(f"the {config.dataset} {name} set has labels {bad} outside 0..{config.num_classes - 1} "
                           f"(num_classes = {config.num_classes})")
    train = _subset(train, config.train_limit, rng)
    test = _subset(test, config.test_limit, rng)
    if config.val_size >= len(train):
        raise RunError(f"val_size ({config.val_size}) leaves no training examples out of {len(train)}")
    order = rng.permutation(len(train))
    val = [train[i] for i in order[:config.val_size]]
    train = [train[i] for i in order[config.val_size:]]
    return train, val, test


def build_tokenizer(config: ClassifyConfig, texts):
    """Notebook 000's (or 002's) tokenizer, truncating to ``max_length``; the encoder gets a leading ``<cls>``.

    Both have a ``<pad>`` token (notebook 002's ``<PAD>`` is renamed on the way in, so the
    batcher finds it under one name).
    """
    from tokenizers import processors

    if config.tokenizer == "notebook_002":
        tokenizer = tokenizers.notebook_002(texts, max_voc=config.vocab_size - 4, max_length=config.max_length)
        tokenizer.post_processor = None  # no <BOS>/<EOS> for a classifier
    else:
        tokenizer = tokenizers.notebook_000(texts, config.vocab_size)
    if config.model == "encoder":
        tokenizer.add_special_tokens(["<cls>"])
        cls_id = tokenizer.token_to_id("<cls>")
        tokenizer.post_processor = processors.TemplateProcessing(single="<cls> $A", special_tokens=[("<cls>", cls_id)])
    tokenizer.enable_truncation(config.max_length)
    return tokenizer


def _pad_id(tokenizer) -> int:
    pad = tokenizer.token_to_id("<pad>")
    return tokenizer.token_to_id("<PAD>") if pad is None else pad


def encode(tokenizer, rows):
    """[(text, label)] -> (list of id arrays, label array); empty texts keep one ``<unk>``."""
    encodings = tokenizer.encode_batch([text for text, _ in rows])
    sequences = [np.asarray(e.ids or [0], dtype=np.int32) for e in encodings]
    return sequences, np.array([label for _, label in rows], dtype=np.int32)


# ------------------------------------------------------------------------------ model and loss


def build_model(config: ClassifyConfig, vocab_size: int, *, seed: int | None = None):
    from ..encoder import TransformerForSequenceClassification
    from ..former import CTransformer

    from .. import set_attention

    seed = config.seed if seed is None else seed
    kw = dict(rngs=nnx.Rngs(params=seed, dropout=seed + 1), dtype=compute_dtype(config.dtype))
    if config.model == "former":
        model = CTransformer(config.emb, config.heads, config.depth, config.max_length, vocab_size,
                             config.num_classes, max_pool=config.max_pool, dropout=config.dropout, **kw)
        set_attention(model, config.attention)
        return model
    encoder = EncoderConfig(vocab_size=vocab_size, hidden_size=config.emb, num_hidden_layers=config.depth,
                            num_attention_heads=config.heads, intermediate_size=config.ff_mult * config.emb,
                            hidden_dropout_prob=config.dropout, max_position_embeddings=config.max_length,
                            num_labels=config.num_classes)
    model = TransformerForSequenceClassification(encoder, **kw)
    set_attention(model, config.attention)
    return model


def loss_fn(model, batch):
    """Mean cross-entropy over real rows (``weight`` 1), with accuracy. Returns (loss, metrics)."""
    out = model(batch["ids"], batch["mask"])  # (b, classes): log-probs (CTransformer) or logits (encoder)
    logp = jax.nn.log_softmax(out.astype(jnp.float32), axis=-1)
    labels, weight = batch["labels"], batch["weight"]
    nll = -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
    count = weight.sum()
    n = jnp.maximum(count, 1.0)
    accuracy = ((logp.argmax(-1) == labels) * weight).sum() / n
    return (nll * weight).sum() / n, {"accuracy": accuracy, "count": count}


# ------------------------------------------------------------------------------- the run


def train_and_evaluate(config: ClassifyConfig, run_dir, *, data_dir=None, resume: bool = False, progress: bool = True,
                       export_torch=None, mesh=None) -> dict:
    """Train, evaluate on the test set, write the run directory; returns the final metrics.

    ``resume`` continues ``run_dir``'s run (the configuration must be the same) from its
    latest checkpoint. ``export_torch`` also writes the trained weights as a torch_reference
    state_dict in a safetensors file (with the model's description in its header).
    """
    run_dir = Path(run_dir)
    run_config = {"task": "classify", **dataclasses.asdict(config)}
    prepare_run_dir(run_dir, run_config, resume=resume)  # before the slow part: a wrong --resume fails now
    train, val, test = load_splits(config, data_dir)
    if not resume:
        create_run_dir(run_dir, run_config)
    tok_path = run_dir / "tokenizer.json"
    if resume and tok_path.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tok_path))
    else:
        tokenizer = build_tokenizer(config, [text for text, _ in train])
        ckpt._atomic_file(tok_path, lambda tmp: tokenizer.save(tmp))
    buckets = default_buckets(config.max_length, config.buckets)
    pad = _pad_id(tokenizer)
    make = lambda rows, shuffle: Bucketed(*encode(tokenizer, rows), batch_size=config.batch_size, buckets=buckets,
                                          pad_id=pad, seed=config.seed, shuffle=shuffle)
    train_batches, val_batches, test_batches = make(train, True), make(val, False), make(test, False)
    steps = config.steps or max(1, math.ceil(config.epochs * train_batches.steps_per_epoch))
    model = build_model(config, tokenizer.get_vocab_size())
    print(f"classify: {config.model} on {config.dataset}: {len(train)} train / {len(val)} val / {len(test)} test "
          f"reviews, {train_batches.num_tokens:,} train tokens, buckets {buckets}, {steps} steps "
          f"({train_batches.steps_per_epoch} per epoch)", file=sys.stderr)
    result = fit(model, config.optim(steps), loss_fn, train_batches, run_dir=run_dir, steps=steps,
                 run_config=run_config, evaluate=batch_evaluator(loss_fn, lambda: val_batches.epoch()),
                 eval_every=config.eval_every or train_batches.steps_per_epoch,
                 checkpoint_every=config.checkpoint_every, keep=config.keep, resume=resume, progress=progress,
                 mesh=mesh,
                 description=f"classify-{config.model}")
    metrics = {"step": result.step, "interrupted": result.interrupted,
               **{f"val_{k}": v for k, v in result.metrics.items() if k != "count"}}
    if not result.interrupted:
        test_metrics = batch_evaluator(loss_fn, lambda: test_batches.epoch())(result.model)
        metrics |= {f"test_{k}": v for k, v in test_metrics.items() if k != "count"}
        _append_metrics(run_dir, result.step, "test", {k: v for k, v in test_metrics.items() if k != "count"})
        plot_curves(run_dir, title=f"classify-{config.model}")  # again, with the test point
    if export_torch is not None:
        ckpt.save_safetensors(result.model, export_torch)
    return metrics


def _append_metrics(run_dir, step, split, values):
    with open(Path(run_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "split": split, **values}) + "\n")


# ------------------------------------------------------------------------------- inference


def load_run(run_dir, *, step: int | None = None):
    """(model in eval mode, tokenizer, config) from a run directory's latest (or given) checkpoint."""
    from tokenizers import Tokenizer

    run_dir = Path(run_dir)
    try:
        saved = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError) as error:
        raise RunError(f"{run_dir} is not a classify run directory (run.json: {error})") from None
    if saved.pop("task", None) != "classify":
        raise RunError(f"{run_dir} holds a run of another task, not classify")
    config = ClassifyConfig(**saved)
    if not (run_dir / "tokenizer.json").is_file():
        raise RunError(f"{run_dir} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    checkpoints = Checkpoints(run_dir, keep=config.keep)
    try:
        model, step = checkpoints.restore_model(build_model(config, tokenizer.get_vocab_size()), step)
    finally:
        checkpoints.close()
    model.eval()
    return model, tokenizer, config


def predict(run_dir, texts, *, step: int | None = None) -> list[tuple[str, float]]:
    """[(label, probability of that label)] for each text, with the run's model and tokenizer."""
    model, tokenizer, config = load_run(run_dir, step=step)
    sequences, _ = encode(tokenizer, [(t, 0) for t in texts])
    probs = []
    for i in range(0, len(sequences), config.batch_size):  # in input order; pad to the bucket of the longest
        chunk = sequences[i:i + config.batch_size]
        buckets = default_buckets(config.max_length, config.buckets)
        length = buckets[int(np.searchsorted(buckets, max(len(s) for s in chunk)))]
        ids = np.full((len(chunk), length), _pad_id(tokenizer), dtype=np.int32)
        mask = np.zeros((len(chunk), length), dtype=bool)
        for row, seq in enumerate(chunk):
            ids[row, :len(seq)], mask[row, :len(seq)] = seq, True
        probs.extend(np.exp(np.asarray(jax.nn.log_softmax(model(ids, mask).astype(jnp.float32), axis=-1))))
    names = LABELS if config.num_classes == 2 else [str(i) for i in range(config.num_classes)]
    return [(names[int(p.argmax())], float(p.max())) for p in probs]
