"""LoRA (Hu et al., 2021) for the library's models, computed as PEFT's ``lora.Linear`` computes it.

A LoRA layer adds a low-rank update to a frozen linear layer:

    y = base(x) + scale * dropout(x) @ A @ B        A (in, r), B (r, out), scale = alpha / r

(``use_rslora=True``: scale = alpha / sqrt(r)). A starts as PEFT's does, kaiming_uniform(a=sqrt(5))
on torch's (r, in) weight, which is U(-1/sqrt(in), 1/sqrt(in)); B starts at zero, so a freshly
adapted model computes exactly what the base computed. Dropout acts on the LoRA branch's input
only, and follows ``model.eval()`` / ``model.train()``.

Layout: A and B are stored in the Flax (in, out) orientation of the kernel they adapt, so the
update ``A @ B`` has the kernel's shape. PEFT's files hold torch's ``lora_A.weight`` (r, in) and
``lora_B.weight`` (out, r): the transposes (``interop.peft`` converts).

The LoRA layers *are* the layers they adapt (``LoRALinear`` subclasses ``nnx.Linear``,
``LoRAConv1D`` the notebook/GPT-2 ``gpt.Linear``) and keep the same ``Param`` objects, so
the base weights stay at their paths (``...q_proj.kernel``, ``...c_attn.matrix``) and porting,
checkpoints and weight decay masks see the same base model. The adapters are ``LoRAParam``s
(an ``nnx.Param`` subclass) named ``lora_A`` / ``lora_B``: train only them with
``nnx.Optimizer(model, tx, wrt=LoRAParam)`` and ``nnx.grad(..., argnums=nnx.DiffState(0, LoRAParam))``.

No torch here; ``interop.peft`` reads and writes PEFT's adapter folders.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from flax_transformer.models import classic, encoder, gpt
from flax_transformer.models.fast_backward import linear_dot_general

__all__ = ["LORA_FILTER", "LoRAConfig", "LoRAConv1D", "LoRALinear", "LoRAParam", "Sizes", "apply", "config_of", "find",
           "layers", "merge", "remove", "state_sizes", "trainable", "unmerge"]


class LoRAParam(nnx.Param):
    """An adapter weight (``lora_A``, ``lora_B``): an ``nnx.Param``, so it is saved and ported as one,
    and a type of its own, so that optimizers and gradients can take only these."""


LORA_FILTER = LoRAParam  # the nnx filter of the adapters: nnx.Optimizer(model, tx, wrt=LORA_FILTER)

# the layers a LoRA can adapt, and the LoRA class of each: their weights are (in, out) both
_ADAPTABLE = (nnx.Linear, gpt.Linear)

# modules whose parent reads their kernel itself (one fused projection over heads) instead of
# calling them: a LoRA on them would be silently skipped, so ``apply`` refuses them
_FUSED_PARENTS = (encoder.AttentionHead, classic.AttentionHead)

_PLAIN_NAME = re.compile(r"\w+")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """What ``apply`` was given: PEFT's ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ``use_rslora``."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's ``scaling``)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _check_config(config: LoRAConfig) -> None:
    if isinstance(config.rank, bool) or not isinstance(config.rank, int) or config.rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {config.rank!r}")
    if isinstance(config.alpha, bool) or not isinstance(config.alpha, (int, float)) or not math.isfinite(config.alpha):
        raise ValueError(f"LoRA alpha must be a finite number, got {config.alpha!r}")
    if not (isinstance(config.dropout, (int, float)) and 0.0 <= config.dropout < 1.0):
        raise ValueError(f"LoRA dropout must be in [0, 1), got {config.dropout!r}")


# One compiled program per shape for what runs eagerly once per layer (initialising, merging):
# unjitted, each of their primitives would be compiled on its own, for every shape.
@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _init_a(key, shape: tuple[int, int], dtype):
    """PEFT's A: kaiming_uniform(a=sqrt(5)) on torch's (r, in) weight is U(-1/sqrt(in), 1/sqrt(in)); ours is (in, r)."""
    bound = 1.0 / math.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


@jax.jit
def _update(a, b, scale):
    """scale * A @ B in float32: (in, r) @ (r, out) -> (in, out)."""
    return scale * (a.astype(jnp.float32) @ b.astype(jnp.float32))


