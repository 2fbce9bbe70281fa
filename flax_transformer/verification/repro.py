"""A minimal reproducer: one module of a pair, alone, in a folder that runs without this library.

``write(directory, torch_model, flax_model, args, report=report)`` takes ``report.first_divergent``
(a ``bisect`` report's module; ``MODEL``: the whole model) or ``path=`` (any torch module path,
``"#k"`` for its k-th call) and writes what someone filing the divergence with JAX, XLA or
PyTorch needs, with only jax, torch and numpy (and ``flatbuffers``, which ``jax.export`` reads
with) installed on their side:

* ``jax_module.jaxexport``: the Flax module's call, jitted with its parameters as arguments,
  serialized by ``jax.export`` (StableHLO; lowered for cpu, cuda, rocm and tpu where it can be);
  ``jax_module.mlir``, the same StableHLO as text, to read;
* ``torch_module.pt2``: the torch module's call, ``torch.export``ed and saved by
  ``torch.export.save`` (a graph and its weights, no pickled classes); where ``torch.export``
  cannot trace the module, the folder has none and the script uses the saved torch output;
* ``flax_weights.npz``, ``torch_weights.npz``: the module's parameters (bfloat16 ones as their
  uint16 bits, listed in ``module.json``); ``inputs.npz``: the inputs it received in the float64
  reference run, cast to float32 (the compute precision) as ``bisect``'s rerun alone does, once in
  each framework's form; ``outputs.npz``: the float64 output and the torch and JAX ones of that rerun;
* ``module.json``: the module's path and class in both frameworks, its constructor arguments
  (the recorded ``init_kwargs`` where it has them, torch's ``extra_repr``, the Flax module's plain
  attributes), ``bisect``'s row, the budget rule, what was measured when it was written, and the
  environment; ``README.txt``: the environment, the command, what the exit codes mean;
* ``repro.py`` (a copy of ``repro_script.py``): runs both modules on the saved inputs, compares
  each with the float64 output, prints the errors and the budget, and exits 1 when JAX's error is
  beyond the budget (the divergence reproduces), 0 when not, 2 when it cannot run.

The rerun is ``bisect``'s "alone" measurement, so a module that ``introduced`` its error
reproduces, and one whose error was ``inherited`` or built up gradually (a ``first_divergent``
with no ``introduced`` row) does not: the reproducer says so rather than exaggerate.
The folder is written under a temporary name and swapped in (``files.write_dir``); the target is
checked before any work (an existing non-empty folder is replaced only with ``overwrite=True``).

torch is imported lazily (this is a verification module).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop import files
from flax_transformer.verification import bisect_rows, capture, frameworks, layouts, measure
from flax_transformer.verification import precision as _precision
from flax_transformer.verification.bisect_report import GRADIENTS, INCOMPLETE, MODEL, BisectReport

SCRIPT = Path(__file__).with_name("repro_script.py")  # copied into the folder as repro.py
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # jax.export lowers for all where the module allows
FORMAT = 1  # module.json's layout


class ReproError(ValueError):
    """No reproducer can be written for this module (or report), and why."""


def target(report: BisectReport | None, path: str | None, flax_path: str | None) -> tuple[str, str]:
    """(torch call label, Flax call label) to reproduce: ``path`` when given, else the report's
    ``first_divergent`` (refused when the report passed, or names no single module)."""
    if (report is None) == (path is None):
        raise ReproError("give report= (its first divergent module) or path= (a torch module path), one of them")
    if path is not None:
        if not isinstance(path, str):
            raise ReproError(f"path= must be a torch module path (a str; '' or {MODEL!r}: the model), got {path!r}")
        label = "" if path == MODEL else path
        return label, label if flax_path is None else flax_path
    if report.first_divergent is None:
        raise ReproError("the report passed: no module diverged, so there is nothing to reproduce "
                         "(write a module's reproducer with path=)")
    if report.first_divergent in (GRADIENTS, INCOMPLETE):
        why = ("only gradients diverged (the forward pass agrees): a module's forward reproducer shows nothing"
               if report.first_divergent == GRADIENTS else "nothing diverged; the report is incomplete")
        raise ReproError(f"first_divergent is {report.first_divergent}: {why}; write a module's reproducer with path=")
    label = report.first_divergent_path
    if label is None:
        raise ReproError(f"first_divergent {report.first_divergent!r} names no module call of the report")
    row = next(r for r in report.rows if r.path == label)
    return label, row.flax_path or label


def check_directory(directory, *, overwrite: bool = False) -> Path:
    """Refuse a target folder before any work (``files.check_target``: its parent must exist; an
    existing non-empty folder only with ``overwrite``); returns its path."""
    return files.check_target(directory, kind="dir", overwrite=overwrite)


def from_report(directory, report: BisectReport, torch_model, flax_model, args, kwargs=None, **options) -> Path | None:
    """``bisect(..., repro=DIR)``: ``write`` the report's first divergent module; None, and nothing
    written, when the report passed or names no single module (``GRADIENTS``, ``INCOMPLETE``)."""
    if report.first_divergent in (None, GRADIENTS, INCOMPLETE):
        return None
    return write(directory, torch_model, flax_model, args, kwargs, report=report, **options)


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _jsonable(value, depth: int = 0):
    """A constructor argument or attribute as JSON: configs (dataclasses) by field, else its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 4:
        return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    try:
        return str(jnp.dtype(value))  # a dtype
    except TypeError:
        return repr(value)


