"""The ops of converter rows (``converter.Row``), each with its inverse.

An op takes a group's parts, ``{((field, value), ...): tensor}``, and returns the parts after it:
it may close a field (``Stack("e")``: the experts become one tensor), open one (``Split("h")``:
one tensor becomes a slice per head) or change each tensor alone (``Transpose``, ``RopePermute``).
``forward`` goes from the source format to the canonical names, ``inverse`` back. Sizes come from
the ``Context`` (the model's config, or overrides such as ``shards``).

Tensors may be numpy arrays or ``safetensors_io.Lazy``: then the result is a ``Lazy`` too, whose
inputs are read only when it is (a slice along the first axis reads only its rows).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from flax_transformer.interop.converter import SOURCE, OpShapeError
from flax_transformer.interop.safetensors_io import Lazy, read

# ------------------------------------------------------------------ lazy array helpers


def _lazy(inputs, shape, dtype, compute):
    """``compute(*arrays)`` now for arrays, or a ``Lazy`` of ``shape``/``dtype`` if any input is one."""
    if not any(isinstance(v, Lazy) for v in inputs):
        return compute(*[np.asarray(v) for v in inputs])
    return Lazy(shape, dtype, lambda: compute(*[read(v) for v in inputs]))


def _shape(value) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, Lazy) else np.shape(value)


def _dtype(values):
    return np.result_type(*[v.dtype if isinstance(v, Lazy) else np.asarray(v).dtype for v in values])


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise OpShapeError(f"{ndim} axes", f"an axis {axis}")
    return axis % ndim


def concat(values: list, axis: int):
    shapes = [_shape(v) for v in values]
    axis = _axis(axis, len(shapes[0]))
    rest = {s[:axis] + s[axis + 1:] for s in shapes}
    if len(rest) > 1 or len({len(s) for s in shapes}) > 1:
        raise OpShapeError(" / ".join(str(list(s)) for s in shapes), f"equal shapes but for axis {axis}")
    shape = list(shapes[0])
    shape[axis] = sum(s[axis] for s in shapes)
    return _lazy(values, shape, _dtype(values), lambda *a: np.concatenate(a, axis=axis))


def interleave(values: list, axis: int):
    """Rows of the parts in turn along ``axis``: a0, b0, a1, b1, ... (GPT-OSS's gate and up)."""
    shapes = [_shape(v) for v in values]
    axis = _axis(axis, len(shapes[0]))
    if len(set(shapes)) > 1:
        raise OpShapeError(" / ".join(str(list(s)) for s in shapes), "equal shapes")
    shape = list(shapes[0])
    shape[axis] *= len(values)
    return _lazy(values, shape, _dtype(values), lambda *a: np.stack(a, axis=axis + 1).reshape(shape))


def stack(values: list, axis: int):
    shapes = [_shape(v) for v in values]
    if len(set(shapes)) > 1:
        raise OpShapeError(", ".join(f"{i}: {list(s)}" for i, s in enumerate(shapes)), "equal shapes")
    axis = _axis(axis, len(shapes[0]) + 1)
    shape = [*shapes[0][:axis], len(values), *shapes[0][axis:]]
    return _lazy(values, shape, _dtype(values), lambda *a: np.stack(a, axis=axis))


def take(value, axis: int, start: int, stop: int, *, squeeze: bool = False):
    """``value[..., start:stop, ...]`` along ``axis`` (the axis dropped with ``squeeze``)."""
    shape = list(_shape(value))
    axis = _axis(axis, len(shape))
    if isinstance(value, Lazy) and axis == 0:
        part = value.rows(start, stop)
        return Lazy(shape[1:], value.dtype, lambda: part.read()[0]) if squeeze else part
    index = (slice(None),) * axis + ((start,) if squeeze else (slice(start, stop),))
    out_shape = shape[:axis] + ([] if squeeze else [stop - start]) + shape[axis + 1:]
    return _lazy([value], out_shape, _dtype([value]), lambda a: a[index])


def chunks(value, axis: int, count: int, what: str) -> list:
    """``count`` equal slices along ``axis``; a length that ``count`` does not divide is mis-shaped."""
    shape = _shape(value)
    if len(shape) <= (axis if axis >= 0 else -axis - 1) or shape[axis] % count:
        raise OpShapeError(tuple(shape), f"(a multiple of {what}={count}, ...)")
    step = shape[axis] // count
    return [take(value, axis, i * step, (i + 1) * step) for i in range(count)]


def outputs_of(value, compute, shapes, dtypes) -> list:
    """The outputs of one ``compute(array)`` that makes several (blocks and scales of one quantisation):
    arrays now, or ``Lazy``s that read ``value`` and compute once, whichever is read first."""
    if not isinstance(value, Lazy):
        return list(compute(np.asarray(value)))
    memo = []

    def get(i):
        if not memo:
            memo.append(compute(value.read()))
        return memo[0][i]
    return [Lazy(shape, dtype, lambda i=i: get(i)) for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True))]


