"""At which step of greedy decoding does a Flax decoder leave its torch twin, and why?

``bisect_generation(torch_model, flax_model, prompt_ids, max_new_tokens)`` decodes greedily in
three ways and compares them step by step (step 0 is the first new token):

* torch float64 (a copy of ``torch_model``): the reference, and the token sequence. Its greedy
  tokens are fed to all three runs (teacher forcing), so every run sees the same prefix at every
  step: a token picked differently by float32 noise would otherwise make later steps compare
  two different texts;
* torch float32: what float32 costs here (``torch_err`` of each step);
* JAX with its key/value cache: ``init_cache``, one prefill of the prompt, then one token per
  ``decode_step``, jitted (two programs: the prefill's shape and the one-token step's; the
  position is a traced scalar, so no step retraces). This is the path ``generate`` runs, where
  bugs that a full forward pass never shows live (a cache write, a cached position offset).

Each step's logits are judged like a ``bisect`` row: JAX's max |error| against fp64 within
``precision.budget(torch_err, scale)``, scale = max |fp64 logit| of the step. A step also
diverges when JAX's greedy token differs from fp64's where fp64's top-2 margin exceeds
``NEAR_TIE`` budgets: two logits each within a budget of fp64 can swap order only if they were
within two budgets of each other, so a swap with a wider margin is a bug, and one with a
narrower margin is float32 noise (reported as ``near tie``, not failed). NaN or inf in any
run's logits fails the step: NaN never agrees.

At the first divergent step (or, when none diverges, the last step, so that a passing report
has also checked the cache):

* ``module``: ``bisect.bisect`` on the whole prefix that step reads (prompt and tokens so far),
  its ``first_divergent``. None means the full forward pass agrees on that prefix: the bug is in
  the cached decode path (then ``cache_layer`` says where);
* ``cache_layer``: the first layer whose cached keys or values (JAX's cache over the prefix's
  positions) leave the budget of torch's own, recomputed from each attention layer's input in
  fp32 and fp64 (``torch_reference``'s attention classes) or read from ``past_key_values``
  (a transformers model). Keys are compared as cached: after RoPE for the llama family.

``passed``: no divergent step, no cache layer over budget, the cache compared. torch is imported
lazily (a verification module).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.models.input_specs import input_spec
from flax_transformer.verification.bisect import bisect
from flax_transformer.verification.measure import err, torch_copy
from flax_transformer.verification.precision import budget, budget_rule, finite_max
from flax_transformer.verification.reports import Report

NEAR_TIE = 2.0  # a greedy token may differ where fp64's top-2 margin is at most this many budgets
# torch_reference's attention classes, and how each one computes the keys and values it would cache
_ATTENTION_KINDS = ("GPTMHAttention", "GPT2Attention", "LlamaAttention")


@dataclass(frozen=True)
class StepRow:
    """One decoding step: the logits of new token ``step`` (position ``position`` of the sequence)."""

    step: int
    position: int  # the query position whose logits pick this token (prompt length - 1 + step)
    token: list  # fp64's greedy token, per row (fed to every run at the next step)
    jax_token: list
    torch_err: float  # torch fp32 vs fp64
    jax_err: float  # JAX (cached decode) vs fp64
    scale: float  # max |fp64 logit|
    budget: float
    margin: float  # fp64's smallest top-2 margin over the rows
    status: str  # "agrees", "near tie", "over budget", "token differs", "not finite"

    @property
    def failed(self) -> bool:
        return self.status in ("over budget", "token differs", "not finite")


@dataclass(frozen=True)
class CacheRow:
    """One layer's cached keys and values over the prefix, against fp64 torch's."""

    layer: int
    torch_err: float
    jax_err: float
    scale: float
    budget: float

    @property
    def failed(self) -> bool:
        return not self.jax_err <= self.budget  # NaN never agrees


@dataclass
class GenerationReport(Report):
    """``bisect_generation``'s findings; ``str(report)`` is one line per step and the verdict."""

    steps: list[StepRow]
    first_divergent_step: int | None
    module: str | None = None  # bisect's first_divergent on the prefix of the step examined
    module_note: str = ""  # why bisect could not run there (a transformers model's internals, say)
    cache_step: int | None = None  # the step whose cache was compared
    cache_rows: list[CacheRow] = field(default_factory=list)
    cache_note: str = ""  # why the cache was not compared, if it was not
    prompt_length: int = 0
    traces: int = 0  # how often JAX traced the decode step: 2 (prefill and one-token step)

    @property
    def cache_layer(self) -> int | None:
        """The first layer whose cached keys or values leave the budget (None: all agree)."""
        return next((r.layer for r in self.cache_rows if r.failed), None)

    @property
    def passed(self) -> bool:
        return self.first_divergent_step is None and self.cache_layer is None and not self.cache_note

    def verdict(self) -> str:
        if self.passed:
            return (f"pass: all {len(self.steps)} steps within budget, every layer's cache within budget "
                    f"(at step {self.cache_step})")
        if self.first_divergent_step is None:
            why = (f"layer {self.cache_layer}'s cached keys/values leave the budget at step {self.cache_step}"
                   if self.cache_layer is not None else f"the cache was not compared ({self.cache_note})")
            return f"FAIL: every step's logits agree, but {why}"
        row = self.steps[self.first_divergent_step]
        where = (f"the full forward pass first diverges in {self.module}" if self.module else
                 f"no module named ({self.module_note})" if self.module_note else
                 "the full forward pass agrees on this prefix: the bug is in the cached decode path")
        cache = (f"first cache layer over budget: {self.cache_layer}" if self.cache_layer is not None else
                 "the cache agrees" if not self.cache_note else f"cache not compared ({self.cache_note})")
        return (f"FAIL: first divergent step {self.first_divergent_step} (position {row.position}: {row.status}); "
                f"{where}; {cache}")

    def __str__(self) -> str:
        lines = [f"{'step':>4} {'pos':>4} {'token':>7} {'jax':>7} {'torch_err':>10} {'jax_err':>10} "
                 f"{'budget':>10} {'margin':>9}  status"]
        for r in self.steps:
            lines.append(f"{r.step:>4} {r.position:>4} {r.token[0]:>7} {r.jax_token[0]:>7} {r.torch_err:>10.3g} "
                         f"{r.jax_err:>10.3g} {r.budget:>10.3g} {r.margin:>9.3g}  {r.status}")
        for c in self.cache_rows:
            lines.append(f"cache layer {c.layer} (step {self.cache_step}): torch_err {c.torch_err:.3g}, jax_err "
                         f"{c.jax_err:.3g}, budget {c.budget:.3g}{'  OVER BUDGET' if c.failed else ''}")
        return "\n".join([*lines, self.verdict()])

    def to_dict(self) -> dict:
        def clean(x):  # JSON has no inf or NaN
            return x if not isinstance(x, float) or np.isfinite(x) else str(x)

        return {"passed": self.passed, "first_divergent_step": self.first_divergent_step, "module": self.module,
                "module_note": self.module_note,
                "cache_layer": self.cache_layer, "cache_step": self.cache_step, "cache_note": self.cache_note,
                "prompt_length": self.prompt_length, "near_tie_budgets": NEAR_TIE, "rule": budget_rule(),
                "steps": [{k: clean(v) for k, v in asdict(r).items()} for r in self.steps],
                "cache": [{k: clean(v) for k, v in asdict(c).items()} for c in self.cache_rows],
                "verdict": self.verdict()}

    def summary(self) -> str:
        return self.verdict()


