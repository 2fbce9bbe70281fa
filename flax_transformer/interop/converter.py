"""Converter rows: one row type for every checkpoint format.

A ``Row`` maps one or more *source* key templates (a checkpoint format's names) to one *canonical*
key template (the names ``porting`` reads: transformers 5's in-memory names for a transformers
family, torch_reference's for the notebooks'), through a chain of ops (``converter_ops``), each
with its inverse. ``to_canonical`` runs the rows forward, ``from_canonical`` backward; one table
serves both directions.

Templates name fields in braces, each matching the pattern ``PLACEHOLDERS`` gives it: ``{i}`` a
layer, ``{e}`` an expert, ``{h}`` a head, ``{s}`` a model-parallel shard, ``{p}`` weight or bias.
A field on both sides of a row is carried over. A field on one side only is taken apart or put
together by an op of the chain: ``Stack("e")`` stacks the experts of a per-expert file into one
tensor, ``Split("h")`` cuts a tensor into per-head slices; with several source templates the
template's index ``t`` is a field too (``Join("t", axis)`` concatenates gate and up). So a
row's group is the tensors that share its carried fields, keyed by the fields still open, and
each op closes or opens one.

It is all or nothing: every source key is taken by exactly one row (the first that matches); a
group lacks no template and no index (experts ``0..E-1`` where the config says ``E``, heads
``0..H-1``); two rows never make the same key. Every problem is collected, then raised at once
as a ``StateDictError`` in the source's names. Values may be ``safetensors_io.Lazy`` tensors: the
ops stay lazy, so a streamed read or write reads each tensor only when its result is written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from flax_transformer.models.state_dict_errors import StateDictError

PLACEHOLDERS = {"i": r"\d+", "e": r"\d+", "h": r"\d+", "s": r"\d+", "p": "weight|bias", "emb": "wte|wpe",
                "ln": "ln_1|ln_2", "conv": r"attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj",
                "attn": "q_proj|k_proj|v_proj|o_proj", "qk_norm": "q_norm|k_norm",
                "mlp": "gate_proj|up_proj|down_proj", "norm": "input_layernorm|post_attention_layernorm",
                "proj": "gate_up_proj|down_proj", "mla": "q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj",
                "mla_norm": "q_a_layernorm|kv_a_layernorm",
                # the linear layers of a DeepSeek-V3 folder that hold FP8 weights (all but the router and lm_head)
                "fp8": r"model\.layers\.\d+\.(?:self_attn\.(?:q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj"
                       r"|o_proj)|mlp\.(?:experts\.\d+\.|shared_experts\.)?(?:gate_proj|up_proj|down_proj))"}
INDEX = r"\d+"  # a field whose values are indices: ordered as numbers, complete from 0
SOURCE = "t"  # the field that numbers a row's source templates


@cache
def fields_of(template: str) -> tuple[str, ...]:
    return tuple(re.findall(r"\{(\w+)\}", template))


@cache
def pattern(template: str) -> re.Pattern:
    """The regex of a template: each ``{field}`` a named group of ``PLACEHOLDERS[field]``."""
    parts = re.split(r"\{(\w+)\}", template)  # literal, field, literal, field, ...
    seen, regex = set(), []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            regex.append(re.escape(part))
        elif part in seen:  # a field named twice must match the same text
            regex.append(f"(?P={part})")
        else:
            seen.add(part)
            regex.append(f"(?P<{part}>{PLACEHOLDERS[part]})")
    return re.compile("".join(regex))


def _value(field: str, text: str):
    return int(text) if PLACEHOLDERS.get(field) == INDEX else text


@dataclass(frozen=True)
class Row:
    """Source key template(s) -> one canonical key template, through ``ops`` (applied in order to
    go to the canonical side, inverted in reverse order to come back)."""

    source: str | tuple[str, ...]
    target: str
    ops: tuple = ()

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else tuple(self.source)

    @property
    def carried(self) -> tuple[str, ...]:
        """The fields on both sides, in the target's order."""
        return tuple(f for f in fields_of(self.target) if f in fields_of(self.sources[0]))

    def open_fields(self, forward: bool) -> tuple[str, ...]:
        """The fields a group is keyed by where it starts: a source's own (and ``t``), or the target's own."""
        if forward:
            own = tuple(f for f in fields_of(self.sources[0]) if f not in self.carried)
            return ((SOURCE,) if len(self.sources) > 1 else ()) + own
        return tuple(f for f in fields_of(self.target) if f not in self.carried)

    def check(self) -> Row:
        """The row is well formed: every source has the same fields, and the ops close exactly the
        fields the source side has and the target lacks, and open those the target has alone."""
        firsts = {frozenset(fields_of(s)) for s in self.sources}
        if len(firsts) != 1:
            raise ValueError(f"{self}: every source template must name the same fields")
        open_ = set(self.open_fields(True))
        for op in self.ops:
            open_ = op.fields_after(open_)
        if open_ != set(self.open_fields(False)):
            raise ValueError(f"{self}: its ops leave the fields {sorted(open_)} open, the target has "
                             f"{sorted(self.open_fields(False))}")
        return self

    def __str__(self):
        return f"Row({' + '.join(self.sources)} -> {self.target})"


