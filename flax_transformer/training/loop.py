"""The run loop: jitted steps, orbax checkpoints, exact resume, logs, curves, Ctrl-C.

    result = fit(model, OptimConfig(...), loss_fn, batches, run_dir="runs/x", steps=2000,
                 run_config=config_dict, evaluate=batch_evaluator(loss_fn, val_batches))

A run directory holds:

* ``run.json``: the run's full configuration. ``--resume`` refuses to continue a run
  with a different one (every differing field is listed), so a resumed run is the run
  that was started.
* ``checkpoints/<step>/``: orbax ``CheckpointManager`` steps (the last ``keep``), each
  with the model's whole NNX state (parameters *and* its dropout RNG streams), the
  optimizer state (Adam moments, update count, so the schedule resumes too), and JSON
  metadata: step, data position, run config, model description, last metrics. The
  batches are a pure function of (seed, step), so the step fixes the data position.
  orbax writes into a temporary folder and renames it when complete: a run killed
  mid-save leaves the previous checkpoint intact.
* ``metrics.jsonl`` (one JSON object per log line: ``step``, ``split``, metrics) and
  ``tensorboard/`` (the same scalars); on resume both are cut back to the checkpoint's
  step, so a resumed run's logs read like an uninterrupted one's.
* ``curves.png``: loss and metric curves (the notebook's ``plot_loss_evolution``).

Resuming is exact: the state is restored bit for bit and the step function is
deterministic on CPU, so a run interrupted and resumed ends with the same parameters as
one that was not (tested).
"""

from __future__ import annotations

import functools
import json
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from .. import files
from ..checkpoints import describe
from .optim import OptimConfig, make_optimizer, schedule


class RunError(RuntimeError):
    """A run cannot start or go on: a clear message, and nothing in the run directory was lost."""


class NonFiniteLoss(RunError):
    """The loss became NaN or infinite; the run stopped before saving the bad state."""