# ---------------------------------------------------------------- checks


def check_inputs(flax_model, prompt_ids, max_new_tokens) -> np.ndarray:
    """The prompt as (b, t) int64, or ValueError before anything runs."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    try:
        spec = input_spec(flax_model)
    except TypeError as error:  # not a whole model
        raise ValueError(str(error)) from None
    if not spec.generates or spec.encoder_decoder or not all(
            hasattr(flax_model, name) for name in ("init_cache", "decode_step")):
        raise ValueError(f"{type(flax_model).__name__} has no key/value cache to decode with (init_cache and "
                         "decode_step): bisect_generation checks decoders (gpt, GPT-2, the llama family)")
    ids = np.asarray(prompt_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt_ids must be integer ids of shape (t,) or (batch, t), t >= 1; got {ids.dtype} "
                         f"{ids.shape}")
    if ids.min() < 0 or ids.max() >= spec.vocab_size:
        raise ValueError(f"prompt id {int(ids.max() if ids.max() >= spec.vocab_size else ids.min())} is outside the "
                         f"model's vocabulary of {spec.vocab_size}")
    if ids.shape[1] + max_new_tokens > spec.max_length:
        raise ValueError(f"the prompt's {ids.shape[1]} tokens and {max_new_tokens} new ones exceed the model's "
                         f"{spec.max_length} positions")
    return ids.astype(np.int64)


# ---------------------------------------------------------------- the three runs


def _logits(model, ids):
    """(b, t, V) float64 numpy logits of a torch model: a tensor, a tuple's first, or ``.logits``."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(ids))
    out = getattr(out, "logits", out)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.double().numpy()