@jax.jit
def _shifted(weight, a, b, scale):
    """weight + scale * A @ B, summed in float32, stored back in the weight's dtype."""
    return (weight.astype(jnp.float32) + _update(a, b, scale)).astype(weight.dtype)


class _LoRA:
    """The adapter part of a LoRA layer; mixed in before the base layer class it adapts."""

    _weight = "kernel"  # the base's weight leaf, (in, out)

    def __init__(self, base, config: LoRAConfig, *, rngs: nnx.Rngs, deterministic: bool = False,
                 dtype=None, param_dtype=None):
        """Take over ``base``'s attributes (its ``Param`` objects themselves) and add the adapter.

        Args:
            base: the layer to adapt, of this class's base type.
            config: rank, alpha, dropout, rsLoRA.
            deterministic: the dropout's starting mode (``apply`` passes the model's).
            dtype: compute type of the LoRA branch; default the base's (float32 where it has none).
            param_dtype: storage type of A and B; default the base weight's.
        """
        for name, value in vars(base).items():
            if not name.startswith("_pytree__"):  # nnx's own bookkeeping stays this object's
                setattr(self, name, nnx.data(value) if base._pytree__nodes.get(name) else value)
        weight = getattr(base, self._weight)
        d_in, d_out = weight.shape
        param_dtype = param_dtype or weight.dtype
        self.lora_config = config
        self.lora_dtype = dtype or getattr(base, "dtype", None) or jnp.float32
        self.lora_scale = config.scale
        self.lora_A = LoRAParam(_init_a(rngs.params(), (d_in, config.rank), jnp.dtype(param_dtype)))
        self.lora_B = LoRAParam(jnp.zeros((config.rank, d_out), param_dtype))
        self.lora_dropout = nnx.Dropout(config.dropout, deterministic=deterministic, rngs=rngs)
        self.merged = False

    def delta(self, x):
        """The LoRA branch alone: (..., in) -> (..., out), ``scale * dropout(x) @ A @ B`` in ``lora_dtype``."""
        h = self.lora_dropout(x.astype(self.lora_dtype))
        dims = (((h.ndim - 1,), (0,)), ((), ()))
        h = linear_dot_general(h, self.lora_A[...].astype(self.lora_dtype), dims)  # (..., r)
        h = linear_dot_general(h, self.lora_B[...].astype(self.lora_dtype), dims)  # (..., out)
        return h * self.lora_scale  # scaled after B, as PEFT's lora_B(lora_A(x)) * scaling

    def __call__(self, x, *args, **kwargs):
        """(..., in) -> (..., out): the base layer's output plus the LoRA branch (the base alone once merged)."""
        y = super().__call__(x, *args, **kwargs)
        if self.merged:
            return y
        return y + self.delta(x).astype(y.dtype)

    def update_matrix(self) -> jax.Array:
        """scale * A @ B: (in, out), what ``merge`` adds to the base weight, in float32."""
        return _update(self.lora_A[...], self.lora_B[...], self.lora_scale)

    def _shift(self, sign: float) -> None:
        weight = getattr(self, self._weight)
        weight.set_value(_shifted(weight[...], self.lora_A[...], self.lora_B[...], sign * self.lora_scale))


class LoRALinear(_LoRA, nnx.Linear):
    """An ``nnx.Linear`` (kernel (in, out)) with a LoRA update: PEFT's ``lora.Linear`` on ``nn.Linear``."""


class LoRAConv1D(_LoRA, gpt.Linear):
    """A ``gpt.Linear`` (``matrix`` (in, out): GPT-2's Conv1D) with a LoRA update: PEFT's ``lora.Linear``
    with ``fan_in_fan_out=True``."""

    _weight = "matrix"


_LORA_CLASS = {nnx.Linear: LoRALinear, gpt.Linear: LoRAConv1D}


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


def layers(model) -> dict[str, _LoRA]:
    """Dotted path -> LoRA layer, for every LoRA layer of ``model``, in graph order."""
    return {_dotted(path): node for path, node in nnx.iter_graph(model) if isinstance(node, _LoRA)}


def _matches(target: str, name: str, dotted: str) -> bool:
    """PEFT's rule: a plain name is the last path part, anything else a regex on the whole dotted path."""
    if _PLAIN_NAME.fullmatch(target):
        return name == target
    return re.fullmatch(target, dotted) is not None


