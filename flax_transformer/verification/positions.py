"""Error against position: where along a sequence JAX's error leaves ``bisect``'s budget.

A position-dependent bug (RoPE scaling ignored, a sliding window off by one, a shifted position
table) is invisible in one number per module: the error is zero at the first positions and
grows, or starts at one position. So for every module call whose output is a sequence,
``bisect`` also keeps the error per position:

* ``jax[p]`` = max over batch and features of |JAX - float64| at position p,
* ``torch[p]`` = the same for torch fp32 (what float32 costs at p),

and ``onset``, the first position where ``jax[p]`` is above the call's budget (``bisect``'s rule,
one budget per call: so a call has an onset exactly when it diverged, and a correct port has
none). NaN or inf in JAX counts as an infinite error at its position, unless the float64 value
is the same infinity.

A sequence output is one whose floating-point arrays hold positions on axis 1 (``(b, t, ...)``,
at least 3 dimensions, axis 1 of the input's length: the first input of 2 or more dimensions,
``(b, t)`` ids or ``(b, t, features)``); arrays of another shape in the same output (an attention
map, an encoder's output of another length) count in the call's row, not in its positions. A
layer compared through a layout change (a convolution: axis 1 is channels there) has none.

The report keeps every call's positions; its ``to_dict`` writes the arrays for the first
divergent call and the model's output only (3 significant digits), and every row's onset.
Pure numpy: ``bisect`` measures, ``bisect_report`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PositionErrors:
    """One call's error per position against float64, and its budget (``bisect.budget``)."""

    torch: np.ndarray  # (t,) max |torch fp32 - fp64| at each position
    jax: np.ndarray  # (t,) max |JAX - fp64| at each position
    budget: float

    @property
    def onset(self) -> int | None:
        """The first position where JAX's error is above the budget (or not finite); None: none is."""
        out = ~(self.jax <= self.budget)  # NaN compares False: out
        return int(np.argmax(out)) if out.any() else None

    @property
    def peak(self) -> int:
        """The position of JAX's largest error (the first, on ties)."""
        return int(np.argmax(np.nan_to_num(self.jax, nan=np.inf)))

    def to_dict(self) -> dict:
        return {"onset": self.onset, "peak": self.peak, "budget": self.budget, "length": len(self.jax),
                "jax": _rounded(self.jax), "torch": _rounded(self.torch)}


def sequence_length(args) -> int | None:
    """Axis 1 of the first input array with 2 or more dimensions: (b, t) ids or (b, t, features)."""
    stack = list(args) if isinstance(args, (tuple, list)) else [args]
    while stack:
        x = stack.pop(0)
        if isinstance(x, (tuple, list)):
            stack[:0] = list(x)
        elif isinstance(x, dict):
            stack[:0] = list(x.values())
        elif getattr(x, "ndim", 0) >= 2:
            return int(x.shape[1])
    return None


def per_position(want: list, got: list, length: int | None) -> np.ndarray | None:
    """(t,) max |got - want| over every axis but 1, over the arrays that are sequences of ``length``
    (see the module docstring); None when none is. Equal values (equal infinities) count 0, NaN
    or another non-finite value in ``got`` infinite."""
    if not length:
        return None
    errs = None
    for g, w in zip(got, want, strict=True):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g64.ndim < 3 or g64.shape[1] != length or g64.shape != w64.shape:
            continue
        with np.errstate(invalid="ignore"):  # inf - inf
            d = np.abs(g64 - w64)
        d[g64 == w64] = 0.0
        d[~np.isfinite(g64) & (g64 != w64)] = np.inf  # NaN never agrees, even with a NaN in float64
        d[np.isnan(d)] = np.inf
        e = np.moveaxis(d, 1, 0).reshape(length, -1).max(axis=1, initial=0.0)
        errs = e if errs is None else np.maximum(errs, e)
    return errs


def measure(want: list, got_t: list, got_j: list, length: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(torch fp32's, JAX's) error per position of one call's aligned float leaves; None: not a sequence."""
    jax = per_position(want, got_j, length)
    return None if jax is None else (per_position(want, got_t, length), jax)


def attach(rows, measured: dict) -> dict[str, PositionErrors]:
    """{row path: PositionErrors} from ``measure``'s results by row path and each row's budget."""
    by_path = {r.path: r for r in rows}
    return {path: PositionErrors(t, j, by_path[path].budget) for path, (t, j) in measured.items()
            if path in by_path and by_path[path].budget is not None}


def summary_line(positions: dict[str, PositionErrors], first: str | None, model_path: str = "") -> str | None:
    """The report's positions line: where the first divergent call's error starts (``first``: its row
    path), and where the model's output's does or that it stays within budget; None when neither
    is a sequence."""
    at, root = positions.get(first) if first is not None else None, positions.get(model_path)
    parts = []
    if at is not None and at.onset is not None:
        parts.append(f"error starts at position {at.onset} of {len(at.jax)} in {first or '(model)'} "
                     f"(JAX {_fmt(at.jax[at.onset])} there, budget {_fmt(at.budget)}; largest at position {at.peak})")
    if root is not None and root is not at:
        if root.onset is not None:
            parts.append(f"the model's output from position {root.onset} (largest at position {root.peak})")
        else:
            ratio = float(np.max(root.jax, initial=0.0)) / root.budget if root.budget > 0 else 0.0
            parts.append(f"the model's output within budget at all {len(root.jax)} positions "
                         f"(largest error at position {root.peak}, {ratio:.2f} of the budget)")
    return ("positions: " + "; ".join(parts)) if parts else None


def report_dict(positions: dict[str, PositionErrors], first: str | None, model_path: str = "") -> dict:
    """The arrays the JSON keeps: the first divergent call's and the model output's, by row path."""
    keep = [p for p in (first, model_path) if p is not None and p in positions]
    return {p: positions[p].to_dict() for p in dict.fromkeys(keep)}


def _rounded(a: np.ndarray) -> list:
    return [float(f"{x:.3g}") if np.isfinite(x) else float(x) for x in np.asarray(a, np.float64)]


def _fmt(x) -> str:
    return f"{x:.2e}" if np.isfinite(x) else str(float(x))