def _jax_decode(flax_model, seq: np.ndarray, prompt_length: int, new: int, judge):
    """JAX's cached decode of ``seq``, each step's logits handed to ``judge(step, (b, V) logits) -> failed``
    as they come. Every step runs (the report shows what follows a divergence); the cache kept is the first
    failed step's, else the last's. Returns (that step, its cache, trace count)."""
    graphdef, state = nnx.split(flax_model)
    traces = [0]

    @jax.jit
    def step(state, tokens, index, cache):
        traces[0] += 1  # runs only while tracing
        logits, cache = nnx.merge(graphdef, state).decode_step(tokens, index, cache)
        return logits[:, -1], cache

    cache = flax_model.init_cache(seq.shape[0], seq.shape[1])
    ids, kept = seq.astype(np.int32), None  # numpy slices: no small program per step
    for s in range(new):  # step 0: the prompt's prefill; step s: the token of step s - 1, at position p + s - 1
        at = 0 if s == 0 else prompt_length + s - 1
        tokens = ids[:, :prompt_length] if s == 0 else ids[:, at:at + 1]
        logits, cache = step(state, tokens, jnp.int32(at), cache)
        if judge(s, np.asarray(logits, np.float64)) and kept is None:
            kept = s, cache
    return (*(kept or (new - 1, cache)), traces[0])


def _step_row(step, position, l64, l32, lj) -> StepRow:
    torch_err, jax_err, scale = err([l32], [l64]), err([lj], [l64]), finite_max(l64)
    allowed = budget(torch_err, scale)
    top2 = np.sort(l64, axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min()) if l64.shape[-1] > 1 else float("inf")
    token, jax_token = np.argmax(l64, -1), np.argmax(lj, -1)
    if not (np.isfinite(l64).all() and np.isfinite(l32).all() and np.isfinite(lj).all()):
        status = "not finite"
    elif not jax_err <= allowed:
        status = "over budget"
    elif (token != jax_token).any():
        gaps = top2[:, 1] - top2[:, 0]
        status = "token differs" if (gaps[token != jax_token] > NEAR_TIE * allowed).any() else "near tie"
    else:
        status = "agrees"
    return StepRow(step, position, token.tolist(), jax_token.tolist(), torch_err, jax_err, scale, allowed, margin,
                   status)


# ---------------------------------------------------------------- the cache


def _hf_kv(model, ids) -> list:
    """A transformers model's ``past_key_values`` as [(keys, values)] (b, h_kv, t, d) per layer."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(ids), use_cache=True)
    pkv = getattr(out, "cache", None) or out.past_key_values  # transformers 5 renames it ``cache``
    if hasattr(pkv, "layers"):  # transformers >= 4.56: a Cache of CacheLayers
        return [(layer.keys, layer.values) for layer in pkv.layers]
    if hasattr(pkv, "key_cache"):
        return list(zip(pkv.key_cache, pkv.value_cache))
    return [(k, v) for k, v, *_ in pkv]


def _module_kv(attn, x):
    """The keys and values (b, h_kv, t, d) a torch_reference attention module would cache for input x
    (b, t, hidden), computed as its ``forward`` does (keys after RoPE for the llama family)."""
    import torch

    b, t, e = x.shape
    kind = type(attn).__name__
    if kind == "GPT2Attention":
        _, k, v = attn.c_attn(x).split(e, dim=2)
        heads = attn.n_head
    elif kind == "GPTMHAttention":
        k, v, heads = attn.k_proj(x), attn.v_proj(x), attn.n_heads
    else:  # LlamaAttention: (optional q/k norm), RoPE at positions 0..t-1; values as projected
        k = attn.k_proj(x).view(b, t, -1, attn.head_dim)
        if attn.qk_norm:
            k = attn.k_norm(k)
        k = k.transpose(1, 2)  # (b, h_kv, t, d)
        cos, sin = attn.rotary_emb(x, torch.arange(t, device=x.device)[None])
        _, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(k, k, cos, sin)
        return k, attn.v_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
    return tuple(y.reshape(b, t, heads, e // heads).transpose(1, 2) for y in (k, v))  # (b, h, t, d)


def _torch_kv(model, ids) -> list | None:
    """Per layer (keys, values) numpy float64 of what torch would cache for ``ids``; None if unknown."""
    import torch

    if type(model).__module__.startswith("transformers."):  # its own cache (its classes share our names)
        pairs = _hf_kv(model, ids)
    else:
        layers = [m for m in model.modules() if type(m).__name__ in _ATTENTION_KINDS]
        if not layers:
            return None
        inputs, hooks = {}, []
        for i, m in enumerate(layers):  # each attention's input, as the whole model computes it
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs, i=i: inputs.__setitem__(i, args[0] if args else kwargs["x"]),
                with_kwargs=True))
        try:
            _logits(model, ids)
        finally:
            for h in hooks:
                h.remove()
        with torch.no_grad():
            pairs = [_module_kv(m, inputs[i]) for i, m in enumerate(layers)]
    return [(k.double().numpy(), v.double().numpy()) for k, v in pairs]


def _cache_rows(torch_model, reference, cache, prefix) -> tuple[list[CacheRow], str]:
    """JAX's cache over the prefix's positions against fp64 torch's keys/values, layer by layer."""
    want, got32 = _torch_kv(reference, prefix), _torch_kv(torch_model, prefix)
    if want is None:
        return [], f"no known way to read {type(torch_model).__name__}'s keys and values"
    if len(want) != len(cache):
        return [], f"torch has {len(want)} attention layers, the Flax cache {len(cache)}"
    t, rows = prefix.shape[1], []
    for layer, ((k64, v64), (k32, v32), (kj, vj)) in enumerate(zip(want, got32, cache)):
        # the positions written so far; a ring (models.ring_cache) holds the last R of them, q at slot q % R
        slots = np.shape(kj)[2]
        held = np.arange(max(t - slots, 0), t)
        kj, vj = np.asarray(kj)[:, :, held % slots], np.asarray(vj)[:, :, held % slots]
        if k64.shape[2] == t:
            k64, v64, k32, v32 = (a[:, :, held] for a in (k64, v64, k32, v32))
        if kj.shape != k64.shape or vj.shape != v64.shape:
            return [], f"layer {layer}'s cache is {kj.shape}, torch's keys {k64.shape}"
        torch_err, jax_err = err([k32, v32], [k64, v64]), err([kj, vj], [k64, v64])
        scale = max(finite_max(k64), finite_max(v64))
        rows.append(CacheRow(layer, torch_err, jax_err, scale, budget(torch_err, scale)))
    return rows, ""


