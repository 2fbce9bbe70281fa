"""Weight porting between torch and Flax NNX models, in both directions.

Both sides use the same parameter paths up to the leaf: torch's
``tblocks.0.mhattention.tokeys.weight`` is Flax's ``tblocks.0.mhattention.tokeys.kernel``.
A torch key is placed by the Flax module at its path: the module's kind of layer says
which Flax leaf takes it and how its layout changes (``LEAF_RULES``). The kind comes
from the family's table where the model is one of the four families (``KEY_MAPS``,
module path -> kind), and otherwise from the module's own type
(``layer_kinds.LAYER_KINDS``), so a user's own NNX model ports with no table entry.
``rename=`` maps torch names that differ from the Flax model's.

Loading is all or nothing: every missing, unexpected, mis-shaped or doubly placed key
is collected and reported in one ``StateDictError`` before a single parameter is written.

Tied weights are placed once, with no rename and no key deleted. ``tied_keys(module)`` gives the
groups of torch names that are one tensor: for a torch module, its state_dict keys that share
storage (nanoGPT's ``self.lm_head.weight = self.tok_emb.weight``); for a Flax model, the groups it
declares with a ``tied_keys`` class attribute (``ties.py``). Loading takes every
name of such a group once one of them has a place: a Flax twin that computes its head with
``self.tok_emb.attend(x)`` needs no ``lm_head`` (torch tensors, and numpy views of them, are known
tied by memory; separate copies must be equal and declared). ``flax_to_torch`` fills every name of
a tied torch tensor, and refuses, naming both keys, a Flax model whose two tensors for it differ.

A target built with ``nnx.eval_shape`` leaves its RNG state abstract: loading gives it keys from
``seed`` so the model runs. Other abstract non-parameter state (batch statistics, a user's
``nnx.Variable``) has no value in the torch weights: loading refuses it up front.

torch is imported lazily, inside the functions that need it, so that a JAX-only user
can import ``flax_transformer`` without it.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop.family_tables import KEY_MAPS, MODULE_FAMILIES
from flax_transformer.interop.layer_kinds import (
    LEAF_RULES,
    Plan,
    Slot,
    apply_rename,
    check_rename,
    join,
    plan_keys,
    to_flax,
    to_torch,
    torch_shape,
    why_not_placed,
)
from flax_transformer.interop.targets import build_unfilled, fill_rng_state, refuse_abstract_state
from flax_transformer.interop.ties import (
    conflicts,
    declared_groups,
    equal_hint,
    fill_torch_names,
    memory_groups,
    tie_groups,
)
from flax_transformer.interop.values import check_value as _check_value
from flax_transformer.interop.values import to_numpy as _to_numpy
from flax_transformer.models.state_dict_errors import StateDictError, check_state_dict_mapping

__all__ = ["LoadResult", "flax_class", "flax_to_torch", "load_state_dict", "state_dict", "tied_keys", "torch_class",
           "torch_to_flax"]

class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def family_or_none(module) -> str | None:
    """The family of a flax_transformer or torch_reference module's class, or None for any other."""
    package, _, family = type(module).__module__.rpartition(".")
    family = MODULE_FAMILIES.get(family, family)
    return family if package in ("flax_transformer.models", "torch_reference") and family in KEY_MAPS else None


def family_of(module) -> str:
    family = family_or_none(module)
    if family is None:
        raise TypeError(
            f"{type(module).__name__} is not a flax_transformer or torch_reference model "
            f"(families: {', '.join(KEY_MAPS)})"
        )
    return family


def _table_kinds(family: str, module_path: str) -> tuple[str, ...] | None:
    """The kinds of layer the family's table gives ``module_path``, or None if it has no entry."""
    for pattern, kinds in KEY_MAPS[family].items():
        if re.fullmatch(rf"(?:.+\.)?(?:{pattern})", module_path):
            return (kinds,) if isinstance(kinds, str) else tuple(kinds)
    return None


def _leaf_rules(family: str, module_path: str) -> dict[str, tuple[str, str]] | None:
    """The leaf rules of the layer at ``module_path``, or None if the table has no entry."""
    kinds = _table_kinds(family, module_path)
    return None if kinds is None else {leaf: rule for kind in kinds for leaf, rule in LEAF_RULES[kind].items()}


