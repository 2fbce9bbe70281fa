"""The verification certificate: evidence, written with every export, that the weights were checked.

Every certified export (``export.save_safetensors``/``save_torch``/``save_orbax``/``save_pretrained``,
so ``port`` and the trainers' ``--export-torch``/``--export-hf``) reloads what it wrote as a torch model, compares it with the Flax model being exported on
example inputs (outputs, and every parameter's gradient), and records:

* the sha256 of every tensor (and of the files that describe the model),
* the forward and backward errors and the tolerance, and the inputs they were measured on,
* for a language model, its next-token agreement: KL(torch || JAX) and top-1/top-5 (``lm``, from
  ``lm_agreement``; optional, so certificates written before it still verify),
* the tensors' dtypes and the matmul precision,
* the versions of jax, flax, torch, transformers (...) and the platform.

A folder (HF, orbax) holds it as ``verification.json``, written inside the folder's atomic
swap. A file ``x.safetensors`` / ``x.pt`` has it beside as ``x.safetensors.verification.json``:
two files cannot be swapped together, so the certificate goes in first and the weights
second. An interrupted export can therefore leave old weights under a new certificate, never
new weights without one, and ``recheck`` reports that mismatch (the file's hash is recorded).

``certificate_check.recheck(path)`` (``flax-transformer verify --checkpoint PATH``) checks the certificate
field by field (``read``, ``validate``: one line naming the file and the field), recomputes
the hashes (a changed tensor is named), reruns the measurement on the recorded inputs, and
compares versions (see its ``Report`` for what fails and what is a note).

This module makes and reads certificates; it writes no file. The writers of ``interop`` take
its ``sidecar`` hook, and ``export`` puts the two together. A user's own model, certified against
its torch reference, adds its own fields: ``certificate_user``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
from importlib import metadata
from pathlib import Path

import numpy as np

from flax_transformer.interop import files
from flax_transformer.verification import pairs
from flax_transformer.verification.certificate_schema import (  # noqa: F401 (re-exported: certificate.X as before)
    DTYPES,
    FORMAT,
    FORMATS,
    INPUT_BOUNDS,
    MAX_BYTES,
    MAX_TOKENS,
    USER,
    CertificateError,
    _brief,
    _name,
    validate,
)
from flax_transformer.verification.compare import TOLERANCE, compare, grads_row

FOLDER_NAME = "verification.json"  # inside an HF or orbax folder
FILE_SUFFIX = ".verification.json"  # beside a single file: x.safetensors.verification.json
INPUTS = {"seed": 0, "batch": 2, "length": 9}  # one small batch: the whole check stays cheap
# A parameter's gradient sums over every position of the batch (an embedding's over its rows too),
# and torch and XLA sum in different orders: with real weights the fp32 rounding grows past 1e-5
# (all-MiniLM-L6-v2: 0.9e-5 to 1.7e-5 on three seeds, worst on attention queries). A porting bug
# (a transpose, a wrong bias) gives relative errors of order 1, so 1e-4 still catches every one.
BACKWARD_TOLERANCE = 1e-4
# The forward error is relative to the outputs' scale, max(1, max |torch output|), as the backward's
# is to the gradient's: fp32 rounding grows with the values (a GPT-2's logits up to ~80 differ by
# 3e-5 in absolute terms), so an absolute 1e-5 would refuse a correct model with large outputs.
FORWARD_RELATIVE_TO = "max(1, max|output|)"  # the torch output
# A re-check in the same environment fails on an error above max(2 x recorded, recorded + 1e-7):
# thread counts and reduction order can move fp32 rounding a little between two correct runs.
RECHECK_FACTOR, RECHECK_SLACK = 2.0, 1e-7
VERSIONED = ("flax_transformer", "jax", "jaxlib", "flax", "torch", "transformers", "numpy", "safetensors",
             "orbax-checkpoint")



def path_for(path) -> Path:
    """Where the certificate of the export ``path`` lives (it need not exist)."""
    path = Path(path)
    return path / FOLDER_NAME if path.is_dir() else path.with_name(path.name + FILE_SUFFIX)


def find(path) -> Path | None:
    """The certificate of ``path`` if it has one."""
    cert = path_for(path)
    return cert if cert.is_file() else None


# ------------------------------------------------------------------ what is recorded


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_tensors(path, fmt: str) -> dict[str, np.ndarray]:
    """Every tensor of a written export, under the names it has in the file (numpy; bf16 stays bf16)."""
    from flax_transformer.interop import checkpoints, hf, orbax_quiet

    path = Path(path)
    if fmt == "safetensors":
        return checkpoints.read_safetensors(path)[0]
    if fmt == "torch":  # by content: the temporary file being checked has no suffix
        return hf._torch_pickle(path)
    if fmt == "hf":
        return hf.read_weights(path)
    import jax
    import orbax.checkpoint as ocp

    with orbax_quiet.errors_raised_not_logged(wait_limit_s=0.0), ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(path.absolute() / "params")
    # Flax paths joined with "/": tblocks/0/ff/0/kernel
    return {"/".join(str(getattr(k, "key", k)) for k in keys): np.asarray(v)
            for keys, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tensor_hashes(tensors: dict) -> dict[str, dict]:
    """{name: {"sha256" of the C-order bytes, "dtype", "shape"}}."""
    out = {}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        out[name] = {"sha256": _sha256(a.tobytes()), "dtype": str(a.dtype), "shape": list(a.shape)}
    return out


def file_hashes(path, fmt: str, name: str | None = None) -> dict[str, str]:
    """sha256 of the weights file of a single-file export (under its final ``name``), or of a
    folder's files that describe the model (its tensors are hashed one by one)."""
    path = Path(path)
    if fmt in ("safetensors", "torch"):
        return {name or path.name: files.sha256_file(path)}
    if fmt == "orbax":  # orbax's own files carry no weights of their own: its tensors are hashed one by one
        return {n: files.sha256_file(path / n) for n in ("flax_transformer.json",) if (path / n).is_file()}
    return {p.name: files.sha256_file(p) for p in sorted(path.iterdir())  # config, weights, a sharded index
            if p.is_file() and (p.name == "config.json" or p.suffix in (".safetensors", ".bin")
                                or p.name.endswith(".index.json"))}


