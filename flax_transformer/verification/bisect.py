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
``sum_i <output_i, W_i>`` (fixed random W, as ``compare.compare``), each judged by the same
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

import contextlib
import os

from flax_transformer.interop.layer_kinds import check_rename
from flax_transformer.verification import bisect_rows, capture, frameworks, layouts, measure, routing
from flax_transformer.verification import precision as _precision
from flax_transformer.verification import repro as reproducer
from flax_transformer.verification.bisect_report import (
    MODEL,
    BisectReport,
    GradRow,
    attach,
    first_divergent_grad,
)
from flax_transformer.verification.measure import cast, fp32_inputs, torch_copy, torch_grads

# ---------------------------------------------------------------- torch's side


def _torch_rerun(torch_module, ref_call, dtype):
    """torch's float outputs of ``torch_module`` rerun alone on the fp64 reference's input to it, cast to ``dtype``."""
    import torch

    with torch.no_grad():
        return bisect_rows.floats(torch_module(*cast(ref_call.args, dtype), **cast(ref_call.kwargs, dtype)))


def _tied(torch_model) -> dict[str, tuple[str, ...]]:
    """{torch key: every key of its tensor} for the tensors torch holds under several keys."""
    from flax_transformer.interop import porting

    return {key: group for group in porting.tied_keys(torch_model) for key in group}


def bisect(torch_model, flax_model, args: tuple | None = None, kwargs: dict | None = None, *, grads: bool = False,
           use_jit: bool = True, seed: int = 0, allow_nonfinite: bool = False,
           allow_skipped: bool = False, rename=None, loss_fn=None, precision=None,
           permutations=None, repro=None) -> BisectReport:
    """Find the first submodule where the Flax model's output leaves the float64 torch reference.

    Both models run in eval mode on the same inputs (numpy arrays or torch tensors). Rows are
    named by torch module paths, in the order the calls return; a module called k times gets
    ``path``, ``path#1``, ... The budget rule, "introduced" and "inherited", ``first_divergent``
    and the statuses of torch calls with no Flax call are in the module docstring. Calls are
    recorded by ``capture`` (torch hooks; NNX ``__call__`` wrapped). ``use_jit`` runs the Flax
    model under ``nnx.jit`` (the reruns of single modules run eagerly). Sequence outputs also get
    their error per position (``report.positions``, ``positions``: where an error starts).

    A skipped call or gradient fails unless ``allow_skipped``; NaN or inf in both frameworks
    unless ``allow_nonfinite`` (on one side, always).

    Outputs of any structure (tuples, dicts, dataclasses, HF ``ModelOutput``s, ``None`` leaves)
    are compared leaf by leaf, their floating-point arrays matched by path
    (``frameworks.pair_paths``). A layer whose kind holds its inputs and outputs in another
    layout in Flax (``layouts.CHANNELS_LAST_KINDS``: a convolution, channels first in torch and last in
    Flax) is compared through that transposition, its rerun too.

    ``permutations``: ``[(torch module path regex, heads), ...]``, projections whose output features
    (and weight rows) torch holds in Meta's interleaved RoPE order per head and Flax in transformers'
    half split (the porting table's rule, ``converter_ops.RopePermute``): compared through that
    permutation, as a convolution is through its transposition, forward, rerun and gradients, so a
    correct port of Meta's model agrees and a port that forgot the permutation is named there.
    ``known_layouts.meta_llama(config)`` gives Meta's ``rename`` and ``permutations``.

    ``precision``: the budget's (``precision.py``; None: the Flax model's compute dtype). A bf16
    model's torch runs (model, reruns, gradients) use a ``torch.bfloat16`` copy, judged by bf16's rule.

    ``rename`` is porting's ``[(regex, replacement), ...]``: a torch module path is looked up in
    Flax at the path its parameters' keys take after the pairs (``flax_path``), and a torch key's
    gradient is compared with the Flax parameter of the renamed key. ``grads=True``
    differentiates ``loss_fn(outputs)`` when given, else ``sum_i <output_i, W_i>`` (both as in
    ``compare``); a tensor torch ties under several keys is one gradient row, summed over its
    uses, with a note naming the keys (``frameworks.grad_keys``).

    ``repro``: a folder (its parent must exist; a non-empty one is refused before any work) where
    ``repro.write`` puts ``first_divergent`` alone, a script and data files that reproduce it with
    only jax, torch and numpy (docs/reproducers.md); nothing is written when the report passed or
    names ``GRADIENTS`` or ``INCOMPLETE``.

    ``torch_model`` may be a recorded trace's path (``trace.record``): torch's side is then read from
    it and torch is not imported (``trace_bisect.bisect``: no ``args``, ``kwargs``, ``seed`` or
    ``permutations``; the trace holds its inputs and W; docs/traces.md).

    Returns:
        a ``BisectReport``: ``rows``, ``first_divergent`` (None exactly when the report passed),
        ``first_nonfinite``, and with ``grads=True`` ``grad_rows`` and ``first_divergent_grad``.
    """
    if isinstance(torch_model, (str, os.PathLike)):  # a recorded trace: no torch on this side
        from flax_transformer.verification import trace_bisect

        if args is not None or kwargs or permutations or seed != 0 or repro is not None:
            raise ValueError("bisect from a trace takes no args, kwargs, seed, permutations or repro: the trace holds "
                             "its inputs and W, and a reproducer needs the torch module")
        return trace_bisect.bisect(torch_model, flax_model, grads=grads, use_jit=use_jit,
                                   allow_nonfinite=allow_nonfinite, allow_skipped=allow_skipped, rename=rename,
                                   loss_fn=loss_fn, precision=precision)
    if args is None:
        raise ValueError("bisect(torch_model, flax_model, args): give the model's inputs")
    import torch

    kwargs = kwargs or {}
    pairs = check_rename(rename)  # a bad rename fails before any work
    if repro is not None:
        reproducer.check_directory(repro)  # so does a reproducer's folder that exists or has no parent
    permuted = layouts.check_permutations(permutations)
    frameworks.split_loss_fn(loss_fn)
    rule = _precision.resolve(precision, flax_model)
    torch_model.eval()
    flax_model.eval()
    reference = torch_copy(torch_model, torch.float64)
    low = torch_model if rule is _precision.FP32 else torch_copy(torch_model, rule.torch_dtype())
    args, kwargs = fp32_inputs(tuple(args)), fp32_inputs(kwargs)  # the fp64 reference casts them back up
    t_args, t_kwargs = tuple(map(frameworks.to_torch, args)), {k: frameworks.to_torch(v) for k, v in kwargs.items()}
    j_args, j_kwargs = tuple(map(frameworks.to_jax, args)), {k: frameworks.to_jax(v) for k, v in kwargs.items()}
    # a mixture of experts: at near ties both torch runs take JAX's choices (``routing``)
    route_report, choices = routing.check(torch_model, flax_model, t_args, t_kwargs, j_args, j_kwargs, rule=rule,
                                          use_jit=use_jit)  # JAX's choices as the run they are forced for
    with contextlib.ExitStack() as forcing:
        for model in {id(m): m for m in (low, reference)}.values():
            forcing.enter_context(routing.forced(model, choices))
        with torch.no_grad():
            t_out, t32 = capture.torch_calls(low, cast(t_args, rule.torch_dtype()), cast(t_kwargs, rule.torch_dtype()))
            _, ref = capture.torch_calls(reference, cast(t_args, torch.float64), cast(t_kwargs, torch.float64))
        j_out, jx = capture.nnx_calls(flax_model, j_args, j_kwargs, use_jit=use_jit)
        modules32, measured = dict(low.named_modules()), {}
        rows = bisect_rows.module_rows(
            capture.labelled(ref), capture.labelled(t32), capture.labelled(jx),
            lambda _, call: _torch_rerun(modules32[call.path], call, rule.torch_dtype()), bisect_rows.flax_names(
                flax_model), pairs, _tied(torch_model), measured, measure.sequence_length((t_args, t_kwargs)), rule,
            permuted)
        experts = routing.expert_rows(capture.labelled(ref), capture.labelled(jx), modules32,
                                      dict(reference.named_modules()), rule) if route_report is not None else {}
        if grads:
            grad_rows = _grad_rows(low, reference, flax_model, t_args, t_kwargs, seed, rename, loss_fn, rule,
                                   permuted)
    first_nonfinite = next((MODEL if r.path == "" else r.path for r in rows if r.produced), None)
    differ, not_compared = frameworks.output_problems(t_out, j_out)  # what no module row covers: strings, labels
    report = BisectReport(rows, None, allow_nonfinite=allow_nonfinite, allow_skipped=allow_skipped,
                          first_nonfinite=first_nonfinite, outputs_differ=differ, outputs_not_compared=not_compared,
                          outputs_set_aside=frameworks.set_aside_lines(t_out) + frameworks.set_aside_lines(j_out),
                          positions=attach(rows, measured), precision=rule.name, routing=route_report,
                          experts=experts)
    if grads:
        report.grad_rows = grad_rows
        report.first_divergent_grad = first_divergent_grad(report, [call.path for call in t32])
    report.settle()
    if repro is not None:  # the first divergent module alone, in a folder that runs without this library
        reproducer.from_report(repro, report, torch_model, flax_model, args, kwargs, precision=rule,
                               permutations=permutations, use_jit=use_jit)
    return report


