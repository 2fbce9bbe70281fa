"""Values between torch, numpy and JAX, and the compiled calls both ``verify`` and ``bisect`` make.

Also what ``compare`` and ``bisect`` share beyond that: any output structure as ``{path: leaf}``
(``flatten``, ``freeze``, ``pair_paths``), the scalar ``grads=True`` differentiates (``loss_fn=`` or
the default ``sum_i <output_i, W_i>``), and which gradients are compared with which (``grad_keys``:
``rename=`` and tied tensors).

torch is imported only inside functions: a torch tensor is recognised by its type's module.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop.layer_kinds import apply_rename, check_rename


def leaves(x):
    """The leaves of nested tuples and lists (a model's outputs), in order."""
    if isinstance(x, (tuple, list)):
        for item in x:
            yield from leaves(item)
    else:
        yield x


def is_torch(a) -> bool:
    return type(a).__module__.startswith("torch") and hasattr(a, "detach")


def to_numpy(a):
    """A torch tensor, JAX or numpy array as numpy; anything else (None, a Python scalar) unchanged."""
    if is_torch(a):
        a = a.detach().cpu()
        return (a.float() if str(a.dtype) == "torch.bfloat16" else a).numpy()  # numpy has no bf16: widened exactly
    return np.asarray(a) if isinstance(a, (np.ndarray, jax.Array)) else a


def to_torch(a):
    """numpy / JAX / torch -> a torch tensor (a copy of numpy's memory); anything else unchanged."""
    import torch

    if is_torch(a):
        return a
    return torch.from_numpy(np.array(a)) if isinstance(a, (np.ndarray, jax.Array)) else a


def to_jax(a):
    """numpy / torch / JAX -> a JAX array; anything else unchanged."""
    a = to_numpy(a)
    return jnp.asarray(a) if isinstance(a, np.ndarray) else a


def nonfinite(reference, other) -> tuple[int, int, int, int]:
    """Where two arrays of one shape hold NaN or inf: (in ``reference`` only, in ``other`` only,
    in both as the same value, in both as different values: NaN against inf, +inf against -inf).

    Non-finite values never agree: the verdicts fail on any of these counts, the third ("not
    finite in either framework") excepted only when the caller allows it explicitly."""
    a = np.atleast_1d(np.asarray(reference, np.float64))
    b = np.atleast_1d(np.asarray(other, np.float64))
    bad_a, bad_b = ~np.isfinite(a), ~np.isfinite(b)
    both = bad_a & bad_b
    same = both & ((np.isnan(a) & np.isnan(b)) | (a == b))
    return (int((bad_a & ~bad_b).sum()), int((bad_b & ~bad_a).sum()), int(same.sum()), int((both & ~same).sum()))


def finite_abs_err(a, b) -> float:
    """max |a - b| in float64 over the positions finite in both; inf when the two are not finite
    at the same positions (NaN or inf on one side, or different non-finite values)."""
    a64 = np.atleast_1d(np.asarray(a, np.float64))
    b64 = np.atleast_1d(np.asarray(b, np.float64))
    only_a, only_b, _, differ = nonfinite(a64, b64)
    if only_a or only_b or differ:
        return float("inf")
    keep = np.isfinite(a64) & np.isfinite(b64)
    return float(np.abs(a64[keep] - b64[keep]).max(initial=0.0))


def max_abs_err(torch_out, flax_out) -> tuple[float, bool]:
    """Largest |torch - flax| over all outputs (``finite_abs_err``: inf when NaN or inf appear on
    one side only), and whether every value is finite (False also for NaN on both sides: a
    caller that reads ``finite`` never passes a non-finite output)."""
    err, finite = 0.0, True
    for a, b in zip(leaves(torch_out), leaves(flax_out), strict=True):
        a, b = np.asarray(to_numpy(a)), np.asarray(to_numpy(b))
        if a.shape != b.shape:
            raise AssertionError(f"output shapes differ: torch {a.shape} vs flax {b.shape}")
        finite &= bool(np.isfinite(a).all() and np.isfinite(b).all())
        err = max(err, finite_abs_err(a, b))
    return err, finite


@nnx.jit
def apply(module, args, kwargs):
    """One jitted wrapper for every comparison, so its compile cache is shared: the two
    directions of a check (same module structure, same shapes) compile once, not twice."""
    return module(*args, **kwargs)


# ------------------------------------------------------------------ any output structure


def is_array(a) -> bool:
    """A torch tensor, numpy or JAX array (a tracer too): a leaf compared by value, not by ``==``."""
    return is_torch(a) or isinstance(a, (np.ndarray, np.generic, jax.Array))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Static:
    """A leaf that is not an array (a string, an int), carried out of a compiled function in the
    output's structure, where JAX keeps it, rather than as a value, which JAX cannot return."""

    value: Any


@dataclasses.dataclass(frozen=True)
class SetAside:
    """An output leaf that is not compared, by its type, and why: a transformers cache (a model run
    with ``use_cache=True``, transformers' default, returns its key/value cache beside the logits;
    ``Cache`` objects, and transformers 4's tuples of tensors in a ``ModelOutput``'s cache field)."""

    value: Any
    why: str


# A ``ModelOutput``'s fields that hold transformers' cache, whatever its type (transformers 4 returns
# tuples of tensors there; 5 a ``Cache`` object, under ``cache`` from 5.x on, ``past_key_values`` before).
CACHE_FIELDS = ("cache", "past_key_values", "cache_params")


def _transformers_type(value, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("transformers.") for c in type(value).__mro__)


def set_aside(value, key=None, parent=None) -> SetAside | None:
    """``value`` as a ``SetAside`` when it is a cache (by its type, or as a ``ModelOutput``'s
    ``CACHE_FIELDS`` entry), else None: it is compared."""
    if _transformers_type(value, "Cache"):
        why = f"a {type(value).__name__}"
    elif key in CACHE_FIELDS and parent is not None and _transformers_type(parent, "ModelOutput"):
        why = f"transformers' {key} field"
    else:
        return None
    return SetAside(value, why + ": the model ran with use_cache=True (pass use_cache=False to leave it out)")


def set_aside_lines(out) -> list[str]:
    """``"PATH (why)"`` for every leaf of ``out`` that ``flatten`` sets aside."""
    return [f"{p} ({v.why})" for p, v in flatten(out) if isinstance(v, SetAside)]


class Flat(dict):
    """An output as ``{path: leaf}`` (``freeze``): a pytree whatever the model returned, so it leaves
    ``nnx.jit`` intact (a plain dataclass or a string does not)."""


jax.tree_util.register_pytree_node(Flat, lambda f: (tuple(f.values()), tuple(f.keys())),
                                   lambda keys, values: Flat(zip(keys, values)))


def _key(k) -> str:
    return f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]"


