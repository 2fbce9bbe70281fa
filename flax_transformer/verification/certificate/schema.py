"""The certificate's record: what a certificate holds (every tensor: ``read_tensors``, ``tensor_hashes``;
``file_hashes``, ``versions``, ``platform_info``; the entries in words: ``value_of``, ``float64_note``,
``lm_line``), and its schema: ``validate(record, cert)`` checks every field before anything uses it,
raising ``CertificateError`` naming the file and the field. ``certificate`` is the flow."""

from __future__ import annotations

import hashlib
import json
import math
import platform
import re
from importlib import metadata
from pathlib import Path

import numpy as np

from flax_transformer.interop import files
from flax_transformer.verification.precision import FP32
from flax_transformer.verification.reports import TOLERANCE, grads_row

FORMAT = "flax_transformer verification certificate 1"
FORMATS = ("safetensors", "torch", "orbax", "hf")
USER = "user"  # model.family of a user's own model, certified against its torch reference (certificate.subjects)
USER_FORMATS = ("safetensors", "torch", "orbax")
VERSIONED = ("flax_transformer", "jax", "jaxlib", "flax", "torch", "transformers", "numpy", "safetensors",
             "orbax-checkpoint")


class CertificateError(ValueError):
    """An export failed its check (nothing was written), or a certificate cannot be read."""


# ------------------------------------------------------------------ what is recorded


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_tensors(path, fmt: str) -> dict[str, np.ndarray]:
    """Every tensor of a written export, under the names it has in the file (numpy; bf16 stays bf16)."""
    from flax_transformer.interop import checkpoints, hf, orbax_quiet, safetensors_io

    path = Path(path)
    if fmt == "safetensors":
        return checkpoints.read_safetensors(path)[0]
    if fmt == "torch":  # by content: the temporary file being checked has no suffix
        return safetensors_io.read_torch_pickle(path)
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
        out[name] = {"sha256": sha256(a.tobytes()), "dtype": str(a.dtype), "shape": list(a.shape)}
    return out


def file_hashes(path, fmt: str, name: str | None = None) -> dict[str, str]:
    """sha256 of a single-file export (under its final ``name``), or of a folder's model-describing files."""
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
    if out["torch"] is not None and torch_available() is None:
        out["torch"] = None
    return out


def platform_info() -> dict[str, str]:
    import jax

    device = jax.devices()[0]
    return {"python": platform.python_version(), "system": platform.platform(), "machine": platform.machine(),
            "jax_backend": jax.default_backend(), "device": getattr(device, "device_kind", str(device))}


def torch_available():
    """torch, if it imports; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch


# ------------------------------------------------------------------ what is measured


INPUTS = {"seed": 0, "batch": 2, "length": 9}  # one small batch: the whole check stays cheap
# A gradient sums over the batch in torch's and XLA's orders: with real weights fp32 rounding passes 1e-5
# (all-MiniLM-L6-v2: 0.9e-5 to 1.7e-5); a porting bug gives relative errors of order 1, caught at 1e-4.
BACKWARD_TOLERANCE = 1e-4
# relative to the outputs' scale, as the backward's: a GPT-2's logits up to ~80 differ by 3e-5 absolute
FORWARD_RELATIVE_TO = "max(1, max|output|)"  # the torch output


FLOAT64_RULE = FP32.formula() + " (precision.budget)"  # the rule as a certificate records it


def float64_entry(row) -> dict:
    """A row's errors against the float64 torch copy, its budget and whether JAX is within it."""
    return {"jax_err": row.jax_err, "torch_err": row.torch_err, "budget": row.budget, "rule": FLOAT64_RULE,
            "passed": row.within_budget is not False and not row.skipped}