# ---------------------------------------------------------------- gradients


def _grad_rows(torch_model, reference, flax_model, args, kwargs, seed, rename=None, loss_fn=None,
               rule=_precision.FP32, permutations=()) -> list[GradRow]:
    """One row per parameter: torch's (at ``rule``'s precision) and Flax's gradients against ``reference``'s."""
    g32, g64, weights, t_paths = torch_grad_values(torch_model, reference, args, kwargs, seed,
                                                   frameworks.split_loss_fn(loss_fn)[0], rule)
    j_args = tuple(map(frameworks.to_jax, args))
    j_kwargs = {k: frameworks.to_jax(v) for k, v in kwargs.items()}
    return bisect_rows.grad_rows(torch_model, g32, g64, weights, t_paths, flax_model, j_args, j_kwargs, rename,
                                 frameworks.split_loss_fn(loss_fn)[1], rule, permutations)


def torch_grad_values(torch_model, reference, args, kwargs, seed, torch_fn, rule=_precision.FP32):
    """(torch's gradients at ``rule``'s precision, the fp64 reference's, {output path: W} of the default
    scalar (``frameworks.default_weights``; empty with ``torch_fn``), torch's output paths that are not
    None): what ``bisect_rows.grad_rows`` judges Flax's gradients by, run now or recorded in a trace."""
    import torch

    with torch.no_grad():
        out = torch_model(*cast(args, rule.torch_dtype()), **cast(kwargs, rule.torch_dtype()))
    weights = {} if torch_fn is not None else frameworks.default_weights(out, seed)  # compare.compare's W
    if torch_fn is None and not weights:
        raise ValueError("grads=True: the torch outputs hold no floating-point array to differentiate; give loss_fn=")
    _, g32 = torch_grads(torch_model, args, kwargs, weights, torch_fn, rule.torch_dtype())
    _, g64 = torch_grads(reference, args, kwargs, weights, torch_fn, torch.float64)
    t_paths = tuple(p for p, v in frameworks.flatten(out) if v is not None)
    return g32, g64, weights, t_paths
