"""Where do a torch model and its Flax twin part ways? Every submodule, against float64 torch.

``bisect(torch_model, flax_model, args)`` runs three models on the same inputs and records
every submodule call of each (``capture``): the torch model in float32, a float64 copy of it
(the reference: what the float32 math approximates) and the Flax model. For each call, in the
order calls return (a module after its submodules), it measures

* ``torch_err``: max |torch fp32 - fp64| (torch's own rounding: what fp32 costs here),
* ``jax_err``: max |JAX - fp64|,

and judges ``jax_err`` against a budget, ``max(SLACK * torch_err, FLOOR_ULPS * eps32 * scale)``
with ``scale`` = max |fp64 output| and eps32 = 2^-23: JAX may be ``SLACK`` times less accurate
than torch, or within ``FLOOR_ULPS`` float32 steps of the output's largest value (the floor
covers modules torch computes exactly, e.g. an embedding lookup or a ReLU). A call beyond the
budget has diverged.

A diverged call either introduced the error or carried it in with its input. To tell, the
module is rerun alone on the fp64 reference's input to it (cast to float32): in JAX, and in
torch fp32 for that rerun's budget. Beyond budget there: ``introduced``; within: ``inherited``.
``first_divergent`` is the first call, in return order, that introduced an error: the
innermost module where it appears (its parents contain it and return later). When no call
introduced one but some diverged (an error built up gradually), it is the first diverged call.

With ``grads=True`` the same three models also give every parameter's gradient of
``sum_i <output_i, W_i>`` (fixed random W, as ``verify.compare``), each judged by the same
budget, taken over the whole model (``grad_budget``: torch's largest gradient error and the
largest fp64 gradient; a gradient that is a small residue of cancelling terms, such as an
attention key bias's, exactly zero, has rounding that follows the terms, not its own size). ``first_divergent_grad`` names a parameter: when the
forward diverged, the first parameter under ``first_divergent`` whose gradient diverged (a
wrong forward makes every gradient it reaches wrong; the place to fix is where the forward
went wrong); otherwise the first diverged parameter in backward order (owning modules in
reverse call order), which is where a wrong backward pass first shows.

Non-finite values never agree. NaN or inf in JAX where torch fp32 has another value makes the
call diverge (its JAX error is infinite); NaN or inf in torch fp32 only is ``not finite in
torch only``; NaN or inf in both, the same value, is ``not finite in either framework``. All
fail, the last one unless ``allow_nonfinite=True``. ``first_nonfinite`` names the first call
that produced a non-finite value: its inputs finite, its output not (in JAX or in torch).

Incomplete is not passed. A call or gradient that could not be compared (``skipped: ...``, e.g.
a torch module the Flax twin does not call) fails the report unless ``allow_skipped=True``;
``report.incomplete`` lists them and the summary's first line counts them (and says when they
were allowed). A report whose whole-model row was not compared never passes.

``first_divergent`` is None exactly when the report passed, and never empty or falsy when it
failed: a module path; ``MODEL`` ("<model>") when the error is in the whole model's own row;
``GRADIENTS`` ("<gradients>") when the forward pass agrees and a gradient does not (see
``first_divergent_grad``); ``INCOMPLETE`` ("<incomplete>") when nothing disagrees but the
report is incomplete. For non-finite values it is the first producing call (above), or the
first failing row.

torch is imported lazily (this is a verification module).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.verification import capture, frameworks

SLACK = 10.0  # JAX may be this many times less accurate than torch fp32 ...
FLOOR_ULPS = 16.0  # ... or this many float32 steps of the output's largest magnitude
EPS32 = float(np.finfo(np.float32).eps)


MODEL = "<model>"  # first_divergent when the error is in the whole model's own row (its path is "")
GRADIENTS = "<gradients>"  # first_divergent when the forward agrees and a gradient does not
INCOMPLETE = "<incomplete>"  # first_divergent when nothing disagrees but something was not compared
# a torch call with no Flax call that is no gap in the report (``_not_called_status``)
COVERED_FREE = "covered: parameter-free, computed inline in Flax (in its parent's row)"
COVERED_READ = "covered: the Flax twin reads this module without calling it (in its parent's row)"
BOTH_NONFINITE = "not finite in either framework"  # a status: fails unless allow_nonfinite
TORCH_NONFINITE = "not finite in torch only"  # a status: always fails
DIVERGED = ("introduced", "inherited", "diverged")


def budget(torch_err: float, scale: float) -> float:
    """The largest JAX error (vs fp64) that is still float32 rounding, by the rule above."""
    return max(SLACK * torch_err, FLOOR_ULPS * EPS32 * scale)


def budget_rule() -> dict:
    """The rule's constants, as the reports' ``to_dict()`` record them."""
    return {"slack": SLACK, "floor_ulps": FLOOR_ULPS, "eps32": EPS32}


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
    torch_err: float | None = None  # torch fp32 vs fp64
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

    @property
    def ratio(self) -> float | None:
        if self.jax_err is None or self.torch_err is None:
            return None
        return self.jax_err / self.torch_err if self.torch_err > 0 else (0.0 if self.jax_err == 0 else float("inf"))

    @property
    def budget(self) -> float | None:
        return None if self.torch_err is None else budget(self.torch_err, self.scale)


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
    budget: float | None = None  # grad_budgets: over the parameter's module

    @property
    def ratio(self) -> float:
        return self.jax_err / self.torch_err if self.torch_err > 0 else (0.0 if self.jax_err == 0 else float("inf"))


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}" if x == x and abs(x) != float("inf") else str(x)


@dataclass
class BisectReport:
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
                + [f"gradient {g.name}" for g in self.grad_rows if g.status.startswith("skipped")])

    def _failed(self) -> bool:
        return (any(_fails(r.status, self.allow_nonfinite) for r in self.rows)
                or any(_fails(g.status, self.allow_nonfinite) for g in self.grad_rows)
                or self.unverified is not None or (bool(self.incomplete) and not self.allow_skipped))

    @property
    def passed(self) -> bool:
        return self.first_divergent is None and self.first_divergent_grad is None and not self._failed()

    def settle(self) -> BisectReport:
        """Set ``first_divergent`` from the rows (None when nothing fails); returns the report."""
        self.first_divergent = None
        if not self._failed():
            return self
        path = _first_divergent(self.rows)
        if path is None and any(_fails(r.status, self.allow_nonfinite) for r in self.rows):  # NaN/inf, no divergence
            bad = next(r for r in self.rows if _fails(r.status, self.allow_nonfinite))
            path = _path(self.first_nonfinite) if self.first_nonfinite is not None else bad.path
        if path is not None:
            self.first_divergent = MODEL if path == "" else path
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
        if self.grad_rows:
            counts += f" and {sum(g.status.startswith('skipped') for g in self.grad_rows)} of {len(self.grad_rows)} gradients"
        names = ", ".join(missing[:20]) + (f", ... ({len(missing) - 20} more)" if len(missing) > 20 else "")
        if self.allow_skipped:
            return f"ALLOWED INCOMPLETE (allow_skipped): {counts} not compared: {names}"
        return (f"INCOMPLETE: {counts} not compared, so the report fails (allow_skipped=True, on the command line "
                f"--allow-skipped, accepts that): {names}")

    def summary(self) -> str:
        lines = [line for line in (self._incomplete_line(),) if line]
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
        if self.grad_rows:
            if self.first_divergent_grad is None:
                line = "gradients: every parameter within budget"
                if any(g.status == BOTH_NONFINITE for g in self.grad_rows):
                    line += f" (values {BOTH_NONFINITE} allowed: allow_nonfinite)"
            else:
                g = next(g for g in self.grad_rows if g.name == self.first_divergent_grad)
                line = f"gradients: first wrong at {self.first_divergent_grad}" + (
                    f" ({g.status})" if g.status != "diverged" else "")
            lines.append(line)
        return "\n".join(lines)

    def __str__(self) -> str:
        header = ("module", "class", "torch err", "jax err", "ratio", "rerun alone: torch", "jax", "status")
        body = [(r.path or "(model)", r.kind, _fmt(r.torch_err), _fmt(r.jax_err),
                 "-" if r.ratio is None else f"{r.ratio:.1f}", _fmt(r.local_torch_err), _fmt(r.local_jax_err),
                 r.status) for r in self.rows]
        parts = [_table(header, body)]
        if self.grad_rows:
            body = [(g.name, _fmt(g.torch_err), _fmt(g.jax_err), f"{g.ratio:.1f}", g.status) for g in self.grad_rows]
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
                         f"jax {_fmt(r.jax_err)} torch {_fmt(r.torch_err)}: {r.status}{mark}")
        return "\n".join(lines + [self.summary()])

    def to_dict(self) -> dict:
        rows = [asdict(r) | {"ratio": r.ratio, "budget": r.budget} for r in self.rows]
        grads = [asdict(g) | {"ratio": g.ratio} for g in self.grad_rows]
        return {"first_divergent": self.first_divergent, "first_divergent_grad": self.first_divergent_grad,
                "first_nonfinite": self.first_nonfinite, "passed": self.passed, "unverified": self.unverified,
                "incomplete": self.incomplete, "allow_skipped": self.allow_skipped,
                "allow_nonfinite": self.allow_nonfinite, "budget_rule": budget_rule(), "modules": rows,
                "gradients": grads}

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


def _table(header, body) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


# ---------------------------------------------------------------- measuring


def _floats(tree) -> list[np.ndarray]:
    """The floating-point arrays of a (nested) output, as numpy."""
    out = []
    for leaf in frameworks.leaves(list(tree.values()) if isinstance(tree, dict) else tree):
        a = frameworks.to_numpy(leaf)
        if isinstance(a, np.ndarray) and jnp.issubdtype(a.dtype, jnp.floating):  # bfloat16 too (kind "V")
            out.append(a)
    return out


def _err(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """max |got - want| in float64; equal values (equal infinities too) count as 0, NaN on both
    sides as 0, NaN on one side as infinite. A distance only: whether non-finite values pass is
    decided apart (``_nonfinite_counts``), and they never agree."""
    err = 0.0
    for a, b in zip(got, want, strict=True):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        with np.errstate(invalid="ignore"):  # inf - inf
            d = np.atleast_1d(np.abs(a64 - b64))  # 0-d outputs give a numpy scalar, which takes no assignment
        d[np.atleast_1d(a64 == b64)] = 0.0  # inf - inf is NaN: equal infinities agree
        d[np.atleast_1d(np.isnan(a64) & np.isnan(b64))] = 0.0
        err = max(err, float(np.nan_to_num(d, nan=np.inf, posinf=np.inf).max(initial=0.0)))
    return err


def _scale(arrays: list[np.ndarray]) -> float:
    """max |finite value|: an infinity in the reference would make the budget infinite."""
    def finite_max(a):
        a = np.atleast_1d(np.abs(np.asarray(a, np.float64)))
        return float(a[np.isfinite(a)].max(initial=0.0))

    return max(map(finite_max, arrays), default=0.0)


def _cast(tree, dtype):
    """Every floating torch tensor in a structure cast to ``dtype`` (ids and masks kept)."""
    if hasattr(tree, "is_floating_point"):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(_cast(x, dtype) for x in tree)
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    return tree


def fp32_inputs(tree):
    """Every floating array (numpy, JAX or torch) in a structure as float32, ids and masks kept:
    the float32 runs take float32 inputs whatever the caller gave (float64 numpy, say)."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(fp32_inputs(x) for x in tree)
    if isinstance(tree, dict):
        return {k: fp32_inputs(v) for k, v in tree.items()}
    if frameworks._is_torch(tree):
        import torch

        return _cast(tree, torch.float32)
    if isinstance(tree, (np.ndarray, jax.Array)) and jnp.issubdtype(tree.dtype, jnp.floating):
        return tree.astype(np.float32) if isinstance(tree, np.ndarray) else tree.astype(jnp.float32)
    return tree


