"""Certified exports: the weights files of ``interop``, each written with the verification
certificate that it was checked (``certificate``), in one atomic write.

    export.save_safetensors(model, "m.safetensors")   # m.safetensors + m.safetensors.verification.json
    export.save_pretrained(model, "folder")           # an HF folder with verification.json inside

Each function takes the arguments of the ``interop`` writer it wraps (``checkpoints.save_*``,
``hf.save_pretrained``) plus ``certify``. The writer writes the weights under a temporary name;
its ``before_swap`` hook (``certificate.sidecar``) reloads them in torch, measures them against
the model, and hands back the certificate, which the writer puts in with the weights. A failed
check raises ``certificate.schema.CertificateError`` and writes nothing. ``certify=False`` writes the
weights alone, for a model torch cannot check or when time matters more than evidence.

Before any of that, a certified export checks the model's own values: a parameter holding NaN or
inf raises ``NonFiniteWeights`` naming the tensors (they come from where the model came from, its
source checkpoint or its training, not from the writer), and nothing is written. ``certify=False``
writes them anyway (weights kept non-finite on purpose).

Your own model (an NNX model the library's four families do not include) is exported against the
torch model it twins, ``reference=`` (``certificate.subjects.UserSubject``)::

    export.save_safetensors(flax_model, "m.safetensors", reference=torch_model, inputs=(ids,))

The file holds the reference's ``state_dict()`` names and layouts (orbax: the Flax parameter tree),
and the certificate is measured against a fresh copy of the reference filled from the file. The
issue's ``checkpoints.save_*(..., reference=)`` is this: the ``interop`` writers never import
verification, so the reference (which the check needs) is taken here.

Why a module of its own: writers write bytes and do not judge them. The I/O layer knows nothing
of verification; this one puts the two together.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from flax_transformer.interop import checkpoints, files, hf, orbax_quiet, porting, safetensors_io, values
from flax_transformer.interop.values import to_numpy
from flax_transformer.verification import certificate
from flax_transformer.verification.certificate import subjects as certificate_subjects
from flax_transformer.verification.certificate.subjects import (
    FamilySubject,
    UserSubject,
    input_record,
    rename_record,
    torch_names,
)

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
        return {path: param[...] for path, param in porting.flax_params(model).items()}


def check_finite(model, *, source=None, hint: str = CERTIFY_HINT) -> None:
    """Raise ``NonFiniteWeights`` naming every parameter of ``model`` that holds NaN or inf (torch names,
    read one at a time). The certified exports call it before writing anything. ``source``: where the
    model came from, for the message."""
    found = values.nonfinite(_named_values(model))
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
    found = values.nonfinite(safetensors_io.open_weights(src))
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
        return writer(model, path, overwrite=overwrite, before_swap=certificate.sidecar(fmt, FamilySubject(model)))
    written = writer(model, path, overwrite=overwrite)
    beside.unlink(missing_ok=True)  # an earlier export's certificate would not describe these weights
    return written


def save_safetensors(model, path, *, reference=None, rename=None, inputs=None, overwrite: bool = False,
                     certify: bool = True) -> Path:
    """``checkpoints.save_safetensors`` and, with ``certify``, ``PATH.verification.json`` beside it.
    Your own model: ``reference=`` (see ``save_own``)."""
    if _own(model, reference, rename, inputs):
        return save_own("safetensors", model, path, reference=reference, rename=rename, inputs=inputs,
                        overwrite=overwrite, certify=certify)
    return _file_export(checkpoints.save_safetensors, "safetensors", model, path, overwrite=overwrite,
                        certify=certify)


def save_torch(model, path, *, reference=None, rename=None, inputs=None, overwrite: bool = False,
               certify: bool = True) -> Path:
    """``checkpoints.save_torch`` and, with ``certify``, ``PATH.verification.json`` beside it, which
    also says which model the bare ``state_dict`` file holds. Your own model: ``reference=``."""
    if _own(model, reference, rename, inputs):
        return save_own("torch", model, path, reference=reference, rename=rename, inputs=inputs,
                        overwrite=overwrite, certify=certify)
    return _file_export(checkpoints.save_torch, "torch", model, path, overwrite=overwrite, certify=certify)


def save_orbax(model, path, *, reference=None, rename=None, inputs=None, overwrite: bool = False,
               certify: bool = True) -> Path:
    """``checkpoints.save_orbax`` and, with ``certify``, ``verification.json`` inside the folder.
    Your own model: ``reference=`` (the folder holds its Flax parameter tree)."""
    if _own(model, reference, rename, inputs):
        return save_own("orbax", model, path, reference=reference, rename=rename, inputs=inputs,
                        overwrite=overwrite, certify=certify)
    if certify:
        files.check_target(path, kind="dir", overwrite=overwrite)  # a wrong target first, as the writer would
        check_finite(model)
    hook = certificate.sidecar("orbax", FamilySubject(model)) if certify else None
    return checkpoints.save_orbax(model, path, overwrite=overwrite, before_swap=hook)


# --------------------------------------------------------------- your own model

REFERENCE_HINT = ("give the torch model it twins: reference=a torch nn.Module (the file gets its state_dict "
                  "names), or a factory: a function returning one, or 'MODULE:FACTORY' whose FACTORY() returns "
                  "(torch_model, flax_model, args), as `flax-transformer verify --pair MODULE:FACTORY` takes")


def _own(model, reference, rename, inputs) -> bool:
    """Whether ``model`` is exported as a user's own model, against ``reference``."""
    if reference is not None:
        return True
    if rename is not None or inputs is not None:
        raise ValueError("rename= and inputs= describe the check against a torch reference: give reference= too "
                         f"({REFERENCE_HINT})")
    if porting.family_or_none(model) is None:
        raise TypeError(f"{type(model).__name__} is not a flax_transformer or torch_reference model; to export "
                        f"your own model, {REFERENCE_HINT}")
    return False


