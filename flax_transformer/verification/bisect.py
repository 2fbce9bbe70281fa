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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop.layer_kinds import apply_rename, check_rename
from flax_transformer.verification import capture, frameworks, layouts, measure, routing
from flax_transformer.verification import precision as _precision
from flax_transformer.verification.bisect_report import (
    BOTH_NONFINITE,
    COVERED_FREE,
    COVERED_READ,
    MODEL,
    TORCH_NONFINITE,
    BisectReport,
    GradRow,
    ModuleRow,
    attach,
    first_divergent_grad,
)
from flax_transformer.verification.measure import (
    cast,
    finite_part_errs,
    fp32_inputs,
    nonfinite_counts,
    torch_copy,
    torch_grads,
)
from flax_transformer.verification.precision import budget, grad_budgets

# ---------------------------------------------------------------- measuring


def _floats(tree) -> list[np.ndarray]:
    """The floating-point arrays of a (nested) output, as numpy, in order."""
    return list(frameworks.float_leaves(tree).values())


def _aligned(ref_out, t32_out, jax_out, channels_last: bool):
    """(fp64, torch fp32, JAX) float leaves of one call, matched by ``frameworks.pair_paths`` and JAX's
    in torch's layout; None when they do not line up (count or shapes)."""
    want, got_t, got_j = frameworks.float_leaves(ref_out), frameworks.float_leaves(t32_out), frameworks.float_leaves(jax_out)
    pairs, torch_only, flax_only = frameworks.pair_paths(list(want), list(got_j))
    if torch_only or flax_only or set(want) != set(got_t):
        return None
    js = [layouts.to_torch_layout(got_j[j], want[t].shape, channels_last) for t, j in pairs]
    if any(j is None for j in js):
        return None
    return [want[t] for t, _ in pairs], [got_t[t] for t, _ in pairs], js


def _jax_inputs(jax_call: capture.Call, ref_call: capture.Call, channels_last: bool = False):
    """The JAX call's own arguments with each float array replaced by the fp64 reference's input
    to the same module (cast to float32; moved to channels last for a layer that takes them so):
    masks and ids keep JAX's own form, which may differ from torch's. None when the float inputs
    do not line up (count or shapes)."""
    leaves, treedef = jax.tree.flatten((jax_call.args, jax_call.kwargs))  # keyword arguments sorted by name
    ref_kwargs = [ref_call.kwargs[k] for k in sorted(ref_call.kwargs)]
    ref = [a for a in frameworks.leaves((*ref_call.args, *ref_kwargs))
           if hasattr(a, "is_floating_point") and a.is_floating_point()]
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype,
                                                                                                  jnp.floating)]
    if len(slots) != len(ref):
        return None
    for i, r in zip(slots, ref):
        a = r.detach().numpy().astype(np.float32)
        if channels_last and a.ndim >= 3:
            a = np.transpose(a, layouts.channels_last_axes(a.ndim))  # (b, c, *spatial) -> (b, *spatial, c)
        if tuple(leaves[i].shape) != a.shape:
            return None
        leaves[i] = jnp.asarray(a).astype(leaves[i].dtype)
    return treedef.unflatten(leaves)


def _rerun_alone(torch_module, ref_call, jax_call, want, dtype=None, heads=None):
    """(torch error, JAX error) of the module rerun alone on the fp64 input, cast to ``dtype`` for
    torch (default float32) and to float32 for JAX (its module casts; through the RoPE permutation
    of ``heads``, as its row); None if it cannot be."""
    import torch

    channels_last = layouts.channels_last(jax_call.module)
    inputs = _jax_inputs(jax_call, ref_call, channels_last)
    if inputs is None or jax_call.module is None:
        return None, None
    dtype = dtype or torch.float32
    with torch.no_grad():
        torch_out = torch_module(*cast(ref_call.args, dtype), **cast(ref_call.kwargs, dtype))
    jax_out = jax_call.module(*inputs[0], **inputs[1])
    got_t = _floats(torch_out)
    got_j = [layouts.to_torch_layout(a, w.shape, channels_last) for a, w in zip(_floats(jax_out), want)]
    if heads is not None:
        got_j = [None if a is None else layouts.to_rope_order(a, heads, -1) for a in got_j]
    if len(got_t) != len(want) or len(got_j) != len(want) or any(a is None for a in got_j):
        return None, None
    return measure.err(got_t, want), measure.err(got_j, want)