# ---------------------------------------------------------------- the whole check


def bisect_generation(torch_model, flax_model, prompt_ids, max_new_tokens: int, *, modules: bool = True,
                      use_jit: bool = True, allow_skipped: bool = False, rename=None) -> GenerationReport:
    """The first step of greedy decoding whose logits leave float32 rounding, and where it comes from.

    Args:
        torch_model: the torch twin (``torch_reference`` or a transformers causal LM), run in
            float32 and as a float64 copy (the reference).
        flax_model: a decoder with ``init_cache``/``decode_step`` (gpt, GPT-2, the llama family).
        prompt_ids: (t,) or (batch, t) token ids, no padding.
        max_new_tokens: steps to decode (>= 1); prompt and new tokens must fit the position table.
        modules: run ``bisect.bisect`` at the divergent step to name ``module`` (False skips it:
            on a large model it costs more than the decoding).
        use_jit, allow_skipped, rename: passed to ``bisect.bisect`` at the divergent step.

    Returns:
        a ``GenerationReport``: ``steps``, ``first_divergent_step`` (from 0: the first new token;
        None when every step agrees), ``module``, ``cache_layer``, ``passed``.
    """
    ids = check_inputs(flax_model, prompt_ids, max_new_tokens)  # before any computation
    torch_model.eval()
    flax_model.eval()
    import torch

    reference = torch_copy(torch_model, torch.float64)
    p, n = ids.shape[1], int(max_new_tokens)
    seq, l64 = ids, []
    for _ in range(n):  # fp64 greedy: the tokens every run is fed
        last = _logits(reference, seq)[:, -1]
        l64.append(last)
        seq = np.concatenate([seq, np.argmax(last, -1)[:, None]], axis=1)
    l64 = np.stack(l64, axis=1)  # (b, n, V)
    l32 = _logits(torch_model, seq[:, :-1])[:, p - 1:]  # causal: one call gives every step's torch fp32 logits
    steps = []

    def judge(s, lj):
        steps.append(_step_row(s, p - 1 + s, l64[:, s], l32[:, s], lj))
        return steps[-1].failed

    at, cache, traces = _jax_decode(flax_model, seq, p, n, judge)
    first = next((r.step for r in steps if r.failed), None)
    prefix = seq[:, :p + at]  # what step ``at`` reads: the prompt and the tokens before it
    report = GenerationReport(steps, first, prompt_length=p, traces=traces, cache_step=at)
    report.cache_rows, report.cache_note = _cache_rows(torch_model, reference, cache, prefix)
    if first is not None and modules:
        try:
            report.module = bisect(torch_model, flax_model, (prefix,), use_jit=use_jit, allow_skipped=allow_skipped,
                                   rename=rename).first_divergent
        except Exception as error:  # e.g. a transformers model whose modules take other arguments than ours:
            # the steps and the cache stand on their own; say why no module is named rather than lose them
            message = (str(error).strip().splitlines() or [""])[0]
            report.module_note = f"bisect failed: {type(error).__name__}: {message[:200]}"
    return report
