"""LoRA on the fused expert weights of the llama family's mixtures of experts, as PEFT's ``ParamWrapper``
adapts a 3-D parameter (``target_parameters``).

``mlp.experts.gate_up_proj`` (E, H, 2I) and ``mlp.experts.down_proj`` (E, I, H) (``moe.LlamaExperts``,
and GPT-OSS's ``moe.GptOssExperts``, whose biases stay as they are) each take one rank-r LoRA per expert:

    W[e] + scale * A[e] @ B[e]        A (E, in, r), B (E, r, out), scale = alpha / r

the sum formed before the experts run, so every expert computes on its own adapted weight. The
adapter of a weight is a ``ParamLoRA`` at ``<experts>.<weight>_lora``; experts that have one become
``LoRAExperts`` (``GptOssLoRAExperts``), which run their ``run_on`` on the adapted weights. The base weights stay at
their paths, so porting and checkpoints see the base model.

``lora.apply(model, parameters=[...])`` adds them (it draws A and B, as for every LoRA, and
``find_parameters`` says which weights the names select); ``lora.merge``, ``unmerge`` and ``remove``
take them as they take the linear layers' LoRA. PEFT's files hold A as (E r, in) (expert-major rows)
and B as (out, r E) (expert-minor columns), in and out the weight's true ones whichever way transformers
stores it (Mixtral's (E, out, in), which PEFT swaps, or GPT-OSS's (E, in, out), ``is_transposed``);
``interop.peft`` converts. PEFT refuses dropout on a
``ParamWrapper``, and so does ``lora.apply``. No torch here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_transformer.models.moe import GptOssExperts, LlamaExperts

__all__ = ["EXPERT_PARAMETERS", "EXPERT_TYPES", "GptOssLoRAExperts", "LoRAExperts", "ParamLoRA", "find_parameters",
           "lora_class_of", "plain_class_of"]

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # the experts' weights a LoRA can take, in definition order
EXPERT_TYPES = (LlamaExperts, GptOssExperts)  # the experts whose EXPERT_PARAMETERS take LoRA


@jax.jit
def _expert_update(a, b, scale):
    """scale * A[e] @ B[e] for every expert, in float32: (E, in, r) @ (E, r, out) -> (E, in, out)."""
    return scale * jnp.einsum("eir,ero->eio", a.astype(jnp.float32), b.astype(jnp.float32))


@jax.jit
def _added(weight, update):
    """weight + update, summed in float32, stored back in the weight's dtype."""
    return (weight.astype(jnp.float32) + update).astype(weight.dtype)


class ParamLoRA(nnx.Module):
    """PEFT's ``ParamWrapper`` on one fused expert weight (E, in, out): one LoRA per expert,
    ``W[e] + scale * A[e] @ B[e]``. It lives at ``<experts>.<parameter>_lora``; its ``LoRAExperts``
    adds the update to the weight before the experts run (PEFT's parametrization)."""

    def __init__(self, lora_A: nnx.Param, lora_B: nnx.Param, config, *, parameter: str):
        """Hold the adapter.

        Args:
            lora_A, lora_B: A (E, in, r) and B (E, r, out), made by ``lora.apply`` (``lora.LoRAParam``s,
                A drawn as PEFT draws it, B zero).
            config: the ``lora.LoRAConfig`` (its ``scale``).
            parameter: the experts' weight it adapts (one of ``EXPERT_PARAMETERS``).
        """
        if parameter not in EXPERT_PARAMETERS:
            raise ValueError(f"ParamLoRA adapts one of {EXPERT_PARAMETERS}, got {parameter!r}")
        (e, _, r), (e_b, r_b, _) = lora_A.shape, lora_B.shape
        if (e, r) != (e_b, r_b):
            raise ValueError(f"ParamLoRA: A {lora_A.shape} and B {lora_B.shape} are not (E, in, r) and (E, r, out)")
        self.parameter = parameter
        self.lora_config, self.lora_scale, self.merged = config, config.scale, False
        self.lora_A, self.lora_B = lora_A, lora_B

    def update_matrix(self) -> jax.Array:
        """scale * A[e] @ B[e]: (E, in, out), what ``merge`` adds to the weight, in float32."""
        return _expert_update(self.lora_A[...], self.lora_B[...], self.lora_scale)

    def shifted(self, weight):
        """weight + the update, summed in float32, in the weight's dtype: what the experts run on."""
        return _added(weight, self.update_matrix())

    def _shift(self, sign: float, parent=None) -> None:
        weight = getattr(parent, self.parameter)
        weight.set_value(_added(weight[...], sign * self.update_matrix()))


