"""The verification certificate: evidence, written with every export, that the weights were checked.

Every certified export (``export.save_safetensors``/``save_torch``/``save_orbax``/``save_pretrained``, so
``port``, ``--export-torch``/``--export-hf``) reloads what it wrote as a torch model, compares it with the
Flax model being exported on example inputs (outputs, and every parameter's gradient), and records:

* the sha256 of every tensor (and of the files that describe the model),
* the forward and backward errors and the tolerance, and the inputs they were measured on,
* for a language model, its next-token agreement: KL(torch || JAX) and top-1/top-5 (``lm``, from
  ``measure.lm_agreement``; optional, so certificates written before it still verify),
* for an HF folder, transformers' own reading of it against the torch twin (``reader``,
  ``certificate.independent``), or why not; the dtypes, matmul precision, versions and platform.

A folder (HF, orbax) holds it as ``verification.json``, written inside the folder's atomic
swap. A file ``x.safetensors`` / ``x.pt`` has it beside as ``x.safetensors.verification.json``:
two files cannot be swapped together, so the certificate goes in first and the weights
second. An interrupted export can therefore leave old weights under a new certificate, never
new weights without one, and ``recheck`` reports that mismatch (the file's hash is recorded).

``recheck(path)`` (``flax-transformer verify --checkpoint PATH``) checks the certificate field by
field (``read``, ``certificate.schema.validate``: one line naming the file and the field),
recomputes the hashes (a changed tensor is named), reruns the measurement on the recorded inputs,
and compares versions (see its ``RecheckReport`` for what fails and what is a note).

This module is the flow: it makes (``make``), reads (``read``, ``certified_pair``) and re-checks
(``recheck``) certificates and writes no file; what a certificate records and its schema are
``certificate.schema``'s. The writers of ``interop`` take its ``sidecar`` hook, and ``export`` puts the two together. What a
certificate is about is its *subject* (``certificate.schema.ExportSubject``; ``certificate.subjects``: a family's
model, a user's own model against its torch reference; ``certificate.peft``: a PEFT adapter): the
subject describes itself, reloads what was written and measures it; the flow does the rest.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flax_transformer.interop import files
from flax_transformer.verification import measure as core
from flax_transformer.verification.certificate import independent, schema, subjects
from flax_transformer.verification.certificate import peft as certificate_peft
from flax_transformer.verification.certificate.schema import (
    FORMAT,
    INPUTS,
    MAX_BYTES,
    USER,
    CertificateError,
    brief,
    error_of,
    file_hashes,
    float64_note,
    key_name,
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
from flax_transformer.verification.reports import Report

FOLDER_NAME = "verification.json"  # inside an HF or orbax folder
FILE_SUFFIX = ".verification.json"  # beside a single file: x.safetensors.verification.json
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
    if not record.get("reader", {}).get("passed", True):  # transformers read the folder otherwise
        failed.append(independent.line(record["reader"]))
    if failed:
        raise CertificateError(f"{label}: the export check failed: {', '.join(failed)} between the model and what "
                               f"was written, {reloaded}; nothing was written (certify=False writes without the check)")


def make(written, fmt: str, subject: schema.ExportSubject, *, name: str | None = None) -> dict:
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


def sidecar(fmt: str, subject: schema.ExportSubject) -> files.BeforeSwap:
    """The writers' ``before_swap`` hook (``files.BeforeSwap``) that certifies an export of ``subject``
    (``certificate.subjects.FamilySubject(model)``, ``UserSubject``, ``certificate.peft.AdapterSubject``):
    it checks the finished temporary output (raising ``CertificateError``, so nothing is written, when
    the check fails) and returns the certificate to go with it: ``verification.json`` inside a folder,
    ``NAME.verification.json`` beside a file."""
    if not isinstance(subject, schema.ExportSubject):
        raise TypeError(f"sidecar certifies an ExportSubject (certificate_subjects.FamilySubject(model) for a "
                        f"model of the families), not a {type(subject).__name__}")
    if fmt not in subject.formats:
        raise ValueError(f"format must be one of {', '.join(subject.formats)}, got {fmt!r}")

    def certify(tmp: Path, final: Path) -> dict[str, bytes]:
        record = subject.record(tmp, fmt, final) if subject.record else make(tmp, fmt, subject, name=final.name)
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


def certified_pair(path):
    """(Flax model, torch model) of a certified export, each read from the files; a bare torch
    ``.pt`` needs no ``--family``/``--class``/``--config`` here: its certificate describes it."""
    record = read(path)
    if record["model"]["family"] == USER:  # the library cannot build it: the user's factory does
        model = record["model"]
        raise CertificateError(f"{path} is an export of your own model ({model['module']}.{model['class']}): the "
                               "library cannot build it; re-check it with its factory (certificate.recheck("
                               "PATH, pair='MODULE:FACTORY'), flax-transformer verify --checkpoint PATH --pair "
                               "MODULE:FACTORY), or bisect that pair with --pair")
    # the Flax model first: built abstract and loaded strictly, it holds the description to the file's
    # tensors before torch allocates anything from it
    flax_model = subjects.flax_model_of(path, record["format"], record["model"])
    return flax_model, subjects.torch_model_of(path, record["format"], record["model"])


@dataclass
class RecheckReport(Report):
    """The re-check of one certificate. ``failures`` make ``passed`` False; ``notes`` do not.

    Fails: a changed, missing or added tensor or file (one the certificate hashes: weights,
    ``config.json``, an index); an error above the tolerance, or JAX beyond its float64 budget; an
    error above ``max(2 x recorded, recorded + 1e-7)`` while versions and platform are unchanged (a
    real change moves it by orders of magnitude). Notes: changed versions or platform (and an error
    grown past that margin with them), a measurement that cannot run. ``reader``: whether anything
    but this library's config reader read the export (``certificate.independent``)."""

    path: Path
    certificate: Path
    passes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    reader: str = ""

    @property
    def passed(self) -> bool:
        return not self.failures

    def format(self) -> str:
        lines = [f"certificate {self.certificate}"]
        lines += [f"  pass  {t}" for t in self.passes] + [f"  FAIL  {t}" for t in self.failures]
        lines += [f"  note  {t}" for t in self.notes] + ([f"  reader  {self.reader}"] if self.reader else [])
        lines.append(f"certificate: {len(self.passes)} passed, {len(self.failures)} failed, {len(self.notes)} notes")
        return "\n".join(lines)

    def summary(self) -> str:
        return self.format()

    def to_dict(self) -> dict:
        return {"path": str(self.path), "certificate": str(self.certificate), "passed": self.passed,
                "passes": list(self.passes), "failures": list(self.failures), "notes": list(self.notes),
                "reader": self.reader}


