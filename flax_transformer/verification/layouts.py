"""Where a torch module's arrays and its Flax twin's are laid out differently, and how ``bisect``
compares through that: by layer kind, channels first in torch and last in Flax (a convolution:
``CHANNELS_LAST_KINDS``); by module path, the features of a query or key projection in Meta's
interleaved RoPE order in torch and transformers' half split in Flax (``permutations=``, the
porting table's ``converter_ops.RopePermute`` rule); and the layouts of a porting table a user
bisects against (``meta_llama``: Meta's reference model against the llama family's Flax model).
"""

from __future__ import annotations

import re

import numpy as np

from flax_transformer.interop.converter_ops import RopePermute, half_split_to_interleaved
from flax_transformer.interop.layer_kinds import kinds_of

# Kinds of layer (``layer_kinds``) whose inputs and outputs torch and Flax hold in transposed
# layouts: torch convolves channels first, (b, c, *spatial); Flax's ``nnx.Conv`` channels last,
# (b, *spatial, c). A user's layer registered as a kind in ``layer_kinds.LAYER_KINDS`` counts too.
CHANNELS_LAST_KINDS = ("conv",)


def channels_last(flax_module) -> bool:
    return flax_module is not None and any(k in CHANNELS_LAST_KINDS for k in kinds_of(flax_module))


def channels_last_axes(ndim: int) -> tuple[int, ...]:
    """flax.shape[j] = torch.shape[axes[j]]: (b, c, *spatial) -> (b, *spatial, c)."""
    return (0, *range(2, ndim), 1)


def to_torch_layout(a: np.ndarray, shape: tuple, channels_last: bool) -> np.ndarray | None:
    """A Flax array in torch's layout of ``shape``: moved from channels last where the layer's kind
    says so (always: the shapes may agree either way, a 3-channel 3x3 map), else as it is; None
    when the result does not have torch's shape."""
    if channels_last and a.ndim >= 3:
        a = np.transpose(a, np.argsort(channels_last_axes(a.ndim)))  # (b, *spatial, c) -> (b, c, *spatial)
    return a if tuple(a.shape) == tuple(shape) else None


def check_permutations(permutations) -> list[tuple[re.Pattern, int]]:
    """``bisect``'s ``permutations=``: ``[(torch module path regex, heads), ...]``, compiled and checked
    before any work. Each names projections whose features torch holds in Meta's interleaved RoPE
    order per head (``converter_ops.RopePermute``, the porting table's rule) and Flax in the half split."""
    out = []
    for i, entry in enumerate(permutations or ()):
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], int) and not isinstance(entry[1], bool) and entry[1] >= 1):
            raise ValueError(f"permutations[{i}] must be (torch module path regex, heads >= 1), got {entry!r}")
        try:
            out.append((re.compile(entry[0]), entry[1]))
        except re.error as error:
            raise ValueError(f"permutations[{i}]: {entry[0]!r} is not a regex: {error}") from None
    return out


def permuted_heads(path: str, permutations: list[tuple[re.Pattern, int]]) -> int | None:
    """The heads of the RoPE permutation the torch module at ``path`` is compared through; None: none."""
    return next((heads for pattern, heads in permutations if pattern.fullmatch(path)), None)


def to_rope_order(a, heads: int, axis: int) -> np.ndarray | None:
    """A Flax array whose ``axis`` holds a query or key projection's features per head in the half
    split, in Meta's interleaved order (``converter_ops.half_split_to_interleaved``); None when the axis
    is not ``heads`` whole pairs."""
    a = np.moveaxis(np.asarray(a), axis, 0)
    if a.ndim == 0 or a.shape[0] % (2 * heads):
        return None
    moved = half_split_to_interleaved(a.reshape(a.shape[0], -1), heads).reshape(a.shape)
    return np.moveaxis(moved, 0, axis)


def meta_llama(config) -> dict:
    """``bisect``'s ``rename`` and ``permutations`` for Meta's reference llama (its ``model.py``:
    ``tok_embeddings``, ``layers.N.attention.wq``, ...) against the llama family's Flax model of
    ``config`` (a ``LlamaConfig``), read off the porting table (``meta_llama.META_LLAMA_ROWS``): every
    Meta module renamed to transformers' (a weight's module, then each parent whose children all move
    under one parent: ``layers.N.attention`` -> ``model.layers.N.self_attn``), and ``wq``/``wk``
    compared through the RoPE permutation, with the query's and the key/value heads.
    ``bisect(meta_model, flax_model, args, **layouts.meta_llama(config))``."""
    from flax_transformer.interop.meta_llama import META_LLAMA_ROWS

    modules, permutations = {}, []
    for row in META_LLAMA_ROWS:
        (source,) = row.sources
        meta = source.split("/", 1)[1].removesuffix(".weight")
        modules[meta] = row.target.removesuffix(".weight")
        if any(isinstance(op, RopePermute) for op in row.ops):
            heads = next(getattr(config, op.heads) for op in row.ops if isinstance(op, RopePermute))
            permutations.append((_template(meta), heads))
    parents, level = {}, modules
    while level:  # a parent renamed when all its children move under one parent
        up: dict[str, set] = {}
        for meta, ours in level.items():
            if "." in meta and "." in ours:
                up.setdefault(meta.rpartition(".")[0], set()).add(ours.rpartition(".")[0])
        level = {m: o.pop() for m, o in up.items() if len(o) == 1 and m not in parents}
        parents |= level
    pairs = sorted(({**parents, **modules}).items(), key=lambda p: -p[0].count("."))  # innermost first
    rename = [(f"^{_template(meta)}\\.", ours.replace("{i}", r"\1") + ".") for meta, ours in pairs]
    return {"rename": rename, "permutations": permutations}


def _template(name: str) -> str:
    """A porting table's key template as a regex: ``{i}`` a layer index (a group)."""
    return re.escape(name).replace(re.escape("{i}"), r"(\d+)")