def entries(report) -> dict:
    """{"forward", "backward"} of a certificate from ``compare(..., grads=True)``'s report."""
    err, finite, scale, rel = float(report.max_abs_err), bool(report.finite), max(1.0, report.scale), report.max_rel_err
    grads = grads_row(report, "", "", "", "grads")
    grad_err, grad_finite = float(report.grad_err), bool(report.grad_finite)
    forward64, backward64 = float64_entry(report.rows[0]), float64_entry(grads)
    forward = {"max_abs_err": err, "scale": scale, "max_rel_err": rel, "relative_to": FORWARD_RELATIVE_TO,
               "finite": finite, "tolerance": TOLERANCE, "float64": forward64,
               "passed": finite and rel <= TOLERANCE and forward64["passed"] and not report.rows[0].mismatched}
    backward = {"max_rel_err": grad_err, "finite": grad_finite, "worst": str(report.worst_grad_key),
                "tolerance": BACKWARD_TOLERANCE, "float64": backward64,
                "passed": grad_finite and grad_err <= BACKWARD_TOLERANCE and backward64["passed"]}
    # what was not compared, or differs outright (a user's model: an output leaf, a gradient with no twin)
    for entry, row in ((forward, report.rows[0]), (backward, grads)):
        if row.skipped or row.mismatched:
            entry["not_compared"] = brief("; ".join(filter(None, (row.skipped, row.mismatched))), 500)
    return {"forward": forward, "backward": backward}


class ExportSubject:
    """What an export's certificate is about (``certificate.subjects``): ``formats``; ``describe()``
    (its ``model``), ``inputs()`` (recorded before the measurement), ``load(written, fmt, description,
    tensors, name)`` (the (Flax, torch) pair of what was written), ``measure(flax_model, torch_model)``
    (``inputs``, ``forward``, ``backward``, ``lm``, ``reader``); ``reloaded`` says how. A subject whose
    record is its own (a PEFT adapter) gives ``record(written, fmt, final)``; ``certificate.make`` the others'."""

    formats: tuple[str, ...] = ()
    reloaded = "reloaded in torch"
    needs_torch = True  # without torch the check is recorded as not measured

    def describe(self) -> dict:
        raise NotImplementedError

    def inputs(self) -> dict:
        return {}

    def load(self, written: Path, fmt: str, description: dict, tensors: dict, name: str | None):
        raise NotImplementedError

    def measure(self, flax_model, torch_model) -> dict:
        raise NotImplementedError

    record = None  # or record(written, fmt, final): the certificate of what was written, to go in at final


# ------------------------------------------------------------- a record in words


def error_of(entry: dict, relative: bool = True) -> float:
    """The error held to the tolerance: relative where recorded (a forward entry written before
    the forward error was relative has ``max_abs_err`` alone), else the absolute one."""
    if relative and "max_rel_err" in entry:
        return float(entry["max_rel_err"])
    return float(entry.get("max_abs_err", entry.get("max_rel_err")))


def float64_note(entry: dict) -> str:
    """"" when the entry met the float64 rule (or has none: certificates before it), else the figures."""
    f = entry.get("float64")
    if not f or f.get("passed", True):
        return ""
    figures = (f"JAX {f['jax_err']:.2e} vs torch {f['torch_err']:.2e} against float64, budget {f['budget']:.2e}"
               if f.get("budget") is not None else "not measured")
    return f"; float64 rule failed: {figures}"


def not_compared_note(entry: dict) -> str:
    return f"; not compared: {entry['not_compared']}" if entry.get("not_compared") else ""


def value_of(entry: dict, relative: bool = True) -> str:
    if "not_measured" in entry:
        return entry["not_measured"]
    return f"{error_of(entry, relative):.2e}" + ("" if entry["finite"] else " (NaN/inf)")


def lm_line(entry: dict) -> str:
    """A certificate's ``lm`` entry (``measure.LMAgreement.to_dict``) in one line."""
    if not entry.get("measured", True) or "not_measured" in entry:
        return f"LM agreement not measured: {entry.get('reason') or entry.get('not_measured')}"
    gates = entry["gates"]
    return (f"LM KL(torch || JAX) mean {entry['kl_mean']:.2e}, max {entry['kl_max']:.2e} over {entry['tokens']} "
            f"tokens (gate {gates['kl_max']:g}), top-1 {entry['top1']:.4f}, top-5 {entry['top5']:.4f} (gates "
            f"{gates['top1']:g}, {gates['top5']:g})")


# --------------------------------------------------------------------------- the schema