def flatten(tree, path: str = "output") -> list[tuple[str, Any]]:
    """The leaves of any output structure with their paths, in order: ``output[0]`` in a tuple or
    list, ``output.logits`` for a dict's or HF ``ModelOutput``'s key, a dataclass's or namedtuple's
    field. A leaf is an array (torch, numpy, JAX), ``None`` or anything else (a string, an int).
    An HF ``ModelOutput`` lists only its fields that are not None (it is a dict of those). A cache
    is one ``SetAside`` leaf (``set_aside``): not compared, and listed by ``set_aside_lines``."""
    if isinstance(tree, Flat):
        return [(p, v.value if isinstance(v, Static) else v) for p, v in tree.items()]
    if tree is None or is_array(tree) or isinstance(tree, (str, bytes, int, float, complex, Static, SetAside)):
        return [(path, tree.value if isinstance(tree, Static) else tree)]
    if (aside := set_aside(tree)) is not None:
        return [(path, aside)]
    if isinstance(tree, Mapping):
        return [leaf for k, v in tree.items()
                for leaf in flatten(set_aside(v, k, tree) or v if v is not None else v, path + _key(k))]
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple: by field name
        return [leaf for k in tree._fields for leaf in flatten(getattr(tree, k), f"{path}.{k}")]
    if isinstance(tree, (tuple, list)):
        return [leaf for i, v in enumerate(tree) for leaf in flatten(v, f"{path}[{i}]")]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return [leaf for f in dataclasses.fields(tree) for leaf in flatten(getattr(tree, f.name), f"{path}.{f.name}")]
    return [(path, tree)]


def float_leaves(tree) -> dict[str, np.ndarray]:
    """{path: array} of the floating-point leaves of any output structure (``frameworks.flatten``), as numpy."""
    out = {}
    for path, leaf in flatten(tree):
        a = to_numpy(leaf)
        if isinstance(a, np.ndarray) and jnp.issubdtype(a.dtype, jnp.floating):  # bfloat16 too (kind "V")
            out[path] = a
    return out