def torch_key_to_flax(family: str, key: str) -> tuple[str, str] | None:
    """``a.b.weight`` -> (``a.b.kernel``, layout rule), or None if no rule covers the key."""
    module_path, _, leaf = key.rpartition(".")
    rules = _leaf_rules(family, module_path)
    if rules is None or leaf not in rules:
        return None
    flax_leaf, rule = rules[leaf]
    return join(module_path, flax_leaf), rule


def flax_path_to_torch(family: str, path: str) -> tuple[str, str] | None:
    """``a.b.kernel`` -> (``a.b.weight``, layout rule), or None."""
    module_path, _, leaf = path.rpartition(".")
    for torch_leaf, (flax_leaf, rule) in (_leaf_rules(family, module_path) or {}).items():
        if flax_leaf == leaf:
            return join(module_path, torch_leaf), rule
    return None


# ------------------------------------------------------------------ flax side


def flax_params(model) -> dict[str, nnx.Param]:
    """Dotted path -> Param variable, for every parameter of an NNX model."""
    out = {}
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param):
            out[".".join(str(p) for p in path)] = variable
    return out


# ------------------------------------------------------------------ placing keys


RENAME_HINT = ("if the checkpoint names things differently, pass rename=[(regex, replacement), ...] "
               "(re.sub on each key, in order)")


def _refusal(missing=(), unexpected=(), mismatched=(), ambiguous=(), why=None, tied=()) -> StateDictError:
    """One StateDictError with every problem: also the keys placed two ways (``.ambiguous``), the tied
    keys whose values differ (``.tied``) and why keys were not placed."""
    error = StateDictError(missing, unexpected, mismatched)
    error.ambiguous, error.tied = list(ambiguous), list(tied)
    lines = [str(error).rstrip()]
    if ambiguous:
        lines.append(f"keys placed two ways ({len(ambiguous)}): " + "; ".join(ambiguous))
    if tied:
        lines.append(f"tied keys whose values differ ({len(tied)}): " + "; ".join(tied))
    if why:
        lines.append("not placed: " + "; ".join(f"{key}: {reason}" for key, reason in why.items()))
    if missing or unexpected:
        lines.append(RENAME_HINT)
    error.args = ("\n  ".join(lines),)
    return error


def plan_of(model) -> Plan:
    family = family_or_none(model)
    return plan_keys(model, None if family is None else functools.partial(_table_kinds, family))


def tied_keys(module) -> list[tuple[str, ...]]:
    """Groups of torch names that are one tensor, two or more names each.

    A torch module: the keys of its ``state_dict()`` that share storage (nanoGPT's, GPT-2's
    ``lm_head.weight`` and ``tok_emb.weight``), in state_dict order. A Flax NNX model: the groups it
    declares with ``tied_keys`` class attributes (``layer_kinds.declared_groups``). A model with no
    tie gives ``[]``.
    """
    if isinstance(module, nnx.Module):
        return declared_groups(plan_of(module))
    if not callable(getattr(module, "state_dict", None)):
        raise TypeError(f"tied_keys takes a torch nn.Module or a Flax NNX module, got {type(module).__name__}")
    return memory_groups(module.state_dict())


def state_dict(model, *, rename=None) -> dict[str, np.ndarray]:
    """The parameters of an NNX model under torch names and layouts.

    Names come from the family's table or else each layer's type, as in
    ``load_state_dict``; every name of a tied group the model declares (``tied_keys``) is
    written, each with the one array. ``rename`` pairs then apply to these names (our names ->
    the checkpoint's: the reverse of the pairs that loading the same checkpoint takes).
    """
    pairs = check_rename(rename)
    plan = plan_of(model)
    ours, ambiguous = {}, []  # our torch name -> (Flax path, array)
    for path, param in plan.params.items():
        slots = plan.slots[path]
        if len(slots) > 1:
            ambiguous.append(f"{path} could be " + " or ".join(f"{s.torch_key} ({s.kind})" for s in slots))
            continue
        if slots[0].torch_key in ours:
            ambiguous.append(f"{ours[slots[0].torch_key][0]} and {path} both become {slots[0].torch_key}")
            continue
        ours[slots[0].torch_key] = path, np.ascontiguousarray(to_torch(slots[0].rule, np.asarray(param[...])))
    for group in declared_groups(plan):
        source = next((name for name in group if name in ours), None)
        for name in group if source else ():
            ours.setdefault(name, ours[source])
    out, source = {}, {}
    for name, (path, array) in ours.items():
        key = apply_rename(name, pairs)
        if key in source:
            if source[key] != path:  # one parameter under two tied names that the rename joins is one key
                ambiguous.append(f"{source[key]} and {path} both become {key}")
            continue
        source[key], out[key] = path, array
    if ambiguous:
        raise _refusal(ambiguous=ambiguous)
    return out


