"""A recorded trace: torch's side of ``bisect``, written where torch runs, read where it does not.

``record(torch_model, args, path)`` runs the torch model as ``bisect`` does (a float64 copy, the
reference, and the model at ``precision``: itself in float32, a ``torch.bfloat16`` copy for bf16)
and writes what ``bisect`` needs of torch to ``path``: every submodule call's label, kind and
parameter names, the reference run's inputs and outputs, the low-precision run's outputs, and the
module rerun alone at that precision on the reference's input (``bisect``'s "rerun alone", torch's
half); the model's inputs and outputs; every parameter's sha256; with ``grads=True`` every
parameter's gradient in both runs and the weights W of the scalar differentiated; the versions
and the device. ``trace_bisect.bisect(path, flax_model)`` (and ``bisect.bisect(path, flax_model)``)
bisects a Flax model against it with no torch installed.

The format (``VERSION`` 1) is a folder:

* ``trace.json``: the index (``docs/traces.md`` lists its fields);
* ``tensors-00001.safetensors``, ...: the tensors, by key (``t0``, ``t1``, ...; a tensor recorded
  twice, the output of one module and the input of the next, is written once), in shards of at most
  ``max_shard_size`` bytes, written as the calls return, so the trace is never whole in memory.

The folder is written under a temporary name and swapped in (``files.write_dir``). ``read`` checks
the index and every shard (its size and sha256) before a value is read, and reads values lazily.

torch is imported only inside ``record`` (this is a verification module).
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flax_transformer.interop import files, safetensors_io
from flax_transformer.verification import capture, frameworks, measure
from flax_transformer.verification import precision as _precision

FORMAT = "flax-transformer-trace"
VERSION = 1
INDEX = "trace.json"
MAX_SHARD_SIZE = "128MB"


# ---------------------------------------------------------------- writing


class _Shards:
    """Tensors written shard by shard: ``put`` returns a tensor's key; a shard is flushed once it holds
    ``limit`` bytes. A value seen before (same dtype, shape and bytes) gets its first key."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = folder, limit
        self.pending: dict[str, np.ndarray] = {}
        self.size, self.where, self.shards, self.seen = 0, {}, {}, {}

    def put(self, array: np.ndarray) -> str:
        array = np.require(array, requirements="C")  # a 0-d array stays 0-d
        digest = hashlib.blake2b(array.reshape(-1).view(np.uint8).data, digest_size=16)
        digest.update(f"{array.dtype.name}{array.shape}".encode())
        if (key := self.seen.get(digest.digest())) is not None:
            return key
        key = self.seen[digest.digest()] = f"t{len(self.seen)}"
        self.pending[key] = array
        self.size += array.nbytes
        if self.size >= self.limit:
            self.flush()
        return key

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"tensors-{len(self.shards) + 1:05d}.safetensors"
        files.save_safetensors_file(self.pending, self.folder / name, {"format": FORMAT})
        self.shards[name] = {"bytes": (self.folder / name).stat().st_size,
                             "sha256": files.sha256_file(self.folder / name)}
        self.where |= dict.fromkeys(self.pending, name)
        self.pending, self.size = {}, 0


def _numpy(tensor) -> np.ndarray:
    """A torch tensor as numpy at its own precision (bfloat16 as ml_dtypes' bfloat16, bit for bit)."""
    import ml_dtypes
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _tree(x, shards: _Shards):
    """A call's inputs (nested tuples, lists, dicts) as JSON: tensors by key, other leaves by value."""
    if frameworks.is_torch(x) or isinstance(x, np.ndarray):
        return {"tensor": shards.put(_numpy(x) if frameworks.is_torch(x) else x)}
    if isinstance(x, (tuple, list)):
        return {"tuple" if isinstance(x, tuple) else "list": [_tree(i, shards) for i in x]}
    if isinstance(x, dict):
        return {"dict": {str(k): _tree(v, shards) for k, v in x.items()}}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"value": x}
    return {"object": repr(x)[:200]}


def _outputs(out, shards: _Shards) -> dict:
    """{path: leaf} of an output (``frameworks.flatten``): a tensor by key, a cache set aside by why."""
    found = {}
    for path, leaf in frameworks.flatten(out):
        if frameworks.is_torch(leaf):
            found[path] = {"tensor": shards.put(_numpy(leaf))}
        elif isinstance(leaf, frameworks.SetAside):
            found[path] = {"set_aside": leaf.why}
        else:
            found[path] = _tree(leaf, shards)
    return found


def _floats(out, shards: _Shards) -> dict:
    """{path: key} of an output's floating tensors."""
    return {p: shards.put(_numpy(v)) for p, v in frameworks.flatten(out)
            if frameworks.is_torch(v) and v.is_floating_point()}