def _jax_inputs(jax_call: capture.Call, ref_call: capture.Call):
    """The JAX call's own arguments with each float array replaced by the fp64 reference's input
    to the same module (cast to float32): masks and ids keep JAX's own form, which may differ
    from torch's. None when the float inputs do not line up (count or shapes)."""
    leaves, treedef = jax.tree.flatten((jax_call.args, jax_call.kwargs))  # keyword arguments sorted by name
    ref_kwargs = [ref_call.kwargs[k] for k in sorted(ref_call.kwargs)]
    ref = [a for a in frameworks.leaves((*ref_call.args, *ref_kwargs))
           if hasattr(a, "is_floating_point") and a.is_floating_point()]
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype,
                                                                                                  jnp.floating)]
    if len(slots) != len(ref) or any(tuple(leaves[i].shape) != tuple(r.shape) for i, r in zip(slots, ref)):
        return None
    for i, r in zip(slots, ref):
        leaves[i] = jnp.asarray(r.detach().numpy().astype(np.float32)).astype(leaves[i].dtype)
    return treedef.unflatten(leaves)


def _rerun_alone(torch_module, ref_call, jax_call, want):
    """(torch fp32 error, JAX error) of the module rerun alone on the fp64 input; None if it cannot be."""
    import torch

    inputs = _jax_inputs(jax_call, ref_call)
    if inputs is None or jax_call.module is None:
        return None, None
    with torch.no_grad():
        torch_out = torch_module(*_cast(ref_call.args, torch.float32), **_cast(ref_call.kwargs, torch.float32))
    jax_out = jax_call.module(*inputs[0], **inputs[1])
    got_t, got_j = _floats(torch_out), _floats(jax_out)
    if len(got_t) != len(want) or len(got_j) != len(want):
        return None, None
    return _err(got_t, want), _err(got_j, want)


