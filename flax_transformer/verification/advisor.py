"""Which modules must stay in float32 for a bf16 model to meet a target? A precision advisor.

``advise_precision(torch_model, flax_model, args, target=...)`` starts from a Flax model that
computes in bfloat16 (parameters as the user has them) and finds a small set of modules to keep
in float32 compute so that the model's output meets ``target`` against the float64 torch
reference (``Target``):

* ``budget`` (``budget=N``): every output within N bfloat16 steps (default 1) of its largest
  |float64| value, max |JAX - float64| <= N x 2^-7 x max|float64|: the floor of ``bisect``'s bf16
  rule (``precision.BF16``) on the whole-model row. Not the rule itself: that one's other arm,
  4 x torch bf16's own error, passes every correct all-bf16 port, so it would advise nothing;
  the floor asks for the accuracy bf16 can hold, which a model all in bf16 misses.
* ``kl=X``: a language model's mean per-token KL(float64 torch || JAX) <= X (``measure.lm_agreement``);
* ``top1=Y``: its top-1 agreement with float64 torch >= Y (near ties agree, as there).

Method. (1) Every module that has a ``dtype`` and is called is a candidate. Each one's *introduced*
error in bf16: the model is cloned with every candidate in float32 and run once, recording every
module call (``capture``); each candidate is rerun alone on its recorded float32 inputs with only
its own ``dtype`` set to bfloat16, and its error against its float32 output, relative to that
output's scale, is what it introduces (a container's own computation only: a decoder layer's
residual sum, an attention's scores and softmax, a model's embedding lookup). (2) Candidates are
ranked by it, by PATH (each module alone) and by KIND (class and attribute name: every
``input_layernorm``, every ``q_proj``, the ``lm_head``; a group ranks by its largest member).
(3) For each ranking, the prefix of the ranked list that meets the target is searched by
bisection (the whole list first: when it fails, nothing smaller will), then a pruning pass drops,
least ranked first, every group whose removal still meets the target. Every set tried is measured
(the model run with that set in float32, the target's metric against float64), never estimated,
and listed in the report. (4) The smaller of the two results (fewest float32 modules, then the
better metric) is applied to a fresh clone and measured once more: the report's figure. It is set
beside "all bf16" and "every norm and attention (softmax) in float32", the usual rule of thumb.

``apply(flax_model, modules)`` sets ``dtype`` per module, in place: a module's ``dtype`` is the
dtype of its own computation (the library's modules cast what they receive and read ``dtype`` at
call time), so the applied model trains as it is (``nnx.jit``, ``nnx.grad``). Parameters keep
their dtype. torch is imported lazily (this is a verification module).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.verification import capture, frameworks, measure
from flax_transformer.verification import precision as _precision
from flax_transformer.verification.reports import Report

LOW, HIGH = jnp.bfloat16, jnp.float32
TARGETS = ("budget", "kl", "top1")


# ---------------------------------------------------------------- the target


@dataclass(frozen=True)
class Target:
    """What the output must meet: ``kind`` "budget" (``value`` bf16 steps of the output's scale),
    "kl" (mean per-token KL at most ``value``) or "top1" (top-1 agreement at least ``value``)."""

    kind: str
    value: float

    @classmethod
    def parse(cls, text) -> Target:
        """"budget", "budget=N", "kl=X", "top1=Y" (or a ``Target``); a ValueError names what is wrong."""
        if isinstance(text, Target):
            return text
        if not isinstance(text, str):
            raise ValueError(f"target={text!r}: give 'budget', 'budget=N', 'kl=X' or 'top1=Y'")
        kind, _, raw = text.strip().partition("=")
        if kind not in TARGETS or (kind != "budget" and not raw):
            raise ValueError(f"target {text!r}: give 'budget', 'budget=N' (bf16 steps), 'kl=X' (mean KL) or "
                             "'top1=Y' (agreement in [0, 1])")
        try:
            value = float(raw) if raw else 1.0
        except ValueError:
            raise ValueError(f"target {text!r}: {raw!r} is not a number") from None
        if not np.isfinite(value) or value <= 0 or (kind == "top1" and value > 1):
            raise ValueError(f"target {text!r}: {kind} takes a finite number "
                             + ("in (0, 1]" if kind == "top1" else "above 0"))
        return cls(kind, value)

    @property
    def lm(self) -> bool:
        return self.kind != "budget"

    def metric(self, m: Metric) -> float:
        return {"budget": m.steps, "kl": m.kl_mean, "top1": m.top1}[self.kind]

    def met(self, m: Metric) -> bool:
        value = self.metric(m)  # NaN meets nothing
        return bool(m.finite and (value >= self.value if self.kind == "top1" else value <= self.value))

    def badness(self, m: Metric) -> tuple[float, float]:
        """How far from float64 a run is, by this target's metric, then (ties: top-1's) by KL or steps."""
        value = self.metric(m)
        first = -value if self.kind == "top1" else value
        second = m.steps if np.isnan(m.kl_mean) else m.kl_mean
        return (np.inf if np.isnan(first) else first, np.inf if np.isnan(second) else second)

    def describe(self) -> str:
        return {"budget": f"every output within {self.value:g} bf16 step(s) of its largest |float64| value",
                "kl": f"mean per-token KL(float64 torch || JAX) <= {self.value:g}",
                "top1": f"top-1 agreement with float64 torch >= {self.value:g}"}[self.kind]


@dataclass(frozen=True)
class Metric:
    """One run's output against float64: max error, scale, the error in bf16 steps of the scale, and a
    language model's KL (mean, max) and top-1 agreement (NaN when there are no logits)."""

    err: float
    scale: float
    steps: float
    kl_mean: float = float("nan")
    kl_max: float = float("nan")
    top1: float = float("nan")
    finite: bool = True

    def line(self) -> str:
        lm = "" if np.isnan(self.kl_mean) else f", KL mean {self.kl_mean:.2e}, top-1 {self.top1:.4f}"
        return f"max err {self.err:.2e} = {self.steps:.2f} bf16 steps of {self.scale:.3g}{lm}"


