"""Weight porting between torch_reference and flax_transformer, in both directions.

Both packages use the same parameter paths up to the leaf: torch's
``tblocks.0.mhattention.tokeys.weight`` is Flax's ``tblocks.0.mhattention.tokeys.kernel``.
So each family declares one table, ``module path -> kind of layer``, and each kind of
layer declares how its leaves map and change layout (``LEAF_RULES``). Nothing else in
this module knows about particular architectures.

Loading is all or nothing: every missing, unexpected or mis-shaped key is collected
and reported in one ``StateDictError`` before a single parameter is written.

torch is imported lazily, inside the functions that need it, so that a JAX-only user
can import ``flax_transformer`` without it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ._shared import StateDictError, check_state_dict_mapping

# --------------------------------------------------------------------- the tables

AS_IS, TRANSPOSE = "as_is", "transpose"

# kind of layer -> {torch leaf: (flax leaf, layout rule)}
LEAF_RULES: dict[str, dict[str, tuple[str, str]]] = {
    "linear": {"weight": ("kernel", TRANSPOSE), "bias": ("bias", AS_IS)},  # torch (out, in), Flax (in, out)
    "layer_norm": {"weight": ("scale", AS_IS), "bias": ("bias", AS_IS)},
    "embedding": {"weight": ("embedding", AS_IS)},
    # notebook 002 writes its own layers: matrix (d_in, d_out), gamma/beta, a bare table
    "matrix_linear": {"matrix": ("matrix", AS_IS), "bias": ("bias", AS_IS)},
    "gamma_beta_norm": {"gamma": ("gamma", AS_IS), "beta": ("beta", AS_IS)},
    "table": {"embeddings": ("embeddings", AS_IS)},
}

# family -> {regex matching the end of a module path: kind(s) of layer}. A pattern
# matches a whole path or a dotted suffix of it, so the same table serves a full
# model and any submodule ported on its own (an attention, a block); "" is the root
# module itself. Where one name is used by two kinds of layer in a family (notebook
# 002 has ``q_proj`` as its own Linear in ``Attention`` and as ``nn.Linear`` in
# ``GPTMHAttention``), the entry lists both kinds: their leaf names tell them apart.
KEY_MAPS: dict[str, dict[str, str | tuple[str, ...]]] = {
    "former": {
        r"token_embedding|pos_embedding": "embedding",
        r"tokeys|toqueries|tovalues|unifyheads|toprobs": "linear",
        r"ff\.0|ff\.2": "linear",
        r"norm1|norm2": "layer_norm",
    },
    "encoder": {
        r"token_embeddings|position_embeddings|token_type_embeddings": "embedding",
        r"q|k|v|output_linear|linear_1|linear_2|classifier|pooler": "linear",
        r"layer_norm|layer_norm_1|layer_norm_2": "layer_norm",
    },
    "gpt": {
        r"": ("matrix_linear", "gamma_beta_norm", "table"),  # a bare Linear, LayerNorm or Embeddings
        r"token_embeddings|position_embeddings": "embedding",
        r"q_proj|k_proj|v_proj": ("linear", "matrix_linear"),
        r"q|k|v|w1|w2": "matrix_linear",
        r"lm_head": "linear",
        r"input_layer_norm|attention_layer_norm|layer_norm_feed_forward|out_layer_norm|embedding_norm":
            "gamma_beta_norm",
        r"layer_norm_attention": ("layer_norm", "gamma_beta_norm"),
        r"layer_norm_input": "layer_norm",
        # GPT-2 (HuggingFace's module names; Conv1D is the notebook's matrix layout)
        r"wte|wpe": "embedding",
        r"c_attn|c_proj|c_fc": "matrix_linear",
        r"ln_1|ln_2|ln_f": "layer_norm",
    },
    "classic": {
        r"src_embedding|tgt_embedding": "embedding",
        r"query_tfm|key_tfm|value_tfm|projection|out": "linear",
        r"position_wise_feed_forward\.0|position_wise_feed_forward\.2": "linear",
        r"layer_norm1|layer_norm2|layer_norm3": "layer_norm",
    },
}

_LAYOUT = {AS_IS: lambda a: a, TRANSPOSE: lambda a: a.T}


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _family(module) -> str:
    package, _, family = type(module).__module__.rpartition(".")
    if package not in ("flax_transformer", "torch_reference") or family not in KEY_MAPS:
        raise TypeError(
            f"{type(module).__name__} is not a flax_transformer or torch_reference model "
            f"(families: {', '.join(KEY_MAPS)})"
        )
    return family


def _leaf_rules(family: str, module_path: str) -> dict[str, tuple[str, str]] | None:
    """The leaf rules of the layer at ``module_path``, or None if the table has no entry."""
    for pattern, kinds in KEY_MAPS[family].items():
        if re.fullmatch(rf"(?:.+\.)?(?:{pattern})", module_path):
            kinds = (kinds,) if isinstance(kinds, str) else kinds
            return {leaf: rule for kind in kinds for leaf, rule in LEAF_RULES[kind].items()}
    return None


def _join(module_path: str, leaf: str) -> str:
    return f"{module_path}.{leaf}" if module_path else leaf


def torch_key_to_flax(family: str, key: str) -> tuple[str, str] | None:
    """``a.b.weight`` -> (``a.b.kernel``, layout rule), or None if no rule covers the key."""
    module_path, _, leaf = key.rpartition(".")
    rules = _leaf_rules(family, module_path)
    if rules is None or leaf not in rules:
        return None
    flax_leaf, rule = rules[leaf]
    return _join(module_path, flax_leaf), rule


def flax_path_to_torch(family: str, path: str) -> tuple[str, str] | None:
    """``a.b.kernel`` -> (``a.b.weight``, layout rule), or None."""
    module_path, _, leaf = path.rpartition(".")
    for torch_leaf, (flax_leaf, rule) in (_leaf_rules(family, module_path) or {}).items():
        if flax_leaf == leaf:
            return _join(module_path, torch_leaf), rule
    return None


# ------------------------------------------------------------------ flax side


def _flax_params(model) -> dict[str, nnx.Param]:
    """Dotted path -> Param variable, for every parameter of an NNX model."""
    out = {}
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param):
            out[".".join(str(p) for p in path)] = variable
    return out


def _to_numpy(value) -> np.ndarray:
    """A torch tensor (any dtype, any device, with or without grad) or array -> numpy."""
    if type(value).__module__.startswith("torch"):
        import torch

        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            import ml_dtypes

            return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return value.numpy()
    return np.asarray(value)


def state_dict(model) -> dict[str, np.ndarray]:
    """The parameters of a flax_transformer model under torch names and layouts."""
    family = _family(model)
    out = {}
    for path, param in _flax_params(model).items():
        mapped = flax_path_to_torch(family, path)
        if mapped is None:
            raise StateDictError(unexpected=[f"{path} (no porting rule in the {family!r} table)"])
        key, rule = mapped
        out[key] = np.ascontiguousarray(_LAYOUT[rule](np.asarray(param[...])))
    return out


def _check_value(key: str, array: np.ndarray, target) -> None:
    """Refuse a value that would not survive the cast to the parameter's dtype ``target``."""
    source = array.dtype
    if np.issubdtype(source, np.complexfloating):
        raise TypeError(f"state_dict[{key!r}] is complex ({source}); parameters are real, and casting would "
                        "drop the imaginary part; nothing was loaded")
    if not (jnp.issubdtype(source, jnp.floating) or jnp.issubdtype(source, jnp.integer)):
        raise TypeError(f"state_dict[{key!r}] has dtype {source}; parameters take real numbers; nothing was loaded")
    if not jnp.issubdtype(target, jnp.floating) or array.size == 0:
        return
    limit = float(jnp.finfo(target).max)
    widest = float(jnp.finfo(source).max if jnp.issubdtype(source, jnp.floating) else jnp.iinfo(source).max)
    if widest <= limit:
        return  # every value fits
    finite = np.isfinite(array) if jnp.issubdtype(source, jnp.floating) else True
    largest = float(np.max(np.abs(array), initial=0, where=finite))
    if largest > limit:
        raise ValueError(f"state_dict[{key!r}] holds {largest:.6g}, beyond the range of the parameter's dtype "
                         f"{jnp.dtype(target).name} (max {limit:.6g}); it would become inf; nothing was loaded")