class Context:
    """What the ops read beyond the tensors: sizes from the model's config (``num_attention_heads``,
    ``num_experts``), and overrides (``shards=2``) that take precedence."""

    def __init__(self, config=None, **overrides):
        self._config, self._overrides = config, overrides

    def for_row(self, row: Row) -> Context:
        """The Context of one row: ``t`` is its number of source templates."""
        return Context(self._config, **{SOURCE: len(row.sources), **self._overrides})

    def size(self, name: str | int | None, *, required: bool = False) -> int | None:
        """The size called ``name``; None where nothing says (then the parts' own count is used),
        unless ``required``: an op that cannot go on without it."""
        if name is None or isinstance(name, int):
            return name
        if name in self._overrides:
            return self._overrides[name]
        value = getattr(self._config, name, None) if self._config is not None else None
        if value is None and required:
            raise ValueError(f"this conversion needs {name!r}, and {'no config was given' if self._config is None else 'the config has none'}")
        return value


class Problems:
    """Every missing, unexpected and mis-shaped key found while converting, raised at once."""

    def __init__(self):
        self.missing, self.unexpected, self.mismatched = [], [], []

    def raise_any(self):
        if self.missing or self.unexpected or self.mismatched:
            raise StateDictError(sorted(set(self.missing)), sorted(set(self.unexpected)), self.mismatched)


def _match(rows: Sequence[Row], key: str, forward: bool):
    """(row number, template number, fields) of the first row whose template takes ``key``."""
    for r, row in enumerate(rows):
        templates = row.sources if forward else (row.target,)
        for t, template in enumerate(templates):
            found = pattern(template).fullmatch(key)
            if found:
                return r, t, {f: _value(f, v) for f, v in found.groupdict().items()}
    return None


def _key_name(row: Row, forward: bool, carried: dict, part: dict) -> str:
    """The key a part of a group has on the side it came from (for messages)."""
    fields = {**carried, **part}
    template = row.sources[fields.get(SOURCE, 0)] if forward else row.target
    return template.format(**fields)


def _complete(row: Row, forward: bool, carried: dict, parts: dict, ctx: Context, problems: Problems) -> bool:
    """Every part a group needs is there: each source template, each index from 0 (to the size the
    ops declare), the same indices for each template. Names what is missing."""
    open_ = row.open_fields(forward)
    sizes = {SOURCE: len(row.sources)} if forward and len(row.sources) > 1 else {}
    for op in row.ops if forward else reversed(row.ops):
        sizes |= op.sizes(ctx, forward)
    ranges = []
    for field in open_:
        values = {dict(k)[field] for k in parts}
        if field in sizes and sizes[field] is not None:
            ranges.append(range(sizes[field]))
        elif all(isinstance(v, int) for v in values):
            ranges.append(range(max(values) + 1))
        else:
            ranges.append(sorted(values))
    wanted = [()]
    for field, values in zip(open_, ranges, strict=True):
        wanted = [(*w, (field, v)) for w in wanted for v in values]
    wanted = {tuple(sorted(w)) for w in wanted}
    missing = sorted(wanted - set(parts), key=str)
    extra = sorted(set(parts) - wanted, key=str)
    problems.missing += [_key_name(row, forward, carried, dict(k)) for k in missing]
    problems.unexpected += [_key_name(row, forward, carried, dict(k)) for k in extra]
    return not missing and not extra