class AdaptedExperts:
    """What experts whose weights take ``ParamLoRA``s (children ``gate_up_proj_lora``, ``down_proj_lora``)
    add to their base class: they run (their ``run_on``) on ``W + scale * A @ B`` (each weight alone once
    merged)."""

    def adapters(self) -> list[ParamLoRA]:
        """Its adapters, in ``EXPERT_PARAMETERS`` order."""
        return [a for n in EXPERT_PARAMETERS if isinstance(a := getattr(self, f"{n}_lora", None), ParamLoRA)]

    def __call__(self, x, experts, weights):
        """(T, H), (T, k), (T, k) -> (T, H): the base experts' ``__call__`` on the adapted weights."""
        used = {name: getattr(self, name)[...] for name in EXPERT_PARAMETERS}
        used.update({a.parameter: a.shifted(used[a.parameter]) for a in self.adapters() if not a.merged})
        return self.run_on(x, experts, weights, **used)


class LoRAExperts(AdaptedExperts, LlamaExperts):
    """A ``moe.LlamaExperts`` whose weights take ``ParamLoRA``s (``AdaptedExperts``)."""


class GptOssLoRAExperts(AdaptedExperts, GptOssExperts):
    """A ``moe.GptOssExperts`` whose weights take ``ParamLoRA``s (``AdaptedExperts``); its biases take none."""


_LORA_CLASS = {LlamaExperts: LoRAExperts, GptOssExperts: GptOssLoRAExperts}  # base experts -> adapted


def lora_class_of(experts) -> type:
    """The adapted class of ``experts`` (a plain ``EXPERT_TYPES`` object)."""
    return next(adapted for base, adapted in _LORA_CLASS.items() if isinstance(experts, base))


def plain_class_of(experts) -> type:
    """The plain class of adapted ``experts`` (``lora_class_of`` undone)."""
    return next(base for base, adapted in _LORA_CLASS.items() if isinstance(experts, adapted))


def find_parameters(model, parameters: tuple[str, ...], nodes: dict) -> list[tuple]:
    """The adapter paths (``<experts>.<parameter>_lora``) of the expert weights that ``parameters``
    name, by PEFT's rule for ``target_parameters``: a weight's dotted path, or a dotted suffix of it.

    ``nodes`` is every node of ``model`` by path tuple (``lora.module_nodes``). ValueError for a name
    that matches nothing, or matches a parameter that is not an expert weight."""
    if isinstance(parameters, str) or not all(isinstance(t, str) and t for t in parameters):
        raise ValueError(f"LoRA parameters must be a list of parameter names, got {parameters!r}")
    found, hits = [], dict.fromkeys(parameters, 0)
    for path, node in nodes.items():
        if not path or isinstance(node, nnx.Module) or not hasattr(node, "shape"):
            continue
        dotted = ".".join(map(str, path))
        matched = [t for t in parameters if dotted == t or dotted.endswith(f".{t}")]
        for t in matched:
            hits[t] += 1
        if not matched:
            continue
        if not (isinstance(nodes[path[:-1]], EXPERT_TYPES) and path[-1] in EXPERT_PARAMETERS):
            raise ValueError(f"LoRA parameter {matched[0]!r} matches {dotted}, which is not an expert weight "
                             f"({', '.join(EXPERT_PARAMETERS)} of a LlamaExperts or GptOssExperts): only those "
                             "take LoRA as parameters")
        found.append((*path[:-1], f"{path[-1]}_lora"))
    unmatched = [t for t, n in hits.items() if n == 0]
    if unmatched:
        names = sorted({".".join(map(str, p)) for p, n in nodes.items() if isinstance(n, EXPERT_TYPES)})[:1]
        raise ValueError(f"LoRA parameters {unmatched} match no parameter of the {type(model).__name__}"
                         + (f"; its experts are like {names[0]}.gate_up_proj" if names else "; it has no experts"))
    return found
