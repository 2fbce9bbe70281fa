"""The report protocol, and what ``compare`` reports.

``Report``: what every verification report has, whatever it measured (``compare``'s
``CompareReport``, ``bisect``'s ``BisectReport``, ``generation_bisect``'s ``GenerationReport``, a
certificate's re-check ``RecheckReport`` and a PEFT adapter's ``AdapterReport``): a verdict
(``passed``, ``verdict()``), a summary in a few lines (``summary()``), the figures as plain data
(``to_dict()``) and as JSON (``to_json()``, infinities and NaN as strings).

``Row``: one line of a comparison and of the ``verify`` command's tables; ``CompareReport``;
``grads_row`` (all of a report's gradients as one Row); ``format_table``. No measuring here
(``compare`` does that), so how a comparison reads or judges changes in one file.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from flax_transformer.verification import measure
from flax_transformer.verification.precision import PRECISIONS, budget_rule


class Report:
    """The report protocol: ``passed``, ``summary()`` and ``to_dict()`` are each report's own;
    ``verdict()`` and ``to_json()`` follow from them unless a report says more."""

    @property
    def passed(self) -> bool:
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError

    def verdict(self) -> str:
        """``pass`` or ``FAIL``."""
        return "pass" if self.passed else "FAIL"

    def __bool__(self):
        raise TypeError(f"a {type(self).__name__} has no truth value: read its verdict as report.passed "
                        "(if report: would read a failed or incomplete comparison as a pass)")

    def __iter__(self):
        raise TypeError(f"a {type(self).__name__} is not a tuple: read report.passed (`err, finite = report` "
                        "was removed: it read an incomplete comparison as 0.0, True); the figures are "
                        "report.max_abs_err, report.finite, report.to_dict()")

    def to_json(self, path=None, *, overwrite: bool = False) -> str:
        """The report as JSON text; also written to ``path`` (through ``files``) when given."""
        text = json_text(self.to_dict())
        if path is not None:
            from flax_transformer.interop import files

            files.check_target(path, kind="file", overwrite=overwrite)
            files.write_text(path, text + "\n", overwrite=overwrite)
        return text


def json_text(data: dict) -> str:
    """JSON of a report's ``to_dict()`` (infinities and NaN as strings: JSON has no such numbers)."""
    return json.dumps(_finite(data), indent=1)


def _finite(x):
    """inf/NaN as strings: JSON has no such numbers."""
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


TOLERANCE = 1e-5  # fp32 with matmul precision "highest": anything larger is a bug


@dataclass(frozen=True)
class Row:
    """One line of a comparison: the outputs (or one parameter's gradient) of a torch model and
    its Flax twin, and, where measured, both against a float64 torch copy of the model.

    It passes when: every value is finite in both frameworks (values NaN or inf in both, as the
    same value, pass only with ``allow_nonfinite``; NaN or inf on one side never), ``max_abs_err
    <= tol``, ``jax_err <= budget`` (the float64 rule, ``precision.budget``: JAX may be ``SLACK``
    times less accurate than torch fp32, or within ``FLOOR_ULPS`` float32 steps of the scale;
    for a bfloat16 model, torch in bfloat16 and bf16's rule, with ``tol`` infinite),
    and everything was compared (``skipped`` empty, or ``allow_skipped``).
    """

    family: str
    module: str
    case: str
    direction: str
    max_abs_err: float
    finite: bool
    tol: float = TOLERANCE
    jax_err: float | None = None  # max |JAX - float64 torch| (None: not measured)
    torch_err: float | None = None  # max |torch fp32 (bf16 for a bf16 model) - float64 torch|
    budget: float | None = None  # the most jax_err may be: precision.budget(torch_err, max |float64|)
    nonfinite_jax: int = 0  # values NaN/inf in JAX where torch has another value
    nonfinite_torch: int = 0  # values NaN/inf in torch where JAX has another value
    nonfinite_both: int = 0  # values NaN/inf in both frameworks, the same value ("not finite in either framework")
    skipped: str = ""  # what could not be compared ("" = everything was)
    allow_nonfinite: bool = False
    allow_skipped: bool = False
    mismatched: str = ""  # what differs outright: a non-array output leaf, a leaf on one side only
    note: str = ""  # e.g. "tied: lm_head.weight = tok_emb.weight" (a gradient summed over its uses)

    @property
    def within_budget(self) -> bool | None:
        """``jax_err <= budget``; None where the float64 reference was not measured."""
        return None if self.budget is None or self.jax_err is None else bool(self.jax_err <= self.budget)

    @property
    def passed(self) -> bool:
        if self.nonfinite_jax or self.nonfinite_torch:
            return False
        if not self.finite and not (self.allow_nonfinite and self.nonfinite_both):
            return False
        if self.skipped and not self.allow_skipped or self.mismatched:
            return False
        return bool(self.max_abs_err <= self.tol) and self.within_budget is not False

    def problems(self) -> list[str]:
        """Why the row fails (or what it was allowed), one phrase each; empty when all is well."""
        out = []
        if self.nonfinite_jax:
            out.append(f"NaN/inf in JAX only ({self.nonfinite_jax} values)")
        if self.nonfinite_torch:
            out.append(f"NaN/inf in torch only ({self.nonfinite_torch} values)")
        if self.nonfinite_both:
            out.append(f"not finite in either framework ({self.nonfinite_both} values"
                       + (", allowed)" if self.allow_nonfinite else ")"))
        elif not self.finite and not (self.nonfinite_jax or self.nonfinite_torch):
            out.append("NaN/inf")
        if not self.max_abs_err <= self.tol:
            out.append(f"max abs err > {self.tol:g}")
        if self.within_budget is False:
            over = self.jax_err / self.budget if self.budget > 0 else float("inf")
            out.append(f"JAX {over:.1f}x its float64 budget")
        if self.skipped:
            out.append(f"not compared: {self.skipped}" + (" (allowed)" if self.allow_skipped else ""))
        if self.mismatched:
            out.append(f"differs: {self.mismatched}")
        return out