def versions() -> dict[str, str | None]:
    """Installed versions (None: not installed). torch counts only if it imports."""
    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    if out["torch"] is not None and _torch() is None:
        out["torch"] = None
    return out


def platform_info() -> dict[str, str]:
    import jax

    device = jax.devices()[0]
    return {"python": platform.python_version(), "system": platform.platform(), "machine": platform.machine(),
            "jax_backend": jax.default_backend(), "device": getattr(device, "device_kind", str(device))}


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


# ------------------------------------------------------------------------ measuring


FLOAT64_RULE = "jax_err <= max(10 x torch_err, 16 x eps32 x max|float64|) (bisect.budget)"


def _float64(row) -> dict:
    """A row's errors against the float64 torch copy, its budget and whether JAX is within it."""
    return {"jax_err": row.jax_err, "torch_err": row.torch_err, "budget": row.budget, "rule": FLOAT64_RULE,
            "passed": row.within_budget is not False and not row.skipped}


def _torch_model(path, fmt: str, description: dict, tensors: dict | None = None):
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
        tensors = read_tensors(path, fmt)
    model.load_state_dict(hf.torch_state(tensors))
    return model.eval()


def _flax_model(path, fmt: str, description: dict, tensors: dict | None = None):
    """The Flax model of what was written at ``path`` (for a re-check: the exported model is gone)."""
    from flax_transformer.interop import checkpoints, hf, porting

    if fmt == "hf":
        if description["class"] == "TransformerForSequenceClassification":
            return hf.classifier_from_pretrained(path)
        return hf.from_pretrained(path)
    if fmt == "orbax":  # re-homed as the export's twin was, so the check's compiled code is shared
        return fp32_twin(checkpoints.load_orbax(path))
    model = checkpoints.build(description)  # as checkpoints.load, whatever the file's suffix
    porting.load_state_dict(model, tensors if tensors is not None else read_tensors(path, fmt), strict=True)
    model.eval()
    return model