MAX_BYTES = 16 << 20  # 16 MiB: all-MiniLM-L6-v2's certificate is ~40 KB; a 1000-layer model's stays under 16 MiB
# the recorded inputs' bounds keep a tampered certificate from driving the re-check's allocation
INPUT_BOUNDS = {"seed": (0, 2**32 - 1), "batch": (1, 64), "length": (1, 4096)}  # seed: a random key keeps 32 bits
MAX_TOKENS = 4096  # batch x length
DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                    "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128"})
MAX_DIMS, MAX_ELEMENTS = 8, 2**40  # a tensor's shape: at most 8 dimensions, 2**40 elements
MAX_TENSORS, MAX_FILES, MAX_TEXT = 200_000, 10_000, 1024
MAX_RENAMES, MAX_INPUTS = 256, 16  # a user model's rename pairs; its call's args (and kwargs)
_HEX = frozenset("0123456789abcdef")


def brief(text, limit: int = 200) -> str:
    """``text``'s first line, cut to ``limit`` characters (for messages that name things from a file)."""
    lines = str(text).strip().splitlines() or [""]
    line = lines[0]
    return line if len(line) <= limit else line[:limit] + f"… ({len(line) - limit} more characters)"


def key_name(key) -> str:
    """A key from a file, shown: ``repr``, cut to 80 characters."""
    return repr(key) if len(repr(key)) <= 80 else repr(key)[:80] + "…"


class _Schema:
    """Checks of one certificate's fields: each failure is a ``CertificateError`` naming the file and the field."""

    def __init__(self, cert):
        self.cert = cert

    def fail(self, field: str, why: str):
        raise CertificateError(f"{self.cert}: field {field}: {why}")

    def kind(self, field, value, kind, what: str):
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            self.fail(field, f"{what}, not {_json_type(value)}")
        return value

    def text(self, field, value, limit: int = MAX_TEXT, *, empty: bool = True):
        self.kind(field, value, str, "a string")
        if len(value) > limit or (not empty and not value):
            self.fail(field, f"a string of 1 to {limit} characters, not one of {len(value)}")
        return value

    def integer(self, field, value, low: int, high: int):
        if type(value) is not int or not low <= value <= high:
            self.fail(field, f"an integer in [{low}, {high}], not {_short_value(value)}")
        return value

    def number(self, field, value, low: float = 0.0, high: float = float("inf"), *, finite: bool = True):
        if type(value) not in (int, float):
            self.fail(field, f"a number, not {_json_type(value)}")
        try:
            x = float(value)
        except OverflowError:  # an integer of hundreds of digits
            x = float("inf")
        if (finite and not math.isfinite(x)) or not (low <= x <= high or (not finite and math.isnan(x))):
            self.fail(field, f"a {'finite ' if finite else ''}number in [{low:g}, {high:g}], not {_short_value(value)}")
        return value

    def digest(self, field, value):
        if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
            self.fail(field, f"a sha256 (64 lowercase hex digits), not {_short_value(value)}")
        return value

    def mapping(self, field, value, limit: int, *, key_limit: int = MAX_TEXT):
        self.kind(field, value, dict, "a JSON object")
        if len(value) > limit:
            self.fail(field, f"at most {limit} entries, not {len(value)}")
        for key in value:
            if not key or len(key) > key_limit:
                self.fail(f"{field}[{key_name(key)}]", f"a name of 1 to {key_limit} characters")
        return value

    def optional(self, record: dict, key: str, check):
        if key in record and record[key] is not None:
            check(key, record[key])


def _json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _short_value(value) -> str:
    shown = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else _json_type(value)
    return shown if len(shown) <= 40 else shown[:40] + "…"


