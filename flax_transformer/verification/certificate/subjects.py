"""What a check is about: a checkpoint as a (Flax, torch) pair, example inputs, a user's own pair,
and a certificate's *subject*.

``verify --checkpoint`` and ``port --verify`` compare a checkpoint's Flax model with its torch twin
on the same inputs; both come from ``load_pair``, so the CLI holds no family knowledge: the inputs
are drawn from what the model says it reads (``model.input_spec()``, ``example_inputs``). A user's
model comes as ``MODULE:FACTORY`` (``verify --pair``, the certified exports' ``reference=`` and their
re-check): ``FACTORY()`` returns (torch model, Flax model, args[, kwargs]) (``call_factory``).

A certificate's subject is how the flow of ``certificate`` (make, sidecar, re-check) describe, reload and measure what it certifies:

* ``FamilySubject``: a model of the library's families, exported as safetensors, torch, orbax or
  an HF folder; the written file is reloaded as its torch twin (``torch_model_of``) and measured
  against the model in float32 (``fp32_twin``) on example inputs drawn from ``input_spec()``
  (``measure``).
* ``UserSubject``: a user's own NNX model the library does not know, certified against the torch
  model it twins (its *reference*). ``export.save_safetensors/save_torch/save_orbax(flax_model, path,
  reference=...)`` write the reference's ``state_dict()`` names (safetensors, torch) or the Flax
  parameter tree (orbax). The check reads the written file back into a fresh copy of the reference
  (strict ``load_state_dict``; orbax through the Flax model and ``porting.flax_to_torch``) and
  compares it with the Flax model by ``compare(..., grads=True, rename=...)`` on the given inputs
  (``measure_user``). The certificate also records the reference's ``model`` (classes, the
  ``MODULE:FACTORY`` it was given as, ``rename``) and the ``inputs`` (each one's shape, dtype and
  sha256, so that a re-check on other inputs is refused); ``certificate.schema`` checks the fields.
  ``certificate.recheck(path, pair="MODULE:FACTORY")`` re-checks it with the factory's models.

A PEFT adapter folder is the third subject (``certificate.peft.AdapterSubject``): its record is its
own, made through the same ``certificate.sidecar``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np

from flax_transformer.interop.layer_kinds import apply_rename, check_rename
from flax_transformer.interop.values import to_numpy
from flax_transformer.models.input_specs import input_spec
from flax_transformer.verification import measure as core
from flax_transformer.verification.certificate import independent, schema
from flax_transformer.verification.certificate.schema import FORMATS, USER, USER_FORMATS, CertificateError, brief
from flax_transformer.verification.compare import compare

MAX_INPUTS = 16  # args, and kwargs: a model call with more is not one the certificate was made for


# ------------------------------------------------- a checkpoint as a pair, example inputs


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


# ------------------------------------------------- a certificate's subjects


class FamilySubject(schema.ExportSubject):
    """A model of the library's families (``state``: the file's values where they differ: a bf16 export's)."""

    formats = FORMATS
    reloaded = "reloaded in torch"

    def __init__(self, model, state: dict | None = None):
        self.model, self.state = model, state

    def describe(self) -> dict:
        from flax_transformer.interop import checkpoints

        return checkpoints.describe(self.model)

    def load(self, written: Path, fmt: str, description: dict, tensors: dict, name: str | None):
        reuse = tensors if fmt != "hf" else None  # the HF torch model reads the folder itself
        self.written = written, fmt  # for the reader entry: transformers reads an HF folder on its own
        return fp32_twin(self.model, self.state), torch_model_of(written, fmt, description, reuse)

    def measure(self, flax_model, torch_model) -> dict:
        record = measure(flax_model, torch_model)
        if record["inputs"] is None:  # a sub-module: nothing measured
            return record
        return record | {"reader": independent.entry(*self.written, torch_model, example_inputs(flax_model))}


