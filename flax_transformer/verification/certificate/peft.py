"""The certificate of a PEFT LoRA adapter folder: evidence that ``peft`` computes what the JAX model did.

``export.save_peft`` (so ``port RUN_DIR DIR --to peft`` and the trainers' ``--export-peft``) writes
the adapter (``interop.peft.save_peft``), then, before the folder is swapped in, loads it the way a
PyTorch user will: transformers' model of the base folder, ``peft.PeftModel.from_pretrained(base,
tmp)``. It checks that every adapter tensor arrived (each LoRA module's A and B equal the file's, and
the file holds nothing else: a key without ``base_model.model.`` that PEFT skips with a warning, or a
``lora_B`` left at zero, fails here), then measures on example inputs the JAX model's output against
PEFT's and the gradient of every adapter tensor against PEFT's. The folder gets ``verification.json``:

* ``adapter``: the sha256 of every tensor of ``adapter_model.safetensors`` and of ``adapter_config.json``,
* ``base``: the base folder's identity, the sha256 of its weight files and ``config.json`` and of its
  own certificate where it has one,
* ``forward`` and ``adapter_grads``: the errors, their tolerances and how many values were compared,
* the versions and platform, as every certificate.

A failed check raises ``CertificateError`` and nothing is written. ``recheck(folder)`` (``flax-transformer
verify --checkpoint ADAPTER_DIR``) recomputes the hashes, finds the base where the certificate says,
checks it is the same base, and measures again: the JAX side now read from the folder itself
(``interop.peft.load_peft`` on the base as ``hf.from_pretrained`` reads it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flax_transformer.interop import files, peft, safetensors_io
from flax_transformer.interop.layer_kinds import to_flax, to_torch
from flax_transformer.verification.certificate.schema import (
    CertificateError,
    ExportSubject,
    platform_info,
    sha256,
    tensor_hashes,
    versions,
)
from flax_transformer.verification.reports import Report

__all__ = ["FILE", "KIND", "AdapterReport", "AdapterSubject", "base_identity", "is_adapter", "measure", "measured_passed", "recheck"]

FILE = "verification.json"
KIND = "peft-lora-adapter"
TOLERANCE = 1e-5  # forward, absolute, fp32 with matmul precision "highest"
GRAD_TOLERANCE = 1e-5  # adapter gradients, relative to their largest magnitude (floor 1)
MAX_BYTES = 4 << 20
ROOT = "base_model.model."  # PeftModel -> LoraModel -> transformers' model: peft's module names
_BASE_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "verification.json")


def is_adapter(path) -> bool:
    """Whether ``path`` is a PEFT adapter folder (it has ``adapter_config.json``)."""
    return (Path(path) / peft.CONFIG_FILE).is_file()


def base_identity(base) -> dict:
    """What identifies the base folder: its path and the sha256 of its config, weight files and certificate."""
    base = Path(base)
    names = sorted({*[n for n in _BASE_FILES if (base / n).is_file()],
                    *[p.name for p in base.glob("model-*.safetensors")]})
    if "config.json" not in names:
        raise CertificateError(f"{base}: no config.json, so no base model to certify the adapter against")
    return {"path": str(base), "files": {name: files.sha256_file(base / name) for name in names}}


def _adapter_hashes(folder: Path) -> dict:
    weights = safetensors_io.open_safetensors(folder / peft.WEIGHTS_FILE)
    tensors = {k: safetensors_io.read(v) for k, v in weights.items()}
    return {"tensors": tensor_hashes(tensors),
            "config_sha256": sha256((folder / peft.CONFIG_FILE).read_bytes())}


def _torch_model(base: Path, task_type, num_labels: int | None = None):
    """transformers' model of the base folder for PEFT's ``task_type``, quiet, fp32, eval mode (a
    sequence classifier with ``num_labels`` outputs, the adapter's saved head's)."""
    import torch
    import transformers

    cls = {"SEQ_CLS": transformers.AutoModelForSequenceClassification,
           "CAUSAL_LM": transformers.AutoModelForCausalLM}.get(task_type)
    if cls is None:
        raw = json.loads((base / "config.json").read_text(encoding="utf-8"))
        from flax_transformer.interop import hf_tables

        cls = transformers.AutoModelForCausalLM if raw.get("model_type") in (*hf_tables.LLAMA_TYPES, "gpt2") \
            else transformers.AutoModel
    bar, verbosity = transformers.utils.logging.is_progress_bar_enabled(), transformers.logging.get_verbosity()
    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    try:
        extra = {"num_labels": num_labels} if task_type == "SEQ_CLS" and num_labels else {}
        return cls.from_pretrained(str(base), dtype=torch.float32, **extra).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bar:
            transformers.utils.logging.enable_progress_bar()


def _num_labels(folder: Path) -> int | None:
    """The outputs of the classifier head an adapter saves (``modules_to_save``), or None without one."""
    heads = [v.shape[0] for k, v in safetensors_io.open_safetensors(folder / peft.WEIGHTS_FILE).items()
             if k.endswith((".classifier.weight", ".classifier.out_proj.weight"))]  # not pre_classifier
    return int(heads[0]) if heads else None


def _output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def measure(model, folder, base) -> dict:
    """Load ``folder`` with ``peft`` onto transformers' model of ``base`` and compare it with ``model``
    (the JAX model with the same adapter): every adapter tensor as loaded, the output, and the
    gradient of every adapter tensor of a fixed random projection of the output."""
    import jax
    import jax.numpy as jnp
    import peft as peft_lib
    import torch
    from flax import nnx

    from flax_transformer.models import lora
    from flax_transformer.verification.certificate.subjects import example_inputs

    folder, base = Path(folder), Path(base)
    config = json.loads((folder / peft.CONFIG_FILE).read_text(encoding="utf-8"))
    try:
        theirs = peft_lib.PeftModel.from_pretrained(_torch_model(base, config.get("task_type"), _num_labels(folder)),
                                                    str(folder),
                                                    is_trainable=True).eval()  # trainable: its adapter gets gradients
    except Exception as error:  # noqa: BLE001 - whatever peft raises, it does not load the folder
        raise CertificateError(f"{folder}: peft does not load the adapter as written: peft raised "
                               f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}") from None
    file = safetensors_io.open_safetensors(folder / peft.WEIGHTS_FILE)
    paths = peft.adapter_module_paths(model)  # a linear layer's module, or an expert weight's ParamWrapper
    ours = lora.layers(model)
    problems, loaded = [], 0
    modules = dict(theirs.named_modules())
    for path, layer in ours.items():  # what peft holds against what the JAX model holds, not against the file
        module = modules.get(ROOT + paths[path]) if path in paths else None
        if module is None or "default" not in getattr(module, "lora_A", {}):
            problems.append(f"{paths.get(path, path)} has no LoRA in peft's model (its target was skipped)")
            continue
        for leaf, want in zip(("lora_A", "lora_B"), peft.to_peft_layout(layer), strict=True):
            got = getattr(module, leaf)["default"].weight.detach().float().numpy()
            want = want.astype(np.float32)  # ours in peft's layout: (r, in) / (out, r), experts' (E r, in) / (out, r E)
            if got.shape != want.shape or not np.array_equal(got, want):
                problems.append(f"{paths[path]}.{leaf} in peft's model is not the JAX model's (max |value| "
                                f"{float(np.abs(got).max()) if got.size else 0:.2e} vs {float(np.abs(want).max()):.2e})")
            loaded += 1
    saved = {ROOT + k[len(peft.PREFIX):]: v for k, v in peft.saved_modules(model, config.get("modules_to_save")).items()}
    named = dict(theirs.named_parameters())
    params = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for key, (path, rule, _) in saved.items():
        owner = _copy_of(named, key, config["modules_to_save"])
        want = to_torch(rule, np.asarray(params[path], np.float32))
        if owner is None or not np.array_equal(named[owner].detach().float().numpy(), want):
            problems.append(f"{key[len(ROOT):]} in peft's model is not the JAX model's trained module")
    lora_keys = [k for k in file if ".lora_" in k]
    if len(lora_keys) != 2 * len(ours) or len(file) != len(lora_keys) + len(saved):
        problems.append(f"the file holds {len(lora_keys)} LoRA tensors and {len(file) - len(lora_keys)} others, "
                        f"the model {2 * len(ours)} and {len(saved)}")
    if problems:
        raise CertificateError(f"{folder}: peft does not load the adapter as written: {'; '.join(problems[:3])}")

    args = example_inputs(model)
    ids, mask = args[0], args[-1]
    rng = np.random.default_rng(0)
    theirs.zero_grad()
    out = _output(theirs(torch.from_numpy(np.asarray(ids)), attention_mask=torch.from_numpy(np.asarray(mask))))
    projection = rng.standard_normal(out.shape).astype(np.float32)
    (out * torch.from_numpy(projection)).sum().backward()
    want = out.detach().float().numpy()
    torch_grads = {}
    for path, layer in ours.items():
        module = modules[ROOT + paths[path]]
        for leaf in ("lora_A", "lora_B"):
            grad = getattr(module, leaf)["default"].weight.grad
            torch_grads[f"{path}.{leaf}"] = None if grad is None else \
                peft.from_peft_layout(layer, leaf, grad.float().numpy())  # in our layout
    # the fully trained modules beside the adapter (a classifier head): PEFT trains its copy of them
    named = dict(theirs.named_parameters())
    for key, (path, rule, _) in saved.items():
        owner = _copy_of(named, key, config["modules_to_save"])
        grad = None if owner is None else named[owner].grad
        torch_grads[path] = None if grad is None else to_flax(rule, grad.float().numpy())
    trained = {path for path, _, _ in saved.values()}

    def wrt(path, value) -> bool:
        return isinstance(value, lora.LoRAParam) or ".".join(map(str, path)) in trained

    def loss(m):
        return (jnp.asarray(m(ids, mask), jnp.float32) * projection).sum(), m(ids, mask)

    with jax.default_matmul_precision("highest"):
        was_eval = all(d.deterministic for _, d in nnx.iter_graph(model) if isinstance(d, nnx.Dropout))
        model.eval()
        try:
            (_, got), grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, wrt), has_aux=True)(model)
        finally:
            if not was_eval:
                model.train()
    got = np.asarray(got, np.float32)
    flat = {".".join(str(p) for p in k): np.asarray(v) for k, v in nnx.to_flat_state(grads)}
    finite = bool(np.isfinite(got).all() and np.isfinite(want).all()) and got.shape == want.shape
    forward = float(np.abs(got - want).max()) if finite else float("inf")
    worst, compared = 0.0, 0
    for key, theirs_grad in torch_grads.items():
        mine = flat.get(key)
        if theirs_grad is None or mine is None or mine.shape != theirs_grad.shape:
            worst = float("inf")
            continue
        scale = max(1.0, float(np.abs(theirs_grad).max()))
        worst = max(worst, float(np.abs(mine - theirs_grad).max()) / scale if np.isfinite(mine).all() else float("inf"))
        compared += 1
    return {"forward": {"max_abs_err": forward, "tolerance": TOLERANCE, "values": int(want.size)},
            "adapter_grads": {"max_rel_err": worst, "tolerance": GRAD_TOLERANCE, "tensors": compared,
                              "of": len(torch_grads)},
            "adapter_tensors_loaded": loaded,
            "inputs": {"seed": 0, "shape": list(np.shape(ids))}}


def _copy_of(named: dict, key: str, modules) -> str | None:
    """The name of PEFT's trained copy of the saved tensor ``key``: under the saved module M,
    ``base_model.model.M.weight`` is ``base_model.model.M.modules_to_save.default.weight``; None if absent."""
    parts = key[len(ROOT):].split(".")
    modules = [modules] if isinstance(modules, str) else list(modules)
    for i in range(1, len(parts)):
        if any(".".join(parts[:i]).endswith(m) for m in modules):  # PEFT's rule: peft._under
            name = ".".join([ROOT + ".".join(parts[:i]), "modules_to_save", "default", *parts[i:]])
            return name if name in named else None
    return None


def measured_passed(measured: dict) -> bool:
    """Whether a measurement (``measure``) meets its tolerances: the output, and every adapter gradient compared."""
    f, g = measured["forward"], measured["adapter_grads"]
    return (f["max_abs_err"] <= f["tolerance"] and g["max_rel_err"] <= g["tolerance"]
            and g["tensors"] == g["of"] > 0)  # NaN/inf compare False: never a pass


def _summary(measured: dict) -> str:
    f, g = measured["forward"], measured["adapter_grads"]
    return (f"forward max abs err {f['max_abs_err']:.2e} (tolerance {f['tolerance']:g}), adapter gradients max "
            f"rel err {g['max_rel_err']:.2e} over {g['tensors']} of {g['of']} tensors (tolerance {g['tolerance']:g})")


class AdapterSubject(ExportSubject):
    """A PEFT adapter folder as a certificate's subject: its record is its own (``record``), made
    through ``certificate.sidecar`` as every export's."""

    formats = ("peft",)

    def __init__(self, model, base):
        self.model, self.base = model, base

    def record(self, written: Path, fmt: str, final: Path) -> dict:
        """Measure the written adapter through peft and return its certificate, or raise
        ``CertificateError`` (nothing is written) when it fails."""
        measured = measure(self.model, written, self.base)
        if not measured_passed(measured):
            raise CertificateError(f"{final}: the adapter loaded in peft does not compute the JAX model's: "
                                   f"{_summary(measured)}; not written")
        return {"kind": KIND, "written": final.name, "adapter": _adapter_hashes(written),
                "base": base_identity(self.base), **measured, "versions": versions(), "platform": platform_info()}


