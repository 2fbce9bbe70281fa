"""HuggingFace checkpoints <-> flax_transformer (and torch_reference): BERT, DistilBERT, RoBERTa, GPT-2,
and the llama family (Llama, Mistral, Qwen2, Qwen3, Gemma).

    model = hf.from_pretrained("path/to/folder")        # config.json + weights -> Flax model
    hf.save_pretrained(model, "path/to/new_folder")       # -> a folder transformers loads

A folder holds ``config.json`` and ``model.safetensors``, or ``pytorch_model.bin``, or
a sharded ``*.index.json`` with its shards. ``model_type`` picks the family:

* ``bert``, ``distilbert``, ``roberta`` -> ``encoder.TransformerEncoder`` with
  ``EncoderConfig.bert`` (post-LN, token types, pooler, the config's eps and GELU),
  ``.distilbert`` (no token types, no pooler, eps 1e-12) or ``.roberta`` (BERT's, with
  positions counted from ``pad_token_id + 1`` that skip padding). Called as
  ``model(input_ids, attention_mask=None, token_type_ids=None)`` -> last hidden state;
  ``model.pool(hidden)`` is the pooler output. HF's fused-per-projection q/k/v weights
  (hidden, hidden) are split into the notebook's per-head layout.
* ``classifier_from_pretrained`` -> ``encoder.TransformerForSequenceClassification`` on
  that encoder: ``BertForSequenceClassification`` ([CLS] through the pooler, then
  ``classifier``), ``DistilBertForSequenceClassification`` (``pre_classifier``, ReLU,
  ``classifier``), ``RobertaForSequenceClassification`` (``<s>``: dense, tanh,
  ``out_proj``), with the folder's head when it has one, else a new one.
* ``gpt2`` -> ``gpt.GPT2LMHeadModel`` with ``GPTConfig``: pre-LN, tanh GELU, final
  LayerNorm, tied embeddings, Conv1D layout. Called as ``model(input_ids,
  attention_mask=None)`` -> logits.
* ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``, ``gemma3_text``, the
  mixtures of experts and ``gpt_oss`` -> ``llama.LlamaForCausalLM`` with ``LlamaConfig.from_hf``
  (the ``model_type`` picks its conventions: ``llama_hf_config``). Called as
  ``model(input_ids, attention_mask=None, position_ids=None)`` -> logits. Names are
  transformers' own; a tied model's file holds no ``lm_head.weight``, as transformers
  writes it.
* A multimodal ``gemma3`` folder (``text_config`` + ``vision_config``) -> its language model, the
  same ``gemma3_text`` model (``language_model.model.*`` as transformers saves it, or
  ``model.language_model.*``); the vision tower and projector are left out with one warning that
  counts them. ``save_pretrained`` writes it back as a ``gemma3_text`` folder.
* ``deepseek_v3`` (the same ``LlamaForCausalLM``, with MLA attention and group-limited experts): an FP8
  folder (``quantization_config.quant_method: "fp8"``) is dequantised on load, lazily, as transformers does;
  its multi-token-prediction layers (after ``num_hidden_layers``) are left out with one warning.
  ``save_pretrained(..., quantisation="fp8")`` writes such a folder.
* A folder in Meta's original layout (``consolidated.NN.pth`` + ``params.json``, no ``config.json``)
  -> the same ``llama.LlamaForCausalLM``; ``meta_llama`` renames, joins the model-parallel shards
  and moves ``wq``/``wk``'s rows from Meta's interleaved RoPE to transformers' half split.

The key tables are in ``hf_tables``; the files are read and written tensor by tensor by
``safetensors_io`` (a checkpoint is never held twice on the host; with ``sharding=`` each
tensor goes straight onto its devices). Loading is strict and all or nothing. Torch
pickles are read only with ``torch.load(weights_only=True)``. Folders are written under a
temporary name and swapped in (``files.write_dir``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from flax_transformer.interop import files, meta_llama, safetensors_io, targets
from flax_transformer.interop.converter import convert, pattern
from flax_transformer.interop.hf_tables import (
    ENCODERS,
    LLAMA_TYPES,
    QUANTISATION_CONFIGS,
    check_write_quantisation,
    config_of,
    dequantised,
    hf_to_ours,
    language_model,
    ours_to_hf,
    without_mtp,
)
from flax_transformer.interop.safetensors_io import open_weights, read
from flax_transformer.models.arg_checks import check_positive_float

# bf16 weights against the fp32 model they were rounded from (``port --dtype bf16 --verify``):
# each weight moves by up to 2**-9 of itself, and the outputs of a small random model by
# ~1e-2 (docs/porting.md). The same bf16 weights in two frameworks still agree at 1e-5.
BF16_TOLERANCE = 5e-2

# the files of a folder's tokenizer (transformers' and the tokenizers library's), and its
# generation settings (generation_config.json: the end ids and defaults transformers' ``generate``
# reads, which belong to the same ids): what ``save_pretrained(..., tokenizer_from=FOLDER)``
# copies, and ``flax-transformer port`` carries across
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model", "chat_template.jinja", "generation_config.json")


def read_weights(path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint file or HF folder, read whole, as numpy arrays (bf16 stays bf16).

    Files: ``.safetensors``; ``.bin``/``.pt``/``.pth`` (torch, ``weights_only=True``);
    ``*.index.json`` (sharded, either kind). A folder: the first of ``model.safetensors``,
    ``model.safetensors.index.json``, ``pytorch_model.bin``, ``pytorch_model.bin.index.json``.
    ``open_weights`` gives the same tensors unread (``safetensors_io.Lazy``).
    """
    return {k: read(v) for k, v in open_weights(path).items()}


