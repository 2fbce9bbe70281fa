"""The measuring core: what ``compare``, ``bisect``, ``generation_bisect``, the certificates and
``verify``'s LoRA rows share, built in one place.

* the runs: the float64 torch reference and a torch copy at a lower precision (``torch_copy``,
  ``torch_reference``: forward, and backward of the same scalar), their gradients (``torch_grads``),
  and the fp32 Flax twin an export is measured with (``fp32_twin``);
* distances (``err``, ``scale``, ``nonfinite_counts``, ``finite_part_errs``), inputs (``cast``,
  ``fp32_inputs``) and error against position (``position_errors``, ``per_position``);
* one output leaf or gradient checked (``check``): torch fp32 against JAX, both against float64
  torch where it ran, NaN/inf counted apart (they never agree); the leaves of two outputs of any
  structure matched and checked (``outputs``); which leaf is a language model's logits;
* a language model's distributions (``lm_agreement``, ``LMAgreement``): per-token KL(torch || JAX),
  top-1 and top-5 agreement over the real tokens, against the fp32 and bf16 gates (``LM_FP32``,
  ``LM_BF16``), numpy in float64.

The budget rule these are judged by is ``precision``'s. torch is imported at call time only.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.verification import frameworks
from flax_transformer.verification.frameworks import finite_abs_err, flatten, match_outputs, nonfinite, to_numpy
from flax_transformer.verification.precision import FP32, Precision, budget, finite_max

# ---------------------------------------------------------------- distances


def err(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """max |got - want| in float64; equal values (equal infinities too) count as 0, NaN on both
    sides as 0, NaN on one side as infinite. A distance only: whether non-finite values pass is
    decided apart (``nonfinite_counts``), and they never agree."""
    out = 0.0
    for a, b in zip(got, want, strict=True):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        with np.errstate(invalid="ignore"):  # inf - inf
            d = np.atleast_1d(np.abs(a64 - b64))  # 0-d outputs give a numpy scalar, which takes no assignment
        d[np.atleast_1d(a64 == b64)] = 0.0  # inf - inf is NaN: equal infinities agree
        d[np.atleast_1d(np.isnan(a64) & np.isnan(b64))] = 0.0
        out = max(out, float(np.nan_to_num(d, nan=np.inf, posinf=np.inf).max(initial=0.0)))
    return out


def scale(arrays: list[np.ndarray]) -> float:
    """max |finite value|: an infinity in the reference would make the budget infinite."""
    return max(map(finite_max, arrays), default=0.0)


def nonfinite_counts(got_t: list, got_j: list) -> tuple[int, int, int]:
    """(values NaN/inf in JAX only, in torch fp32 only, in both as the same value), over the arrays
    of one output; different non-finite values at one position count on both sides."""
    jax_only = torch_only = both = 0
    for t, j in zip(got_t, got_j, strict=True):
        only_t, only_j, same, differ = nonfinite(t, j)
        jax_only, torch_only, both = jax_only + only_j + differ, torch_only + only_t + differ, both + same
    return jax_only, torch_only, both


def finite_part_errs(got_t: list, got_j: list, want: list) -> tuple[float, float]:
    """(torch err, JAX err) against ``want`` over the positions finite in all three."""
    torch_err = jax_err = 0.0
    for t, j, w in zip(got_t, got_j, want, strict=True):
        t64, j64, w64 = (np.atleast_1d(np.asarray(a, np.float64)) for a in (t, j, w))
        keep = np.isfinite(t64) & np.isfinite(j64) & np.isfinite(w64)
        torch_err = max(torch_err, float(np.abs(t64 - w64)[keep].max(initial=0.0)))
        jax_err = max(jax_err, float(np.abs(j64 - w64)[keep].max(initial=0.0)))
    return torch_err, jax_err


# ---------------------------------------------------------------- inputs


def cast(tree, dtype):
    """Every floating torch tensor in a structure cast to ``dtype`` (ids and masks kept)."""
    if hasattr(tree, "is_floating_point"):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(cast(x, dtype) for x in tree)
    if isinstance(tree, dict):
        return {k: cast(v, dtype) for k, v in tree.items()}
    return tree


def fp32_inputs(tree):
    """Every floating array (numpy, JAX or torch) in a structure as float32, ids and masks kept:
    the float32 runs take float32 inputs whatever the caller gave (float64 numpy, say)."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(fp32_inputs(x) for x in tree)
    if isinstance(tree, dict):
        return {k: fp32_inputs(v) for k, v in tree.items()}
    if frameworks.is_torch(tree):
        import torch

        return cast(tree, torch.float32)
    if isinstance(tree, (np.ndarray, jax.Array)) and jnp.issubdtype(tree.dtype, jnp.floating):
        return tree.astype(np.float32) if isinstance(tree, np.ndarray) else tree.astype(jnp.float32)
    return tree


