"""A Flax porting target built with ``nnx.eval_shape``: its RNG state filled, other abstract state refused.

``nnx.eval_shape`` (as the docs build targets, so that porting draws no random numbers) leaves every
variable abstract, dropout RNG streams and batch statistics included. Loading fills the parameters;
the RNG streams get keys from a seed here, so the model runs; any other abstract state has no value
in the torch weights, and is refused before anything is loaded, with the fix in the message.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx


def abstract_state(model) -> tuple[list, list[str]]:
    """What ``nnx.eval_shape`` left abstract besides parameters: ([(index, RNG variable)], [other "path (type)"])."""
    rngs, others = [], []
    for i, (path, variable) in enumerate(nnx.iter_graph(model)):
        if (isinstance(variable, nnx.Variable) and not isinstance(variable, nnx.Param)
                and isinstance(variable.get_value(), jax.ShapeDtypeStruct)):
            if isinstance(variable, (nnx.RngKey, nnx.RngCount)):
                rngs.append((i, variable))
            else:
                others.append(f"{'.'.join(map(str, path))} ({type(variable).__name__})")
    return rngs, others


def refuse_abstract_state(model) -> None:
    """Refuse a target whose non-parameter state (not RNG) is abstract: no torch weight gives its values."""
    others = abstract_state(model)[1]
    if others:
        raise ValueError(f"{type(model).__name__} was built with nnx.eval_shape, which left state that is not a "
                         f"parameter abstract ({len(others)}): {', '.join(others)}; the torch weights cannot fill "
                         "it: build the target concretely (Model(..., rngs=nnx.Rngs(0))) or give it values before "
                         "porting; nothing was loaded")


def fill_rng_state(model, seed: int) -> None:
    """Give the RNG streams that ``nnx.eval_shape`` left abstract concrete keys from ``seed`` and zero counts."""
    base = jax.random.key(seed)
    for i, variable in abstract_state(model)[0]:
        abstract = variable.get_value()
        if isinstance(variable, nnx.RngCount):
            variable.set_value(jnp.zeros(abstract.shape, abstract.dtype))
            continue
        key = jax.random.fold_in(base, i)  # one stream per variable: its place in the graph
        key = jax.random.split(key, abstract.shape) if abstract.shape else key
        typed = jax.dtypes.issubdtype(abstract.dtype, jax.dtypes.prng_key)
        variable.set_value(key if typed else jax.random.key_data(key).astype(abstract.dtype))


@contextlib.contextmanager
def tracer_origins_unexplained():
    """While tracing, a tracer's errors do not say where its value came from (jax-ml/jax#40041).

    A tracer's ``.sharding`` raises AttributeError, and jax (0.10) builds that error's message by
    walking every equation traced so far. flax NNX's ``Variable.set_value`` probes
    ``getattr(value, "sharding", None)`` at each RNG count update (``rngs.params()``: one per
    initialised weight), and ``getattr`` throws the message away: building a model under
    ``nnx.eval_shape`` took time quadratic in its size (all-MiniLM-L6-v2: 27 s, 6 s without the
    walk). Errors raised meanwhile keep their text, less that origin paragraph. A jax without the
    hook is left as it is.
    """
    from jax._src.interpreters import partial_eval

    tracer = getattr(partial_eval, "DynamicJaxprTracer", None)
    if tracer is None or not callable(vars(tracer).get("_origin_msg")):
        yield
        return
    original = vars(tracer)["_origin_msg"]
    tracer._origin_msg = lambda self: ""
    try:
        yield
    finally:
        tracer._origin_msg = original


def build_unfilled(cls, kwargs: dict, *, seed: int = 0):
    """Build a Flax module without initialising its parameters (they stay abstract).

    Random initialisation of a large model costs time and memory that porting throws
    away. ``nnx.eval_shape`` gives the structure; the dropout RNG streams get concrete
    keys here, and the parameters are filled by ``load_state_dict``.
    """
    with tracer_origins_unexplained():
        abstract = nnx.eval_shape(lambda: cls(**kwargs, rngs=nnx.Rngs(seed)))
    others = abstract_state(abstract)[1]
    if others:
        raise TypeError(f"cannot build {cls.__name__} unfilled: unexpected state {', '.join(others)}")
    fill_rng_state(abstract, seed)
    return abstract