def _short(digest) -> str:
    return str(digest)[:12]


SHOWN = 5  # a group of more failures than this is one line: the count, the first names, "… and N more"


def _group(report: RecheckReport, what: str, items: list[str], single) -> None:
    """One failure per item, or for more than ``SHOWN`` one line: the count, the first few, and how many more."""
    if len(items) <= SHOWN:
        report.failures.extend(single(item) for item in items)
    else:
        report.failures.append(f"{what} ({len(items)}): {', '.join(items[:SHOWN])} … and {len(items) - SHOWN} more")


def _check_hashes(report: RecheckReport, path: Path, record: dict) -> dict | None:
    fmt = record["format"]
    if fmt in ("safetensors", "torch"):  # the one weights file, whatever it is called now (renamed with its certificate)
        found = {name: files.sha256_file(path) for name in record["files"]}  # one entry: the schema says so
    else:
        found = file_hashes(path, fmt)
    missing, changed = [], []
    for fname, digest in record["files"].items():
        shown = brief(fname if fname == path.name or fmt in ("orbax", "hf") else
                            f"{path.name} (certified as {fname})", 120)
        if fname not in found:
            missing.append(shown)
        elif found[fname] != digest:
            changed.append(f"file {shown} changed (sha256 {_short(digest)}… at export, {_short(found[fname])}… now)")
    _group(report, "files missing", missing, lambda f: f"file {f} is missing")
    _group(report, "files changed", changed, lambda line: line)
    added = [brief(f, 80) for f in sorted(set(found) - set(record["files"]))]
    _group(report, "files not in the certificate (added after the export)", added,
           lambda f: f"file {f} is not in the certificate (added after the export)")
    try:
        tensors = read_tensors(path, fmt)
    except (OSError, ValueError) as error:
        report.failures.append(f"cannot read the tensors: {brief(error)}")
        return None
    now, recorded = tensor_hashes(tensors), record["tensors"]
    gone, new, differ = [], [], []
    for key in sorted(set(recorded) | set(now)):
        if key not in now:
            gone.append(key_name(key))
        elif key not in recorded:
            new.append(key_name(key))
        elif now[key] != recorded[key]:
            was, new_ = recorded[key], now[key]
            detail = (f"sha256 {_short(was['sha256'])}… at export, {_short(new_['sha256'])}… now"
                      if (was["dtype"], was["shape"]) == (new_["dtype"], new_["shape"]) else
                      f"{was['dtype']} {was['shape']} at export, {new_['dtype']} {new_['shape']} now")
            differ.append((key_name(key), detail))
    _group(report, "tensors missing", gone, lambda k: f"tensor {k} is missing")
    _group(report, "tensors not in the certificate", new, lambda k: f"tensor {k} is not in the certificate")
    if len(differ) <= SHOWN:
        report.failures.extend(f"tensor {k} changed ({detail})" for k, detail in differ)
    else:
        _group(report, "tensors changed", [k for k, _ in differ], None)
    if not report.failures:
        report.passes.append(f"{len(recorded)} tensors and {len(record['files'])} files unchanged (sha256)")
    return tensors