def freeze(tree) -> Flat:
    """``flatten`` as a pytree that any compiled function can return (non-array leaves as ``Static``)."""
    return Flat((p, v if v is None or is_array(v) else Static(v)) for p, v in flatten(tree))


def pair_paths(torch_paths: list[str], flax_paths: list[str]) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """Which output leaf of torch goes with which of Flax: by path when both have the same paths;
    else by position when both have as many (a torch ``ModelOutput`` against a Flax tuple); else
    the paths both have, and the rest on one side only. Returns (pairs, torch only, flax only)."""
    if set(torch_paths) == set(flax_paths):
        return [(p, p) for p in torch_paths], [], []
    if len(torch_paths) == len(flax_paths):
        return list(zip(torch_paths, flax_paths)), [], []
    common = set(flax_paths)
    return ([(p, p) for p in torch_paths if p in common], [p for p in torch_paths if p not in common],
            [p for p in flax_paths if p not in set(torch_paths)])


def show(x) -> str:
    """A leaf for a report line: an array by shape and dtype, anything else by repr (cut at 40)."""
    if is_array(x):
        return f"array{tuple(np.shape(x))} {getattr(x, 'dtype', '')}".rstrip()
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _same(a, b) -> bool:
    """Non-array leaves agree: same type and equal (NaN never equals itself: non-finite never agrees)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an == that is no truth value
        return False


def match_outputs(torch_out, flax_out) -> tuple[list[tuple[str, str, Any, Any]], list[dict], list[str]]:
    """The two frameworks' outputs leaf by leaf (``pair_paths`` on the leaves that are not None):
    (arrays to compare by value, as (name, torch path, torch leaf, flax leaf), with a Python number
    against an array among them; every other leaf as {"output", "torch", "flax", "equal"}, None
    against None or an absent leaf equal (an HF ``ModelOutput`` drops its None fields), a cache set
    aside on either side (``SetAside``: listed by ``set_aside_lines``, never paired); what
    differs: a non-array leaf unequal or of another type, a leaf on one side only)."""
    t_leaves, j_leaves = flatten(torch_out), flatten(flax_out)
    t_vals = {p: v for p, v in t_leaves if v is not None and not isinstance(v, SetAside)}  # caches: set_aside_lines
    j_vals = {p: v for p, v in j_leaves if v is not None and not isinstance(v, SetAside)}
    pairs, torch_only, flax_only = pair_paths(list(t_vals), list(j_vals))
    arrays, others, mismatched = [], [], []
    for tp, jp in pairs:
        a, b = t_vals[tp], j_vals[jp]
        name = tp if tp == jp else f"{tp} (flax {jp})"
        if (is_array(a) or is_array(b)) and all(is_array(x) or _number(x) for x in (a, b)):
            arrays.append((name, tp, a, b))
            continue
        equal = _same(a, b)
        others.append({"output": name, "torch": show(a), "flax": show(b), "equal": equal})
        if not equal:
            mismatched.append(f"{name}: torch {show(a)}, flax {show(b)}")
    mismatched += [f"{p}: only in torch ({show(t_vals[p])})" for p in torch_only]
    mismatched += [f"{p}: only in flax ({show(j_vals[p])})" for p in flax_only]
    t_none, j_none = [p for p, v in t_leaves if v is None], [p for p, v in j_leaves if v is None]
    for p in dict.fromkeys(p for p in t_none + j_none if p not in t_vals and p not in j_vals):
        others.append({"output": p, "torch": "None" if p in t_none else "absent",
                       "flax": "None" if p in j_none else "absent", "equal": True})
    return arrays, others, mismatched


def output_problems(torch_out, flax_out) -> tuple[list[str], list[str]]:
    """What of a whole model's outputs a module-by-module check cannot vouch for, beside its float
    arrays (which its rows compare): (leaves that differ outright: a non-array leaf unequal, a leaf
    on one side only, an integer or bool array (ids, a mask, labels: no row compares them) not equal
    value for value; array leaves that are not numbers, which cannot be compared by value).
    ``bisect`` fails on the first, and counts the second as not compared."""
    arrays, _, differ = match_outputs(torch_out, flax_out)
    not_compared = []
    for name, _, a, b in arrays:
        a, b = np.asarray(to_numpy(a)), np.asarray(to_numpy(b))
        kinds = {"f" if x.dtype.name == "bfloat16" else x.dtype.kind for x in (a, b)}  # bfloat16: numpy's "V"
        if not kinds <= set("biuf"):
            not_compared.append(name)
        elif kinds != {"f"} and (a.shape != b.shape or not np.array_equal(a, b)):
            how = (f"shape {list(a.shape)} vs {list(b.shape)}" if a.shape != b.shape
                   else f"{int(np.count_nonzero(a != b))} of {a.size} values differ")
            differ = differ + [f"{name}: torch {show(a)}, flax {show(b)}: {how}"]
    return differ, not_compared


# ------------------------------------------------------------------ the scalar grads=True differentiates


def split_loss_fn(loss_fn) -> tuple[Any, Any]:
    """``loss_fn=`` as (torch's, Flax's): one function for both, or a pair (torch_fn, flax_fn)."""
    if loss_fn is None:
        return None, None
    if isinstance(loss_fn, (tuple, list)) and len(loss_fn) == 2 and all(map(callable, loss_fn)):
        return loss_fn[0], loss_fn[1]
    if callable(loss_fn):
        return loss_fn, loss_fn
    raise ValueError(f"loss_fn must be a function of the outputs or a pair (torch_fn, flax_fn), got "
                     f"{type(loss_fn).__name__}")


def default_weights(torch_out, seed: int) -> dict[str, np.ndarray]:
    """{path: W} for every floating output leaf of torch: the fixed random weights of the default
    scalar ``sum_i <output_i, W_i>`` (standard normal, float32, drawn in path order from ``seed``)."""
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(tuple(leaf.shape)).astype(np.float32) for p, leaf in flatten(torch_out)
            if is_torch(leaf) and leaf.is_floating_point()}


def torch_scalar(out, weights: dict[str, np.ndarray], loss_fn=None):
    """torch's scalar to differentiate: ``loss_fn(out)``, else ``sum_i <output_i, W_i>`` over ``weights``."""
    if loss_fn is not None:
        value = loss_fn(out)
        if not is_torch(value) or value.numel() != 1:
            raise ValueError(f"loss_fn must return one number (a tensor of one element) for torch, got "
                             f"{_describe(value)}")
        if not value.requires_grad:
            raise ValueError("loss_fn's value does not depend on the torch model's parameters (it has no grad_fn)")
        return value.reshape(())
    leaves = dict(flatten(out))
    return sum((leaves[p] * _torch_tensor(w, leaves[p].dtype).to(leaves[p].device)).sum()  # W beside the output (CUDA)
               for p, w in weights.items())