@dataclass(frozen=True)
class Trial:
    """One set of float32 modules, measured: how the search got there (``step``), its size and metric."""

    search: str  # "path" | "kind" | "reference"
    step: str
    modules: tuple[str, ...]
    metric: Metric
    met: bool


@dataclass
class Candidate:
    """A module that may stay in float32: its path, class, kind and the error it introduces in bf16."""

    path: str
    cls: str
    kind: str
    introduced: float  # max |bf16 rerun - float32| / max |float32 output| of its own computation
    alone: float = float("nan")  # the target's metric with this module alone in bf16, every other in float32


@dataclass
class AdviceReport(Report):
    """What ``advise_precision`` found (see the module docstring): ``modules`` is the advised set."""

    target: Target
    candidates: list[Candidate]
    trials: list[Trial]
    all_bf16: Trial
    norms_and_softmax: Trial
    advised: Trial  # re-measured on a fresh clone with ``apply``
    search: str  # which ranking gave the set: "path" or "kind"
    notes: list[str] = field(default_factory=list)
    kinds: dict[str, float] = field(default_factory=dict)  # each kind alone in bf16: the target's metric

    @property
    def modules(self) -> tuple[str, ...]:
        return self.advised.modules

    @property
    def passed(self) -> bool:
        return self.advised.met

    def summary(self) -> str:
        a, b, n = self.advised, self.all_bf16, self.norms_and_softmax
        head = (f"precision advice ({self.target.kind}: {self.target.describe()}): "
                + (f"met with {len(a.modules)} float32 module(s), by {self.search}" if a.met else
                   "NOT met even with every candidate in float32"))
        rows = [("all bf16", b), (f"every norm and attention in float32 ({len(n.modules)})", n),
                (f"advised ({len(a.modules)})", a)]
        lines = [head] + [f"  {name:44s} {t.metric.line()}: {'meets' if t.met else 'misses'}" for name, t in rows]
        lines.append("  advised set: " + (", ".join(_label(p) for p in a.modules) or "(none)"))
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])

    def __str__(self) -> str:
        lines = [self.summary(), "", f"each module alone in bf16 (the rest in float32): the {self.target.kind} metric, "
                 "and the error it introduces rerun alone (relative to its output):"]
        for c in self.candidates:
            alone = "-" if np.isnan(c.alone) else f"{c.alone:.4g}"  # not ranked: nothing was searched
            lines.append(f"  {alone:>10s}  {c.introduced:9.2e}  {c.kind:36s} {_label(c.path)}")
        lines += [f"  {value:10.4g}  {'':9s}  {name} (every one)" for name, value in self.kinds.items()]
        lines += ["", f"sets tried ({self.target.kind} metric; every one measured):"]
        for t in self.trials:
            lines.append(f"  {t.search:5s} {t.step:24s} {len(t.modules):3d} modules  "
                         f"{self.target.metric(t.metric):10.4g}  {'meets' if t.met else 'misses'}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        trial = lambda t: asdict(t) | {"modules": list(t.modules), "size": len(t.modules)}  # noqa: E731
        return {"passed": self.passed, "target": asdict(self.target), "target_text": self.target.describe(),
                "search": self.search, "modules": list(self.modules), "advised": trial(self.advised),
                "all_bf16": trial(self.all_bf16), "norms_and_softmax": trial(self.norms_and_softmax),
                "candidates": [asdict(c) for c in self.candidates], "trials": [trial(t) for t in self.trials],
                "kinds": dict(self.kinds),
                "notes": list(self.notes)}


def _label(path: str) -> str:
    return path or "<model>"


# ---------------------------------------------------------------- applying a set


def dtype_modules(flax_model) -> dict[str, nnx.Module]:
    """{path: module} of every module of ``flax_model`` that has a floating ``dtype`` (its compute dtype)."""
    out = {}
    for path, node in nnx.iter_graph(flax_model):
        dtype = getattr(node, "dtype", None) if isinstance(node, nnx.Module) else None
        try:
            floating = dtype is not None and jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
        except TypeError:  # an attribute named dtype that is no dtype
            continue
        if floating:
            out[".".join(map(str, path))] = node
    return out


def apply(flax_model, modules, dtype=HIGH):
    """Set ``dtype`` (the compute dtype, float32 by default) of the modules at ``modules`` (paths as
    ``advise_precision`` gives them, "" the model itself), in place; returns the model. Every path is
    checked first: one that names no module with a ``dtype`` is a ValueError and nothing changes."""
    if isinstance(modules, str):
        raise ValueError(f"modules={modules!r}: give a list of module paths, not one string")
    found = dtype_modules(flax_model)
    paths = list(modules)
    missing = [p for p in paths if p not in found]
    if missing:
        raise ValueError(f"no module with a dtype at {', '.join(map(repr, missing))} in {type(flax_model).__name__}"
                         f" (paths such as {', '.join(repr(p) for p in list(found)[:3])})")
    for path in paths:
        found[path].dtype = dtype
    return flax_model


def norms_and_softmax(flax_model) -> tuple[str, ...]:
    """The rule of thumb's set: every normalisation and every attention (its scores and softmax)."""
    return tuple(p for p, m in dtype_modules(flax_model).items()
                 if re.search(r"Norm$|Attention", type(m).__name__))


def kind(path: str, module) -> str:
    """A module's kind: its class and attribute name (``LlamaRMSNorm:input_layernorm``)."""
    role = next((part for part in reversed(path.split(".")) if part and not part.isdigit()), "<model>")
    return f"{type(module).__name__}:{role}"


# ---------------------------------------------------------------- measuring


class _Bench:
    """The float64 reference's outputs and a clone of the Flax model whose candidates' dtypes are set per trial."""

    def __init__(self, torch_model, flax_model, args, kwargs, target: Target, lm_mask, use_jit: bool):
        import torch

        args, kwargs = measure.fp32_inputs(tuple(args)), measure.fp32_inputs(kwargs)
        t_args, t_kwargs = tuple(map(frameworks.to_torch, args)), {k: frameworks.to_torch(v) for k, v in kwargs.items()}
        self.args = tuple(map(frameworks.to_jax, args))
        self.kwargs = {k: frameworks.to_jax(v) for k, v in kwargs.items()}
        torch_model.eval()
        with torch.no_grad():
            reference = measure.torch_copy(torch_model, torch.float64)
            self.ref = reference(*measure.cast(t_args, torch.float64), **measure.cast(t_kwargs, torch.float64))
        self.logits_path = measure.logits_path(self.ref)
        self.ref_logits = measure.leaf(self.ref, self.logits_path)
        if target.lm:
            measure.check_logits(self.ref_logits, "the torch logits")  # a language model's, or a clear error
        self.mask = None if lm_mask is None else np.asarray(lm_mask)
        self.model = nnx.clone(flax_model)
        self.model.eval()
        self.jitted = nnx.jit(lambda m, a, k: m(*a, **k)) if use_jit else None
        self.low = {p: m.dtype for p, m in dtype_modules(self.model).items()}

    def set(self, high: tuple[str, ...]):
        modules = dtype_modules(self.model)
        for path, dtype in self.low.items():
            modules[path].dtype = HIGH if path in high else dtype

    def run(self, model):
        if self.jitted is not None:
            return self.jitted(model, self.args, self.kwargs)
        return model(*self.args, **self.kwargs)

    def measure(self, model) -> Metric:
        """``model``'s output against the float64 reference: every array leaf, and the logits' KL and top-1."""
        out = self.run(model)
        arrays, _, _ = frameworks.match_outputs(self.ref, out)
        if not arrays:
            raise ValueError("the Flax model's outputs have no array to compare with torch's")
        want = [np.asarray(frameworks.to_numpy(t), np.float64) for _, _, t, _ in arrays]
        got = [np.asarray(frameworks.to_numpy(j), np.float64) for _, _, _, j in arrays]
        finite = all(bool(np.isfinite(g).all()) for g in got)
        err, size = measure.err(got, want), measure.scale(want)
        steps = err / (_precision.BF16.eps * size) if size > 0 else (0.0 if err == 0 else float("inf"))
        if self.ref_logits is None or measure.leaf(out, self.logits_path, self.ref) is None:
            return Metric(err, size, steps, finite=finite)
        try:
            lm = measure.lm_agreement(self.ref_logits, measure.leaf(out, self.logits_path, self.ref), self.mask)
        except ValueError:  # not logits (a regression head): the budget's figures only
            return Metric(err, size, steps, finite=finite)
        return Metric(err, size, steps, lm.kl_mean, lm.kl_max, lm.top1, finite and lm.finite and lm.measured)


def _introduced(bench: _Bench) -> tuple[list[Candidate], list[str]]:
    """Each called candidate's own error in bf16: rerun alone on its float32 inputs (module docstring)."""
    bench.set(tuple(bench.low))  # every candidate in float32: the run whose calls are the reruns' inputs
    _, calls = capture.nnx_calls(bench.model, bench.args, bench.kwargs, use_jit=False)
    first = {}
    for call in calls:
        first.setdefault(call.path, call)
    modules, found, notes = dtype_modules(bench.model), [], []
    for path, module in modules.items():
        call = first.get(path)
        if call is None:
            notes.append(f"{_label(path)} is never called (read by its parent): its dtype is not its own")
            continue
        module.dtype = bench.low[path]
        try:
            out = module(*call.args, **call.kwargs)
        finally:
            module.dtype = HIGH
        want = list(frameworks.float_leaves(call.output).values())
        got = list(frameworks.float_leaves(out).values())
        size = measure.scale(want)
        rel = measure.err(got, want) / size if size > 0 and len(got) == len(want) else 0.0
        found.append(Candidate(path, type(module).__name__, kind(path, module), rel))
    return found, notes


# ---------------------------------------------------------------- the search


def _search(bench: _Bench, target: Target, groups: list[tuple[str, tuple[str, ...]]], name: str,
            trials: list[Trial], cache: dict) -> Trial | None:
    """Bisection over the ranked ``groups``' prefixes, then pruning (module docstring); None: even all fail."""

    def tried(step: str, chosen: list[int]) -> Trial:
        modules = tuple(sorted({p for i in chosen for p in groups[i][1]}))
        if modules not in cache:
            bench.set(modules)
            cache[modules] = bench.measure(bench.model)
        metric = cache[modules]
        trial = Trial(name, step, modules, metric, target.met(metric))
        trials.append(trial)
        return trial

    if not groups or not tried(f"all {len(groups)} groups", list(range(len(groups)))).met:
        return None
    lo, hi = 0, len(groups)  # prefix lo misses (0: all bf16, measured apart), prefix hi meets
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tried(f"first {mid} groups", list(range(mid))).met:
            hi = mid
        else:
            lo = mid
    chosen = list(range(hi))
    for i in reversed(range(hi)):  # least ranked first
        rest = [j for j in chosen if j != i]
        if tried(f"without {groups[i][0]}", rest).met:
            chosen = rest
    return tried("final", chosen)


def _ranked(bench: _Bench, target: Target, candidates: list[Candidate], by: str, cache: dict,
            kinds: dict[str, float]) -> list[tuple[str, tuple[str, ...]]]:
    """(name, paths) of every group, the worst first: ranked by the target's metric with that group alone
    in bf16 and every other candidate in float32 (measured; each candidate's is its ``alone``, each
    kind's goes to ``kinds``), ties by the error introduced."""
    every = tuple(sorted(c.path for c in candidates))
    groups: dict[str, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault(_label(c.path) if by == "path" else c.kind, []).append(c)
    scored = []
    for name, members in groups.items():
        high = tuple(p for p in every if p not in {c.path for c in members})
        if high not in cache:
            bench.set(high)
            cache[high] = bench.measure(bench.model)
        metric = cache[high]
        for c in members if by == "path" else ():
            c.alone = target.metric(metric)
        if by == "kind":
            kinds[name] = target.metric(metric)
        scored.append(((target.badness(metric), max(c.introduced for c in members)), name, members))
    scored.sort(key=lambda item: item[0], reverse=True)
    return [(name, tuple(c.path for c in members)) for _, name, members in scored]


def measure_set(torch_model, flax_model, args: tuple, kwargs: dict | None = None, *, modules=(), target="budget",
                lm_mask=None) -> Metric:
    """The output of ``flax_model`` with ``modules`` in float32 (a clone; the model is not changed) against
    float64 torch, as ``advise_precision`` measures each set: an advised set checked on other inputs."""
    target = Target.parse(target)
    bench = _Bench(torch_model, flax_model, args, kwargs or {}, target, lm_mask, False)
    return bench.measure(apply(bench.model, modules))


def advise_precision(torch_model, flax_model, args: tuple, kwargs: dict | None = None, *, target="budget",
                     lm_mask=None, use_jit: bool = False, by: tuple[str, ...] = ("path", "kind")) -> AdviceReport:
    """Find a small set of modules to keep in float32 so that bf16 ``flax_model`` meets ``target``.

    Args:
        torch_model: the torch twin (float32 or any dtype; a float64 copy is the reference).
        flax_model: a Flax NNX model computing in bfloat16 (its modules' ``dtype``); not changed.
        args, kwargs: the inputs both models are called with (numpy, JAX or torch arrays).
        target: "budget", "budget=N", "kl=X" or "top1=Y", or a ``Target`` (module docstring).
        lm_mask: (b, t), nonzero on the real tokens the KL and top-1 are taken over (None: all).
        use_jit: run each trial under ``nnx.jit`` (a compile per set tried) instead of eagerly.
        by: the rankings searched: "path", "kind", or both.

    Returns:
        an ``AdviceReport``: ``modules`` (the advised paths, for ``apply``), ``passed`` (the advised
        set, applied to a fresh clone and measured, meets the target), every set tried, and the
        all-bf16 and norms-and-softmax-in-float32 sets measured beside it.
    """
    target = Target.parse(target)
    if not by or any(b not in ("path", "kind") for b in by):
        raise ValueError(f"by={by!r}: give 'path', 'kind' or both")
    if _precision.of_model(flax_model) is not _precision.BF16:
        raise ValueError("the Flax model does not compute in bfloat16: build or load it with dtype=jnp.bfloat16 "
                         "(the advisor chooses which modules go back to float32)")
    bench = _Bench(torch_model, flax_model, args, kwargs or {}, target, lm_mask, use_jit)
    candidates, notes = _introduced(bench)
    trials, cache = [], {}

    def reference(step: str, modules: tuple[str, ...]) -> Trial:
        modules = tuple(sorted(modules))
        bench.set(modules)
        cache[modules] = metric = bench.measure(bench.model)
        trial = Trial("ref", step, modules, metric, target.met(metric))
        trials.append(trial)
        return trial

    low = reference("all bf16", ())
    rule = reference("norms and attention", norms_and_softmax(bench.model))
    kinds: dict[str, float] = {}
    found = [] if low.met else [t for b in by if (t := _search(
        bench, target, _ranked(bench, target, candidates, b, cache, kinds), b, trials, cache)) is not None]
    best = min(found, key=lambda t: (len(t.modules), target.metric(t.metric) * (-1 if target.kind == "top1" else 1)),
               default=None)
    chosen = () if best is None else best.modules
    if best is None and not low.met:
        chosen = tuple(sorted(c.path for c in candidates))  # nothing meets it: the most the advisor can give
        notes.append("even every candidate in float32 misses the target: the error is not bf16's (a bug?), "
                     "or the target is beyond float32")
    advised = apply(nnx.clone(flax_model), chosen)  # a fresh clone, set by apply, measured again
    advised.eval()
    metric = bench.measure(advised)
    final = Trial("apply", "advised set, applied", chosen, metric, target.met(metric))
    return AdviceReport(target, candidates, trials, low, rule, final,
                        "none needed" if low.met else (best.search if best else "none"), notes, kinds)
