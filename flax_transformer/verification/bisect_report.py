"""What ``bisect`` reports: one row per module call (``ModuleRow``) and per
parameter gradient (``GradRow``), and ``BisectReport`` (verdict, summary, tree, JSON).

``bisect`` (the measuring) builds these; this module holds no measuring code, so a change to
how a report reads or judges touches only this file. The module docstring of ``bisect``
describes the statuses and the verdict.

Error against position (``PositionErrors``, in ``BisectReport.positions``): where along a sequence
JAX's error leaves the budget.

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
``measure.position_errors`` measures, this module prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from flax_transformer.verification.precision import PRECISIONS, Precision, budget, budget_rule
from flax_transformer.verification.reports import Report
from flax_transformer.verification.routing import expert_lines

MODEL = "<model>"  # first_divergent when the error is in the whole model's own row (its path is "")
GRADIENTS = "<gradients>"  # first_divergent when the forward agrees and a gradient does not
INCOMPLETE = "<incomplete>"  # first_divergent when nothing disagrees but something was not compared
WEIGHTS = "<weights>"  # first_divergent when the Flax model's weights are not a trace's (``trace_bisect``)
# a torch call with no Flax call that is no gap in the report (``_not_called_status``)
COVERED_FREE = "covered: parameter-free, computed inline in Flax (in its parent's row)"
COVERED_READ = "covered: the Flax twin reads this module without calling it (in its parent's row)"
BOTH_NONFINITE = "not finite in either framework"  # a status: fails unless allow_nonfinite
TORCH_NONFINITE = "not finite in torch only"  # a status: always fails
DIVERGED = ("introduced", "inherited", "diverged")


def _path(name: str) -> str:
    """A row's path from a name in a report: ``MODEL`` is the model's own row, path ""."""
    return "" if name == MODEL else name


def _fails(status: str, allow_nonfinite: bool) -> bool:
    return status in DIVERGED or status == TORCH_NONFINITE or (status == BOTH_NONFINITE and not allow_nonfinite)


@dataclass(frozen=True)
class ModuleRow:
    """One submodule call: errors against the fp64 reference, end to end and rerun alone."""

    path: str  # torch naming, "" = the model; "#k" marks the k-th repeated call
    kind: str  # the torch class
    torch_err: float | None = None  # torch (at the Flax model's precision, fp32 mostly) vs fp64
    jax_err: float | None = None  # JAX vs fp64
    scale: float = 0.0  # max |fp64 output|
    local_torch_err: float | None = None  # rerun alone on the fp64 input
    local_jax_err: float | None = None
    # ok | introduced | inherited | diverged (no rerun possible) | not finite in either framework |
    # not finite in torch only | skipped: why
    status: str = "ok"
    nonfinite_jax: int = 0  # output values NaN/inf in JAX where torch fp32 has another value
    nonfinite_torch: int = 0  # ... in torch fp32 where JAX has another value
    nonfinite_both: int = 0  # ... NaN/inf in both, the same value
    produced: str = ""  # "JAX", "torch" or "JAX, torch": its inputs finite there, its output not
    flax_path: str = ""  # the Flax call's path where rename= gives another one
    note: str = ""  # how it was compared, where that is not as it is (a layout moved)
    precision: str = "float32"  # the Flax model's compute dtype: torch ran at it, the budget is its rule

    @property
    def ratio(self) -> float | None:
        if self.jax_err is None or self.torch_err is None:
            return None
        return self.jax_err / self.torch_err if self.torch_err > 0 else (0.0 if self.jax_err == 0 else float("inf"))

    @property
    def budget(self) -> float | None:
        return None if self.torch_err is None else budget(self.torch_err, self.scale, PRECISIONS[self.precision])


@dataclass(frozen=True)
class GradRow:
    """One parameter's gradient (torch key) against the fp64 reference's."""

    name: str
    torch_err: float
    jax_err: float
    scale: float
    status: str  # ok | diverged | not finite in either framework | not finite in torch only | skipped: why
    nonfinite_jax: int = 0
    nonfinite_torch: int = 0
    nonfinite_both: int = 0
    budget: float | None = None  # grad_budgets: over the model
    note: str = ""  # "tied: lm_head.weight = tok_emb.weight": a tensor with several keys, its uses summed
    keys: tuple[str, ...] = ()  # every torch key of a tied tensor (``name`` is the first)

    @property
    def ratio(self) -> float:
        return self.jax_err / self.torch_err if self.torch_err > 0 else (0.0 if self.jax_err == 0 else float("inf"))


def _status_text(row) -> str:
    """A row's status with its notes: how it was compared, the Flax path ``rename=`` gave it."""
    notes = [n for n in (row.note, f"Flax: {row.flax_path}" if getattr(row, "flax_path", "") else "") if n]
    return row.status + (f" ({'; '.join(notes)})" if notes else "")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}" if x == x and abs(x) != float("inf") else str(x)