def _nonfinite_counts(got_t: list, got_j: list) -> tuple[int, int, int]:
    """(values NaN/inf in JAX only, in torch fp32 only, in both as the same value), over the arrays
    of one output; different non-finite values at one position count on both sides."""
    jax_only = torch_only = both = 0
    for t, j in zip(got_t, got_j, strict=True):
        only_t, only_j, same, differ = frameworks.nonfinite(t, j)
        jax_only, torch_only, both = jax_only + only_j + differ, torch_only + only_t + differ, both + same
    return jax_only, torch_only, both


def _finite_part_errs(got_t: list, got_j: list, want: list) -> tuple[float, float]:
    """(torch err, JAX err) against ``want`` over the positions finite in all three."""
    torch_err = jax_err = 0.0
    for t, j, w in zip(got_t, got_j, want, strict=True):
        t64, j64, w64 = (np.atleast_1d(np.asarray(a, np.float64)) for a in (t, j, w))
        keep = np.isfinite(t64) & np.isfinite(j64) & np.isfinite(w64)
        torch_err = max(torch_err, float(np.abs(t64 - w64)[keep].max(initial=0.0)))
        jax_err = max(jax_err, float(np.abs(j64 - w64)[keep].max(initial=0.0)))
    return torch_err, jax_err


def _all_finite(tree) -> bool:
    """Every floating value of a call's inputs or output (JAX or torch, nested) finite."""
    return all(bool(np.isfinite(np.asarray(a, np.float64)).all()) for a in _floats(jax.tree.leaves(tree)))


