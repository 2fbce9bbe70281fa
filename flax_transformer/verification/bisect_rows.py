"""``bisect``'s judging: one row per torch module call and per parameter gradient, from values.

``bisect`` runs torch (float64, and at the Flax model's precision) and hands the calls here;
``trace_bisect`` hands the same calls read back from a recorded trace, where torch is not
installed. Either way a torch call is a ``capture.Call`` whose ``module`` answers
``named_parameters()`` (a torch module, or a trace's ``RecordedModule``), and the torch module
rerun alone on the float64 input comes as its float outputs (``rerun_torch``), run now or
recorded. The statuses, the budget rule and ``first_divergent`` are in ``bisect``'s docstring.

No torch here: the values are numpy, JAX, or torch tensors that ``frameworks`` converts.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop.layer_kinds import apply_rename, check_rename
from flax_transformer.verification import capture, frameworks, layouts, measure
from flax_transformer.verification import precision as _precision
from flax_transformer.verification.bisect_report import (
    BOTH_NONFINITE,
    COVERED_FREE,
    COVERED_READ,
    TORCH_NONFINITE,
    GradRow,
    ModuleRow,
)
from flax_transformer.verification.measure import finite_part_errs, nonfinite_counts
from flax_transformer.verification.precision import budget, grad_budgets

# torch's float outputs of one module rerun alone on the float64 input (``name``: the call's label), or None
RerunTorch = Callable[[str, capture.Call], "list[np.ndarray] | None"]


def floats(tree) -> list[np.ndarray]:
    """The floating-point arrays of a (nested) output, as numpy, in order."""
    return list(frameworks.float_leaves(tree).values())


def kind_of(module) -> str:
    """A torch call's module kind: its class name (a trace's ``RecordedModule`` says the recorded one)."""
    return getattr(module, "recorded_kind", None) or type(module).__name__


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


def _is_float(a) -> bool:
    """A floating torch tensor or numpy array (a trace's inputs are numpy)."""
    if hasattr(a, "is_floating_point"):
        return bool(a.is_floating_point())
    return isinstance(a, np.ndarray) and jnp.issubdtype(a.dtype, jnp.floating)


def jax_inputs(jax_call: capture.Call, ref_call: capture.Call, channels_last: bool = False):
    """The JAX call's own arguments with each float array replaced by the fp64 reference's input
    to the same module (cast to float32; moved to channels last for a layer that takes them so):
    masks and ids keep JAX's own form, which may differ from torch's. None when the float inputs
    do not line up (count or shapes)."""
    leaves, treedef = jax.tree.flatten((jax_call.args, jax_call.kwargs))  # keyword arguments sorted by name
    ref_kwargs = [ref_call.kwargs[k] for k in sorted(ref_call.kwargs)]
    ref = [a for a in frameworks.leaves((*ref_call.args, *ref_kwargs)) if _is_float(a)]
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype,
                                                                                                  jnp.floating)]
    if len(slots) != len(ref):
        return None
    for i, r in zip(slots, ref):
        a = np.asarray(frameworks.to_numpy(r)).astype(np.float32)
        if channels_last and a.ndim >= 3:
            a = np.transpose(a, layouts.channels_last_axes(a.ndim))  # (b, c, *spatial) -> (b, *spatial, c)
        if tuple(leaves[i].shape) != a.shape:
            return None
        leaves[i] = jnp.asarray(a).astype(leaves[i].dtype)
    return treedef.unflatten(leaves)


def rerun_alone(torch_rerun, ref_call, jax_call, want, heads=None):
    """(torch error, JAX error) of the module rerun alone on the fp64 input: ``torch_rerun()`` gives
    torch's float outputs of that rerun (at the precision's dtype; run now or recorded; None: none),
    JAX's module runs now on it cast to float32 (its module casts; through the RoPE permutation of
    ``heads``, as its row); (None, None) if it cannot be."""
    channels_last = layouts.channels_last(jax_call.module)
    inputs = jax_inputs(jax_call, ref_call, channels_last)
    if inputs is None or jax_call.module is None or (got_t := torch_rerun()) is None:
        return None, None
    jax_out = jax_call.module(*inputs[0], **inputs[1])
    got_j = [layouts.to_torch_layout(a, w.shape, channels_last) for a, w in zip(floats(jax_out), want)]
    if heads is not None:
        got_j = [None if a is None else layouts.to_rope_order(a, heads, -1) for a in got_j]
    if len(got_t) != len(want) or len(got_j) != len(want) or any(a is None for a in got_j):
        return None, None
    return measure.err(got_t, want), measure.err(got_j, want)


def _all_finite(tree) -> bool:
    """Every floating value of a call's inputs or output (JAX or torch, nested) finite."""
    return all(bool(np.isfinite(np.asarray(a, np.float64)).all()) for a in floats(tree))


def produced(call) -> bool:
    """The call's inputs finite, its output not: it made the NaN or inf (a recorded call says so itself)."""
    if call is None:
        return False
    known = getattr(call, "produced", None)
    if known is not None:
        return bool(known)
    return not _all_finite(call.output) and _all_finite((call.args, call.kwargs))


