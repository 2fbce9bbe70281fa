"""Checkpoints of a run: an orbax ``CheckpointManager`` over ``run_dir/checkpoints``, checked.

* Every checkpoint stores a checksum (BLAKE2b) of each of its arrays in its metadata; a
  restore recomputes them and refuses a checkpoint whose bytes changed, naming it.
* ``Checkpoints.restore_latest`` (what ``--resume`` uses) falls back to the newest
  checkpoint that is intact, saying so, and moves the broken ones to ``broken-checkpoints/``.
* A reader of a run that may still be training (``restore_newest``, ``restore_model``: ``port
  RUN_DIR``, ``load_run``, ``generate --checkpoint``) reads the newest checkpoint; when it is
  removed while it is read (the run's ``keep``), the checkpoints are listed again and the newest
  read, once more.
* A save that fails (a full disk) removes its unfinished folder and raises ``RunError`` with
  the reason in one line; orbax's own tracebacks are kept off stderr (``interop.orbax_quiet``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop import orbax_quiet
from flax_transformer.interop.placement import is_key as _is_key
from flax_transformer.training.errors import RunError
from flax_transformer.training.rundir import BROKEN, barrier, is_main_process

# ----------------------------------------------------------------------------- checkpoints


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:,.0f} KiB"


def check_disk_space(run_dir, nbytes: int, keep: int) -> None:
    """Refuse a run whose checkpoints (``nbytes`` each) cannot fit on the disk of ``run_dir``."""
    try:
        stat = os.statvfs(run_dir)
    except OSError:
        return
    free = stat.f_bavail * stat.f_frsize
    if free < nbytes * 1.1:
        raise RunError(f"{run_dir}: {_size(free)} free on its disk, but one checkpoint needs about {_size(nbytes)}: "
                       "free some space, or choose another --out")
    if free < nbytes * (keep + 1):
        print(f"warning: {_size(free)} free on the disk of {run_dir}; {keep} checkpoints of about {_size(nbytes)} "
              "may not fit", file=sys.stderr)


def saved_filter(wrt=nnx.Param):
    """The nnx filter of what a checkpoint of a run that trains ``wrt`` holds of its model: everything
    (``wrt`` every ``nnx.Param``), else everything but the frozen parameters (the ``nnx.Param``s ``wrt``
    leaves out: a LoRA run's base), which the reader rebuilds as the run did."""
    if wrt is nnx.Param:
        return ...
    return nnx.Not(nnx.All(nnx.Param, nnx.Not(wrt)))


def _storable(tree):
    """Typed PRNG keys -> their raw uint32 data (what orbax can write)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _unstorable(tree, like):
    return jax.tree.map(lambda x, ref: jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref))
                        if _is_key(ref) else jnp.asarray(x, dtype=ref.dtype), tree, like)


def _host_value(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))  # every process calls this alike
    return np.asarray(x)


def array_checksums(tree) -> dict[str, str]:
    """{path of each array: BLAKE2b of its dtype, shape and bytes}: the same for any sharding."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        value = np.ascontiguousarray(_host_value(leaf))
        digest = hashlib.blake2b(f"{value.dtype.name}{value.shape}".encode(), digest_size=16)
        digest.update(value.reshape(-1).view(np.uint8).data if value.size else b"")
        out[jax.tree_util.keystr(path)] = digest.hexdigest()
    return out


def _first_line(error: BaseException) -> str:
    """``Type: message`` in one line of at most ~300 characters (the start and the end of a long one,
    where tensorstore puts the operating system's reason, e.g. "No space left on device")."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > 300:
        text = f"{text[:140]} ... {text[-150:]}"
    return f"{type(error).__name__}: {text}"


class _Vanished(RunError):
    """A checkpoint removed while it was read (a run still training keeps its last ``keep``)."""

    def __init__(self, path: Path):
        super().__init__(f"checkpoint {path} was removed while it was read (a run still training removes its "
                         "older checkpoints as it saves new ones)")


class Checkpoints:
    """An orbax ``CheckpointManager`` over ``run_dir/checkpoints`` keeping the last ``keep`` steps.

    ``read_only`` (reading a run, e.g. ``--predict``) creates nothing."""

    def __init__(self, run_dir, keep: int = 3, *, read_only: bool = False):
        import orbax.checkpoint as ocp

        orbax_quiet.install_filters()
        self._ocp = ocp
        self.run_dir = Path(run_dir)
        self.directory = (self.run_dir / "checkpoints").absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise RunError(f"{self.directory} is a file, not the run's checkpoint folder")
        try:
            with orbax_quiet.quiet_absl():
                self.manager = ocp.CheckpointManager(
                    self.directory, options=ocp.CheckpointManagerOptions(
                        max_to_keep=keep, create=not read_only, read_only=read_only,
                        cleanup_tmp_directories=not read_only),  # the leftovers of a run killed mid-save
                    item_names=("state", "meta"))
        except Exception as error:  # orbax raises many kinds
            raise RunError(f"cannot open the checkpoints in {self.directory}: {_first_line(error)}") from None

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Write checkpoint ``step`` (``meta`` gains the arrays' checksums); ``RunError`` if it cannot be
        written (a full disk), after removing the unfinished checkpoint."""
        ocp = self._ocp
        state = _storable(state)
        meta = dict(meta, checksums=array_checksums(state))
        try:
            with orbax_quiet.errors_raised_not_logged():
                self.manager.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
                self.manager.wait_until_finished()
        except Exception as error:
            if is_main_process():
                for unfinished in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                    shutil.rmtree(unfinished, ignore_errors=True)
            found = re.search(r"([^:\[\]]+) \[os_error_code='?(\d+)'?\]", str(error))  # tensorstore's I/O errors
            reason = f"{found.group(1).strip()} (errno {found.group(2)})" if found else _first_line(error)
            raise RunError(f"could not write checkpoint {step} into {self.directory}: {reason}") from None

    def _verify(self, step: int, state, meta: dict) -> None:
        saved = meta.get("checksums")
        if not isinstance(saved, dict):
            return  # written before checksums were stored
        now = array_checksums(state)
        bad = [path for path, digest in now.items() if saved.get(path, digest) != digest]
        if bad:
            raise RunError(f"checkpoint {self.directory / str(step)} is corrupt: {len(bad)} of its arrays "
                           f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}) differ from the checksums saved "
                           "with it")

    def _read(self, step: int, state_args):
        ocp = self._ocp
        path = self.directory / str(step)
        try:
            with orbax_quiet.errors_raised_not_logged():
                restored = self.manager.restore(step, args=ocp.args.Composite(state=state_args,
                                                                              meta=ocp.args.JsonRestore()))
            state, meta = restored["state"], restored["meta"]
            if not isinstance(meta, dict):
                raise ValueError("its metadata is not a JSON object")
        except Exception as error:  # orbax/tensorstore raise many kinds; all mean the same to the user
            if not path.exists():
                raise _Vanished(path) from None
            raise RunError(f"checkpoint {path} is unreadable: {_first_line(error)}") from None
        try:
            self._verify(step, state, meta)
        except RunError:
            if not path.exists():  # removed after some of its files were read
                raise _Vanished(path) from None
            raise
        return state, dict(meta)

    def _read_newest(self, state_args) -> tuple[int, object, dict]:
        """(step, state, meta) of the newest checkpoint, for a reader of a run that may still be training:
        when the checkpoint is removed while it is read (the run's ``keep`` removes its older checkpoints
        as it saves newer ones), the checkpoints are listed again and the newest read, once more."""
        removed = None
        while True:
            step = self.latest()
            if step is None:
                raise RunError(f"no checkpoint in {self.directory}" + (
                    "" if removed is None else f" (checkpoint {removed} was removed while it was read)"))
            try:
                state, meta = self._read(step, state_args)
            except _Vanished as error:
                if removed is not None:
                    raise RunError(f"{error}, and so was checkpoint {removed} before it: is something removing the "
                                   f"checkpoints in {self.directory}? Try again") from None
                removed = step
                with orbax_quiet.quiet_absl():
                    self.manager.reload()
                continue
            return step, state, meta

    def restore_newest(self, like: dict) -> tuple[int, dict, dict]:
        """(step, state shaped like ``like``, meta) of the newest checkpoint, for a reader (``port``,
        ``load_run``): one removed while it is read (a run still training keeps its last ``keep``) is
        replaced by the newest listed again. ``RunError`` if it cannot be read or its arrays differ from
        their checksums, or there is none."""
        step, state, meta = self._read_newest(self._ocp.args.StandardRestore(_storable(like)))
        return step, _unstorable(state, like), meta

    def restore(self, step: int, like: dict) -> tuple[dict, dict]:
        """(state shaped like ``like``, meta) of checkpoint ``step``; ``RunError`` if it cannot be read or
        its arrays differ from their checksums."""
        try:
            state, meta = self._read(step, self._ocp.args.StandardRestore(_storable(like)))
        except RunError as error:
            others = [s for s in self.steps() if s != step]
            raise RunError(f"{error}. Nothing was changed. Other checkpoints: {others or 'none'}") from None
        return _unstorable(state, like), meta

    def restore_latest(self, like: dict) -> tuple[int, dict, dict] | None:
        """(step, state, meta) of the newest checkpoint that restores intact (None when there is none).

        A broken newer one is reported on stderr and moved to ``run_dir/broken-checkpoints/``
        (so that the run can save that step again); ``RunError`` when none is intact."""
        steps, failures = self.steps(), []
        for step in reversed(steps):
            try:
                state, meta = self._read(step, self._ocp.args.StandardRestore(_storable(like)))
            except RunError as error:
                failures.append(str(error).splitlines()[0])
                if is_main_process():
                    print(f"warning: {failures[-1]}", file=sys.stderr)
                continue
            if failures:
                moved = [self._set_aside(broken) for broken in steps if broken > step]
                if is_main_process():
                    print(f"warning: resuming from the previous checkpoint, step {step}; the broken one(s) were moved "
                          f"to {', '.join(str(m) for m in moved)}", file=sys.stderr)
            return step, _unstorable(state, like), meta
        if failures:
            # the warnings above named each failure; the error is one line
            raise RunError(f"no checkpoint in {self.directory} can be restored ({len(failures)} corrupt or unreadable, "
                           "named above). Nothing was changed.")
        return None

    def _set_aside(self, step: int) -> Path:
        target = self.run_dir / BROKEN / str(step)
        n = 1
        while target.exists():
            n += 1
            target = self.run_dir / BROKEN / f"{step}-{n}"
        barrier(f"set aside {step}: chosen")
        if is_main_process():
            target.parent.mkdir(exist_ok=True)
            os.rename(self.directory / str(step), target)
        barrier(f"set aside {step}: moved")
        self.manager.reload()
        return target

    def restore_model(self, model, step: int | None = None, *, wrt=nnx.Param):
        """Fill ``model`` (a built NNX model) with checkpoint ``step`` (default: the newest, listed again
        if it is removed while it is read: ``restore_newest``), checked against its checksums.

        ``wrt``: what the run trained (``fit``'s); the frozen parameters it leaves out are not in the
        checkpoint, and stay as ``model`` holds them (the base the run was rebuilt from)."""
        graphdef, state = nnx.split(model)
        like = {"model": nnx.to_pure_dict(nnx.filter_state(state, saved_filter(wrt)))}
        ocp = self._ocp
        target = _storable(like)  # the model part only: no need to know the optimizer to predict
        args = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                      partial_restore=True)
        if step is None:
            step, restored, _ = self._read_newest(args)
        else:
            restored, _ = self._read(step, args)
        nnx.replace_by_pure_dict(state, _unstorable(restored, like)["model"])
        return nnx.merge(graphdef, state), step

    def close(self):
        with contextlib.suppress(Exception), orbax_quiet.quiet_absl():  # after a failed save orbax may raise again here
            self.manager.close()