def read_config(folder) -> dict:
    return files.read_json_object(folder, "config.json")


def read_folder(path, *, classifier: bool = False) -> tuple[dict, str, object, dict]:
    """(config.json, model_type, our config, the folder's tensors unread) of an HF folder.

    A RoBERTa gets a pooler when the folder has one (``RobertaForSequenceClassification``
    folders have none), and never inside a classifier (its head reads ``<s>`` itself). A BERT
    folder without one (``BertForMaskedLM``) gives an encoder without one.
    A config field of the wrong type or value is named with the file.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no such HuggingFace folder: {path}")
    raw = read_config(path)
    try:  # the config is checked before the weights are opened
        kind, config = config_of(raw)
    except ValueError as error:
        raise ValueError(f"{path / 'config.json'}: {error}") from None
    weights = open_weights(path)
    if raw.get("model_type") == "gemma3":
        weights, left_out = language_model(weights)
        if left_out:
            warnings.warn(f"{path}: a multimodal Gemma 3 folder: read its language model (a gemma3_text "
                          f"LlamaForCausalLM) and left out its {len(left_out)} vision tower and projector tensors, "
                          "which a text-only model has no place for", stacklevel=3)
    weights, left_out, layers = without_mtp(raw, weights)
    if left_out:
        warnings.warn(f"{path}: skipped the multi-token-prediction (MTP) module: {len(left_out)} tensors of layer"
                      f"{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))} (num_nextn_predict_layers "
                      f"after the {raw['num_hidden_layers']} layers), which DeepseekV3ForCausalLM does not run "
                      "either", stacklevel=3)
    weights = dequantised(raw, weights)  # FP8 (DeepSeek-V3): float32 weights, lazily
    if kind == "roberta":
        pooler = not classifier and bool({"pooler.dense.weight", "roberta.pooler.dense.weight"} & set(weights))
        config = dataclasses.replace(config, pooler=pooler)
    elif kind == "bert" and not classifier and not {"pooler.dense.weight", "bert.pooler.dense.weight"} & set(weights):
        config = dataclasses.replace(config, pooler=False)  # BertForMaskedLM saves no pooler
    return raw, kind, config, weights


def torch_state(weights: dict) -> dict:
    """numpy arrays (or ``Lazy`` tensors, read here) -> torch tensors for a torch_reference
    ``load_state_dict``, values unchanged.

    Not cast to float32 here: the load checks each value against its parameter (a complex
    value, or one beyond float32's range, is refused there instead of silently changed).
    bfloat16, which torch cannot take from numpy, is widened to float32 exactly.
    """
    import torch

    out = {}
    for key, value in weights.items():
        value = read(value)
        if value.dtype.kind not in "biufc":  # bfloat16 and other ml_dtypes floats
            value = value.astype(np.float32)
        out[key] = torch.from_numpy(np.array(value))  # a writable copy
    return out


# ------------------------------------------------------------------- loading


def _model_class(kind: str, package):
    """The class of ``package`` (``flax_transformer.models`` or ``torch_reference``) that holds a ``model_type``."""
    import importlib

    if kind in ENCODERS:
        return importlib.import_module(f"{package}.encoder").TransformerEncoder
    if kind in LLAMA_TYPES:
        return importlib.import_module(f"{package}.llama").LlamaForCausalLM
    return importlib.import_module(f"{package}.gpt").GPT2LMHeadModel


def is_model_folder(path) -> bool:
    """A folder ``from_pretrained`` reads: an HF folder (``config.json``) or Meta's llama layout (``params.json``,
    ``consolidated.*.pth``)."""
    path = Path(path)
    return path.is_dir() and ((path / "config.json").is_file() or meta_llama.is_meta_folder(path))


def _open_state(path) -> tuple[str, object, dict]:
    """(model_type, our config, tensors under torch_reference's names) of an HF or a Meta llama folder."""
    if meta_llama.is_meta_folder(path):
        config, state = meta_llama.open_folder(path)
        return "llama", config, state
    _, kind, config, weights = read_folder(path)
    return kind, config, hf_to_ours(kind, weights, config)


def from_pretrained(path, *, dtype=jnp.float32, param_dtype=jnp.float32, seed: int = 0, sharding=None):
    """A Flax model (eval mode) with the weights of an HF BERT, DistilBERT, RoBERTa, GPT-2 or llama-family
    (Llama, Mistral, Qwen2, Qwen3, Gemma) folder, or of Meta's original llama layout (``meta_llama``).

    Args:
        dtype, param_dtype: compute and storage types; a bf16 checkpoint loads into
            float32 parameters (exactly) or bf16 ones, and a float32 one into either.
        sharding: where the parameters live: None (the default device), a
            ``jax.sharding.Sharding``, a ``Mesh`` (split over its "fsdp" axis as training
            does) or a function ``(path, shape) -> Sharding``; each tensor is put there
            as it is read (``safetensors_io.fill``).
    """
    kind, config, state = _open_state(path)
    cls = _model_class(kind, "flax_transformer.models")
    model = targets.build_unfilled(cls, dict(config=config, dtype=dtype, param_dtype=param_dtype), seed=seed)
    safetensors_io.fill(model, state, sharding=sharding)
    model.eval()
    return model


def torch_from_pretrained(path):
    """The torch_reference twin (eval mode) with the weights of a folder (any ``from_pretrained`` reads)."""
    kind, config, state = _open_state(path)
    model = _model_class(kind, "torch_reference")(config)
    model.load_state_dict(torch_state(state))
    return model.eval()


def transformers_from_pretrained(path):
    """(transformers' own model of an HF folder, its missing keys): loaded by transformers itself from the
    same files, in float32 and eval mode, as the model ``from_pretrained`` reads: ``AutoModel``
    (``BertModel``, ``DistilBertModel``, ``RobertaModel``; a classifier folder's head is left out),
    ``GPT2LMHeadModel`` or ``AutoModelForCausalLM`` (the llama family). An independent reading of the folder to check this library's against
    (``flax-transformer port --verify``). Its progress bar and load report are kept quiet: the
    missing keys (which transformers initialised at random) are returned instead, but an encoder's
    ``pooler.*``: the callers compare the last hidden state, which it does not touch (a classifier's
    body, RoBERTa's, has none). ImportError without transformers."""
    import torch
    import transformers

    raw = read_config(path)
    kind = raw.get("model_type")
    cls = (transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.AutoModelForCausalLM
           if kind in LLAMA_TYPES or kind == "gemma3" else transformers.AutoModel)
    bar, verbosity = transformers.utils.logging.is_progress_bar_enabled(), transformers.logging.get_verbosity()
    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    try:
        model, info = cls.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bar:
            transformers.utils.logging.enable_progress_bar()
    missing = info.get("missing_keys") or ()
    if cls is transformers.AutoModel:  # a classifier's body has no pooler, which the last hidden state skips
        missing = [key for key in missing if not key.startswith("pooler.")]
    return model.eval(), sorted(missing)


def transformers_output(model, input_ids, attention_mask=None) -> np.ndarray:
    """A transformers model's last hidden state (encoders) or logits (decoders) as numpy, without gradients."""
    import torch

    kwargs = {} if attention_mask is None else {"attention_mask": torch.from_numpy(np.array(attention_mask))}
    with torch.no_grad():
        out = model(torch.from_numpy(np.array(input_ids)), **kwargs)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float().numpy()


def _classifier_state(path, num_labels, pooling, seed):
    """(EncoderConfig, torch_reference-named tensors) of a sequence classifier from an HF folder.

    The head comes from the folder when it has one (a ``*ForSequenceClassification``
    folder, such as ``save_pretrained`` writes), else it is new: N(0, initializer_range)
    weights and zero biases, as transformers initialises it.
    """
    raw, kind, config, weights = read_folder(path, classifier=True)
    if kind not in ENCODERS:
        raise ValueError(f"{path} holds a {raw.get('model_type')!r} model; a sequence classifier needs a BERT, "
                         "DistilBERT or RoBERTa folder")
    spec = ENCODERS[kind]
    head_names = [k for k in weights if any(pattern(row.source).fullmatch(k) for row in spec.classifier_rows)]
    head = convert(spec.classifier_rows, {k: weights.pop(k) for k in head_names}, forward=True, config=config)
    if kind == "roberta":  # a RobertaModel folder's pooler: RobertaForSequenceClassification has none either
        weights = {k: v for k, v in weights.items() if not k.startswith(("pooler.", "roberta.pooler."))}
    id2label = raw.get("id2label")
    if id2label is not None and not isinstance(id2label, dict):
        raise ValueError(f"{path / 'config.json'}: id2label must be a JSON object, got {type(id2label).__name__}")
    if num_labels is None:  # the head's, else the config's labels, else 2
        weight = head.get("classifier.weight")
        num_labels = int(weight.shape[0]) if weight is not None and weight.ndim == 2 else len(id2label or ()) or 2
    config = dataclasses.replace(config, num_labels=num_labels, classifier_pooling=pooling)
    if not head:
        rng = np.random.default_rng(seed)
        try:
            std = check_positive_float("initializer_range", raw.get("initializer_range", 0.02))
        except ValueError as error:
            raise ValueError(f"{path / 'config.json'}: {error}") from None
        layers = {"classifier": config.num_labels}
        if config.classifier_head != "linear":
            layers = {"pre_classifier": config.hidden_size, **layers}
        for name, width in layers.items():
            head[f"{name}.weight"] = rng.normal(0.0, std, (width, config.hidden_size)).astype(np.float32)
            head[f"{name}.bias"] = np.zeros(width, np.float32)
    ours = {f"encoder.{k}": v for k, v in hf_to_ours(kind, weights, config).items()}
    return config, {**ours, **head}  # a half head or a wrong shape is named by the strict load


def classifier_from_pretrained(path, *, num_labels: int | None = None, pooling: str = "cls",
                               dtype=jnp.float32, param_dtype=jnp.float32, seed: int = 0, sharding=None):
    """A Flax ``encoder.TransformerForSequenceClassification`` (eval mode) on an HF BERT, DistilBERT
    or RoBERTa folder.

    Args:
        path: a base-model or ``*ForSequenceClassification`` folder.
        num_labels: classes; default the folder's head's, else its ``id2label``'s, else 2.
        pooling: "cls" (the first token: transformers' classifiers) or "mean".
        seed: for a new head's initialisation (and the model's dropout stream).
        sharding: as for ``from_pretrained``.
    """
    from flax_transformer.models import encoder

    config, state = _classifier_state(path, num_labels, pooling, seed)
    model = targets.build_unfilled(encoder.TransformerForSequenceClassification,
                                   dict(config=config, dtype=dtype, param_dtype=param_dtype), seed=seed)
    safetensors_io.fill(model, state, sharding=sharding)
    model.eval()
    return model


def torch_classifier_from_pretrained(path, *, num_labels: int | None = None, pooling: str = "cls", seed: int = 0):
    """The torch_reference twin of ``classifier_from_pretrained`` (eval mode), with the same new head."""
    from torch_reference import encoder

    config, state = _classifier_state(path, num_labels, pooling, seed)
    model = encoder.TransformerForSequenceClassification(config)
    model.load_state_dict(torch_state(state))
    return model.eval()


# ------------------------------------------------------------------- saving


def kind_of(model) -> tuple[str, object, bool]:
    """(model_type, config, is a sequence classifier) of a model ``save_pretrained`` writes."""
    name, module = type(model).__name__, type(model).__module__
    if name in ("TransformerEncoder", "TransformerForSequenceClassification") and module.endswith(".encoder"):
        config = model.init_kwargs()["config"]
        if config.hf_model_type is None:
            config.to_hf_dict()  # raises, naming the options transformers has no equivalent for
        return config.hf_model_type, config, name != "TransformerEncoder"
    if name == "GPT2LMHeadModel":
        return "gpt2", model.init_kwargs()["config"], False
    if name == "LlamaForCausalLM" and module.endswith(".llama"):
        config = model.init_kwargs()["config"]
        return config.model_type, config, False
    raise ValueError(f"save_pretrained writes encoder.TransformerEncoder (BERT, DistilBERT, RoBERTa), "
                     f"TransformerForSequenceClassification on them, gpt.GPT2LMHeadModel and llama.LlamaForCausalLM, "
                     f"not {name}; use checkpoints.save_safetensors or save_orbax for the others")


def can_save(model) -> bool:
    """True for the models ``save_pretrained`` writes as a transformers model folder."""
    try:
        kind_of(model)
    except ValueError:
        return False
    return True


def _classifier_config(kind: str, config, labels) -> dict:
    """The ``*ForSequenceClassification`` config.json of a classifier, refused where transformers' head differs."""
    head = {"bert": "linear", "distilbert": "relu", "roberta": "tanh"}[kind]
    if config.classifier_pooling != "cls" or config.classifier_head != head or (kind == "roberta" and config.pooler):
        raise ValueError(f"transformers' {ENCODERS[kind].classifier} reads the first token through "
                         f"{'the pooler and ' if kind == 'bert' else ''}a {head!r} head; this classifier "
                         f"(classifier_pooling={config.classifier_pooling!r}, classifier_head="
                         f"{config.classifier_head!r}, pooler={config.pooler}) has no transformers equivalent")
    names = list(labels) if labels is not None else [f"LABEL_{i}" for i in range(config.num_labels)]
    if len(names) != config.num_labels:
        raise ValueError(f"{len(names)} labels for a classifier of {config.num_labels} classes")
    return {**config.to_hf_dict(), "architectures": [ENCODERS[kind].classifier],
            "id2label": {str(i): n for i, n in enumerate(names)}, "label2id": {n: i for i, n in enumerate(names)}}


def save_dtype(dtype):
    if dtype is None:
        return None
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be a floating-point dtype such as jnp.bfloat16, got {dtype!r}") from None
    if dtype.name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype.name}")
    return dtype