def _check_error_entry(s: _Schema, key: str, entry) -> None:
    """``forward``/``backward``: measured (errors, finite, tolerance) or ``{"not_measured": reason}``."""
    s.kind(key, entry, dict, "a JSON object")
    if "not_measured" in entry:
        s.text(f"{key}.not_measured", entry["not_measured"], 500, empty=False)
        return
    errors = ("max_abs_err", "max_rel_err") if key == "forward" else ("max_rel_err",)
    if not any(e in entry for e in errors):
        s.fail(key, f"needs {' or '.join(errors)} (or not_measured): it has "
                    f"{', '.join(map(key_name, list(entry)[:5])) or 'no field'}")
    for e in errors:
        s.optional(entry, e, lambda f, v: s.number(f"{key}.{f}", v))
    s.kind(f"{key}.finite", entry.get("finite"), bool, "true or false")
    s.number(f"{key}.tolerance", entry.get("tolerance"), 0.0, 1.0)
    if entry["tolerance"] <= 0:
        s.fail(f"{key}.tolerance", "a number in (0, 1], not 0")
    s.optional(entry, "scale", lambda f, v: s.number(f"{key}.{f}", v, 1.0))
    for f in ("relative_to", "worst", "not_compared", "implementation"):
        s.optional(entry, f, lambda f, v: s.text(f"{key}.{f}", v))
    s.optional(entry, "passed", lambda f, v: s.kind(f"{key}.{f}", v, bool, "true or false"))
    if entry.get("float64") is not None:
        f64 = s.kind(f"{key}.float64", entry["float64"], dict, "a JSON object")
        for f in ("jax_err", "torch_err", "budget"):
            s.optional(f64, f, lambda f, v: s.number(f"{key}.float64.{f}", v, finite=False))
        s.optional(f64, "rule", lambda f, v: s.text(f"{key}.float64.{f}", v))
        s.optional(f64, "passed", lambda f, v: s.kind(f"{key}.float64.{f}", v, bool, "true or false"))


def _check_lm(s: _Schema, entry) -> None:
    """``lm`` (a language model's certificate; older ones have none): ``measure.LMAgreement.to_dict``."""
    s.kind("lm", entry, dict, "a JSON object")
    if "not_measured" in entry:
        s.text("lm.not_measured", entry["not_measured"], 500, empty=False)
        return
    s.integer("lm.tokens", entry.get("tokens"), 0, MAX_TOKENS)
    s.integer("lm.vocab", entry.get("vocab"), 0, 2**40)
    s.optional(entry, "top1_near_ties", lambda f, v: s.integer(f"lm.{f}", v, 0, MAX_TOKENS))
    for f, high in (("kl_mean", float("inf")), ("kl_max", float("inf")), ("top1", 1.0), ("top5", 1.0)):
        s.number(f"lm.{f}", entry.get(f), 0.0, high, finite=False)  # NaN: nothing measured, or NaN logits
    for f in ("finite", "measured", "passed"):
        s.kind(f"lm.{f}", entry.get(f), bool, "true or false")
    s.optional(entry, "reason", lambda f, v: s.text(f"lm.{f}", v))
    gates = s.kind("lm.gates", entry.get("gates"), dict, "a JSON object")
    s.text("lm.gates.name", gates.get("name"), 32)
    for f in ("kl_mean", "kl_max", "top1", "top5", "tie_margin"):
        s.number(f"lm.gates.{f}", gates.get(f))


def _check_inputs(s: _Schema, inputs) -> None:
    s.kind("inputs", inputs, dict, "a JSON object or null")
    for key, (low, high) in INPUT_BOUNDS.items():
        if key not in inputs:
            s.fail(f"inputs.{key}", "missing")
        s.integer(f"inputs.{key}", inputs[key], low, high)
    if inputs["batch"] * inputs["length"] > MAX_TOKENS:
        s.fail("inputs.length", f"batch x length at most {MAX_TOKENS} tokens, not {inputs['batch']} x {inputs['length']}")
    if inputs.get("shapes") is not None:
        shapes = s.kind("inputs.shapes", inputs["shapes"], list, "a list")
        if len(shapes) > 8:
            s.fail("inputs.shapes", f"at most 8 inputs, not {len(shapes)}")
        for i, shape in enumerate(shapes):
            if shape is not None:
                _check_shape(s, f"inputs.shapes[{i}]", shape)
    s.optional(inputs, "drawn_by", lambda f, v: s.text(f"inputs.{f}", v))


