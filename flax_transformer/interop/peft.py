"""PEFT LoRA adapter folders <-> the library's LoRA models (``models.lora``), both ways.

    peft.save_peft(model, "adapter/")      # adapter_config.json + adapter_model.safetensors
    peft.load_peft(model, "adapter/")      # a PEFT LoRA adapter onto a (ported) base model

A folder is what ``PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained(base, folder)``
reads: ``adapter_config.json`` (``peft_type`` "LORA", ``r``, ``lora_alpha``, ``target_modules``, ...)
and ``adapter_model.safetensors`` with one pair of tensors per adapted module of transformers' model:

    base_model.model.<module path>.lora_A.weight    (r, in)     torch nn.Linear layout of A
    base_model.model.<module path>.lora_B.weight    (out, r)

The library stores A (in, r) and B (r, out): both transposed. Experts' fused weights (``target_parameters``,
``lora_experts.ParamLoRA``) are held as PEFT's ``ParamWrapper`` holds them: A (E r, in), B (out, r E), under
the experts' path, ``gate_up_proj`` one ``base_layer.`` deeper when both are adapted. GPT-2's Conv1D layers
take ``fan_in_fan_out=True`` and the same shapes. Module paths are transformers' own (``hf``'s key tables
for the models ``hf.save_pretrained`` writes), the porting names for any other model.

Loading is all or nothing: the adapter is checked whole (config, prefix, every missing, unexpected or
mis-shaped tensor) before LoRA is added. Safetensors only (a pickled ``adapter_model.bin`` is refused).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop import converter, files, hf, peft_config, porting, safetensors_io, values
from flax_transformer.interop.hf_tables import ENCODERS, table_of
from flax_transformer.interop.layer_kinds import to_flax, torch_shape
from flax_transformer.models import gpt, lora
from flax_transformer.models.lora_experts import EXPERT_PARAMETERS, EXPERT_TYPES, ParamLoRA
from flax_transformer.models.state_dict_errors import StateDictError

__all__ = ["CONFIG_FILE", "PREFIX", "WEIGHTS_FILE", "adapter_module_paths", "check_base", "from_peft_layout",
           "hf_module_paths", "load_peft", "save_peft", "to_peft_layout"]

CONFIG_FILE, WEIGHTS_FILE = peft_config.FILE, "adapter_model.safetensors"  # its fields: interop.peft_config
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model

# ------------------------------------------------------------------ names


def _our_weight_key(layer) -> str:
    """The torch (porting) leaf of a linear layer's weight: nn.Linear's ``weight``, the notebook's ``matrix``."""
    return "matrix" if isinstance(layer, gpt.Linear) else "weight"


def _hf_key(model, key: str, *, whole: bool = False) -> str | None:
    """Our torch (porting) name of a parameter -> the name transformers' model gives it.

    The models ``hf.save_pretrained`` writes go through its key tables (the classifier's body under
    ``encoder.`` gets the family's prefix); any other model's torch names are its porting names.
    For one head's slice of a transformers tensor (BERT's ``heads.<i>.q``): None, or with ``whole``
    the name of the tensor it is a slice of."""
    if not hf.can_save(model):
        return key
    kind, _, classifier = hf.kind_of(model)
    if classifier:
        spec = ENCODERS[kind]
        if key.startswith("encoder."):
            name = _rename(spec.rows, key[len("encoder."):], whole)
            return None if name is None else spec.prefix + name
        return _rename(spec.classifier_rows, key, whole)
    return _rename(table_of(kind), key, whole)


def _rename(rows, key: str, whole: bool = False) -> str | None:
    return converter.source_name(rows, key, whole=whole, format_name="transformers")


def _module_of(key: str) -> str:
    return key.rpartition(".")[0]


def hf_module_paths(model) -> dict[str, str]:
    """Our dotted path -> transformers' module path, for every linear layer that is a module of
    transformers' model (BERT's per-head q/k/v slices are not), and for each projection over all
    heads that a ``lora.FusedLoRA`` takes (``<attention>.q_lora`` -> ``<layer>.attention.self.query``)."""
    out = {}
    nodes = lora.module_nodes(model)
    path_of = {id(node): path for path, node in nodes.items()}
    for path, node in nodes.items():
        if path and isinstance(node, lora.ADAPTABLE):
            dotted = lora.dotted_path(path)
            name = _hf_key(model, f"{dotted}.{_our_weight_key(node)}")
            if name is not None:
                out[dotted] = _module_of(name)
        if path and hf.can_save(model):
            for slot, projection, _ in lora.fused_slots(node, path):
                first = lora.dotted_path(path_of[id(node.head_layers(projection)[0])])
                out[lora.dotted_path(slot)] = _module_of(_hf_key(model, f"{first}.weight", whole=True))
    return out