def _torch_tensor(w: np.ndarray, dtype):
    import torch

    return torch.from_numpy(w).to(torch.float64 if dtype == torch.float64 else torch.float32)


def _describe(value) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else type(value).__name__


def _flax_scalar(out, weights: dict, torch_paths: tuple[str, ...], loss_fn):
    if loss_fn is not None:
        value = loss_fn(out)
        if not isinstance(value, jax.Array) or value.size != 1:
            raise ValueError(f"loss_fn must return one number (an array of one element) for JAX, got "
                             f"{_describe(value)}")
        return jnp.reshape(value, ())
    leaves = {p: v for p, v in flatten(out) if v is not None}
    pairs, _, _ = pair_paths(list(torch_paths), list(leaves))
    terms = [(leaves[j].astype(weights[t].dtype) * weights[t]).sum() for t, j in pairs
             if t in weights and isinstance(leaves[j], jax.Array)]  # another leaf there: compare says it differs
    return sum(terms, jnp.zeros((), jnp.float32))


# ------------------------------------------------------------------ the compiled calls


@nnx.jit
def apply_flat(module, args, kwargs) -> Flat:
    """``apply`` with its output as ``freeze`` gives it: for outputs JAX cannot return as they are
    (a plain dataclass, a string), which ``apply`` refuses."""
    return freeze(module(*args, **kwargs))