class UserSubject(schema.ExportSubject):
    """A user's own model, against ``reference`` (a torch model), on ``args``/``kwargs``."""

    formats = USER_FORMATS
    needs_torch = False  # the reference is a torch model: torch is there

    def __init__(self, flax_model, reference, *, spec: str | None = None, rename=None, args=(), kwargs=None,
                 drawn_by: str = ""):
        self.flax_model, self.reference, self.spec, self.rename = flax_model, reference, spec, rename
        self.args, self.kwargs, self.drawn_by = args, kwargs, drawn_by
        self.reloaded = f"reloaded into a fresh copy of {type(reference).__name__}"

    def describe(self) -> dict:
        return describe(self.reference, self.flax_model, reference=self.spec, rename=self.rename)

    def inputs(self) -> dict:
        return {"inputs": input_record(self.args, self.kwargs, self.drawn_by)}

    def load(self, written: Path, fmt: str, description: dict, tensors: dict, name: str | None):
        try:
            torch_model = load_torch(copy.deepcopy(self.reference), written, fmt, tensors, self.flax_model,
                                     self.rename, name)
        except ValueError as error:  # porting's StateDictError too
            why = brief(" ".join(str(error).split()), 600)
            raise CertificateError(f"{name or written.name}: the export check failed: {why}; nothing was written") from None
        return core.fp32_twin(self.flax_model), torch_model

    def measure(self, flax_model, torch_model) -> dict:
        return measure_user(flax_model, torch_model, self.args, self.kwargs, rename=self.rename)


# ------------------------------------------------------------------ a family's model


def torch_model_of(path, fmt: str, description: dict, tensors: dict | None = None):
    """The torch_reference model of what was written at ``path``, built and filled from the file."""
    from flax_transformer.interop import checkpoints, hf, porting

    if fmt == "hf":
        if description["class"] == "TransformerForSequenceClassification":
            return hf.torch_classifier_from_pretrained(path)
        return hf.torch_from_pretrained(path)
    if fmt == "orbax":  # torch cannot read orbax: through the library's own reader and port
        return porting.flax_to_torch(checkpoints.load_orbax(path)).eval()
    model = checkpoints.build(description, framework="torch")
    if tensors is None:
        tensors = schema.read_tensors(path, fmt)
    model.load_state_dict(hf.torch_state(tensors))
    return model.eval()


def flax_model_of(path, fmt: str, description: dict, tensors: dict | None = None):
    """The Flax model of what was written at ``path`` (for a re-check: the exported model is gone)."""
    from flax_transformer.interop import checkpoints, hf, porting

    if fmt == "hf":
        if description["class"] == "TransformerForSequenceClassification":
            return hf.classifier_from_pretrained(path)
        return hf.from_pretrained(path)
    if fmt == "orbax":  # re-homed as the export's twin was, so the check's compiled code is shared
        return fp32_twin(checkpoints.load_orbax(path))
    model = checkpoints.build(description)  # as checkpoints.load, whatever the file's suffix
    porting.load_state_dict(model, tensors if tensors is not None else schema.read_tensors(path, fmt), strict=True)
    model.eval()
    return model


def fp32_twin(model, state: dict | None = None):
    """The exported model as a Flax model computing in float32 (eval mode), with the same values.

    The certificate is about the weights: a model that computes in bf16 is measured in fp32, so
    one tolerance holds; bf16 parameters widen to float32 exactly. A float32 model on one device
    is used as it is, through an eval-mode view (the caller's model keeps its mode; building a
    twin costs a trace of the whole model). Anything else is rebuilt from the numpy ``state``
    (torch names; default ``porting.state_dict(model)``), so sharded parameters never enter a
    computation here; pass ``state`` when the file holds other values (a bf16 export)."""
    from flax_transformer.interop import checkpoints, porting

    if state is None and type(model).__module__.startswith("torch_reference"):
        twin = porting.torch_to_flax(model)
        twin.eval()
        return twin
    return core.fp32_twin(model, compute_dtype=None if state is not None else model.init_kwargs().get("dtype"),
                          values_differ=state is not None,
                          build=lambda: checkpoints.build(checkpoints.describe(model)),
                          fill=lambda twin: porting.load_state_dict(
                              twin, porting.state_dict(model) if state is None else state, strict=True))