# ----------------------------------------------------------------------------- run directory


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_differences(saved: dict, given: dict) -> list[str]:
    """``["field: saved -> given", ...]`` for every field that differs."""
    a, b = _flatten(saved), _flatten(given)
    return [f"{k}: {a.get(k, '<absent>')!r} (checkpoint) vs {b.get(k, '<absent>')!r} (now)"
            for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")]


def prepare_run_dir(run_dir, run_config: dict, *, resume: bool) -> Path:
    """Check that a new run would not overwrite another, or that ``resume`` continues the same run.

    Raises ``RunError`` (and changes nothing) when a new run would overwrite an existing
    one, when there is nothing to resume, or when the configuration differs from the saved one.
    Creates nothing: call ``create_run_dir`` once the data has loaded, so that a run that
    fails on its input leaves no half-made run directory behind.
    """
    run_dir = Path(run_dir)
    saved_path = run_dir / "run.json"
    if resume:
        if not saved_path.is_file():
            raise RunError(f"--resume: {run_dir} holds no run (no run.json); start one with --out {run_dir}")
        try:
            saved = json.loads(saved_path.read_text())
        except (OSError, ValueError) as error:
            raise RunError(f"--resume: {saved_path} is unreadable ({error})") from None
        diff = config_differences(saved, json.loads(json.dumps(run_config)))
        if diff:
            raise RunError("--resume with a different configuration than the run in "
                           f"{run_dir}:\n  " + "\n  ".join(diff) +
                           "\nResume with the same flags, or start a new run with another --out.")
        return run_dir
    if saved_path.exists() or any((run_dir / "checkpoints").glob("*")):
        raise RunError(f"{run_dir} already holds a run; continue it with --resume, or choose another --out")
    return run_dir


def create_run_dir(run_dir, run_config: dict) -> Path:
    """Make a new run's directory and write its ``run.json`` (after ``prepare_run_dir`` checked it).

    With several processes every one checks the folder first, then process 0 alone writes.
    """
    run_dir = Path(run_dir)
    prepare_run_dir(run_dir, run_config, resume=False)
    barrier("create_run_dir: checked")  # no process may see process 0's run.json as "another run"
    if is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
        files.write_text(run_dir / "run.json", json.dumps(run_config, indent=2) + "\n")
    barrier("create_run_dir: written")
    return run_dir


# ----------------------------------------------------------------------------- checkpoints


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _storable(tree):
    """Typed PRNG keys -> their raw uint32 data (what orbax can write)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _unstorable(tree, like):
    return jax.tree.map(lambda x, ref: jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref))
                        if _is_key(ref) else jnp.asarray(x, dtype=ref.dtype), tree, like)


class Checkpoints:
    """An orbax ``CheckpointManager`` over ``run_dir/checkpoints`` keeping the last ``keep`` steps."""

    def __init__(self, run_dir, keep: int = 3):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = (Path(run_dir) / "checkpoints").absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: dict, meta: dict) -> None:
        ocp = self._ocp
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_storable(state)), meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def restore(self, step: int, like: dict) -> tuple[dict, dict]:
        """(state shaped like ``like``, meta) of checkpoint ``step``; ``RunError`` if it cannot be read."""
        ocp = self._ocp
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_storable(like)), meta=ocp.args.JsonRestore()))
            return _unstorable(restored["state"], like), dict(restored["meta"])
        except Exception as error:  # orbax/tensorstore raise many kinds; all mean the same to the user
            others = [s for s in self.steps() if s != step]
            raise RunError(f"checkpoint {self.directory / str(step)} is unreadable: {type(error).__name__}: "
                           f"{str(error)[:300]}\nNothing was changed. Other checkpoints: {others or 'none'}; "
                           "move the broken one aside to resume from the one before it.") from None

    def restore_model(self, model, step: int | None = None):
        """Fill ``model`` (a built NNX model) with checkpoint ``step`` (default: the latest)."""
        step = self.latest() if step is None else step
        if step is None:
            raise RunError(f"no checkpoint in {self.directory}")
        graphdef, state = nnx.split(model)
        like = {"model": nnx.to_pure_dict(state)}
        ocp = self._ocp
        target = _storable(like)
        try:  # the model part only: no need to know the optimizer to predict
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)))["state"]
        except Exception as error:
            raise RunError(f"checkpoint {self.directory / str(step)} is unreadable: {type(error).__name__}: "
                           f"{str(error)[:300]}") from None
        nnx.replace_by_pure_dict(state, _unstorable(restored, like)["model"])
        return nnx.merge(graphdef, state), step

    def close(self):
        self.manager.close()


# ----------------------------------------------------------------------------- logs and curves


class _NoLog:
    """What processes other than the first log: nothing (process 0 writes the run's files)."""

    def write(self, step: int, split: str, metrics: dict) -> None:
        pass

    def close(self):
        pass


class MetricsLog:
    """``metrics.jsonl`` and TensorBoard scalars; ``start`` > 0 cuts both back to that step (resume)."""

    def __init__(self, run_dir, start: int = 0, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        kept = []
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start]
        files.write_text(self.path, "".join(line + "\n" for line in kept), overwrite=True)
        self.file = open(self.path, "a")
        self.writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start or None)

    def write(self, step: int, split: str, metrics: dict) -> None:
        record = {"step": step, "split": split, **{k: float(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(f"{split}/{key}", float(value), step)

    def close(self):
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def plot_curves(run_dir, title: str = "") -> Path | None:
    """``run_dir/curves.png``: train and eval loss against step, then one panel per other eval metric.

    Only process 0 draws (and returns the path); other processes of a multi-process run return None.
    """
    if not is_main_process():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        return None
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in records:
        for key, value in r.items():
            if key not in ("step", "split", "lr", "tokens_per_s", "grad_norm", "count"):
                series.setdefault((r["split"], key), []).append((r["step"], value))
    metrics = ["loss"] + sorted({k for _, k in series if k != "loss"})
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for split in ("train", "eval", "test"):
            points = series.get((split, metric))
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if split != "train" else None, markersize=3, label=split)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.set_title(metric)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    files.write_file(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), overwrite=True)
    plt.close(fig)
    return out


# ----------------------------------------------------------------------------- Ctrl-C


class _StopRequest:
    """First Ctrl-C asks the loop to save and stop after the current step; a second one aborts."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nInterrupted: saving a checkpoint after this step (Ctrl-C again to abort without saving)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


# ----------------------------------------------------------------------------- steps


# ----------------------------------------------------------------------------- devices and processes


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


def is_main_process() -> bool:
    """Whether this process writes the run's files and prints progress (process 0; the only one, usually)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process of a multi-process run gets here; nothing with one process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def parse_mesh(spec: str | None):
    """``"data=4,fsdp=2"`` -> a ``jax.sharding.Mesh`` over the first 8 devices, axes ("data", "fsdp").

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
            if name.strip() not in sizes:
                raise ValueError(name)
            sizes[name.strip()] = int(value)
    except ValueError:
        raise RunError(f"--mesh {spec!r}: expected data=N,fsdp=M") from None
    n = sizes["data"] * sizes["fsdp"]
    devices = jax.devices()
    if n < 1 or n > len(devices):
        raise RunError(f"--mesh {spec} needs {n} devices, {len(devices)} available "
                       "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    if jax.process_count() > 1 and n != len(devices):
        raise RunError(f"--mesh {spec} covers {n} devices; a run over {jax.process_count()} processes must cover "
                       f"all {len(devices)} of their devices")
    grid = np.array(devices[:n]).reshape(sizes["data"], sizes["fsdp"])
    return jax.sharding.Mesh(grid, ("data", "fsdp"))


def _param_spec(x, fsdp: int):
    """FSDP: split a parameter (and its Adam moments) along its largest axis that ``fsdp`` divides."""
    from jax.sharding import PartitionSpec as P

    shape = getattr(x, "shape", ())
    if fsdp == 1 or not shape or _is_key(x):
        return P()
    axes = sorted(range(len(shape)), key=lambda i: -shape[i])
    for axis in axes:
        if shape[axis] % fsdp == 0:
            return P(*[("fsdp" if i == axis else None) for i in range(len(shape))])
    return P()  # too small to split: replicated


def state_shardings(tree, mesh):
    from jax.sharding import NamedSharding

    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, _param_spec(x, fsdp)), tree)


def batch_sharding(batch, mesh):
    """Every batch array split along its first (batch) axis over both mesh axes: data parallel over all devices."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.size
    for key, value in batch.items():
        if np.ndim(value) and np.shape(value)[0] % n:
            raise RunError(f"batch size {np.shape(value)[0]} ({key}) is not divisible by the {n} devices of the mesh")
    return {k: NamedSharding(mesh, P(("data", "fsdp")) if np.ndim(v) else P()) for k, v in batch.items()}


def _to_mesh(tree, shardings):
    """Arrays that every process holds whole and alike (a freshly built model) onto their ``shardings``."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, sharding):  # device_put refuses arrays committed to one process's device
        if _is_key(x):
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


def _compiled_steps(loss_fn, train_def, opt_def, shardings=None):
    """The train step as a pure function of (model state, optimizer state), traced once per batch shape.

    With ``shardings`` = (model state, optimizer state, replicated) the step keeps the
    parameters and optimizer state where they are (FSDP) and XLA's SPMD partitioner inserts
    the collectives: no hand-written all-reduce.
    """
    jit = partial(jax.jit, donate_argnums=(0, 1))
    if shardings is not None:
        model_sh, opt_sh, replicated = shardings
        jit = partial(jax.jit, donate_argnums=(0, 1), out_shardings=(model_sh, opt_sh, replicated))

    @jit
    def train_step(model_state, opt_state, batch):
        model = nnx.merge(train_def, model_state)
        optimizer = nnx.merge(opt_def, opt_state)
        (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return nnx.state(model), nnx.state(optimizer), dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))

    return train_step


@functools.cache
def _jitted_loss(loss_fn):
    return nnx.jit(loss_fn)


def batch_evaluator(loss_fn, batches: Callable[[], object]):
    """``evaluate(model)``: the count-weighted mean of ``loss_fn``'s metrics over ``batches()``.

    ``loss_fn`` must report ``count`` (examples or tokens in the batch) among its metrics.
    Evaluators of the same ``loss_fn`` (validation, then test) share one jitted function,
    so the test pass reuses the validation pass's compilations.
    """
    step = _jitted_loss(loss_fn)

    def evaluate(model):
        totals, count = {}, 0.0
        for batch in batches():
            loss, metrics = jax.device_get(step(model, batch))
            n = float(metrics["count"])
            count += n
            for key, value in dict(metrics, loss=loss).items():
                if key != "count":
                    totals[key] = totals.get(key, 0.0) + float(value) * n
        if count == 0:
            raise RunError("the evaluation set is empty")
        return {key: value / count for key, value in totals.items()} | {"count": count}

    return evaluate


# ----------------------------------------------------------------------------- fit


@dataclass
class FitResult:
    model: nnx.Module  # in eval mode, holding the final parameters
    step: int
    interrupted: bool
    metrics: dict = field(default_factory=dict)  # the last evaluation


def _tokens(batches, batch) -> int:
    """Real (unpadded) tokens in a batch, for tokens/s: the batcher's count, else the mask's or the ids'."""
    if hasattr(batches, "count_tokens"):
        return batches.count_tokens(batch)
    if "mask" in batch:
        return int(batch["mask"].sum())
    return int(np.asarray(batch["ids"]).size)


def fit(model, optim: OptimConfig, loss_fn, batches, *, run_dir, steps: int, run_config: dict,
        evaluate: Callable | None = None, eval_every: int | None = None, checkpoint_every: int | None = None,
        keep: int = 3, resume: bool = False, log_every: int = 10, progress: bool = True,
        tensorboard: bool = True, description: str = "train", mesh=None) -> FitResult:
    """Train ``model`` for ``steps`` optimizer updates, saving, logging and evaluating as it goes.

    Args:
        model: an NNX model built with ``nnx.Rngs(params=..., dropout=...)`` (dropout draws
            from its own stream, which is saved with the model).
        optim: the optax chain to build (``make_optimizer``).
        loss_fn: ``loss_fn(model, batch) -> (loss, metrics)``; metrics include ``count``.
        batches: ``batches.batch(step)`` (a dict of arrays) and ``batches.position(step)``.
        run_dir: prepared with ``prepare_run_dir`` (``run.json`` written or checked).
        evaluate: ``evaluate(model) -> metrics`` on held-out data, every ``eval_every``
            steps and at the end.
        checkpoint_every: save every so many steps (and always at the end, and on Ctrl-C).
        resume: continue from the latest checkpoint in ``run_dir``.
        mesh: a ``jax.sharding.Mesh`` with axes ("data", "fsdp") (see ``parse_mesh``): batches
            split over all its devices, parameters and optimizer state split over "fsdp".
            The results equal a one-device run's within float rounding (tested on 8 CPU devices).
            Required, over all devices, in a multi-process run (``initialize_distributed``):
            every process calls ``fit`` alike, process 0 alone writes the logs and curves, and
            the returned model is replicated in every process.

    Raises ``NonFiniteLoss`` when the loss is NaN/inf (the last good checkpoint is kept)
    and ``RunError`` for anything that stops a run before it starts.
    """
    if steps < 1:
        raise RunError(f"steps must be >= 1, got {steps}")
    if mesh is None and jax.process_count() > 1:
        raise RunError(f"a run over {jax.process_count()} processes needs a mesh over all {jax.device_count()} "
                       f"devices (--mesh data={jax.device_count()})")
    run_dir = Path(run_dir)
    checkpoint_every = checkpoint_every or max(1, steps // 5)
    optimizer = nnx.Optimizer(model, make_optimizer(optim), wrt=nnx.Param)
    lr_at = schedule(optim)
    checkpoints = Checkpoints(run_dir, keep=keep)
    model.train()
    train_def, model_state = nnx.split(model)
    opt_def, opt_state = nnx.split(optimizer)
    shardings = None
    if mesh is not None:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        shardings = (state_shardings(model_state, mesh), state_shardings(opt_state, mesh), NamedSharding(mesh, P()))
        model_state = _to_mesh(model_state, shardings[0])
        opt_state = _to_mesh(opt_state, shardings[1])
        specs = [sh.spec for sh in jax.tree.leaves(shardings[0])]
        print(f"Sharded over {dict(mesh.shape)}: batches over all {mesh.size} devices, "
              f"{sum('fsdp' in spec for spec in specs)} of {len(specs)} model arrays split over fsdp",
              file=sys.stderr)
    start = 0
    if resume:
        start = checkpoints.latest()
        if start is None:
            checkpoints.close()
            raise RunError(f"--resume: {run_dir} has no checkpoint yet; start it again without --resume "
                           "(delete the folder first)")
        # restored straight into the mesh's shardings: each process reads the shards it holds
        like = {"model": nnx.to_pure_dict(model_state), "optimizer": nnx.to_pure_dict(opt_state)}
        restored, meta = checkpoints.restore(start, like)
        nnx.replace_by_pure_dict(model_state, restored["model"])
        nnx.replace_by_pure_dict(opt_state, restored["optimizer"])
        print(f"Resuming {run_dir} from step {start} ({meta.get('data_position')})", file=sys.stderr)
    window = meta.get("log_window", []) if resume else []  # so the next log line averages the same steps

    def current_model():
        m = nnx.merge(train_def, model_state)
        m.eval()
        return m

    try:
        description_of_model = describe(model)
    except TypeError:  # not a library model (a training-only module such as classify.Probe)
        description_of_model = {"class": f"{type(model).__module__}.{type(model).__name__}"}

    def save(step, last_metrics):
        meta = {"step": step, "data_position": batches.position(step), "run_config": run_config,
                "model": description_of_model, "metrics": last_metrics,
                "log_window": window}  # the steps not logged yet
        checkpoints.save(step, {"model": nnx.to_pure_dict(model_state), "optimizer": nnx.to_pure_dict(opt_state)},
                         meta)

    train_step = _compiled_steps(loss_fn, train_def, opt_def, shardings)
    main = is_main_process()  # with several processes, process 0 alone writes the logs and the progress bar
    log = MetricsLog(run_dir, start, tensorboard=tensorboard) if main else _NoLog()
    bar = tqdm(total=steps, initial=start, desc=description, unit="step", disable=not (progress and main),
               dynamic_ncols=True, mininterval=0.5)
    window_tokens, window_start = 0, time.perf_counter()
    last_eval, interrupted, step = {}, False, start
    try:
        with _StopRequest() as stop:
            while step < steps:
                batch = batches.batch(step)
                model_state, opt_state, metrics = train_step(
                    model_state, opt_state, batch if mesh is None else put_batch(batch, mesh))
                metrics = jax.device_get(metrics)
                loss = float(metrics["loss"])
                if not math.isfinite(loss):
                    good = checkpoints.latest()
                    raise NonFiniteLoss(f"the loss is {loss} at step {step + 1}: stopping. Nothing after the last "
                                        f"good checkpoint was saved ({run_dir}/checkpoints/{good})" if good is not None
                                        else f"the loss is {loss} at step {step + 1}: stopping before any "
                                        "checkpoint (lower --lr?)")
                step += 1
                window.append({k: float(v) for k, v in metrics.items()})
                window_tokens += _tokens(batches, batch)
                bar.update(1)
                if step % log_every == 0 or step == steps:
                    seconds = time.perf_counter() - window_start
                    mean = {k: float(np.mean([m[k] for m in window])) for k in window[0] if k != "count"}
                    mean |= {"lr": float(lr_at(step - 1)), "tokens_per_s": window_tokens / max(seconds, 1e-9)}
                    log.write(step, "train", mean)
                    bar.set_postfix(loss=f"{mean['loss']:.4f}", tok_s=f"{mean['tokens_per_s']:,.0f}")
                    window, window_tokens, window_start = [], 0, time.perf_counter()
                if evaluate is not None and eval_every and step % eval_every == 0 and step != steps:
                    last_eval = evaluate(current_model())
                    log.write(step, "eval", last_eval)
                    if main:
                        bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in last_eval.items()
                                                               if k != "count"), file=sys.stderr)
                if stop.requested:
                    interrupted = True
                    break
                if step % checkpoint_every == 0 or step == steps:
                    save(step, last_eval)
            if interrupted:
                save(step, last_eval)
                bar.write(f"Saved a checkpoint at step {step} in {run_dir}; continue with --resume", file=sys.stderr)
            elif evaluate is not None:
                last_eval = evaluate(current_model())
                log.write(step, "eval", last_eval)
    finally:
        bar.close()
        log.close()
        checkpoints.close()
    plot_curves(run_dir, title=description)
    if jax.process_count() > 1:  # the final model whole in every process, so that each can decode or export it
        model_state = jax.jit(lambda state: state, out_shardings=shardings[2])(model_state)
    return FitResult(current_model(), step, interrupted, last_eval)