def hf_parameter_names(model) -> dict[str, str]:
    """Our dotted path -> transformers' parameter name, for every expert weight that takes a LoRA as a
    parameter (``lora_experts.EXPERT_PARAMETERS`` of each ``EXPERT_TYPES``). transformers 5 holds the experts
    fused, under our (canonical) names, whatever per-expert names its files use."""
    out = {}
    for path, node in lora.module_nodes(model).items():
        if isinstance(node, EXPERT_TYPES):
            for name in EXPERT_PARAMETERS:
                dotted = lora.dotted_path((*path, name))
                out[dotted] = _hf_key(model, dotted) or dotted
    return out


def _wrapper_paths(names: dict[str, str]) -> dict[str, str]:
    """Our adapter path -> PEFT's path of its ``ParamWrapper``, for ``names`` (adapter path -> transformers
    parameter name). PEFT wraps a module's targeted weights in their definition order, each wrapper
    around the last, so the first sits deepest: ``experts.base_layer`` when a second one follows."""
    out, by_module = {}, {}
    for ours, name in names.items():
        by_module.setdefault(_module_of(name), []).append((EXPERT_PARAMETERS.index(name.rpartition(".")[2]), ours))
    for module, found in by_module.items():
        for depth, (_, ours) in enumerate(sorted(found)):
            out[ours] = module + ".base_layer" * (len(found) - 1 - depth)
    return out


def adapter_module_paths(model) -> dict[str, str]:
    """Our adapter path -> the path of the module of PEFT's model (``base_model.model.`` left off) that
    holds its ``lora_A`` / ``lora_B``: the adapted layer's transformers module, or for a
    ``lora_experts.ParamLoRA`` its ``ParamWrapper`` (``experts``, ``experts.base_layer``). A LoRA on one
    head's slice of a transformers projection has none, so it is absent."""
    modules, weights, everything = hf_module_paths(model), hf_parameter_names(model), lora.layers(model)
    names = {path: weights[f"{path.rpartition('.')[0]}.{layer.parameter}"]
             for path, layer in everything.items() if isinstance(layer, ParamLoRA)}
    return {**{path: modules[path] for path in everything if path in modules}, **_wrapper_paths(names)}


def to_peft_layout(layer) -> tuple[np.ndarray, np.ndarray]:
    """An adapter's A and B as PEFT's module holds them: a layer's (in, r), (r, out) as torch's (r, in),
    (out, r); a ``ParamLoRA``'s (E, in, r), (E, r, out) as its ``ParamWrapper``'s (E r, in), (out, r E)."""
    a, b = np.asarray(layer.lora_A[...]), np.asarray(layer.lora_B[...])
    if not isinstance(layer, ParamLoRA):
        return np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
    e, d_in, r = a.shape
    return (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(e * r, d_in)),  # expert-major rows
            np.ascontiguousarray(b.transpose(2, 1, 0).reshape(b.shape[2], r * e)))  # expert-minor columns


def from_peft_layout(layer, leaf: str, value: np.ndarray) -> np.ndarray:
    """PEFT's ``leaf`` ("lora_A" or "lora_B") of ``layer`` (a tensor, or its gradient) in our layout:
    ``to_peft_layout`` undone."""
    if not isinstance(layer, ParamLoRA):
        return value.T
    experts = layer.lora_A.shape[0]
    if leaf == "lora_A":
        return value.reshape(experts, -1, value.shape[1]).transpose(0, 2, 1)
    return value.reshape(value.shape[0], -1, experts).transpose(2, 1, 0)


def _fused_shape(model, ours: str) -> tuple[int, int]:
    """(in, out) of the projection over all heads whose FusedLoRA path is ``ours``."""
    parent, _, slot = ours.rpartition(".")
    attention = {lora.dotted_path(p): n for p, n in lora.module_nodes(model).items() if p}[parent]
    heads = attention.head_layers(slot[:-len("_lora")])
    return heads[0].kernel.shape[0], sum(h.kernel.shape[1] for h in heads)


