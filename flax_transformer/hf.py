"""HuggingFace checkpoints <-> flax_transformer (and torch_reference): BERT and GPT-2.

    model = hf.from_pretrained("path/to/folder")        # config.json + weights -> Flax model
    hf.save_pretrained(model, "path/to/new_folder")       # -> a folder transformers loads

A folder holds ``config.json`` and ``model.safetensors``, or ``pytorch_model.bin``, or
a sharded ``*.index.json`` with its shards. ``model_type`` picks the family:

* ``bert`` -> ``encoder.TransformerEncoder`` with ``EncoderConfig.bert``: post-LN,
  token-type embeddings, pooler, the config's eps, its GELU. Called as
  ``model(input_ids, attention_mask=None, token_type_ids=None)`` -> last hidden state;
  ``model.pool(hidden)`` is BERT's pooler output. HF's fused-per-projection q/k/v
  weights (hidden, hidden) are split into the notebook's per-head layout.
* ``classifier_from_pretrained`` -> ``encoder.TransformerForSequenceClassification``
  over that BERT (``BertForSequenceClassification``: [CLS] through the pooler, or mean
  pooling), with the folder's ``classifier.*`` head when it has one, else a new one.
* ``gpt2`` -> ``gpt.GPT2LMHeadModel`` with ``GPTConfig``: pre-LN, tanh GELU, final
  LayerNorm, tied embeddings, Conv1D layout. Called as ``model(input_ids,
  attention_mask=None)`` -> logits.

Each family has one declarative key table (HF name pattern -> our torch_reference
name, plus a layout rule); loading goes through ``porting.load_state_dict``, so it is
strict and all or nothing. Torch pickles are read only with
``torch.load(weights_only=True)``. Files are written to a temporary path and renamed.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from . import files, porting
from ._shared import check_positive_float
from .configs import EncoderConfig, GPTConfig

# ------------------------------------------------------------------ key tables
# (HF name, our torch_reference name, rule), both sides templates whose {fields}
# match the PLACEHOLDERS below, so one table serves both directions. Rules: "as_is";
# "split_heads": an HF (hidden, hidden) weight or (hidden,) bias is one slice per head
# on our side, ``{h}`` in our name (the notebook's AttentionHead layout).

AS_IS, SPLIT_HEADS = "as_is", "split_heads"

PLACEHOLDERS = {"i": r"\d+", "h": r"\d+", "p": "weight|bias", "emb": "wte|wpe", "ln": "ln_1|ln_2",
                "conv": r"attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj"}

BERT_KEYS = [
    ("embeddings.word_embeddings.weight", "embeddings.token_embeddings.weight", AS_IS),
    ("embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight", AS_IS),
    ("embeddings.token_type_embeddings.weight", "embeddings.token_type_embeddings.weight", AS_IS),
    ("embeddings.LayerNorm.{p}", "embeddings.layer_norm.{p}", AS_IS),
    ("encoder.layer.{i}.attention.self.query.{p}", "layers.{i}.attention.heads.{h}.q.{p}", SPLIT_HEADS),
    ("encoder.layer.{i}.attention.self.key.{p}", "layers.{i}.attention.heads.{h}.k.{p}", SPLIT_HEADS),
    ("encoder.layer.{i}.attention.self.value.{p}", "layers.{i}.attention.heads.{h}.v.{p}", SPLIT_HEADS),
    ("encoder.layer.{i}.attention.output.dense.{p}", "layers.{i}.attention.output_linear.{p}", AS_IS),
    ("encoder.layer.{i}.attention.output.LayerNorm.{p}", "layers.{i}.layer_norm_1.{p}", AS_IS),
    ("encoder.layer.{i}.intermediate.dense.{p}", "layers.{i}.feed_forward.linear_1.{p}", AS_IS),
    ("encoder.layer.{i}.output.dense.{p}", "layers.{i}.feed_forward.linear_2.{p}", AS_IS),
    ("encoder.layer.{i}.output.LayerNorm.{p}", "layers.{i}.layer_norm_2.{p}", AS_IS),
    ("pooler.dense.{p}", "pooler.{p}", AS_IS),
]
BERT_BUFFERS = [r"embeddings\.position_ids"]  # not parameters
BERT_HEADS = ("cls.", "classifier.", "qa_outputs.")  # task heads a BertModel does not have

GPT2_KEYS = [
    ("transformer.{emb}.weight", "transformer.{emb}.weight", AS_IS),
    ("transformer.h.{i}.{ln}.{p}", "transformer.h.{i}.{ln}.{p}", AS_IS),
    ("transformer.ln_f.{p}", "transformer.ln_f.{p}", AS_IS),
    ("transformer.h.{i}.{conv}.weight", "transformer.h.{i}.{conv}.matrix", AS_IS),  # Conv1D: (in, out) both
    ("transformer.h.{i}.{conv}.bias", "transformer.h.{i}.{conv}.bias", AS_IS),
    ("lm_head.weight", "lm_head.weight", AS_IS),  # only when the head is not tied
]
GPT2_BUFFERS = [r"transformer\.h\.\d+\.attn\.(bias|masked_bias)"]  # old causal-mask buffers


def _pattern(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)  # literal, field, literal, field, ...
    regex = "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>{PLACEHOLDERS[part]})"
                    for i, part in enumerate(parts))
    return re.compile(regex)


def _convert(table, state: dict, *, forward: bool, heads: int | None = None) -> dict:
    """Rename (and split or join heads) by the table, HF -> ours if ``forward``, else back."""
    out, joins = {}, {}
    for key, value in state.items():
        for hf_name, our_name, rule in table:
            match = _pattern(hf_name if forward else our_name).fullmatch(key)
            if not match:
                continue
            fields = match.groupdict()
            if forward and rule == SPLIT_HEADS:
                if np.ndim(value) == 0 or np.shape(value)[0] % heads:
                    raise porting.StateDictError(mismatched=[(key, tuple(np.shape(value)),
                                                              f"(a multiple of num_attention_heads={heads}, ...)")])
                for h, part in enumerate(np.split(value, heads, axis=0)):
                    out[our_name.format(**fields, h=h)] = part
            elif not forward and rule == SPLIT_HEADS:
                joins.setdefault(hf_name.format(**fields), {})[int(fields["h"])] = value
            else:
                out[(our_name if forward else hf_name).format(**fields)] = value
            break
        else:
            if not forward:
                raise ValueError(f"{key}: no HuggingFace name for it in the key table")
            out[key] = value  # unknown: kept, so that the strict load names it
    for hf_key, parts in joins.items():
        out[hf_key] = np.concatenate([parts[h] for h in sorted(parts)], axis=0)
    return out


# ------------------------------------------------------------------ reading files


def _safetensors(file: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(file))
    except SafetensorError as error:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupted?): {error}") from None


def _torch_pickle(file: Path) -> dict[str, np.ndarray]:
    import pickle

    import torch

    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"refusing to load {file}: torch.load(weights_only=True) rejected it, so unpickling it would run "
            f"code from the file. Convert it to safetensors where you trust it. ({str(error).splitlines()[0]})"
        ) from None
    except Exception as error:  # a corrupted pickle fails in many ways (KeyError, IndexError, EOFError...)
        raise ValueError(f"{file} is not a readable torch checkpoint (truncated or corrupted?): "
                         f"{type(error).__name__}: {error}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{file} does not hold a state_dict (a mapping of names to tensors)")
    return {k: porting._to_numpy(v) for k, v in state.items()}


def read_weights(path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint file or HF folder, as numpy arrays (bf16 stays bf16).

    Files: ``.safetensors``; ``.bin``/``.pt``/``.pth`` (torch, ``weights_only=True``);
    ``*.index.json`` (sharded, either kind). A folder: the first of
    ``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
    ``pytorch_model.bin.index.json``.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint: {path}")
    if path.is_dir():
        for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                     "pytorch_model.bin.index.json"):
            if (path / name).is_file():
                return read_weights(path / name)
        raise FileNotFoundError(f"{path} holds no weights (model.safetensors, pytorch_model.bin or a sharded index)")
    if path.name.endswith(".index.json"):
        weight_map = _read_index(path)
        out = {}
        for shard in sorted(set(weight_map.values())):
            part = read_weights(path.parent / shard)
            out.update({k: v for k, v in part.items() if weight_map.get(k) == shard})
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise ValueError(f"{path} lists tensors its shards do not hold: {', '.join(missing[:10])}")
        return out
    if path.suffix == ".safetensors":
        return _safetensors(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        return _torch_pickle(path)
    raise ValueError(f"unknown checkpoint format: {path} (expected .safetensors, .bin/.pt/.pth or *.index.json)")


def _read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded-checkpoint index: tensor name -> shard file in the same folder."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a sharded-checkpoint index (not valid JSON: {error})") from None
    if not isinstance(index, dict) or "weight_map" not in index:
        raise ValueError(f"{path} is not a sharded-checkpoint index (a JSON object with a 'weight_map')")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{path}: 'weight_map' must map tensor names to shard file names, "
                         f"got {type(weight_map).__name__}")
    for shard in set(weight_map.values()):
        # a shard lies in the index's folder: no absolute path, no '..'
        if not shard or "\\" in shard or "\x00" in shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise ValueError(f"{path}: shard {shard!r} is not a file name in the index's own folder")
        if Path(shard).suffix not in (".safetensors", ".bin", ".pt", ".pth"):
            raise ValueError(f"{path}: shard {shard!r} is not a .safetensors or torch (.bin/.pt/.pth) file")
        if not (path.parent / shard).is_file():
            raise FileNotFoundError(f"{path}: shard {shard!r} does not exist in {path.parent}")
    return weight_map


def read_config(folder) -> dict:
    file = Path(folder) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, not a {type(config).__name__}")
    return config


# --------------------------------------------------------------- key conversion


def _family(config: dict):
    model_type = config.get("model_type")
    if model_type == "bert":
        return "bert", EncoderConfig.bert(config)
    if model_type == "gpt2":
        return "gpt2", GPTConfig.from_any(config)
    raise ValueError(f"unsupported model_type {model_type!r}: flax_transformer.hf reads 'bert' and 'gpt2'")


def _read_family(folder) -> tuple[dict, str, object]:
    """(config.json as read, family, config); a field of the wrong type or value is named with the file."""
    raw = read_config(folder)
    try:
        kind, config = _family(raw)
    except ValueError as error:
        raise ValueError(f"{Path(folder) / 'config.json'}: {error}") from None
    return raw, kind, config


def _normalise_hf_names(kind: str, weights: dict) -> dict:
    """Drop buffers and wrapper prefixes: ``bert.`` (BertFor*), ``transformer.`` (GPT2Model has none)."""
    out = {}
    for key, value in weights.items():
        if kind == "bert":
            key = key[len("bert."):] if key.startswith("bert.") else key
            if any(re.fullmatch(p, key) for p in BERT_BUFFERS):
                continue
        else:
            if not key.startswith(("transformer.", "lm_head.")):
                key = "transformer." + key
            if any(re.fullmatch(p, key) for p in GPT2_BUFFERS):
                continue
        out[key] = value
    return out


def hf_to_ours(kind: str, weights: dict, config) -> dict[str, np.ndarray]:
    """HF tensor names and layouts -> torch_reference names (the ``porting.state_dict`` layout).

    Unknown keys are kept as they are, so that the strict load reports them.
    """
    weights = _normalise_hf_names(kind, weights)
    if kind == "bert":
        dropped = sorted(k for k in weights if k.startswith(BERT_HEADS))
        if dropped:
            warnings.warn(f"ignoring {len(dropped)} task-head tensors a BertModel does not have: {dropped[:4]}",
                          stacklevel=2)
        weights = {k: v for k, v in weights.items() if not k.startswith(BERT_HEADS)}
        return _convert(BERT_KEYS, weights, forward=True, heads=config.num_attention_heads)
    if config.tie_word_embeddings and "lm_head.weight" in weights:
        tied = weights.pop("lm_head.weight")
        wte = weights.get("transformer.wte.weight")
        if wte is not None and (tied.shape != wte.shape or not np.array_equal(tied, wte)):
            raise ValueError("lm_head.weight differs from transformer.wte.weight but the config ties them")
    return _convert(GPT2_KEYS, weights, forward=True)


def ours_to_hf(kind: str, state: dict) -> dict[str, np.ndarray]:
    """torch_reference names -> HF names and layouts (the inverse of ``hf_to_ours``)."""
    return _convert(BERT_KEYS if kind == "bert" else GPT2_KEYS, state, forward=False)


# ------------------------------------------------------------------- public API


def from_pretrained(path, *, dtype=jnp.float32, param_dtype=jnp.float32, seed: int = 0):
    """A Flax model (eval mode) with the weights of an HF BERT or GPT-2 folder."""
    from . import encoder, gpt

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no such HuggingFace folder: {path}")
    _, kind, config = _read_family(path)
    cls = encoder.TransformerEncoder if kind == "bert" else gpt.GPT2LMHeadModel
    weights = hf_to_ours(kind, read_weights(path), config)
    model = porting.build_unfilled(cls, dict(config=config, dtype=dtype, param_dtype=param_dtype), seed=seed)
    porting.load_state_dict(model, weights, strict=True)
    model.eval()
    return model


def torch_state(weights: dict) -> dict:
    """numpy arrays -> torch tensors for a torch_reference ``load_state_dict``, values unchanged.

    Not cast to float32 here: the load checks each value against its parameter (a complex
    value, or one beyond float32's range, is refused there instead of silently changed).
    bfloat16, which torch cannot take from numpy, is widened to float32 exactly.
    """
    import torch

    out = {}
    for key, value in weights.items():
        value = np.asarray(value)
        if value.dtype.kind not in "biufc":  # bfloat16 and other ml_dtypes floats
            value = value.astype(np.float32)
        out[key] = torch.from_numpy(np.array(value))  # a writable copy
    return out


def torch_from_pretrained(path):
    """The torch_reference twin (eval mode) with the weights of an HF BERT or GPT-2 folder."""
    from torch_reference import encoder, gpt

    _, kind, config = _read_family(path)
    cls = encoder.TransformerEncoder if kind == "bert" else gpt.GPT2LMHeadModel
    model = cls(config)
    weights = hf_to_ours(kind, read_weights(path), config)
    model.load_state_dict(torch_state(weights))
    return model.eval()


CLASSIFIER_KEYS = ("classifier.weight", "classifier.bias")


def _classifier_weights(path, num_labels, pooling, seed):
    """(EncoderConfig, torch_reference-named weights) of a BERT classifier from an HF folder.

    The head comes from the folder's ``classifier.*`` when it has one (a
    ``BertForSequenceClassification`` folder, such as ``save_pretrained`` writes), else it
    is new: N(0, initializer_range) weights and zero biases, as transformers initialises it.
    """
    raw, kind, config = _read_family(path)
    if kind != "bert":
        raise ValueError(f"{path} holds a {raw.get('model_type')!r} model; a sequence classifier needs a BERT folder "
                         "(model_type 'bert')")
    weights = dict(read_weights(path))
    head = {k: weights.pop(k) for k in CLASSIFIER_KEYS if k in weights}
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
        head = {"classifier.weight": rng.normal(0.0, std, (config.num_labels, config.hidden_size)).astype(np.float32),
                "classifier.bias": np.zeros(config.num_labels, np.float32)}
    ours = {f"encoder.{k}": v for k, v in hf_to_ours("bert", weights, config).items()}
    return config, {**ours, **head}  # a half head or a wrong shape is named by the strict load


def classifier_from_pretrained(path, *, num_labels: int | None = None, pooling: str = "cls",
                               dtype=jnp.float32, param_dtype=jnp.float32, seed: int = 0):
    """A Flax ``encoder.TransformerForSequenceClassification`` (eval mode) on an HF BERT folder.

    Args:
        path: a ``BertModel`` or ``BertForSequenceClassification`` folder.
        num_labels: classes; default the folder's head's, else its ``id2label``'s, else 2.
        pooling: "cls" ([CLS] through the pooler: ``BertForSequenceClassification``) or "mean".
        seed: for a new head's initialisation (and the model's dropout stream).
    """
    from . import encoder

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no such HuggingFace folder: {path}")
    config, weights = _classifier_weights(path, num_labels, pooling, seed)
    model = porting.build_unfilled(encoder.TransformerForSequenceClassification,
                                   dict(config=config, dtype=dtype, param_dtype=param_dtype), seed=seed)
    porting.load_state_dict(model, weights, strict=True)
    model.eval()
    return model


def torch_classifier_from_pretrained(path, *, num_labels: int | None = None, pooling: str = "cls", seed: int = 0):
    """The torch_reference twin of ``classifier_from_pretrained`` (eval mode), with the same new head."""
    from torch_reference import encoder

    config, weights = _classifier_weights(Path(path), num_labels, pooling, seed)
    model = encoder.TransformerForSequenceClassification(config)
    model.load_state_dict(torch_state(weights))
    return model.eval()


def can_save(model) -> bool:
    """True for the models ``save_pretrained`` writes as a transformers model folder (BERT, GPT-2)."""
    try:
        return _kind_of(model)[0] in ("bert", "gpt2")
    except ValueError:
        return False


def _kind_of(model) -> tuple[str, object]:
    name = type(model).__name__
    if name == "TransformerEncoder" and type(model).__module__.endswith("encoder"):
        config = model.init_kwargs()["config"]
        return "bert", config
    if name == "TransformerForSequenceClassification" and type(model).__module__.endswith("encoder"):
        return "bert-classifier", model.init_kwargs()["config"]
    if name == "GPT2LMHeadModel":
        return "gpt2", model.init_kwargs()["config"]
    raise ValueError(f"save_pretrained writes encoder.TransformerEncoder (BERT) and gpt.GPT2LMHeadModel, not {name}; "
                     "use checkpoints.save_safetensors or save_orbax for the others")


def save_pretrained(model, path, *, overwrite: bool = False, tokenizer=None, tokenizer_from=None,
                    labels=None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that transformers loads with no missing or
    unexpected keys: ``BertModel``, ``BertForSequenceClassification`` or ``GPT2LMHeadModel``.

    Args:
        model: a Flax or torch_reference ``TransformerEncoder`` / ``TransformerForSequenceClassification``
            (BERT-style: ``EncoderConfig.bert``; [CLS] pooling) or ``GPT2LMHeadModel``.
        tokenizer: a ``tokenizers.Tokenizer`` to write as ``tokenizer.json``, so that
            ``AutoTokenizer.from_pretrained(path)`` loads it.
        tokenizer_from: a folder whose ``tokenizer_config.json``, ``special_tokens_map.json``
            and ``vocab.txt`` are copied alongside (the checkpoint the model came from).
        labels: class names, written as the config's ``id2label`` / ``label2id``.

    The folder is written under a temporary name next to ``path`` and swapped in at the end
    (``files.write_dir``), so a failure leaves no trace and an old folder as it was. An
    existing empty folder is written into; a non-empty one is replaced only with
    ``overwrite=True``.
    """
    path = files.check_target(path, kind="dir", overwrite=overwrite)
    kind, config = _kind_of(model)
    if kind == "bert-classifier":
        if config.classifier_pooling != "cls" or not config.pooler or config.norm_first:
            raise ValueError("transformers' BertForSequenceClassification classifies [CLS] through the pooler of a "
                             "post-LN BERT; this classifier (classifier_pooling="
                             f"{config.classifier_pooling!r}, pooler={config.pooler}, norm_first={config.norm_first}) "
                             "has no transformers equivalent")
        hf_config = {**config.to_bert_dict(), "architectures": ["BertForSequenceClassification"]}
        names = list(labels) if labels is not None else [f"LABEL_{i}" for i in range(config.num_labels)]
        if len(names) != config.num_labels:
            raise ValueError(f"{len(names)} labels for a classifier of {config.num_labels} classes")
        hf_config |= {"id2label": {str(i): n for i, n in enumerate(names)},
                      "label2id": {n: i for i, n in enumerate(names)}}
    else:
        hf_config = config.to_bert_dict() if kind == "bert" else config.to_hf_dict()
    if type(model).__module__.startswith("torch_reference"):
        state = {k: porting._to_numpy(v) for k, v in model.state_dict().items()}
    else:
        state = porting.state_dict(model)
    if kind == "gpt2" and config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if kind == "bert-classifier":
        body = {k[len("encoder."):]: v for k, v in state.items() if k.startswith("encoder.")}
        weights = {f"bert.{k}": v for k, v in ours_to_hf("bert", body).items()}
        weights |= {k: v for k, v in state.items() if k in CLASSIFIER_KEYS}
    else:
        weights = ours_to_hf(kind, state)
    weights = {k: np.ascontiguousarray(v) for k, v in weights.items()}

    def write(tmp: Path):
        files.save_safetensors_file(weights, tmp / "model.safetensors", {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if tokenizer_from is not None:
            for name in ("tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
                if (Path(tokenizer_from) / name).is_file():
                    shutil.copyfile(Path(tokenizer_from) / name, tmp / name)
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer.json"))
    return files.write_dir(path, write, overwrite=overwrite)
