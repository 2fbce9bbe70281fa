"""The run loop: jitted steps, orbax checkpoints, exact resume, logs, curves, Ctrl-C.

    result = fit(model, OptimConfig(...), loss_fn, batches, run_dir="runs/x", steps=2000,
                 run_config=config_dict, evaluate=batch_evaluator(loss_fn, val_batches))

A run directory (``rundir``: created, locked against a second process, checked) holds:

* ``run.json``: the run's full configuration. ``--resume`` refuses to continue a run
  with a different one (every differing field is listed), so a resumed run is the run
  that was started.
* ``checkpoints/<step>/``: orbax ``CheckpointManager`` steps (the last ``keep``), each
  with the model's whole NNX state (parameters *and* its dropout RNG streams), the
  optimizer state (Adam moments, update count, so the schedule resumes too), and JSON
  metadata: step, data position, run config, model description, last metrics, and a
  checksum of every array (a restore refuses a checkpoint whose bytes changed; ``--resume``
  then falls back to the one before, saying so). The batches are a pure function of
  (seed, step), so the step fixes the data position. orbax writes into a temporary folder
  and renames it when complete: a run killed mid-save leaves the previous checkpoint intact.
* ``metrics.jsonl`` (one JSON object per log line: ``step``, ``split``, metrics) and
  ``tensorboard/`` (the same scalars); on resume both are cut back to what the checkpoint
  had seen, so a resumed run's logs read like an uninterrupted one's, each step once.
* ``curves.png``: loss and metric curves (the notebook's ``plot_loss_evolution``).

Resuming is exact: the state is restored bit for bit and the step function is
deterministic on CPU, so a run interrupted and resumed ends with the same parameters as
one that was not (tested).
"""

from __future__ import annotations

import functools
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from flax_transformer.interop.checkpoints import describe
from flax_transformer.training.distributed import place_state, put_batch
from flax_transformer.training.errors import NonFiniteLoss, RunError
from flax_transformer.training.optim import OptimConfig, make_optimizer, schedule
from flax_transformer.training.run_checkpoints import Checkpoints, check_disk_space, saved_filter
from flax_transformer.training.rundir import MetricsLog, _NoLog, is_main_process, lock_run_dir, plot_curves
from flax_transformer.training.step import compiled_train_step, eval_step

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


# ----------------------------------------------------------------------------- evaluation


def batch_evaluator(loss_fn, batches: Callable[[], object]):
    """``evaluate(model)``: the count-weighted mean of ``loss_fn``'s metrics over ``batches()``.

    ``loss_fn`` must report ``count`` (examples or tokens in the batch) among its metrics.
    Evaluators of the same ``loss_fn`` (validation, then test) share one jitted function,
    so the test pass reuses the validation pass's compilations.
    """
    step = eval_step(loss_fn)

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


def _holding_the_run_dir(function):
    """Run ``function(..., run_dir=...)`` holding the run directory's lock (``rundir.lock_run_dir``)."""

    @functools.wraps(function)
    def locked(*args, run_dir, **kwargs):
        with lock_run_dir(run_dir):
            return function(*args, run_dir=run_dir, **kwargs)

    return locked


def _restore(checkpoints, run_dir, model_state, opt_state, kept=None) -> tuple[int, dict]:
    """Fill the states in place from the latest intact checkpoint; (its step, its metadata).

    Restored straight into the states' shardings: each process reads the shards it holds. With
    ``kept`` (``run_checkpoints.saved_filter``), the model's variables it leaves out (a frozen base)
    are not read: they stay as built."""
    held = model_state if kept is None else nnx.filter_state(model_state, kept)
    like = {"model": nnx.to_pure_dict(held), "optimizer": nnx.to_pure_dict(opt_state)}
    found = checkpoints.restore_latest(like)
    if found is None:
        print(f"{run_dir} has no checkpoint yet: starting it from step 0", file=sys.stderr)
        return 0, {}
    start, restored, meta = found
    nnx.replace_by_pure_dict(model_state, restored["model"])
    nnx.replace_by_pure_dict(opt_state, restored["optimizer"])
    print(f"Resuming {run_dir} from step {start} ({meta.get('data_position')})", file=sys.stderr)
    return start, meta