def each(value, compute, shape=None, dtype=None):
    """``compute(array)`` of one tensor, lazily for a ``Lazy`` (same shape and dtype unless given)."""
    return _lazy([value], shape or _shape(value), dtype or _dtype([value]), compute)


# ------------------------------------------------------------------ parts


def _by(parts: dict, field: str) -> dict:
    """{the other fields: {value of ``field``: tensor}}."""
    out: dict = {}
    for key, value in parts.items():
        fields = dict(key)
        index = fields.pop(field)
        out.setdefault(tuple(sorted(fields.items())), {})[index] = value
    return out


def _with(key: tuple, field: str, index) -> tuple:
    return tuple(sorted((*key, (field, index))))


class Op:
    """One step of a row: ``closes`` a field going forward, ``opens`` one, or neither."""

    closes: str | None = None
    opens: str | None = None
    size: str | int | None = None  # the Context size of the field it closes or opens (None: read off)

    def fields_after(self, open_: set) -> set:
        return (open_ - {self.closes}) | ({self.opens} if self.opens else set())

    def sizes(self, ctx, forward: bool) -> dict:
        """The number of parts the group must bring for the field this op takes in that direction."""
        field = self.closes if forward else self.opens
        if field is None or self.size is None:
            return {}
        return {field: ctx.size(self.size)}

    def forward(self, parts: dict, ctx) -> dict:
        raise NotImplementedError

    def inverse(self, parts: dict, ctx) -> dict:
        raise NotImplementedError


class Inverted(Op):
    """An op run the other way round: its inverse forward."""

    def __init__(self, op: Op):
        self.op, self.closes, self.opens, self.size = op, op.opens, op.closes, op.size

    def forward(self, parts, ctx):
        return self.op.inverse(parts, ctx)

    def inverse(self, parts, ctx):
        return self.op.forward(parts, ctx)

    def __repr__(self):
        return f"Inverted({self.op!r})"


class Stack(Op):
    """Forward: the parts of ``field`` (experts ``0..E-1``) stacked on a new ``axis``; back: unstacked."""

    def __init__(self, field: str, axis: int = 0, size: str | int | None = None):
        self.closes, self.axis, self.size = field, axis, size

    def forward(self, parts, ctx):
        return {rest: stack([by[i] for i in sorted(by)], self.axis) for rest, by in _by(parts, self.closes).items()}

    def inverse(self, parts, ctx):
        out = {}
        for key, value in parts.items():
            shape = _shape(value)
            n = shape[_axis(self.axis, len(shape))] if shape else None
            want = (ctx.size(self.size) if self.size is not None else None) or n
            if n is None or n != want:
                raise OpShapeError(tuple(shape), f"({want} along axis {self.axis}: {self.size or self.closes})")
            for i in range(n):
                out[_with(key, self.closes, i)] = take(value, self.axis, i, i + 1, squeeze=True)
        return out

    def __repr__(self):
        return f"Stack({self.closes!r}, axis={self.axis})"