def constructor(torch_module, flax_module) -> dict:
    """What can be read of both modules' constructor arguments: the recorded ``init_kwargs``
    (``RecordsInit``), torch's ``extra_repr`` and the Flax module's plain attributes."""
    def recorded(module):
        reader = getattr(module, "init_kwargs", None)
        return {k: _jsonable(v) for k, v in reader().items()} if callable(reader) else None

    plain = (bool, int, float, str, type(None))
    attributes = {k: _jsonable(v) for k, v in sorted(vars(flax_module).items())
                  if not k.startswith("_") and (isinstance(v, plain) or isinstance(v, tuple)
                                                and all(isinstance(x, plain) for x in v))}
    return {"torch": {"class": _class_name(torch_module), "init_kwargs": recorded(torch_module),
                      "extra_repr": torch_module.extra_repr()},
            "flax": {"class": _class_name(flax_module), "init_kwargs": recorded(flax_module),
                     "attributes": attributes}}


def _stored(a) -> np.ndarray:
    """An array as npz holds it: bfloat16 (no numpy dtype) as its uint16 bits."""
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype == jnp.bfloat16 else a


def _jax_inputs(jax_call, ref_call, channels_last: bool) -> tuple[list, object, list[int]]:
    """(the leaves of the JAX call's arguments, each float array the float64 reference's input to the
    module cast to float32 as ``bisect``'s rerun gives it, their treedef, the indices of the array
    leaves): the arrays are the exported call's inputs, the other leaves (flags) constants of it."""
    given = bisect_rows.jax_inputs(jax_call, ref_call, channels_last)
    if given is None:
        raise ReproError("the torch call's float inputs do not line up with the Flax call's (count or shapes)")
    leaves, treedef = jax.tree.flatten(given)
    return leaves, treedef, [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]