def _reference(reference):
    """(torch model, its "MODULE:FACTORY" or None, the factory's (args, kwargs) or None)."""
    import torch

    if isinstance(reference, torch.nn.Module):
        return reference, None, None
    if not (isinstance(reference, str) or callable(reference)):
        raise TypeError(f"reference= must be a torch nn.Module, a factory or 'MODULE:FACTORY', got "
                        f"{type(reference).__name__}; {REFERENCE_HINT}")
    name = certificate_subjects.factory_name(reference)
    made = certificate_subjects.run_factory(certificate_subjects.load_factory(reference) if isinstance(reference, str) else reference, name)
    if isinstance(made, torch.nn.Module):
        return made, reference if isinstance(reference, str) else None, None
    torch_model, _, args, kwargs = certificate_subjects.unpack_pair(made, name)
    return torch_model, reference if isinstance(reference, str) else None, (args, kwargs)


def _inputs(model, inputs, given, spec) -> tuple[tuple, dict, str]:
    """(args, kwargs, where they came from): ``inputs=``, else the factory's, else ``model.input_spec()``."""
    if inputs is not None:
        if not isinstance(inputs, (tuple, list)):
            raise ValueError(f"inputs= is the tuple of the model's arguments, e.g. (ids,), not a "
                             f"{type(inputs).__name__}")
        return tuple(inputs), {}, "given (inputs=)"
    if given is not None:
        return (*given, f"the args of the reference factory {spec or 'given'}")
    if callable(getattr(model, "input_spec", None)):
        shape = certificate.INPUTS
        return (certificate_subjects.example_inputs(model, **shape), {},
                f"certificate_subjects.example_inputs from input_spec() (seed {shape['seed']}, batch {shape['batch']}, "
                f"length {shape['length']})")
    raise ValueError(f"{type(model).__name__} has no input_spec() to draw example inputs from: pass inputs=(the "
                     "model's arguments, e.g. (ids,)) to certify it on them")