@dataclass
class AdapterReport(Report):
    """What ``recheck`` found: ``failures`` (any one fails the check) and ``notes``."""

    path: Path
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    measured: dict | None = None

    @property
    def ok(self) -> bool:
        return not self.failures and self.measured is not None

    @property
    def passed(self) -> bool:
        return self.ok

    def to_dict(self) -> dict:
        return {"path": str(self.path), "passed": self.passed, "failures": list(self.failures),
                "notes": list(self.notes), "measured": self.measured}

    def summary(self) -> str:
        lines = [f"{self.path}: PEFT LoRA adapter certificate -> {'pass' if self.ok else 'FAIL'}"]
        if self.measured is not None:
            lines.append(f"  measured through peft now: {_summary(self.measured)}")
        lines += [f"  FAIL: {x}" for x in self.failures] + [f"  note: {x}" for x in self.notes]
        return "\n".join(lines)


def _read(folder: Path) -> dict:
    cert = folder / FILE
    if not cert.is_file():
        raise CertificateError(f"{folder} has no certificate ({FILE})")
    if cert.stat().st_size > MAX_BYTES:
        raise CertificateError(f"{cert}: more than {MAX_BYTES} bytes; not read")
    try:
        record = json.loads(cert.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise CertificateError(f"{cert} is not valid JSON: {str(error)[:200]}") from None
    if not isinstance(record, dict) or record.get("kind") != KIND:
        raise CertificateError(f"{cert}: not a PEFT adapter certificate (kind {record.get('kind') if isinstance(record, dict) else None!r})")
    for key, kind in (("adapter", dict), ("base", dict), ("forward", dict), ("adapter_grads", dict)):
        if not isinstance(record.get(key), kind):
            raise CertificateError(f"{cert}: field {key!r} is missing or not an object")
    base = record["base"]
    if not isinstance(base.get("path"), str) or not _digests(base.get("files")):
        raise CertificateError(f"{cert}: field 'base' must hold 'path' (a string) and 'files' (file name -> sha256)")
    adapter = record["adapter"]
    if not isinstance(adapter.get("tensors"), dict) or not isinstance(adapter.get("config_sha256"), str):
        raise CertificateError(f"{cert}: field 'adapter' must hold 'tensors' (an object: tensor name -> its hash) "
                               "and 'config_sha256' (a string)")
    return record


def _digests(value) -> bool:
    """Whether ``value`` is a non-empty {name: sha256 hex} object, as a certificate records its base's files."""
    return isinstance(value, dict) and bool(value) and all(
        isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in value.items())


def recheck(folder, *, base=None) -> AdapterReport:
    """Check an adapter folder against its certificate: hashes, the base, and a new measurement."""
    from flax_transformer.interop import hf

    folder = Path(folder)
    record = _read(folder)
    report = AdapterReport(folder)
    now = _adapter_hashes(folder)
    changed = sorted(k for k in set(now["tensors"]) | set(record["adapter"].get("tensors", {}))
                     if now["tensors"].get(k) != record["adapter"].get("tensors", {}).get(k))
    if changed:
        report.failures.append(f"{len(changed)} adapter tensors differ from the certified ones (first: {changed[0]})")
    if now["config_sha256"] != record["adapter"].get("config_sha256"):
        report.failures.append(f"{peft.CONFIG_FILE} differs from the certified one")
    base = Path(base or record["base"]["path"])
    if not base.is_dir():
        report.failures.append(f"the base {base} is not there (moved?): nothing to measure the adapter on")
        return report
    identity = base_identity(base)["files"]
    differ = sorted(k for k in set(identity) | set(record["base"]["files"])
                    if identity.get(k) != record["base"]["files"].get(k))
    if differ:
        report.failures.append(f"the base {base} is not the certified one: {', '.join(differ)} differ")
    kind = json.loads((folder / peft.CONFIG_FILE).read_text(encoding="utf-8")).get("task_type")
    if kind == "SEQ_CLS":  # the head's size is the adapter's saved classifier's
        labels = _num_labels(folder)
        model = hf.classifier_from_pretrained(base, **({"num_labels": labels} if labels else {}))
    else:
        model = hf.from_pretrained(base)
    peft.load_peft(model, folder)
    report.measured = measure(model, folder, base)
    if not measured_passed(report.measured):
        report.failures.append("the adapter through peft no longer computes the JAX model's")
    recorded = record["forward"].get("max_abs_err")
    if isinstance(recorded, (int, float)):
        report.notes.append(f"certified forward error {recorded:.2e}")
    return report
