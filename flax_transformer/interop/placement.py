"""Where a parameter lives on a ("data", "fsdp"[, "expert"]) mesh: the rule shared by loading and training.

* "expert" (expert parallelism): every expert tensor of a mixture of experts (``...mlp.experts.gate_up_proj``
  (E, H, 2I), ``...mlp.experts.down_proj`` (E, I, H), their LoRA adapters' ``lora_A``/``lora_B`` (E, ., .),
  and the Adam moments of each) is split along its expert axis (the first) over "expert": each
  device holds E / n experts whole. The axis size must divide E (``PlacementError`` otherwise).
* "fsdp": every parameter (and its Adam moments) is split along its largest axis that the "fsdp"
  size divides and that "expert" does not already split; replicated when none is.
* Everything else is replicated; batches are split over every axis (``training.distributed``).

It sits here, in ``interop``, rather than in ``training.distributed``: loading a checkpoint
onto a mesh (``safetensors_io.fill(..., sharding=mesh)``) places each parameter as training
places it (``training.distributed.state_shardings``), so that a loaded model trains without
being moved, and ``interop`` may not import ``training`` (the layers import to the left only:
models <- interop <- verification <- training <- cli).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax

from flax_transformer.models.lora_experts import EXPERT_PARAMETERS

# the weights of a ``moe.LlamaExperts`` or ``GptOssExperts`` (E first); a ``lora_experts.ParamLoRA`` on one
# lives at ``<name>_lora``. GPT-OSS's experts' biases are E first too, and take no LoRA.
EXPERT_WEIGHTS = EXPERT_PARAMETERS
EXPERT_BIASES = ("gate_up_proj_bias", "down_proj_bias")


class PlacementError(ValueError):
    """A parameter the mesh cannot place as asked (an expert axis that does not divide its experts)."""


def is_key(x) -> bool:
    """Whether ``x`` is an array of typed PRNG keys (never split: a key is one value)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def path_names(path) -> tuple[str, ...]:
    """A parameter's path as names: from a dotted string (``porting.flax_params``) or a JAX key path
    (``jax.tree_util.tree_map_with_path`` over an ``nnx.State`` or an optimizer's state); the
    ``.value`` of a variable is dropped."""
    if isinstance(path, str):
        names = tuple(path.split("."))
    else:
        names = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def is_expert_tensor(path) -> bool:
    """Whether the parameter at ``path`` has one slice per expert along its first axis: an experts'
    weight or (GPT-OSS) bias, the ``lora_A``/``lora_B`` of a weight's ``ParamLoRA``, or an optimizer moment of one."""
    names = path_names(path)
    for i, name in enumerate(names[:-1]):
        if name != "experts":
            continue
        rest = names[i + 1:]
        if rest in {(w,) for w in EXPERT_WEIGHTS + EXPERT_BIASES}:
            return True
        if len(rest) == 2 and rest[0] in {f"{w}_lora" for w in EXPERT_WEIGHTS} and rest[1] in ("lora_A", "lora_B"):
            return True
    return False


def param_spec(path, x, axes: Mapping[str, int]):
    """The ``PartitionSpec`` of the parameter (or Adam moment) ``x`` at ``path`` on a mesh whose axis
    sizes are ``axes`` (``mesh.shape``; a missing axis counts as size 1): see the module's rules.
    A scalar and PRNG keys are replicated (``P()``). ``x``: an array or a ``jax.ShapeDtypeStruct``.

    Raises ``PlacementError`` (one line, naming the tensor and the sizes) for an expert tensor
    whose expert count the "expert" axis does not divide."""
    from jax.sharding import PartitionSpec as P

    shape = tuple(getattr(x, "shape", ()))
    if not shape or is_key(x):
        return P()
    spec: list = [None] * len(shape)
    expert, fsdp = int(axes.get("expert", 1)), int(axes.get("fsdp", 1))
    if expert > 1 and is_expert_tensor(path):
        if shape[0] % expert:
            raise PlacementError(f"{'.'.join(path_names(path))} {list(shape)} has {shape[0]} experts, which the mesh's "
                                 f"expert axis of size {expert} does not divide (use an expert size dividing {shape[0]})")
        spec[0] = "expert"
    if fsdp > 1:
        free = sorted((i for i in range(len(shape)) if spec[i] is None), key=lambda i: -shape[i])
        for axis in free:
            if shape[axis] % fsdp == 0:
                spec[axis] = "fsdp"
                break
    return P(*spec) if any(spec) else P()  # P(): replicated (nothing asked, or too small to split)


def splits_first_axis(sharding) -> bool:
    """Whether ``sharding`` gives devices different slices of an array's first axis (experts over "expert")."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not sharding.spec:
        return False
    first = sharding.spec[0]
    return any(sharding.mesh.shape[a] > 1 for a in ((first,) if isinstance(first, str) else first or ()))


def put_by_rows(shape: tuple, sharding, read_rows):
    """An array of ``shape`` on ``sharding`` (split along its first axis) made from the rows its devices
    hold: ``read_rows(start, stop)`` gives rows ``start:stop`` as numpy, once per distinct block (devices
    that share a block, across a data axis, share the read). Each process reads only its own devices'
    blocks (``jax.make_array_from_callback``): a checkpoint's experts are read where they are used."""
    blocks: dict = {}

    def block(index):  # index: the slices of the whole array one device holds
        start, stop, _ = index[0].indices(shape[0])
        if (start, stop) not in blocks:
            blocks[(start, stop)] = read_rows(start, stop)
        return blocks[(start, stop)][(slice(None), *index[1:])]

    out = jax.make_array_from_callback(shape, sharding, block)
    blocks.clear()
    return out
