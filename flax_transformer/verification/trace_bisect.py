"""``bisect`` against a recorded trace: the Flax model runs here, torch's side is read back from the
folder ``trace.record`` wrote, on another machine perhaps, and torch is never imported.

What it checks first: the Flax model's weights, named as torch's (``porting.state_dict`` after
``rename=``) and hashed as ``record`` hashed torch's (sha256 of their float32 values), against the
trace's. Another set of weights makes a bisect name a module that is not wrong, so a difference
fails the report (``first_divergent`` is ``WEIGHTS``, "<weights>"), names the keys, and nothing is
run. Then the rows are ``bisect``'s (``bisect_rows``), with the recorded calls for torch's: the
budgets, "introduced" and "inherited" (the JAX module rerun alone now, against torch's recorded
rerun), ``first_divergent`` and, with ``grads=True`` (a trace recorded with gradients), the
gradients against the recorded ones, with the recorded W.

What a trace cannot do: force a mixture of experts' near ties (``routing.check`` runs torch with
JAX's choices; the trace holds torch's own), so for a model with routers the report says routing
was not forced, and no expert is rerun alone; ``permutations=`` (Meta's RoPE order) is not taken.
The report carries the trace's environment (``BisectReport.trace``: device, versions, precision).
"""

from __future__ import annotations

from flax_transformer.interop.layer_kinds import apply_rename, check_rename
from flax_transformer.verification import bisect_rows, capture, frameworks, measure, routing, trace
from flax_transformer.verification import precision as _precision
from flax_transformer.verification.bisect_report import MODEL, BisectReport, attach, first_divergent_grad


def bisect(trace_path, flax_model, *, grads: bool = False, use_jit: bool = True, allow_nonfinite: bool = False,
           allow_skipped: bool = False, rename=None, loss_fn=None, precision=None,
           verify: bool = True) -> BisectReport:
    """``bisect.bisect`` with torch's side from the trace at ``trace_path`` (``trace.read``: ``verify``
    hashes its shards first). The trace's inputs, seed and W are used; ``precision`` must be the
    trace's (None: the Flax model's, which must be it); ``loss_fn``: the Flax side's (the second of a
    pair), given exactly when the trace was recorded with one. The other arguments are ``bisect``'s."""
    pairs = check_rename(rename)  # a bad rename fails before any work
    found = trace.read(trace_path, verify=verify)
    rule = _rule(precision, flax_model, found)
    _, flax_fn = frameworks.split_loss_fn(loss_fn)
    if grads and not found.grads:
        raise ValueError(f"grads=True: the trace {found.path} was recorded without gradients "
                         "(record it with grads=True)")
    if grads and found.index["loss_fn"] != (flax_fn is not None):
        raise ValueError(f"the trace {found.path} was recorded with " + (
            "a loss_fn: give the Flax side's as loss_fn=" if found.index["loss_fn"] else
            "the default scalar sum_i <output_i, W_i>: give no loss_fn"))
    flax_model.eval()
    info = {"path": str(found.path), "precision": found.precision.name, "seed": found.index["seed"],
            "environment": found.environment, "notes": []}
    if routing.router_paths(flax_model):
        info["notes"].append("routing: NOT forced (a trace holds torch's own expert choices, not JAX's): a near tie "
                             "between experts may show as a divergence at a router; experts were not run alone")
    differ = weights_differ(found, flax_model, pairs)
    if differ:
        return BisectReport([], None, allow_nonfinite=allow_nonfinite, allow_skipped=allow_skipped,
                            precision=rule.name, trace=info, weights_differ=differ).settle()
    args, kwargs = found.inputs()
    j_args, j_kwargs = tuple(map(frameworks.to_jax, args)), {k: frameworks.to_jax(v) for k, v in kwargs.items()}
    j_out, jx = capture.nnx_calls(flax_model, j_args, j_kwargs, use_jit=use_jit)
    tied = {key: group for group in found.model.tied for key in group}
    measured = {}
    rows = bisect_rows.module_rows(found.calls("reference"), found.calls("low"), capture.labelled(jx),
                                   lambda label, _: found.rerun(label), bisect_rows.flax_names(flax_model), pairs,
                                   tied, measured, measure.sequence_length((args, kwargs)), rule)
    t_out = found.output()
    first_nonfinite = next((MODEL if r.path == "" else r.path for r in rows if r.produced), None)
    differ, not_compared = frameworks.output_problems(t_out, j_out)
    report = BisectReport(rows, None, allow_nonfinite=allow_nonfinite, allow_skipped=allow_skipped,
                          first_nonfinite=first_nonfinite, outputs_differ=differ, outputs_not_compared=not_compared,
                          outputs_set_aside=frameworks.set_aside_lines(t_out) + frameworks.set_aside_lines(j_out),
                          positions=attach(rows, measured), precision=rule.name, trace=info)
    if grads:
        g_low, g64, weights, paths = found.gradients()
        report.grad_rows = bisect_rows.grad_rows(found.model, g_low, g64, weights, paths, flax_model, j_args,
                                                 j_kwargs, rename, flax_fn, rule, torch_tied=found.model.tied)
        report.first_divergent_grad = first_divergent_grad(report, [e["path"] for e in found.index["calls"]])
    return report.settle()