def _all_finite(tree) -> bool:
    """Every floating value of a call's inputs or output (JAX or torch, nested) finite."""
    return all(bool(np.isfinite(np.asarray(a, np.float64)).all()) for a in _floats(tree))


def _produced(call) -> bool:
    """The call's inputs finite, its output not: it made the NaN or inf."""
    return call is not None and not _all_finite(call.output) and _all_finite((call.args, call.kwargs))


def _status(jax_err, torch_err, scale, local, precision=_precision.FP32) -> str:
    if jax_err <= budget(torch_err, scale, precision):
        return "ok"
    local_torch, local_jax = local
    if local_jax is None:
        return "diverged"
    return "introduced" if local_jax > budget(local_torch, scale, precision) else "inherited"


def _not_called_status(module, name: str, flax_names: tuple[set[str], set[str]] | None, pairs=(),
                       tied: dict[str, tuple[str, ...]] | None = None) -> str:
    """The status of a torch module call that has no Flax call at its path (after ``rename``).

    Covered (not a gap in the report): a parameter-free module (a dropout in eval mode, an
    activation as a module) whose effect the Flax twin computes inline, or a module the Flax
    twin has at the same path, or whose every parameter it holds under the same torch name,
    but reads rather than calls (an embedding table indexed directly; BERT's per-head
    projections, which the Flax attention folds into one matmul; a head tied to the embedding,
    computed with ``embed.attend``: any key of a tied tensor, ``tied``, will do). Its effect is in
    its parent's row, and its parameters' in their gradients.
    Skipped (incomplete): a module with parameters and no Flax module of its name (a layout
    the port renamed, say, without ``rename=``), which nothing in the report stands for."""
    base = name.split("#")[0]
    if not any(True for _ in module.parameters()):
        return COVERED_FREE
    flax_paths, flax_keys = flax_names or (set(), set())
    tied = tied or {}

    def held(key: str) -> bool:
        return any(apply_rename(k, pairs) in flax_keys for k in tied.get(key, (key,)))

    if flax_path(base, module, pairs) in flax_paths or all(held(f"{base}.{key}" if base else key)
                                                           for key, _ in module.named_parameters()):
        return COVERED_READ
    return "skipped: no Flax call at this path" + ("" if pairs else " (rename=? torch and Flax may name it apart)")


def flax_path(path: str, module, pairs) -> str:
    """The Flax module path of the torch module at ``path`` under ``rename``'s compiled ``pairs``:
    the part its parameters' keys keep after renaming (``a.attention.tokeys.weight`` ->
    ``a.mhattention.tokeys.weight``: ``a.mhattention``), else ``path + "."`` renamed (a module with
    no parameters), so the same pairs as porting's match whole keys and module paths alike."""
    if not pairs or not path:
        return path
    found = set()
    for key, _ in module.named_parameters():
        renamed = apply_rename(f"{path}.{key}", pairs)
        if renamed.endswith("." + key):
            found.add(renamed[: -len(key) - 1])
    if len(found) == 1:
        return found.pop()
    probe = apply_rename(path + ".", pairs)
    return probe[:-1] if probe.endswith(".") else apply_rename(path, pairs)


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


def _tied(torch_model) -> dict[str, tuple[str, ...]]:
    """{torch key: every key of its tensor} for the tensors torch holds under several keys."""
    from flax_transformer.interop import porting

    return {key: group for group in porting.tied_keys(torch_model) for key in group}


