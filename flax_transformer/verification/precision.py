"""The budget rule at a precision: how far from float64 a Flax model's values may be and still be
rounding, for a model that computes in float32 and for one that computes in bfloat16.

The rule is one for both: JAX's error against the float64 torch reference may be at most

    max(slack * torch_err, floor_ulps * eps * scale)

where ``torch_err`` is the error of the torch model run *at the Flax model's precision* against
the same reference (what that precision costs in this module, on these inputs), ``scale`` the
largest |float64| value of the output, and ``eps`` the precision's step at 1 (2^-23 for float32,
2^-7 for bfloat16). The floor covers modules torch computes exactly (an embedding lookup, a
ReLU), whose torch error is zero.

* ``FP32``: slack 10, floor 16 float32 steps (2e-6 of the scale). A bug leaves this by orders of
  magnitude; correct ports stay under 0.35 of it (docs/verification.md).
* ``BF16``: the torch run is a copy of the torch model in ``torch.bfloat16`` (weights and
  activations rounded to bf16; torch's CPU kernels accumulate matmuls and norms in float32, as
  XLA's do), slack 4, floor 1 bfloat16 step (0.8% of the scale). The slack is smaller than
  float32's because torch and JAX at bf16 make the same roundings at the same places (a weight, a
  matmul's output, a residual sum): what differs is their order and JAX's float32 softmax and norm
  statistics, which make JAX, if anything, more accurate. The figures behind these constants are in
  docs/verification.md ("bf16 budgets").

``of_model`` reads a Flax model's compute precision from its modules' ``dtype``; ``resolve`` turns
a caller's ``precision=`` argument (None for that, a name, or a ``Precision``) into one. ``budget``,
``grad_budget`` and ``grad_budgets`` apply the rule (one budget for all of a model's gradients);
``Precision.formula`` and ``Precision.rule`` are how reports and certificates write it down, so the
rule is written in this file only.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclass(frozen=True)
class Precision:
    """One precision's budget rule (see the module docstring)."""

    name: str  # "float32" | "bfloat16": the Flax model's compute dtype, and the torch run's
    eps: float  # the dtype's step at 1
    slack: float  # JAX may be this many times less accurate than torch at the same precision ...
    floor_ulps: float  # ... or this many steps of the output's largest magnitude

    def budget(self, torch_err: float, scale: float) -> float:
        """The largest JAX error (against float64) that is still rounding at this precision."""
        return max(self.slack * torch_err, self.floor_ulps * self.eps * scale)

    @property
    def short(self) -> str:
        return {"float32": "fp32", "bfloat16": "bf16"}[self.name]

    def torch_dtype(self):
        import torch

        return getattr(torch, self.name)

    def rule(self) -> dict:
        """The rule's constants, as reports' ``to_dict()`` record them."""
        out = {"precision": self.name, "slack": self.slack, "floor_ulps": self.floor_ulps, "eps": self.eps}
        return out | ({"eps32": self.eps} if self.name == "float32" else {})  # the key reports had before bf16

    def formula(self) -> str:
        """The rule in one line, as a certificate records it: ``jax_err <= max(10 x torch_err, 16 x
        eps32 x max|float64|)`` for float32."""
        eps = "eps32" if self.name == "float32" else f"eps_{self.short}"
        return f"jax_err <= max({self.slack:g} x torch_err, {self.floor_ulps:g} x {eps} x max|float64|)"


FP32 = Precision("float32", float(np.finfo(np.float32).eps), 10.0, 16.0)
BF16 = Precision("bfloat16", 2.0 ** -7, 4.0, 1.0)
PRECISIONS = {p.name: p for p in (FP32, BF16)} | {"fp32": FP32, "bf16": BF16}
SLACK = FP32.slack  # JAX may be this many times less accurate than torch fp32 ...
FLOOR_ULPS = FP32.floor_ulps  # ... or this many float32 steps of the output's largest magnitude
EPS32 = FP32.eps


def of_model(flax_model) -> Precision:
    """The compute precision of a Flax model: ``BF16`` when any of its modules computes in
    bfloat16 (``dtype``), else ``FP32``. A float16 module is refused (no torch CPU run to budget it)."""
    found = set()
    for _, node in nnx.iter_graph(flax_model):
        dtype = getattr(node, "dtype", None) if isinstance(node, nnx.Module) else None
        if dtype is not None:
            try:
                found.add(jnp.dtype(dtype).name)
            except TypeError:  # a module's own attribute named dtype that is no dtype
                continue
    if "float16" in found:
        raise ValueError("the Flax model computes in float16: budgets exist for float32 and bfloat16 only; "
                         "check it in one of those (build it with dtype=jnp.bfloat16 or float32)")
    return BF16 if "bfloat16" in found else FP32


def resolve(precision, flax_model) -> Precision:
    """``precision=`` as given to ``bisect``/``compare``: None reads the Flax model's (``of_model``);
    a name ("float32", "fp32", "bfloat16", "bf16") or a ``Precision`` is taken as it is."""
    if precision is None:
        return of_model(flax_model)
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: give None (the Flax model's), 'float32' or 'bfloat16'")
    return PRECISIONS[precision]


def budget(torch_err: float, scale: float, precision: Precision = FP32) -> float:
    """The largest JAX error (vs fp64) that is still rounding at ``precision`` (float32:
    ``max(SLACK * torch_err, FLOOR_ULPS * EPS32 * scale)``)."""
    return precision.budget(torch_err, scale)


def budget_rule(precision: Precision = FP32) -> dict:
    """The rule's constants, as the reports' ``to_dict()`` record them."""
    return precision.rule()


def finite_max(a) -> float:
    """max |finite value| of an array: an infinity in the reference would make the budget infinite."""
    a = np.atleast_1d(np.abs(np.asarray(a, np.float64)))
    return float(a[np.isfinite(a)].max(initial=0.0))


def grad_budgets(g32: dict[str, np.ndarray], g64: dict[str, np.ndarray],
                 precision: Precision = FP32) -> dict[str, tuple[float, float]]:
    """{parameter: (scale, budget)} of its gradient: one budget for all of a model's gradients,
    ``grad_budget`` of each one's torch fp32 error (finite values) and largest |fp64| value."""
    own = {}
    for name, want in g64.items():
        err = 0.0
        if name in g32:
            t64, w64 = np.atleast_1d(np.asarray(g32[name], np.float64)), np.atleast_1d(np.asarray(want, np.float64))
            keep = np.isfinite(t64) & np.isfinite(w64)
            err = float(np.abs(t64 - w64)[keep].max(initial=0.0))
        own[name] = (err, finite_max(want))
    shared = grad_budget(own, precision)
    return {name: shared for name in own}


def grad_budget(own: dict[str, tuple[float, float]], precision: Precision = FP32) -> tuple[float, float]:
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
    return scale, budget(torch_err, scale, precision)
