"""LoRA (Hu et al., 2021) for the library's models, computed as PEFT's ``lora.Linear`` computes it.

A LoRA layer adds a low-rank update to a frozen linear layer:

    y = base(x) + scale * dropout(x) @ A @ B        A (in, r), B (r, out), scale = alpha / r

(``use_rslora=True``: scale = alpha / sqrt(r)). A starts as PEFT's does, kaiming_uniform(a=sqrt(5))
on torch's (r, in) weight, which is U(-1/sqrt(in), 1/sqrt(in)); B starts at zero, so a freshly
adapted model computes what the base computed. Dropout acts on the LoRA branch's input only.

Layout: A and B in the Flax (in, out) orientation of the kernel they adapt (``A @ B`` has its shape);
PEFT's files hold the transposes, torch's (r, in) and (out, r) (``interop.peft`` converts).

The LoRA layers *are* the layers they adapt (``LoRALinear`` subclasses ``nnx.Linear``,
``LoRAConv1D`` the notebook/GPT-2 ``gpt.Linear``) and keep the same ``Param`` objects, so
the base weights stay at their paths (``...q_proj.kernel``, ``...c_attn.matrix``) and porting,
checkpoints and weight decay masks see the same base model. The adapters are ``LoRAParam``s
(an ``nnx.Param`` subclass) named ``lora_A`` / ``lora_B``: train only them with
``nnx.Optimizer(model, tx, wrt=LoRAParam)`` and ``nnx.grad(..., argnums=nnx.DiffState(0, LoRAParam))``.

Experts (``parameters=``, PEFT's ``target_parameters``): one rank-r LoRA per expert of the fused weights, as
PEFT's ``ParamWrapper`` (``lora_experts``); ``apply`` draws their A and B as every LoRA's, no dropout there.

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

from flax_transformer.models import gpt
from flax_transformer.models.fast_backward import linear_dot_general
from flax_transformer.models.lora_experts import ParamLoRA, find_parameters, lora_class_of, plain_class_of

__all__ = ["ADAPTABLE", "LORA_FILTER", "PLAIN_NAME", "FusedLoRA", "LoRAConfig", "LoRAConv1D", "LoRALinear", "LoRAParam",
           "Sizes", "apply", "config_of", "find", "layers", "merge", "remove", "state_sizes", "trainable", "unmerge"]


class LoRAParam(nnx.Param):
    """An adapter weight (``lora_A``, ``lora_B``): an ``nnx.Param``, so it is saved and ported as one,
    and a type of its own, so that optimizers and gradients can take only these."""


LORA_FILTER = LoRAParam  # the nnx filter of the adapters: nnx.Optimizer(model, tx, wrt=LORA_FILTER)

# the layers a LoRA can adapt (their weights are (in, out) both); _LORA_CLASS gives the LoRA class of each
ADAPTABLE = (nnx.Linear, gpt.Linear)

PLAIN_NAME = re.compile(r"\w+")  # a target that is a plain module name (PEFT's rule), not a regex


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """What ``apply`` was given: PEFT's ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ``use_rslora``."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    use_rslora: bool = False
    parameters: tuple[str, ...] = ()  # PEFT's target_parameters: the experts' fused weights

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
    if config.parameters and config.dropout:
        raise ValueError(f"LoRA on parameters ({list(config.parameters)}) takes no dropout (PEFT's ParamWrapper "
                         f"refuses it: the update is added to the weight, not to a branch), got {config.dropout!r}")


# One compiled program per shape for what runs eagerly once per layer (initialising, merging):
# unjitted, each of their primitives would be compiled on its own, for every shape.
@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _init_a(key, shape: tuple[int, ...], dtype):
    """PEFT's A: kaiming_uniform(a=sqrt(5)) on torch's (r, in) weight is U(-1/sqrt(in), 1/sqrt(in)); ours is
    (in, r), or (E, in, r) for experts."""
    bound = 1.0 / math.sqrt(shape[-2])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


