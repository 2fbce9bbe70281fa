"""Constructor records: a module remembers the arguments it was built with, so that porting can build its twin.

Pure Python (no JAX, no torch): both packages' modules derive from ``RecordsInit``.
"""

from __future__ import annotations

import copy
import functools
import inspect

from flax_transformer.models.arg_checks import check_constructor_args


class _Opaque:
    """Wraps an unhashable constructor argument so it can live in a module's static state."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"_Opaque({self.value!r})"


def _freeze(value):
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
        return value
    except TypeError:
        # a private copy: the caller may mutate its object later (notebook 001 sets
        # config.num_labels after building models)
        return _Opaque(copy.deepcopy(value))


def _thaw(value):
    if isinstance(value, _Opaque):
        return value.value
    if isinstance(value, tuple):
        return tuple(_thaw(v) for v in value)
    return value


class RecordsInit:
    """Mixin that remembers constructor arguments (minus ``rngs``), for porting.

    ``flax_transformer.interop.porting`` rebuilds a module's twin in the other framework from
    them, so porting needs no per-class knowledge of signatures. The arguments are
    stored hashable (lists become tuples) because NNX keeps them in the static graph.
    A class may declare ``_init_converters = {"config": SomeConfig.from_any}`` to record
    an argument in a canonical, immutable form. Before ``__init__`` runs, the arguments
    are checked by name (``CONSTRUCTOR_CHECKS``: sizes, layer counts, dropout rates, eps).
    """

    _init_converters: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            return
        init = cls.__init__
        signature = inspect.signature(init)

        @functools.wraps(init)
        def recording_init(self, *args, **kw):
            try:
                bound = signature.bind(self, *args, **kw)
            except TypeError:
                bound = None  # wrong arguments: let __init__ raise its own TypeError
            if bound is not None:
                check_constructor_args(cls.__name__, bound.arguments)  # before anything is built
            init(self, *args, **kw)
            if type(self) is cls:
                del bound.arguments["self"]
                bound.arguments.pop("rngs", None)
                convert = type(self)._init_converters
                self._init_args = tuple((k, _freeze(convert[k](v) if k in convert else v))
                                        for k, v in bound.arguments.items())

        cls.__init__ = recording_init

    def init_kwargs(self) -> dict:
        """The constructor's keyword arguments, as given (without ``rngs``)."""
        return {k: _thaw(v) for k, v in self._init_args}