def _set_child(parent, key, child) -> None:
    if isinstance(key, int):  # an item of an nnx.List / Sequential
        parent[key] = child
    else:
        setattr(parent, key, child)


def _in_eval_mode(model) -> bool:
    """True when the model's dropouts run deterministically (eval mode); False with none."""
    dropouts = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Dropout)]
    return bool(dropouts) and all(d.deterministic for d in dropouts)


def _nodes(model) -> dict[tuple, object]:
    """Path tuple -> node, for the model (``()``) and everything under it."""
    return {(): model, **{tuple(path): node for path, node in nnx.iter_graph(model) if path}}


def find(model, targets: str | Sequence[str]) -> list[str]:
    """The dotted paths of the layers ``apply(model, targets=targets)`` would adapt, checked as it checks them."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return [_dotted(path) for path in _find(model, targets, _nodes(model))]


def _find(model, targets: tuple[str, ...], nodes: dict) -> list[tuple]:
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"LoRA targets must be non-empty module names or regexes, got {targets!r}")
    for target in targets:
        if not _PLAIN_NAME.fullmatch(target):
            try:
                re.compile(target)
            except re.error as error:
                raise ValueError(f"LoRA target {target!r} is not a valid regex: {error}") from None
    found, hits = [], dict.fromkeys(targets, 0)
    for path, node in nodes.items():
        if not path or not isinstance(node, nnx.Module):
            continue
        dotted = _dotted(path)
        matched = [t for t in targets if _matches(t, str(path[-1]), dotted)]
        if not matched:
            continue
        for t in matched:
            hits[t] += 1
        if not isinstance(node, _ADAPTABLE):
            raise ValueError(f"LoRA target {matched[0]!r} matches {dotted}, a {type(node).__name__}, "
                             "not a linear layer (nnx.Linear or gpt.Linear)")
        parent = nodes[path[:-1]]
        if isinstance(parent, _FUSED_PARENTS):
            raise ValueError(f"LoRA target {matched[0]!r} matches {dotted}, a per-head projection that "
                             f"{type(parent).__module__.rsplit('.', 1)[-1]}.MultiHeadAttention reads as one fused "
                             "kernel, so a LoRA there would be skipped; target the attention's output and "
                             "feed-forward layers instead")
        found.append(path)
    unmatched = [t for t, n in hits.items() if n == 0]
    if unmatched:
        names = sorted({str(p[-1]) for p, n in nodes.items() if p and isinstance(n, _ADAPTABLE)})
        raise ValueError(f"LoRA targets {unmatched} match no module of the {type(model).__name__}; "
                         f"its linear layers are named {names}")
    return found


def apply(model, *, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
          targets: str | Sequence[str] = ("q_proj", "v_proj"), use_rslora: bool = False, rngs: nnx.Rngs,
          dtype=None, param_dtype=None):
    """Add LoRA to every linear layer of ``model`` that a target names, in place; returns ``model``.

    Args:
        rank, alpha, dropout, use_rslora: PEFT's ``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``.
        targets: module names or regexes, as PEFT's ``target_modules``: a plain name (``"q_proj"``,
            ``"c_attn"``) matches a module whose last path part it is; anything else is a regex that
            must match the whole dotted path (``r".*\\.layers\\.0\\..*_proj"``). One string is one target.
            The default, ``q_proj`` and ``v_proj``, is PEFT's for the llama family.
        rngs: draws A (``params`` stream) and the LoRA dropout's stream.
        dtype, param_dtype: as ``LoRALinear``'s; default each base layer's.

    Raises:
        ValueError: rank < 1, a bad alpha or dropout, a target that matches nothing, a matched
            module that is not a linear layer (named with its type), a per-head q/k/v projection
            that its attention reads as one fused kernel, or a model that already has LoRA.
    """
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    config = LoRAConfig(rank=rank, alpha=alpha, dropout=dropout, targets=targets, use_rslora=bool(use_rslora))
    _check_config(config)
    if layers(model):
        raise ValueError("the model already has LoRA layers; merge or remove them first (lora.remove)")
    nodes = _nodes(model)
    found = [(path, nodes[path]) for path in _find(model, targets, nodes)]
    deterministic = _in_eval_mode(model)
    for path, node in found:
        cls = next(c for base, c in _LORA_CLASS.items() if isinstance(node, base))
        new = cls(node, config, rngs=rngs, deterministic=deterministic, dtype=dtype, param_dtype=param_dtype)
        _set_child(nodes[path[:-1]], path[-1], new)
    return model


def config_of(model) -> LoRAConfig | None:
    """The ``LoRAConfig`` that ``apply`` gave ``model`` (read off its LoRA layers), or None without LoRA."""
    configs = {layer.lora_config for layer in layers(model).values()}
    if len(configs) > 1:
        raise ValueError(f"the model's LoRA layers have {len(configs)} different configs: {sorted(map(str, configs))}")
    return next(iter(configs), None)


def _adapted(model) -> dict[str, _LoRA]:
    found = layers(model)
    if not found:
        raise ValueError(f"the {type(model).__name__} has no LoRA layers (lora.apply adds them)")
    return found


def merge(model):
    """Fold ``scale * A @ B`` into each base weight, so that the model runs at the base's cost.

    The adapters are kept (``unmerge`` takes them out again); a merged layer computes its base
    alone. Raises ValueError on a model that has no LoRA or is already merged. Returns ``model``.
    """
    found = _adapted(model)
    merged = [path for path, layer in found.items() if layer.merged]
    if merged:
        raise ValueError(f"the LoRA layers are already merged ({merged[0]}, ...); unmerge first")
    for layer in found.values():
        layer._shift(+1.0)
        layer.merged = True
    return model


def unmerge(model):
    """Take ``scale * A @ B`` out of each base weight again (the inverse of ``merge``, up to rounding)."""
    found = _adapted(model)
    if not all(layer.merged for layer in found.values()):
        raise ValueError("the LoRA layers are not merged")
    for layer in found.values():
        layer._shift(-1.0)
        layer.merged = False
    return model


def remove(model, *, merge_weights: bool = True):
    """Put plain layers back in place of the LoRA layers, in place; returns ``model``.

    With ``merge_weights`` (the default) the adapters are folded in first: the model computes
    what the adapted one did, as a plain model that ``hf.save_pretrained`` and porting write.
    With ``merge_weights=False`` the base weights come back as they were (an unmerged adapter is dropped).
    """
    found = _adapted(model)
    for layer in found.values():
        if merge_weights and not layer.merged:
            layer._shift(+1.0)
        elif not merge_weights and layer.merged:
            layer._shift(-1.0)
    nodes = _nodes(model)
    for path, node in list(nodes.items()):
        if isinstance(node, _LoRA):
            _set_child(nodes[path[:-1]], path[-1], _plain(node))
    return model


def _plain(layer: _LoRA):
    """The base layer again: an object of the base class holding ``layer``'s own attributes but the
    adapter's (its Param objects themselves), made as nnx's graph unflattening makes nodes."""
    base_cls = next(b for b, c in _LORA_CLASS.items() if isinstance(layer, c))
    plain = object.__new__(base_cls)
    for name, value in vars(layer).items():
        if not name.startswith("lora_") and name != "merged":
            object.__setattr__(plain, name, value)
    return plain


class Sizes(NamedTuple):
    """Parameter counts: what LoRA trains (the adapters) and what full fine-tuning would (the base)."""

    adapted: int
    full: int

    @property
    def fraction(self) -> float:
        """adapted / full: also the optimizer state's size against full fine-tuning's."""
        return self.adapted / self.full if self.full else 0.0


def state_sizes(model) -> Sizes:
    """How many parameters LoRA trains (``LoRAParam``s) against how many full fine-tuning of the same
    model would (every other ``nnx.Param``: the base).

    An optimizer's state grows with what it trains (Adam keeps two numbers per parameter), so
    ``fraction`` is also its state's size against full fine-tuning's.
    """
    def count(state) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(state))

    return Sizes(count(nnx.state(model, LoRAParam)), count(nnx.state(model, nnx.All(nnx.Param, nnx.Not(LoRAParam)))))


def trainable(model) -> nnx.State:
    """The adapter parameters of ``model`` (``nnx.state(model, LoRAParam)``): what LoRA trains."""
    return nnx.state(model, LoRAParam)