def export_jax(module, leaves, treedef, slots, out_paths):
    """(``jax.export.Exported`` of ``run(weights, inputs) -> [output leaf at each of out_paths]``,
    {weight name: array} in argument order, the inputs): the module's parameters are arguments, its
    other state (buffers, RNG state) and the non-array leaves of its call constants."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    named, weights_def = jax.tree_util.tree_flatten_with_path(params)
    weights = {jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): a for p, a in named}

    def run(weights, inputs):
        full = list(leaves)
        for i, x in zip(slots, inputs, strict=True):
            full[i] = x
        call_args, call_kwargs = treedef.unflatten(full)
        model = nnx.merge(graphdef, jax.tree.unflatten(weights_def, weights), rest)
        out = dict(frameworks.flatten(model(*call_args, **call_kwargs)))
        return [out[p] for p in out_paths]

    inputs = [leaves[i] for i in slots]
    spec = [[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays] for arrays in (weights.values(), inputs)]
    try:
        exported = jax.export.export(jax.jit(run), platforms=PLATFORMS)(*spec)
    except Exception:  # a lowering that one of the platforms lacks: this machine's only
        exported = jax.export.export(jax.jit(run))(*spec)
    return exported, weights, inputs


def _torch_call(torch_module, args, kwargs, out_paths):
    """A torch module taking the call's tensors only (other arguments constants) and returning its
    output leaves at ``out_paths`` as a tuple: what ``torch.export`` traces."""
    import torch
    from torch.utils import _pytree

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch_module
            leaves, self.spec = _pytree.tree_flatten((args, kwargs))
            self.slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
            self.constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            self.inputs = tuple(leaves[i] for i in self.slots)

        def forward(self, *tensors):
            full = list(self.constants)
            for i, t in zip(self.slots, tensors, strict=True):
                full[i] = t
            call_args, call_kwargs = _pytree.tree_unflatten(full, self.spec)
            out = dict(frameworks.flatten(self.module(*call_args, **call_kwargs)))
            return tuple(out[p] for p in out_paths)

    return Call().eval()


def to_torch_layout(a: np.ndarray, how: dict) -> np.ndarray:
    """A JAX output in torch's layout as ``module.json``'s ``outputs`` entry says (the script's rule)."""
    if how.get("axes") is not None:
        a = np.transpose(a, how["axes"])
    if how.get("features") is not None:
        a = np.take(a, how["features"], axis=-1)
    return a


def _layouts(want: list[np.ndarray], got: list, channels_last: bool, heads: int | None) -> list[dict]:
    """How each JAX output goes to torch's layout: the axes (channels last) and the feature order (Meta's RoPE)."""
    out = []
    for w, j in zip(want, got, strict=True):
        how = {"axes": [int(x) for x in np.argsort(layouts.channels_last_axes(j.ndim))]
               if channels_last and j.ndim >= 3 else None, "features": None}
        if heads is not None:
            order = layouts.to_rope_order(np.arange(w.shape[-1]), heads, 0)
            if order is None:
                raise ReproError(f"the output's features are not {heads} heads of RoPE pairs (permutations=)")
            how["features"] = [int(x) for x in order]
        if to_torch_layout(np.zeros(j.shape), how).shape != w.shape:
            raise ReproError(f"the Flax output of shape {tuple(j.shape)} does not match torch's {w.shape}")
        out.append(how)
    return out


def environment() -> dict:
    """Versions and devices the reproducer was written with (README.txt and module.json)."""
    import flax
    import torch

    device = jax.devices()[0]
    return {"python": platform.python_version(), "platform": platform.platform(), "numpy": np.__version__,
            "jax": jax.__version__, "jaxlib": getattr(sys.modules.get("jaxlib"), "__version__", "?"),
            "flax": flax.__version__, "torch": torch.__version__,
            "jax_device": f"{device.platform}: {device.device_kind}", "torch_device": "cpu",
            "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision),
            "torch_float32_matmul_precision": torch.get_float32_matmul_precision()}


def write(directory, torch_model, flax_model, args: tuple, kwargs: dict | None = None, *,
          report: BisectReport | None = None, path: str | None = None, flax_path: str | None = None,
          precision=None, permutations=None, use_jit: bool = True, overwrite: bool = False) -> Path:
    """Write the reproducer folder of one module of the pair (module docstring); returns its path.

    Args:
        directory: the folder to write (checked first: a non-empty one only with ``overwrite``).
        torch_model, flax_model, args, kwargs: the pair and the model inputs, as ``bisect`` takes them.
        report: a ``bisect`` report: its ``first_divergent`` module (``MODEL``: the whole model),
            at the Flax path its row names (``rename=``'s); refused when it passed, or names
            ``GRADIENTS`` or ``INCOMPLETE``.
        path: instead of a report, a torch module path (``"#k"``: its k-th call; ``""`` or ``MODEL``:
            the model); ``flax_path``: its Flax call's label where that differs.
        precision: the budget's (None: the report's, else the Flax model's); ``permutations``:
            ``bisect``'s (the module's outputs compared through Meta's RoPE order).
        use_jit: record the Flax calls under ``nnx.jit`` (as ``bisect``) or eagerly.
    """
    import torch

    directory = check_directory(directory, overwrite=overwrite)  # before any work
    label, flax_label = target(report, path, flax_path)
    rule = _precision.resolve(precision if precision is not None or report is None else report.precision,
                              flax_model)
    permuted = layouts.check_permutations(permutations)
    torch_model.eval()
    flax_model.eval()
    args, kwargs = measure.fp32_inputs(tuple(args)), measure.fp32_inputs(kwargs or {})
    t_args, t_kwargs = tuple(map(frameworks.to_torch, args)), {k: frameworks.to_torch(v) for k, v in kwargs.items()}
    j_args, j_kwargs = tuple(map(frameworks.to_jax, args)), {k: frameworks.to_jax(v) for k, v in kwargs.items()}
    reference = measure.torch_copy(torch_model, torch.float64)
    with torch.no_grad():
        _, ref_calls = capture.torch_calls(reference, measure.cast(t_args, torch.float64),
                                           measure.cast(t_kwargs, torch.float64))
    ref = capture.labelled(ref_calls).get(label)
    if ref is None:
        raise ReproError(f"the torch model has no call {label or MODEL!r} on these inputs")
    _, jax_calls = capture.nnx_calls(flax_model, j_args, j_kwargs, use_jit=use_jit)
    jx = capture.labelled(jax_calls).get(flax_label)
    if jx is None or jx.module is None:
        raise ReproError(f"the Flax model has no call {flax_label or MODEL!r} on these inputs"
                         + ("" if report is not None or flax_path is not None else " (flax_path=?)"))
    low = torch_model if rule is _precision.FP32 else measure.torch_copy(torch_model, rule.torch_dtype())
    torch_module = dict(low.named_modules())[ref.path]
    want_all, flax_all = frameworks.float_leaves(ref.output), frameworks.float_leaves(jx.output)
    pairs, torch_only, flax_only = frameworks.pair_paths(list(want_all), list(flax_all))
    if torch_only or flax_only or not pairs:
        raise ReproError(f"the outputs do not pair up: torch's {list(want_all)} and Flax's {list(flax_all)}")
    channels_last = layouts.channels_last(jx.module)
    leaves, treedef, slots = _jax_inputs(jx, ref, channels_last)
    exported, weights, j_inputs = export_jax(jx.module, leaves, treedef, slots, [j for _, j in pairs])
    blob = exported.serialize()
    j_out = [np.asarray(a) for a in jax.export.deserialize(blob).call(list(weights.values()), j_inputs)]
    want = [want_all[t] for t, _ in pairs]
    how = _layouts(want, j_out, channels_last, layouts.permuted_heads(ref.path, permuted))
    dtype = rule.torch_dtype()
    call = _torch_call(torch_module, measure.cast(ref.args, dtype), measure.cast(ref.kwargs, dtype),
                       [t for t, _ in pairs])
    row = None if report is None else next((r for r in report.rows if r.path == label), None)

    def fill(tmp: Path):
        try:
            torch.export.save(torch.export.export(call, call.inputs), tmp / "torch_module.pt2")
            program, why_not = torch.export.load(tmp / "torch_module.pt2").module(), None
        except Exception as error:  # a module torch.export cannot trace: the saved output stands in
            (tmp / "torch_module.pt2").unlink(missing_ok=True)
            program, why_not = call, f"torch.export failed: {type(error).__name__}: {str(error).splitlines()[0]}"
        with torch.no_grad():
            t_out = [frameworks.to_numpy(t) for t in program(*call.inputs)]
        got_j = [to_torch_layout(a, h) for a, h in zip(j_out, how)]
        torch_err, jax_err, scale = measure.err(t_out, want), measure.err(got_j, want), measure.scale(want)
        limit = rule.budget(torch_err, scale)
        bf16 = sorted({f"flax_weights.npz:{k}" for k, a in weights.items() if a.dtype == jnp.bfloat16}
                      | {f"inputs.npz:jax.{i}" for i, a in enumerate(j_inputs) if a.dtype == jnp.bfloat16})
        np.savez(tmp / "flax_weights.npz", **{k: _stored(a) for k, a in weights.items()})
        np.savez(tmp / "torch_weights.npz", **{k: frameworks.to_numpy(v) for k, v in torch_module.state_dict().items()})
        np.savez(tmp / "inputs.npz", **{f"jax.{i}": _stored(a) for i, a in enumerate(j_inputs)},
                 **{f"torch.{i}": frameworks.to_numpy(t) for i, t in enumerate(call.inputs)})
        np.savez(tmp / "outputs.npz", **{f"float64.{i}": w for i, w in enumerate(want)},
                 **{f"torch.{i}": a for i, a in enumerate(t_out)}, **{f"jax.{i}": _stored(a) for i, a in enumerate(j_out)})
        (tmp / "jax_module.jaxexport").write_bytes(blob)
        (tmp / "jax_module.mlir").write_text(exported.mlir_module())
        measured = {"torch_err": torch_err, "jax_err": jax_err, "scale": scale, "budget": limit,
                    "reproduces": bool(jax_err > limit)}
        spec = {"format": FORMAT, "torch_path": label, "flax_path": flax_label,
                "constructor": constructor(torch_module, jx.module),
                "bisect": None if row is None else dataclasses.asdict(row),
                "rule": rule.rule() | {"formula": rule.formula()},
                "jax": {"weights": list(weights), "inputs": len(j_inputs), "platforms": list(exported.platforms),
                        "torch_dtype": str(dtype).removeprefix("torch.")},
                "torch": {"program": None if why_not else "torch_module.pt2", "why_not": why_not,
                          "inputs": len(call.inputs), "dtype": str(dtype).removeprefix("torch.")},
                "bfloat16": bf16, "outputs": [{"torch": t, "flax": j, **h} for (t, j), h in zip(pairs, how)],
                "measured": measured, "environment": environment()}
        (tmp / "module.json").write_text(json.dumps(spec, indent=1) + "\n")
        (tmp / "repro.py").write_text(SCRIPT.read_text())
        (tmp / "README.txt").write_text(readme(spec))

    return files.write_dir(directory, fill, overwrite=overwrite)


def readme(spec: dict) -> str:
    """README.txt: what the folder holds, the environment it was written in, the command."""
    m, env, row = spec["measured"], spec["environment"], spec["bisect"]
    name = spec["torch_path"] or MODEL
    verdict = ("reproduces: JAX's error is beyond the budget" if m["reproduces"]
               else "does NOT reproduce alone: JAX's error is within the budget on this module's own input")
    lines = [
        f"Reproducer of {name} ({spec['constructor']['torch']['class']} in torch, "
        f"{spec['constructor']['flax']['class']} in Flax at {spec['flax_path'] or MODEL!r})",
        "", "Run it (needs only jax, torch, numpy, and flatbuffers for jax.export):",
        "    pip install jax torch numpy flatbuffers", "    python repro.py",
        "Exit 1: the divergence reproduces (JAX's error against float64 is beyond the budget); 0: it does not;",
        "2: it could not run here (the exported platforms, a missing package).", "",
        f"Budget: {spec['rule']['formula']}, torch_err being torch's own error at {spec['rule']['precision']}.",
        f"When written: JAX {m['jax_err']:.3e}, torch {m['torch_err']:.3e}, budget {m['budget']:.3e}, "
        f"scale {m['scale']:.3e}: {verdict}.",
    ]
    if row is not None:
        lines.append(f"bisect's row: {row['status']} (JAX {row['jax_err']}, torch {row['torch_err']} in the whole model)")
    if spec["torch"]["why_not"]:
        lines.append(f"torch side: no torch_module.pt2 ({spec['torch']['why_not']}); the saved torch output is used")
    lines += ["", "Written with:"] + [f"    {k}: {v}" for k, v in env.items()] + ["", "Files:",
              "    repro.py            the script", "    module.json         paths, classes, constructor arguments, "
              "budget, measurements, environment",
              "    jax_module.jaxexport  the Flax call, jax.export.serialize (StableHLO; weights are arguments)",
              "    jax_module.mlir     the same StableHLO as text",
              "    torch_module.pt2    the torch call, torch.export.save", "    flax_weights.npz, torch_weights.npz, "
              "inputs.npz (the float64 reference's inputs to the module, as float32), outputs.npz (float64, torch, jax)",
              ""]
    return "\n".join(lines)