def measure(flax_model, torch_model, *, seed: int = schema.INPUTS["seed"], batch: int = schema.INPUTS["batch"],
            length: int = schema.INPUTS["length"]) -> dict:
    """{"inputs", "forward", "backward"}: ``flax_model`` against ``torch_model`` on example inputs.

    forward: the largest |torch - flax| over the outputs (``max_abs_err``), and relative to the
    outputs' scale ``max(1, max |torch output|)`` (``max_rel_err``, the one held to the tolerance).
    backward: the largest parameter gradient error relative to the gradient's scale
    (``compare.compare(..., grads=True)``). Both in fp32 with matmul precision "highest", against
    ``reports.TOLERANCE`` and ``certificate.schema.BACKWARD_TOLERANCE``; and both against a float64 torch copy of
    the model by ``bisect``'s budget rule (``float64``: JAX's and torch's errors, the budget).
    Any non-finite value, or anything not compared, fails."""
    import jax

    if getattr(flax_model, "input_spec", None) is None:  # a sub-module (an attention layer...)
        reason = f"not measured: {type(flax_model).__name__} is not a whole model (no input_spec() to draw inputs from)"
        return {"inputs": None, "forward": {"not_measured": reason}, "backward": {"not_measured": reason}}
    args = example_inputs(flax_model, seed=seed, batch=batch, length=length)
    inputs = {"seed": seed, "batch": batch, "length": length,
              "shapes": [None if a is None else list(np.shape(a)) for a in args],
              "drawn_by": "certificate_subjects.example_inputs (numpy default_rng(seed) token ids; the last row right-padded)"}
    lm = flax_model.input_spec().generates  # a language model: its next-token distributions too (measure.lm_agreement)
    with jax.default_matmul_precision("highest"):  # forward and backward, one compile
        report = compare(torch_model, flax_model, args, grads=True, seed=seed, lm=lm,
                         lm_mask=lm_mask(flax_model, args) if lm else None)
    return {"inputs": inputs} | schema.entries(report) | ({"lm": report.lm.to_dict()} if lm else {})


# ------------------------------------------------------------------ your own model


def _qualified(obj) -> tuple[str, str]:
    return type(obj).__module__, type(obj).__qualname__


def describe(torch_model, flax_model, *, reference: str | None = None, rename=None) -> dict:
    """The certificate's ``model`` field for a user's model and its torch reference."""
    module, name = _qualified(torch_model)
    flax_module, flax_name = _qualified(flax_model)
    return {"family": USER, "class": name, "module": module, "flax_class": flax_name, "flax_module": flax_module,
            "reference": reference, "rename": rename_record(rename)}


def rename_record(rename) -> list[list[str]]:
    """``rename`` as JSON: (regex, replacement) string pairs. A compiled regex with flags or a
    function replacement cannot be written down, so a certified export refuses it."""
    check_rename(rename)  # a bad regex: one line naming it
    out = []
    for i, pair in enumerate(rename or ()):
        pattern, replacement = pair
        if not isinstance(pattern, str) or not isinstance(replacement, str):
            raise ValueError(f"rename[{i}] must be two strings (regex, replacement) to be recorded in the "
                             f"certificate, got {pair!r}")
        out.append([pattern, replacement])
    return out


def _input_entry(value, where: str):
    if value is None:
        return None
    if isinstance(value, (bool, int, float)):  # Python scalars: passed to both frameworks as they are
        if isinstance(value, float) and not np.isfinite(value):
            raise ValueError(f"{where} is {value}: give finite numbers")
        return {"value": value}
    try:
        array = np.ascontiguousarray(to_numpy(value))  # torch tensors, JAX and numpy arrays
    except (TypeError, ValueError, RuntimeError):
        array = None
    if array is None or array.dtype == object or array.dtype.kind not in "biuf" and array.dtype.name != "bfloat16":
        raise ValueError(f"{where} is a {type(value).__name__}: a certified export's inputs are arrays, numbers "
                         "or None")
    return {"shape": list(array.shape), "dtype": str(array.dtype),
            "sha256": hashlib.sha256(array.tobytes()).hexdigest()}


def input_record(args, kwargs=None, drawn_by: str = "") -> dict:
    """``{"args", "kwargs", "drawn_by"}``: each input's shape, dtype and sha256 (or value, or null)."""
    kwargs = kwargs or {}
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise ValueError(f"inputs must be a tuple of the model's arguments, got {type(args).__name__}")
    if len(args) > MAX_INPUTS or len(kwargs) > MAX_INPUTS:
        raise ValueError(f"at most {MAX_INPUTS} arguments and {MAX_INPUTS} keyword arguments, not "
                         f"{len(args)} and {len(kwargs)}")
    return {"args": [_input_entry(a, f"inputs[{i}]") for i, a in enumerate(args)],
            "kwargs": {k: _input_entry(v, f"kwargs[{k!r}]") for k, v in kwargs.items()}, "drawn_by": drawn_by}