def save_own(fmt: str, model, path, *, reference, rename=None, inputs=None, overwrite: bool = False,
             certify: bool = True) -> Path:
    """Your own NNX model as ``fmt`` ("safetensors", "torch", "orbax"), certified against ``reference``.

    The file holds ``reference``'s ``state_dict()`` names and layouts (every name of a tied tensor,
    each a copy: safetensors keeps no shared storage; torch's file keeps the tie as
    ``torch.save(model.state_dict())`` does), filled with ``porting.flax_to_torch(model, copy of
    reference)``; an orbax folder holds the Flax parameter tree. The reference gives the structure
    only; its own weights are not used. With ``certify``: the certificate (``UserSubject``)
    measured on ``inputs`` (the model's arguments; default the reference factory's, else drawn
    from ``model.input_spec()``).

    Args:
        reference: a torch ``nn.Module``, a function returning one or a ``--pair`` factory's
            ``(torch_model, flax_model, args[, kwargs])``, or ``"MODULE:FACTORY"`` (recorded, so
            the re-check can name it).
        rename: porting's ``[(regex, replacement), ...]``, torch names -> the Flax model's, as
            ``porting.torch_to_flax``, ``compare`` and ``verify --pair --rename`` take it.
    """
    kind = "dir" if fmt == "orbax" else "file"
    path = files.check_target(Path(path).absolute() if kind == "dir" else path, kind=kind, overwrite=overwrite)
    beside = certificate.path_for(path)
    if kind == "file":
        files.check_target(beside, kind="file", overwrite=True)  # a folder or link there: refused before any work
    rename_record(rename)  # a rename the certificate cannot record: refused before any work
    torch_model, spec, given = _reference(reference)
    hook = None
    if certify:
        args, kwargs, drawn_by = _inputs(model, inputs, given, spec)
        input_record(args, kwargs)  # inputs it cannot record: refused before any work
        check_finite(model)
        hook = certificate.sidecar(fmt, UserSubject(model, torch_model, spec=spec, rename=rename, args=args,
                                                    kwargs=kwargs, drawn_by=drawn_by))
    if fmt == "orbax":
        return files.write_dir(path, lambda tmp: _write_orbax(model, tmp), overwrite=overwrite, before_swap=hook)
    filled = porting.flax_to_torch(model, copy.deepcopy(torch_model),
                                   rename=torch_names(rename, torch_model))
    state = filled.state_dict()
    if fmt == "safetensors":
        arrays = {k: np.ascontiguousarray(to_numpy(v)) for k, v in state.items()}
        write = lambda tmp: files.save_safetensors_file(arrays, tmp, {"format": "pt"})  # noqa: E731
    else:
        write = lambda tmp: files.save_torch_file(state, tmp)  # noqa: E731
    written = files.write_file(path, write, overwrite=overwrite, before_swap=hook)
    if not certify:
        beside.unlink(missing_ok=True)  # an earlier export's certificate would not describe these weights
    return written


def _write_orbax(model, tmp: Path) -> None:
    import orbax.checkpoint as ocp
    from flax import nnx

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with orbax_quiet.errors_raised_not_logged(), ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp / "params", params)


def save_pretrained(model, path, *, overwrite: bool = False, certify: bool = True, dtype=None, **kwargs) -> Path:
    """``hf.save_pretrained`` (same arguments) and, with ``certify``, ``verification.json`` inside the
    folder. A ``dtype`` export is certified on the values it holds (its bf16 values, say)."""
    hook = None
    if certify:
        files.check_target(path, kind="dir", overwrite=overwrite)  # a wrong target first, as the writer would
        check_finite(model)
        state = None
        if dtype is not None:  # the model's values as the folder stores them
            stored = np.dtype(hf.save_dtype(dtype))
            state = {k: np.asarray(safetensors_io.read(v)).astype(stored)
                     for k, v in safetensors_io.model_tensors(model).items()}
        hook = certificate.sidecar("hf", FamilySubject(model, state))
    return hf.save_pretrained(model, path, overwrite=overwrite, dtype=dtype, before_swap=hook, **kwargs)


def save_peft(model, path, *, base, overwrite: bool = False, certify: bool = True, **kwargs) -> Path:
    """``interop.peft.save_peft`` (same arguments; ``base_model_name_or_path`` defaults to ``base``) and,
    with ``certify``, ``verification.json`` inside the folder: the adapter loaded by ``peft`` onto
    transformers' model of the HF folder ``base`` computes the JAX model's output and adapter
    gradients (``certificate.peft``), or nothing is written. Refused before any work: a merged model (its
    adapters take no part in its output) and, with ``certify``, a ``base`` that is no HF folder."""
    from flax_transformer.interop import peft
    from flax_transformer.models import lora
    from flax_transformer.verification.certificate import peft as certificate_peft

    if any(getattr(layer, "merged", False) for layer in lora.layers(model).values()):  # adapters out of its output
        raise ValueError("the model's LoRA is merged (lora.merge): unmerge it (lora.unmerge) to save its adapter, "
                         "or save the merged model with save_pretrained")
    hook = None
    if certify:
        files.check_target(path, kind="dir", overwrite=overwrite)
        if not (Path(base) / "config.json").is_file():  # the base is what the adapter is certified on: first
            what = "holds no config.json" if Path(base).is_dir() else "is not a folder"
            raise FileNotFoundError(f"base={str(base)!r} {what}: save_peft certifies the adapter on its base, the HF "
                                    "folder the model was loaded from (certify=False writes it unchecked)")
        check_finite(model)
        hook = certificate.sidecar("peft", certificate_peft.AdapterSubject(model, base))
    kwargs.setdefault("base_model_name_or_path", str(base))
    return peft.save_peft(model, path, overwrite=overwrite, before_swap=hook, **kwargs)
