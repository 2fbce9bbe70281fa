"""Whether a certificate was measured against an implementation that read the config on its own.

A family's export is certified against its torch twin (``certificate.subjects.FamilySubject``), and
that twin is built by this library's own config reader: a field the reader gets wrong (a Mistral's
``layer_types`` read as a window on every layer) is wrong on both sides, and the certificate passes.
So an HF folder is also loaded by transformers itself, which reads ``config.json`` with its own
class for the ``model_type``, and its logits (last hidden state for an encoder) are compared with the
Flax model's on the certificate's inputs. The certificate records the result as ``reader``: the
figures, or ``{"not_measured": why}`` (another format, a classifier, transformers missing or unable to
load the folder), which ``verify --checkpoint`` prints as a note. Every line says which it was.
"""

from __future__ import annotations

import numpy as np

from flax_transformer.verification.certificate.schema import brief
from flax_transformer.verification.reports import TOLERANCE

SHARED = "measured against torch_reference only: shares the config reader"


def not_measured(why: str) -> dict:
    return {"not_measured": f"{SHARED} ({why})"}


def entry(path, fmt: str, flax_model, args) -> dict:
    """The ``reader`` entry of the export at ``path``: transformers' reading of an HF folder against
    ``flax_model`` on ``args`` (ids, mask), or why it was not measured."""
    if fmt != "hf":
        return not_measured(f"a {fmt} export holds this library's own description, which only it reads")
    if type(flax_model).__name__ == "TransformerForSequenceClassification":
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
    from flax_transformer.verification.frameworks import apply

    ids, mask = args[0], args[1]
    want = hf.transformers_output(reference, ids, mask)
    got = np.asarray(apply(flax_model, (ids, mask), {}), dtype=np.float32)
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


def recheck(report, path, record: dict, flax_model, args) -> None:
    """The ``reader`` entry measured again into ``report`` (a ``RecheckReport``): a pass or failure
    when transformers read the folder, else a note saying that the check shares the config reader."""
    now = entry(path, record["format"], flax_model, args)
    if "not_measured" in now:
        report.notes.append(now["not_measured"])
    else:
        (report.passes if now["passed"] else report.failures).append(line(now) + " now")
