"""Record every submodule call of a model, in torch and in Flax NNX: path, inputs, output.

``bisect`` compares the two frameworks module by module; this module only records.

torch: forward hooks (``register_forward_hook(..., with_kwargs=True)``) on every named module.

NNX has no hooks. Flax 0.12's ``nnx.capture(..., method_outputs=...)`` sows each method's
output, but only the output (``bisect`` also needs each call's inputs, to rerun a module
alone), only for methods a class defines itself (a subclass that inherits ``__call__`` is
missed), and as a tree by path, which loses the order of the calls. So ``nnx_calls`` wraps
``__call__`` itself: for the duration of a ``with`` block, every Module class in the model gets
a ``__call__`` that records ``(path, args, kwargs, output)`` when its instance belongs to the
model (looked up by ``id``), in the order the calls return, and is put back afterwards, also
on error. Python looks ``__call__`` up on the type, not the instance, which is why the class is
wrapped rather than the instance. The model runs under ``nnx.jit`` (the numerics ``compare``
checks) with the recorded arrays returned from the compiled function, or eagerly.

torch is imported lazily (this is a verification module).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from flax_transformer.verification import frameworks


@dataclass
class Call:
    """One call of one submodule: ``path`` in dotted form ("" is the model itself)."""

    path: str
    args: tuple
    kwargs: dict
    output: Any
    module: Any = None


def label(path: str, index: int) -> str:
    """The name of a module's ``index``-th call: ``path``, then ``path#1``, ``path#2``, ..."""
    return path if index == 0 else f"{path}#{index}"


def labelled(calls: list[Call]) -> dict[str, Call]:
    """{label: call} in call order."""
    seen: dict[str, int] = {}
    out = {}
    for call in calls:
        k = seen.get(call.path, 0)
        seen[call.path] = k + 1
        out[label(call.path, k)] = call
    return out


# ------------------------------------------------------------------------ torch


def _detach(x):
    """A copy of every tensor in a (nested) structure, so later in-place ops cannot change it."""
    if hasattr(x, "detach") and hasattr(x, "clone"):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_detach(i) for i in x) if not hasattr(x, "_fields") else type(x)(*map(_detach, x))
    if isinstance(x, dict):
        return {k: _detach(v) for k, v in x.items()}
    return x


def torch_calls(model, args: tuple, kwargs: dict, *, on_output=None) -> tuple[Any, list[Call]]:
    """Run a torch model and record every submodule call (forward hooks), in the order calls return.

    ``on_output(call)``, if given, is called inside the hook with the live (undetached) output,
    e.g. to hook its gradient. Returns (the model's output, [Call]).
    """
    calls: list[Call] = []

    def hook(path):
        def record(module, hook_args, hook_kwargs, output):
            call = Call(path, _detach(hook_args), _detach(hook_kwargs), _detach(output), module)
            calls.append(call)
            if on_output is not None:
                on_output(call, output)
        return record

    handles = [m.register_forward_hook(hook(path), with_kwargs=True) for path, m in model.named_modules()]
    try:
        out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return out, calls


# -------------------------------------------------------------------------- NNX

_ACTIVE: list | None = None  # the recorder of the running nnx_calls, or None


def _module_paths(model) -> dict[int, tuple[str, Any]]:
    """{id(module): (dotted path, module)} for every Module in the graph (shared ones once)."""
    return {id(m): (".".join(map(str, path)), m) for path, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)}


def _wrap(original):
    def __call__(self, *args, **kwargs):
        recorder = _ACTIVE
        entry = None if recorder is None else recorder[0].get(id(self))
        # a class whose __call__ calls super().__call__ on the same instance is recorded once
        if entry is None or (recorder[2] and recorder[2][-1] is self):
            return original(self, *args, **kwargs)
        recorder[2].append(self)
        try:
            out = original(self, *args, **kwargs)
        finally:
            recorder[2].pop()
        recorder[1].append(Call(entry[0], args, kwargs, out, self))
        return out

    __call__.original = original
    return __call__


@contextlib.contextmanager
def _recording(model):
    """Inside: every call of one of ``model``'s submodules is appended to the yielded list."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("nnx_calls cannot be nested")
    paths = _module_paths(model)
    patched = {}
    for _, m in paths.values():
        cls = type(m)
        if cls in patched or not any("__call__" in k.__dict__ for k in cls.__mro__):  # nnx.List, say
            continue
        own = cls.__dict__.get("__call__")
        original = getattr(cls.__call__, "original", cls.__call__)  # never wrap a wrapper
        patched[cls] = own
        cls.__call__ = _wrap(original)
    calls: list[Call] = []
    _ACTIVE = (paths, calls, [])
    try:
        yield calls
    finally:
        _ACTIVE = None
        for cls, own in patched.items():
            if own is None:
                del cls.__call__
            else:
                cls.__call__ = own


def _arrays(tree) -> tuple[list, Any]:
    """(the JAX arrays of a pytree, a function putting arrays back in their places)."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

    def rebuild(arrays):
        full = list(leaves)
        for i, a in zip(where, arrays, strict=True):
            full[i] = a
        return treedef.unflatten(full)

    return [leaves[i] for i in where], rebuild


def nnx_calls(model, args: tuple, kwargs: dict, *, use_jit: bool = True) -> tuple[Any, list[Call]]:
    """Run a Flax NNX model and record every submodule call, in the order calls return.

    Under ``use_jit`` the calls are recorded while ``nnx.jit`` traces, and their arrays come
    back as outputs of the compiled function; outputs come back as ``frameworks.freeze`` gives
    them (``{path: leaf}``), so any structure does (a plain dataclass, a string leaf), which JAX
    could not return as it is. Each ``Call.module`` is the caller's own instance.
    """
    if not use_jit:
        with _recording(model) as calls:
            out = model(*args, **kwargs)
        return out, calls
    static: list = []

    @nnx.jit
    def traced(m, a, k):
        static.clear()  # what the last trace recorded, should JAX ever trace twice
        with _recording(m) as recorded:
            result = frameworks.freeze(m(*a, **k))
        dynamic = []
        for call in recorded:
            arrays, rebuild = _arrays((call.args, call.kwargs, frameworks.freeze(call.output)))
            static.append((call.path, rebuild))
            dynamic.append(arrays)
        return result, dynamic

    out, dynamic = traced(model, args, kwargs)
    modules = {path: m for path, m in ((".".join(map(str, p)), m) for p, m in nnx.iter_graph(model))}
    calls = []
    for (path, rebuild), arrays in zip(static, dynamic, strict=True):
        call_args, call_kwargs, output = rebuild(arrays)
        calls.append(Call(path, call_args, call_kwargs, output, modules.get(path)))
    return out, calls