def load_state_dict(model, state: Mapping[str, Any], strict: bool = True) -> LoadResult:
    """Load torch-named weights (torch tensors or numpy arrays) into a Flax model.

    Every key is checked before anything is written. With ``strict=True`` missing and
    unexpected keys raise; shape mismatches always raise. Values are cast to each
    parameter's own dtype (``param_dtype``), so bf16 weights load into fp32 models and
    the other way round.

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)``, as torch's ``load_state_dict``.
    """
    family = _family(model)
    params = _flax_params(model)
    check_state_dict_mapping(state)
    updates, seen, unexpected, mismatched = {}, set(), [], []
    for key, value in state.items():
        mapped = torch_key_to_flax(family, key)
        if mapped is None or mapped[0] not in params:
            unexpected.append(key)
            continue
        path, rule = mapped
        seen.add(path)
        try:
            original = _to_numpy(value)
        except (TypeError, ValueError) as error:
            raise TypeError(f"state_dict[{key!r}] is not an array ({type(value).__name__}: {error}); "
                            "nothing was loaded") from None
        array = _LAYOUT[rule](original)
        expected = tuple(params[path].shape)
        if tuple(array.shape) != expected:
            # report both shapes in the checkpoint's (torch) layout (a transpose reverses the axes)
            mismatched.append((key, tuple(original.shape), expected[::-1] if rule == TRANSPOSE else expected))
            continue
        _check_value(key, array, params[path].dtype)
        updates[path] = array
    missing = [(flax_path_to_torch(family, p) or (p,))[0] for p in params if p not in seen]
    if mismatched or (strict and (missing or unexpected)):
        raise StateDictError(missing if strict else (), unexpected if strict else (), mismatched)
    unfilled = [(flax_path_to_torch(family, p) or (p,))[0] for p in params
                if p not in seen and isinstance(params[p].get_value(), jax.ShapeDtypeStruct)]
    if unfilled:
        raise StateDictError(missing=unfilled)  # an unfilled model cannot be partly loaded
    # convert everything first: a value that cannot be cast fails before any write
    try:
        converted = {path: jnp.asarray(array, dtype=params[path].dtype) for path, array in updates.items()}
    except (TypeError, ValueError) as error:
        raise TypeError(f"state_dict values must be numeric arrays; nothing was loaded ({error})") from None
    for path, array in converted.items():
        params[path].set_value(array)
    return LoadResult(missing, unexpected)


