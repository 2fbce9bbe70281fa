"""Several devices and several processes: joining a multi-process run, the ("data", "fsdp"[, "expert"])
mesh, and where parameters, optimizer state and batches live on it.

Batches are split along their first axis over every device of the mesh (data parallel, the
"expert" axis included: see ``batch_sharding``); parameters and their Adam moments are placed by
``interop.placement.param_spec``: a mixture of experts' expert tensors split over "expert" along
their expert axis, every tensor over "fsdp" along its largest (other) divisible axis.
XLA's SPMD partitioner inserts the collectives: there is no hand-written all-reduce or all-to-all.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from flax_transformer.interop.placement import PlacementError, is_expert_tensor, is_key, param_spec
from flax_transformer.training.errors import RunError


def initialize_distributed(coordinator: str, num_processes: int, process_id: int, *, timeout_s: int = 300) -> None:
    """Join a run of ``num_processes`` processes, this one being ``process_id``, through the
    coordinator at ``HOST:PORT`` (served by process 0). Call it before anything touches JAX's
    devices; afterwards ``jax.devices()`` lists every process's devices.

    Every process then runs the same program: it computes the same global batches (a pure
    function of (seed, step)), takes part in each step's collectives and in orbax's
    checkpoint saves, and process 0 alone writes the human files (``is_main_process``).
    CPU devices exchange data through gloo (the setting does not affect GPUs or TPUs).
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s)
    except Exception as error:  # RuntimeError or XlaRuntimeError, with a long C++ message
        raise RunError(f"could not join the run through the coordinator {coordinator} as process {process_id} of "
                       f"{num_processes}: {type(error).__name__}: {str(error)[:500]}") from None


AXES = ("data", "fsdp", "expert")  # the mesh's axes, in this order ("expert" only when --mesh names it)


def parse_mesh(spec: str | None):
    """``"data=4,fsdp=2"`` -> a ``jax.sharding.Mesh`` over the first 8 devices, axes ("data", "fsdp");
    ``"data=2,expert=4"`` (or ``data=..,fsdp=..,expert=..``) adds an "expert" axis: expert parallelism
    for a mixture of experts (``interop.placement``).

    With several processes the mesh must cover all of their devices (``jax.device_count()``).
    """
    if not spec:
        if jax.process_count() > 1:
            raise RunError(f"a run over {jax.process_count()} processes needs --mesh covering all "
                           f"{jax.device_count()} of their devices (e.g. --mesh data={jax.device_count()})")
        return None
    sizes = {"data": 1, "fsdp": 1}
    try:
        for part in spec.split(","):
            name, value = part.split("=")
            if name.strip() not in AXES or not 1 <= int(value) <= 1 << 20:
                raise ValueError(name)
            sizes[name.strip()] = int(value)
    except ValueError:
        raise RunError(f"--mesh {spec!r}: expected data=N,fsdp=M (and expert=K for a mixture of experts)") from None
    n = int(np.prod(list(sizes.values())))
    devices = jax.devices()
    if n < 1 or n > len(devices):
        raise RunError(f"--mesh {spec} needs {n} devices, {len(devices)} available "
                       "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    if jax.process_count() > 1 and n != len(devices):
        raise RunError(f"--mesh {spec} covers {n} devices; a run over {jax.process_count()} processes must cover "
                       f"all {len(devices)} of their devices")
    names = tuple(a for a in AXES if a in sizes)
    grid = np.array(devices[:n]).reshape([sizes[a] for a in names])
    return jax.sharding.Mesh(grid, names)


def state_shardings(tree, mesh):
    """The ``NamedSharding`` of every array of ``tree`` (a model's or an optimizer's state) on ``mesh``, by
    ``param_spec`` on its path; an expert axis that does not divide a tensor's experts is a ``RunError``."""
    from jax.sharding import NamedSharding

    axes = dict(mesh.shape)
    try:
        return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, param_spec(path, x, axes)), tree)
    except PlacementError as error:
        raise RunError(f"--mesh {_spelled(mesh)}: {error}") from None


def check_expert_axis(tree, mesh) -> None:
    """Refuse an "expert" axis (size > 1) for a model without experts: it would only replicate every
    parameter over those devices, which a data axis of that size does too, saying so."""
    expert = dict(mesh.shape).get("expert", 1)
    if expert > 1 and not any(is_expert_tensor(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)):
        raise RunError(f"--mesh {_spelled(mesh)}: expert={expert} needs a mixture of experts, and this model has "
                       f"no experts; put those devices on data= (or fsdp=) instead")


def _spelled(mesh) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def batch_axes(mesh) -> tuple[str, ...]:
    """The mesh axes a batch is split over: all of them. The expert axis carries data too, as in
    GShard and Switch Transformer: its devices hold different experts, and each also runs the rest
    of the model (attention, norms, the router) on its own share of the batch, rather than all of
    them computing the same tokens; XLA moves the tokens or the experts' weights between them."""
    return tuple(a for a in AXES if a in mesh.axis_names)


def batch_sharding(batch, mesh):
    """Every batch array split along its first (batch) axis over every mesh axis: data parallel over all devices."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axes = batch_axes(mesh)
    n = int(np.prod([mesh.shape[a] for a in axes]))
    for key, value in batch.items():
        if np.ndim(value) and np.shape(value)[0] % n:
            raise RunError(f"batch size {np.shape(value)[0]} ({key}) is not divisible by the {n} devices of the mesh")
    return {k: NamedSharding(mesh, P(axes) if np.ndim(v) else P()) for k, v in batch.items()}


def check_batch_size(batch_size: int, mesh) -> None:
    """Refuse, before anything runs, a batch that the mesh's devices cannot split evenly."""
    if mesh is not None and batch_size % mesh.size:
        raise RunError(f"--batch-size {batch_size} is not divisible by the {mesh.size} devices of --mesh")


def _to_mesh(tree, shardings):
    """Arrays that every process holds whole and alike (a freshly built model) onto their ``shardings``."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, sharding):  # device_put refuses arrays committed to one process's device
        if is_key(x):
            return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
        value = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, value, value.shape)

    return jax.tree.map(put, tree, shardings)


def put_batch(batch, mesh):
    """A global batch of numpy arrays (the same in every process) onto ``mesh``, split as ``batch_sharding``.

    Each process copies only the slices its own devices hold (``jax.device_put`` would also
    work but checks with a collective, every step, that the processes' batches are equal).
    """
    shardings = batch_sharding(batch, mesh)
    return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v), np.shape(v))
            for k, v in batch.items()}


def place_state(model_state, opt_state, mesh):
    """Put a fresh model's state and its optimizer's onto ``mesh``; returns
    (model state, optimizer state, (model shardings, optimizer shardings, replicated))."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    check_expert_axis(model_state, mesh)
    shardings = (state_shardings(model_state, mesh), state_shardings(opt_state, mesh), NamedSharding(mesh, P()))
    model_state, opt_state = _to_mesh(model_state, shardings[0]), _to_mesh(opt_state, shardings[1])
    specs = [sh.spec for sh in jax.tree.leaves(shardings[0])]
    experts = (f", {sum('expert' in spec for spec in specs)} split over expert" if "expert" in mesh.axis_names
               else "")
    print(f"Sharded over {dict(mesh.shape)}: batches over all {mesh.size} devices, "
          f"{sum('fsdp' in spec for spec in specs)} of {len(specs)} model arrays split over fsdp{experts}",
          file=sys.stderr)
    return model_state, opt_state, shardings