def torch_names(rename, torch_model):
    """``rename`` (torch names -> the Flax model's, as ``torch_to_flax`` and ``compare`` take it)
    turned round for ``flax_to_torch`` (the Flax model's -> torch's), by applying it to each of
    ``torch_model``'s keys: one pair that maps every renamed name back at once, so that names the
    pairs swap do not chain."""
    pairs = check_rename(rename)
    if not pairs:
        return None
    back = {}
    for key in torch_model.state_dict():
        back.setdefault(apply_rename(key, pairs), key)
    return [(re.compile(r"\A.*\Z", re.S), lambda m: back.get(m.group(0), m.group(0)))]


def fill_flax(model, tensors: dict) -> None:
    """An orbax export's Flax parameter tree (paths joined with "/") into ``model``, all or nothing."""
    import jax.numpy as jnp

    from flax_transformer.interop import porting

    params = porting.flax_params(model)
    given = {k.replace("/", "."): v for k, v in tensors.items()}
    missing, unexpected = sorted(params.keys() - given.keys()), sorted(given.keys() - params.keys())
    shapes = [f"{k} {list(np.shape(given[k]))} in the file, {list(p.shape)} in the model"
              for k, p in params.items() if k in given and tuple(np.shape(given[k])) != tuple(p.shape)]
    if missing or unexpected or shapes:
        problems = [f"{what}: {', '.join(keys[:5])}{' …' if len(keys) > 5 else ''}" for what, keys in
                    (("missing", missing), ("unexpected", unexpected), ("shapes differ", shapes)) if keys]
        raise ValueError(f"the orbax parameters do not fit {type(model).__name__}: {'; '.join(problems)}")
    for key, param in params.items():
        param.set_value(jnp.asarray(given[key], dtype=param.dtype))


def shared_ties(tensors: dict, torch_model) -> dict:
    """``tensors`` with the equal copies of each tensor that ``torch_model`` ties made one array (so
    porting places them once, as it does a torch state_dict's); copies that differ stay apart."""
    from flax_transformer.interop import porting

    out = dict(tensors)
    for group in porting.tied_keys(torch_model):
        given = [k for k in group if k in out]
        if given and all(np.array_equal(out[given[0]], out[k]) for k in given[1:]):
            for key in given[1:]:
                out[key] = out[given[0]]
    return out


def load_torch(torch_model, written: Path, fmt: str, tensors: dict, flax_model, rename, name: str | None = None):
    """``torch_model`` filled from the written file: strict ``load_state_dict`` (safetensors, torch), or
    orbax's Flax tree into a clone of ``flax_model`` and ``porting.flax_to_torch``."""
    from flax import nnx

    from flax_transformer.interop import hf, porting

    if fmt == "orbax":
        twin = nnx.clone(flax_model)
        fill_flax(twin, tensors)
        porting.flax_to_torch(twin, torch_model, rename=torch_names(rename, torch_model))
    else:
        try:
            torch_model.load_state_dict(hf.torch_state(tensors), strict=True)
        except RuntimeError as error:  # torch's strict load: missing, unexpected, mis-shaped keys
            why = brief(" ".join(str(error).split()), 600)  # torch's lines: which keys, which shapes
            raise ValueError(f"{name or written.name} does not load strictly into {type(torch_model).__name__}: "
                             f"{why}") from None
    return torch_model.eval()


def measure_user(flax_model, torch_model, args, kwargs=None, *, rename=None) -> dict:
    """{"forward", "backward"}: ``compare(torch_model, flax_model, args, kwargs, grads=True,
    rename=rename)`` in fp32 with matmul precision "highest", as ``measure``."""
    import jax

    with jax.default_matmul_precision("highest"):
        report = compare(torch_model, flax_model, tuple(args), dict(kwargs or {}), grads=True, rename=rename or None)
    return schema.entries(report)
