"""Compare one torch model with its Flax twin: ``compare`` runs both on the same inputs and
returns a ``CompareReport`` (the outputs' error, and with ``grads=True`` every parameter's
gradient error); ``Row`` is one line of it and of the ``verify`` command's tables.

Every output and gradient is also measured against a float64 copy of the torch model and held
to the float64 budget rule (``precision.budget``: one rule, written once). Non-finite values never
agree, and anything not compared makes the verdict incomplete (see ``compare``).

``certificate``, ``verify`` and the CLI build on it; it builds on ``frameworks`` and takes the
budget rule from ``precision`` and its measuring from ``measure``. torch is imported at call time only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop.layer_kinds import apply_rename, check_rename
from flax_transformer.verification import measure, routing
from flax_transformer.verification import precision as _precision
from flax_transformer.verification.frameworks import apply as _apply
from flax_transformer.verification.frameworks import (
    apply_flat,
    default_weights,
    flatten,
    grad_keys,
    set_aside_lines,
    split_loss_fn,
    sum_grads,
    to_jax,
    to_torch,
    torch_scalar,
)
from flax_transformer.verification.frameworks import flax_grads as _flax_grads
from flax_transformer.verification.measure import torch_reference
from flax_transformer.verification.precision import grad_budget
from flax_transformer.verification.reports import TOLERANCE, CompareReport, Row


def compare(torch_model, flax_model, args: tuple, kwargs: dict | None = None, *, tol: float | None = None,
            grads: bool = False, use_jit: bool = True, seed: int = 0, fp64: bool = True,
            allow_nonfinite: bool = False, allow_skipped: bool = False, rename=None,
            loss_fn=None, lm: bool = False, lm_mask=None, lm_gates: measure.LMGates | None = None,
            precision=None) -> CompareReport:
    """Run a torch model and its Flax twin in eval mode on the same inputs and compare them.

    Works for any pair whose calls take the same arguments. Inputs may be numpy arrays or torch
    tensors (each framework gets its own copy); ``None`` and Python scalars pass through.

    Outputs may have any structure (tuples, dicts, dataclasses, HF ``ModelOutput``s, ``None`` or
    other non-array leaves: a torch ``(logits, None)``). Leaves are named by path (``output[0]``,
    ``output.logits``) and matched by path, or by position where the structures differ but hold
    as many leaves (``frameworks.match_outputs``). Arrays are compared by value; any other leaf
    must be equal, of the same type, and is listed (``report.others``); ``None`` equals an absent
    leaf. A leaf that differs, or is on one side only, fails the report (``Row.mismatched``).
    A cache is set aside by its type (a transformers model run with ``use_cache=True``, its default,
    returns its key/value cache beside the logits: ``frameworks.set_aside``): it is not compared,
    the logits and any hidden states are, and ``report.set_aside`` and the summary list it.

    Each array output is judged three ways: its max abs error (``tol``), its error relative to the
    outputs' scale (``report.max_rel_err``, for the certificate), and against a float64 copy of the
    torch model (``deepcopy(torch_model).double()``, float inputs cast; ids and masks kept), with
    ``bisect``'s budget rule: JAX's error against float64 may be at most
    ``precision.budget(torch_err, scale)``, ``max(SLACK * torch_err, FLOOR_ULPS * eps32 * scale)``,
    where ``torch_err`` is torch fp32's own error against float64 and ``scale`` the output's
    largest |float64| value. This catches an error far below ``tol`` on an output with small
    values (a tanh GELU for an exact one), where torch fp32 is much more accurate than that.

    Non-finite values never agree: NaN or inf on one side only fails; NaN or inf on both sides
    (the same value) is "not finite in either framework" and fails unless ``allow_nonfinite``.
    Anything that could not be compared (an array leaf that is not numeric, a gradient with no
    counterpart, the float64 reference when it does not run) is listed in ``report.skipped`` and
    fails unless ``allow_skipped``; the summary's first line then says so.

    Args:
        args, kwargs: the call's arguments, e.g. ``(ids, mask)``.
        tol: the max abs error a row may have and pass; None: ``TOLERANCE`` (fp32, matmul precision
            "highest": 1e-5) for a float32 model, none (infinite) for a bfloat16 one, which is
            judged by its float64 budget alone (``precision``).
        grads: also compare every parameter's gradient of one scalar: ``loss_fn(outputs)`` when
            given, else ``sum_i <output_i, W_i>`` over the floating output leaves with fixed random
            ``W_i`` (``frameworks.default_weights``, seeded by ``seed``, placed on Flax's leaves by
            path): the gradient of any loss is the backward pass of some such ``W``, so a random one
            checks the whole backward pass. Each parameter's error is relative to its gradient's
            scale, ``max(1, max |g_torch|)``; parameters are named by their torch keys. A tensor
            torch holds under several keys (a head tied to the embedding) is one row, its gradient
            the sum over its uses, as torch's autograd gives it; the Flax side sums its gradients
            too where it holds the tensor more than once; the row's note says it is tied. Each
            gradient is also held to the float64 rule (the float64 copy's gradient; one budget for
            all of them, torch's largest gradient error and the largest gradient over the model,
            ``precision.grad_budget``, as in ``bisect``).
        use_jit: run the Flax side under ``nnx.jit`` (False: eagerly, op by op).
        fp64: measure against the float64 copy (one more torch forward, and backward with
            ``grads``); False leaves the float64 columns empty and the rule unapplied.
        allow_nonfinite, allow_skipped: see above.
        rename: porting's ``[(regex, replacement), ...]`` (``porting.torch_to_flax(..., rename=)``):
            a torch key's gradient is compared with the Flax parameter whose torch name the key
            becomes after the pairs, applied with ``re.sub`` in order.
        loss_fn: the scalar for ``grads=True``, a function of the outputs, as the model returned
            them (a tuple, a ``ModelOutput``...), returning one number. One function is called
            on torch's outputs (torch tensors), on the float64 copy's and on Flax's (JAX arrays),
            so write it with what both have: indexing and attributes (``out[1]``,
            ``out.logits``), arithmetic operators and the methods ``.sum()``, ``.mean()``,
            ``.max()``, ``.reshape()``, e.g. ``lambda out: out[1]`` (a loss the model returns) or
            ``lambda out: (out.logits ** 2).mean()``; no ``torch.*`` or ``jnp.*`` calls. Or give a
            pair ``(torch_fn, flax_fn)``, one per framework.
        lm: the pair is a language model: also measure the next-token distributions
            (``measure.lm_agreement``: per-token KL(torch || JAX), mean and max, top-1 and top-5
            agreement) on the logits, the output itself, its ``.logits`` or its first element; a
            ``ValueError`` right after torch's forward, before the Flax model runs, when that is
            not floating-point ``[..., vocab]`` logits. The figures are in ``report.lm``, its
            summary and ``to_dict()["lm"]``, and the report passes only if they meet ``lm_gates``.
        lm_mask: ``logits.shape[:-1]``, nonzero at real tokens (padding is left out); None: all.
        lm_gates: ``measure.LM_FP32`` or ``LM_BF16``; None: the one of the model's ``precision``.
        precision: the float64 budget's rule (``precision.py``); None reads the Flax model's compute
            dtype. For a bfloat16 model torch also runs as a ``torch.bfloat16`` copy (forward, and
            backward with ``grads``), whose error against float64 sets the budget, by bf16's rule:
            a correct bf16 port passes, a bug does not. Needs ``fp64`` (nothing else judges it).

    Returns:
        A ``CompareReport``: one row for the outputs, then one per parameter gradient. Read its
        verdict as ``report.passed`` (or ``report.verdict()``, ``to_dict()["passed"]``); it is not a
        tuple and has no truth value (both raise ``TypeError``). Where anything was not compared or
        differs outright, ``report.max_abs_err`` is NaN and ``report.finite`` False (``grad_err`` and
        ``grad_finite`` likewise for a gradient not compared), so no reading of them agrees.
    """
    import torch

    from flax_transformer.interop import porting

    kwargs = kwargs or {}
    check_rename(rename)  # a bad rename fails before any work
    rule = _precision.resolve(precision, flax_model)
    if rule is not _precision.FP32 and not fp64:
        raise ValueError(f"a {rule.name} model is judged against float64 alone (no abs tolerance holds at "
                         f"{rule.name}): fp64=False leaves nothing to judge it by")
    tol = (TOLERANCE if rule is _precision.FP32 else float("inf")) if tol is None else tol
    lm_gates = lm_gates or (measure.LM_FP32 if rule is _precision.FP32 else measure.LM_BF16)
    torch_fn, flax_fn = split_loss_fn(loss_fn)
    torch_model.eval()
    flax_model.eval()
    t_args, t_kwargs = tuple(map(to_torch, args)), {k: to_torch(v) for k, v in kwargs.items()}
    j_args, j_kwargs = tuple(map(to_jax, args)), {k: to_jax(v) for k, v in kwargs.items()}
    # a mixture of experts: choices compared first; at near ties torch runs with JAX's (routing.py)
    route_report, choices = routing.check(torch_model, flax_model, t_args, t_kwargs, j_args, j_kwargs, fp64=fp64,
                                          rule=rule, use_jit=use_jit)
    with routing.forced(torch_model, choices):  # the hooks come off whatever happens
        with torch.set_grad_enabled(grads):
            torch_out = torch_model(*t_args, **t_kwargs)
        if lm:  # checked before anything else runs: a wrong output is the caller's mistake, not a finding
            logits_at = measure.logits_path(torch_out)
            torch_logits = measure.check_logits(measure.leaf(torch_out, logits_at), f"the torch model's {logits_at}")
        family, name = type(flax_model).__module__.rpartition(".")[2], type(flax_model).__name__
        allow = dict(allow_nonfinite=allow_nonfinite, allow_skipped=allow_skipped)
        weights, torch_grads = None, {}
        if grads:
            weights = {} if torch_fn is not None else default_weights(torch_out, seed)
            if torch_fn is None and not weights:
                raise ValueError("grads=True: the torch outputs hold no floating-point array to differentiate; "
                                 "give loss_fn=")
            torch_model.zero_grad(set_to_none=True)
            torch_scalar(torch_out, weights, torch_fn).backward()
            torch_grads = {k: p.grad.numpy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32)
                           for k, p in torch_model.named_parameters()}
        ref_out, ref_grads, why_not = (torch_reference(torch_model, t_args, t_kwargs, weights, torch_fn) if fp64
                                       else (None, None, ""))
        low_out = low_grads = None
        if rule is not _precision.FP32 and not why_not:  # torch at the model's precision: what it costs there
            low_out, low_grads, why_not = torch_reference(torch_model, t_args, t_kwargs, weights, torch_fn, rule)
    if grads:
        t_paths = tuple(p for p, v in flatten(torch_out) if v is not None)
        flax_out, flax_grads = _flax_grads(flax_model, j_args, j_kwargs,
                                           {p: jnp.asarray(w) for p, w in weights.items()}, t_paths, flax_fn)
    else:
        flax_out = _run(flax_model, j_args, j_kwargs, use_jit)
    agreement = (measure.lm_agreement(torch_logits, measure.leaf(flax_out, logits_at, torch_out), lm_mask, gates=lm_gates)
                 if lm else None)
    measured = fp64 and not why_not
    checks, others, skipped, mismatched = measure.outputs(torch_out, flax_out, ref_out, measured, low_out, rule)
    skipped = ([why_not] if why_not else []) + skipped
    out_row = _row(family, name, "given inputs", "torch vs flax", checks, tol, "; ".join(skipped),
                   mismatched="; ".join(mismatched), **allow)
    err, finite = out_row.max_abs_err, out_row.finite
    if (skipped and not allow_skipped) or mismatched:  # the report's figures never read as agreement then
        err, finite = float("nan"), False
    scale = max((c["torch_scale"] for c in checks), default=0.0)
    outputs = tuple(checks)
    aside = dict(set_aside=tuple(set_aside_lines(torch_out) + [f"{p} (flax)" for p in set_aside_lines(flax_out)]))
    if not grads:
        return CompareReport((out_row,), err, finite, tol, scale=scale, outputs=outputs, others=tuple(others),
                             skipped=tuple(skipped), lm=agreement, precision=rule.name, routing=route_report,
                             **aside, **allow)
    rows = [out_row]
    holder = nnx.clone(flax_model)
    nnx.update(holder, flax_grads)  # the gradients in the parameters' places, to read them under torch names
    flax_grads = porting.state_dict(holder)
    keys, flax_only = grad_keys(torch_model, flax_grads, rename, porting.tied_keys(flax_model))
    hint = "" if rename else " (rename=[(regex, replacement)] maps torch names onto the Flax model's)"
    checks, notes = {}, {}
    for key in keys:
        t, j = sum_grads(torch_grads, key.torch), sum_grads(flax_grads, key.flax)
        notes[key.name] = key.note
        checks[key.name] = (measure.blank(t.shape, "no Flax parameter of this name" + hint) if j is None else
                            measure.check(t, j, None if ref_grads is None else sum_grads(ref_grads, key.torch),
                                   measured=measured, precision=rule,
                                   low=None if low_grads is None else sum_grads(low_grads, key.torch)))
    buffers = {apply_rename(k, check_rename(rename)) for k, _ in torch_model.named_buffers()}
    for key in flax_only:
        if key in buffers:  # a torch buffer (DeepSeek's correction bias): no gradient there, so Flax's must be 0
            zero = np.zeros(np.shape(flax_grads[key]), np.float32)
            checks[key] = measure.check(zero, flax_grads[key], zero.astype(np.float64) if measured else None,
                                        measured=measured, precision=rule, low=zero if low_grads else None)
            notes[key] = "a torch buffer: its gradient is zero"
            continue
        checks[key] = measure.blank(np.shape(flax_grads[key]), "a Flax parameter that no torch key reaches" + hint)
    # one budget for all gradients: torch's largest error and the largest gradient (precision.grad_budget)
    measured = {k: (c["torch_err"], c["scale"]) for k, c in checks.items() if c["budget"] is not None}
    grad_scale, limit = grad_budget(measured, rule)
    for key in measured:
        checks[key].update(scale=grad_scale, budget=limit)
    worst, worst_key, all_finite = 0.0, "", True
    for key, check in checks.items():
        g_err = check["max_abs_err"] / max(1.0, check["torch_scale"])  # relative to the gradient's scale
        row = _row(family, key, "given inputs", "grads", [check], tol, check["skipped"], note=notes.get(key, ""),
                   **allow)
        rows.append(dataclasses.replace(row, max_abs_err=g_err))
        if check["skipped"]:
            skipped.append(f"gradient {key}: {check['skipped']}")
        all_finite &= row.finite
        if g_err >= worst:
            worst, worst_key = g_err, key
    if any(r.skipped for r in rows[1:]) and not allow_skipped:  # a gradient not compared: no figure of agreement
        worst, all_finite = float("nan"), False
    return CompareReport(tuple(rows), err, finite, tol, worst, all_finite, worst_key, scale=scale,
                         outputs=outputs, others=tuple(others), skipped=tuple(skipped), lm=agreement,
                         precision=rule.name, routing=route_report, **aside, **allow)


def _run(flax_model, j_args, j_kwargs, use_jit: bool):
    """The Flax model's outputs: compiled (as they are where JAX can return them, else ``freeze``d) or eager."""
    if not use_jit:
        return flax_model(*j_args, **j_kwargs)
    try:
        return _apply(flax_model, j_args, j_kwargs)  # one compile cache with verify's other calls
    except TypeError as error:
        if "not a valid JAX type" not in str(error):
            raise
        return apply_flat(flax_model, j_args, j_kwargs)  # a string or a plain dataclass in the outputs