# ---------------------------------------------------------------- error against position


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
    (``bisect_report``'s docstring says which); None when none is. Equal values (equal infinities) count 0, NaN
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


def position_errors(want: list, got_t: list, got_j: list, length: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(torch fp32's, JAX's) error per position of one call's aligned float leaves; None: not a sequence."""
    jax = per_position(want, got_j, length)
    return None if jax is None else (per_position(want, got_t, length), jax)


# ---------------------------------------------------------------- the runs


def torch_copy(torch_model, dtype):
    """A copy of ``torch_model`` in ``dtype``, eval mode: ``torch.float64`` is the reference every
    float32 (or bfloat16) run is measured against; ``torch.bfloat16`` is torch at a bf16 model's precision."""
    return copy.deepcopy(torch_model).to(dtype).eval()


def torch_grads(model, args, kwargs, weights, loss_fn, dtype):
    """(outputs, {torch key: gradient as numpy}) of ``model`` run on ``args`` cast to ``dtype``: the
    backward of ``frameworks.torch_scalar`` (``weights``, or ``loss_fn``), a parameter it does not
    reach given zeros. The model's gradients are cleared before and after."""
    import torch

    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = model(*cast(args, dtype), **cast(kwargs, dtype))
        frameworks.torch_scalar(out, weights, loss_fn).backward()
    grads = {k: to_numpy(p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


def torch_reference(torch_model, t_args, t_kwargs, weights, loss_fn, rule: Precision | None = None):
    """(outputs, {torch key: gradient} or None, why it did not run or "") of a copy of the torch
    model in float64 (the reference), or at ``rule``'s precision (torch at the Flax model's: its
    error sets the budget): one forward, and with ``weights`` (not None) the backward of the same
    scalar as torch fp32's (``frameworks.torch_scalar``). Whatever the copy raises (a user's model
    in float64 or bf16) is the reason, never an exception: the check is then incomplete."""
    import torch

    dtype = torch.float64 if rule is None else rule.torch_dtype()
    what = "the float64 reference" if rule is None else f"torch in {rule.name}"
    try:
        reference = torch_copy(torch_model, dtype)
        if weights is None:
            with torch.no_grad():
                return reference(*cast(t_args, dtype), **cast(t_kwargs, dtype)), None, ""
        return (*torch_grads(reference, t_args, t_kwargs, weights, loss_fn, dtype), "")
    except Exception as error:  # the user's model in float64 or bf16: whatever it raises, the check is incomplete
        message = (str(error).strip().splitlines() or [""])[0]
        return None, None, f"{what} did not run ({type(error).__name__}: {message})"


def fp32_twin(model, *, build=None, fill=None, compute_dtype=None, values_differ: bool = False):
    """``model`` as a Flax model computing in float32, eval mode, with the same values: what an
    export is measured with, so one tolerance holds whatever the model computes in.

    A float32 model (float32 parameters on one device, ``compute_dtype`` None or float32) is used
    as it is, through an eval-mode view (the caller's model keeps its mode; no copy), unless
    ``values_differ`` (the file holds other values than the model: a bf16 export). Otherwise
    ``build()`` (a float32 model of the same structure) filled by ``fill(twin)`` (porting's state,
    a LoRA run's parameters), so sharded parameters never enter a computation here; without
    ``build``, a clone whose floating parameters are widened to float32 (bf16 widens exactly)."""
    if not values_differ and (compute_dtype is None or jnp.dtype(compute_dtype) == jnp.float32) and all(
            p.dtype == jnp.float32 and p.is_fully_addressable and len(p.sharding.device_set) == 1
            for p in jax.tree.leaves(nnx.state(model, nnx.Param))):
        return nnx.view(model, deterministic=True, use_running_average=True, raise_if_not_found=False)
    if build is None:
        twin = nnx.clone(model)
        for _, variable in nnx.iter_graph(twin):
            if isinstance(variable, nnx.Param) and jnp.issubdtype(variable.dtype, jnp.floating):
                variable.set_value(jnp.asarray(variable[...], jnp.float32))  # bf16 widens exactly
    else:
        twin = build()
        fill(twin)
    twin.eval()  # a copy: the caller's model keeps its mode
    return twin


# ---------------------------------------------------------------- one leaf checked


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
        found = check(t, j, ref.get(path), measured=measured, low=low.get(path) if low_out is not None else None,
                      precision=precision)
        found["output"] = name
        checks.append(found)
        if found["skipped"]:
            skipped.append(f"{name}: {found['skipped']}")
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
        result.update(max_abs_err=finite_abs_err(t64, j64), finite=False, torch_scale=scale([t64]),
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
    size = float(np.abs(r64).max(initial=0.0))
    result.update(torch_err=torch_err, jax_err=jax_err, scale=size, budget=budget(torch_err, size, precision))
    if lost:
        where = "the float64 reference" if low is None else f"the float64 reference or torch in {precision.name}"
        result["skipped"] = f"{lost} values NaN/inf in {where}, finite in both frameworks"
    return result


# ---------------------------------------------------------------- a language model's distributions
# Distribution-level agreement of two language models' logits: per-token KL(torch || JAX), top-1 and
# top-5 agreement, over the real (unpadded) positions, against named gates (``LM_FP32``, ``LM_BF16``).
# A max abs error on the logits says how far two numbers are; a language model is used through its
# next-token distribution, so this says how far the two *distributions* are, in the terms an LM user
# reads (MaxText gates its checkpoint conversions on KL <= 0.015). torch is the reference ``p``, JAX
# ``q``; numpy in float64. ``compare(..., lm=True)``, ``verify --checkpoint`` and the certificates all
# call ``lm_agreement``.

# MaxText's published gate for a converted checkpoint (bf16 against the reference): the
# distribution-level bar people know. Ours is far tighter: an fp32 port differs only by rounding.
MAXTEXT_KL_GATE = 0.015
# Near ties: two logits within this much (in log-probability, i.e. a probability ratio of
# 1.001) are the same choice. Rounding moves logits by ~1e-6 in fp32 and ~1e-2 in bf16, so argmax
# between two candidates this close is a coin toss and says nothing about the port; a
# disagreement counts only where torch's own top choice beats JAX's by more than this.
LM_TIE_MARGIN = 1e-3
LM_TOP_K = 5


@dataclass(frozen=True)
class LMGates:
    """What ``lm_agreement`` holds the figures to. ``kl_max``: the largest per-token KL allowed;
    ``kl_mean``: the mean's; ``top1``, ``top5``: the smallest agreement allowed (ties excepted)."""

    name: str
    kl_mean: float
    kl_max: float
    top1: float
    top5: float
    tie_margin: float = LM_TIE_MARGIN


# fp32, matmul precision "highest": on correct ports KL is 3e-14 to 3e-13 (bench/lm_agreement.py,
# GPT-2, llama and gpt, mean and max; docs/verification.md). KL grows as the square of the logits'
# error, so a model with larger logits (a real GPT-2's reach ~80, rounding 3e-5) stays near 1e-9:
# 1e-8 for the mean and 1e-7 for one token leave that room and are still five orders of magnitude
# below MaxText's 0.015. A planted bug gives far more: a temperature of 1.01 on logits of standard
# deviation 3, KL 1e-4; one position's logits shifted by one vocabulary entry, KL of order 1. Every top-1 choice (near ties excepted) and every top-5 set must agree.
LM_FP32 = LMGates("fp32", kl_mean=1e-8, kl_max=1e-7, top1=1.0, top5=1.0)
# bf16 compute (fp32 parameters) against the fp32 torch model: bf16 keeps 8 bits of mantissa, the
# logits move by ~4e-2 and KL is 2e-5 to 5e-5 on average, 1.5e-4 at worst (bench/lm_agreement.py);
# argmax flips where the top two are within bf16's rounding: top-1 0.95 to 0.99, top-5 sets 0.85 to
# 0.93 measured. The gate is MaxText's mean, one token up to ten times it, 90 % top-1, 70 % top-5.
LM_BF16 = LMGates("bf16", kl_mean=MAXTEXT_KL_GATE, kl_max=0.15, top1=0.9, top5=0.7)


@dataclass(frozen=True)
class LMAgreement:
    """The figures over the real tokens. ``measured`` False (no token, or the shapes did not
    allow it): nothing was measured and ``passed`` is False, never a silent pass. Non-finite
    logits make ``finite`` False, the KL figures NaN or inf, and ``passed`` False."""

    tokens: int  # real positions measured (the mask's ones)
    vocab: int
    kl_mean: float  # per-token KL(p || q) in nats, mean over the real tokens
    kl_max: float
    top1: float  # fraction of tokens whose argmax agrees (near ties count as agreeing)
    top5: float  # fraction whose top-5 sets are equal (up to near ties at the 5th place)
    top1_near_ties: int  # tokens whose argmax differs inside the tie margin (counted as agreeing)
    finite: bool
    gates: LMGates
    measured: bool = True
    reason: str = ""  # why nothing was measured

    @property
    def passed(self) -> bool:
        g = self.gates
        return bool(self.measured and self.finite and self.kl_mean <= g.kl_mean and self.kl_max <= g.kl_max
                    and self.top1 >= g.top1 and self.top5 >= g.top5)

    def problems(self) -> list[str]:
        g = self.gates
        if not self.measured:
            return [f"not measured: {self.reason}"]
        out = [] if self.finite else ["NaN/inf logits"]
        out += [f"{what} {value:.2e} > {gate:g}" for what, value, gate in
                (("KL mean", self.kl_mean, g.kl_mean), ("KL max", self.kl_max, g.kl_max))
                if not value <= gate]  # NaN fails too
        out += [f"{what} {value:.4f} < {gate:g}" for what, value, gate in
                (("top-1", self.top1, g.top1), ("top-5", self.top5, g.top5)) if not value >= gate]
        return out

    def lines(self) -> list[str]:
        """Two lines for a report: the KL figures, and the top-k agreement, with the verdict."""
        if not self.measured:
            return [f"LM agreement: not measured ({self.reason}): FAIL"]
        g = self.gates
        verdict = "pass" if self.passed else "FAIL: " + "; ".join(self.problems())
        ties = f", {self.top1_near_ties} near ties" if self.top1_near_ties else ""
        return [f"LM KL(torch || JAX) per token over {self.tokens} tokens: mean {self.kl_mean:.2e}, "
                f"max {self.kl_max:.2e} (gate {g.kl_max:g}, {g.name}; MaxText's {MAXTEXT_KL_GATE:g})",
                f"LM top-1 agreement {self.top1:.4f}{ties}, top-5 {self.top5:.4f} (gates {g.top1:g}, {g.top5:g}): "
                + verdict]

    def to_dict(self) -> dict:
        out = asdict(self) | {"passed": self.passed}
        out["gates"] = asdict(self.gates)
        return out


def _lm_not_measured(reason: str, vocab: int, gates: LMGates) -> LMAgreement:
    nan = float("nan")
    return LMAgreement(0, vocab, nan, nan, nan, nan, 0, True, gates, measured=False, reason=reason)


def check_logits(logits, what: str = "logits") -> np.ndarray:
    """``logits`` as a floating array [..., vocab] (at least one position, vocab >= 2), else a
    ``ValueError`` that says what it got: the check ``compare(..., lm=True)`` runs first."""
    if logits is None:
        raise ValueError(f"lm=True: {what}: there is no such array among the outputs")
    a = np.asarray(logits)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise ValueError(f"lm=True: {what} must be floating-point logits [..., vocab], not {a.dtype} {list(a.shape)}")
    if a.ndim < 2 or a.shape[-1] < 2:
        raise ValueError(f"lm=True: {what} must be logits [..., vocab] with a batch or position axis and a "
                         f"vocabulary of at least 2, not shape {list(a.shape)}")
    return a


def _log_softmax(x: np.ndarray) -> np.ndarray:
    # max-shifted in float64: exact for finite logits, never overflows; NaN/inf propagate (they must)
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = x - np.max(x, axis=-1, keepdims=True)
        return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def lm_agreement(torch_logits, jax_logits, mask=None, *, gates: LMGates = LM_FP32) -> LMAgreement:
    """Per-token KL(p || q), p = softmax(torch), q = softmax(JAX), and top-1/top-5 agreement over
    the positions where ``mask`` is nonzero (shape ``logits.shape[:-1]``; None: every position).

    KL = sum_v p_v (log p_v - log q_v), from float64 log-softmax; clipped at 0 below (float64
    rounding of two equal distributions can give -1e-17). Top-1 agrees when argmax is equal, or
    when JAX's choice is within ``gates.tie_margin`` of torch's best in torch's own log-probs (a
    near tie: counted in ``top1_near_ties``). Top-5 (k = min(5, vocab)) agrees when every one of
    JAX's top k is in torch's top k or within the tie margin of torch's k-th largest: the sets are
    equal up to which of near-equal candidates fills the last places."""
    p = check_logits(torch_logits, "the torch logits").astype(np.float64)
    q = check_logits(jax_logits, "the JAX logits").astype(np.float64)
    if p.shape != q.shape:
        raise ValueError(f"lm=True: logits shapes differ: torch {list(p.shape)}, JAX {list(q.shape)}")
    vocab = p.shape[-1]
    keep = np.ones(p.shape[:-1], bool) if mask is None else np.asarray(mask)
    if keep.shape != p.shape[:-1]:
        raise ValueError(f"lm=True: the mask's shape {list(keep.shape)} is not the logits' positions "
                         f"{list(p.shape[:-1])}")
    keep = keep.astype(bool)
    if not keep.any():
        return _lm_not_measured("no real token: every position is masked", vocab, gates)
    p, q = p[keep], q[keep]  # (tokens, vocab)
    finite = bool(np.isfinite(p).all() and np.isfinite(q).all())
    logp, logq = _log_softmax(p), _log_softmax(q)
    with np.errstate(invalid="ignore"):
        kl = np.sum(np.exp(logp) * (logp - logq), axis=-1)
    kl = np.where(kl < 0, 0.0, kl)  # NaN stays NaN: np.maximum would too, this says so
    if not finite:  # NaN never agrees, whatever the arithmetic above made of it
        kl = np.full_like(kl, np.nan)
    t1, ties = _top1(logp, logq, gates.tie_margin, finite)
    return LMAgreement(int(keep.sum()), vocab, float(np.mean(kl)), float(np.max(kl)), t1, _topk(logp, logq,
                       min(LM_TOP_K, vocab), gates.tie_margin, finite), ties, finite, gates)


def _top1(logp, logq, margin: float, finite: bool) -> tuple[float, int]:
    if not finite:
        return 0.0, 0
    best_p, best_q = np.argmax(logp, -1), np.argmax(logq, -1)
    rows = np.arange(len(logp))
    differ = best_p != best_q
    tie = differ & (logp[rows, best_p] - logp[rows, best_q] <= margin)
    return float(np.mean(~differ | tie)), int(tie.sum())


def _topk(logp, logq, k: int, margin: float, finite: bool) -> float:
    if not finite:
        return 0.0
    top_q = np.argpartition(-logq, k - 1, axis=-1)[:, :k]  # JAX's top k ids (any order)
    kth_p = -np.partition(-logp, k - 1, axis=-1)[:, k - 1:k]  # torch's k-th largest log-prob
    # a JAX top-k id agrees when torch ranks it in its top k too, up to the margin at the boundary
    ok = np.take_along_axis(logp, top_q, -1) >= kth_p - margin
    return float(np.mean(ok.all(-1)))