def _e(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def format_table(rows: list[Row]) -> str:
    """The rows as a table: the abs error, JAX's error against float64 torch and its budget, the verdict."""
    header = ("family", "module", "case", "direction", "max abs err", "jax vs fp64", "budget", "result")
    body = []
    for r in rows:
        problems = r.problems()
        result = ("pass" if r.passed else "FAIL") + (f": {'; '.join(problems)}" if problems else "")
        result += f" ({r.note})" if r.note else ""
        body.append((r.family, r.module, r.case, r.direction,
                     f"{r.max_abs_err:.2e}" + ("" if r.finite else " (NaN/inf)"), _e(r.jax_err), _e(r.budget), result))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


@dataclass(frozen=True)
class CompareReport(Report):
    """What ``compare`` found: the output row, and with ``grads=True`` one row per parameter.

    ``str(report)`` is the table ``flax-transformer verify`` prints; ``report.to_dict()`` the same
    as plain data. It also unpacks as ``err, finite = report`` (the outputs' max abs error and
    whether all outputs are finite), the form ``compare`` returned before it grew a report.
    """

    rows: tuple[Row, ...]
    max_abs_err: float
    finite: bool
    tol: float = TOLERANCE
    grad_err: float | None = None  # worst parameter-gradient error, relative to max(1, max |g|)
    grad_finite: bool | None = None
    worst_grad_key: str | None = None
    scale: float = 0.0  # max |torch output| (finite values): max_rel_err is max_abs_err / max(1, scale)
    outputs: tuple[dict, ...] = ()  # one per array output leaf (by path): its errors, against float64 too
    others: tuple[dict, ...] = ()  # one per output leaf that is not an array (None, a string): both values, equal
    skipped: tuple[str, ...] = ()  # what could not be compared (an output leaf, the float64 reference)
    allow_nonfinite: bool = False
    allow_skipped: bool = False
    lm: measure.LMAgreement | None = None  # with lm=True: KL(torch || JAX), top-1/top-5 over the real tokens
    precision: str = "float32"  # the Flax model's compute dtype: the float64 budget's rule (``precision.py``)
    routing: object = None  # a mixture of experts: ``routing.RoutingReport`` (near ties, divergent routers)
    set_aside: tuple[str, ...] = ()  # output leaves not compared by their type: caches ("PATH (why)")

    @property
    def passed(self) -> bool:
        return (all(r.passed for r in self.rows) and (not self.skipped or self.allow_skipped)
                and (self.lm is None or self.lm.passed) and (self.routing is None or self.routing.passed))

    @property
    def max_rel_err(self) -> float:
        """The outputs' max abs error relative to their scale, ``max(1, max |torch output|)``."""
        return self.max_abs_err / max(1.0, self.scale)

    @property
    def jax_err(self) -> float | None:
        """The outputs' JAX error against float64 torch (the output nearest its budget); None: not measured."""
        return self.rows[0].jax_err

    @property
    def torch_err(self) -> float | None:
        return self.rows[0].torch_err

    @property
    def budget(self) -> float | None:
        return self.rows[0].budget

    @property
    def incomplete(self) -> bool:
        return bool(self.skipped)


    def __str__(self) -> str:
        return format_table(list(self.rows)) + "\n\n" + self.summary()

    def summary(self) -> str:
        """The verdict in a few lines; the first says so when something was not compared."""
        lines = []
        if self.skipped:
            lines.append(f"{'ALLOWED INCOMPLETE (allow_skipped)' if self.allow_skipped else 'INCOMPLETE'}: "
                         f"{len(self.skipped)} not compared: {'; '.join(self.skipped)}")
        if self.set_aside:
            lines.append("set aside, not compared: " + "; ".join(self.set_aside))
        out = self.rows[0]
        line = (f"outputs: max abs err {out.max_abs_err:.2e}, relative {out.max_abs_err / max(1.0, self.scale):.2e} "
                + (f"(tolerance {self.tol:g})" if self.tol != float("inf") else
                   f"(no abs tolerance: a {self.precision} model is judged by its float64 budget)"))
        if out.jax_err is not None:
            line += f"; against float64 torch: JAX {out.jax_err:.2e}, torch {out.torch_err:.2e}, budget {out.budget:.2e}"
        lines.append(line)
        if self.others:
            lines.append("outputs that are not arrays (must be equal): " + "; ".join(
                f"{o['output']}: {o['torch']}" + ("" if o["equal"] else f" vs flax {o['flax']} DIFFERENT")
                for o in self.others))
        grads = self.rows[1:]
        if grads:
            failed = [r.module for r in grads if not r.passed]
            lines.append(f"gradients: {len(grads) - len(failed)} of {len(grads)} parameters pass (worst relative "
                         f"err {self.grad_err:.2e}, {self.worst_grad_key})"
                         + (f"; failing: {', '.join(failed[:5])}{', ...' if len(failed) > 5 else ''}" if failed else ""))
        if self.lm is not None:
            lines.extend(self.lm.lines())
        problems = [f"{r.module}: {'; '.join(p)}" for r in self.rows if not r.passed and (p := r.problems())]
        if self.lm is not None and not self.lm.passed:
            problems.append("LM agreement: " + "; ".join(self.lm.problems()))
        if self.routing is not None:
            lines.extend(self.routing.lines())
            problems = self.routing.problems() + problems  # a divergent router explains the outputs after it
        if self.precision != "float32":
            rule = PRECISIONS[self.precision]
            lines.append(f"precision: {self.precision} (the Flax model's); torch ran in {self.precision} too for the "
                         f"budget, max({rule.slack:g} x its error, {rule.floor_ulps:g} {self.precision} step(s) of "
                         "the output) against float64")
        lines.append("pass" if self.passed else "FAIL" + (f" ({problems[0]})" if problems else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "tol": self.tol, "max_abs_err": self.max_abs_err, "finite": self.finite,
                "max_rel_err": self.max_rel_err, "scale": self.scale, "jax_err": self.jax_err,
                "torch_err": self.torch_err, "budget": self.budget,
                "budget_rule": budget_rule(PRECISIONS[self.precision]),
                "grad_err": self.grad_err, "grad_finite": self.grad_finite, "worst_grad_key": self.worst_grad_key,
                "skipped": list(self.skipped), "set_aside": list(self.set_aside), "allow_skipped": self.allow_skipped,
                "allow_nonfinite": self.allow_nonfinite, "outputs": list(self.outputs), "others": list(self.others),
                "lm": None if self.lm is None else self.lm.to_dict(),
                "routing": None if self.routing is None else self.routing.to_dict(),
                "rows": [dataclasses.asdict(r) | {"passed": r.passed, "problems": r.problems()} for r in self.rows]}


def grads_row(report: CompareReport, family: str, module: str, case: str, direction: str) -> Row:
    """One Row for all of a report's parameter gradients: the worst relative error, the float64
    figures of the gradient nearest (or furthest beyond) its budget, the non-finite counts summed;
    it passes exactly when every gradient row does."""
    grads = report.rows[1:]
    measured = [r for r in grads if r.budget is not None]
    worst = max(measured, key=lambda r: r.jax_err / r.budget if r.budget > 0 else
                (0.0 if r.jax_err == 0 else float("inf")), default=None)
    skipped = "; ".join(f"{r.module}: {r.skipped}" for r in grads if r.skipped)
    return Row(family, module, case, direction, report.grad_err, report.grad_finite, report.tol,
               jax_err=None if worst is None else worst.jax_err, torch_err=None if worst is None else worst.torch_err,
               budget=None if worst is None else worst.budget,
               nonfinite_jax=sum(r.nonfinite_jax for r in grads), nonfinite_torch=sum(r.nonfinite_torch for r in grads),
               nonfinite_both=sum(r.nonfinite_both for r in grads), skipped=skipped,
               allow_nonfinite=report.allow_nonfinite, allow_skipped=report.allow_skipped)