def _produced(call) -> bool:
    """The call's inputs finite, its output not: it made the NaN or inf."""
    return call is not None and not _all_finite(call.output) and _all_finite((call.args, call.kwargs))


def _status(jax_err, torch_err, scale, local) -> str:
    if jax_err <= budget(torch_err, scale):
        return "ok"
    local_torch, local_jax = local
    if local_jax is None:
        return "diverged"
    return "introduced" if local_jax > budget(local_torch, scale) else "inherited"


def _not_called_status(module, name: str, flax_names: tuple[set[str], set[str]] | None) -> str:
    """The status of a torch module call that has no Flax call at its path.

    Covered (not a gap in the report): a parameter-free module (a dropout in eval mode, an
    activation as a module) whose effect the Flax twin computes inline, or a module the Flax
    twin has at the same path, or whose every parameter it holds under the same torch name,
    but reads rather than calls (an embedding table indexed directly; BERT's per-head
    projections, which the Flax attention folds into one matmul). Its effect is in its parent's row, and its parameters' in their gradients.
    Skipped (incomplete): a module with parameters and no Flax module of its name (a layout
    the port renamed, say), which nothing in the report stands for."""
    base = name.split("#")[0]
    if not any(True for _ in module.parameters()):
        return COVERED_FREE
    flax_paths, flax_keys = flax_names or (set(), set())
    if base in flax_paths or all((f"{base}.{key}" if base else key) in flax_keys
                                 for key, _ in module.named_parameters()):
        return COVERED_READ
    return "skipped: no Flax call at this path"