def load_state_dict(model, state: Mapping[str, Any], strict: bool = True, rename=None, *,
                    seed: int = 0) -> LoadResult:
    """Load torch-named weights (torch tensors or numpy arrays) into a Flax NNX model.

    Any NNX model whose parameter paths follow the torch module's loads: each key goes to
    the Flax module at its path, by the family's table or else the module's type (see
    the module docstring). Every key is checked before anything is written. With
    ``strict=True`` missing and unexpected keys raise; shape mismatches and keys placed
    two ways (two keys on one parameter, one key fitting two kinds of layer) always
    raise. Values are cast to each parameter's own dtype (``param_dtype``), so bf16
    weights load into fp32 models and the other way round.

    Tied keys (one tensor under two names) are placed once: a key with no place of its own
    is taken when another name of its tensor has one. They are known tied when their values
    share memory (a torch state_dict, or ``.numpy()`` views of it) or when the model declares
    them (``tied_keys``; their values must then be equal).

    Args:
        rename: ``[(regex, replacement), ...]`` applied with ``re.sub``, in order, to
            each key before it is placed, for checkpoints that name things differently.
        seed: seeds the RNG state (dropout keys) that ``nnx.eval_shape`` left abstract.

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)``, as torch's ``load_state_dict``.
    """
    pairs = check_rename(rename)
    check_state_dict_mapping(state)
    return _load(model, state, strict, pairs, seed=seed)


