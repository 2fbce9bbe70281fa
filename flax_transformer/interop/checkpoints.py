"""Flax weights on disk: safetensors with torch names, and orbax checkpoints.

Both carry what is needed to rebuild the model: its family, class and constructor
arguments (``model.init_kwargs()``), as JSON in the safetensors header or in a
``flax_transformer.json`` beside the orbax files. So

    save_safetensors(model, "m.safetensors");  model = load("m.safetensors")

works for any flax_transformer (or torch_reference) model, and a torch user can read
the same file with ``safetensors.torch.load_file`` and ``load_state_dict``: the names
and layouts are torch's (``porting.state_dict``). Every writer goes through ``files``:
the whole output is written under a temporary name and swapped in, an existing output
is replaced only with ``overwrite=True``, and a failure leaves the old one as it was.

These writers write bytes and do not judge them: the certified exports (the same files with
the verification certificate that they were checked in torch) are ``verification.export``'s,
which call these with a ``before_swap`` hook (``files.BeforeSwap``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop import files, orbax_quiet, porting, targets, values
from flax_transformer.models import configs
from flax_transformer.models.llama_config import LlamaConfig

METADATA_KEY = "flax_transformer"


# ------------------------------------------------------------ model descriptions


def _to_json(value):
    if dataclasses.is_dataclass(value):
        return {"__config__": type(value).__name__, **dataclasses.asdict(value)}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "__dict__") or isinstance(value, dict):  # a duck-typed config
        items = value if isinstance(value, dict) else vars(value)
        return {k: _to_json(v) for k, v in items.items() if not k.startswith("_")}
    raise TypeError(f"cannot describe constructor argument {value!r} in JSON")


# What a description may name, and so what reading a file may construct: the model
# classes of each family (the same names in flax_transformer and torch_reference) and
# the config types. A name read from a file is only ever looked up in these tables.
MODEL_CLASSES: dict[str, tuple[str, ...]] = {
    "former": ("MHSelfAttention", "SelfAttention", "TransformerBlock", "CTransformer", "GTransformer"),
    "encoder": ("AttentionHead", "MultiHeadAttention", "FeedForward", "TransformerEncoderLayer", "Embeddings",
                "TransformerEncoder", "TransformerForSequenceClassification"),
    "gpt": ("Embeddings", "Linear", "LayerNorm", "FeedForward", "Attention", "TransformerLayer", "GPTAttention",
            "GPTTransformerLayer", "GPTMHAttention", "GPTMHTransformerLayer", "GPTTransformer", "GPT2Attention",
            "GPT2MLP", "GPT2Block", "GPT2Model", "GPT2LMHeadModel"),
    "classic": ("ScaledDotProductAttention", "AttentionHead", "MultiHeadAttention", "PositionalEmbedding",
                "EncoderBlock", "TransformerEncoder", "DecoderBlock", "TransformerDecoder", "Transformer"),
    "llama": ("LlamaRMSNorm", "LlamaRotaryEmbedding", "LlamaMLP", "LlamaSparseMoeBlock", "LlamaAttention",
              "DeepseekV3Attention", "LlamaDecoderLayer", "LlamaModel", "LlamaForCausalLM"),
}
CONFIG_TYPES = {"EncoderConfig": configs.EncoderConfig, "GPTConfig": configs.GPTConfig, "LlamaConfig": LlamaConfig}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _model_class(family, name, framework: str):
    """The class ``family.name`` of flax_transformer (``framework="flax"``) or torch_reference, from the table."""
    if not isinstance(family, str) or family not in MODEL_CLASSES:
        raise ValueError(f"unknown family {family!r} (families: {', '.join(MODEL_CLASSES)})")
    if not isinstance(name, str) or name not in MODEL_CLASSES[family]:
        raise ValueError(f"{name!r} is not a {family} model class (classes: {', '.join(MODEL_CLASSES[family])})")
    module = importlib.import_module(f"{'flax_transformer.models' if framework == 'flax' else 'torch_reference'}.{family}")
    return {allowed: getattr(module, allowed) for allowed in MODEL_CLASSES[family]}[name]


def _from_json(value):
    if isinstance(value, dict) and "__config__" in value:
        name = value["__config__"]
        if not isinstance(name, str) or name not in CONFIG_TYPES:
            raise ValueError(f"unknown config type {name!r} (config types: {', '.join(CONFIG_TYPES)})")
        return CONFIG_TYPES[name](**{k: v for k, v in value.items() if k != "__config__"})
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def describe(model) -> dict:
    """{"family", "class", "init_kwargs"} of a flax_transformer or torch_reference model."""
    family = porting.family_of(model)
    kwargs = {k: v for k, v in model.init_kwargs().items() if k not in ("dtype", "param_dtype")}
    return {"family": family, "class": type(model).__name__, "init_kwargs": _to_json(kwargs)}


def build(description: dict, *, framework: str = "flax", dtype=jnp.float32, param_dtype=jnp.float32, seed=0):
    """An (unfilled, for Flax) model of the described family/class/arguments."""
    if not isinstance(description, dict) or not isinstance(description.get("init_kwargs"), dict):
        raise ValueError("not a model description (a JSON object with family, class and an init_kwargs object): "
                         f"{_short(description)}")
    try:
        family, name = description["family"], description["class"]
        kwargs = {k: _from_json(v) for k, v in description["init_kwargs"].items()}
    except (KeyError, TypeError) as error:
        raise ValueError(f"not a model description: {_short(description)} ({error})") from None
    if framework not in ("flax", "torch"):
        raise ValueError(f"framework must be 'flax' or 'torch', got {framework!r}")
    cls = _model_class(family, name, framework)
    try:
        if framework == "flax":
            return targets.build_unfilled(cls, dict(kwargs, dtype=dtype, param_dtype=param_dtype), seed=seed)
        return cls(**kwargs)
    except TypeError as error:  # wrong constructor arguments
        raise ValueError(f"cannot build {family}.{name} from {kwargs}: {error}") from None


# ------------------------------------------------------------------- writing


def _state(model) -> dict[str, np.ndarray]:
    if type(model).__module__.startswith("torch_reference"):
        return {k: values.to_numpy(v) for k, v in model.state_dict().items()}
    return porting.state_dict(model)


def save_safetensors(model, path, *, overwrite: bool = False, before_swap: files.BeforeSwap | None = None) -> Path:
    """Weights under torch names and layouts, plus the model description in the header.

    An existing ``path`` is replaced only with ``overwrite=True`` (``files.OutputError`` otherwise).
    ``before_swap``: see ``files.write_file`` (``verification.export.save_safetensors`` certifies)."""
    files.check_target(path, kind="file", overwrite=overwrite)
    state = {k: np.ascontiguousarray(v) for k, v in _state(model).items()}
    metadata = {"format": "pt", METADATA_KEY: json.dumps(describe(model))}
    return files.write_file(path, lambda tmp: files.save_safetensors_file(state, tmp, metadata),
                            overwrite=overwrite, before_swap=before_swap)


def save_torch(model, path, *, overwrite: bool = False, before_swap: files.BeforeSwap | None = None) -> Path:
    """A plain torch ``state_dict`` file (``torch.save``), for ``load_state_dict``. It does not say
    which model it holds; its certificate does (``verification.export.save_torch``)."""
    import torch

    files.check_target(path, kind="file", overwrite=overwrite)
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in _state(model).items()}
    return files.write_file(path, lambda tmp: files.save_torch_file(state, tmp), overwrite=overwrite,
                            before_swap=before_swap)


def save_orbax(model, path, *, overwrite: bool = False, before_swap: files.BeforeSwap | None = None) -> Path:
    """An orbax checkpoint of the parameters, with ``flax_transformer.json`` beside it in the folder.
    ``before_swap``: see ``files.write_dir`` (``verification.export.save_orbax`` certifies)."""
    import orbax.checkpoint as ocp

    path = files.check_target(Path(path).absolute(), kind="dir", overwrite=overwrite)
    if type(model).__module__.startswith("torch_reference"):
        model = porting.torch_to_flax(model)

    def write(tmp: Path):
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        with orbax_quiet.errors_raised_not_logged(), ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp / "params", params)
        (tmp / f"{METADATA_KEY}.json").write_text(json.dumps(describe(model), indent=2) + "\n")
    return files.write_dir(path, write, overwrite=overwrite, before_swap=before_swap)


# ------------------------------------------------------------------- reading


def read_safetensors(path) -> tuple[dict[str, np.ndarray], dict | None]:
    """(tensors, model description or None) of a safetensors file."""
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except SafetensorError as error:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupted?): {error}") from None
    if METADATA_KEY not in metadata:
        return tensors, None
    try:
        description = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: the {METADATA_KEY!r} header entry is not valid JSON ({error})") from None
    if not isinstance(description, dict):
        raise ValueError(f"{path}: the {METADATA_KEY!r} header entry must be a JSON object, "
                         f"not a {type(description).__name__}")
    return tensors, description


def load_orbax(path, *, dtype=jnp.float32, param_dtype=jnp.float32):
    """A Flax model from ``save_orbax``'s folder."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = path / f"{METADATA_KEY}.json"
    if not meta.is_file():
        raise FileNotFoundError(f"{path} is not a flax_transformer orbax checkpoint (no {meta.name})")
    try:
        description = json.loads(meta.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{meta} is not valid JSON: {error}") from None
    model = _build_from(meta, description, dtype=dtype, param_dtype=param_dtype)
    state = nnx.state(model, nnx.Param)
    target = nnx.to_pure_dict(state)
    try:  # a corrupt folder: orbax's noise kept off stderr, its error cut to what names the problem
        with orbax_quiet.errors_raised_not_logged(), ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path / "params", target)
    except (ValueError, OSError, RuntimeError, KeyError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        cut = first if len(first) <= 300 else first[:300] + " ..."  # tensorstore appends the whole spec
        raise ValueError(f"{path} is unreadable (orbax): {cut}") from None
    nnx.replace_by_pure_dict(state, jax_tree_cast(restored, target))
    nnx.update(model, state)
    model.eval()
    return model


def _build_from(file, description, **kw):
    """``build`` for a description read from ``file``: an error names the file."""
    try:
        return build(description, **kw)
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from None


def jax_tree_cast(tree, like):
    """Cast each leaf of ``tree`` to the dtype of the matching leaf of ``like``."""
    import jax

    return jax.tree.map(lambda a, b: jnp.asarray(a, dtype=b.dtype), tree, like)


def load(path, *, dtype=jnp.float32, param_dtype=jnp.float32):
    """A Flax model (eval mode) from any checkpoint that describes itself: an HF folder, an
    orbax folder from ``save_orbax`` or a ``save_safetensors`` file. A training run directory is
    the training layer's to read: ``flax_transformer.training.run_loading.load_run(RUN_DIR)``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint file or folder: {path}")
    if path.is_dir():
        if (path / f"{METADATA_KEY}.json").exists():
            return load_orbax(path, dtype=dtype, param_dtype=param_dtype)
        if (path / "run.json").is_file():  # a training run: its model is built by its task's code
            raise ValueError(f"{path} is a training run directory: load it with "
                             "flax_transformer.training.run_loading.load_run(RUN_DIR) (its .model), or run_loading.load_model(RUN_DIR)")
        from flax_transformer.interop import hf

        return hf.from_pretrained(path, dtype=dtype, param_dtype=param_dtype)
    tensors, description = read_safetensors(path) if path.suffix == ".safetensors" else (None, None)
    if description is None:
        raise ValueError(f"{path} does not say which model it holds (a bare state_dict): convert it with "
                         "`flax-transformer port SRC DST --family F --class C --config JSON` first")
    model = _build_from(path, description, dtype=dtype, param_dtype=param_dtype)
    porting.load_state_dict(model, tensors, strict=True)
    model.eval()
    return model