@dataclass
class BisectReport(Report):
    """``bisect``'s findings; ``str(report)`` is a table, ``report.tree()`` an indented tree.

    ``first_divergent`` is None exactly when the report passed; when it failed, a non-empty
    name (a module path, ``MODEL``, ``GRADIENTS`` or ``INCOMPLETE``: see the module docstring),
    so ``if report.first_divergent:`` never reads a failure as agreement.
    """

    rows: list[ModuleRow]
    first_divergent: str | None
    grad_rows: list[GradRow] = field(default_factory=list)
    first_divergent_grad: str | None = None
    allow_nonfinite: bool = False
    allow_skipped: bool = False
    first_nonfinite: str | None = None  # the first call whose inputs were finite and output not (MODEL: the model)
    outputs_differ: list[str] = field(default_factory=list)  # model outputs unequal (not float arrays) or on one side only
    outputs_not_compared: list[str] = field(default_factory=list)  # model output arrays that are not numbers
    outputs_set_aside: list[str] = field(default_factory=list)  # output leaves not compared by type: caches
    # {row path: PositionErrors}: the error per position of every sequence output
    positions: dict = field(default_factory=dict)
    precision: str = "float32"  # the Flax model's compute dtype; "torch" is torch run at it (``precision.py``)
    routing: object = None  # a mixture of experts: ``routing.RoutingReport`` (near ties forced, loads)
    experts: dict = field(default_factory=dict)  # {experts call: (``routing.ExpertRow``, ...)}: each expert alone
    trace: dict | None = None  # bisected against a recorded trace: its path, precision, environment, notes
    weights_differ: list[str] = field(default_factory=list)  # keys whose weights are not the trace's: not bisected

    @property
    def first_divergent_path(self) -> str | None:
        """The row path of ``first_divergent`` ("" for ``MODEL``, the model's own row); None when it
        is None or names no row (``GRADIENTS``, ``INCOMPLETE``)."""
        if self.first_divergent is None:
            return None
        path = _path(self.first_divergent)
        return path if self._row(path) is not None else None

    def onset(self, path: str) -> int | None:
        """The first position where the call at ``path`` (``MODEL``: the model's output) leaves its
        budget; None when it never does or its output is not a sequence (``positions``)."""
        found = self.positions.get(_path(path))
        return None if found is None else found.onset

    @property
    def unverified(self) -> str | None:
        """Why the forward pass was not verified (the whole model's row skipped, or no row
        compared), None when it was: a report that compared nothing must not pass."""
        root = self._row("")
        if root is None:
            return "the whole model's output was not compared (no call of the model itself)"
        if root.status.startswith("skipped"):
            return f"the whole model's output was not compared ({root.status})"
        if all(r.status.startswith(("skipped", "covered")) for r in self.rows):
            return "no module's output was compared"
        return None

    @property
    def incomplete(self) -> list[str]:
        """What could not be compared: module calls (``(model)`` for the model) and ``gradient NAME``s."""
        return ([r.path or "(model)" for r in self.rows if r.status.startswith("skipped")]
                + [f"{name} (not numbers)" for name in self.outputs_not_compared]
                + [f"gradient {g.name}" for g in self.grad_rows if g.status.startswith("skipped")])

    def _failed(self) -> bool:
        return (any(_fails(r.status, self.allow_nonfinite) for r in self.rows)
                or any(_fails(g.status, self.allow_nonfinite) for g in self.grad_rows)
                or self.unverified is not None or (bool(self.incomplete) and not self.allow_skipped)
                or bool(self.outputs_differ) or bool(self._bad_experts()) or bool(self.weights_differ))

    def _bad_experts(self) -> list[str]:
        """The experts calls with an expert beyond its budget when run alone (one no token chose too)."""
        return [label for label, rows in self.experts.items() if not all(r.passed for r in rows)]

    @property
    def passed(self) -> bool:
        return self.first_divergent is None and self.first_divergent_grad is None and not self._failed()

    def settle(self) -> BisectReport:
        """Set ``first_divergent`` from the rows (None when nothing fails); returns the report."""
        self.first_divergent = None
        if not self._failed():
            return self
        if self.weights_differ:  # nothing was bisected
            self.first_divergent = WEIGHTS
            return self
        path = _first_divergent(self.rows)
        if path is None and any(_fails(r.status, self.allow_nonfinite) for r in self.rows):  # NaN/inf, no divergence
            bad = next(r for r in self.rows if _fails(r.status, self.allow_nonfinite))
            path = _path(self.first_nonfinite) if self.first_nonfinite is not None else bad.path
        if path is not None:
            self.first_divergent = MODEL if path == "" else path
        elif self.outputs_differ:  # an output that is not a float array differs: the model's own outputs
            self.first_divergent = MODEL
        elif self._bad_experts():  # an expert no token of these inputs chose, wrong when run alone
            self.first_divergent = self._bad_experts()[0]
        elif any(_fails(g.status, self.allow_nonfinite) for g in self.grad_rows):
            self.first_divergent = GRADIENTS
        else:
            self.first_divergent = INCOMPLETE
        return self

    def _row(self, path: str) -> ModuleRow | None:
        path = _path(path)
        return next((r for r in self.rows if r.path == path), None)

    def _incomplete_line(self) -> str | None:
        missing = self.incomplete
        if not missing:
            return None
        modules = sum(r.status.startswith("skipped") for r in self.rows)
        counts = f"{modules} of {len(self.rows)} module calls"
        if self.outputs_not_compared:
            counts += f", {len(self.outputs_not_compared)} output(s)"
        if self.grad_rows:
            counts += f" and {sum(g.status.startswith('skipped') for g in self.grad_rows)} of {len(self.grad_rows)} gradients"
        names = ", ".join(missing[:20]) + (f", ... ({len(missing) - 20} more)" if len(missing) > 20 else "")
        if self.allow_skipped:
            return f"ALLOWED INCOMPLETE (allow_skipped): {counts} not compared: {names}"
        return (f"INCOMPLETE: {counts} not compared, so the report fails (allow_skipped=True, on the command line "
                f"--allow-skipped, accepts that): {names}")

    def summary(self) -> str:
        if self.weights_differ:
            return "\n".join([_weights_line(self.weights_differ), *_trace_lines(self.trace)])
        lines = [line for line in (self._incomplete_line(),) if line]
        if self.outputs_set_aside:
            lines.append("outputs set aside, not compared: " + "; ".join(self.outputs_set_aside))
        if self.outputs_differ:
            lines.append(f"outputs: FAIL: {len(self.outputs_differ)} of the model's outputs differ (a leaf on one side "
                         "only, or a leaf that is not a float array unequal): " + "; ".join(self.outputs_differ[:10]))
        path = _first_divergent(self.rows)
        bad = [r for r in self.rows if _fails(r.status, self.allow_nonfinite)]
        produced = self._row(self.first_nonfinite) if self.first_nonfinite is not None else None
        at = "" if produced is None else (f"NaN/inf first produced at {self.first_nonfinite} ({produced.kind}, in "
                                          f"{produced.produced}; its inputs finite)")
        if self.unverified is not None and path is None:
            line = f"forward: NOT VERIFIED: {self.unverified}"
        elif path is not None:
            row = self._row(path)
            where = "introduced in" if row.status == "introduced" else "first seen at (built up gradually)"
            line = (f"forward: error {where} {path or MODEL} ({row.kind}): JAX {_fmt(row.jax_err)} "
                    f"vs torch {_fmt(row.torch_err)} against float64" + (f"; {at}" if at else ""))
        elif bad:
            line = f"forward: {bad[0].status}: " + (at or f"first at {bad[0].path or MODEL} ({bad[0].kind})")
        else:
            line = "forward: every module within budget"
            if any(r.status == BOTH_NONFINITE for r in self.rows):
                line += f" (values {BOTH_NONFINITE} allowed: allow_nonfinite" + (f"; {at})" if at else ")")
        lines.append(line)
        where = summary_line(self.positions, None if path is None else _path(path))
        lines += [where] if where else []
        if self.grad_rows:
            if self.first_divergent_grad is None:
                missing = sum(g.status.startswith("skipped") for g in self.grad_rows)
                line = "gradients: every parameter within budget" if not missing else (
                    f"gradients: every compared parameter within budget ({missing} of {len(self.grad_rows)} not "
                    "compared)")
                if any(g.status == BOTH_NONFINITE for g in self.grad_rows):
                    line += f" (values {BOTH_NONFINITE} allowed: allow_nonfinite)"
            else:
                g = next(g for g in self.grad_rows if g.name == self.first_divergent_grad)
                notes = [n for n in (g.status if g.status != "diverged" else "", g.note) if n]
                line = f"gradients: first wrong at {self.first_divergent_grad}" + (
                    f" ({'; '.join(notes)})" if notes else "")
            lines.append(line)
        if self.routing is not None:
            lines += self.routing.lines() + expert_lines(self.experts)
        if self.precision != "float32":
            rule = PRECISIONS[self.precision]
            lines.append(f"precision: {self.precision} (the Flax model's); torch ran in {self.precision} too, budget "
                         f"max({rule.slack:g} x torch's error, {rule.floor_ulps:g} {self.precision} step(s) of the "
                         "output) against float64")
        return "\n".join(lines + _trace_lines(self.trace))

    @property
    def rule(self) -> Precision:
        """The budget rule this report's rows were judged by (``precision.py``)."""
        return PRECISIONS[self.precision]

    def __str__(self) -> str:
        header = ("module", "class", "torch err" if self.precision == "float32" else f"torch {self.rule.short} err",
                  "jax err", "ratio", "rerun alone: torch", "jax", "status")
        body = [(r.path or "(model)", r.kind, _fmt(r.torch_err), _fmt(r.jax_err),
                 "-" if r.ratio is None else f"{r.ratio:.1f}", _fmt(r.local_torch_err), _fmt(r.local_jax_err),
                 _status_text(r)) for r in self.rows]
        parts = [_table(header, body)]
        if self.grad_rows:
            body = [(g.name, _fmt(g.torch_err), _fmt(g.jax_err), f"{g.ratio:.1f}", _status_text(g))
                    for g in self.grad_rows]
            parts.append(_table(("parameter gradient", "torch err", "jax err", "ratio", "status"), body))
        return "\n\n".join(parts + [self.summary()])

    def tree(self) -> str:
        """Modules indented by depth, in call order (each under the parent that contains it)."""
        lines = []
        called = {r.path.split("#")[0] for r in self.rows}
        first = None if self.first_divergent is None else _path(self.first_divergent)
        for r in self.rows:
            path = r.path.split("#")[0]
            depth = sum(1 for p in called if p != path and (not p or path.startswith(p + ".")))
            mark = " <-- first divergent" if r.path == first else ""
            lines.append(f"{'  ' * depth}{r.path or '(model)'} [{r.kind}] "
                         f"jax {_fmt(r.jax_err)} torch {_fmt(r.torch_err)}: {_status_text(r)}{mark}")
        return "\n".join(lines + [self.summary()])

    def to_dict(self) -> dict:
        rows = [asdict(r) | {"ratio": r.ratio, "budget": r.budget, "onset": self.onset(r.path)} for r in self.rows]
        grads = [asdict(g) | {"ratio": g.ratio} for g in self.grad_rows]
        return {"first_divergent": self.first_divergent, "first_divergent_grad": self.first_divergent_grad,
                "first_nonfinite": self.first_nonfinite, "passed": self.passed, "unverified": self.unverified,
                "incomplete": self.incomplete, "outputs_differ": self.outputs_differ,
                "outputs_set_aside": self.outputs_set_aside,
                "allow_skipped": self.allow_skipped,
                "allow_nonfinite": self.allow_nonfinite, "budget_rule": budget_rule(self.rule), "modules": rows,
                "gradients": grads, "routing": None if self.routing is None else self.routing.to_dict(),
                "experts": {k: [asdict(r) | {"passed": r.passed} for r in v] for k, v in self.experts.items()},
                "trace": self.trace, "weights_differ": self.weights_differ,
                "positions": report_dict(
                    self.positions, None if self.first_divergent is None else _path(self.first_divergent))}

    def to_html(self, path=None, *, overwrite: bool = False) -> str:
        """The report as one self-contained HTML page (``bisect_picture``: a row per module call on a
        log scale, the first divergent highlighted); also written to ``path`` when given, as ``to_json``."""
        from flax_transformer.interop import files
        from flax_transformer.verification import bisect_picture

        if path is not None:
            files.check_target(path, kind="file", overwrite=overwrite)  # before the drawing
        page = bisect_picture.to_html(self)
        if path is not None:
            files.write_text(path, page, overwrite=overwrite)
        return page

    def to_png(self, path, *, overwrite: bool = False) -> bytes:
        """The same picture as a PNG (matplotlib, Agg), written to ``path`` as ``to_json`` writes; returns its bytes."""
        from flax_transformer.interop import files
        from flax_transformer.verification import bisect_picture

        files.check_target(path, kind="file", overwrite=overwrite)
        data = bisect_picture.to_png(self)
        files.write_bytes(path, data, overwrite=overwrite)
        return data