def _compare_errors(report: RecheckReport, record: dict, measured: dict, same_environment: bool) -> None:
    for key in ("forward", "backward"):
        was, now = record[key], measured[key]
        if "not_measured" in now:
            at_export = "" if was.get("not_measured") == now["not_measured"] else f" (at export: {value_of(was)})"
            report.notes.append(f"{key}: {now['not_measured']}{at_export}")
            continue
        value = error_of(now)  # held to the tolerance: relative to the outputs' / gradients' scale
        # a recorded tolerance can tighten the library's, never loosen it
        tolerance = min(float(was.get("tolerance", now["tolerance"])), float(now["tolerance"]))
        # like with like: a forward entry from before the relative error has the absolute one alone
        relative = "not_measured" in was or "max_rel_err" in was
        recorded = None if "not_measured" in was else error_of(was, relative)
        if recorded is None:
            report.notes.append(f"{key}: {was['not_measured']} at export; measured now")
        label = ("backward max relative gradient err" if key == "backward" else
                 "forward max relative err" if relative else "forward max abs err")
        shown = value_of(now, relative)
        both = f"{label} {shown} now, " + (f"{recorded:.2e} at export" if recorded is not None else
                                           "none recorded") + f" (tolerance {tolerance:g})"
        compared = error_of(now, relative)
        if not now["finite"] or value > tolerance or not now.get("float64", {}).get("passed", True):
            report.failures.append(both + float64_note(now))
        elif recorded is not None and compared > max(RECHECK_FACTOR * recorded, recorded + RECHECK_SLACK):
            (report.notes if not same_environment else report.failures).append(
                both + ("; larger than recorded, with the versions or platform changed" if not same_environment
                        else f"; larger than recorded (beyond the re-check margin, max({RECHECK_FACTOR:g} x "
                             f"recorded, recorded + {RECHECK_SLACK:g})), with the same versions and platform"))
        else:
            report.passes.append(both)


def _environment_notes(record: dict) -> list[str]:
    """Versions and platform fields that changed since the export, each with both values."""
    now_versions, now_platform = versions(), platform_info()
    changed = [f"{k} {record['versions'].get(k)} at export, {now_versions.get(k)} now"
               for k in sorted(set(record["versions"]) | set(now_versions))
               if record["versions"].get(k) != now_versions.get(k)]
    changed += [f"platform {k}: {record['platform'].get(k)!r} at export, {now_platform.get(k)!r} now"
                for k in sorted(set(record["platform"]) | set(now_platform))
                if record["platform"].get(k) != now_platform.get(k)]
    changed = [brief(c, 200) for c in changed]
    if len(changed) > 2 * SHOWN:
        changed = changed[:SHOWN] + [f"… and {len(changed) - SHOWN} more versions or platform fields changed"]
    return changed