def _module_rows(ref_calls, t32_calls, jax_calls, modules32, rerun: bool,
                 flax_names: tuple[set[str], set[str]] | None = None, pairs=(),
                 tied: dict[str, tuple[str, ...]] | None = None, measured: dict | None = None,
                 length: int | None = None, precision=_precision.FP32, permutations=()) -> list[ModuleRow]:
    """One row per torch call (``t32_calls``: the torch run at ``precision``); ``measured`` gets
    {row: (torch, JAX) error per position} (``positions``); ``permutations``: ``check_permutations``'."""
    rows = []
    for name, ref in ref_calls.items():
        kind = type(ref.module).__name__
        base, mark, count = name.partition("#")
        at = flax_path(base, ref.module, pairs) + mark + count  # the Flax call's label
        t32, jx = t32_calls.get(name), jax_calls.get(at)
        renamed = at if at != name else ""
        if jx is None:
            rows.append(ModuleRow(name, kind, status=_not_called_status(ref.module, name, flax_names, pairs, tied),
                                  produced="torch" if _produced(t32) else "", flax_path=renamed))
            continue
        channels_last = layouts.channels_last(jx.module)
        aligned = _aligned(ref.output, t32.output, jx.output, channels_last)
        if aligned is None:
            shapes = lambda xs: [tuple(x.shape) for x in xs]  # noqa: E731
            rows.append(ModuleRow(name, kind, flax_path=renamed, status=(
                f"skipped: the Flax output has another structure or shape ({shapes(_floats(jx.output))} vs "
                f"torch {shapes(_floats(ref.output))})")))
            continue
        want, got_t, got_j = aligned
        heads = layouts.permuted_heads(ref.path, permutations)
        if heads is not None and any((got_j := [layouts.to_rope_order(j, heads, -1) for j in got_j])[i] is None
                                     for i in range(len(got_j))):
            rows.append(ModuleRow(name, kind, flax_path=renamed, status=(
                f"skipped: the output's features are not {heads} heads of RoPE pairs (permutations=)")))
            continue
        moved = channels_last and any(w.ndim >= 3 for w in want)
        torch_err, jax_err, scale = measure.err(got_t, want), measure.err(got_j, want), measure.scale(want)
        if measured is not None and not moved and (found := measure.position_errors(want, got_t, got_j, length)):
            measured[name] = found
        jax_only, torch_only, both = nonfinite_counts(got_t, got_j)
        if jax_only:  # NaN/inf in JAX where torch has another value: never agreement
            jax_err = float("inf")
        elif both and not torch_only:  # the same NaN/inf in both: judge the finite rest by the budget
            torch_err, jax_err = finite_part_errs(got_t, got_j, want)
        local = (None, None)
        if rerun and jax_err > budget(torch_err, scale, precision):  # only a diverged call needs the rerun
            local = _rerun_alone(modules32[ref.path], ref, jx, want, precision.torch_dtype(), heads)
        status = _status(jax_err, torch_err, scale, local, precision)
        if torch_only and not jax_only:
            status = TORCH_NONFINITE
        elif jax_only and status == "ok":  # torch's own error is infinite too: no budget to be within
            status = "diverged"
        elif both and status == "ok":
            status = BOTH_NONFINITE
        produced = ", ".join(side for side, call in (("JAX", jx), ("torch", t32)) if _produced(call))
        rows.append(ModuleRow(name, kind, torch_err, jax_err, scale, *local, status, jax_only, torch_only, both,
                              produced, flax_path=renamed,
                              note="channels last in Flax, compared in torch's layout" if moved else
                              "compared through Meta's RoPE order of its features" if heads is not None else "",
                              precision=precision.name))
    return rows