def _rule(precision, flax_model, found: trace.Trace) -> _precision.Precision:
    """The trace's precision, when ``precision`` (or, None, the Flax model's) is it; else a ValueError."""
    recorded = found.precision
    if precision is not None:
        if _precision.resolve(precision, flax_model) is not recorded:
            raise ValueError(f"precision={precision!r}: the trace {found.path} was recorded in {recorded.name}; "
                             "a trace is judged at its own precision (record another for another)")
        return recorded
    own = _precision.of_model(flax_model)
    if own is not recorded:
        raise ValueError(f"the Flax model computes in {own.name} and the trace {found.path} was recorded in "
                         f"{recorded.name}: record it with precision={own.short!r}, or give precision="
                         f"{recorded.short!r} to judge this model by the trace's rule")
    return recorded


def weights_differ(found: trace.Trace, flax_model, pairs=()) -> list[str]:
    """The keys whose weights differ from the trace's ("NAME", "NAME (why)"), [] when every one matches:
    each torch parameter (any key of a tied tensor) must be in the Flax model under its renamed name
    with the same float32 values (sha256); a torch buffer is compared where the Flax model holds it;
    a Flax parameter no torch key names differs too."""
    from flax_transformer.interop import porting

    try:
        ours = porting.state_dict(flax_model)
    except (TypeError, ValueError) as error:
        first = (str(error).strip().splitlines() or [""])[0]
        return [f"(not checked: the Flax model's parameters cannot be named as torch's: {first})"]
    entry = found.index["model"]
    groups = {key: group for group in found.model.tied for key in group}
    differ, seen = [], set()

    def compare(name, recorded, key):
        seen.add(key)
        value = ours[key]
        if list(value.shape) != recorded["shape"]:
            differ.append(f"{name} (shape {list(value.shape)}, the trace's {recorded['shape']})")
        elif trace.weight_hash(value) != recorded["sha256"]:
            differ.append(name)

    for name, recorded in entry["parameters"].items():
        keys = [apply_rename(k, pairs) for k in groups.get(name, (name,))]
        held = [k for k in keys if k in ours]
        if not held:
            differ.append(f"{name} (not in the Flax model{'' if pairs else '; rename=?'})")
            continue
        compare(name, recorded, apply_rename(name, pairs) if apply_rename(name, pairs) in ours else held[0])
    for name, recorded in entry["buffers"].items():
        if (key := apply_rename(name, pairs)) in ours:
            compare(name, recorded, key)
    differ += [f"{key} (only in the Flax model)" for key in ours if key not in seen]
    return differ