def _status(jax_err, torch_err, scale, local, precision=_precision.FP32) -> str:
    if jax_err <= budget(torch_err, scale, precision):
        return "ok"
    local_torch, local_jax = local
    if local_jax is None:
        return "diverged"
    return "introduced" if local_jax > budget(local_torch, scale, precision) else "inherited"


def not_called_status(module, name: str, flax_names: tuple[set[str], set[str]] | None, pairs=(),
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
    params = [key for key, _ in module.named_parameters()]
    if not params:
        return COVERED_FREE
    flax_paths, flax_keys = flax_names or (set(), set())
    tied = tied or {}

    def held(key: str) -> bool:
        return any(apply_rename(k, pairs) in flax_keys for k in tied.get(key, (key,)))

    if flax_path(base, module, pairs) in flax_paths or all(held(f"{base}.{key}" if base else key) for key in params):
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


def flax_names(flax_model) -> tuple[set[str], set[str]]:
    """(the Flax model's module paths, its parameters' torch names): what a torch call with no Flax
    call may be covered by (``not_called_status``)."""
    from flax_transformer.interop import porting

    paths = {".".join(map(str, path)) for path, node in nnx.iter_graph(flax_model) if isinstance(node, nnx.Module)}
    try:
        keys = set(porting.state_dict(flax_model))
    except (TypeError, ValueError):  # a model the porting cannot name: by path alone
        keys = set()
    return paths, keys


def module_rows(ref_calls, t32_calls, jax_calls, rerun_torch: RerunTorch | None,
                flax_names: tuple[set[str], set[str]] | None = None, pairs=(),
                tied: dict[str, tuple[str, ...]] | None = None, measured: dict | None = None,
                length: int | None = None, precision=_precision.FP32, permutations=()) -> list[ModuleRow]:
    """One row per torch call (``t32_calls``: the torch run at ``precision``); ``rerun_torch`` gives a
    diverged call's torch rerun alone (None: no reruns); ``measured`` gets {row: (torch, JAX) error per
    position} (``positions``); ``permutations``: ``layouts.check_permutations``'."""
    rows = []
    for name, ref in ref_calls.items():
        kind = kind_of(ref.module)
        base, mark, count = name.partition("#")
        at = flax_path(base, ref.module, pairs) + mark + count  # the Flax call's label
        t32, jx = t32_calls.get(name), jax_calls.get(at)
        renamed = at if at != name else ""
        if jx is None:
            rows.append(ModuleRow(name, kind, status=not_called_status(ref.module, name, flax_names, pairs, tied),
                                  produced="torch" if produced(t32) else "", flax_path=renamed))
            continue
        channels_last = layouts.channels_last(jx.module)
        aligned = _aligned(ref.output, t32.output, jx.output, channels_last)
        if aligned is None:
            shapes = lambda xs: [tuple(x.shape) for x in xs]  # noqa: E731
            rows.append(ModuleRow(name, kind, flax_path=renamed, status=(
                f"skipped: the Flax output has another structure or shape ({shapes(floats(jx.output))} vs "
                f"torch {shapes(floats(ref.output))})")))
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
        if rerun_torch is not None and jax_err > budget(torch_err, scale, precision):  # only a diverged call's
            local = rerun_alone(lambda: rerun_torch(name, ref), ref, jx, want, heads)  # noqa: B023 - called now
        status = _status(jax_err, torch_err, scale, local, precision)
        if torch_only and not jax_only:
            status = TORCH_NONFINITE
        elif jax_only and status == "ok":  # torch's own error is infinite too: no budget to be within
            status = "diverged"
        elif both and status == "ok":
            status = BOTH_NONFINITE
        made = ", ".join(side for side, call in (("JAX", jx), ("torch", t32)) if produced(call))
        rows.append(ModuleRow(name, kind, torch_err, jax_err, scale, *local, status, jax_only, torch_only, both,
                              made, flax_path=renamed,
                              note="channels last in Flax, compared in torch's layout" if moved else
                              "compared through Meta's RoPE order of its features" if heads is not None else "",
                              precision=precision.name))
    return rows


# ---------------------------------------------------------------- gradients


def grad_rows(torch_model, g32: dict, g64: dict, weights: dict, torch_paths: tuple[str, ...], flax_model,
              j_args, j_kwargs, rename=None, flax_fn=None, rule=_precision.FP32, permutations=(),
              torch_tied=None) -> list[GradRow]:
    """One row per parameter: torch's gradients (``g32``, at ``rule``'s precision) and Flax's, taken
    now, against the fp64 reference's ``g64`` ({torch key: numpy}); ``weights`` {torch output path:
    W} the default scalar's (empty with ``flax_fn``), ``torch_paths`` torch's output leaves that are
    not None. ``torch_model`` answers ``named_parameters``/``named_buffers`` (a trace's stand-in
    too, with its ``torch_tied`` groups)."""
    from flax_transformer.interop import porting

    _, grads = frameworks.flax_grads(flax_model, j_args, j_kwargs, {p: jnp.asarray(w) for p, w in weights.items()},
                                     tuple(torch_paths), flax_fn)
    holder = nnx.clone(flax_model)
    nnx.update(holder, grads)  # the gradients in the parameters' places, to read them under torch names
    gj = porting.state_dict(holder)
    keys, flax_only = frameworks.grad_keys(torch_model, gj, rename, porting.tied_keys(flax_model),
                                           torch_tied=torch_tied)
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