def bisect(torch_model, flax_model, args: tuple, kwargs: dict | None = None, *, grads: bool = False,
           use_jit: bool = True, seed: int = 0, allow_nonfinite: bool = False,
           allow_skipped: bool = False, rename=None, loss_fn=None, precision=None,
           permutations=None) -> BisectReport:
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

    Returns:
        a ``BisectReport``: ``rows``, ``first_divergent`` (None exactly when the report passed),
        ``first_nonfinite``, and with ``grads=True`` ``grad_rows`` and ``first_divergent_grad``.
    """
    import torch

    kwargs = kwargs or {}
    pairs = check_rename(rename)  # a bad rename fails before any work
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
        rows = _module_rows(capture.labelled(ref), capture.labelled(t32), capture.labelled(jx), modules32, True,
                            _flax_names(flax_model), pairs, _tied(torch_model), measured,
                            measure.sequence_length((t_args, t_kwargs)), rule, permuted)
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
    return report.settle()


# ---------------------------------------------------------------- gradients


def _grad_rows(torch_model, reference, flax_model, args, kwargs, seed, rename=None, loss_fn=None,
               rule=_precision.FP32, permutations=()) -> list[GradRow]:
    """One row per parameter: torch's (at ``rule``'s precision) and Flax's gradients against ``reference``'s."""
    import torch
    from flax import nnx

    from flax_transformer.interop import porting

    torch_fn, flax_fn = frameworks.split_loss_fn(loss_fn)
    with torch.no_grad():
        out = torch_model(*cast(args, rule.torch_dtype()), **cast(kwargs, rule.torch_dtype()))
    weights = {} if torch_fn is not None else frameworks.default_weights(out, seed)  # compare.compare's W
    if torch_fn is None and not weights:
        raise ValueError("grads=True: the torch outputs hold no floating-point array to differentiate; give loss_fn=")
    _, g32 = torch_grads(torch_model, args, kwargs, weights, torch_fn, rule.torch_dtype())
    _, g64 = torch_grads(reference, args, kwargs, weights, torch_fn, torch.float64)
    j_args = tuple(map(frameworks.to_jax, args))
    j_kwargs = {k: frameworks.to_jax(v) for k, v in kwargs.items()}
    t_paths = tuple(p for p, v in frameworks.flatten(out) if v is not None)
    _, grads = frameworks.flax_grads(flax_model, j_args, j_kwargs, {p: jnp.asarray(w) for p, w in weights.items()},
                                     t_paths, flax_fn)
    holder = nnx.clone(flax_model)
    nnx.update(holder, grads)  # the gradients in the parameters' places, to read them under torch names
    gj = porting.state_dict(holder)
    keys, flax_only = frameworks.grad_keys(torch_model, gj, rename, porting.tied_keys(flax_model))
    # one gradient per tensor: a tied one summed over its uses (torch's autograd sums already)
    g32 = {k.name: frameworks.sum_grads(g32, k.torch) for k in keys}
    g64 = {k.name: frameworks.sum_grads(g64, k.torch) for k in keys}
    budgets = grad_budgets(g32, g64, rule)
    rows = []
    for key in keys:
        want = g64[key.name]
        if not key.flax:
            rows.append(GradRow(key.name, 0.0, float("nan"), 0.0, "skipped: no Flax parameter of this name"
                                + ("" if rename else " (rename=?)"), note=key.note, keys=key.tied))
            continue
        (scale, limit), got_t, got_j = budgets[key.name], [g32[key.name]], [frameworks.sum_grads(gj, key.flax)]
        if (heads := layouts.permuted_heads(key.name.rpartition(".")[0], permutations)) is not None:
            got_j = [layouts.to_rope_order(got_j[0], heads, 0)]  # a weight's rows, a bias: Meta's order
        torch_err, jax_err = measure.err(got_t, [want]), measure.err(got_j, [want])
        jax_only, torch_only, both = nonfinite_counts(got_t, got_j)
        if jax_only:
            jax_err = float("inf")
        elif both and not torch_only:
            torch_err, jax_err = finite_part_errs(got_t, got_j, [want])
        status = "ok" if jax_err <= limit and not jax_only else "diverged"
        if torch_only and not jax_only:
            status = TORCH_NONFINITE
        elif both and status == "ok":
            status = BOTH_NONFINITE
        rows.append(GradRow(key.name, torch_err, jax_err, scale, status, jax_only, torch_only, both, limit,
                            note=key.note, keys=key.tied))
    buffers = {apply_rename(k, check_rename(rename)) for k, _ in torch_model.named_buffers()}
    for name in flax_only:
        if name in buffers:  # a torch buffer (DeepSeek's correction bias): no gradient there, so Flax's must be 0
            g = np.asarray(frameworks.to_numpy(gj[name]), np.float64)
            err = float(np.abs(g).max(initial=0.0)) if np.all(np.isfinite(g)) else float("inf")
            rows.append(GradRow(name, 0.0, err, 0.0, "ok" if err == 0 else "diverged", budget=0.0,
                                note="a torch buffer: its gradient is zero"))
            continue
        rows.append(GradRow(name, 0.0, float("nan"), 0.0, "skipped: a Flax parameter that no torch key reaches"
                            + ("" if rename else " (rename=?)")))
    return rows
