"""Flax NNX twins of the notebooks' Transformers, with weight porting and parity checks.

The package is layered, and the folders are the layers; each imports only those above it here:

* ``models``: the families (the four notebooks' and ``llama``), their layers, attention, configs and generation (no torch);
* ``interop``: files, safetensors, checkpoints, HuggingFace folders, torch <-> Flax porting;
* ``verification``: comparing a torch model with its Flax twin, ``bisect``, certificates and
  the certified exports;
* ``training``: the training library the ``train/`` entry points run;
* ``cli``: the ``flax-transformer`` command and the trainers' shared flags.

Every name is imported from the module that defines it, by its full path
(``from flax_transformer.interop import porting``,
``from flax_transformer.models.attention import set_attention``): the package itself holds no
names, so that importing it costs nothing and ``torch_reference`` can read the pure-Python
configs without JAX. The short names of older releases (``flax_transformer.porting``) raise an
``AttributeError`` that names the full path.
"""

import sys as _sys

__version__ = "0.1.0"

# the short names this package used to give (``from flax_transformer import porting``), and where each lives
_MOVED = {
    **{name: f"flax_transformer.models.{name}" for name in (
        "attention", "classic", "configs", "encoder", "former", "generate", "gpt", "layers", "llama", "llama_config",
        "lora")},
    **{name: f"flax_transformer.interop.{name}" for name in (
        "checkpoints", "files", "hf", "layer_kinds", "peft", "porting", "safetensors_io")},
    **{name: f"flax_transformer.verification.{name}" for name in (
        "bisect", "certificate", "export", "verify")},
    "certificate_check": "flax_transformer.verification.certificate",
    "pairs": "flax_transformer.verification.certificate.subjects",
    "inspection": "flax_transformer.cli.inspection",
    "ATTENTION_IMPLEMENTATIONS": "flax_transformer.models.attention.ATTENTION_IMPLEMENTATIONS",
    "set_attention": "flax_transformer.models.attention.set_attention",
}


def _moved(name: str) -> str:
    return f"flax_transformer.{name} is {_MOVED[name]}: import it from there"


def __getattr__(name):
    if name in _MOVED:
        raise AttributeError(_moved(name))
    raise AttributeError(f"module 'flax_transformer' has no attribute {name!r}")


class _MovedFinder:
    """``import flax_transformer.porting`` and ``from flax_transformer import porting`` name the full path too.

    Python answers both by importing the submodule; this finder, asked only for the old short names,
    refuses with the sentence above instead of "No module named ...".
    """

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name in _MOVED:
            raise ModuleNotFoundError(_moved(name))  # no ``name=``: ``from ... import`` would swallow it
        return None


if not any(type(finder).__name__ == "_MovedFinder" for finder in _sys.meta_path):  # once, reloaded or not
    _sys.meta_path.append(_MovedFinder())