def _torch_keys(model) -> list[str]:
    """The torch (porting) names of the model's base parameters, adapters left out; from porting's plan,
    which names them without copying a single array (``porting.state_dict`` would copy them all)."""
    plan = porting.plan_of(model)
    return [slots[0].torch_key for path, slots in plan.slots.items()
            if not isinstance(plan.params[path], lora.LoRAParam)]


def _peft_matches(targets, module: str) -> bool:
    """PEFT's ``target_modules`` rule (``check_target_module_exists``): a string is a regex on the whole
    module path; a list names modules by their full path or a dotted suffix of it."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return module in targets or any(module.endswith(f".{t}") for t in targets)


def _under(modules: list[str], module: str) -> bool:
    """Whether ``module`` is, or is inside, a module that ``modules_to_save`` names. PEFT's rule
    (``_set_trainable``): a module whose path *ends with* a name, as a string, is wrapped whole, so
    ``classifier`` takes DistilBERT's ``pre_classifier`` too, and RoBERTa's ``classifier`` its
    ``classifier.dense`` and ``classifier.out_proj``."""
    parts = module.split(".")
    return any(".".join(parts[:i]).endswith(m) for i in range(1, len(parts) + 1) for m in modules)


def _target_modules(model, adapted: set[str]) -> list[str]:
    """The shortest ``target_modules`` that selects exactly the adapted modules of transformers' model:
    their last names when no other module of it has one of those names, else their full paths."""
    names = sorted({m.rpartition(".")[2] for m in adapted})
    everything = set()  # every module path of transformers' model (each parameter's ancestors)
    if not adapted:
        return []  # LoRA on parameters alone: PEFT's way to say "no module" (None would take its defaults)
    for key in _torch_keys(model):
        parts = (_hf_key(model, key, whole=True) or key).split(".")[:-1]  # fused experts: transformers' own name
        everything.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    clash = [m for m in everything if m not in adapted and _peft_matches(names, m)]
    return sorted(adapted) if clash else names


def _peft_param_matches(targets, name: str) -> bool:
    """PEFT's ``target_parameters`` rule: a parameter's full name, or a dotted suffix of it."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _target_parameters(adapted: set[str], everything: set[str]) -> list[str]:
    """The shortest ``target_parameters`` that selects exactly the adapted weights: their last two name
    parts (``experts.gate_up_proj``) when that selects no other weight, else their full names."""
    short = sorted({".".join(name.split(".")[-2:]) for name in adapted})
    return short if all(_peft_param_matches(short, n) == (n in adapted) for n in everything) else sorted(adapted)


# ------------------------------------------------------------------ saving