@dataclass
class _State:
    """What the loop carries: the graph definitions (static), the states (arrays), where they live."""

    train_def: object
    opt_def: object
    model: nnx.State
    optimizer: nnx.State
    shardings: tuple | None
    start: int
    meta: dict
    kept: object = None  # what a checkpoint holds of the model (None: all of it; else not the frozen params)

    def pure(self) -> dict:
        model = self.model if self.kept is None else nnx.filter_state(self.model, self.kept)
        return {"model": nnx.to_pure_dict(model), "optimizer": nnx.to_pure_dict(self.optimizer)}

    def current_model(self):
        """The model as it is now, in eval mode."""
        model = nnx.merge(self.train_def, self.model)
        model.eval()
        return model


def _sizes(model, optimizer, wrt) -> dict:
    """What a run that trains ``wrt`` trains, against the whole model, and its optimizer state's bytes."""
    def count(state) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(state))

    return {"trained_params": count(nnx.state(model, wrt)), "params": count(nnx.state(model, nnx.Param)),
            "optimizer_bytes": sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(nnx.state(optimizer)))}


def _print_sizes(model, optimizer, wrt) -> None:
    sizes = _sizes(model, optimizer, wrt)
    share = sizes["trained_params"] / max(sizes["params"], 1)
    print(f"training {sizes['trained_params']:,} of the model's {sizes['params']:,} parameters ({share:.2%}); "
          f"optimizer state {sizes['optimizer_bytes']:,} bytes (the rest is frozen: no gradient, no optimizer "
          "state, not in the checkpoints)", file=sys.stderr)


def _start(model, optim, checkpoints, run_dir, *, keep: int, resume: bool, mesh, init_from_torch=None,
           wrt=nnx.Param) -> _State:
    """Split model and optimizer, place them on the mesh, restore the latest checkpoint if resuming
    (or, starting a run, the torch training checkpoint ``init_from_torch``), and check that ``keep``
    checkpoints fit on the disk."""
    model.train()
    optimizer = nnx.Optimizer(model, make_optimizer(optim), wrt=wrt)
    start = 0
    if init_from_torch is not None and not resume:
        from flax_transformer.training.torch_state.to_jax import import_torch_state

        start = import_torch_state(init_from_torch, model, optim, optimizer=optimizer)[1]
        print(f"Starting {run_dir} from {init_from_torch} at step {start}", file=sys.stderr)
    kept = None if wrt is nnx.Param else saved_filter(wrt)
    if kept is not None and is_main_process():
        _print_sizes(model, optimizer, wrt)
    train_def, model_state = nnx.split(model)
    opt_def, opt_state = nnx.split(optimizer)
    shardings = None
    if mesh is not None:
        model_state, opt_state, shardings = place_state(model_state, opt_state, mesh)
    else:  # committed to the device, as restored arrays are: a fresh run and a resumed one (whose frozen
        # arrays are built, the rest restored) then compile one same step, and none compiles it twice
        model_state, opt_state = jax.device_put((model_state, opt_state), jax.devices()[0])
    start, meta = _restore(checkpoints, run_dir, model_state, opt_state, kept) if resume else (start, {})
    state = _State(train_def, opt_def, model_state, opt_state, shardings, start, meta, kept)
    if is_main_process():
        check_disk_space(run_dir, sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state.pure())), keep)
    return state


def _check_finite(loss: float, step: int, checkpoints, run_dir) -> None:
    if not math.isfinite(loss):
        good = checkpoints.latest()
        raise NonFiniteLoss(f"the loss is {loss} at step {step + 1}: stopping. Nothing after the last good "
                            f"checkpoint was saved ({run_dir}/checkpoints/{good})" if good is not None
                            else f"the loss is {loss} at step {step + 1}: stopping before any checkpoint (lower --lr?)")