def _finite(tree) -> bool:
    return all(bool(v.isfinite().all()) for _, v in frameworks.flatten(tree)
               if frameworks.is_torch(v) and v.is_floating_point())


def _hash(tensor) -> dict:
    """sha256 of a tensor's float32 values (little-endian bytes), with its own dtype and shape."""
    import torch

    values = np.ascontiguousarray(tensor.detach().cpu().to(torch.float32).numpy(), "<f4")
    return {"sha256": hashlib.sha256(values.view(np.uint8).data).hexdigest(),
            "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}


def weight_hash(values) -> str:
    """sha256 of an array's float32 values, as ``record`` hashes torch's: what a Flax model's weights are checked by."""
    values = np.ascontiguousarray(np.asarray(values, np.float32), "<f4")
    return hashlib.sha256(values.view(np.uint8).data).hexdigest()


def environment(device) -> dict:
    """Where a trace was recorded: versions, the device and its float32 matmul settings."""
    import importlib.metadata
    import importlib.util

    import torch

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    env = {"library": version("flax-transformer"), "python": platform.python_version(),
           "platform": platform.platform(), "torch": torch.__version__, "numpy": np.__version__,
           "jax": version("jax") if importlib.util.find_spec("jax") else None,
           "device": str(device), "device_name": "cpu",
           "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if device.type == "cuda":
        env |= {"device_name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32)}
    return env


def record(torch_model, args, path, kwargs=None, *, grads: bool = False, seed: int = 0, precision="fp32",
           loss_fn=None, overwrite: bool = False, max_shard_size=MAX_SHARD_SIZE) -> Path:
    """Run ``torch_model`` on ``args``/``kwargs`` (numpy or torch; floats as float32) as ``bisect`` does and
    write its trace to the folder ``path`` (the module docstring). ``precision``: the run judged
    ("fp32"/"float32" or "bf16"/"bfloat16"), the Flax model's to bisect later. ``grads=True`` records
    every parameter's gradient of ``loss_fn(outputs)`` (torch's function, or the first of a pair),
    else of ``sum_i <output_i, W_i>`` with ``frameworks.default_weights(outputs, seed)``, as ``bisect``.
    An existing ``path`` is replaced only with ``overwrite``. Returns the path."""
    import torch

    rule = _precision.resolve(precision, None) if precision is not None else _precision.FP32
    torch_fn, _ = frameworks.split_loss_fn(loss_fn)
    limit = safetensors_io.parse_size(max_shard_size)
    if not hasattr(torch_model, "named_modules"):
        raise TypeError(f"record takes a torch nn.Module, got {type(torch_model).__name__}")
    files.check_target(path, kind="dir", overwrite=overwrite)  # before any work
    kwargs = dict(kwargs or {})
    param = next(iter(torch_model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    args, kwargs = measure.fp32_inputs(tuple(args)), measure.fp32_inputs(kwargs)
    t_args = tuple(_to(frameworks.to_torch(a), device) for a in args)
    t_kwargs = {k: _to(frameworks.to_torch(v), device) for k, v in kwargs.items()}
    torch_model.eval()

    def write(folder: Path) -> None:
        shards = _Shards(folder, limit)
        index = {"format": FORMAT, "version": VERSION, "precision": rule.name, "seed": seed, "grads": grads,
                 "loss_fn": torch_fn is not None, "environment": environment(device),
                 "inputs": {"args": _tree(t_args, shards), "kwargs": _tree(t_kwargs, shards)},
                 "model": _model_entry(torch_model)}
        low = torch_model if rule is _precision.FP32 else measure.torch_copy(torch_model, rule.torch_dtype())
        reference = measure.torch_copy(torch_model, torch.float64)
        calls, t_out = _calls(low, reference, t_args, t_kwargs, rule.torch_dtype(), shards)
        index["calls"], index["output"] = calls, _outputs(t_out, shards)
        if grads:
            index["gradients"] = _gradients(low, reference, t_args, t_kwargs, t_out, seed, torch_fn, rule, shards)
        shards.flush()
        index["tensors"], index["shards"] = shards.where, shards.shards
        (folder / INDEX).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")

    return files.write_dir(path, write, overwrite=overwrite)


def _to(x, device):
    return x.to(device) if frameworks.is_torch(x) else x


def _model_entry(torch_model) -> dict:
    from flax_transformer.interop import porting

    params = dict(torch_model.named_parameters(remove_duplicate=False))
    return {"class": type(torch_model).__name__,
            "parameters": {k: _hash(v) for k, v in params.items()},
            "distinct": [k for k, _ in torch_model.named_parameters()],
            "buffers": {k: _hash(v) for k, v in torch_model.named_buffers()},
            "tied": [list(g) for g in porting.tied_keys(torch_model)]}


def _calls(low, reference, t_args, t_kwargs, dtype, shards: _Shards) -> tuple[list[dict], object]:
    """Both runs, each call written as it returns: the low run's outputs first, then the reference's
    inputs and outputs and the low module rerun alone on them. Returns (the calls, the low run's output)."""
    import torch

    entries: dict[str, dict] = {}
    order: list[str] = []  # the reference run's labels, in the order its calls returned

    def run(model, dtype, hook):
        counts: dict[str, int] = {}

        def make(path):
            def on_return(module, hook_args, hook_kwargs, output):
                k = counts[path] = counts.get(path, -1) + 1
                hook(capture.label(path, k), path, module, hook_args, hook_kwargs, output)
            return on_return

        handles = [m.register_forward_hook(make(p), with_kwargs=True) for p, m in model.named_modules()]
        try:
            with torch.no_grad():
                return model(*measure.cast(t_args, dtype), **measure.cast(t_kwargs, dtype))
        finally:
            for h in handles:
                h.remove()

    def on_low(label, path, module, hook_args, hook_kwargs, output):
        entries[label] = {"label": label, "path": path, "kind": type(module).__name__,
                          "parameters": [k for k, _ in module.named_parameters()],
                          "low": _floats(output, shards),
                          "produced": _finite((hook_args, hook_kwargs)) and not _finite(output)}

    low_modules = dict(low.named_modules())

    def on_reference(label, path, module, hook_args, hook_kwargs, output):
        entry = entries.setdefault(label, {"label": label, "path": path, "kind": type(module).__name__,
                                           "parameters": [k for k, _ in module.named_parameters()],
                                           "low": None, "produced": False})
        entry |= {"args": _tree(hook_args, shards), "kwargs": _tree(hook_kwargs, shards),
                  "reference": _floats(output, shards), "rerun": None}
        try:  # torch's half of bisect's "rerun alone": the low module on the reference's input
            rerun = low_modules[path](*measure.cast(hook_args, dtype), **measure.cast(hook_kwargs, dtype))
            entry["rerun"] = list(_floats(rerun, shards).values())
        except Exception as error:  # noqa: BLE001 - a module that cannot run alone: no rerun, said why
            entry["rerun_error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        order.append(label)

    out = run(low, dtype, on_low)
    run(reference, torch.float64, on_reference)
    return [entries[label] for label in order], out


def _gradients(low, reference, t_args, t_kwargs, t_out, seed, torch_fn, rule, shards: _Shards) -> dict:
    """Every parameter's gradient in the low run and the reference's, written one run at a time."""
    import torch

    weights = {} if torch_fn is not None else frameworks.default_weights(t_out, seed)  # bisect's W
    if torch_fn is None and not weights:
        raise ValueError("grads=True: the torch outputs hold no floating-point array to differentiate; give loss_fn=")
    found = {"weights": {p: shards.put(w) for p, w in weights.items()},
             "paths": [p for p, v in frameworks.flatten(t_out) if v is not None]}
    for name, model, dtype in (("low", low, rule.torch_dtype()), ("reference", reference, torch.float64)):
        _, grads = measure.torch_grads(model, t_args, t_kwargs, weights, torch_fn, dtype)
        found[name] = {k: shards.put(np.asarray(g)) for k, g in grads.items()}
        del grads
    return found


# ---------------------------------------------------------------- reading


@dataclass
class RecordedCall(capture.Call):
    """A torch call read back from a trace; ``produced``: its inputs were finite and its output not."""

    produced: bool | None = None


class RecordedModule:
    """A torch module as a trace knows it: its kind and parameter names (what ``bisect_rows`` asks)."""

    def __init__(self, kind: str, parameters: list[str], buffers: list[str] = ()):
        self.recorded_kind, self._parameters, self._buffers = kind, list(parameters), list(buffers)

    def named_parameters(self, remove_duplicate: bool = True):
        return [(k, None) for k in self._parameters]

    def parameters(self):
        return [None for _ in self._parameters]

    def named_buffers(self):
        return [(k, None) for k in self._buffers]


class RecordedModel(RecordedModule):
    """The whole torch model as a trace knows it: every parameter name (tied ones repeated), one per tensor."""

    def __init__(self, entry: dict):
        super().__init__(entry["class"], list(entry["parameters"]), list(entry["buffers"]))
        self._distinct, self.tied = list(entry["distinct"]), [tuple(g) for g in entry["tied"]]

    def named_parameters(self, remove_duplicate: bool = True):
        return [(k, None) for k in (self._distinct if remove_duplicate else self._parameters)]


class _Calls(Mapping):
    """{label: ``RecordedCall``} of one run, each read from the shards when asked for."""

    def __init__(self, trace: Trace, side: str):
        self.trace, self.side = trace, side
        self.entries = {e["label"]: e for e in trace.index["calls"] if e.get(side) is not None}

    def __getitem__(self, label):
        e = self.entries[label]
        module = RecordedModule(e["kind"], e["parameters"])
        output = frameworks.Flat((p, self.trace.tensor(k)) for p, k in e[self.side].items())
        if self.side == "low":
            return RecordedCall(e["path"], (), {}, output, module, produced=e["produced"])
        args, kwargs = self.trace.tree(e["args"]), self.trace.tree(e["kwargs"])
        return RecordedCall(e["path"], tuple(args), kwargs, output, module)

    def __iter__(self):
        return iter(self.entries)

    def __len__(self):
        return len(self.entries)


class Trace:
    """A trace read back (``read``): the index checked, the values read lazily from the shards."""

    def __init__(self, path: Path, index: dict):
        self.path, self.index = path, index
        self.precision = _precision.PRECISIONS[index["precision"]]
        self.environment: dict = index["environment"]
        self.grads = index.get("gradients") is not None
        self.model = RecordedModel(index["model"])
        self._rerun = {e["label"]: e.get("rerun") for e in index["calls"]}

    def tensor(self, key: str) -> np.ndarray:
        from safetensors import SafetensorError, safe_open

        file = self.path / self.index["tensors"][key]
        try:
            with safe_open(str(file), framework="np") as f:
                return f.get_tensor(key)
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{file}: cannot read tensor {key}: {error}") from None

    def tree(self, node):
        """A recorded input tree (``_tree``) back as numpy arrays and values."""
        if "tensor" in node:
            return self.tensor(node["tensor"])
        if "tuple" in node or "list" in node:
            items = [self.tree(i) for i in node.get("tuple", node.get("list"))]
            return tuple(items) if "tuple" in node else items
        if "dict" in node:
            return {k: self.tree(v) for k, v in node["dict"].items()}
        return node.get("value", node.get("object"))

    def inputs(self) -> tuple[tuple, dict]:
        return tuple(self.tree(self.index["inputs"]["args"])), self.tree(self.index["inputs"]["kwargs"])

    def output(self) -> frameworks.Flat:
        """The low run's output, ``{path: leaf}``: arrays, values, caches as ``SetAside``."""
        return frameworks.Flat((p, frameworks.SetAside(None, v["set_aside"]) if "set_aside" in v else self.tree(v))
                               for p, v in self.index["output"].items())

    def calls(self, side: str) -> Mapping:
        """{label: call} of the "reference" (float64) or "low" run, in the order calls returned."""
        return _Calls(self, side)

    def rerun(self, label: str) -> list[np.ndarray] | None:
        """torch's float outputs of the module at ``label`` rerun alone at the trace's precision."""
        keys = self._rerun.get(label)
        return None if keys is None else [self.tensor(k) for k in keys]

    def gradients(self) -> tuple[dict, dict, dict, tuple[str, ...]]:
        """(low run's gradients, reference's, {output path: W}, torch's output paths not None)."""
        g = self.index["gradients"]
        load = lambda keys: {k: self.tensor(v) for k, v in keys.items()}  # noqa: E731
        return load(g["low"]), load(g["reference"]), load(g["weights"]), tuple(g["paths"])


def read(path, *, verify: bool = True) -> Trace:
    """The trace at ``path`` (a folder ``record`` wrote), its index checked: format and version, every
    shard present, of its recorded size and (``verify``) sha256, every tensor in a listed shard.
    Anything else is a ``ValueError`` naming the file."""
    path = Path(path)
    index_file = path / INDEX
    if not index_file.is_file():
        raise ValueError(f"{path} is not a trace: it has no {INDEX}" if path.is_dir() else f"no trace at {path}")
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{index_file} is not valid JSON (truncated or corrupt?): {error}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{index_file} is not a {FORMAT} index")
    if index.get("version") != VERSION:
        raise ValueError(f"{index_file} is a trace of version {index.get('version')!r}; this library reads "
                         f"version {VERSION} (record it again with this version)")
    missing = [k for k in ("precision", "environment", "inputs", "model", "calls", "output", "tensors", "shards")
               if k not in index]
    if missing or index["precision"] not in _precision.PRECISIONS:
        raise ValueError(f"{index_file} lacks {', '.join(missing) or 'a known precision'}")
    for name, entry in index["shards"].items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"{file}: a shard of the trace is missing")
        if file.stat().st_size != entry["bytes"]:
            raise ValueError(f"{file}: {file.stat().st_size} bytes, the index says {entry['bytes']} (truncated?)")
        if verify and files.sha256_file(file) != entry["sha256"]:
            raise ValueError(f"{file}: its sha256 is not the index's (the file is corrupt)")
    stray = sorted({s for s in index["tensors"].values() if s not in index["shards"]})
    if stray:
        raise ValueError(f"{index_file} places tensors in {', '.join(stray)}, which it does not list")
    return Trace(path, index)