def _row(family, module, case, direction, checks: list[dict], tol, skipped: str, *, mismatched: str = "",
         note: str = "", **allow) -> Row:
    """One Row from the checks of some output leaves: the largest errors, and the float64 figures
    of the leaf nearest (or furthest beyond) its budget."""
    measured = [c for c in checks if c["budget"] is not None]
    worst = max(measured, key=lambda c: c["jax_err"] / c["budget"] if c["budget"] > 0
                else (0.0 if c["jax_err"] == 0 else float("inf")), default=None)
    return Row(family, module, case, direction, max((c["max_abs_err"] for c in checks), default=0.0),
               all(c["finite"] for c in checks), tol,
               jax_err=None if worst is None else worst["jax_err"],
               torch_err=None if worst is None else worst["torch_err"],
               budget=None if worst is None else worst["budget"],
               nonfinite_jax=sum(c["nonfinite_jax"] for c in checks),
               nonfinite_torch=sum(c["nonfinite_torch"] for c in checks),
               nonfinite_both=sum(c["nonfinite_both"] for c in checks), skipped=skipped, mismatched=mismatched,
               note=note, **allow)


def gradient_errors(torch_module, flax_module, args: tuple, kwargs: dict | None = None, *, seed: int = 0):
    """Compare d loss / d parameter between a torch module and its Flax twin, parameter by parameter
    (``compare(..., grads=True)``; see there for the loss and the relative error).

    Returns (largest relative error over all parameters, all gradients finite, worst key).
    """
    report = compare(torch_module, flax_module, args, kwargs, grads=True, seed=seed)
    return report.grad_err, report.grad_finite, report.worst_grad_key
