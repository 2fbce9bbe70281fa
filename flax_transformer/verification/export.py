"""Certified exports: the weights files of ``interop``, each written with the verification
certificate that it was checked (``certificate``), in one atomic write.

    export.save_safetensors(model, "m.safetensors")   # m.safetensors + m.safetensors.verification.json
    export.save_pretrained(model, "folder")           # an HF folder with verification.json inside

Each function takes the arguments of the ``interop`` writer it wraps (``checkpoints.save_*``,
``hf.save_pretrained``) plus ``certify``. The writer writes the weights under a temporary name;
its ``before_swap`` hook (``certificate.sidecar``) reloads them in torch, measures them against
the model, and hands back the certificate, which the writer puts in with the weights. A failed
check raises ``certificate.CertificateError`` and writes nothing. ``certify=False`` writes the
weights alone, for a model torch cannot check or when time matters more than evidence.

Before any of that, a certified export checks the model's own values: a parameter holding NaN or
inf raises ``NonFiniteWeights`` naming the tensors (they come from where the model came from, its
source checkpoint or its training, not from the writer), and nothing is written. ``certify=False``
writes them anyway (weights kept non-finite on purpose).

Why a module of its own: writers write bytes and do not judge them. The I/O layer knows nothing
of verification; this one puts the two together.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flax_transformer.interop import checkpoints, files, hf, porting, safetensors_io
from flax_transformer.verification import certificate

CERTIFY_HINT = "certify=False writes them anyway"  # port says --no-certify
SOURCE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class NonFiniteWeights(ValueError):
    """The weights to export hold NaN or inf: refused before anything is written, naming the tensors."""


def _refusal(found: list[str], whose: str, why: str, hint: str) -> NonFiniteWeights:
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    tensors = "1 tensor" if len(found) == 1 else f"{len(found)} tensors"
    return NonFiniteWeights(f"{whose} NaN/inf in {tensors}: {', '.join(found[:5])}{more}; {why}; nothing was "
                            f"written ({hint})")


def _named_values(model) -> dict:
    """The model's parameters under torch names (as the exports write them), else under Flax paths."""
    try:
        return safetensors_io.model_tensors(model)
    except (ValueError, TypeError, KeyError):  # not a model of the families: its own parameter paths
        return {path: param[...] for path, param in porting._flax_params(model).items()}


def check_finite(model, *, source=None, hint: str = CERTIFY_HINT) -> None:
    """Raise ``NonFiniteWeights`` naming every parameter of ``model`` that holds NaN or inf (torch names,
    read one at a time). The certified exports call it before writing anything. ``source``: where the
    model came from, for the message."""
    found = porting.nonfinite(_named_values(model))
    if found:
        whose = f"the model read from {source} holds" if source is not None else "the model holds"
        raise _refusal(found, whose, "these values come from its source (the checkpoint it was loaded from, or "
                                     "its training), not from the writer", hint)


def check_source_finite(src, *, hint: str = CERTIFY_HINT) -> bool:
    """Raise ``NonFiniteWeights`` naming every tensor of the checkpoint ``src`` (an HF folder or a
    weights file) that holds NaN or inf, under its name in ``src``, each read in turn. False when
    ``src`` is neither (an orbax folder, a training run): check the model it gives with
    ``check_finite`` instead."""
    src = Path(src)
    if not ((src.is_dir() and (src / "config.json").is_file()) or (src.is_file() and src.suffix in SOURCE_SUFFIXES)):
        return False
    found = porting.nonfinite(safetensors_io.open_weights(src))
    if found:
        raise _refusal(found, f"{src} holds", "these are the source's own values, found before any export, "
                                              "not made by the conversion or the writer", hint)
    return True


def _file_export(writer, fmt: str, model, path, *, overwrite: bool, certify: bool) -> Path:
    path = files.check_target(path, kind="file", overwrite=overwrite)
    beside = certificate.path_for(path)
    files.check_target(beside, kind="file", overwrite=True)  # a folder or link there: refused before any work
    if certify:
        check_finite(model)
        return writer(model, path, overwrite=overwrite, before_swap=certificate.sidecar(fmt, model))
    written = writer(model, path, overwrite=overwrite)
    beside.unlink(missing_ok=True)  # an earlier export's certificate would not describe these weights
    return written


def save_safetensors(model, path, *, overwrite: bool = False, certify: bool = True) -> Path:
    """``checkpoints.save_safetensors`` and, with ``certify``, ``PATH.verification.json`` beside it."""
    return _file_export(checkpoints.save_safetensors, "safetensors", model, path, overwrite=overwrite,
                        certify=certify)


def save_torch(model, path, *, overwrite: bool = False, certify: bool = True) -> Path:
    """``checkpoints.save_torch`` and, with ``certify``, ``PATH.verification.json`` beside it, which
    also says which model the bare ``state_dict`` file holds."""
    return _file_export(checkpoints.save_torch, "torch", model, path, overwrite=overwrite, certify=certify)


def save_orbax(model, path, *, overwrite: bool = False, certify: bool = True) -> Path:
    """``checkpoints.save_orbax`` and, with ``certify``, ``verification.json`` inside the folder."""
    if certify:
        files.check_target(path, kind="dir", overwrite=overwrite)  # a wrong target first, as the writer would
        check_finite(model)
    hook = certificate.sidecar("orbax", model) if certify else None
    return checkpoints.save_orbax(model, path, overwrite=overwrite, before_swap=hook)


def save_pretrained(model, path, *, overwrite: bool = False, certify: bool = True, dtype=None, **kwargs) -> Path:
    """``hf.save_pretrained`` (same arguments) and, with ``certify``, ``verification.json`` inside the
    folder. A ``dtype`` export is certified on the values it holds (its bf16 values, say)."""
    hook = None
    if certify:
        files.check_target(path, kind="dir", overwrite=overwrite)  # a wrong target first, as the writer would
        check_finite(model)
        state = None
        if dtype is not None:  # the model's values as the folder stores them
            stored = np.dtype(hf._save_dtype(dtype))
            state = {k: np.asarray(safetensors_io.read(v)).astype(stored)
                     for k, v in safetensors_io.model_tensors(model).items()}
        hook = certificate.sidecar("hf", model, state=state)
    return hf.save_pretrained(model, path, overwrite=overwrite, dtype=dtype, before_swap=hook, **kwargs)