def _check_user_model(s: _Schema, model: dict, fmt: str) -> None:
    """A user's model: its torch and Flax classes, the factory it was given as, porting's rename pairs."""
    if fmt not in USER_FORMATS:
        s.fail("format", f"one of {', '.join(USER_FORMATS)} for a user's model, not {fmt!r}")
    for f in ("class", "module", "flax_class", "flax_module"):
        s.text(f"model.{f}", model.get(f), 256, empty=False)
    s.optional(model, "reference", lambda f, v: s.text(f"model.{f}", v, empty=False))
    renames = s.kind("model.rename", model.get("rename"), list, "a list of [regex, replacement] pairs")
    if len(renames) > MAX_RENAMES:
        s.fail("model.rename", f"at most {MAX_RENAMES} pairs, not {len(renames)}")
    for i, pair in enumerate(renames):
        field = f"model.rename[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            s.fail(field, f"a [regex, replacement] pair, not {_short_value(pair)}")
        pattern, replacement = (s.text(f"{field}[{j}]", v) for j, v in enumerate(pair))
        try:
            re.compile(pattern).sub(replacement, "")  # bad escapes fail here, as porting's check_rename
        except re.error as error:
            s.fail(field, f"not a valid regex and replacement: {error}")


def _check_user_inputs(s: _Schema, inputs) -> None:
    """A user's model's inputs: each argument null, {"value": number} or {"shape", "dtype", "sha256"}."""
    s.kind("inputs", inputs, dict, "a JSON object {args, kwargs}")
    args = s.kind("inputs.args", inputs.get("args"), list, "a list")
    kwargs = s.mapping("inputs.kwargs", inputs.get("kwargs", {}), MAX_INPUTS, key_limit=64)
    if len(args) > MAX_INPUTS:
        s.fail("inputs.args", f"at most {MAX_INPUTS} inputs, not {len(args)}")
    for field, entry in [*((f"inputs.args[{i}]", a) for i, a in enumerate(args)),
                         *((f"inputs.kwargs[{key_name(k)}]", v) for k, v in kwargs.items())]:
        if entry is None:
            continue
        s.kind(field, entry, dict, "null or a JSON object")
        if "value" in entry:
            if type(entry["value"]) is not bool:
                s.number(f"{field}.value", entry["value"], -float("inf"), float("inf"))
            continue
        s.digest(f"{field}.sha256", entry.get("sha256"))
        if entry.get("dtype") not in DTYPES:
            s.fail(f"{field}.dtype", f"one of {', '.join(sorted(DTYPES))}, not {_short_value(entry.get('dtype'))}")
        _check_shape(s, f"{field}.shape", entry.get("shape"))
    s.optional(inputs, "drawn_by", lambda f, v: s.text(f"inputs.{f}", v))


def _check_shape(s: _Schema, field: str, shape) -> None:
    s.kind(field, shape, list, "a list of dimensions")
    if len(shape) > MAX_DIMS:
        s.fail(field, f"at most {MAX_DIMS} dimensions, not {len(shape)}")
    count = 1
    for i, n in enumerate(shape):
        count *= s.integer(f"{field}[{i}]", n, 0, MAX_ELEMENTS)
    if count > MAX_ELEMENTS:
        s.fail(field, f"at most 2**40 elements, not {count}")


_ENTRY = {"max_abs_err", "max_rel_err", "scale", "relative_to", "finite", "tolerance", "float64", "passed",
          "not_compared", "worst", "not_measured", "implementation"}
KNOWN = {"": {"certificate", "created", "format", "model", "files", "tensors", "dtypes", "matmul_precision", "versions",
              "platform", "inputs", "forward", "backward", "lm", "reader"}, "dtypes": {"tensors", "compute"},
         "model": {"family", "class", "init_kwargs", "module", "flax_class", "flax_module", "reference", "rename"},
         "forward": _ENTRY, "backward": _ENTRY, "reader": _ENTRY, "lm": {  # every field a certificate may hold
             "tokens", "vocab", "kl_mean", "kl_max", "top1", "top5", "top1_near_ties", "finite", "gates",
             "measured", "reason", "passed", "not_measured"}}