def load_pair(path):
    """(Flax model, torch model) of a certified export, each read from the files; a bare torch
    ``.pt`` needs no ``--family``/``--class``/``--config`` here: its certificate describes it."""
    record = read(path)
    if record["model"]["family"] == USER:  # the library cannot build it: the user's factory does
        model = record["model"]
        raise CertificateError(f"{path} is an export of your own model ({model['module']}.{model['class']}): the "
                               "library cannot build it; re-check it with its factory (certificate_check.recheck("
                               "PATH, pair='MODULE:FACTORY'), flax-transformer verify --checkpoint PATH --pair "
                               "MODULE:FACTORY), or bisect that pair with --pair")
    # the Flax model first: built abstract and loaded strictly, it holds the description to the file's
    # tensors before torch allocates anything from it
    flax_model = _flax_model(path, record["format"], record["model"])
    return flax_model, _torch_model(path, record["format"], record["model"])


def fp32_twin(model, state: dict | None = None):
    """The exported model as a Flax model computing in float32 (eval mode), with the same values.

    The certificate is about the weights: a model that computes in bf16 is measured in fp32, so
    one tolerance holds; bf16 parameters widen to float32 exactly. A float32 model on one device
    is used as it is, through an eval-mode view (the caller's model keeps its mode; building a
    twin costs a trace of the whole model). Anything else is rebuilt from the numpy ``state``
    (torch names; default ``porting.state_dict(model)``), so sharded parameters never enter a
    computation here; pass ``state`` when the file holds other values (a bf16 export)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from flax_transformer.interop import checkpoints, porting

    if state is None and type(model).__module__.startswith("torch_reference"):
        twin = porting.torch_to_flax(model)
        twin.eval()
        return twin
    if state is None:
        dtype = model.init_kwargs().get("dtype")
        params = jax.tree.leaves(nnx.state(model, nnx.Param))
        if (dtype is None or jnp.dtype(dtype) == jnp.float32) and all(
                p.dtype == jnp.float32 and p.is_fully_addressable and len(p.sharding.device_set) == 1 for p in params):
            return nnx.view(model, deterministic=True, use_running_average=True, raise_if_not_found=False)
        state = porting.state_dict(model)
    twin = checkpoints.build(checkpoints.describe(model))
    porting.load_state_dict(twin, state, strict=True)
    twin.eval()  # a copy: the caller's model keeps its mode
    return twin


def measure(flax_model, torch_model, *, seed: int = INPUTS["seed"], batch: int = INPUTS["batch"],
            length: int = INPUTS["length"]) -> dict:
    """{"inputs", "forward", "backward"}: ``flax_model`` against ``torch_model`` on example inputs.

    forward: the largest |torch - flax| over the outputs (``max_abs_err``), and relative to the
    outputs' scale ``max(1, max |torch output|)`` (``max_rel_err``, the one held to the tolerance).
    backward: the largest parameter gradient error relative to the gradient's scale
    (``verify.compare(..., grads=True)``). Both in fp32 with matmul precision "highest", against
    ``compare.TOLERANCE`` and ``BACKWARD_TOLERANCE``; and both against a float64 torch copy of
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
    lm = flax_model.input_spec().generates  # a language model: its next-token distributions too (lm_agreement)
    with jax.default_matmul_precision("highest"):  # forward and backward, one compile
        report = compare(torch_model, flax_model, args, grads=True, seed=seed, lm=lm,
                         lm_mask=pairs.lm_mask(flax_model, args) if lm else None)
    return {"inputs": inputs} | _entries(report) | ({"lm": report.lm.to_dict()} if lm else {})