class _TrainLog:
    """The run's logs: train metrics averaged over ``log_every`` steps (with the learning rate and
    real tokens/s over the same steps, not tqdm's smoothed rate), evaluations, the progress bar.

    ``tokens_per_s`` (the bar's ``tok_s``) divides the steps' real tokens by the time spent in
    those train steps alone (``fit`` times each: its batch, the step, its metrics back on the host):
    an evaluation, a checkpoint or anything else between two steps does not lower it. What an
    evaluation took is logged apart, as ``eval_s`` in its record (and on the bar).

    The steps not logged yet (``window``) are saved with each checkpoint, so that after a resume
    the next log line averages the same steps as in an uninterrupted run. With several processes,
    process 0 alone writes."""

    def __init__(self, run_dir, batches, lr_at, state: _State, steps: int, *, log_every: int, progress: bool,
                 tensorboard: bool, description: str):
        self.main = is_main_process()
        self.batches, self.lr_at, self.steps, self.log_every = batches, lr_at, steps, log_every
        self.window, self.tokens, self.seconds = state.meta.get("log_window", []), 0, 0.0
        self.postfix: dict[str, str] = {}
        self.log = (MetricsLog(run_dir, state.start, tensorboard=tensorboard, lines=state.meta.get("log_lines"))
                    if self.main else _NoLog())
        self.bar = tqdm(total=steps, initial=state.start, desc=description, unit="step",
                        disable=not (progress and self.main), dynamic_ncols=True, mininterval=0.5)

    def train(self, step: int, metrics: dict, batch, seconds: float) -> None:
        """Record the train step that brought the run to ``step``; it took ``seconds``."""
        self.window.append({k: float(v) for k, v in metrics.items()})
        self.tokens += _tokens(self.batches, batch)
        self.seconds += seconds
        self.bar.update(1)
        if step % self.log_every and step != self.steps:
            return
        mean = {k: float(np.mean([m[k] for m in self.window])) for k in self.window[0] if k != "count"}
        mean |= {"lr": float(self.lr_at(step - 1)), "tokens_per_s": self.tokens / max(self.seconds, 1e-9)}
        self.log.write(step, "train", mean)
        self.postfix |= {"loss": f"{mean['loss']:.4f}", "tok_s": f"{mean['tokens_per_s']:,.0f}"}
        self.bar.set_postfix(self.postfix)
        self.window, self.tokens, self.seconds = [], 0, 0.0

    def evaluation(self, step: int, metrics: dict, *, seconds: float, show: bool = True) -> None:
        """Record the evaluation at ``step``, which took ``seconds`` (logged as ``eval_s``)."""
        self.log.write(step, "eval", {**metrics, "eval_s": seconds})
        self.postfix["eval_s"] = f"{seconds:.1f}"
        self.bar.set_postfix(self.postfix)
        if show and self.main:
            self.bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "count")
                           + f" ({seconds:.1f} s)", file=sys.stderr)

    def close(self) -> None:
        for thing in (self.bar, self.log):
            if thing is not None:
                thing.close()


