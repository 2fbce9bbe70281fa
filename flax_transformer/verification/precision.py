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
a caller's ``precision=`` argument (None for that, a name, or a ``Precision``) into one.
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


FP32 = Precision("float32", float(np.finfo(np.float32).eps), 10.0, 16.0)
BF16 = Precision("bfloat16", 2.0 ** -7, 4.0, 1.0)
PRECISIONS = {p.name: p for p in (FP32, BF16)} | {"fp32": FP32, "bf16": BF16}


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
