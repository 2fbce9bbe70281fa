"""Routers checked: did each token choose the same experts in torch and in JAX, and where not, is it
a near tie that float32 rounding may decide either way, or a divergence?

A mixture of experts sends each token to the top k of its router's scores. Two experts whose scores
differ by less than float32's rounding may be picked differently by two correct implementations: the
token then goes through other experts and its output differs by far more than any tolerance, though
neither side is wrong. A check that fails such a port is useless; one loosened until it passes hides
a real routing bug. The float64 torch reference tells them apart:

* every router call (a ``moe.LlamaTopKRouter``, GPT-OSS's ``GptOssTopKRouter`` or DeepSeek-V3's
  ``DeepseekV3TopkRouter`` in the Flax model, the module of the same path in torch: ``torch_reference``'s
  or transformers' ``*TopKRouter``/``*TopkRouter``, which return ``(logits, weights, experts)``) is
  recorded in torch fp32, torch float64 and JAX;
* a token whose chosen set of experts differs between torch and JAX is a **near tie** when the
  float64 router logits of the swapped experts differ by at most ``margin``, twice the router
  logits' float64 budget (``precision.budget`` of torch's own error: each side may be that far
  from float64, so two experts closer than twice that may be ordered either way); otherwise the
  router **diverges** there, and the report names it;
* DeepSeek-V3's router (``GroupLimited``) chooses in two steps, each of which can tie: the
  ``topk_group`` groups whose two best corrected scores (``sigmoid(logits) + e_score_correction_bias``)
  sum highest, then the top k corrected scores within them. JAX's choice is a near tie when float64
  could have made it: the groups it drew from, filled up with float64's best other groups, fall short
  of float64's ``topk_group``-th group score by at most ``group_margin``, and within those groups its
  experts fall short of the best expert it left out by at most ``margin`` (each twice the float64
  budget of torch's own error on that quantity, the group sums and the corrected scores);
* at near ties, and where a token chose the same experts in another order (two of its chosen experts
  closer than the precision orders them: the block's output is the same, the router's outputs are not,
  position by position), ``compare`` and ``bisect`` run torch (fp32, float64 and at the model's
  precision) again with every router's choice forced to JAX's (``forced``: the weights recomputed from
  torch's own scores as the router computes them: a softmax's, or DeepSeek-V3's sigmoid scores without
  the bias, renormalised where the router does, times ``routed_scaling_factor``), so each token's
  output is compared against the float64 run with the same choice, under the ordinary budget.

``RoutingReport`` also gives each router's expert load of the batch (how many of the tokens' k
choices went to each expert, torch fp32's choice) and the logits' errors against float64.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
from flax import nnx

from flax_transformer.models.moe import DeepseekV3TopkRouter, GptOssTopKRouter, LlamaTopKRouter
from flax_transformer.verification import capture, measure
from flax_transformer.verification import precision as _precision

EXAMPLES = 3  # divergent tokens named per router


def router_paths(flax_model) -> list[str]:
    """The dotted paths of the Flax model's routers (``moe.LlamaTopKRouter``, GPT-OSS's, DeepSeek-V3's), in
    model order."""
    return [".".join(map(str, path)) for path, node in nnx.iter_graph(flax_model)
            if isinstance(node, (LlamaTopKRouter, GptOssTopKRouter, DeepseekV3TopkRouter))]


@dataclass(frozen=True)
class GroupLimited:
    """How a DeepSeek-V3 router chooses, read from its module: its correction bias (E,) and its sizes."""

    bias: np.ndarray
    n_group: int
    topk_group: int

    @classmethod
    def of(cls, module) -> GroupLimited | None:
        """The router's rule (torch_reference's, transformers' ``num_group`` or Flax's), or None: not DeepSeek's."""
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is None:
            return None
        bias = _numpy(bias[...] if isinstance(bias, nnx.Variable) else bias).astype(np.float64)
        n_group = getattr(module, "n_group", None) or module.num_group
        return cls(bias, int(n_group), int(module.topk_group))

    def scores(self, logits: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
        """(corrected scores (T, E), group scores (T, n_group)) computed in ``dtype``, as the router does."""
        logits = logits.astype(dtype)
        corrected = (1 / (1 + np.exp(-logits))).astype(dtype) + self.bias.astype(dtype)
        grouped = np.sort(corrected.reshape(len(corrected), self.n_group, -1), axis=-1)
        return corrected, grouped[..., -2:].sum(-1)

    def shortfall(self, corrected: np.ndarray, groups: np.ndarray, chosen) -> tuple[float, float]:
        """How far one token's ``chosen`` experts fall short of float64's own choice: (group shortfall,
        expert shortfall), 0 where float64 makes the same choice. Its groups, filled up with the best
        others, against the ``topk_group``-th best group score; its weakest expert against the best one
        left out of those groups."""
        size = len(corrected) // self.n_group
        drawn = sorted({int(e) // size for e in chosen})
        if len(drawn) > self.topk_group:
            return float("inf"), float("inf")
        others = [int(g) for g in np.argsort(-groups, kind="stable") if int(g) not in drawn]
        kept = drawn + others[: self.topk_group - len(drawn)]
        group_short = float(np.sort(groups)[-self.topk_group] - groups[kept].min())
        left = [e for g in kept for e in range(g * size, (g + 1) * size) if e not in set(map(int, chosen))]
        expert_short = float(corrected[left].max() - corrected[list(map(int, chosen))].min()) if left else 0.0
        return max(group_short, 0.0), max(expert_short, 0.0)


@dataclass(frozen=True)
class RouterCheck:
    """One router call: how many tokens chose other experts in JAX than in torch, and why."""

    path: str
    tokens: int
    differ: int  # tokens whose chosen set of experts differs
    near_ties: int  # of those, the float64 logits of the swapped experts within ``margin``
    worst_gap: float  # the largest float64 gap between swapped experts of a token that differs (0: none)
    margin: float  # 2 x the float64 budget of the router's logits (DeepSeek-V3: of its corrected scores)
    torch_err: float  # torch fp32's router logits against float64
    jax_err: float  # JAX's router logits against float64
    load: tuple[int, ...]  # per expert, the tokens' choices that went to it (torch fp32)
    examples: tuple[str, ...] = ()  # the first divergent tokens, in words
    group_margin: float = 0.0  # DeepSeek-V3: 2 x the float64 budget of its group scores (0: no groups)

    @property
    def diverged(self) -> bool:
        return self.differ > self.near_ties

    def line(self) -> str:
        head = f"{self.path}: {self.tokens} tokens, load {list(self.load)}"
        if not self.differ:
            return head + ", every choice equal"
        groups = f", groups <= {self.group_margin:.2e}" if self.group_margin else ""
        text = (f"{head}, {self.differ} chose other experts: {self.near_ties} near ties (float64 gap <= "
                f"{self.margin:.2e}{groups})")
        if self.diverged:
            text += (f", {self.differ - self.near_ties} DIVERGE (float64 gap up to {self.worst_gap:.2e}; "
                     + "; ".join(self.examples) + ")")
        return text

    def to_dict(self) -> dict:
        return {"path": self.path, "tokens": self.tokens, "differ": self.differ, "near_ties": self.near_ties,
                "worst_gap": self.worst_gap, "margin": self.margin, "torch_err": self.torch_err,
                "jax_err": self.jax_err, "load": list(self.load), "examples": list(self.examples),
                "diverged": self.diverged, "group_margin": self.group_margin}


@dataclass(frozen=True)
class RoutingReport:
    """Every router of a comparison. ``forced``: torch ran again with JAX's choices at the near ties."""

    routers: tuple[RouterCheck, ...]
    forced: bool = False
    skipped: str = ""  # why the choices could not be judged (no float64 reference)
    reordered: int = 0  # tokens that chose the same experts in another order (torch re-run with JAX's order)

    @property
    def passed(self) -> bool:
        return not self.skipped and not any(r.diverged for r in self.routers)

    @property
    def near_ties(self) -> int:
        return sum(r.near_ties for r in self.routers)

    def lines(self) -> list[str]:
        differ = sum(r.differ for r in self.routers)
        head = (f"routing: {len(self.routers)} router calls, {differ} tokens chose other experts, "
                f"{self.near_ties} near ties" + (f", {self.reordered} the same experts in another order"
                                                 if self.reordered else "")
                + (" (torch re-run with JAX's choices there)" if self.forced else ""))
        if self.skipped:
            head += f"; NOT JUDGED: {self.skipped}"
        return [head] + [f"  {r.line()}" for r in self.routers]

    def problems(self) -> list[str]:
        out = [f"routing not judged: {self.skipped}"] if self.skipped else []
        return out + [f"router {r.path}: {r.differ - r.near_ties} tokens chose other experts beyond the float64 "
                      f"margin" for r in self.routers if r.diverged]

    def to_dict(self) -> dict:
        return {"passed": self.passed, "forced": self.forced, "near_ties": self.near_ties, "skipped": self.skipped,
                "reordered": self.reordered,
                "routers": [r.to_dict() for r in self.routers]}


# ------------------------------------------------------------------ recording


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; bf16 has no numpy dtype: widened exactly
        x = x.detach().cpu()
        return (x.float() if str(x.dtype) in ("torch.bfloat16", "torch.float16") else x).numpy()
    return np.asarray(x)


def torch_routes(model, paths: list[str], args: tuple, kwargs: dict) -> dict[str, tuple]:
    """{path: (router logits (T, E), chosen experts (T, k), ``GroupLimited`` or None)} of one torch forward
    (no gradient); the logits as computed (float32 stays float32)."""
    wanted = set(paths)
    _, calls = capture.torch_calls(model, args, kwargs)
    out = {}
    for label, call in capture.labelled([c for c in calls if c.path in wanted]).items():
        out[label] = (_numpy(call.output[0]), _numpy(call.output[2]), GroupLimited.of(call.module))
    return out


def flax_routes(model, paths: list[str], args: tuple, kwargs: dict, *, use_jit: bool = True) -> dict[str, tuple]:
    """{path: (router logits (T, E), chosen experts (T, k), ``GroupLimited`` or None)} of one JAX forward,
    compiled or eager as the comparison that forces these choices runs it (XLA's fusions round otherwise, and
    may order a near tie the other way)."""
    wanted = set(paths)
    _, calls = capture.nnx_calls(model, args, kwargs, use_jit=use_jit)
    out = {}
    for label, call in capture.labelled([c for c in calls if c.path in wanted]).items():
        logits, _, chosen = call.output.values() if isinstance(call.output, dict) else call.output  # frozen or not
        out[label] = (np.asarray(logits), np.asarray(chosen), GroupLimited.of(call.module))
    return out


# ------------------------------------------------------------------ judging


def judge(t32: dict, t64: dict | None, jax: dict, rule=_precision.FP32, why_not: str = "") -> RoutingReport:
    """The routers' report from the three runs' routes (``torch_routes``, ``flax_routes``); ``t64``
    None (with ``why_not``): choices compared, differences not judged."""
    checks = []
    for label, (logits32, chosen32, *rest) in t32.items():
        if label not in jax:
            continue
        logits_j, chosen_j = jax[label][:2]
        groups = rest[0] if rest else None
        experts = logits32.shape[-1]
        load = tuple(int(n) for n in np.bincount(chosen32.reshape(-1), minlength=experts))
        ref = None if t64 is None else t64.get(label, (None,))[0]
        ref = None if ref is None else np.asarray(ref, np.float64)
        torch_err = 0.0 if ref is None else measure.err([logits32.astype(np.float64)], [ref])
        jax_err = 0.0 if ref is None else measure.err([logits_j.astype(np.float64)], [ref])
        margin = 0.0 if ref is None else 2 * rule.budget(torch_err, float(np.max(np.abs(ref), initial=0.0)))
        group_margin = 0.0
        if groups is not None and ref is not None:  # DeepSeek-V3: the margins of what it chooses by
            (c32, g32), (c64, g64) = groups.scores(logits32, np.float32), groups.scores(ref, np.float64)
            margin = 2 * rule.budget(measure.err([c32.astype(np.float64)], [c64]), float(np.abs(c64).max()))
            group_margin = 2 * rule.budget(measure.err([g32.astype(np.float64)], [g64]), float(np.abs(g64).max()))
        differ, near, worst, examples = 0, 0, 0.0, []
        for token in range(chosen32.shape[0]):
            a, b = set(chosen32[token].tolist()), set(chosen_j[token].tolist())
            if a == b:
                continue
            differ += 1
            if ref is None:
                continue
            if groups is None:
                gap = max(abs(ref[token, i] - ref[token, j]) for i in a - b for j in b - a)
                tie = gap <= margin
            else:
                group_short, expert_short = groups.shortfall(c64[token], g64[token], sorted(b))
                gap, tie = max(group_short, expert_short), group_short <= group_margin and expert_short <= margin
            worst = max(worst, gap)
            if tie:
                near += 1
            elif len(examples) < EXAMPLES:
                examples.append(f"token {token}: torch {sorted(a)}, JAX {sorted(b)}, float64 gap {gap:.2e}")
        checks.append(RouterCheck(label, int(chosen32.shape[0]), differ, near, float(worst), float(margin),
                                  float(torch_err), float(jax_err), load, tuple(examples), float(group_margin)))
    skipped = why_not if t64 is None and any(c.differ for c in checks) else ""
    return RoutingReport(tuple(checks), skipped=skipped)


@contextlib.contextmanager
def forced(torch_model, choices: dict[str, np.ndarray]):
    """Within the block, each torch router of ``choices`` (path -> experts (T, k)) picks those experts.

    Its weights are recomputed from its own logits as the router computes them: softmax in float32
    (float64 in a float64 copy), the chosen probabilities, divided by their sum where the router's own
    weights sum to 1 (a renormalising router), in the dtype of its weights; for DeepSeek-V3's router
    (``e_score_correction_bias``) the sigmoid scores, without the bias, divided by their sum (+ 1e-20)
    where its ``norm_topk_prob`` says, times its ``routed_scaling_factor``. The hooks travel with a
    ``copy.deepcopy`` of the model (the float64 and bf16 copies ``measure`` makes)."""
    import torch

    handles = []
    for name, module in torch_model.named_modules():
        if name not in choices:
            continue

        def hook(module, args, output, chosen=choices[name]):
            logits, weights, experts = output[0], output[1], output[2]
            pick = torch.as_tensor(np.array(chosen), device=experts.device, dtype=experts.dtype)
            wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
            if hasattr(module, "e_score_correction_bias"):  # DeepSeek-V3: the scores alone weigh
                new = wide.sigmoid().gather(-1, pick)
                if module.norm_topk_prob:
                    new = new / (new.sum(-1, keepdim=True) + 1e-20)
                return (logits, (new * module.routed_scaling_factor).to(weights.dtype), pick, *output[3:])
            new = torch.softmax(wide, dim=-1).gather(-1, pick)
            if torch.allclose(weights.float().sum(-1), torch.ones((), device=weights.device), atol=1e-2):
                new = new / new.sum(-1, keepdim=True)
            return (logits, new.to(weights.dtype), pick, *output[3:])

        handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def check(torch_model, flax_model, t_args, t_kwargs, j_args, j_kwargs, *, fp64: bool = True,
          rule=_precision.FP32, use_jit: bool = True) -> tuple[RoutingReport | None, dict[str, np.ndarray]]:
    """(the routing report, JAX's choices to force in torch where the report has near ties and no
    divergence, else {}); (None, {}) for a model without routers."""
    import torch

    paths = router_paths(flax_model)
    if not paths:
        return None, {}
    with torch.no_grad():  # torch at the model's precision: its error against float64 sets the margin
        low = torch_model if rule is _precision.FP32 else measure.torch_copy(torch_model, rule.torch_dtype())
        t32 = torch_routes(low, paths, measure.cast(t_args, rule.torch_dtype()) if low is not torch_model else t_args,
                           measure.cast(t_kwargs, rule.torch_dtype()) if low is not torch_model else t_kwargs)
        t64, why_not = None, "no float64 reference (fp64=False)"
        if fp64:
            try:
                copy = measure.torch_copy(torch_model, torch.float64)
                t64 = torch_routes(copy, paths, measure.cast(t_args, torch.float64),
                                   measure.cast(t_kwargs, torch.float64))
            except Exception as error:  # noqa: BLE001 - a user's model in float64: the choices are not judged
                t64, why_not = None, f"the float64 reference did not run ({type(error).__name__}: {error})"
    jax = flax_routes(flax_model, paths, j_args, j_kwargs, use_jit=use_jit)
    report = judge(t32, t64, jax, rule, why_not)
    # the same experts in another order (two chosen experts' scores closer than the precision orders them):
    # the block's output is the same, its router's outputs are not, position by position
    reordered = sum(a != b and sorted(a) == sorted(b) for label in jax if label in t32
                    for a, b in zip(t32[label][1].tolist(), jax[label][1].tolist()))
    if not (report.near_ties or reordered) or not report.passed:
        return report, {}
    return (RoutingReport(report.routers, forced=True, reordered=reordered),
            {label: jax[label][1] for label in jax})


# ------------------------------------------------------------------ experts one by one


@dataclass(frozen=True)
class ExpertRow:
    """One expert of one experts call, run alone on every token of the call (weight 1)."""

    expert: int
    torch_err: float
    jax_err: float
    budget: float

    @property
    def passed(self) -> bool:
        return self.jax_err <= self.budget


def expert_rows(ref_calls: dict, jax_calls: dict, low_modules: dict, ref_modules: dict,
                rule=_precision.FP32) -> dict[str, tuple[ExpertRow, ...]]:
    """{experts call label: one row per expert}: each expert of each ``LlamaExperts`` call run alone on
    the call's tokens, in float64 torch (``ref_modules``), torch at the model's precision
    (``low_modules``) and JAX, so a wrong expert is named by its index (two experts swapped by a
    converter: both; gate and up swapped in one: that one). ``*_calls`` are ``capture.labelled``."""
    import jax.numpy as jnp
    import torch

    from flax_transformer.models.moe import LlamaExperts

    out = {}
    for label, jx in jax_calls.items():
        ref = ref_calls.get(label)
        if not isinstance(jx.module, LlamaExperts) or ref is None or ref.path not in ref_modules:
            continue
        x64 = ref.args[0].to(torch.float64)
        tokens = x64.shape[0]
        rows = []
        for e in range(jx.module.num_experts):
            chosen = torch.full((tokens, 1), e, dtype=torch.int64)
            with torch.no_grad():
                want = ref_modules[ref.path](x64, chosen, torch.ones((tokens, 1), dtype=torch.float64)).numpy()
                low = low_modules[ref.path](x64.to(rule.torch_dtype()), chosen,
                                            torch.ones((tokens, 1), dtype=rule.torch_dtype())).float().numpy()
            got = np.asarray(jx.module(jnp.asarray(x64.numpy(), jnp.float32), jnp.asarray(chosen.numpy()),
                                       jnp.ones((tokens, 1), jnp.float32)), np.float64)
            torch_err, jax_err = measure.err([low], [want]), measure.err([got], [want])
            rows.append(ExpertRow(e, torch_err, jax_err, rule.budget(torch_err, measure.scale([want]))))
        out[label] = tuple(rows)
    return out


def expert_lines(experts: dict[str, tuple[ExpertRow, ...]]) -> list[str]:
    """One line per experts call: every expert within budget, or which are not."""
    lines = []
    for label, rows in experts.items():
        bad = [r for r in rows if not r.passed]
        lines.append(f"experts {label}: {len(rows)} experts run alone, " + (
            "every one within budget" if not bad else "DIVERGE: " + ", ".join(
                f"expert {r.expert} (JAX {r.jax_err:.2e} vs budget {r.budget:.2e})" for r in bad)))
    return lines