def _load(model, state: Mapping[str, Any], strict: bool, pairs, optional=frozenset(), seed: int = 0) -> LoadResult:
    """``load_state_dict``; keys in ``optional`` (torch buffers) are skipped where nothing takes them."""
    plan = plan_of(model)
    params = plan.params
    refuse_abstract_state(model)  # before any work: nothing in the weights could fill it
    by_key: dict[str, list[tuple[str, Slot]]] = {}
    for path, slots in plan.slots.items():
        for slot in slots:
            by_key.setdefault(slot.torch_key, []).append((path, slot))
    renamed = {key: apply_rename(key, pairs) for key in state}
    shown = {key: key if name == key else f"{key} (renamed {name})" for key, name in renamed.items()}
    tie = tie_groups(plan, state, renamed)
    present = {}  # our name -> the state's keys of its tied group
    for key, name in renamed.items():
        for member in tie.get(name, ()):
            present.setdefault(member, []).append(key)
    placed, claims, unexpected, why, ambiguous = [], {}, [], {}, []
    contested: set[str] = set()
    for key, name in renamed.items():
        targets = by_key.get(name, [])
        if len(targets) > 1:
            ambiguous.append(f"{shown[key]} fits " + " and ".join(f"{slot.kind} -> {path}" for path, slot in targets))
            contested.update(path for path, _ in targets)  # placed twice, not missing
        elif targets:
            placed.append((key, *targets[0]))
            claims.setdefault(targets[0][0], []).append(key)
        elif any(by_key.get(member) for member in tie.get(name, ())):
            continue  # another name of its tensor has a place: placed there, once
        elif key not in optional:
            unexpected.append(key)
            why[shown[key]] = why_not_placed(plan, name)
    for path, keys in claims.items():
        if len(keys) > 1:  # even one tied tensor's names: a rename that joins names hides other mistakes
            tied_note = (" (one tied tensor: tied keys load with no rename; leave it out)"
                         if all(k in present.get(renamed[keys[0]], ()) for k in keys) else "")
            ambiguous.append(" and ".join(shown[k] for k in keys) + f" all land on {path}{tied_note}")
    for path in params:  # a tied name the state lacks takes its tensor from a name the state has
        slots = plan.slots[path]
        donors = present.get(slots[0].torch_key, ())
        if path not in claims and path not in contested and len(slots) == 1 and donors:
            placed.append((donors[0], path, slots[0]))
            claims[path] = [donors[0]]
    tied = [c for keys in {tuple(ks) for ks in present.values() if len(ks) > 1}
            for c in conflicts(state, list(keys), shown)]
    updates, mismatched = {}, []
    for original_key, path, slot in placed:
        try:
            original = _to_numpy(state[original_key])
        except (TypeError, ValueError) as error:
            raise TypeError(f"state_dict[{original_key!r}] is not an array ({type(state[original_key]).__name__}: "
                            f"{error}); nothing was loaded") from None
        if original.ndim != len(params[path].shape):
            mismatched.append((original_key, tuple(original.shape), torch_shape(slot.rule, params[path].shape)))
            continue
        array = to_flax(slot.rule, original)
        if tuple(array.shape) != tuple(params[path].shape):
            # both shapes in the checkpoint's (torch) layout
            mismatched.append((original_key, tuple(original.shape), torch_shape(slot.rule, params[path].shape)))
            continue
        _check_value(original_key, array, params[path].dtype)
        updates[path] = array
    missing = list(dict.fromkeys(plan.slots[p][0].torch_key for p in params
                                 if p not in claims and p not in contested))
    if ambiguous or mismatched or tied or (strict and (missing or unexpected)):
        if strict:
            for key in unexpected:
                why[shown[key]] += equal_hint(state, key, [p[0] for p in placed], renamed)
        raise _refusal(missing if strict else (), unexpected if strict else (), mismatched, ambiguous,
                       why if strict else None, tied)
    unfilled = [plan.slots[p][0].torch_key for p in params
                if p not in claims and isinstance(params[p].get_value(), jax.ShapeDtypeStruct)]
    if unfilled:
        raise _refusal(missing=unfilled)  # an unfilled model cannot be partly loaded
    # convert everything first: a value that cannot be cast fails before any write
    try:
        # jnp.array copies: jnp.asarray of a numpy array may alias its memory on CPU, and a torch tensor's
        # .numpy() shares the tensor's, so an in-place torch optimizer step would change the Flax weights
        converted = {path: jnp.array(array, dtype=params[path].dtype) for path, array in updates.items()}
    except (TypeError, ValueError) as error:
        raise TypeError(f"state_dict values must be numeric arrays; nothing was loaded ({error})") from None
    for path, array in converted.items():
        params[path].set_value(array)
    fill_rng_state(model, seed)
    return LoadResult(missing, unexpected)


# --------------------------------------------------------------------- twins


def _is_eval(flax_module) -> bool:
    """An NNX module is in eval mode when all of its dropouts are deterministic."""
    dropouts = [m for _, m in nnx.iter_graph(flax_module) if isinstance(m, nnx.Dropout)]
    return all(d.deterministic for d in dropouts)


def flax_class(torch_module) -> type:
    """The flax_transformer class of the same family and name as a torch_reference module."""
    module = importlib.import_module(f"flax_transformer.models.{family_of(torch_module)}")
    return getattr(module, type(torch_module).__name__)


def torch_class(flax_module) -> type:
    """The torch_reference class of the same family and name as a flax_transformer module."""
    module = importlib.import_module(f"torch_reference.{family_of(flax_module)}")
    return getattr(module, type(flax_module).__name__)