@_holding_the_run_dir
def fit(model, optim: OptimConfig, loss_fn, batches, *, run_dir, steps: int, run_config: dict,
        evaluate: Callable | None = None, eval_every: int | None = None, checkpoint_every: int | None = None,
        keep: int = 3, resume: bool = False, log_every: int = 10, progress: bool = True,
        tensorboard: bool = True, description: str = "train", mesh=None, init_from_torch=None,
        wrt=nnx.Param) -> FitResult:
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
        resume: continue from the latest intact checkpoint in ``run_dir`` (a broken newer one
            is reported and moved aside; with no checkpoint yet, the run starts from step 0).
        mesh: a ``jax.sharding.Mesh`` with axes ("data", "fsdp") (see ``parse_mesh``): batches
            split over all its devices, parameters and optimizer state split over "fsdp".
            The results equal a one-device run's within float rounding (tested on 8 CPU devices).
            Required, over all devices, in a multi-process run (``initialize_distributed``):
            every process calls ``fit`` alike, process 0 alone writes the logs and curves, and
            the returned model is replicated in every process.
        init_from_torch: a torch training checkpoint (``torch_state``: weights, Adam/AdamW state,
            LambdaLR, step N) a new run starts from; it trains steps N+1 .. ``steps``, its batches
            those of steps N.. (a pure function of (seed, step)).
        wrt: the variables that train (an nnx filter): every ``nnx.Param`` by default; a LoRA run
            gives its adapters (and a head), so the rest of the model gets no gradient and no
            optimizer state, and its checkpoints hold everything but the frozen parameters (those
            the caller rebuilds, as the base model it started from, before a resume restores them:
            ``Checkpoints.restore_model(..., wrt=)`` likewise).

    Raises ``NonFiniteLoss`` when the loss is NaN/inf (the last good checkpoint is kept)
    and ``RunError`` for anything that stops a run before it starts. The run directory is
    locked while ``fit`` runs (another process training into it is refused).
    """
    if steps < 1:
        raise RunError(f"steps must be >= 1, got {steps}")
    if mesh is None and jax.process_count() > 1:
        raise RunError(f"a run over {jax.process_count()} processes needs a mesh over all {jax.device_count()} "
                       f"devices (--mesh data={jax.device_count()})")
    if init_from_torch is not None and wrt is not nnx.Param:
        raise RunError("a torch training checkpoint continues a run that trains every parameter; it cannot start "
                       "one that trains a part (LoRA adapters, a head)")
    run_dir = Path(run_dir)
    checkpoint_every = checkpoint_every or max(1, steps // 5)
    checkpoints = Checkpoints(run_dir, keep=keep)
    try:
        state = _start(model, optim, checkpoints, run_dir, keep=keep, resume=resume, mesh=mesh,
                       init_from_torch=init_from_torch, wrt=wrt)
        if state.start >= steps and init_from_torch is not None and not resume:
            raise RunError(f"{init_from_torch} is at step {state.start}; the run ends at step {steps}: nothing to train")
    except BaseException:
        checkpoints.close()
        raise
    try:
        description_of_model = describe(model)
    except TypeError:  # not a library model (a training-only module such as classify.Probe)
        description_of_model = {"class": f"{type(model).__module__}.{type(model).__name__}"}

    def save(step, last_metrics):
        meta = {"step": step, "data_position": batches.position(step), "run_config": run_config,
                "model": description_of_model, "metrics": last_metrics,
                "log_window": logs.window,  # the steps not logged yet
                "log_lines": logs.log.count}  # the records metrics.jsonl holds now (a resume cuts it back to them)
        checkpoints.save(step, state.pure(), meta)

    def evaluation(step, *, show=True):
        started = time.perf_counter()
        metrics = evaluate(state.current_model())
        logs.evaluation(step, metrics, seconds=time.perf_counter() - started, show=show)
        return metrics

    train_step = compiled_train_step(loss_fn, state.train_def, state.opt_def, state.shardings)
    logs, last_eval, interrupted, step = None, {}, False, state.start
    try:
        logs = _TrainLog(run_dir, batches, schedule(optim), state, steps, log_every=log_every, progress=progress,
                         tensorboard=tensorboard, description=description)
        with _StopRequest() as stop:
            while step < steps:
                started = time.perf_counter()  # the train step's time: tokens/s counts nothing else
                batch = batches.batch(step)
                state.model, state.optimizer, metrics = train_step(
                    state.model, state.optimizer, batch if mesh is None else put_batch(batch, mesh))
                metrics = jax.device_get(metrics)
                seconds = time.perf_counter() - started
                _check_finite(float(metrics["loss"]), step, checkpoints, run_dir)
                step += 1
                logs.train(step, metrics, batch, seconds)
                if evaluate is not None and eval_every and step % eval_every == 0 and step != steps:
                    last_eval = evaluation(step)
                if stop.requested:
                    interrupted = True
                    break
                if step % checkpoint_every == 0 or step == steps:
                    save(step, last_eval)
            if interrupted:
                save(step, last_eval)
                logs.bar.write(f"Saved a checkpoint at step {step} in {run_dir}; continue with --resume",
                               file=sys.stderr)
            elif evaluate is not None:
                last_eval = evaluation(step, show=False)
    finally:
        if logs is not None:
            logs.close()
        checkpoints.close()
    plot_curves(run_dir, title=description)
    if jax.process_count() > 1:  # the final model whole in every process, so that each can decode or export it
        state.model = jax.jit(lambda s: s, out_shardings=state.shardings[2])(state.model)
    return FitResult(state.current_model(), step, interrupted, last_eval)