@jax.jit
def _update(a, b, scale):
    """scale * A @ B in float32: (in, r) @ (r, out) -> (in, out)."""
    return scale * (a.astype(jnp.float32) @ b.astype(jnp.float32))


@jax.jit
def _shifted(weight, a, b, scale):
    """weight + scale * A @ B, summed in float32, stored back in the weight's dtype."""
    return (weight.astype(jnp.float32) + _update(a, b, scale)).astype(weight.dtype)


class _Adapter:
    """A and B, the LoRA dropout and the branch ``scale * dropout(x) @ A @ B``: what a LoRA layer
    (``_LoRA``) and a LoRA over all heads (``FusedLoRA``) share."""

    def _add_adapter(self, d_in: int, d_out: int, config: LoRAConfig, *, rngs: nnx.Rngs, deterministic: bool,
                     dtype, param_dtype) -> None:
        self.lora_config = config
        self.lora_dtype = dtype
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

    def update_matrix(self) -> jax.Array:
        """scale * A @ B: (in, out), what ``merge`` adds to the base weight, in float32."""
        return _update(self.lora_A[...], self.lora_B[...], self.lora_scale)


class _LoRA(_Adapter):
    """A linear layer with a LoRA; mixed in before the base layer class it adapts."""

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
        self._add_adapter(d_in, d_out, config, rngs=rngs, deterministic=deterministic,
                          dtype=dtype or getattr(base, "dtype", None) or jnp.float32,
                          param_dtype=param_dtype or weight.dtype)

    def __call__(self, x, *args, **kwargs):
        """(..., in) -> (..., out): the base layer's output plus the LoRA branch (the base alone once merged)."""
        y = super().__call__(x, *args, **kwargs)
        if self.merged:
            return y
        return y + self.delta(x).astype(y.dtype)

    def _shift(self, sign: float, parent=None) -> None:
        weight = getattr(self, self._weight)
        weight.set_value(_shifted(weight[...], self.lora_A[...], self.lora_B[...], sign * self.lora_scale))


class LoRALinear(_LoRA, nnx.Linear):
    """An ``nnx.Linear`` (kernel (in, out)) with a LoRA update: PEFT's ``lora.Linear`` on ``nn.Linear``."""


class LoRAConv1D(_LoRA, gpt.Linear):
    """A ``gpt.Linear`` (``matrix`` (in, out): GPT-2's Conv1D) with a LoRA update: PEFT's ``lora.Linear``
    with ``fan_in_fan_out=True``."""

    _weight = "matrix"


_LORA_CLASS = {nnx.Linear: LoRALinear, gpt.Linear: LoRAConv1D}


class FusedLoRA(_Adapter, nnx.Module):
    """A LoRA over one projection of *all* heads of an attention that keeps one linear layer per head.

    ``encoder.MultiHeadAttention`` stores BERT's ``query`` as ``heads.<i>.q`` (the notebook's layout),
    one (e, d) kernel per head. PEFT's LoRA on ``query`` is one A (e, r) and one B (r, h*d) for the
    whole projection, which no per-head LoRA equals (a rank-r update of h*d columns is not h
    rank-r updates of d columns). This is that LoRA: it lives at ``<attention>.<name>_lora``, the
    attention adds its ``delta`` to the stacked projection (``layers.stacked_projection``), and
    ``merge`` adds head i's d columns of ``A @ B`` to head i's kernel.
    """

    def __init__(self, d_in: int, d_out: int, config: LoRAConfig, *, projection: str, rngs: nnx.Rngs,
                 deterministic: bool = False, dtype=jnp.float32, param_dtype=jnp.float32):
        self.projection = projection  # the heads' layer name it spans ("q", "k", "v")
        self._add_adapter(d_in, d_out, config, rngs=rngs, deterministic=deterministic, dtype=dtype,
                          param_dtype=param_dtype)

    def _shift(self, sign: float, parent=None) -> None:
        update = sign * self.update_matrix()  # (e, h*d), head-major columns as the stacked kernel's
        start = 0
        for layer in parent.head_layers(self.projection):
            width = layer.kernel.shape[1]
            layer.kernel.set_value(_added(layer.kernel[...], update[:, start:start + width]))
            start += width


