"""Tied weights: one tensor under several torch names, and how porting places it once.

torch keeps a tied weight once and lists it under each name (nanoGPT, GPT-2, Llama 3.2 and Gemma
write ``self.lm_head.weight = self.tok_emb.weight``): its ``state_dict()`` holds both keys, sharing
storage. ``memory_groups`` finds such names by memory (a torch state_dict, or ``.numpy()`` views of
it). A Flax twin that computes its head with ``self.tok_emb.attend(x)`` has no parameter for the
second name; ``declared_groups`` reads the names it declares one tensor (``tied_keys``), for
checkpoints whose copies no longer share memory. ``porting`` uses both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from flax_transformer.interop.layer_kinds import Plan, join
from flax_transformer.interop.values import to_numpy

TIED_HINT = 'tied_keys = (("lm_head.weight", "tok_emb.weight"),)'  # the declaration, as messages show it


def _memory_identity(value) -> tuple | None:
    """Where a torch tensor's or numpy array's values live: (device, first byte, shape, byte strides, dtype).

    Two values with the same identity are one array; None for values with no memory of their own to
    compare (empty, ``meta``, read lazily, JAX arrays).
    """
    if type(value).__module__.startswith("torch"):
        if value.numel() == 0 or value.device.type == "meta":
            return None
        size = value.element_size()
        start = value.untyped_storage().data_ptr() + value.storage_offset() * size
        return (value.device.type, value.device.index, start, tuple(value.shape),
                tuple(s * size for s in value.stride()), str(value.dtype).removeprefix("torch."))
    if isinstance(value, np.ndarray) and value.size:
        return ("cpu", None, value.__array_interface__["data"][0], value.shape, value.strides, value.dtype.name)
    return None


def same_memory(a, b) -> bool:
    """Whether two values (torch tensors or numpy arrays) are one array in memory."""
    identity = _memory_identity(a)
    return identity is not None and identity == _memory_identity(b)


def memory_groups(state: Mapping[str, object]) -> list[tuple[str, ...]]:
    """The keys of ``state`` whose values are one array in memory, in groups of two or more, in ``state``'s order."""
    groups: dict[tuple, list[str]] = {}
    for key, value in state.items():
        identity = _memory_identity(value)
        if identity is not None:
            groups.setdefault(identity, []).append(key)
    return [tuple(keys) for keys in groups.values() if len(keys) > 1]


def merge_groups(groups) -> list[tuple[str, ...]]:
    """Groups of names joined wherever they share a name, names in first-seen order."""
    merged: list[list[str]] = []
    for group in groups:
        joined = [m for m in merged if any(name in m for name in group)]
        new = list(dict.fromkeys([name for m in joined for name in m] + list(group)))
        merged = [m for m in merged if all(m is not j for j in joined)] + [new]
    return [tuple(m) for m in merged]


def declared_groups(plan: Plan) -> list[tuple[str, ...]]:
    """The torch names that a Flax model declares one tensor, from ``tied_keys`` on any of its modules.

    ``tied_keys = (("lm_head.weight", "tok_emb.weight"),)`` on a model's class says the two names are
    one tensor: a checkpoint holding both (equal) loads, and ``porting.state_dict`` writes both. Names
    are relative to the declaring module; at least one name of a group must be a parameter's.
    """
    taken = {slot.torch_key for slots in plan.slots.values() for slot in slots}
    out = []
    for module_path, module in plan.modules.items():
        declared = getattr(module, "tied_keys", ())
        if isinstance(declared, (str, bytes)) or not isinstance(declared, Sequence) or not all(
                isinstance(g, Sequence) and not isinstance(g, (str, bytes)) and len(g) > 1
                and all(isinstance(n, str) for n in g) for g in declared):
            raise TypeError(f"{type(module).__name__}.tied_keys must be groups of two or more torch names, "
                            f"e.g. {TIED_HINT}; got {declared!r}")
        for group in declared:
            names = tuple(dict.fromkeys(join(module_path, name) for name in group))
            if not taken & set(names):
                raise ValueError(f"{type(module).__name__}.tied_keys declares {', '.join(names)} one tensor, but "
                                 "none of them is a parameter of the model")
            out.append(names)
    return merge_groups(out)


def tie_groups(plan: Plan, state: Mapping[str, object], renamed: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """Our torch name -> its group of tied names (ours): shared memory in ``state`` (keys -> ``renamed``), or declared."""
    in_memory = [tuple(renamed[k] for k in group) for group in memory_groups(state)]
    return {name: group for group in merge_groups(in_memory + declared_groups(plan)) for name in group}


def difference(first: np.ndarray, other: np.ndarray) -> str | None:
    """How two values of one tied tensor differ ("in shape ...", "largest difference ..."), or None if equal."""
    if first.shape != other.shape:
        return f"in shape, {first.shape} and {other.shape}"
    if np.array_equal(first, other, equal_nan=True):
        return None
    return f"largest difference {float(np.max(np.abs(first.astype(np.float64) - other.astype(np.float64)))):.3g}"


def conflicts(state: Mapping[str, object], keys: list[str], shown: dict[str, str]) -> list[str]:
    """The keys of one tied group (of a state_dict to load) whose values differ from the first's."""
    gaps = [(key, None if same_memory(state[keys[0]], state[key]) else
             difference(to_numpy(state[keys[0]]), to_numpy(state[key]))) for key in keys[1:]]
    return [f"{shown[keys[0]]} and {shown[key]} are declared one tensor (tied_keys) but differ ({gap})"
            for key, gap in gaps if gap]


def equal_hint(state: Mapping[str, object], key: str, placed: list[str],
               names: Mapping[str, str] | None = None) -> str:
    """For an unplaced ``key`` whose value equals a placed key's: how to declare the two one tensor.
    ``names``: each state key's name after the load's ``rename`` (the model's names, which a
    ``tied_keys`` declaration uses); the keys themselves without one."""
    names = names or {}
    value = to_numpy(state[key])
    for other in placed:
        theirs = to_numpy(state[other])
        if theirs.shape == value.shape and theirs.dtype == value.dtype and np.array_equal(theirs, value):
            mine, yours = names.get(key, key), names.get(other, other)
            return (f"; it equals {other}: if the Flax model uses one tensor for both, declare it on the model's "
                    f"class: tied_keys = (({mine!r}, {yours!r}),)")
    return ""


def fill_torch_names(own: Mapping[str, object], state: dict[str, np.ndarray]) -> tuple[dict, list[str]]:
    """``state`` with every name of each tensor that the torch state_dict ``own`` ties, and the ties it breaks.

    A name ``state`` lacks takes the value of one it has; two names it has with different values
    are one conflict, naming both: the torch module can keep one of them only.
    """
    state, conflicts = dict(state), []
    for group in memory_groups(own):
        given = [k for k in group if k in state]
        for key in given[1:]:
            gap = difference(state[given[0]], state[key])
            if gap and state[given[0]].shape == state[key].shape:  # a shape apart is reported as a mismatch
                conflicts.append(f"{given[0]} and {key} are one tensor in the torch module, but the Flax model's "
                                 f"differ ({gap}); writing both would lose one")
        for key in group if given else ():
            state.setdefault(key, state[given[0]])
    return state, conflicts
