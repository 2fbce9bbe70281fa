"""Distribution-level agreement of two language models' logits: per-token KL(torch || JAX), top-1
and top-5 agreement, over the real (unpadded) positions, against named gates.

A max abs error on the logits says how far two numbers are; a language model is used through its
next-token distribution, so this says how far the two *distributions* are, in the terms an LM user
reads (MaxText gates its checkpoint conversions on KL <= 0.015). torch is the reference ``p``, JAX
``q``. Everything here is numpy in float64: it never imports torch or jax, and ``compare(...,
lm=True)``, ``verify --checkpoint`` and the certificates all call ``measure``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

# MaxText's published gate for a converted checkpoint (bf16 against the reference): the
# distribution-level bar people know. Ours is far tighter: an fp32 port differs only by rounding.
MAXTEXT_KL_GATE = 0.015
# Near ties: two logits within this much (in log-probability, i.e. a probability ratio of
# 1.001) are the same choice. Rounding moves logits by ~1e-6 in fp32 and ~1e-2 in bf16, so argmax
# between two candidates this close is a coin toss and says nothing about the port; a
# disagreement counts only where torch's own top choice beats JAX's by more than this.
TIE_MARGIN = 1e-3
TOP_K = 5


@dataclass(frozen=True)
class Gates:
    """What ``measure`` holds the figures to. ``kl_max``: the largest per-token KL allowed;
    ``kl_mean``: the mean's; ``top1``, ``top5``: the smallest agreement allowed (ties excepted)."""

    name: str
    kl_mean: float
    kl_max: float
    top1: float
    top5: float
    tie_margin: float = TIE_MARGIN


# fp32, matmul precision "highest": on correct ports KL is 3e-14 to 3e-13 (bench/lm_agreement.py,
# GPT-2, llama and gpt, mean and max; docs/verification.md). KL grows as the square of the logits'
# error, so a model with larger logits (a real GPT-2's reach ~80, rounding 3e-5) stays near 1e-9:
# 1e-8 for the mean and 1e-7 for one token leave that room and are still five orders of magnitude
# below MaxText's 0.015. A planted bug gives far more: a temperature of 1.01 on logits of standard
# deviation 3, KL 1e-4; one position's logits shifted by one vocabulary entry, KL of order 1. Every top-1 choice (near ties excepted) and every top-5 set must agree.
FP32 = Gates("fp32", kl_mean=1e-8, kl_max=1e-7, top1=1.0, top5=1.0)
# bf16 compute (fp32 parameters) against the fp32 torch model: bf16 keeps 8 bits of mantissa, the
# logits move by ~4e-2 and KL is 2e-5 to 5e-5 on average, 1.5e-4 at worst (bench/lm_agreement.py);
# argmax flips where the top two are within bf16's rounding: top-1 0.95 to 0.99, top-5 sets 0.85 to
# 0.93 measured. The gate is MaxText's mean, one token up to ten times it, 90 % top-1, 70 % top-5.
BF16 = Gates("bf16", kl_mean=MAXTEXT_KL_GATE, kl_max=0.15, top1=0.9, top5=0.7)


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
    gates: Gates
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


def _not_measured(reason: str, vocab: int, gates: Gates) -> LMAgreement:
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


def measure(torch_logits, jax_logits, mask=None, *, gates: Gates = FP32) -> LMAgreement:
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
        return _not_measured("no real token: every position is masked", vocab, gates)
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
                       min(TOP_K, vocab), gates.tie_margin, finite), ties, finite, gates)


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
