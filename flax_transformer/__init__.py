"""Flax NNX twins of the notebooks' Transformers, with weight porting and parity checks.

The package is layered, and the folders are the layers; each imports only those above it here:

* ``models``: the families (the four notebooks' and ``llama``), their layers, attention, configs and generation (no torch);
* ``interop``: files, safetensors, checkpoints, HuggingFace folders, torch <-> Flax porting;
* ``verification``: comparing a torch model with its Flax twin, ``bisect``, certificates and
  the certified exports;
* ``training``: the training library the ``train/`` entry points run;
* ``cli``: the ``flax-transformer`` command and the trainers' shared flags.

The modules users import most are also reachable by their short names, loaded on first use
(``from flax_transformer import porting, verify``), so that importing the package costs nothing
and ``torch_reference`` can read the pure-Python configs without JAX.
"""

import importlib

__version__ = "0.1.0"

# short name -> the module it stands for
_MODULES = {
    **{name: f"flax_transformer.models.{name}" for name in (
        "attention", "classic", "configs", "encoder", "former", "generate", "gpt", "layers", "llama", "llama_config",
        "lora")},
    **{name: f"flax_transformer.interop.{name}" for name in (
        "checkpoints", "files", "hf", "layer_kinds", "peft", "porting", "safetensors_io")},
    **{name: f"flax_transformer.verification.{name}" for name in (
        "bisect", "certificate", "certificate_check", "export", "inspection", "pairs", "verify")},
}
_NAMES = {"ATTENTION_IMPLEMENTATIONS": "flax_transformer.models.attention",
          "set_attention": "flax_transformer.models.attention"}

__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'flax_transformer' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_MODULES, *_NAMES])