def _entries(report) -> dict:
    """{"forward", "backward"} of a certificate from ``compare(..., grads=True)``'s report."""
    err, finite, scale, rel = float(report.max_abs_err), bool(report.finite), max(1.0, report.scale), report.max_rel_err
    grads = grads_row(report, "", "", "", "grads")
    grad_err, grad_finite = float(report.grad_err), bool(report.grad_finite)
    forward64, backward64 = _float64(report.rows[0]), _float64(grads)
    forward = {"max_abs_err": err, "scale": scale, "max_rel_err": rel, "relative_to": FORWARD_RELATIVE_TO,
               "finite": finite, "tolerance": TOLERANCE, "float64": forward64,
               "passed": finite and rel <= TOLERANCE and forward64["passed"] and not report.rows[0].mismatched}
    backward = {"max_rel_err": grad_err, "finite": grad_finite, "worst": str(report.worst_grad_key),
                "tolerance": BACKWARD_TOLERANCE, "float64": backward64,
                "passed": grad_finite and grad_err <= BACKWARD_TOLERANCE and backward64["passed"]}
    # what was not compared, or differs outright (a user's model: an output leaf, a gradient with no twin)
    for entry, row in ((forward, report.rows[0]), (backward, grads)):
        if row.skipped or row.mismatched:
            entry["not_compared"] = _brief("; ".join(filter(None, (row.skipped, row.mismatched))), 500)
    return {"forward": forward, "backward": backward}


def _not_measured(reason: str) -> dict:
    return {"inputs": dict(INPUTS), "forward": {"not_measured": reason}, "backward": {"not_measured": reason}}


def _skeleton(written: Path, fmt: str, description: dict, tensors: dict, name: str | None) -> dict:
    """Everything a certificate records but the measurement."""
    return {"certificate": FORMAT, "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "format": fmt, "model": description, "files": file_hashes(written, fmt, name),
            "tensors": tensor_hashes(tensors),
            "dtypes": {"tensors": sorted({str(np.asarray(t).dtype) for t in tensors.values()}), "compute": "float32"},
            "matmul_precision": "highest", "versions": versions(), "platform": platform_info()}


def _refuse_failed(record: dict, label: str, reloaded: str) -> None:
    """``CertificateError`` naming every failed entry of ``record``: the caller then writes nothing."""
    failed = [f"{k} {_value(v)} (tolerance {v['tolerance']:g}){_float64_note(v)}{_not_compared_note(v)}"
              for k in ("forward", "backward") if not (v := record[k]).get("passed", True)]
    if not record.get("lm", {}).get("passed", True):
        failed.append(lm_line(record["lm"]))
    if failed:
        raise CertificateError(f"{label}: the export check failed: {', '.join(failed)} between the model and what "
                               f"was written, {reloaded}; nothing was written (certify=False writes without the check)")


def make(written, fmt: str, model, *, name: str | None = None, state: dict | None = None) -> dict:
    """The certificate of the export just written at ``written`` (a temporary path) of ``model``.

    Raises ``CertificateError`` when the check fails: the caller then writes nothing."""
    from flax_transformer.interop import checkpoints

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    written = Path(written)
    description = checkpoints.describe(model)
    tensors = read_tensors(written, fmt)
    reuse = tensors if fmt != "hf" else None  # the HF torch model reads the folder itself
    record = _skeleton(written, fmt, description, tensors, name)
    del tensors  # hashed: not held through the measurement
    if _torch() is None:
        record |= _not_measured("not measured: torch not installed")
    else:
        torch_model = _torch_model(written, fmt, description, reuse)
        reuse = None  # copied into the torch model
        record |= measure(fp32_twin(model, state), torch_model)
    _refuse_failed(record, name or written.name, "reloaded in torch")
    return record


