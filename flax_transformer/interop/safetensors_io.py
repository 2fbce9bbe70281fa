"""Checkpoint files read and written one tensor at a time: safetensors (single or sharded), torch pickles.

A checkpoint larger than you want to copy is never held twice on the host:

* reading, ``open_weights`` gives every tensor as a ``Lazy`` (its shape and dtype from the
  file's header, its data read when asked, from the memory-mapped file, which is opened
  for that one read and closed again); ``fill`` checks every name and shape against the
  model first (all or nothing, as ``porting.load_state_dict``) and then reads, converts
  and places the tensors one by one, each straight onto its devices when a sharding is
  given (``jax.device_put(array, sharding)``);
* writing, ``write_safetensors`` writes the header from the shapes alone and then each
  tensor's bytes as it is read off the model; ``write_checkpoint`` splits the tensors
  into shards of at most ``max_shard_size`` bytes with a ``model.safetensors.index.json``,
  as transformers' ``save_pretrained`` does.

So peak host memory is the model plus one tensor (the largest), plus the interpreter and
libraries (``bench/memory.py`` measures it). Torch pickles cannot be read piecewise
and are read whole, only with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from flax_transformer.models.state_dict_errors import StateDictError, read_weights_entry

# safetensors' dtype codes <-> numpy (bfloat16 and the float8s are ml_dtypes')
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _numpy_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, None) or name)


class Lazy:
    """A tensor known by its shape and dtype, whose data is read only by ``read()``.

    ``rows(start, stop)`` is a lazy slice along the first axis (read alone from a
    safetensors file); ``astype`` a lazy cast.
    """

    def __init__(self, shape, dtype, read, read_rows=None):
        self.shape, self.dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        self._read, self._read_rows = read, read_rows

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def read(self) -> np.ndarray:
        array = np.asarray(self._read())
        if array.shape != self.shape or array.dtype != self.dtype:
            raise ValueError(f"a tensor read back as {array.dtype}{list(array.shape)}, its header says "
                             f"{self.dtype}{list(self.shape)} (the file changed while it was read?)")
        return array

    @property
    def reads_rows(self) -> bool:
        """Whether ``rows`` reads only its rows (from a safetensors file), not the whole tensor."""
        return self._read_rows is not None

    def rows(self, start: int, stop: int) -> Lazy:
        if self._read_rows is not None:
            return Lazy((stop - start, *self.shape[1:]), self.dtype, lambda: self._read_rows(start, stop))
        return Lazy((stop - start, *self.shape[1:]), self.dtype, lambda: self.read()[start:stop])

    def astype(self, dtype) -> Lazy:
        return Lazy(self.shape, dtype, lambda: self.read().astype(dtype))

    def __repr__(self):
        return f"Lazy({self.dtype}{list(self.shape)})"


def read(value) -> np.ndarray:
    """A ``Lazy`` read, or an array as it is."""
    return value.read() if isinstance(value, Lazy) else np.asarray(value)


# ------------------------------------------------------------------ reading


def _raw_reader(file: str, name: str, dtype: np.dtype, shape: tuple):
    """(read whole, read rows) of a float8 tensor (not in safetensors' numpy reader): its bytes, as ml_dtypes'."""
    def read_rows(start, stop):
        with open(file, "rb") as f:
            begin = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))[name]["data_offsets"][0] + f.tell()
            row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
            f.seek(begin + start * row)
            return np.frombuffer(f.read((stop - start) * row), dtype).reshape(stop - start, *shape[1:])
    return (lambda: read_rows(0, shape[0]) if shape else read_rows(0, 1).reshape(())), read_rows


def open_safetensors(file) -> dict[str, Lazy]:
    """Every tensor of a safetensors file as a ``Lazy`` (the header is read and checked now)."""
    from safetensors import SafetensorError, safe_open

    file = str(file)

    def reader(name):
        def read_all():
            try:
                with safe_open(file, framework="np") as f:
                    return f.get_tensor(name)
            except SafetensorError as error:
                raise ValueError(f"{file}: cannot read {name}: {error}") from None

        def read_rows(start, stop):
            try:
                with safe_open(file, framework="np") as f:
                    return f.get_slice(name)[start:stop]
            except SafetensorError as error:
                raise ValueError(f"{file}: cannot read {name}: {error}") from None
        return read_all, read_rows

    out = {}
    try:
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                code = piece.get_dtype()
                if code not in _DTYPES:
                    raise ValueError(f"{file}: tensor {name} has dtype {code}, which numpy cannot hold")
                dtype, shape = _numpy_dtype(_DTYPES[code]), tuple(piece.get_shape())
                readers = _raw_reader(file, name, dtype, shape) if code.startswith("F8") else reader(name)
                out[name] = Lazy(shape, dtype, *readers)
    except SafetensorError as error:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupted?): {error}") from None
    return out


def read_torch_pickle(file: Path) -> dict[str, np.ndarray]:
    import pickle

    import torch

    from flax_transformer.interop.values import to_numpy

    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"refusing to load {file}: torch.load(weights_only=True) rejected it, so unpickling it would run "
            f"code from the file. Convert it to safetensors where you trust it. ({str(error).splitlines()[0]})"
        ) from None
    except Exception as error:  # a corrupted pickle fails in many ways (KeyError, IndexError, EOFError...)
        raise ValueError(f"{file} is not a readable torch checkpoint (truncated or corrupted?): "
                         f"{type(error).__name__}: {error}") from None
    state = read_weights_entry(state, file)  # a training checkpoint's model/state_dict entry, with a warning
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{file} does not hold a state_dict (a mapping of names to tensors)")
    return {k: to_numpy(v) for k, v in state.items()}


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded-checkpoint index: tensor name -> shard file in the same folder."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a sharded-checkpoint index (not valid JSON: {error})") from None
    if not isinstance(index, dict) or "weight_map" not in index:
        raise ValueError(f"{path} is not a sharded-checkpoint index (a JSON object with a 'weight_map')")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{path}: 'weight_map' must map tensor names to shard file names, "
                         f"got {type(weight_map).__name__}")
    for shard in sorted(set(weight_map.values())):
        # a shard lies in the index's folder: no absolute path, no '..'
        if not shard or "\\" in shard or "\x00" in shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise ValueError(f"{path}: shard {shard!r} is not a file name in the index's own folder")
        if Path(shard).suffix not in (".safetensors", ".bin", ".pt", ".pth"):
            raise ValueError(f"{path}: shard {shard!r} is not a .safetensors or torch (.bin/.pt/.pth) file")
        if not (path.parent / shard).is_file():
            listed = [k for k, v in weight_map.items() if v == shard]
            raise MissingShard(f"{path}: shard {shard!r} does not exist in {path.parent} (the index lists "
                               f"{_names(listed)} in it)")
    return weight_map


class ShardError(ValueError):
    """A sharded checkpoint whose shards and index disagree: refused, because transformers would read
    another set of values than the index says (see ``check_shards``)."""


class MissingShard(ShardError, FileNotFoundError):
    """The index names a shard that is not in its folder (transformers fails on it too)."""


def _names(names: list[str], most: int = 5) -> str:
    """``a, b, c`` (and ``N more``): a list of tensor names short enough for one line."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _shard_pattern(index: Path) -> re.Pattern:
    """The names transformers gives the shards of ``index``: ``model-00001-of-00003.safetensors`` for
    ``model.safetensors.index.json``, ``pytorch_model-00001-of-00002.bin`` for ``pytorch_model.bin.index.json``."""
    stem, ext = _split_ext(index.name[: -len(".index.json")])
    return re.compile(re.escape(stem) + r"-\d+-of-\d+" + re.escape(ext))


def _split_ext(name: str) -> tuple[str, str]:
    suffix = Path(name).suffix
    return (name[: -len(suffix)], suffix) if suffix else (name, "")


def check_shards(index: Path, weight_map: dict[str, str], held: dict[str, set[str]]) -> None:
    """Refuse (``ShardError``, one line) a sharded checkpoint whose files say something else than its index.

    transformers 5 (``modeling_utils.PreTrainedModel._load_pretrained_model``, with the shard list of
    ``utils.hub.get_checkpoint_shard_files``) opens the shards the index names, in sorted order, and
    merges *every* tensor of each into one dict: the index says which files to open, not which copy
    of a tensor to take. So a tensor in two shards takes the copy of the last shard in name order,
    whatever the index says; a tensor in a listed shard loads even where the index lists it in
    another shard or not at all; a tensor the index lists but its shard lacks is missing (newly
    initialised, with a warning); a shard the index does not name is never opened. This reader
    refuses each of those instead of taking one side, so that what it loads is what both the index
    and transformers say. ``held``: {shard file: the tensor names in it}.
    """
    where: dict[str, list[str]] = {}
    for shard in sorted(held):
        for key in held[shard]:
            where.setdefault(key, []).append(shard)
    problems = []
    for key in sorted(where):
        found, listed = where[key], weight_map.get(key)
        says = f"the index lists it in {listed}" if listed else "the index does not list it"
        if len(found) > 1:
            problems.append(f"{key} is in {len(found)} shards, {' and '.join(found)} ({says}; transformers "
                            f"would take the copy in {found[-1]})")
        elif found[0] != listed:
            lacks = ", which does not hold it" if listed else ""
            problems.append(f"{key} is in {found[0]}, but {says}{lacks} (transformers would load it from {found[0]})")
    for key in sorted(set(weight_map) - set(where)):
        problems.append(f"the index lists {key} in {weight_map[key]}, which does not hold it (transformers would "
                        "initialise it at random)")
    named = set(weight_map.values())
    pattern = _shard_pattern(index)
    strays = sorted(p.name for p in index.parent.iterdir() if pattern.fullmatch(p.name) and p.name not in named)
    for stray in strays:
        problems.append(f"shard {stray} is not in the index (transformers would not read it; it holds "
                        f"{_names(sorted(_stray_keys(index.parent / stray)))})")
    if problems:
        more = f" (and {len(problems) - 3} more problems)" if len(problems) > 3 else ""
        raise ShardError(f"{index}: the shards do not match the index: {'; '.join(problems[:3])}{more}; "
                         "refusing to guess which values are meant")


def _stray_keys(file: Path) -> list[str]:
    try:
        return list(open_weights(file))
    except (OSError, ValueError):
        return ["unreadable tensors"]


def open_weights(path) -> dict:
    """Every tensor of a checkpoint file or HF folder: a ``Lazy`` for safetensors, else a numpy array.

    Files: ``.safetensors``; ``.bin``/``.pt``/``.pth`` (torch, ``weights_only=True``);
    ``*.index.json`` (sharded, either kind). A folder: the first of ``WEIGHT_FILES``.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint: {path}")
    if path.is_dir():
        for name in WEIGHT_FILES:
            if (path / name).is_file():
                return open_weights(path / name)
        raise FileNotFoundError(f"{path} holds no weights (model.safetensors, pytorch_model.bin or a sharded index)")
    if path.name.endswith(".index.json"):  # every shard's tensors where the index says, and nowhere else
        weight_map = read_index(path)
        parts = {shard: open_weights(path.parent / shard) for shard in sorted(set(weight_map.values()))}
        check_shards(path, weight_map, {shard: set(part) for shard, part in parts.items()})
        return {k: v for part in parts.values() for k, v in part.items()}
    if path.suffix == ".safetensors":
        return open_safetensors(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        return read_torch_pickle(path)
    raise ValueError(f"unknown checkpoint format: {path} (expected .safetensors, .bin/.pt/.pth or *.index.json)")


# ------------------------------------------------------------------ a model's tensors


def _torch_names(model) -> dict[str, tuple]:
    """{flax path: (torch name, layout rule, Param)} of every parameter of a flax_transformer model, as
    ``porting`` places them (the family's table, then each module's type: GPT-OSS's experts and Mixtral's
    share a path; a parameter of no layer, such as attention sinks, keeps its name)."""
    from flax_transformer.interop import porting

    family, out = porting.family_of(model), {}
    plan = porting.plan_of(model)
    for path, param in plan.params.items():
        slots = plan.slots[path]
        if len(slots) != 1:
            raise StateDictError(unexpected=[f"{path} (placed two ways by the {family!r} table: "
                                             f"{', '.join(s.torch_key for s in slots)})"])
        out[path] = (slots[0].torch_key, slots[0].rule, param)
    return out


def model_tensors(model) -> dict[str, Lazy]:
    """A flax_transformer or torch_reference model's parameters under torch names and layouts, as
    ``Lazy``s: each is copied to the host (and transposed) only when read."""
    from flax_transformer.interop.layer_kinds import to_torch, torch_shape
    from flax_transformer.interop.values import to_numpy

    if type(model).__module__.startswith("torch_reference"):
        return {k: Lazy(tuple(v.shape), to_numpy(v.detach().reshape(-1)[:0]).dtype,
                        lambda v=v: to_numpy(v)) for k, v in model.state_dict().items()}
    return {key: Lazy(torch_shape(rule, tuple(param.shape)), np.dtype(param.dtype),
                      lambda p=param, r=rule: np.ascontiguousarray(to_torch(r, np.asarray(p[...]))))
            for key, rule, param in _torch_names(model).values()}


def _placement(sharding, path: str, shape: tuple, dtype):
    """The ``jax.sharding.Sharding`` of the parameter at ``path`` (None: JAX's default device)."""
    import jax

    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        return sharding
    if isinstance(sharding, jax.sharding.Mesh):  # as training places it: experts over "expert", FSDP over "fsdp"
        from jax.sharding import NamedSharding

        from flax_transformer.interop.placement import param_spec

        return NamedSharding(sharding, param_spec(path, jax.ShapeDtypeStruct(shape, dtype), dict(sharding.shape)))
    if callable(sharding):
        return sharding(path, shape)
    raise TypeError(f"sharding must be a jax.sharding.Sharding, a Mesh or a function (path, shape) -> Sharding, "
                    f"got {type(sharding).__name__}")


def fill(model, state: dict, *, sharding=None) -> None:
    """Load torch-named tensors (``Lazy`` or arrays) into a model built with ``targets.build_unfilled``.

    Every name and shape is checked first, from the headers alone; missing, unexpected and
    mis-shaped keys are raised together (``StateDictError``). Then each tensor is read,
    changed to the model's layout, checked (``values.check_value``), cast to its
    parameter's dtype and put on its devices, one at a time: the host never holds more
    than one tensor besides the model. A failure part-way leaves a model that nobody
    holds (``from_pretrained`` returns nothing), so the load stays all or nothing.

    Args:
        sharding: None (JAX's default device), one ``Sharding`` for every parameter, a
            ``Mesh`` (each parameter placed as training places it, ``placement.param_spec``:
            a mixture's experts over its "expert" axis, FSDP over "fsdp"), or a function
            ``(flax path, shape) -> Sharding``. Experts split over "expert" from a file whose
            tensors read by rows (a safetensors file holding the fused experts) are read
            block by block, each process reading only its own devices' experts; per-expert
            files (transformers' layout, stacked by ``hf_tables``) are read whole, then placed.
    """
    import jax
    import jax.numpy as jnp

    from flax_transformer.interop import values
    from flax_transformer.interop.layer_kinds import to_flax, torch_shape
    from flax_transformer.interop.placement import is_expert_tensor, put_by_rows, splits_first_axis

    by_name = {key: (path, rule, param) for path, (key, rule, param) in _torch_names(model).items()}
    plan, seen, unexpected, mismatched = [], set(), [], []
    for key, value in state.items():
        if key not in by_name:
            unexpected.append(key)
            continue
        path, rule, param = by_name[key]
        seen.add(key)
        shape, expected = tuple(np.shape(value)), torch_shape(rule, tuple(param.shape))  # both in torch's layout
        if shape != expected:
            mismatched.append((key, shape, expected))
            continue
        dtype = np.dtype(value.dtype)
        if not (np.issubdtype(dtype, np.integer) or jnp.issubdtype(dtype, jnp.floating)):
            raise TypeError(f"state_dict[{key!r}] has dtype {dtype}; parameters take real numbers; nothing was loaded")
        plan.append((key, path, rule, param, value))
    missing = [key for key in by_name if key not in seen]
    if missing or unexpected or mismatched:
        raise StateDictError(missing, unexpected, mismatched)
    # every placement before any read: a mesh that cannot place a tensor is refused with nothing read
    placements = [_placement(sharding, path, tuple(param.shape), np.dtype(param.dtype))
                  for key, path, rule, param, value in plan]
    for (key, path, rule, param, value), placement in zip(plan, placements, strict=True):
        if isinstance(value, Lazy) and value.reads_rows and is_expert_tensor(path) and splits_first_axis(placement):
            # experts' layout keeps the expert axis first (layer_kinds "experts": "e out in" -> "e in out")
            def block(start, stop, key=key, rule=rule, value=value, dtype=param.dtype):
                array = to_flax(rule, value.rows(start, stop).read())
                values.check_value(key, array, dtype)
                return np.asarray(array, dtype=dtype)
            param.set_value(put_by_rows(tuple(param.shape), placement, block))
            del value
            continue
        array = to_flax(rule, read(value))
        values.check_value(key, array, param.dtype)
        array = np.asarray(array, dtype=param.dtype)  # host-side cast: one tensor (e.g. bf16 file -> fp32)
        if placement is None:
            param.set_value(jnp.array(array))  # a copy: jnp.asarray may alias a caller's numpy array on CPU
        elif jax.process_count() == 1:
            param.set_value(jax.device_put(array, placement))
        else:  # every process reads the same file; each puts the slices its own devices hold
            param.set_value(jax.make_array_from_process_local_data(placement, array, array.shape))
        del array, value


# ------------------------------------------------------------------ writing

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30}


def parse_size(size) -> int:
    """Bytes from an int or transformers' ``max_shard_size`` spelling: "500MB", "2GB", "1.5GiB"."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be a number of bytes or a size such as '500MB', got {size!r}")
    if isinstance(size, (int, np.integer)):
        value = int(size)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"max_shard_size {size!r}: expected bytes or a size such as '500MB', '2GB', '1GiB'")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size!r}")
    return value


def write_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """A safetensors file written tensor by tensor: the header from the shapes, then each tensor's
    bytes as it is read (``Lazy``) or given. The format is safetensors' own: an 8-byte little-endian
    header length, the JSON header (padded to 8 bytes), the data in header order."""
    header, offset = {}, 0
    codes = {v: k for k, v in _DTYPES.items()}
    for name, value in tensors.items():
        dtype = np.dtype(value.dtype)
        if dtype.name not in codes:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors code")
        size = int(np.prod(np.shape(value), dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": codes[dtype.name], "shape": list(np.shape(value)), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, value in tensors.items():
            array = np.ascontiguousarray(read(value))
            if array.shape != tuple(header[name]["shape"]) or array.dtype != np.dtype(value.dtype):
                raise ValueError(f"{name}: read as {array.dtype}{list(array.shape)}, declared "
                                 f"{value.dtype}{header[name]['shape']}")
            f.write(array.reshape(-1).view(np.uint8).data)
            del array


def shard(tensors: dict, max_shard_size) -> list[dict]:
    """Tensors in order, a new shard whenever the next one would pass ``max_shard_size`` bytes (a
    tensor larger than that gets a shard of its own), as transformers shards."""
    limit, shards, size = parse_size(max_shard_size), [{}], 0
    for name, value in tensors.items():
        nbytes = int(np.prod(np.shape(value), dtype=np.int64)) * np.dtype(value.dtype).itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += nbytes
    return shards


def write_checkpoint(tensors: dict, folder, *, max_shard_size=None, metadata: dict | None = None) -> list[str]:
    """``model.safetensors``, or with ``max_shard_size`` shards ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``) when more than one
    is needed, in ``folder`` (a temporary folder that ``files.write_dir`` swaps in). Returns the names."""
    folder = Path(folder)
    shards = [tensors] if max_shard_size is None else shard(tensors, max_shard_size)
    if len(shards) == 1:
        write_safetensors(tensors, folder / "model.safetensors", metadata)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, part in zip(names, shards):
        write_safetensors(part, folder / name, metadata)
        weight_map |= {k: name for k in part}
        total += sum(int(np.prod(np.shape(v), dtype=np.int64)) * np.dtype(v.dtype).itemsize for v in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [*names, "model.safetensors.index.json"]