def _begin(path: Path, record: dict) -> tuple[RecheckReport, dict | None, list[str] | None]:
    """The report begun: (report, the tensors read, the versions and platform notes), or (report,
    None, None) when the weights are missing."""
    report = RecheckReport(path, path_for(path))
    if not path.exists():
        report.failures.append(f"{path} is missing (an export interrupted before its weights went in?)")
        return report, None, None
    tensors = _check_hashes(report, path, record)
    changed = _environment_notes(record)
    report.notes.extend(changed)
    return report, tensors, changed


def recheck(path, pair=None, *, base=None) -> RecheckReport | certificate_peft.AdapterReport:
    """Re-check an export against its certificate: hashes, the measurement on the recorded
    inputs (the library's defaults where none are recorded), versions and platform. Raises
    ``CertificateError`` when there is no readable one (``certificate.read``: the schema is
    checked first). The errors are always measured now, never copied from the certificate: where
    that cannot be done the report says "not re-measured: <reason>", a note, not a pass.

    ``pair``: for an export of your own model (``export.save_*(..., reference=)``), the
    ``"MODULE:FACTORY"`` (or the factory) whose ``FACTORY()`` returns (torch model, Flax model,
    args[, kwargs]), as for ``verify --pair``: see ``recheck_user``.

    A PEFT adapter folder is re-checked by its subject (``certificate.peft.recheck``: hashes, the
    base, measured through peft again; ``base``: where the base folder is now, if it moved)."""
    path = Path(path)
    if pair is None and certificate_peft.is_adapter(path):
        return certificate_peft.recheck(path, base=base)
    record = read(path)
    user = record["model"]["family"] == USER
    if user or pair is not None:
        return recheck_user(path, record, pair)
    report, tensors, changed = _begin(path, record)
    if changed is None:  # the weights are missing
        return report
    inputs = record.get("inputs")
    if inputs is None:  # the schema has checked any that are recorded
        inputs = INPUTS
        report.notes.append("no inputs recorded in the certificate: re-measured on the library's defaults (seed "
                            f"{inputs['seed']}, batch {inputs['batch']}, length {inputs['length']}), as every export "
                            "measures")
    if torch_available() is None:
        measured = not_measured("not re-measured: torch not installed")
    else:
        fmt, description = record["format"], record["model"]
        try:  # the Flax model first: built abstract and loaded strictly, it holds the description to the file
            flax_model = subjects.flax_model_of(path, fmt, description, tensors if fmt != "hf" else None)
            torch_model = subjects.torch_model_of(path, fmt, description, tensors if fmt != "hf" else None)
        except (OSError, ValueError, TypeError, RuntimeError) as error:  # RuntimeError: torch's load_state_dict
            report.failures.append(f"cannot load the export to re-measure it: {brief(error)}")
            return report
        measured = subjects.measure(flax_model, torch_model, seed=inputs["seed"], batch=inputs["batch"],
                                length=inputs["length"])
    _compare_errors(report, record, measured, same_environment=not changed)
    _compare_lm(report, record, measured)
    if "not_measured" not in measured["forward"]:  # the config read by transformers too, or why not
        args = subjects.example_inputs(flax_model, seed=inputs["seed"], batch=inputs["batch"], length=inputs["length"])
        independent.recheck(report, path, record, torch_model, args)
    return report


def _compare_lm(report: RecheckReport, record: dict, measured: dict) -> None:
    """A language model's next-token agreement (``lm`` in the certificate; certificates before it
    have none), measured now against its gates; the recorded figures are shown beside."""
    now, was = measured.get("lm"), record.get("lm")
    if now is None:
        if was is not None:
            report.notes.append("LM agreement: not re-measured" + (
                f" ({measured['forward']['not_measured']})" if "not_measured" in measured["forward"] else ""))
        return
    line = lm_line(now) + " now" + (f"; at export KL max {was['kl_max']:.2e}" if was and "kl_max" in was else "")
    (report.passes if now["passed"] else report.failures).append(line)


# ------------------------------------------------------------------ your own model