def _weights_line(differ: list[str]) -> str:
    names = ", ".join(differ[:5]) + (f", ... ({len(differ) - 5} more)" if len(differ) > 5 else "")
    return (f"weights: FAIL: {len(differ)} differ from the trace's (sha256 of their float32 values): {names}; not "
            "bisected (other weights would make a correct module look wrong)")


def _trace_lines(trace: dict | None) -> list[str]:
    """Where torch's side was recorded (a trace's environment), and what a trace could not do."""
    if trace is None:
        return []
    env = trace["environment"]
    tf32 = "" if "tf32_matmul" not in env else (f", TF32 matmul {'on' if env['tf32_matmul'] else 'off'}, cuDNN "
                                                 f"{'on' if env['tf32_cudnn'] else 'off'}")
    return [f"trace: {trace['path']}: torch {env['torch']} in {trace['precision']} on {env['device_name']} "
            f"({env['device']}{tf32}), python {env['python']}, flax-transformer {env['library']}", *trace["notes"]]


def _table(header, body) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


def first_divergent_grad(report: BisectReport, call_order: list[str]) -> str | None:
    """The parameter ``report.first_divergent_grad`` names (``call_order``: torch's module paths in the
    order their calls returned): when the forward diverged, the first diverged gradient of a
    parameter under the forward's first divergent module (a tied tensor counts under any of its
    keys: a head tied to the embedding is under ``lm_head``); else, or if none is, the first in
    backward order (owning modules in reverse order of their first return)."""
    diverged = [g for g in report.grad_rows if _fails(g.status, report.allow_nonfinite)]
    if not diverged:
        return None
    forward = _first_divergent(report.rows)  # the forward's own first divergence, not a report-level name
    if forward is not None:
        prefix = forward.split("#")[0]
        inside = [g.name for g in diverged
                  if any(not prefix or k.startswith(prefix + ".") for k in g.keys or (g.name,))]
        if inside:
            return inside[0]
    order = {}
    for i, path in enumerate(call_order):
        order.setdefault(path, i)
    return max((g.name for g in diverged), key=lambda n: order.get(n.rpartition(".")[0], -1))


def _first_divergent(rows: list[ModuleRow]) -> str | None:
    introduced = [r.path for r in rows if r.status == "introduced"]
    diverged = [r.path for r in rows if r.status in ("inherited", "diverged")]
    return (introduced or diverged or [None])[0]


# ---------------------------------------------------------------- error against position


@dataclass(frozen=True)
class PositionErrors:
    """One call's error per position against float64, and its budget (``precision.budget``)."""

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
                     f"(JAX {_fmt_error(at.jax[at.onset])} there, budget {_fmt_error(at.budget)}; largest at position {at.peak})")
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


def _fmt_error(x) -> str:
    return f"{x:.2e}" if np.isfinite(x) else str(float(x))