def _error(entry: dict, relative: bool = True) -> float:
    """The error held to the tolerance: relative where recorded (a forward entry written before
    the forward error was relative has ``max_abs_err`` alone), else the absolute one."""
    if relative and "max_rel_err" in entry:
        return float(entry["max_rel_err"])
    return float(entry.get("max_abs_err", entry.get("max_rel_err")))


def _float64_note(entry: dict) -> str:
    """"" when the entry met the float64 rule (or has none: certificates before it), else the figures."""
    f = entry.get("float64")
    if not f or f.get("passed", True):
        return ""
    figures = (f"JAX {f['jax_err']:.2e} vs torch {f['torch_err']:.2e} against float64, budget {f['budget']:.2e}"
               if f.get("budget") is not None else "not measured")
    return f"; float64 rule failed: {figures}"


def _not_compared_note(entry: dict) -> str:
    return f"; not compared: {entry['not_compared']}" if entry.get("not_compared") else ""


def _value(entry: dict, relative: bool = True) -> str:
    if "not_measured" in entry:
        return entry["not_measured"]
    return f"{_error(entry, relative):.2e}" + ("" if entry["finite"] else " (NaN/inf)")


def lm_line(entry: dict) -> str:
    """A certificate's ``lm`` entry (``lm_agreement.LMAgreement.to_dict``) in one line."""
    if not entry.get("measured", True) or "not_measured" in entry:
        return f"LM agreement not measured: {entry.get('reason') or entry.get('not_measured')}"
    gates = entry["gates"]
    return (f"LM KL(torch || JAX) mean {entry['kl_mean']:.2e}, max {entry['kl_max']:.2e} over {entry['tokens']} "
            f"tokens (gate {gates['kl_max']:g}), top-1 {entry['top1']:.4f}, top-5 {entry['top5']:.4f} (gates "
            f"{gates['top1']:g}, {gates['top5']:g})")


def to_json(record: dict) -> str:
    return json.dumps(record, indent=1) + "\n"


# ---------------------------------------------------------------------- the writers' hook


def sidecar(fmt: str, model, *, state: dict | None = None) -> files.BeforeSwap:
    """The writers' ``before_swap`` hook (``files.BeforeSwap``) that certifies an export of ``model``:
    it checks the finished temporary output (raising ``CertificateError``, so nothing is written,
    when the check fails) and returns the certificate to go with it: ``verification.json`` inside a
    folder, ``NAME.verification.json`` beside a file. ``state``: the values the file holds where they
    differ from the model's (a bf16 export is certified on its bf16 values)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")

    def certify(tmp: Path, final: Path) -> dict[str, bytes]:
        record = make(tmp, fmt, model, name=final.name, state=state)
        name = FOLDER_NAME if fmt in ("orbax", "hf") else final.name + FILE_SUFFIX
        return {name: to_json(record).encode("utf-8")}
    return certify


# ---------------------------------------------------------------------------- re-check


def read(path) -> dict:
    """The certificate of ``path``, read (at most ``MAX_BYTES``) and checked field by field against
    the schema (``validate``) before anything uses it: ``CertificateError`` otherwise, one line
    naming the file and the field."""
    cert = path_for(path)
    if not cert.is_file():
        raise CertificateError(f"{path} has no certificate ({cert.name})")
    size = cert.stat().st_size
    if size > MAX_BYTES:  # refused unread: a certificate of any model this library writes is far smaller
        raise CertificateError(f"{cert}: {size} bytes, more than a certificate's limit of {MAX_BYTES} "
                               f"({MAX_BYTES >> 20} MiB); not read")
    with open(cert, "rb") as f:
        data = f.read(MAX_BYTES + 1)  # bounded even if the file grew since stat
    if len(data) > MAX_BYTES:
        raise CertificateError(f"{cert}: more than a certificate's limit of {MAX_BYTES} bytes; not read")
    try:
        record = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as error:  # JSONDecodeError, too many digits, nesting
        raise CertificateError(f"{cert} is not valid JSON: {_brief(error)}") from None
    return validate(record, cert)