@jax.jit
def _added(weight, update):
    """weight + update, summed in float32, stored back in the weight's dtype."""
    return (weight.astype(jnp.float32) + update).astype(weight.dtype)


def _rebuilt(node, cls, drop=()):
    """An object of ``cls`` holding ``node``'s own attributes (its Param objects themselves) but ``drop``,
    made as nnx's graph unflattening makes nodes (no constructor runs)."""
    new = object.__new__(cls)
    for name, value in vars(node).items():
        if name not in drop:
            object.__setattr__(new, name, value)
    return new


_ADAPTERS = (_LoRA, FusedLoRA, ParamLoRA)


def dotted_path(path) -> str:
    return ".".join(str(p) for p in path)


def layers(model) -> dict[str, _Adapter]:
    """Dotted path -> LoRA layer (or ``FusedLoRA``, ``ParamLoRA``), for every adapter of ``model``, in graph order."""
    return {dotted_path(path): node for path, node in nnx.iter_graph(model) if isinstance(node, _ADAPTERS)}


def fused_slots(node, path: tuple) -> list[tuple[tuple, str, tuple[str, ...]]]:
    """(adapter path, projection, its transformers names) for each projection that ``node`` (an
    attention keeping one layer per head, which declares ``LORA_FUSED``) can take a ``FusedLoRA`` on."""
    return [((*path, f"{projection}_lora"), projection, names)
            for projection, names in getattr(type(node), "LORA_FUSED", {}).items()]


def _matches(target: str, name: str, dotted: str) -> bool:
    """PEFT's rule: a plain name is the last path part, anything else a regex on the whole dotted path."""
    if PLAIN_NAME.fullmatch(target):
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


def module_nodes(model) -> dict[tuple, object]:
    """Path tuple -> node, for the model (``()``) and everything under it."""
    return {(): model, **{tuple(path): node for path, node in nnx.iter_graph(model) if path}}


