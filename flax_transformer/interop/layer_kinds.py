"""What kind of layer a Flax module is, how each kind's leaves map to torch's, which torch
key each parameter of a model takes, and ``rename=``.

``porting`` places a torch key ``a.b.weight`` by looking at the Flax module at ``a.b``:
its kind of layer (from a family's table, or else from the module's own type, through
``LAYER_KINDS``) says which Flax leaf takes torch's ``weight`` and how the array changes
layout (``LEAF_RULES``). So any NNX model whose parameter paths follow its torch
twin's ports with no table entry, as long as its layers are of a known type.

A user's own layer type joins by one line: ``LAYER_KINDS.append((MyDense, "linear"))``;
a new kind of layer by one entry in ``LEAF_RULES`` besides.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from flax import nnx

from flax_transformer.models import gpt, layers, moe

# ------------------------------------------------------------------ layouts


class Layout(NamedTuple):
    """Where a parameter's axes sit in torch and in Flax, by name: ``Layout("out in", "in out")`` is
    ``nn.Linear``'s weight against NNX's kernel. ``...`` stands for any number of axes kept in order
    (a convolution's window), so ``Layout("...", "...")`` keeps any array as it is. An expert tensor
    names its expert axis, which stays first: ``Layout("e out in", "e in out")``."""

    torch: str
    flax: str

    def axes(self, ndim: int) -> tuple[int, ...]:
        """The permutation that takes a torch array to the Flax layout: flax.shape[j] = torch.shape[axes[j]]."""
        torch_names, flax_names = self.torch.split(), self.flax.split()
        fixed = len(torch_names) - ("..." in torch_names)
        if ndim < fixed or ("..." not in torch_names and ndim != fixed):
            raise ValueError(f"a {ndim}-d array does not fit the layout {self.torch!r} (torch) -> {self.flax!r} (Flax)")
        rest = [f"...{k}" for k in range(ndim - fixed)]

        def expand(names):
            out = []
            for name in names:
                out += rest if name == "..." else [name]
            return out

        source = expand(torch_names)
        return tuple(source.index(name) for name in expand(flax_names))


AS_IS = Layout("...", "...")
TRANSPOSE = Layout("out in", "in out")  # nn.Linear (out, in) <-> kernel (in, out)
CONV = Layout("out in ...", "... in out")  # nn.ConvNd (out, in/groups, *window) <-> nnx.Conv (*window, in/groups, out)
EXPERTS = Layout("e out in", "e in out")  # fused experts: torch (E, out, in) <-> Flax (E, in, out)


def to_flax(rule: Layout, array: np.ndarray) -> np.ndarray:
    """A torch-layout array in the Flax layout of ``rule``."""
    return np.transpose(array, rule.axes(np.ndim(array)))


def to_torch(rule: Layout, array: np.ndarray) -> np.ndarray:
    """A Flax-layout array back in torch's layout (the inverse of ``to_flax``)."""
    return np.transpose(array, np.argsort(rule.axes(np.ndim(array))))


def torch_shape(rule: Layout, flax_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The torch-layout shape of a Flax parameter of ``flax_shape`` (for error messages)."""
    axes = np.argsort(rule.axes(len(flax_shape)))
    return tuple(int(flax_shape[i]) for i in axes)


# ------------------------------------------------------------------ kinds of layer

# kind of layer -> {torch leaf: (flax leaf, its Layout)}
LEAF_RULES: dict[str, dict[str, tuple[str, str]]] = {
    "linear": {"weight": ("kernel", TRANSPOSE), "bias": ("bias", AS_IS)},  # torch (out, in), Flax (in, out)
    "layer_norm": {"weight": ("scale", AS_IS), "bias": ("bias", AS_IS)},
    "rms_norm": {"weight": ("scale", AS_IS)},
    "embedding": {"weight": ("embedding", AS_IS)},
    "conv": {"weight": ("kernel", CONV), "bias": ("bias", AS_IS)},
    # notebook 002 writes its own layers: matrix (d_in, d_out), gamma/beta, a bare table
    "matrix_linear": {"matrix": ("matrix", AS_IS), "bias": ("bias", AS_IS)},
    "gamma_beta_norm": {"gamma": ("gamma", AS_IS), "beta": ("beta", AS_IS)},
    "table": {"embeddings": ("embeddings", AS_IS)},
    # the llama family's fused experts (transformers 5's in-memory names)
    "experts": {"gate_up_proj": ("gate_up_proj", EXPERTS), "down_proj": ("down_proj", EXPERTS)},
    # GPT-OSS's: transformers holds them input first already, (E, H, 2I) interleaved and (E, I, H), as Flax does
    "gpt_oss_experts": {"gate_up_proj": ("gate_up_proj", AS_IS), "gate_up_proj_bias": ("gate_up_proj_bias", AS_IS),
                        "down_proj": ("down_proj", AS_IS), "down_proj_bias": ("down_proj_bias", AS_IS)},
    "router": {"weight": ("weight", AS_IS), "bias": ("bias", AS_IS)},  # (E, H) on both sides; GPT-OSS's has a bias
}

# Flax module type -> kind of layer, tested with isinstance, so subclasses count. A
# module of none of these types is a container: its own ``nnx.Param`` attributes map
# as they are, by name (a learned positional table, a scalar gate).
LAYER_KINDS: list[tuple[type, str]] = [
    (nnx.Linear, "linear"),  # layers.Linear builds one
    (nnx.Embed, "embedding"),  # layers.Embed builds one
    (nnx.LayerNorm, "layer_norm"),
    (layers.LayerNorm, "layer_norm"),
    (nnx.RMSNorm, "rms_norm"),
    (nnx.Conv, "conv"),  # 1-d (the tested case) and n-d: torch (out, in/groups, *window)
    (gpt.Linear, "matrix_linear"),
    (gpt.LayerNorm, "gamma_beta_norm"),
    (gpt.Embeddings, "table"),
    (moe.LlamaExperts, "experts"),
    (moe.LlamaTopKRouter, "router"),
    (moe.GptOssExperts, "gpt_oss_experts"),
    (moe.GptOssTopKRouter, "router"),
]


def kinds_of(module) -> tuple[str, ...]:
    """The kinds of layer ``module`` is by its type: usually one, none for a container.

    Two kinds are possible (a class deriving from two layer types); ``porting``
    refuses a key that the two would place differently, naming both.
    """
    found: list[str] = []
    for cls, kind in LAYER_KINDS:
        if isinstance(module, cls) and kind not in found:
            found.append(kind)
    return tuple(found)


# ------------------------------------------------------------------ placing keys


def join(module_path: str, leaf: str) -> str:
    return f"{module_path}.{leaf}" if module_path else leaf


class Slot(NamedTuple):
    """One torch name of a Flax parameter: the key, its layout rule, and the kind of layer that says so."""

    torch_key: str
    rule: Layout
    kind: str  # a LEAF_RULES kind, or "by name" (a parameter of a module with no rule for it)


TableKinds = Callable[[str], "tuple[str, ...] | None"]  # module path -> kinds, None where a table has no entry


class Plan(NamedTuple):
    params: dict[str, nnx.Param]  # Flax path -> parameter
    slots: dict[str, list[Slot]]  # Flax path -> its torch names: one, unless two kinds disagree
    modules: dict[str, nnx.Module]  # module path -> module ("" is the root)
    table: TableKinds | None  # the family's table, which takes precedence over types


def kinds_at(table: TableKinds | None, module_path: str, module) -> tuple[str, ...]:
    """The table's kinds where it has an entry for the path, else the module's own type. Where the
    table lists several kinds for one path and the module's type is one of them, that one (the
    llama family's ``experts``: Mixtral's layout or GPT-OSS's, the same leaf names told apart by type)."""
    kinds = table(module_path) if table is not None else None
    if kinds is None:
        return kinds_of(module) if module is not None else ()
    typed = tuple(k for k in kinds_of(module) if k in kinds) if len(kinds) > 1 and module is not None else ()
    return typed or kinds


def plan_keys(model, table: TableKinds | None = None) -> Plan:
    """Every parameter of ``model`` with the torch key(s) it takes, from its module's kind of layer.

    A parameter that no rule of its module's kind names (every parameter of a module of
    no known type: a learned positional table, a gate) keeps its own name, as is.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"expected a Flax NNX module, got {type(model).__name__}")
    params, modules = {}, {}
    for path, node in nnx.iter_graph(model):
        name = ".".join(str(p) for p in path)
        if isinstance(node, nnx.Param):
            params[name] = node
        elif isinstance(node, nnx.Module):
            modules[name] = node
    slots = {}
    for path in params:
        module_path, _, leaf = path.rpartition(".")
        found: list[Slot] = []
        for kind in kinds_at(table, module_path, modules.get(module_path)):
            for torch_leaf, (flax_leaf, rule) in LEAF_RULES[kind].items():
                slot = Slot(join(module_path, torch_leaf), rule, kind)
                if flax_leaf == leaf and all(s[:2] != slot[:2] for s in found):
                    found.append(slot)
        slots[path] = found or [Slot(path, AS_IS, "by name")]
    return Plan(params, slots, modules, table)


def why_not_placed(plan: Plan, key: str) -> str:
    """Why no parameter of the planned model takes the torch key ``key`` (after renames)."""
    module_path, _, leaf = key.rpartition(".")
    module = plan.modules.get(module_path)
    if module is None:
        return f"no Flax module at {module_path!r}"
    takes = sorted({s.torch_key.rpartition(".")[2] for path, slots in plan.slots.items()
                    if path.rpartition(".")[0] == module_path for s in slots})
    kinds = kinds_at(plan.table, module_path, module)
    what = f"a {' and '.join(kinds)} layer" if kinds else "of no known layer type"
    return (f"the {type(module).__name__} at {module_path or '(root)'!r} is {what}; "
            f"it takes {', '.join(takes) or 'nothing'}, not {leaf!r}")


# ------------------------------------------------------------------ rename=

Rename = list[tuple[re.Pattern, object]]


def check_rename(rename) -> Rename:
    """``rename=`` as compiled ``(regex, replacement)`` pairs, checked before any work.

    Each pair is applied with ``re.sub`` in order; a replacement is a string (``\\1``
    group references allowed) or a function of the match, as ``re.sub`` takes.
    """
    if rename is None:
        return []
    if isinstance(rename, (str, bytes)) or not isinstance(rename, Sequence):
        raise ValueError(f"rename must be a list of (regex, replacement) pairs, got {type(rename).__name__}")
    pairs = []
    for i, pair in enumerate(rename):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"rename[{i}] must be a (regex, replacement) pair, got {pair!r}")
        pattern, replacement = pair
        if not isinstance(pattern, (str, re.Pattern)) or not (isinstance(replacement, str) or callable(replacement)):
            raise ValueError(f"rename[{i}] must be (str regex, str replacement), got {pair!r}")
        try:
            compiled = re.compile(pattern)
            if isinstance(replacement, str):
                compiled.sub(replacement, "")  # bad escapes fail here; group references only on a match
        except re.error as error:
            raise ValueError(f"rename[{i}] = {pair!r} is not a valid regex and replacement: {error}") from None
        pairs.append((compiled, replacement))
    return pairs


def apply_rename(key: str, pairs: Rename) -> str:
    """``key`` after every pair of ``rename=``, in order."""
    for i, (pattern, replacement) in enumerate(pairs):
        try:
            key = pattern.sub(replacement, key)
        except (re.error, IndexError) as error:
            raise ValueError(f"rename[{i}] ({pattern.pattern!r} -> {replacement!r}) fails on {key!r}: "
                             f"{error}") from None
    return key
