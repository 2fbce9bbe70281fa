"""Whether a certificate was measured against an implementation that read the config on its own.

A family's export is certified against its torch twin (``certificate.subjects.FamilySubject``), and
that twin is built by this library's own config reader: a field the reader gets wrong (a Mistral's
``layer_types`` read as a window on every layer) is wrong on both sides, and the certificate passes.
So an HF folder is also loaded by transformers itself, which reads ``config.json`` with its own
class for the ``model_type``, and its logits (last hidden state for an encoder) are compared with the
torch twin's on the certificate's inputs (the twin is held to the Flax model by the forward entry;
both in torch, eagerly: nothing more to compile). The certificate records the result as ``reader``: the
figures, or ``{"not_measured": why}`` (another format, a classifier, transformers missing or unable to
load the folder), which ``verify --checkpoint`` prints on its ``reader`` line.
"""

from __future__ import annotations

import numpy as np

from flax_transformer.verification.certificate.schema import brief
from flax_transformer.verification.reports import TOLERANCE

SHARED = "measured against torch_reference only: shares the config reader"


def not_measured(why: str) -> dict:
    return {"not_measured": f"{SHARED} ({why})"}


def entry(path, fmt: str, torch_model, args) -> dict:
    """The ``reader`` entry of the export at ``path``: transformers' reading of an HF folder against
    ``torch_model`` (the twin this library's reader built from it) on ``args`` (ids, mask), or why it
    was not measured."""
    if fmt != "hf":
        return not_measured(f"a {fmt} export holds this library's own description, which only it reads")
    if type(torch_model).__name__ == "TransformerForSequenceClassification":
        return not_measured("a classifier: transformers' AutoModel leaves its head out")
    try:
        import transformers

        from flax_transformer.interop import hf
    except ImportError:
        return not_measured("transformers is not installed")
    try:
        reference, missing = hf.transformers_from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - whatever transformers raises, it did not read the folder
        return not_measured(f"transformers {transformers.__version__} cannot load it: {type(error).__name__}: "
                            f"{brief(error, 160)}")
    import torch

    ids, mask = args[0], args[1]
    want = hf.transformers_output(reference, ids, mask)
    with torch.no_grad():
        got = torch_model(torch.from_numpy(np.asarray(ids)), torch.from_numpy(np.asarray(mask))).float().numpy()
    finite = bool(np.isfinite(want).all() and np.isfinite(got).all())
    err = float(np.max(np.abs(want - got))) if finite and want.shape == got.shape else float("inf")
    scale = max(1.0, float(np.max(np.abs(want)))) if finite else 1.0
    out = {"implementation": f"transformers {transformers.__version__}", "max_abs_err": err,
           "max_rel_err": err / scale, "scale": scale, "finite": finite, "tolerance": TOLERANCE,
           "passed": finite and err / scale <= TOLERANCE and not missing}
    if missing:  # transformers initialised them at random: the folder is not the model it reads
        out["not_compared"] = brief(f"transformers found no {', '.join(missing[:5])}" +
                                    (f" and {len(missing) - 5} more" if len(missing) > 5 else ""), 300)
    return out


def line(reader: dict | None) -> str:
    """A ``reader`` entry in words (None: a certificate from before it)."""
    if reader is None:
        return f"{SHARED} (the certificate predates the reader entry)"
    if "not_measured" in reader:
        return reader["not_measured"]
    return (f"read independently by {reader['implementation']}: max relative err {reader['max_rel_err']:.2e}"
            f"{'' if reader['finite'] else ' (NaN/inf)'} (tolerance {reader['tolerance']:g})"
            + (f"; {reader['not_compared']}" if reader.get("not_compared") else ""))


def recheck(report, path, record: dict, torch_model, args) -> None:
    """The ``reader`` entry measured again into ``report`` (a ``RecheckReport``): its ``reader`` line,
    and a failure when transformers reads the folder otherwise."""
    now = entry(path, record["format"], torch_model, args)
    report.reader = now["not_measured"] if "not_measured" in now else line(now) + " now"
    if not now.get("passed", True):
        report.failures.append(report.reader)
