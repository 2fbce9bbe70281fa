"""The certificate of a user's own model: an NNX model the library does not know, certified
against the torch model it twins (its *reference*).

``export.save_safetensors/save_torch/save_orbax(flax_model, path, reference=...)`` write the
reference's ``state_dict()`` names (safetensors, torch) or the Flax parameter tree (orbax). The
check reads the written file back into a fresh copy of the reference (strict ``load_state_dict``;
orbax through the Flax model and ``porting.flax_to_torch``) and compares it with the Flax model by
``compare(..., grads=True, rename=...)`` on the given inputs. The certificate then records, beside
what every certificate records (``certificate``):

* ``model``: ``{"family": "user", "class", "module"}`` of the torch reference, ``flax_class``,
  ``flax_module``, ``reference`` (the ``MODULE:FACTORY`` it was given as, else null) and
  ``rename`` (porting's ``[regex, replacement]`` pairs: torch names -> the Flax model's);
* ``inputs``: ``{"args": [...], "kwargs": {...}, "drawn_by"}``, each input ``null``, a number
  (``{"value"}``) or an array's ``{"shape", "dtype", "sha256"}``, so that a re-check on other
  inputs is refused rather than compared with figures measured on these.

``certificate_check.recheck(path, pair="MODULE:FACTORY")`` re-checks it with the factory's models.
"""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path

import numpy as np

from flax_transformer.interop import files
from flax_transformer.interop.layer_kinds import apply_rename, check_rename
from flax_transformer.interop.values import to_numpy
from flax_transformer.verification import certificate as cert
from flax_transformer.verification.certificate_schema import USER, CertificateError
from flax_transformer.verification.compare import compare

FORMATS = ("safetensors", "torch", "orbax")
MAX_INPUTS = 16  # args, and kwargs: a model call with more is not one the certificate was made for


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

    params = porting._flax_params(model)
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
            why = cert._brief(" ".join(str(error).split()), 600)  # torch's lines: which keys, which shapes
            raise ValueError(f"{name or written.name} does not load strictly into {type(torch_model).__name__}: "
                             f"{why}") from None
    return torch_model.eval()


def fp32_view(model):
    """The Flax model in eval mode, computing in float32: an eval-mode view of a float32 model (the
    caller's keeps its mode), else a clone with its parameters widened to float32."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param))):
        return nnx.view(model, deterministic=True, use_running_average=True, raise_if_not_found=False)
    twin = nnx.clone(model)
    for _, variable in nnx.iter_graph(twin):
        if isinstance(variable, nnx.Param) and jnp.issubdtype(variable.dtype, jnp.floating):
            variable.set_value(jnp.asarray(variable[...], jnp.float32))  # bf16 widens exactly
    twin.eval()
    return twin


def measure(flax_model, torch_model, args, kwargs=None, *, rename=None) -> dict:
    """{"forward", "backward"}: ``compare(torch_model, flax_model, args, kwargs, grads=True,
    rename=rename)`` in fp32 with matmul precision "highest", as ``certificate.measure``."""
    import jax

    with jax.default_matmul_precision("highest"):
        report = compare(torch_model, flax_model, tuple(args), dict(kwargs or {}), grads=True, rename=rename or None)
    return cert._entries(report)


def make(written, fmt: str, flax_model, reference, *, name: str | None = None, spec: str | None = None,
         rename=None, args=(), kwargs=None, drawn_by: str = "") -> dict:
    """The certificate of a user's model just written at ``written`` (a temporary path): measured
    against a fresh copy of ``reference`` filled from the file. ``CertificateError`` when it fails."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    written = Path(written)
    tensors = cert.read_tensors(written, fmt)
    record = cert._skeleton(written, fmt, describe(reference, flax_model, reference=spec, rename=rename), tensors, name)
    record["inputs"] = input_record(args, kwargs, drawn_by)
    try:
        torch_model = load_torch(copy.deepcopy(reference), written, fmt, tensors, flax_model, rename, name)
    except ValueError as error:  # porting's StateDictError too
        why = cert._brief(" ".join(str(error).split()), 600)
        raise CertificateError(f"{name or written.name}: the export check failed: {why}; nothing was written") from None
    del tensors
    record |= measure(fp32_view(flax_model), torch_model, args, kwargs, rename=rename)
    cert._refuse_failed(record, name or written.name, f"reloaded into a fresh copy of {type(reference).__name__}")
    return record


def sidecar(fmt: str, flax_model, reference, **measured) -> files.BeforeSwap:
    """The writers' ``before_swap`` hook for a user's model (``make``'s keyword arguments)."""

    def certify(tmp: Path, final: Path) -> dict[str, bytes]:
        record = make(tmp, fmt, flax_model, reference, name=final.name, **measured)
        file = cert.FOLDER_NAME if fmt == "orbax" else final.name + cert.FILE_SUFFIX
        return {file: cert.to_json(record).encode("utf-8")}
    return certify
