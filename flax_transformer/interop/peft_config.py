"""``adapter_config.json`` read field by field: what ``peft.load_peft`` computes, what it may ignore, and
everything else refused in one line naming the field.

peft's ``LoraConfig`` grows a field for each LoRA variant (aLoRA, KaSA, BD-LoRA, ...). A reader that took
only the fields it knows would load such an adapter as plain LoRA, and compute something else with no
error: aLoRA's adapter applied at every position, PiSSA's onto a base it was not trained on. So every
field is in one of three tables, and one that is in none (a newer peft's, a typing slip) is refused:

* ``COMPUTED``: read, and what they compute is this library's (``load_peft``, ``check_base``);
* ``IGNORED``: they change nothing that ``load_peft`` computes (each with the reason);
* ``REFUSED``: a computation this library does not implement; accepted only at a value that turns it
  off (null, or its default), refused at any other naming the field.

``init_lora_weights`` says how A and B started. Where the start left the base alone (True, False,
"gaussian", "orthogonal", "eva") the file's A and B are the whole adapter. PiSSA, OLoRA, CorDA and
LoRA-GA subtract their start from the base weights: an adapter saved without conversion belongs on
that residual base, not on the base it came from; LoftQ's on its quantized base. Those are refused
with the way to convert them. Pure Python: no JAX, torch or peft.
"""

from __future__ import annotations

import math
from pathlib import Path

from flax_transformer.interop import files

__all__ = ["COMPUTED", "FILE", "IGNORED", "INIT_PLAIN", "REFUSED", "read_config"]

FILE = "adapter_config.json"

COMPUTED = {
    "peft_type": "'LORA' only: another PEFT method is another computation",
    "r": "the adapters' rank: A is (r, in), B (out, r)",
    "lora_alpha": "the scale alpha / r (alpha / sqrt(r) with use_rslora)",
    "use_rslora": "rank-stabilised scale alpha / sqrt(r)",
    "lora_dropout": "dropout on the LoRA branch while training",
    "target_modules": "which linear layers take LoRA (PEFT's rule: a regex on the path, or names / suffixes)",
    "target_parameters": "which experts' weights take LoRA (PEFT's ParamWrapper)",
    "modules_to_save": "modules trained fully beside the adapter, their tensors read from the file",
    "bias": "'none' only: 'all' and 'lora_only' train base biases the adapter file does not hold here",
    "init_lora_weights": "how A and B started: accepted where the start left the base alone (INIT_PLAIN), "
                         "refused where it changed the base (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ) or trains A alone "
                         "(MiCA)",
    "base_model_name_or_path": "check_base: an adapter for another base is refused where this says which",
}

IGNORED = {
    "task_type": "which PeftModel class peft wraps the base in; here the model given to load_peft decides",
    "inference_mode": "whether peft freezes the adapter after loading; what trains is the run's choice here",
    "peft_version": "the peft that wrote the folder",
    "auto_mapping": "the base's class for peft's AutoPeftModel; here the model given to load_peft decides",
    "revision": "the hub revision of the base; here the base is given",
    "fan_in_fan_out": "peft sets it from the layer's type (Conv1D: true, Linear: false) whatever is written, as "
                      "load_peft does",
    "layers_pattern": "read by peft only with layers_to_transform, which is refused",
    "megatron_core": "the module megatron_config's layers come from; megatron_config is refused",
    "qalora_group_size": "read by peft only with use_qalora, which is refused",
    "loftq_config": "the settings of LoftQ's start (init_lora_weights 'loftq', refused); the file holds the tensors",
    "eva_config": "the settings of EVA's start, which leaves the base alone; the file holds the tensors",
    "corda_config": "the settings of CorDA's start (init_lora_weights 'corda', refused); the file holds the tensors",
    "lora_ga_config": "the settings of LoRA-GA's start (init_lora_weights 'lora_ga', refused); the file holds the "
                      "tensors",
    "runtime_config": "where peft keeps weights at run time (ephemeral GPU offload); not what they compute",
}

