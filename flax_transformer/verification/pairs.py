"""A checkpoint as a (Flax, torch) pair, example inputs for any whole model, and a user's own pair.

``verify --checkpoint`` and ``port --verify`` compare a checkpoint's Flax model with its
torch twin on the same inputs; both come from here, so the CLI holds no family knowledge:
the inputs are drawn from what the model says it reads (``model.input_spec()``). A user's
model comes as ``MODULE:FACTORY`` (``verify --pair``, the certified exports' ``reference=`` and
their re-check): ``FACTORY()`` returns (torch model, Flax model, args[, kwargs]).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

from flax_transformer.models.input_specs import input_spec


def load_pair(src, family: str | None = None, cls: str | None = None, config: str | dict | None = None, *,
              load=None, dtype: str = "fp32"):
    """(flax model, torch model) of a checkpoint, each built from SRC itself where possible.

    SRC is an HF folder (or Meta's llama layout), a ``save_safetensors`` file or an orbax folder (they describe their
    model); a bare torch state_dict (``.pt``/``.bin``/``.safetensors`` without a description)
    needs ``family``, ``cls`` and ``config`` (constructor arguments, a dict or JSON text).
    ``load``: how a self-describing SRC becomes a Flax model (default ``checkpoints.load``); a
    layer above passes its own, e.g. the CLI's, which also reads training run directories.
    ``dtype``: the Flax model's compute dtype, "fp32" or "bf16" (parameters stay float32).
    """
    import jax.numpy as jnp

    from flax_transformer.interop import checkpoints, hf, porting

    compute = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype]

    path = Path(src)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint: {path}")
    if family or cls or config:
        if not (family and cls):
            raise ValueError("--family and --class go together (with --config for the constructor arguments)")
        kwargs = config
        if isinstance(config, str) or config is None:
            try:
                kwargs = json.loads(config) if config else {}
            except json.JSONDecodeError as error:
                raise ValueError(f"--config is not valid JSON: {error}") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"--config must be a JSON object of constructor arguments, got {config!r}")
        torch_model = checkpoints.build({"family": family, "class": cls, "init_kwargs": kwargs}, framework="torch")
        weights = checkpoints.read_safetensors(path)[0] if path.suffix == ".safetensors" else hf.read_weights(path)
        torch_model.load_state_dict(hf.torch_state(weights))  # checked, not cast: see hf.torch_state
        torch_model.eval()
        return porting.torch_to_flax(torch_model, dtype=compute), torch_model
    if hf.is_model_folder(path):  # an HF folder, or Meta's llama layout
        return hf.from_pretrained(path, dtype=compute), hf.torch_from_pretrained(path)
    if path.suffix in (".pt", ".bin", ".pth") or (path.suffix == ".safetensors" and
                                                   checkpoints.read_safetensors(path)[1] is None):
        raise ValueError(f"{path} is a bare state_dict: say what it holds (port takes --family, --class and "
                         "--config; an HF checkpoint goes in a folder with its config.json)")
    flax_model = (load or checkpoints.load)(path, **({} if dtype == "fp32" else {"dtype": compute}))
    return flax_model, porting.flax_to_torch(flax_model)


def example_inputs(model, *, seed: int = 0, batch: int = 2, length: int = 9) -> tuple:
    """Random model-level inputs (numpy) for a whole model of either framework.

    ``(ids, mask)`` with the last row right-padded, or for an encoder-decoder
    ``(src_ids, tgt_ids, src_mask, None)`` (the model builds its own causal target mask).
    """
    spec = input_spec(model)
    rng = np.random.default_rng(seed)
    t = min(length, spec.max_length)
    ids = rng.integers(0, spec.vocab_size, size=(batch, t))
    mask = np.ones((batch, t), np.int64)
    mask[-1, max(1, t - 3):] = 0  # right padding
    if spec.encoder_decoder:
        return ids, rng.integers(0, spec.target_vocab_size, size=(batch, t)), mask, None
    return ids, mask


def lm_mask(model, args: tuple):
    """The real tokens of a language model's logits for ``example_inputs``' ``args`` (1 = token):
    a decoder's padding mask (its last argument; None: every position), None for an
    encoder-decoder, whose target positions are all real."""
    if input_spec(model).encoder_decoder:
        return None
    return None if args[-1] is None else np.asarray(args[-1])


# ------------------------------------------------- a user's pair: MODULE:FACTORY


def load_factory(spec: str):
    """The callable named by ``MODULE:FACTORY``.

    MODULE is a path to a ``.py`` file when it ends in ``.py`` (imported under its file name,
    with its folder first on ``sys.path`` while it imports, so that it can import the modules
    beside it), else a dotted module name importable from here (the current directory is on
    the path, as for ``python -m``).
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--pair must be MODULE:FACTORY (a module or a .py file, then a function), got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"--pair: no such file: {path}")
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader_spec)
        folder = str(path.resolve().parent)
        sys.path.insert(0, folder)  # as `python FILE.py` would: its sibling modules import
        try:
            loader_spec.loader.exec_module(module)
        except Exception as error:
            raise ValueError(f"--pair: importing {path} failed: {type(error).__name__}: {error}") from None
        finally:
            if folder in sys.path:  # the file may have taken it off itself
                sys.path.remove(folder)
    else:
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")
        try:
            module = importlib.import_module(module_name)
        except Exception as error:
            raise ValueError(f"--pair: cannot import {module_name!r}: {type(error).__name__}: {error}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--pair: {module_name} has no function {attr!r}")
    return factory