def _inputs_differ(recorded: dict, now: dict) -> str | None:
    """How the factory's inputs differ from the certificate's (the first difference), or None."""
    def shown(entry):
        return "none" if entry is None else (f"{entry['value']!r}" if "value" in entry else
                                             f"{entry['dtype']} {entry['shape']} sha256 {_short(entry['sha256'])}…")
    was = {f"args[{i}]": e for i, e in enumerate(recorded["args"])} | {
        f"kwargs[{k!r}]": e for k, e in recorded.get("kwargs", {}).items()}
    new = {f"args[{i}]": e for i, e in enumerate(now["args"])} | {
        f"kwargs[{k!r}]": e for k, e in now["kwargs"].items()}
    for name in [*was, *(k for k in new if k not in was)]:
        if name not in new or name not in was or was[name] != new[name]:
            return (f"{name}: {shown(was[name]) if name in was else 'absent'} at export, "
                    f"{shown(new[name]) if name in new else 'absent'} now")
    return None


def recheck_user(path: Path, record: dict, pair) -> RecheckReport:
    """The re-check of a user's model's export with the pair that ``pair`` gives: the hashes again,
    the file read into the factory's torch model (strict ``load_state_dict``) and its Flax model
    (``porting.load_state_dict`` with the recorded rename; orbax: the Flax tree, then
    ``porting.flax_to_torch``), measured again on the factory's inputs and compared with the
    recorded figures. ``ValueError`` (one line) when the pair cannot re-check this export: none
    given, a library family's export, other classes than the certificate's, or other inputs than
    the recorded ones (the figures hold for those inputs only)."""
    model = record["model"]
    if model["family"] != USER:
        raise ValueError(f"{path} is an export of the library's {model['family']}.{model['class']}: re-check it "
                         "without a pair (--pair is for an export of your own model)")
    if pair is None:
        how = f"pair={model['reference']!r}" if model.get("reference") else "pair='MODULE:FACTORY'"
        raise CertificateError(
            f"{path} is an export of your own model ({model['module']}.{model['class']}): re-check it with the "
            f"factory of its torch and Flax models, {how} (flax-transformer verify --checkpoint PATH --pair "
            f"{model.get('reference') or 'MODULE:FACTORY'})")
    name = subjects.factory_name(pair)
    torch_model, flax_model, args, kwargs = subjects.call_factory(pair)
    for key, module, obj in (("class", "module", torch_model), ("flax_class", "flax_module", flax_model)):
        if type(obj).__qualname__ != model[key]:  # by class name: a file's module name depends on how it is imported
            raise ValueError(f"{name} gives a {type(obj).__qualname__}; {path}'s certificate was made with a "
                             f"{model[key]} ({model[module]})")
    differ = _inputs_differ(record["inputs"], subjects.input_record(args, kwargs))
    if differ:
        raise ValueError(f"{name} gives other inputs than {path} was certified on ({differ}): its figures hold "
                         "for those inputs only; re-check with the factory that returns them")
    report, tensors, changed = _begin(path, record)
    if changed is None:  # the weights are missing
        return report
    if tensors is None:
        return report
    fmt, rename = record["format"], [tuple(p) for p in model["rename"]]
    try:
        if fmt == "orbax":  # the Flax tree into the Flax model, and from it into torch
            subjects.fill_flax(flax_model, tensors)
            subjects.load_torch(torch_model, path, fmt, tensors, flax_model, rename)
        else:  # each from the file: torch strictly, Flax through porting with the recorded rename
            subjects.load_torch(torch_model, path, fmt, tensors, flax_model, rename)
            from flax_transformer.interop import porting

            porting.load_state_dict(flax_model, subjects.shared_ties(tensors, torch_model), strict=True,
                                    rename=rename or None)
    except (ValueError, TypeError, RuntimeError) as error:  # porting's StateDictError is a ValueError
        why = brief(" ".join(str(error).split()), 600)  # porting's lines (which keys, why) on one
        report.failures.append(f"cannot load the export into {name}'s models to re-measure it: {why}")
        return report
    measured = subjects.measure_user(core.fp32_twin(flax_model), torch_model, args, kwargs,
                                        rename=rename)
    _compare_errors(report, record, measured, same_environment=not changed)
    return report