# field -> (its default, what it computes that load_peft does not). Accepted at the default or null.
REFUSED = {
    "use_dora": (False, "DoRA adds a magnitude vector to each adapted module"),
    "rank_pattern": ({}, "per-module ranks"),
    "alpha_pattern": ({}, "per-module alphas"),
    "layers_to_transform": (None, "LoRA on some layers' modules only"),
    "exclude_modules": (None, "modules taken out of target_modules"),
    "lora_bias": (False, "a trained bias on lora_B"),
    "trainable_token_indices": (None, "trained rows of the embedding"),
    "alora_invocation_tokens": (None, "aLoRA applies the adapter only from its invocation tokens on; read as plain "
                                      "LoRA it would act at every position"),
    "layer_replication": (None, "the base's layers repeated (each copy with an adapter of its own), a deeper model "
                                "than the base"),
    "kasa_config": (None, "KaSA cuts the base weights' smallest singular components and trains a diagonal "
                          "(lora_diag) between A and B"),
    "use_bdlora": (None, "BD-LoRA's block-diagonal A or B"),
    "arrow_config": (None, "Arrow routes each token among several adapters"),
    "monteclora_config": (None, "MonteCLoRA samples its adapters"),
    "velora_config": (None, "VeLoRA trains through a compressed backward pass"),
    "use_qalora": (False, "QALoRA pools the inputs in groups (GPTQ bases)"),
    "megatron_config": (None, "Megatron's parallel layers"),
    "ensure_weight_tying": (False, "the adapters of tied layers tied together"),
    # peft 0.2's fields (alpaca-lora's adapters were written with them): off, they are plain LoRA
    "enable_lora": (None, "peft 0.2's MergedLinear: LoRA on some of a fused projection's parts"),
    "merge_weights": (False, "peft 0.2: the adapter merged into the base weights in eval mode"),
}

# init_lora_weights whose start leaves the base weights as they were: A and B from the file are the adapter
INIT_PLAIN = (True, False, "gaussian", "orthogonal", "eva")
_RESIDUAL = ("pissa", "olora", "corda", "lora_ga")  # starts subtracted from the base ("pissa_niter_N" too)


def _is_off(value, default) -> bool:
    """Whether ``value`` is null or ``default`` itself: ``0 == False`` in Python, so the types must agree too
    (``use_dora: 0`` is no value peft writes: refused, not guessed to be off)."""
    return value is None or (type(value) is type(default) and value == default)


def _check_init(file: Path, value) -> None:
    if value is None or isinstance(value, bool) or (isinstance(value, str) and value in INIT_PLAIN):
        return  # None and false: no start at all
    if isinstance(value, str) and value.lower().startswith(_RESIDUAL):
        raise ValueError(f"{file}: init_lora_weights={value!r} subtracts the adapter's start from the base weights, so "
                         "this adapter (saved without conversion) belongs on that residual base, not on the base; "
                         "convert it to plain LoRA: PEFT's save_pretrained(..., "
                         "path_initial_model_for_weight_conversion=<the adapter as initialised>) or "
                         "convert_to_lora, then load that")
    if value == "loftq":
        raise ValueError(f"{file}: init_lora_weights='loftq' belongs on the quantized base LoftQ made from the "
                         "base, not on the base itself; load it with peft onto that base")
    if value == "mica":
        raise ValueError(f"{file}: init_lora_weights='mica' (MiCA) trains A alone with lora_B frozen, which LoRA "
                         "here does not; not supported")
    raise ValueError(f"{file}: init_lora_weights={value!r} is not one of peft's starts that leave the base alone "
                     f"({', '.join(map(repr, INIT_PLAIN))})")


def read_config(folder) -> dict:
    """``adapter_config.json`` of a PEFT LoRA folder, checked field by field before anything is loaded:
    every field computed (``COMPUTED``) or ignorable (``IGNORED``), or off (``REFUSED``); anything else
    is a ``ValueError`` naming the file and the field."""
    file = Path(folder) / FILE
    config = files.read_json_object(folder, FILE)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type {config.get('peft_type')!r} is not 'LORA'; load_peft reads LoRA "
                         "adapters only")
    unknown = sorted(set(config) - set(COMPUTED) - set(IGNORED) - set(REFUSED))
    if unknown:
        raise ValueError(f"{file}: field {unknown[0]!r} is not one that load_peft computes or may ignore (peft's "
                         "LoraConfig fields as of peft 0.21; docs/lora.md lists them), so what it changes is not "
                         "known: refused")
    for name, (default, what) in REFUSED.items():
        if not _is_off(config.get(name), default):
            raise ValueError(f"{file}: {name}={config[name]!r} is not supported: {what}, which load_peft does not "
                             "compute")
    _check_init(file, config.get("init_lora_weights", True))
    if config.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias={config['bias']!r} trains base biases, which the adapter does not "
                         "hold here; only bias 'none' is supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{file}: r must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{file}: lora_alpha must be a finite number, got {alpha!r}")
    if not isinstance(config.get("use_rslora", False), (bool, type(None))):
        raise ValueError(f"{file}: use_rslora must be true or false, got {config['use_rslora']!r}")
    targets, parameters = config.get("target_modules"), config.get("target_parameters")
    if parameters is not None and not (isinstance(parameters, list) and all(isinstance(t, str) and t for t in parameters)):
        raise ValueError(f"{file}: target_parameters must be a list of parameter names, got {parameters!r}")
    if parameters and targets in (None, []):
        return config  # LoRA on the experts' weights alone
    if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                         and all(isinstance(t, str) for t in targets))):
        raise ValueError(f"{file}: target_modules must be a regex or a list of module names, got {targets!r}")
    return config
