"""The verification certificate: evidence, written with every export, that the weights were checked.

Every certified export (``export.save_safetensors``/``save_torch``/``save_orbax``/``save_pretrained``,
so ``port`` and the trainers' ``--export-torch``/``--export-hf``) reloads what it wrote as a torch model, compares it with the Flax model being exported on
example inputs (outputs, and every parameter's gradient), and records:

* the sha256 of every tensor (and of the files that describe the model),
* the forward and backward errors and the tolerance, and the inputs they were measured on,
* for a language model, its next-token agreement: KL(torch || JAX) and top-1/top-5 (``lm``, from
  ``measure.lm_agreement``; optional, so certificates written before it still verify),
* the tensors' dtypes and the matmul precision,
* the versions of jax, flax, torch, transformers (...) and the platform.

A folder (HF, orbax) holds it as ``verification.json``, written inside the folder's atomic
swap. A file ``x.safetensors`` / ``x.pt`` has it beside as ``x.safetensors.verification.json``:
two files cannot be swapped together, so the certificate goes in first and the weights
second. An interrupted export can therefore leave old weights under a new certificate, never
new weights without one, and ``recheck`` reports that mismatch (the file's hash is recorded).

``certificate_check.recheck(path)`` (``flax-transformer verify --checkpoint PATH``) checks the certificate
field by field (``read``, ``certificate_schema.validate``: one line naming the file and the field),
recomputes the hashes (a changed tensor is named), reruns the measurement on the recorded inputs,
and compares versions (see its ``RecheckReport`` for what fails and what is a note).

This module is the flow: it makes (``make``) and reads (``read``) certificates and writes no file;
what a certificate records (hashes, versions, platform) and its schema are ``certificate_schema``'s.
The writers of ``interop`` take its ``sidecar`` hook, and ``export`` puts the two together. What a
certificate is about is its *subject* (``ExportSubject``, in ``certificate_subjects``: a family's
model, a user's own model against its torch reference; ``certificate_peft``: a PEFT adapter): the
subject describes itself, reloads what was written and measures it; the flow does the rest.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np

from flax_transformer.interop import files
from flax_transformer.verification.certificate_schema import (
    FORMAT,
    MAX_BYTES,
    CertificateError,
    brief,
    file_hashes,
    float64_note,
    lm_line,
    not_compared_note,
    platform_info,
    read_tensors,
    tensor_hashes,
    torch_available,
    validate,
    value_of,
    versions,
)
from flax_transformer.verification.precision import FP32
from flax_transformer.verification.reports import TOLERANCE, grads_row

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




def path_for(path) -> Path:
    """Where the certificate of the export ``path`` lives (it need not exist)."""
    path = Path(path)
    return path / FOLDER_NAME if path.is_dir() else path.with_name(path.name + FILE_SUFFIX)


def find(path) -> Path | None:
    """The certificate of ``path`` if it has one."""
    cert = path_for(path)
    return cert if cert.is_file() else None


# ------------------------------------------------------------------------ measuring


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


def not_measured(reason: str) -> dict:
    return {"inputs": dict(INPUTS), "forward": {"not_measured": reason}, "backward": {"not_measured": reason}}


def skeleton(written: Path, fmt: str, description: dict, tensors: dict, name: str | None) -> dict:
    """Everything a certificate records but the measurement."""
    return {"certificate": FORMAT, "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "format": fmt, "model": description, "files": file_hashes(written, fmt, name),
            "tensors": tensor_hashes(tensors),
            "dtypes": {"tensors": sorted({str(np.asarray(t).dtype) for t in tensors.values()}), "compute": "float32"},
            "matmul_precision": "highest", "versions": versions(), "platform": platform_info()}


def refuse_failed(record: dict, label: str, reloaded: str) -> None:
    """``CertificateError`` naming every failed entry of ``record``: the caller then writes nothing."""
    failed = [f"{k} {value_of(v)} (tolerance {v['tolerance']:g}){float64_note(v)}{not_compared_note(v)}"
              for k in ("forward", "backward") if not (v := record[k]).get("passed", True)]
    if not record.get("lm", {}).get("passed", True):
        failed.append(lm_line(record["lm"]))
    if failed:
        raise CertificateError(f"{label}: the export check failed: {', '.join(failed)} between the model and what "
                               f"was written, {reloaded}; nothing was written (certify=False writes without the check)")


class ExportSubject:
    """What an export's certificate is about (``certificate_subjects``): ``formats`` it can be
    written as; ``describe()`` (the certificate's ``model``), ``inputs()`` (fields recorded before
    the measurement), ``load(written, fmt, description, tensors, name)`` (the (Flax, torch) pair
    that measures what was written) and ``measure(flax_model, torch_model)`` (``inputs``,
    ``forward``, ``backward``, ``lm``); ``reloaded`` says how, for a refusal. ``record`` is the
    whole flow (``make``); a subject whose record is its own (a PEFT adapter) overrides it."""

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

    def record(self, written: Path, fmt: str, final: Path) -> dict:
        """The certificate of what was written at ``written``, to be swapped in at ``final``."""
        return make(written, fmt, self, name=final.name)


def make(written, fmt: str, subject: ExportSubject, *, name: str | None = None) -> dict:
    """The certificate of the export just written at ``written`` (a temporary path) of ``subject``.

    Raises ``CertificateError`` when the check fails: the caller then writes nothing."""
    if fmt not in subject.formats:
        raise ValueError(f"format must be one of {', '.join(subject.formats)}, got {fmt!r}")
    written = Path(written)
    description = subject.describe()
    tensors = read_tensors(written, fmt)
    record = skeleton(written, fmt, description, tensors, name) | subject.inputs()
    if subject.needs_torch and torch_available() is None:
        record |= not_measured("not measured: torch not installed")
    else:
        flax_model, torch_model = subject.load(written, fmt, description, tensors, name)
        del tensors  # hashed and loaded: not held through the measurement
        record |= subject.measure(flax_model, torch_model)
    refuse_failed(record, name or written.name, subject.reloaded)
    return record


def to_json(record: dict) -> str:
    return json.dumps(record, indent=1) + "\n"


# ---------------------------------------------------------------------- the writers' hook


FOLDER_FORMATS = ("orbax", "hf", "peft")  # the certificate goes inside: FOLDER_NAME


def sidecar(fmt: str, subject: ExportSubject) -> files.BeforeSwap:
    """The writers' ``before_swap`` hook (``files.BeforeSwap``) that certifies an export of ``subject``
    (``certificate_subjects.FamilySubject(model)``, ``UserSubject``, ``certificate_peft.AdapterSubject``):
    it checks the finished temporary output (raising ``CertificateError``, so nothing is written, when
    the check fails) and returns the certificate to go with it: ``verification.json`` inside a folder,
    ``NAME.verification.json`` beside a file."""
    if not isinstance(subject, ExportSubject):
        raise TypeError(f"sidecar certifies an ExportSubject (certificate_subjects.FamilySubject(model) for a "
                        f"model of the families), not a {type(subject).__name__}")
    if fmt not in subject.formats:
        raise ValueError(f"format must be one of {', '.join(subject.formats)}, got {fmt!r}")

    def certify(tmp: Path, final: Path) -> dict[str, bytes]:
        record = subject.record(tmp, fmt, final)
        name = FOLDER_NAME if fmt in FOLDER_FORMATS else final.name + FILE_SUFFIX
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
        raise CertificateError(f"{cert} is not valid JSON: {brief(error)}") from None
    return validate(record, cert)