def _flax_names(flax_model) -> tuple[set[str], set[str]]:
    """(the Flax model's module paths, its parameters' torch names): what a torch call with no Flax
    call may be covered by (``_not_called_status``)."""
    from flax_transformer.interop import porting

    paths = {".".join(map(str, path)) for path, node in nnx.iter_graph(flax_model) if isinstance(node, nnx.Module)}
    try:
        keys = set(porting.state_dict(flax_model))
    except (TypeError, ValueError):  # a model the porting cannot name: by path alone
        keys = set()
    return paths, keys


def _module_rows(ref_calls, t32_calls, jax_calls, modules32, rerun: bool,
                 flax_names: tuple[set[str], set[str]] | None = None) -> list[ModuleRow]:
    rows = []
    for name, ref in ref_calls.items():
        kind = type(ref.module).__name__
        t32, jx = t32_calls.get(name), jax_calls.get(name)
        want = _floats(ref.output)
        if jx is None:
            rows.append(ModuleRow(name, kind, status=_not_called_status(ref.module, name, flax_names),
                                  produced="torch" if _produced(t32) else ""))
            continue
        got_t, got_j = _floats(t32.output), _floats(jx.output)
        if len(got_j) != len(want) or any(a.shape != b.shape for a, b in zip(got_j, want)):
            shapes = lambda xs: [tuple(x.shape) for x in xs]  # noqa: E731
            rows.append(ModuleRow(name, kind, status=f"skipped: the Flax output has another structure or shape "
                                                     f"({shapes(got_j)} vs torch {shapes(want)})"))
            continue
        torch_err, jax_err, scale = _err(got_t, want), _err(got_j, want), _scale(want)
        jax_only, torch_only, both = _nonfinite_counts(got_t, got_j)
        if jax_only:  # NaN/inf in JAX where torch has another value: never agreement
            jax_err = float("inf")
        elif both and not torch_only:  # the same NaN/inf in both: judge the finite rest by the budget
            torch_err, jax_err = _finite_part_errs(got_t, got_j, want)
        local = (None, None)
        if rerun and jax_err > budget(torch_err, scale):  # only a diverged call needs the rerun
            local = _rerun_alone(modules32[ref.path], ref, jx, want)
        status = _status(jax_err, torch_err, scale, local)
        if torch_only and not jax_only:
            status = TORCH_NONFINITE
        elif jax_only and status == "ok":  # torch's own error is infinite too: no budget to be within
            status = "diverged"
        elif both and status == "ok":
            status = BOTH_NONFINITE
        produced = ", ".join(side for side, call in (("JAX", jx), ("torch", t32)) if _produced(call))
        rows.append(ModuleRow(name, kind, torch_err, jax_err, scale, *local, status, jax_only, torch_only, both,
                              produced))
    return rows


def _first_divergent(rows: list[ModuleRow]) -> str | None:
    introduced = [r.path for r in rows if r.status == "introduced"]
    diverged = [r.path for r in rows if r.status in ("inherited", "diverged")]
    return (introduced or diverged or [None])[0]