# --------------------------------------------------------------------- twins


def _is_eval(flax_module) -> bool:
    """An NNX module is in eval mode when all of its dropouts are deterministic."""
    dropouts = [m for _, m in nnx.iter_graph(flax_module) if isinstance(m, nnx.Dropout)]
    return all(d.deterministic for d in dropouts)


def flax_class(torch_module) -> type:
    """The flax_transformer class of the same family and name as a torch_reference module."""
    module = importlib.import_module(f"flax_transformer.{_family(torch_module)}")
    return getattr(module, type(torch_module).__name__)


def torch_class(flax_module) -> type:
    """The torch_reference class of the same family and name as a flax_transformer module."""
    module = importlib.import_module(f"torch_reference.{_family(flax_module)}")
    return getattr(module, type(flax_module).__name__)


def build_unfilled(cls, kwargs: dict, *, seed: int = 0):
    """Build a Flax module without initialising its parameters (they stay abstract).

    Random initialisation of a large model costs time and memory that porting throws
    away. ``nnx.eval_shape`` gives the structure; the dropout RNG streams get concrete
    keys here, and the parameters are filled by ``load_state_dict``.
    """
    abstract = nnx.eval_shape(lambda: cls(**kwargs, rngs=nnx.Rngs(seed)))
    base = jax.random.key(seed)
    for i, (path, variable) in enumerate(nnx.iter_graph(abstract)):
        if isinstance(variable, nnx.RngKey):
            variable.set_value(jax.random.fold_in(base, i))
        elif isinstance(variable, nnx.RngCount):
            variable.set_value(jnp.zeros((), jnp.uint32))
        elif isinstance(variable, nnx.Variable) and not isinstance(variable, nnx.Param):
            raise TypeError(f"cannot build {cls.__name__} unfilled: unexpected state {type(variable).__name__} at {path}")
    return abstract


def torch_to_flax(torch_module, *, dtype=jnp.float32, param_dtype=jnp.float32, seed: int = 0):
    """Build the Flax twin of a torch_reference module, with its weights and mode.

    Args:
        torch_module: an instance of a torch_reference class.
        dtype, param_dtype: compute and storage types of the Flax module.
        seed: seeds the Flax module's ``nnx.Rngs`` (dropout streams).
    """
    cls = flax_class(torch_module)
    kwargs = dict(torch_module.init_kwargs(), dtype=dtype, param_dtype=param_dtype)
    flax_module = build_unfilled(cls, kwargs, seed=seed)
    load_state_dict(flax_module, torch_module.state_dict(), strict=True)
    if torch_module.training:
        flax_module.train()
    else:
        flax_module.eval()
    return flax_module


def flax_to_torch(flax_module, *, dtype=None):
    """Build the torch_reference twin of a Flax module, with its weights and mode.

    Args:
        dtype: torch dtype of the parameters; default float32 (bfloat16 weights are
            widened exactly).
    """
    import torch

    cls = torch_class(flax_module)
    kwargs = {k: v for k, v in flax_module.init_kwargs().items() if k not in ("dtype", "param_dtype")}
    torch_module = cls(**kwargs)
    state = {}
    for key, array in state_dict(flax_module).items():
        state[key] = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
    torch_module.load_state_dict(state, strict=True)
    torch_module.to(dtype or torch.float32)
    torch_module.train(not _is_eval(flax_module))
    return torch_module