def torch_to_flax(torch_module, flax_module=None, *, rename=None, dtype=None, param_dtype=None, seed: int = 0):
    """The Flax twin of a torch module, with its weights and train/eval mode.

    Args:
        torch_module: a torch ``nn.Module``.
        flax_module: where the weights go. None builds the twin of a torch_reference
            module (unfilled, then loaded). Given, any NNX model whose parameter paths
            follow the torch module's is loaded in place, all or nothing, and returned.
            torch buffers it has no place for are skipped (a Flax model computes such
            constants); one it has a parameter of that name for loads as is.
        rename: ``[(regex, replacement), ...]`` for torch names that differ from the Flax
            model's (see ``load_state_dict``).
        dtype, param_dtype: compute and storage types of the built twin (default float32);
            with ``flax_module`` the module's own are kept, and these must be left out.
        seed: seeds the built twin's ``nnx.Rngs`` (dropout streams), or the RNG state that
            ``nnx.eval_shape`` left abstract in a given one.
    """
    pairs = check_rename(rename)
    if not callable(getattr(torch_module, "state_dict", None)):
        raise TypeError(f"torch_module must be a torch nn.Module, got {type(torch_module).__name__}")
    if flax_module is None:
        try:
            cls = flax_class(torch_module)
        except TypeError as error:
            raise TypeError(f"{error}; to port your own model, pass its Flax twin: "
                            "torch_to_flax(torch_module, flax_module)") from None
        # the types only where asked: a twin built with the defaults records (and compiles) like one built
        # by hand with them, so the two directions of a check share a compiled program
        kwargs = dict(torch_module.init_kwargs(), **{k: v for k, v in (('dtype', dtype), ('param_dtype', param_dtype))
                                                      if v is not None})
        flax_module = build_unfilled(cls, kwargs, seed=seed)
    elif not isinstance(flax_module, nnx.Module):
        raise TypeError(f"flax_module must be a Flax NNX module, got {type(flax_module).__name__}")
    elif dtype is not None or param_dtype is not None:
        raise ValueError("dtype and param_dtype say how to build the twin; flax_module is already built "
                         "and keeps its own types")
    state = torch_module.state_dict()
    buffers = frozenset(name for name, _ in torch_module.named_buffers()) & state.keys()
    _load(flax_module, state, True, pairs, optional=buffers, seed=seed)
    if torch_module.training:
        flax_module.train()
    else:
        flax_module.eval()
    return flax_module


def flax_to_torch(flax_module, torch_module=None, *, rename=None, dtype=None):
    """The torch twin of a Flax NNX module, with its weights and train/eval mode.

    Args:
        torch_module: where the weights go. None builds the torch_reference twin of a
            flax_transformer module. Given, any torch module whose keys follow
            ``state_dict(flax_module, rename=rename)`` is loaded in place, all or nothing,
            and returned; its buffers keep their own values. Every name of a tensor it ties
            is filled; a Flax model whose values for two such names differ is refused.
        rename: ``[(regex, replacement), ...]`` applied to the Flax model's torch names
            (ours -> the torch module's).
        dtype: torch dtype of the parameters; default float32 for a built twin (bfloat16
            weights are widened exactly), the module's own for a given one.
    """
    import torch

    state = state_dict(flax_module, rename=rename)
    if torch_module is None:
        try:
            cls = torch_class(flax_module)
        except TypeError as error:
            raise TypeError(f"{error}; to port your own model, pass its torch twin: "
                            "flax_to_torch(flax_module, torch_module)") from None
        kwargs = {k: v for k, v in flax_module.init_kwargs().items() if k not in ("dtype", "param_dtype")}
        torch_module = cls(**kwargs)
        dtype = dtype or torch.float32
    elif not isinstance(torch_module, torch.nn.Module):
        raise TypeError(f"torch_module must be a torch nn.Module, got {type(torch_module).__name__}")
    _load_torch(torch_module, state)
    if dtype is not None:
        torch_module.to(dtype)
    torch_module.train(not _is_eval(flax_module))
    return torch_module


def _load_torch(torch_module, state: dict[str, np.ndarray]) -> None:
    """Load ``state`` into a torch module, all or nothing; buffers that ``state`` lacks keep their values."""
    import torch

    own = torch_module.state_dict()
    state, tied = fill_torch_names(own, state)  # one torch tensor under several names: each name gets it
    buffers = {name for name, _ in torch_module.named_buffers()}
    missing = [k for k in own if k not in state and k not in buffers]
    unexpected = [k for k in state if k not in own]
    mismatched = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items()
                  if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if missing or unexpected or mismatched or tied:
        raise _refusal(missing, unexpected, mismatched, tied=tied)
    tensors = {}
    for key, array in state.items():
        if own[key].dtype.is_floating_point:  # torch's copy would turn a value beyond the range into inf
            _check_value(key, array, jnp.dtype(str(own[key].dtype).removeprefix("torch.")))
        widened = np.float32 if array.dtype.name == "bfloat16" else array.dtype  # numpy has no torch bf16
        tensors[key] = torch.from_numpy(np.array(array, dtype=widened))  # a writable copy
    torch_module.load_state_dict(tensors, strict=False)