def save_peft(model, folder, *, base_model_name_or_path: str | None = None, task_type: str | None = None,
              modules_to_save=None, overwrite: bool = False, before_swap=None) -> Path:
    """Write a LoRA model's adapter as a PEFT folder that ``PeftModel.from_pretrained`` loads.

    Args:
        model: a model that ``lora.apply`` adapted (merged or not: the adapters are written).
        folder: the adapter folder, written whole under a temporary name and swapped in
            (``files.write_dir``); a non-empty one is replaced only with ``overwrite=True``.
        base_model_name_or_path, task_type: copied into ``adapter_config.json`` (``task_type`` as
            PEFT's ``"CAUSAL_LM"``, ``"SEQ_CLS"``, ...; None loads with a plain ``PeftModel``).
        modules_to_save: transformers module names to train fully beside the adapter; their
            weights (``base_model.model.<module>.<leaf>``) are written with the adapter.
        before_swap: ``files.write_dir``'s hook (``verification.export.save_peft`` certifies with it).

    Returns the folder's path.
    """
    config = lora.config_of(model)
    if config is None:
        raise ValueError(f"the {type(model).__name__} has no LoRA layers: lora.apply adds them")
    folder = files.check_target(folder, kind="dir", overwrite=overwrite)
    paths, everything = adapter_module_paths(model), lora.layers(model)
    layers = {path: layer for path, layer in everything.items() if not isinstance(layer, ParamLoRA)}
    weights = hf_parameter_names(model)
    experts = {weights[f"{path.rpartition('.')[0]}.{layer.parameter}"]  # transformers' names of the adapted weights
               for path, layer in everything.items() if isinstance(layer, ParamLoRA)}
    homeless = [path for path in layers if path not in paths]
    if homeless:
        raise ValueError(f"{homeless[0]} is a LoRA on one head's slice of a transformers projection, which no "
                         "module of transformers' model is, so PEFT cannot hold it; adapt the whole projection "
                         "(targets such as 'query', 'value': one LoRA over all heads, as PEFT's)")
    tensors = {}
    for path, layer in everything.items():
        tensors[f"{PREFIX}{paths[path]}.lora_A.weight"], tensors[f"{PREFIX}{paths[path]}.lora_B.weight"] = \
            to_peft_layout(layer)
    saved = None
    if modules_to_save:
        saved = [modules_to_save] if isinstance(modules_to_save, str) else list(modules_to_save)
        found = {m: 0 for m in saved}
        state = None
        for key in _torch_keys(model):
            name = _hf_key(model, key)
            owner = [m for m in saved if name is not None and _under([m], _module_of(name))]
            for m in owner:
                found[m] += 1
            if owner:
                state = porting.state_dict(model) if state is None else state  # only when some module is saved
                tensors[PREFIX + name] = state[key]
        absent = [m for m, n in found.items() if n == 0]
        if absent:
            raise ValueError(f"modules_to_save {absent} name no module of the model")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": _target_modules(model, {paths[p] for p in layers}),
        "target_parameters": _target_parameters(experts, set(weights.values())) or None,
        "fan_in_fan_out": any(isinstance(layer, lora.LoRAConv1D) for layer in layers.values()),
        "use_rslora": config.use_rslora,
        "bias": "none",
        "modules_to_save": saved,
        "init_lora_weights": True,
        "use_dora": False,
        "inference_mode": True,  # PeftModel.save_pretrained writes it so
    }

    def write(tmp: Path):
        safetensors_io.write_safetensors(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n", encoding="utf-8")

    return files.write_dir(folder, write, overwrite=overwrite, before_swap=before_swap)


# ------------------------------------------------------------------ loading


def _our_targets(model, targets, chosen: list[str]) -> list[str]:
    """``apply``'s targets for the chosen layers: PEFT's names where they select exactly those in our model
    (the llama family's and GPT-2's names are transformers'), else each layer's escaped path."""
    if isinstance(targets, list) and all(lora.PLAIN_NAME.fullmatch(t) for t in targets):
        try:
            if sorted(lora.find(model, targets)) == sorted(chosen):
                return sorted(targets)  # peft keeps them as a set: their order means nothing
        except ValueError:  # a name that is not ours (BERT's "dense") or names a module that is not linear
            pass
    return [re.escape(path) for path in chosen]


def _our_parameters(model, parameters: list[str], chosen: list[str]) -> list[str]:
    """``apply``'s parameters for the chosen weights: PEFT's names where they select exactly those in our
    model (the llama family's names are transformers'), else each weight's full path."""
    try:
        if sorted(lora.find(model, (), parameters)) == sorted(f"{w}_lora" for w in chosen):
            return sorted(parameters)
    except ValueError:  # a name that matches nothing of ours, or something that is not an expert weight
        pass
    return list(chosen)


_CERT_BYTES = 4 << 20  # a PEFT adapter's certificate is a few kB (verification.certificate.peft's limit)


def _certified_base(cert: Path) -> dict[str, str]:
    """The sha256 of each base file an adapter's certificate records (its ``base.files``). A certificate
    that cannot be read is a ``ValueError`` naming it: never a silent fallback to a weaker check."""
    why = None
    if cert.stat().st_size > _CERT_BYTES:
        why = f"more than {_CERT_BYTES} bytes"
    else:
        try:
            record = json.loads(cert.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            record, why = None, f"not valid JSON ({str(error)[:120]})"
        recorded = record.get("base", {}).get("files") if isinstance(record, dict) and \
            isinstance(record.get("base"), dict) else None
        if why is None and not (isinstance(recorded, dict) and recorded and all(
                isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in recorded.items())):
            why = "no 'base': {'files': {name: sha256}} in it"
    if why is not None:
        raise ValueError(f"{cert} is unreadable ({why}), so the adapter's base cannot be checked: restore the "
                         "adapter's certificate, or delete it to check the base by base_model_name_or_path alone")
    return recorded


def _recorded_path(cert: Path):
    return json.loads(cert.read_text(encoding="utf-8"))["base"].get("path")


def check_base(folder, base) -> None:
    """Refuse an adapter made for another base than the HF folder ``base``, where it says which one.

    Its certificate (``verification.json``, written by ``verification.export.save_peft``) records the
    sha256 of its base's files: each of those ``base`` has must match, and one of them must be a weights
    file; a certificate that cannot be read (not JSON, no ``base.files``) is refused, naming it. Without one, a
    ``base_model_name_or_path`` that is a folder here must hold the same ``config.json`` as ``base``
    (a hub name or a folder that is not here cannot be compared, and is not refused)."""
    folder, base = Path(folder), Path(base)
    cert = folder / "verification.json"
    if cert.is_file():
        recorded = _certified_base(cert)
        compared = [name for name in recorded if (base / name).is_file() and name != "verification.json"]
        if not any(name.endswith(".safetensors") or name.endswith(".index.json") for name in compared):
            raise ValueError(f"{folder} is an adapter for another base: its certificate {cert} records the base's "
                             f"weights as {', '.join(sorted(recorded))}, none of which {base} has")
        differ = sorted(name for name in compared if files.sha256_file(base / name) != recorded[name])
        if differ:
            raise ValueError(f"{folder} is an adapter for another base: its certificate's base "
                             f"{_recorded_path(cert)!r} has other {', '.join(differ)} than {base}")
        return
    named = peft_config.read_config(folder).get("base_model_name_or_path")
    if isinstance(named, str) and named and (Path(named) / "config.json").is_file():
        theirs = files.read_json_object(Path(named), "config.json")
        ours = files.read_json_object(base, "config.json")
        if Path(named).resolve() != base.resolve() and theirs != ours:
            raise ValueError(f"{folder} is an adapter for another base: its base_model_name_or_path {named} holds "
                             f"another config.json than {base}")


def load_peft(model, folder, *, rngs=None):
    """Add a PEFT LoRA adapter to ``model`` (in place) and return it.

    ``model`` is the base the adapter was trained on, as the library loads it (``hf.from_pretrained``,
    ``porting.torch_to_flax``): LoRA goes on the linear layers whose transformers module path the
    adapter's ``target_modules`` names (PEFT's rule), with its ``r``, ``lora_alpha``,
    ``lora_dropout`` and ``use_rslora``, and A/B are loaded from ``adapter_model.safetensors``.

    Raises:
        ValueError: on the first problem of the config (peft_type not LORA, a field that is neither computed
            nor ignorable: ``interop.peft_config``), keys without the ``base_model.model.`` prefix, targets
            absent from the model, NaN or inf in a tensor (named), or a model
            that already has LoRA; ``StateDictError`` (a ValueError) lists every missing, unexpected
            and mis-shaped tensor. Nothing is changed in the model when it raises.
    """
    folder = Path(folder)
    config = peft_config.read_config(folder)
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        pickled = " (adapter_model.bin is a pickle, which is not read: save it as safetensors)" \
            if (folder / "adapter_model.bin").is_file() else ""
        raise FileNotFoundError(f"{folder} has no {WEIGHTS_FILE}{pickled}")
    if lora.layers(model):
        raise ValueError("the model already has LoRA layers; merge or remove them first (lora.remove)")
    weights = safetensors_io.open_safetensors(file)
    bare = [k for k in weights if not k.startswith(PREFIX)]
    if bare:
        raise ValueError(f"{file}: {len(bare)} keys lack PEFT's {PREFIX!r} prefix (first: {bare[0]!r}); "
                         "is this a PEFT adapter?")
    paths = hf_module_paths(model)
    targets, parameters = config.get("target_modules") or [], config.get("target_parameters") or []
    chosen = {ours: theirs for ours, theirs in paths.items() if targets and _peft_matches(targets, theirs)}
    experts = {ours: theirs for ours, theirs in hf_parameter_names(model).items()
               if _peft_param_matches(parameters, theirs)}  # our weight path -> transformers' name
    if parameters and not experts:
        raise ValueError(f"{folder / CONFIG_FILE}: target_parameters {parameters!r} name no expert weight of the "
                         f"{type(model).__name__} (its experts' weights are named like "
                         f"{sorted(hf_parameter_names(model).values())[:2]})")
    if targets and not chosen:
        raise ValueError(f"{folder / CONFIG_FILE}: target_modules {targets!r} name no linear layer of the "
                         f"{type(model).__name__} (its modules are named like {sorted(paths.values())[:4]})")
    nodes = {lora.dotted_path(p): n for p, n in lora.module_nodes(model).items() if p}
    rank, expected = config["r"], {}
    for ours, theirs in chosen.items():
        base = nodes.get(ours)
        if base is None:  # a projection over all heads (lora.FusedLoRA)
            d_in, d_out = _fused_shape(model, ours)
        else:
            d_in, d_out = getattr(base, "matrix" if isinstance(base, gpt.Linear) else "kernel").shape
        expected[f"{PREFIX}{theirs}.lora_A.weight"] = (ours, "lora_A", (rank, d_in))
        expected[f"{PREFIX}{theirs}.lora_B.weight"] = (ours, "lora_B", (d_out, rank))
    adapters = {f"{path.rpartition('.')[0]}.{path.rpartition('.')[2]}_lora": name for path, name in experts.items()}
    for ours, wrapper in _wrapper_paths(adapters).items():  # ours: <experts>.<weight>_lora
        e, d_in, d_out = nodes[ours[:-len("_lora")]].shape  # Flax (E, in, out)
        expected[f"{PREFIX}{wrapper}.lora_A.weight"] = (ours, "lora_A", (e * rank, d_in))
        expected[f"{PREFIX}{wrapper}.lora_B.weight"] = (ours, "lora_B", (d_out, rank * e))
    saved = saved_modules(model, config.get("modules_to_save"))  # PEFT key -> (flax path, rule, torch shape)
    missing = [k for k in [*expected, *saved] if k not in weights]
    unexpected = [k for k in weights if k not in expected and k not in saved]
    mismatched = [(k, tuple(weights[k].shape), shape) for k, (*_, shape) in [*expected.items(), *saved.items()]
                  if k in weights and tuple(weights[k].shape) != shape]
    if missing or unexpected or mismatched:
        raise StateDictError(missing, unexpected, mismatched)
    arrays = {k: safetensors_io.read(weights[k]) for k in [*expected, *saved]}
    bad = [k for k, a in arrays.items() if not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16"]
    if bad:
        raise ValueError(f"{file}: {bad[0]} is {arrays[bad[0]].dtype}, not a floating-point tensor")
    broken = values.nonfinite(arrays)  # named here, not later as a NaN loss
    if broken:
        raise ValueError(f"{file}: NaN/inf in {len(broken)} adapter tensor{'s' if len(broken) > 1 else ''}: "
                         f"{', '.join(broken[:3])}{' ...' if len(broken) > 3 else ''}; the adapter is broken "
                         "where it was made (its training diverged, or the file was damaged)")
    lora.apply(model, rank=rank, alpha=config["lora_alpha"], dropout=config.get("lora_dropout", 0.0),
               targets=_our_targets(model, targets, list(chosen)) if chosen else (),
               use_rslora=bool(config.get("use_rslora", False)), rngs=rngs if rngs is not None else nnx.Rngs(0),
               parameters=_our_parameters(model, parameters, list(experts)) if experts else ())
    layers = lora.layers(model)
    for key, (ours, leaf, _) in expected.items():
        param = getattr(layers[ours], leaf)
        value = np.asarray(arrays[key], np.float32)
        value = from_peft_layout(layers[ours], leaf, value)  # torch (r, in) -> ours (in, r), and so on
        param.set_value(jnp.array(value, dtype=param.dtype))
    params = porting.plan_of(model).params
    for key, (path, rule, _) in saved.items():  # the fully trained modules (a classifier head) replace the base's
        param = params[path]
        param.set_value(jnp.array(to_flax(rule, np.asarray(arrays[key], np.float32)), dtype=param.dtype))
    return model


def saved_modules(model, modules) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """PEFT key -> (our Flax path, its layout rule, torch shape) of every base tensor under a module of
    ``modules_to_save``. PEFT lists modules that the model may lack (SEQ_CLS's ``["classifier",
    "score"]``: one or the other exists); those name nothing and are skipped, as PEFT skips them."""
    if not modules:
        return {}
    modules = [modules] if isinstance(modules, str) else list(modules)
    plan = porting.plan_of(model)
    out = {}
    for path, slots in plan.slots.items():
        if isinstance(plan.params[path], lora.LoRAParam):
            continue
        name = _hf_key(model, slots[0].torch_key, whole=True)
        if _under(modules, _module_of(name)):
            if _hf_key(model, slots[0].torch_key) is None:
                raise ValueError(f"modules_to_save {modules}: {name} is split over heads here; not supported")
            out[PREFIX + name] = path, slots[0].rule, torch_shape(slots[0].rule, tuple(plan.params[path].shape))
    return out