def convert(rows: Sequence[Row], state: dict, *, forward: bool, config=None, context: Context | None = None,
            keep_unknown: bool | None = None, format_name: str = "source") -> dict:
    """``state`` through the rows: source names -> canonical if ``forward``, else back.

    Keys no row takes are kept as they are going forward (``keep_unknown``, the default there),
    so that the strict load that follows names them; coming back, they are refused.
    """
    ctx = context or Context(config)
    keep_unknown = forward if keep_unknown is None else keep_unknown
    groups: dict[tuple, dict] = {}
    out, problems = {}, Problems()
    for key, value in state.items():
        found = _match(rows, key, forward)
        if found is None:
            if not keep_unknown:
                raise ValueError(f"{key}: no {format_name} name for it in the key table")
            out[key] = value
            continue
        r, t, fields = found
        row = rows[r]
        carried = tuple((f, fields[f]) for f in row.carried)
        part = {f: fields[f] for f in row.open_fields(forward) if f != SOURCE}
        if forward and len(row.sources) > 1:
            part[SOURCE] = t
        groups.setdefault((r, carried), {})[tuple(sorted(part.items()))] = (key, value)
    made: dict[str, str] = {}
    for (r, carried), parts in groups.items():
        row, carried = rows[r], dict(carried)
        row_ctx = ctx.for_row(row)
        if not _complete(row, forward, carried, parts, row_ctx, problems):
            continue
        values = {k: v for k, (_, v) in parts.items()}
        names = {k: name for k, (name, _) in parts.items()}
        try:
            for op in row.ops if forward else reversed(row.ops):
                values = op.forward(values, row_ctx) if forward else op.inverse(values, row_ctx)
        except OpShapeError as error:  # named by the group's template, its open fields left as {field}
            template = row.sources[0] if forward else row.target
            problems.mismatched.append((template.format_map(_Open(carried)), error.got, error.expected))
            continue
        for part, value in values.items():
            fields = {**carried, **dict(part)}
            template = row.target if forward else row.sources[fields.pop(SOURCE, 0)]
            key = template.format(**fields)
            source = ", ".join(sorted(names.values()))
            if key in made or key in out:
                problems.unexpected.append(f"{key} (made twice: from {made.get(key, key)} and from {source})")
            made[key] = source
            out[key] = value
    problems.raise_any()
    return out


class _Open(dict):
    def __missing__(self, field):
        return "{" + field + "}"


def to_canonical(rows: Sequence[Row], state: dict, *, config=None, **kwargs) -> dict:
    return convert(rows, state, forward=True, config=config, **kwargs)


def from_canonical(rows: Sequence[Row], state: dict, *, config=None, **kwargs) -> dict:
    return convert(rows, state, forward=False, config=config, **kwargs)


def source_name(rows: Sequence[Row], key: str, *, whole: bool = False, format_name: str = "source") -> str | None:
    """The source name of one canonical key (a module's or a parameter's), without its tensor.

    For a key that is a slice of a source tensor (one head of BERT's query): None, or with
    ``whole`` the name of the tensor it is part of. Keys of rows that gather several source
    tensors into one (experts) have no single name: None.
    """
    found = _match(rows, key, forward=False)
    if found is None:
        raise ValueError(f"{key}: no {format_name} name for it in the key table")
    r, _, fields = found
    row = rows[r]
    if len(row.sources) > 1 or row.open_fields(True):
        return None
    if row.open_fields(False) and not whole:
        return None
    return row.sources[0].format(**{f: fields[f] for f in row.carried})


class OpShapeError(ValueError):
    """An op cannot take a tensor of this shape: (what it got, what it needs), for ``mismatched``."""

    def __init__(self, got, expected):
        super().__init__(f"{got} vs {expected}")
        self.got, self.expected = got, expected