def bisect(torch_model, flax_model, args: tuple, kwargs: dict | None = None, *, grads: bool = False,
           use_jit: bool = True, seed: int = 0, allow_nonfinite: bool = False,
           allow_skipped: bool = False) -> BisectReport:
    """Find the first submodule where the Flax model's output leaves the float64 torch reference.

    Both models run in eval mode on the same inputs (numpy arrays or torch tensors). Rows are
    named by torch module paths, in the order the calls return; a module called k times gets
    ``path``, ``path#1``, ... A torch module the Flax model does not call at that path (e.g. a
    BERT attention head that the Flax attention folds into one matmul) is skipped with a status.
    The budget rule, "introduced" and "inherited" and ``first_divergent`` are in the module
    docstring. torch's calls are recorded by forward hooks; the Flax ones by wrapping each Module
    class's ``__call__`` for the duration of the run (``capture.nnx_calls``; its docstring says
    why not ``nnx.capture``: that sows outputs only, and loses the call order). ``use_jit`` runs
    the Flax model under ``nnx.jit`` (the reruns of single modules run eagerly).

    A skipped call or gradient makes the report incomplete, which fails unless ``allow_skipped``;
    values NaN or inf in both frameworks fail unless ``allow_nonfinite`` (NaN or inf on one side
    always fails). See the module docstring.

    Returns:
        a ``BisectReport``: ``rows``, ``first_divergent`` (None exactly when the report passed),
        ``first_nonfinite``, and with ``grads=True`` ``grad_rows`` and ``first_divergent_grad``.
    """
    import torch

    kwargs = kwargs or {}
    torch_model.eval()
    flax_model.eval()
    reference = copy.deepcopy(torch_model).double()
    args, kwargs = fp32_inputs(tuple(args)), fp32_inputs(kwargs)  # the fp64 reference casts them back up
    t_args, t_kwargs = tuple(map(frameworks.to_torch, args)), {k: frameworks.to_torch(v) for k, v in kwargs.items()}
    j_args, j_kwargs = tuple(map(frameworks.to_jax, args)), {k: frameworks.to_jax(v) for k, v in kwargs.items()}
    with torch.no_grad():
        _, t32 = capture.torch_calls(torch_model, t_args, t_kwargs)
        _, ref = capture.torch_calls(reference, _cast(t_args, torch.float64), _cast(t_kwargs, torch.float64))
    _, jx = capture.nnx_calls(flax_model, j_args, j_kwargs, use_jit=use_jit)
    modules32 = dict(torch_model.named_modules())
    rows = _module_rows(capture.labelled(ref), capture.labelled(t32), capture.labelled(jx), modules32, True,
                        _flax_names(flax_model))
    first_nonfinite = next((MODEL if r.path == "" else r.path for r in rows if r.produced), None)
    report = BisectReport(rows, None, allow_nonfinite=allow_nonfinite, allow_skipped=allow_skipped,
                          first_nonfinite=first_nonfinite)
    if grads:
        report.grad_rows = _grad_rows(torch_model, reference, flax_model, t_args, t_kwargs, seed)
        report.first_divergent_grad = _first_divergent_grad(report, t32)
    return report.settle()


# ---------------------------------------------------------------- gradients


