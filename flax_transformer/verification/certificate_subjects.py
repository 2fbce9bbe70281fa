"""What a certificate is about, its *subject*: how the flow of ``certificate`` (make, sidecar)
and ``certificate_check`` (re-check) describe, reload and measure it.

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
  (``measure_user``). The certificate then records, beside what every certificate records:

  * ``model``: ``{"family": "user", "class", "module"}`` of the torch reference, ``flax_class``,
    ``flax_module``, ``reference`` (the ``MODULE:FACTORY`` it was given as, else null) and
    ``rename`` (porting's ``[regex, replacement]`` pairs: torch names -> the Flax model's);
  * ``inputs``: ``{"args": [...], "kwargs": {...}, "drawn_by"}``, each input ``null``, a number
    (``{"value"}``) or an array's ``{"shape", "dtype", "sha256"}``, so that a re-check on other
    inputs is refused rather than compared with figures measured on these.

  ``certificate_check.recheck(path, pair="MODULE:FACTORY")`` re-checks it with the factory's models.

A PEFT adapter folder is the third subject (``certificate_peft.AdapterSubject``): its record is its
own, made through the same ``certificate.sidecar``.
"""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path

import numpy as np

from flax_transformer.interop.layer_kinds import apply_rename, check_rename
from flax_transformer.interop.values import to_numpy
from flax_transformer.verification import certificate as cert
from flax_transformer.verification import measure as core
from flax_transformer.verification import pairs
from flax_transformer.verification.certificate_schema import FORMATS, USER, USER_FORMATS, CertificateError, brief
from flax_transformer.verification.compare import compare

MAX_INPUTS = 16  # args, and kwargs: a model call with more is not one the certificate was made for


class FamilySubject(cert.ExportSubject):
    """A model of the library's families (``state``: the values the file holds where they differ
    from the model's: a bf16 export is certified on its bf16 values)."""

    formats = FORMATS
    reloaded = "reloaded in torch"

    def __init__(self, model, state: dict | None = None):
        self.model, self.state = model, state

    def describe(self) -> dict:
        from flax_transformer.interop import checkpoints

        return checkpoints.describe(self.model)

    def load(self, written: Path, fmt: str, description: dict, tensors: dict, name: str | None):
        reuse = tensors if fmt != "hf" else None  # the HF torch model reads the folder itself
        torch_model = torch_model_of(written, fmt, description, reuse)
        return fp32_twin(self.model, self.state), torch_model

    def measure(self, flax_model, torch_model) -> dict:
        return measure(flax_model, torch_model)


class UserSubject(cert.ExportSubject):
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
        tensors = cert.read_tensors(path, fmt)
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
    porting.load_state_dict(model, tensors if tensors is not None else cert.read_tensors(path, fmt), strict=True)
    model.eval()
    return model


def load_pair(path):
    """(Flax model, torch model) of a certified export, each read from the files; a bare torch
    ``.pt`` needs no ``--family``/``--class``/``--config`` here: its certificate describes it."""
    record = cert.read(path)
    if record["model"]["family"] == USER:  # the library cannot build it: the user's factory does
        model = record["model"]
        raise CertificateError(f"{path} is an export of your own model ({model['module']}.{model['class']}): the "
                               "library cannot build it; re-check it with its factory (certificate_check.recheck("
                               "PATH, pair='MODULE:FACTORY'), flax-transformer verify --checkpoint PATH --pair "
                               "MODULE:FACTORY), or bisect that pair with --pair")
    # the Flax model first: built abstract and loaded strictly, it holds the description to the file's
    # tensors before torch allocates anything from it
    flax_model = flax_model_of(path, record["format"], record["model"])
    return flax_model, torch_model_of(path, record["format"], record["model"])


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


def measure(flax_model, torch_model, *, seed: int = cert.INPUTS["seed"], batch: int = cert.INPUTS["batch"],
            length: int = cert.INPUTS["length"]) -> dict:
    """{"inputs", "forward", "backward"}: ``flax_model`` against ``torch_model`` on example inputs.

    forward: the largest |torch - flax| over the outputs (``max_abs_err``), and relative to the
    outputs' scale ``max(1, max |torch output|)`` (``max_rel_err``, the one held to the tolerance).
    backward: the largest parameter gradient error relative to the gradient's scale
    (``compare.compare(..., grads=True)``). Both in fp32 with matmul precision "highest", against
    ``reports.TOLERANCE`` and ``certificate.BACKWARD_TOLERANCE``; and both against a float64 torch copy of
    the model by ``bisect``'s budget rule (``float64``: JAX's and torch's errors, the budget).
    Any non-finite value, or anything not compared, fails."""
    import jax

    if getattr(flax_model, "input_spec", None) is None:  # a sub-module (an attention layer...)
        reason = f"not measured: {type(flax_model).__name__} is not a whole model (no input_spec() to draw inputs from)"
        return {"inputs": None, "forward": {"not_measured": reason}, "backward": {"not_measured": reason}}
    args = pairs.example_inputs(flax_model, seed=seed, batch=batch, length=length)
    inputs = {"seed": seed, "batch": batch, "length": length,
              "shapes": [None if a is None else list(np.shape(a)) for a in args],
              "drawn_by": "pairs.example_inputs (numpy default_rng(seed) token ids; the last row right-padded)"}
    lm = flax_model.input_spec().generates  # a language model: its next-token distributions too (measure.lm_agreement)
    with jax.default_matmul_precision("highest"):  # forward and backward, one compile
        report = compare(torch_model, flax_model, args, grads=True, seed=seed, lm=lm,
                         lm_mask=pairs.lm_mask(flax_model, args) if lm else None)
    return {"inputs": inputs} | cert.entries(report) | ({"lm": report.lm.to_dict()} if lm else {})


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
    return cert.entries(report)
