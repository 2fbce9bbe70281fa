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

Why a module of its own: writers write bytes and do not judge them. The I/O layer knows nothing
of verification; this one puts the two together.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flax_transformer.interop import checkpoints, files, hf
from flax_transformer.verification import certificate


def _file_export(writer, fmt: str, model, path, *, overwrite: bool, certify: bool) -> Path:
    path = files.check_target(path, kind="file", overwrite=overwrite)
    beside = certificate.path_for(path)
    files.check_target(beside, kind="file", overwrite=True)  # a folder or link there: refused before any work
    if certify:
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
    hook = certificate.sidecar("orbax", model) if certify else None
    return checkpoints.save_orbax(model, path, overwrite=overwrite, before_swap=hook)


def save_pretrained(model, path, *, overwrite: bool = False, certify: bool = True, dtype=None, **kwargs) -> Path:
    """``hf.save_pretrained`` (same arguments) and, with ``certify``, ``verification.json`` inside the
    folder. A ``dtype`` export is certified on the values it holds (its bf16 values, say)."""
    hook = None
    if certify:
        state = None
        if dtype is not None:  # the model's values as the folder stores them
            from flax_transformer.interop import safetensors_io

            stored = np.dtype(hf._save_dtype(dtype))
            state = {k: np.asarray(safetensors_io.read(v)).astype(stored)
                     for k, v in safetensors_io.model_tensors(model).items()}
        hook = certificate.sidecar("hf", model, state=state)
    return hf.save_pretrained(model, path, overwrite=overwrite, dtype=dtype, before_swap=hook, **kwargs)
