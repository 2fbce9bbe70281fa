"""One output leaf or one gradient, checked: torch fp32 against JAX, and both against the float64
torch reference where it ran (``check``), with NaN/inf counted apart (they never agree); the leaves of
two outputs of any structure matched and checked (``outputs``). ``compare`` makes its rows from these.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from flax_transformer.verification.bisect import _scale, budget
from flax_transformer.verification.frameworks import finite_abs_err, flatten, match_outputs, nonfinite, to_numpy
from flax_transformer.verification.precision import FP32, Precision


def logits_path(torch_out) -> str | None:
    """Which leaf of a language model's output holds its logits (``compare(..., lm=True)``): the
    output itself, a ``.logits`` field (HF's ``ModelOutput``), else the first leaf that is not None
    (``(logits, loss)``). None: no leaf at all."""
    paths = [p for p, v in flatten(torch_out) if v is not None]
    return next((p for p in paths if p.endswith((".logits", "['logits']"))), paths[0] if paths else None)


def leaf(out, path: str | None, torch_out=None):
    """The leaf of ``out`` at torch's ``path`` (as numpy; None where there is none); with
    ``torch_out``, ``out`` is Flax's output, its leaves paired with torch's as ``compare`` pairs them."""
    if torch_out is None:
        return next((to_numpy(v) for p, v in flatten(out) if p == path), None)
    return next((to_numpy(j) for _, p, _, j in match_outputs(torch_out, out)[0] if p == path), None)


def outputs(torch_out, flax_out, ref_out, measured: bool, low_out=None, precision: Precision = FP32):
    """(checks of the array leaves, entries of the other leaves, what was not compared, what differs),
    leaves matched by ``frameworks.match_outputs``; ``low_out``: torch's outputs at ``precision``
    (None: ``torch_out`` is at it)."""
    arrays, others, mismatched = match_outputs(torch_out, flax_out)
    ref = dict(flatten(ref_out)) if ref_out is not None else {}
    low = dict(flatten(low_out)) if low_out is not None else {}
    checks, skipped = [], []
    for name, path, t, j in arrays:
        leaf = check(t, j, ref.get(path), measured=measured, low=low.get(path) if low_out is not None else None,
                     precision=precision)
        leaf["output"] = name
        checks.append(leaf)
        if leaf["skipped"]:
            skipped.append(f"{name}: {leaf['skipped']}")
    if not checks:
        skipped.append("no array among the outputs")
    return checks, others, skipped, mismatched


def blank(shape, skipped: str = "") -> dict:
    """A check with nothing measured yet (``skipped``: why nothing will be)."""
    return {"shape": list(shape), "max_abs_err": 0.0, "finite": True, "torch_scale": 0.0,
            "nonfinite_jax": 0, "nonfinite_torch": 0, "nonfinite_both": 0,
            "jax_err": None, "torch_err": None, "scale": None, "budget": None, "skipped": skipped}


def is_numeric(a) -> bool:
    return isinstance(a, np.ndarray) and (a.dtype.kind in "biuf" or jnp.issubdtype(a.dtype, jnp.floating))


def check(t, j, r, *, measured: bool, low=None, precision: Precision = FP32) -> dict:
    """One output leaf (or one gradient): torch fp32 ``t`` against JAX ``j``, both against float64
    torch ``r`` where ``measured`` (the budget from this leaf's own figures, by ``precision``'s rule;
    torch's error is ``low``'s, torch run at that precision, where given, else ``t``'s)."""
    t, j = to_numpy(t), to_numpy(j)
    kinds = f"torch {type(t).__name__}, flax {type(j).__name__}"
    t, j = np.asarray(t), np.asarray(j)
    result = blank(t.shape)
    if not (is_numeric(t) and is_numeric(j)):
        result["skipped"] = f"not numeric arrays ({kinds})"
        return result
    if t.shape != j.shape:
        raise AssertionError(f"output shapes differ: torch {t.shape} vs flax {j.shape}")
    t64, j64 = np.atleast_1d(np.asarray(t, np.float64)), np.atleast_1d(np.asarray(j, np.float64))
    keep = np.isfinite(t64) & np.isfinite(j64)
    finite = bool(keep.all())
    if finite:  # the common case, without the masks
        result.update(max_abs_err=float(np.abs(t64 - j64).max(initial=0.0)),
                     torch_scale=float(np.abs(t64).max(initial=0.0)))
    else:
        only_t, only_j, both, differ = nonfinite(t64, j64)
        result.update(max_abs_err=finite_abs_err(t64, j64), finite=False, torch_scale=_scale([t64]),
                     nonfinite_jax=only_j + differ, nonfinite_torch=only_t + differ, nonfinite_both=both)
    if not measured or not jnp.issubdtype(t.dtype, jnp.floating):
        return result  # integer outputs are compared exactly; nothing to measure against float64
    if r is None:
        result["skipped"] = "no float64 reference for it"
        return result
    r64 = np.atleast_1d(np.asarray(to_numpy(r), np.float64))
    if low is not None:  # torch at the Flax model's precision: its error sets the budget
        t64 = np.atleast_1d(np.asarray(to_numpy(low), np.float64))
        if t64.shape != r64.shape:
            result["skipped"] = f"torch in {precision.name} gave another shape ({t64.shape} vs {r64.shape})"
            return result
    finite_r = np.isfinite(r64) & np.isfinite(t64)
    lost = 0 if finite and finite_r.all() else int((keep & ~finite_r).sum())
    if not (finite and finite_r.all()):
        keep &= finite_r
        t64, j64, r64 = t64[keep], j64[keep], r64[keep]
    torch_err = float(np.abs(t64 - r64).max(initial=0.0))
    jax_err = float(np.abs(j64 - r64).max(initial=0.0))
    scale = float(np.abs(r64).max(initial=0.0))
    result.update(torch_err=torch_err, jax_err=jax_err, scale=scale, budget=budget(torch_err, scale, precision))
    if lost:
        where = "the float64 reference" if low is None else f"the float64 reference or torch in {precision.name}"
        result["skipped"] = f"{lost} values NaN/inf in {where}, finite in both frameworks"
    return result