def save_pretrained(model, path, *, overwrite: bool = False, tokenizer=None, tokenizer_from=None,
                    labels=None, max_shard_size=None, dtype=None, quantisation: str | None = None,
                    before_swap: files.BeforeSwap | None = None) -> Path:
    """Write ``config.json`` + safetensors weights that transformers loads with no missing or
    unexpected keys: ``BertModel``, ``DistilBertModel``, ``RobertaModel``, their
    ``*ForSequenceClassification``, ``GPT2LMHeadModel``, or the ``LlamaForCausalLM``,
    ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or ``GemmaForCausalLM`` of a
    ``LlamaConfig``'s ``model_type`` (``LlamaConfig.to_hf_dict``: the RoPE settings under
    ``rope_parameters`` and, for older readers, ``rope_scaling`` and ``rope_theta``).

    Args:
        model: a Flax or torch_reference ``TransformerEncoder`` / ``TransformerForSequenceClassification``
            (``EncoderConfig.bert``/``.distilbert``/``.roberta``; first-token pooling), ``GPT2LMHeadModel``
            or ``llama.LlamaForCausalLM``.
        tokenizer: a ``tokenizers.Tokenizer`` to write as ``tokenizer.json``, so that
            ``AutoTokenizer.from_pretrained(path)`` loads it.
        tokenizer_from: a folder whose tokenizer files (``TOKENIZER_FILES``: ``tokenizer.json``,
            ``tokenizer_config.json``, ``special_tokens_map.json``, ``vocab.txt``, ...) are
            copied alongside (the checkpoint the model came from); ``tokenizer`` replaces its
            ``tokenizer.json``.
        labels: class names, written as the config's ``id2label`` / ``label2id``.
        max_shard_size: bytes (or "500MB", "2GB", as transformers): shards
            ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` when
            the weights need more than one.
        dtype: the stored dtype (``jnp.bfloat16``, ``jnp.float16``, ``jnp.float32``);
            default each parameter's own. Written as the config's ``dtype``, so transformers
            loads a bf16 folder as bf16.
        quantisation: None (the default: plain tensors, also for a model read from a quantised folder),
            ``"mxfp4"`` (GPT-OSS: the experts' weights as ``*_blocks`` + ``*_scales`` with the
            released folders' ``quantization_config``; lossy for weights MXFP4 cannot hold) or ``"fp8"``
            (DeepSeek-V3: every linear layer but the router and ``lm_head`` as a float8_e4m3fn ``weight`` and a
            float32 ``weight_scale_inv`` per 128 x 128 tile, as the released folders; lossy but for weights
            read from such a folder).
        before_swap: see ``files.write_dir``; ``verification.export.save_pretrained`` writes the
            folder with its verification certificate this way.

    Tensors are written one at a time as they are read off the model (``safetensors_io``).
    The folder is written under a temporary name next to ``path`` and swapped in at the end
    (``files.write_dir``), so a failure leaves no trace and an old folder as it was. An
    existing empty folder is written into; a non-empty one is replaced only with
    ``overwrite=True``.
    """
    path = files.check_target(path, kind="dir", overwrite=overwrite)
    kind, config, classifier = kind_of(model)
    check_write_quantisation("classifier" if classifier else kind, quantisation)
    dtype = save_dtype(dtype)
    if max_shard_size is not None:
        safetensors_io.parse_size(max_shard_size)  # a bad size fails before anything is written
    hf_config = (_classifier_config(kind, config, labels) if classifier
                 else config.to_hf_dict())
    state = safetensors_io.model_tensors(model)  # torch_reference names, unread
    if (kind == "gpt2" or kind in LLAMA_TYPES) and config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor, written once under the embedding's name, as transformers does
    if classifier:
        spec = ENCODERS[kind]
        body = {k[len("encoder."):]: v for k, v in state.items() if k.startswith("encoder.")}
        weights = {f"{spec.prefix}{k}": v for k, v in ours_to_hf(kind, body, config).items()}
        weights |= convert(spec.classifier_rows, {k: v for k, v in state.items() if not k.startswith("encoder.")},
                           forward=False, format_name="HuggingFace")
    else:
        weights = ours_to_hf(kind, state, config, quantisation=quantisation)
    if quantisation is not None:
        hf_config["quantization_config"] = dict(QUANTISATION_CONFIGS[quantisation])
    if dtype is not None:  # an FP8 folder's scales stay float32, its float8 weights float8
        hf_config["dtype"] = dtype.name
        weights = {k: v.astype(dtype) if (np.issubdtype(np.dtype(v.dtype), np.floating)
                   or v.dtype.name == "bfloat16") and not k.endswith("weight_scale_inv") else v
                   for k, v in weights.items()}

    def write(tmp: Path):
        safetensors_io.write_checkpoint(weights, tmp, max_shard_size=max_shard_size, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_from) / name).is_file():
                    shutil.copyfile(Path(tokenizer_from) / name, tmp / name)
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer.json"))
    return files.write_dir(path, write, overwrite=overwrite, before_swap=before_swap)