def validate(record, cert) -> dict:
    """``record`` (a parsed certificate), checked field by field before anything uses it: types,
    ranges, required and unknown fields (``KNOWN``; ``CertificateError`` naming ``cert`` and the field).
    Optional: created, inputs (null or absent: the re-check draws the library's defaults), dtypes,
    matmul_precision, lm, reader (``certificate.independent``). A user's model (``model.family`` "user")
    has ``class``, ``module``, ``flax_class``, ``flax_module``, ``reference`` and ``rename``, and
    requires ``inputs`` (``args``, ``kwargs``: each null, a number or an array's shape, dtype and sha256)."""
    s = _Schema(cert)
    if not isinstance(record, dict):
        raise CertificateError(f"{cert}: field (top level): a JSON object, not {_json_type(record)}: not a {FORMAT!r}")
    for section, names in KNOWN.items():  # refused: a reader that skipped it would not say so
        entry = record.get(section) if section else record
        for name in [n for n in (entry if isinstance(entry, dict) else ()) if n not in names][:1]:
            s.fail(f"{section}.{key_name(name)}".lstrip("."), f"not a field of a {FORMAT!r}: refused unread")
    if record.get("certificate") != FORMAT:
        s.fail("certificate", f"{_short_value(record.get('certificate'))}: not a {FORMAT!r}")
    if record.get("format") not in FORMATS:
        s.fail("format", f"one of {', '.join(FORMATS)}, not {_short_value(record.get('format'))}")
    s.optional(record, "created", lambda f, v: s.text(f, v, 64))
    model = s.kind("model", record.get("model"), dict, "a JSON object")
    user = s.text("model.family", model.get("family"), 64, empty=False) == USER
    if user:
        _check_user_model(s, model, record["format"])
    else:
        s.text("model.class", model.get("class"), 128, empty=False)
        s.mapping("model.init_kwargs", model.get("init_kwargs"), 256)
    files_ = s.mapping("files", record.get("files"), MAX_FILES, key_limit=255)
    if record["format"] in ("safetensors", "torch") and len(files_) != 1:
        s.fail("files", f"one weights file for a {record['format']} export, not {len(files_)}")
    for name, digest in files_.items():
        s.digest(f"files[{key_name(name)}]", digest)
    tensors = s.mapping("tensors", record.get("tensors"), MAX_TENSORS)
    for name, entry in tensors.items():
        field = f"tensors[{key_name(name)}]"
        s.kind(field, entry, dict, "a JSON object {sha256, dtype, shape}")
        s.digest(f"{field}.sha256", entry.get("sha256"))
        if entry.get("dtype") not in DTYPES:
            s.fail(f"{field}.dtype", f"one of {', '.join(sorted(DTYPES))}, not {_short_value(entry.get('dtype'))}")
        _check_shape(s, f"{field}.shape", entry.get("shape"))
    for key in ("forward", "backward"):
        _check_error_entry(s, key, record.get(key))
    s.optional(record, "lm", lambda f, v: _check_lm(s, v))
    s.optional(record, "reader", lambda f, v: _check_error_entry(s, f, v))
    if user:  # required: a re-check must run on the very inputs the figures were measured on
        _check_user_inputs(s, record.get("inputs"))
    else:
        s.optional(record, "inputs", lambda f, v: _check_inputs(s, v))
    if record.get("dtypes") is not None:
        dtypes = s.kind("dtypes", record["dtypes"], dict, "a JSON object")
        for i, d in enumerate(s.kind("dtypes.tensors", dtypes.get("tensors", []), list, "a list")):
            if d not in DTYPES:
                s.fail(f"dtypes.tensors[{i}]", f"a known dtype, not {_short_value(d)}")
        if dtypes.get("compute") not in DTYPES | {None}:
            s.fail("dtypes.compute", f"a known dtype, not {_short_value(dtypes.get('compute'))}")
    s.optional(record, "matmul_precision", lambda f, v: s.text(f, v, 32))
    for key, limit in (("versions", 128), ("platform", 512)):
        for name, value in [(n, v) for n, v in s.mapping(key, record.get(key), 64, key_limit=64).items() if v is not None]:
            s.text(f"{key}[{key_name(name)}]", value, limit)
    return record