@functools.partial(nnx.jit, static_argnames=("torch_paths", "loss_fn"))
def flax_grads(module, args, kwargs, weights: dict, torch_paths: tuple[str, ...] = (), loss_fn=None):
    """(outputs as ``freeze`` gives them, d scalar / d parameters), in one compiled function. The
    scalar is ``loss_fn(outputs)``, else ``sum_i <output_i, W_i>`` with ``weights`` {torch path: W}
    placed on the Flax leaves by ``pair_paths`` (``torch_paths``: torch's leaves that are not None)."""
    def loss(m):
        out = m(*args, **kwargs)
        return _flax_scalar(out, weights, torch_paths, loss_fn), freeze(out)
    (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(module)
    return out, grads


# ------------------------------------------------------------------ which gradient is compared with which


@dataclasses.dataclass(frozen=True)
class GradKey:
    """One gradient to compare: a torch tensor's, named by its first torch key."""

    name: str
    torch: tuple[str, ...]  # torch parameters (distinct tensors) whose gradients add up to it
    flax: tuple[str, ...]  # Flax parameters, by their torch names, whose gradients add up to it
    tied: tuple[str, ...] = ()  # every torch key of the tensor, when it has several

    @property
    def note(self) -> str:
        """"tied: lm_head.weight = tok_emb.weight" (and how often Flax holds it), or ""."""
        parts = [f"tied: {' = '.join((*self.tied[1:], self.tied[0]))}"] if self.tied else []
        if len(self.flax) > 1:
            parts.append(f"Flax holds it {len(self.flax)} times ({', '.join(self.flax)}), gradients summed")
        return "; ".join(parts)


def grad_keys(torch_model, flax_names, rename=None, flax_tied=(), *,
              torch_tied=None) -> tuple[list[GradKey], list[str]]:
    """(one ``GradKey`` per torch tensor, the Flax parameters no torch key reaches).

    A torch key reaches the Flax parameter whose torch name it becomes after ``rename`` (porting's
    ``[(regex, replacement)]``, applied in order). Keys of one tensor form one group: torch's
    (``porting.tied_keys``: shared memory) joined with those the Flax model declares one tensor
    (``flax_tied``: ``porting.tied_keys(flax_model)``, its ``tied_keys`` attributes). A group's
    gradient is the sum over its distinct tensors on each side: torch's autograd has summed a
    shared tensor's uses already; a Flax twin holds it once (a head through ``embed.attend``, or a
    declared tie that ``porting.state_dict`` writes under each name: counted once) or once per use
    (two parameters: their gradients summed). ``torch_tied``: torch's groups given (a recorded
    trace's), not read from ``torch_model``'s memory."""
    from flax_transformer.interop import porting
    from flax_transformer.interop.ties import merge_groups

    pairs = check_rename(rename)
    order = {n: i for i, (n, _) in enumerate(torch_model.named_parameters(remove_duplicate=False))}
    distinct = {n for n, _ in torch_model.named_parameters()}  # one name per tensor object
    renamed = {n: apply_rename(n, pairs) for n in order}
    declared = {k: tuple(g) for g in flax_tied for k in g}  # a Flax torch name -> the names of its tensor
    by_flax: dict[tuple, list[str]] = {}
    for n in order:
        if renamed[n] in declared:
            by_flax.setdefault(declared[renamed[n]], []).append(n)
    torch_tied = porting.tied_keys(torch_model) if torch_tied is None else torch_tied
    groups = [tuple(n for n in g if n in order) for g in torch_tied]
    groups = merge_groups([g for g in groups if len(g) > 1] + [tuple(g) for g in by_flax.values() if len(g) > 1])
    grouped = {n for g in groups for n in g}
    groups += [(n,) for n in order if n not in grouped]
    known = set(flax_names)
    keys, used = [], set()
    for group in sorted((tuple(sorted(g, key=order.get)) for g in groups), key=lambda g: order[g[0]]):
        found = [k for k in dict.fromkeys(renamed[n] for n in group) if k in known]
        used.update(found)
        flax, tensors = [], set()
        for k in found:  # one per Flax tensor: a declared tie's names are one
            if declared.get(k, (k,)) not in tensors:
                tensors.add(declared.get(k, (k,)))
                flax.append(k)
        keys.append(GradKey(group[0], tuple(n for n in group if n in distinct), tuple(flax),
                            group if len(group) > 1 else ()))
    return keys, [k for k in flax_names if k not in used]


def sum_grads(grads: dict, names: tuple[str, ...]):
    """The sum of ``grads[n]`` over ``names`` as numpy (a tensor used several times); None for no names."""
    arrays = [np.asarray(to_numpy(grads[n])) for n in names]
    return functools.reduce(np.add, arrays) if arrays else None