def run_factory(factory, spec=None):
    """What ``factory()`` returns; anything it raises, ``sys.exit`` too, as one ``ValueError`` naming ``spec``
    (default: the factory's name)."""
    spec = spec or factory_name(factory)
    try:
        return factory()
    except SystemExit as error:  # a factory that exits must not end the check as if it had passed
        raise ValueError(f"--pair: {spec} called sys.exit({error.code!r}) instead of returning a pair") from None
    except Exception as error:
        raise ValueError(f"--pair: {spec} raised {type(error).__name__}: {error}") from None


def factory_name(factory) -> str:
    """``MODULE:FACTORY`` as given, or a callable's ``module.qualname``."""
    if isinstance(factory, str):
        return factory
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', type(factory).__name__)}"


def unpack_pair(made, spec: str):
    """(torch model, flax model, args, kwargs) from what a ``--pair`` factory returned, checked."""
    if not isinstance(made, tuple) or len(made) not in (3, 4):
        raise ValueError(f"--pair: {spec} must return (torch_model, flax_model, args) or "
                         f"(torch_model, flax_model, args, kwargs), got {_kind(made)}")
    torch_model, flax_model, args, kwargs = (*made, {}) if len(made) == 3 else made
    if not hasattr(torch_model, "named_modules"):
        raise ValueError(f"--pair: {spec}'s first item must be a torch module, got {_kind(torch_model)}")
    from flax import nnx

    if not isinstance(flax_model, nnx.Module):
        raise ValueError(f"--pair: {spec}'s second item must be a Flax NNX module, got {_kind(flax_model)}")
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs or {}, dict):
        raise ValueError(f"--pair: {spec}'s args must be a tuple (and kwargs a dict), got {_kind(args)}")
    return torch_model, flax_model, tuple(args), dict(kwargs or {})


def call_factory(spec):
    """(torch model, flax model, args, kwargs) from the factory named by ``MODULE:FACTORY`` (or a
    factory given as a callable)."""
    factory = spec if callable(spec) else load_factory(spec)
    name = factory_name(spec)
    return unpack_pair(run_factory(factory, name), name)


def _kind(x) -> str:
    return f"a tuple of {len(x)}" if isinstance(x, tuple) else type(x).__name__