def find(model, targets: str | Sequence[str], parameters: Sequence[str] = ()) -> list[str]:
    """The dotted paths of the adapters ``apply(model, targets=targets, parameters=parameters)`` would
    add, checked as it checks them (an expert weight's is ``<experts>.<parameter>_lora``)."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    nodes = module_nodes(model)
    return [dotted_path(path) for path in [*_find(model, targets, nodes, bool(parameters)),
                                           *find_parameters(model, tuple(parameters), nodes)]]


def _find(model, targets: tuple[str, ...], nodes: dict, may_be_empty: bool = False) -> list[tuple]:
    """The paths of what the targets adapt: a linear layer's own path, or for a projection over all
    heads (``FusedLoRA``), the path its adapter takes (``<attention>.q_lora``). No targets at all
    only ``may_be_empty`` (parameters are adapted instead)."""
    if not targets and may_be_empty:
        return []
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"LoRA targets must be non-empty module names or regexes, got {targets!r}")
    for target in targets:
        if not PLAIN_NAME.fullmatch(target):
            try:
                re.compile(target)
            except re.error as error:
                raise ValueError(f"LoRA target {target!r} is not a valid regex: {error}") from None
    found, hits, fused_names = [], dict.fromkeys(targets, 0), set()
    for path, node in nodes.items():
        if not path or not isinstance(node, nnx.Module):
            continue
        dotted = dotted_path(path)
        for slot, _, names in fused_slots(node, path):
            fused_names.update(names)
            matched = [t for t in targets if (t in names if PLAIN_NAME.fullmatch(t)
                                              else re.fullmatch(t, dotted_path(slot)) is not None)]
            for t in matched:
                hits[t] += 1
            if matched:
                found.append(slot)
        matched = [t for t in targets if _matches(t, str(path[-1]), dotted)]
        if not matched:
            continue
        for t in matched:
            hits[t] += 1
        if not isinstance(node, ADAPTABLE):
            raise ValueError(f"LoRA target {matched[0]!r} matches {dotted}, a {type(node).__name__}, "
                             "not a linear layer (nnx.Linear or gpt.Linear)")
        found.append(path)
    unmatched = [t for t, n in hits.items() if n == 0]
    if unmatched:
        names = sorted({str(p[-1]) for p, n in nodes.items() if p and isinstance(n, ADAPTABLE)})
        also = f", and its attention's projections over all heads {sorted(fused_names)}" if fused_names else ""
        raise ValueError(f"LoRA targets {unmatched} match no module of the {type(model).__name__}; "
                         f"its linear layers are named {names}{also}")
    return found


def apply(model, *, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
          targets: str | Sequence[str] = ("q_proj", "v_proj"), use_rslora: bool = False, rngs: nnx.Rngs,
          dtype=None, param_dtype=None, parameters: Sequence[str] = ()):
    """Add LoRA to every linear layer of ``model`` that a target names, in place; returns ``model``.

    Args:
        rank, alpha, dropout, use_rslora: PEFT's ``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``.
        targets: module names or regexes, as PEFT's ``target_modules``: a plain name (``"q_proj"``,
            ``"c_attn"``) matches a module whose last path part it is; anything else is a regex that
            must match the whole dotted path (``r".*\\.layers\\.0\\..*_proj"``). One string is one target.
            The default, ``q_proj`` and ``v_proj``, is PEFT's for the llama family. The encoder
            family keeps one layer per head (``heads.<i>.q``): ``"q"`` adapts each head's layer (as
            PEFT on the notebook twin does), while transformers' names of the whole projection
            (``"query"``, ``"value"``; DistilBERT's ``"q_lin"``) put one ``FusedLoRA`` over all heads
            at ``<attention>.q_lora`` (as PEFT on transformers' BERT does).
        rngs: draws A (``params`` stream) and the LoRA dropout's stream.
        dtype, param_dtype: as ``LoRALinear``'s; default each base layer's.
        parameters: PEFT's ``target_parameters``: expert weights by dotted path or dotted suffix
            (``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``), each taking one LoRA per
            expert (``ParamLoRA``). ``targets`` may then be empty; ``dropout`` must be 0.

    Raises:
        ValueError: rank < 1, a bad alpha or dropout, a target that matches nothing, a matched
            module that is not a linear layer (named with its type), a parameter that is not an
            expert weight, or a model that already has LoRA.
    """
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    parameters = (parameters,) if isinstance(parameters, str) else tuple(parameters)
    config = LoRAConfig(rank=rank, alpha=alpha, dropout=dropout, targets=targets, use_rslora=bool(use_rslora),
                        parameters=parameters)
    _check_config(config)
    if layers(model):
        raise ValueError("the model already has LoRA layers; merge or remove them first (lora.remove)")
    nodes = module_nodes(model)
    found = [(path, nodes.get(path)) for path in _find(model, targets, nodes, bool(parameters))]
    in_params = find_parameters(model, parameters, nodes) if parameters else []
    deterministic = _in_eval_mode(model)
    wrapped = {}  # id of experts -> the LoRAExperts (GptOssLoRAExperts) that replaces them
    for path in in_params:
        experts = nodes[path[:-1]]
        if id(experts) not in wrapped:
            wrapped[id(experts)] = _rebuilt(experts, lora_class_of(experts))
            _set_child(nodes[path[:-2]], path[-2], wrapped[id(experts)])
        weight = getattr(experts, name := path[-1][:-len("_lora")])
        (e, d_in, d_out), dtype = weight.shape, jnp.dtype(param_dtype or weight.dtype)
        a = LoRAParam(_init_a(rngs.params(), (e, d_in, config.rank), dtype))  # PEFT's (E r, in) has the same fan-in
        setattr(wrapped[id(experts)], path[-1],
                ParamLoRA(a, LoRAParam(jnp.zeros((e, config.rank, d_out), dtype)), config, parameter=name))
    for path, node in found:
        parent = nodes[path[:-1]]
        if node is None:  # a projection over all heads: the adapter is a new child of the attention
            projection = path[-1][:-len("_lora")]
            heads = parent.head_layers(projection)
            kernel = heads[0].kernel
            new = FusedLoRA(kernel.shape[0], sum(h.kernel.shape[1] for h in heads), config, projection=projection,
                            rngs=rngs, deterministic=deterministic,
                            dtype=dtype or getattr(parent, "dtype", None) or jnp.float32,
                            param_dtype=param_dtype or kernel.dtype)
        else:
            cls = next(c for base, c in _LORA_CLASS.items() if isinstance(node, base))
            new = cls(node, config, rngs=rngs, deterministic=deterministic, dtype=dtype, param_dtype=param_dtype)
        _set_child(parent, path[-1], new)
    return model


def config_of(model) -> LoRAConfig | None:
    """The ``LoRAConfig`` that ``apply`` gave ``model`` (read off its LoRA layers), or None without LoRA."""
    configs = {layer.lora_config for layer in layers(model).values()}
    if len(configs) > 1:
        raise ValueError(f"the model's LoRA layers have {len(configs)} different configs: {sorted(map(str, configs))}")
    return next(iter(configs), None)


def _adapted(model) -> dict[tuple, tuple[_Adapter, object]]:
    """Path -> (adapter, its parent module) for every adapter of ``model``; ValueError without any."""
    nodes = module_nodes(model)
    found = {path: (node, nodes[path[:-1]]) for path, node in nodes.items() if isinstance(node, _ADAPTERS)}
    if not found:
        raise ValueError(f"the {type(model).__name__} has no LoRA layers (lora.apply adds them)")
    return found


def merge(model):
    """Fold ``scale * A @ B`` into each base weight, so that the model runs at the base's cost.

    The adapters are kept (``unmerge`` takes them out again); a merged layer computes its base
    alone. Raises ValueError on a model that has no LoRA or is already merged. Returns ``model``.
    """
    found = _adapted(model)
    merged = [dotted_path(path) for path, (layer, _) in found.items() if layer.merged]
    if merged:
        raise ValueError(f"the LoRA layers are already merged ({merged[0]}, ...); unmerge first")
    for layer, parent in found.values():
        layer._shift(+1.0, parent)
        layer.merged = True
    return model


def unmerge(model):
    """Take ``scale * A @ B`` out of each base weight again (the inverse of ``merge``, up to rounding)."""
    found = _adapted(model)
    if not all(layer.merged for layer, _ in found.values()):
        raise ValueError("the LoRA layers are not merged")
    for layer, parent in found.values():
        layer._shift(-1.0, parent)
        layer.merged = False
    return model


def remove(model, *, merge_weights: bool = True):
    """Put plain layers back in place of the LoRA layers (and drop ``FusedLoRA``s), in place; returns ``model``.

    With ``merge_weights`` (the default) the adapters are folded in first: the model computes
    what the adapted one did, as a plain model that ``hf.save_pretrained`` and porting write.
    With ``merge_weights=False`` the base weights come back as they were (an unmerged adapter is dropped).
    """
    found = _adapted(model)
    for layer, parent in found.values():
        if merge_weights and not layer.merged:
            layer._shift(+1.0, parent)
        elif not merge_weights and layer.merged:
            layer._shift(-1.0, parent)
    nodes = module_nodes(model)
    for path, (layer, parent) in found.items():
        if isinstance(layer, FusedLoRA):
            delattr(parent, path[-1])
        elif isinstance(layer, ParamLoRA):
            delattr(parent, path[-1])
            if not parent.adapters():  # the experts' last adapter: plain experts again
                _set_child(nodes[path[:-2]], path[-2], _rebuilt(parent, plain_class_of(parent)))
        else:
            _set_child(parent, path[-1], _plain(layer))
    return model


def _plain(layer: _LoRA):
    """The base layer again: an object of the base class holding ``layer``'s own attributes but the
    adapter's (its Param objects themselves), made as nnx's graph unflattening makes nodes."""
    base_cls = next(b for b, c in _LORA_CLASS.items() if isinstance(layer, c))
    return _rebuilt(layer, base_cls, drop=[n for n in vars(layer) if n.startswith("lora_") or n == "merged"])


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