def _torch_grads(model, args, kwargs, weights, dtype) -> dict[str, np.ndarray]:
    import torch

    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        outs = list(frameworks.leaves(model(*_cast(args, dtype), **_cast(kwargs, dtype))))
        sum((o * torch.from_numpy(w).to(dtype)).sum() for o, w in zip(outs, weights)).backward()
    grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().numpy()
             for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _grad_rows(torch_model, reference, flax_model, args, kwargs, seed) -> list[GradRow]:
    import torch
    from flax import nnx

    from flax_transformer.interop import porting

    with torch.no_grad():
        outs = list(frameworks.leaves(torch_model(*args, **kwargs)))
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal(tuple(o.shape)).astype(np.float32) for o in outs]  # verify.compare's W
    g32 = _torch_grads(torch_model, args, kwargs, weights, torch.float32)
    g64 = _torch_grads(reference, args, kwargs, weights, torch.float64)
    j_args = tuple(map(frameworks.to_jax, args))
    j_kwargs = {k: frameworks.to_jax(v) for k, v in kwargs.items()}
    _, grads = frameworks.flax_grads(flax_model, j_args, j_kwargs, [jnp.asarray(w) for w in weights])
    holder = nnx.clone(flax_model)
    nnx.update(holder, grads)  # the gradients in the parameters' places, to read them under torch names
    gj = porting.state_dict(holder)
    budgets = grad_budgets(g32, g64)
    rows = []
    for name, want in g64.items():
        if name not in gj:
            rows.append(GradRow(name, 0.0, float("nan"), 0.0, "skipped: no Flax parameter of this name"))
            continue
        (scale, limit), got_t, got_j = budgets[name], [g32[name]], [np.asarray(gj[name])]
        torch_err, jax_err = _err(got_t, [want]), _err(got_j, [want])
        jax_only, torch_only, both = _nonfinite_counts(got_t, got_j)
        if jax_only:
            jax_err = float("inf")
        elif both and not torch_only:
            torch_err, jax_err = _finite_part_errs(got_t, got_j, [want])
        status = "ok" if jax_err <= limit and not jax_only else "diverged"
        if torch_only and not jax_only:
            status = TORCH_NONFINITE
        elif both and status == "ok":
            status = BOTH_NONFINITE
        rows.append(GradRow(name, torch_err, jax_err, scale, status, jax_only, torch_only, both, limit))
    return rows


def grad_budgets(g32: dict[str, np.ndarray], g64: dict[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    """{parameter: (scale, budget)} of its gradient: one budget for all of a model's gradients,
    ``grad_budget`` of each one's torch fp32 error (finite values) and largest |fp64| value."""
    own = {}
    for name, want in g64.items():
        err = 0.0
        if name in g32:
            t64, w64 = np.atleast_1d(np.asarray(g32[name], np.float64)), np.atleast_1d(np.asarray(want, np.float64))
            keep = np.isfinite(t64) & np.isfinite(w64)
            err = float(np.abs(t64 - w64)[keep].max(initial=0.0))
        own[name] = (err, _scale([want]))
    shared = grad_budget(own)
    return {name: shared for name in own}


def grad_budget(own: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """(scale, budget) for every gradient of one model, from each parameter's own (torch fp32
    error, largest |fp64 gradient|): ``budget(torch_err, scale)`` with both the largest over the
    model. JAX's gradients must be as accurate as torch's, within ``SLACK``, taken over the model.

    Not parameter by parameter: a gradient can be a small residue of large cancelling terms, and
    its rounding then follows the terms, which torch and XLA sum differently. An attention key
    bias's gradient is exactly zero, all noise (on all-MiniLM-L6-v2 JAX's error was 17 times
    torch's); the query and key weights behind a saturated softmax are small residues (the
    classic Transformer's first attention layers, whose inputs are embeddings times
    sqrt(d_model): on correct ports JAX's error reached 36 times torch's there, and 0.6 of a
    budget taken over each module). Over the model, correct ports of every family use at most
    0.35 of it; a wrong backward (a doubled gradient) is orders of magnitude beyond."""
    torch_err = max((err for err, _ in own.values()), default=0.0)
    scale = max((s for _, s in own.values()), default=0.0)
    return scale, budget(torch_err, scale)


def _first_divergent_grad(report: BisectReport, t32_calls) -> str | None:
    diverged = [g.name for g in report.grad_rows if _fails(g.status, report.allow_nonfinite)]
    if not diverged:
        return None
    forward = _first_divergent(report.rows)  # the forward's own first divergence, not a report-level name
    if forward is not None:
        prefix = forward.split("#")[0]
        inside = [n for n in diverged if not prefix or n.startswith(prefix + ".")]
        if inside:
            return inside[0]
    # backward order: owning modules in reverse order of their first return
    order = {}
    for i, call in enumerate(t32_calls):
        order.setdefault(call.path, i)
    return max(diverged, key=lambda n: order.get(n.rpartition(".")[0], -1))