class Join(Op):
    """Forward: the parts of ``field`` concatenated along an existing ``axis`` (gate then up, a
    tensor's model-parallel shards), or taken in turn with ``interleave``; back: cut into ``size``
    equal parts. ``size`` defaults to the field's name in the Context (``t``: the row's sources)."""

    def __init__(self, field: str, axis: int = 0, size: str | int | None = None, *, interleave: bool = False):
        self.closes, self.axis, self.size, self.interleave = field, axis, size or field, interleave

    def forward(self, parts, ctx):
        combine = interleave if self.interleave else concat
        return {rest: combine([by[i] for i in sorted(by)], self.axis) for rest, by in _by(parts, self.closes).items()}

    def inverse(self, parts, ctx):
        n, out = ctx.size(self.size, required=True), {}
        for key, value in parts.items():
            if self.interleave:
                shape = list(_shape(value))
                axis = _axis(self.axis, len(shape))
                if shape[axis] % n:
                    raise OpShapeError(tuple(shape), f"(a multiple of {self.size}={n} along axis {axis})")
                step = [*shape[:axis], shape[axis] // n, n, *shape[axis + 1:]]
                pieces = [each(value, lambda a, j=j, step=step, axis=axis: a.reshape(step).take(j, axis=axis + 1),
                               shape=[*shape[:axis], shape[axis] // n, *shape[axis + 1:]]) for j in range(n)]
            else:
                pieces = chunks(value, self.axis, n, self.size)
            out |= {_with(key, self.closes, j): piece for j, piece in enumerate(pieces)}
        return out

    def __repr__(self):
        return f"Join({self.closes!r}, axis={self.axis}{', interleave' if self.interleave else ''})"


def Split(field: str, axis: int = 0, size: str | int | None = None) -> Op:  # noqa: N802 - an op's name
    """Forward: one tensor cut into ``size`` equal slices along ``axis``, one per value of ``field``
    (BERT's query into the notebook's per-head layers); back: joined."""
    return Inverted(Join(field, axis, size))


def Unstack(field: str, axis: int = 0, size: str | int | None = None) -> Op:  # noqa: N802 - an op's name
    """Forward: one tensor's ``axis`` taken apart into a tensor per value of ``field``; back: stacked."""
    return Inverted(Stack(field, axis, size))


class Transpose(Op):
    """Named axes: ``Transpose("e out in", "e in out")`` moves each axis to where the target names it."""

    def __init__(self, source: str, target: str):
        self.source, self.target = source.split(), target.split()
        if sorted(self.source) != sorted(self.target) or len(set(self.source)) != len(self.source):
            raise ValueError(f"Transpose({source!r}, {target!r}): the same distinct axis names on both sides")

    @staticmethod
    def _move(value, names, to):
        shape = _shape(value)
        if len(shape) != len(names):
            raise OpShapeError(tuple(shape), f"{len(names)} axes ({' '.join(names)})")
        axes = [names.index(n) for n in to]
        return each(value, lambda a: np.ascontiguousarray(np.transpose(a, axes)), shape=[shape[i] for i in axes])

    def forward(self, parts, ctx):
        return {k: self._move(v, self.source, self.target) for k, v in parts.items()}

    def inverse(self, parts, ctx):
        return {k: self._move(v, self.target, self.source) for k, v in parts.items()}

    def __repr__(self):
        return f"Transpose({' '.join(self.source)!r}, {' '.join(self.target)!r})"


def interleaved_to_half_split(weight, heads: int):
    """(heads * head_dim, in) rows of ``wq`` or ``wk``, per head from Meta's RoPE order (x0, y0, x1, y1, ...)
    to transformers' (x0, x1, ..., y0, y1, ...): row j + c * head_dim/2 takes Meta's row 2j + c."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)  # (h, 2, d/2, in)


def half_split_to_interleaved(weight, heads: int):
    """The inverse of ``interleaved_to_half_split``."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


class RopePermute(Op):
    """Meta's RoPE order of a query or key projection's rows -> transformers' half split, per head
    (``heads``: the Context size, ``num_attention_heads`` or ``num_key_value_heads``); back again."""

    def __init__(self, heads: str):
        self.heads = heads

    def _each(self, parts, ctx, permute):
        heads, out = ctx.size(self.heads, required=True), {}
        for key, value in parts.items():
            shape = _shape(value)
            if len(shape) != 2 or shape[0] % (2 * heads):
                raise OpShapeError(tuple(shape), f"(a multiple of 2 * {self.heads}={2 * heads}, in)")
            out[key] = each(value, lambda a, h=heads: permute(a, h))
        return out

    def forward(self, parts, ctx):
        return self._each(parts, ctx, interleaved_to_half_split)

    def inverse(self, parts, ctx):
        return self._each(parts, ctx, half_split_to_interleaved)

    def __repr__(self):
        return f"RopePermute({self.heads!r})"


class Replicated(Op):
    """Forward: a tensor every model-parallel shard holds a copy of (a norm): the copies must be equal,
    and one is kept; back: a copy for each of ``size`` shards."""

    def __init__(self, field: str = "s", size: str | int = "shards"):
        self.closes, self.size = field, size

    def forward(self, parts, ctx):
        out = {}
        for rest, by in _by(parts, self.closes).items():
            copies = [by[i] for i in sorted(by)]
            if len({_shape(c) for c in copies}) > 1:
                raise OpShapeError(" / ".join(str(list(_shape(c))) for c in copies), "equal copies")
            out[rest] = copies[0] if len(copies) == 1 else _lazy(copies, _shape(copies[0]), _dtype(copies),
                                                                 lambda *a: _equal_or_fail(a))
        return out

    def inverse(self, parts, ctx):
        n = ctx.size(self.size, required=True)
        return {_with(key, self.closes, j): value for key, value in parts.items() for j in range(n)}


def _equal_or_fail(copies):
    if any(not np.array_equal(c, copies[0]) for c in copies[1:]):
        raise ValueError("the copies of a replicated tensor differ between shards")
    return copies[0]


class EmbeddingShards(Op):
    """Forward: a token embedding's model-parallel shards, joined along its rows (Llama 3's
    ``VocabParallelEmbedding``) or its columns (Llama 1/2's ``ParallelEmbedding``), told apart by
    their width against ``dim``; back: cut along the rows."""

    def __init__(self, field: str = "s", dim: str = "hidden_size", size: str | int = "shards"):
        self.closes, self.dim, self.size = field, dim, size

    def forward(self, parts, ctx):
        out, dim = {}, ctx.size(self.dim, required=True)
        for rest, by in _by(parts, self.closes).items():
            pieces = [by[i] for i in sorted(by)]
            width = _shape(pieces[0])[-1] if _shape(pieces[0]) else None
            axis = 0 if len(pieces) == 1 or width == dim else 1
            out[rest] = pieces[0] if len(pieces) == 1 else concat(pieces, axis)
        return out

    def inverse(self, parts, ctx):
        n, out = ctx.size(self.size, required=True), {}
        for key, value in parts.items():
            out |= {_with(key, self.closes, j): p for j, p in enumerate(chunks(value, 0, n, self.size))}
        return out


# ------------------------------------------------------------------ quantised formats

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def mxfp4_dequantise(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GPT-OSS's MXFP4 experts, as transformers' ``convert_moe_packed_tensors`` computes them:
    ``blocks`` (E, N, G, B) bytes of two FP4 codes (low nibble first), ``scales`` (E, N, G) biased
    exponents (127 is 2**0) -> (E, G * B * 2, N) bfloat16 (the values are exact in it)."""
    blocks, exponents = np.asarray(blocks, np.uint8), np.asarray(scales, np.int32) - 127
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2], values[..., 1::2] = FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, exponents[..., None])
    out = values.reshape(*blocks.shape[:-2], -1)  # (E, N, K)
    return np.ascontiguousarray(np.swapaxes(out, 1, 2)).astype(ml_dtypes.bfloat16)


def mxfp4_quantise(weight: np.ndarray, block_bytes: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of ``mxfp4_dequantise``: (E, K, N) -> blocks (E, N, K / (2 * block_bytes), block_bytes)
    and scales, each block's scale the smallest power of two that puts its largest value within 6,
    values rounded to the nearest FP4 code. Exact for any tensor ``mxfp4_dequantise`` makes."""
    values = np.swapaxes(np.asarray(weight, np.float32), 1, 2)  # (E, N, K)
    per_block = 2 * block_bytes
    if values.shape[-1] % per_block:
        raise OpShapeError(tuple(np.shape(weight)), f"(E, a multiple of {per_block}, N)")
    values = values.reshape(*values.shape[:-1], values.shape[-1] // per_block, per_block)
    largest = np.abs(values).max(axis=-1)
    exponents = np.where(largest > 0, np.ceil(np.log2(np.maximum(largest, 1e-38) / 6.0)), -127).astype(np.int32)
    exponents = np.clip(exponents, -127, 128)
    scaled = np.ldexp(values, -exponents[..., None])
    codes = np.abs(np.abs(scaled)[..., None] - FP4_VALUES[:8]).argmin(axis=-1).astype(np.uint8)
    codes |= np.where(np.signbit(scaled), 8, 0).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exponents + 127).astype(np.uint8)


class MXFP4(Op):
    """Forward: GPT-OSS's ``*_blocks`` and ``*_scales`` (the row's two sources, in that order) ->
    the dequantised bfloat16 tensor; back: quantised again (exact for what it dequantised)."""

    closes = SOURCE

    def forward(self, parts, ctx):
        out = {}
        for rest, by in _by(parts, SOURCE).items():
            blocks, scales = by[0], by[1]
            b, s = _shape(blocks), _shape(scales)
            if len(b) != 4 or b[:-1] != s:
                raise OpShapeError(f"blocks {list(b)}, scales {list(s)}", "(E, N, G, B) and (E, N, G)")
            kinds = [np.dtype(_dtype([v])) for v in (blocks, scales)]
            if kinds != [np.dtype(np.uint8)] * 2:  # anything else would be cast to bytes silently
                raise OpShapeError(f"blocks {kinds[0]}, scales {kinds[1]}", "uint8 blocks and scales")
            shape = (b[0], b[2] * b[3] * 2, b[1])
            out[rest] = _lazy([blocks, scales], shape, ml_dtypes.bfloat16, mxfp4_dequantise)
        return out

    def inverse(self, parts, ctx):
        out = {}
        for key, value in parts.items():
            e, k, n = _shape(value)
            blocks, scales = outputs_of(value, mxfp4_quantise, [(e, n, k // 32, 16), (e, n, k // 32)],
                                        [np.uint8, np.uint8])
            out |= {_with(key, SOURCE, 0): blocks, _with(key, SOURCE, 1): scales}
        return out


class FP8Blocks(Op):
    """Forward: DeepSeek-V3's float8 (e4m3) ``weight`` and its ``weight_scale_inv`` (one float32 per
    ``block`` tile, (rows, cols) or one int for both; edges included: a weight whose shape the block does not
    divide has partial last tiles, as DeepSeek's reference ``weight_dequant`` reads them) -> the weight times its
    tile's scale, a float32 product (transformers' ``Fp8Dequantize``); back: each tile scaled so that its largest
    value is float8's largest (448), rounded to float8. A weight that is not float8_e4m3fn, a scale that is not
    float32, of the wrong tile count, or not finite and positive is refused (``OpShapeError``, naming the weight)."""

    closes = SOURCE

    def __init__(self, block: int | tuple[int, int] = 128):
        self.block = (block, block) if isinstance(block, int) else tuple(block)

    def _tiles(self, shape):
        return tuple(math.ceil(n / b) for n, b in zip(shape, self.block, strict=True))

    def _expand(self, scale, shape):
        return np.repeat(np.repeat(scale, self.block[0], 0), self.block[1], 1)[:shape[0], :shape[1]]

    def _check(self, weight, scale):
        w, s = _shape(weight), _shape(scale)
        if len(w) != 2 or s != self._tiles(w):
            expected = f"(out, in) and {list(self._tiles(w))}" if len(w) == 2 else "(out, in)"
            raise OpShapeError(f"weight {list(w)}, scale {list(s)} (tiles of {list(self.block)})", expected)
        kinds = [np.dtype(_dtype([v])) for v in (weight, scale)]
        if kinds != [np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.float32)]:
            raise OpShapeError(f"weight {kinds[0]}, scale {kinds[1]}", "a float8_e4m3fn weight, a float32 scale")
        values = read(scale)  # one float per tile: small, read now so that a bad one fails before any work
        if not (np.isfinite(values).all() and (values > 0).all()):
            raise OpShapeError(f"scale {values.ravel()[~(np.isfinite(values.ravel()) & (values.ravel() > 0))][:3]}",
                               "finite positive scales")

    def forward(self, parts, ctx):
        out = {}
        for rest, by in _by(parts, SOURCE).items():
            weight, scale = by[0], by[1]
            self._check(weight, scale)
            out[rest] = _lazy([weight, scale], _shape(weight), np.float32,
                              lambda a, b: a.astype(np.float32) * self._expand(b.astype(np.float32), a.shape))
        return out

    def _quantise(self, array):
        array = np.asarray(array, np.float32)
        tiles = self._tiles(array.shape)
        scale = np.ones(tiles, np.float32)
        rows, cols = self.block
        for r in range(tiles[0]):
            for c in range(tiles[1]):
                tile = array[r * rows:(r + 1) * rows, c * cols:(c + 1) * cols]
                largest = float(np.abs(tile).max()) if tile.size else 0.0
                scale[r, c] = np.float32(largest) / np.float32(448.0) if largest > 0 else 1.0
        weight = (array / self._expand(scale, array.shape)).astype(ml_dtypes.float8_e4m3fn)
        return weight, scale

    def inverse(self, parts, ctx):
        out = {}
        for key, value in parts.items():
            shape = _shape(value)
            if len(shape) != 2:
                raise OpShapeError(tuple(shape), "(out, in)")
            weight, scale = outputs_of(value, self._quantise, [shape, self._tiles(shape)],
                                       [ml_dtypes.float8_e4m3fn, np.float32])
            out[_with(key, SOURCE, 0)], out[_with(key, SOURCE, 1)] = weight, scale
        return out

    def __repr__(self):
        return f"FP8Blocks({list(self.block)})"
