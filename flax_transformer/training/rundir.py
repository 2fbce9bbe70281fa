"""The run directory: ``run.json``, its lock, the logs and curves (the checkpoints: ``run_checkpoints``).

* ``open_run`` checks ``--out`` and the configuration, creates the folder and ``run.json``
  (a new run) and holds an exclusive lock on it (``.lock``, ``fcntl.flock``) while the run
  goes on: a second ``--resume`` of the same run, or a second new run into the same
  ``--out``, is refused with a clear message instead of crashing inside orbax. The kernel
  drops the lock when the process ends, however it ends, so a ``kill -9`` leaves no stale
  lock. With several processes, process 0 holds it for all of them.
* A new run that fails before its first checkpoint (a bad flag found late, no memory, a
  full disk, a second Ctrl-C) removes what it made, so the same ``--out`` can be used again.
* ``checkpoints/``: see ``run_checkpoints.Checkpoints`` (with a checksum of every array).
* ``metrics.jsonl`` holds each (step, split) once: a resumed run cuts it back to the lines
  its checkpoint had seen, and a line written again replaces the old one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np

from flax_transformer.interop import files
from flax_transformer.training.errors import RunDirBusy, RunError
from flax_transformer.training.run_config import from_dict, nest

LOCK_NAME = ".lock"
BROKEN = "broken-checkpoints"
# what a run writes into its folder (removed again when a new run fails before its first checkpoint)
RUN_FILES = ("run.json", "tokenizer.json", "metrics.jsonl", "tensorboard", "checkpoints", "features", "curves.png",
             "sample.txt", BROKEN, LOCK_NAME)


# ----------------------------------------------------------------------------- processes


def is_main_process() -> bool:
    """Whether this process writes the run's files and prints progress (process 0; the only one, usually)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process of a multi-process run gets here; nothing with one process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _all_agree(ok: bool) -> bool:
    """Process 0's ``ok``, in every process (a broadcast; just ``ok`` with one process)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


# ----------------------------------------------------------------------------- the folder


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


def check_out(run_dir) -> Path:
    """Refuse (``RunError``) a run directory that could not be written: a name that is not UTF-8,
    a file where the folder should be, or a folder (or the nearest one above it) that is read-only."""
    text = os.fsdecode(run_dir)
    try:
        text.encode("utf-8")
    except UnicodeError:
        raise RunError(f"--out {ascii(text)} is not a UTF-8 file name: choose another") from None
    path = Path(text)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise RunError(f"--out {path} is a file, not a folder: choose another path")
        where = path
    else:
        where = path.absolute().parent
        while not where.exists() and not where.is_symlink():
            where = where.parent
        if not where.is_dir():
            raise RunError(f"--out {path}: {where} is a file, not a folder")
    if not os.access(where, os.W_OK | os.X_OK):
        raise RunError(f"--out {path}: cannot write into {where} (read-only, or no permission)")
    try:
        longest = os.pathconf(where, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    for part in path.absolute().relative_to(where.absolute()).parts if where != path else ():
        if len(os.fsencode(part)) > longest:
            raise RunError(f"--out {path}: the name {part[:40]!r}... is longer than the {longest} bytes a file "
                           "name may have here")
    return path


def read_run_config(run_dir) -> dict:
    """``run_dir/run.json`` as a dict, its config nested (``run``, ``optim``) even when the file was
    written flat, before the nesting (``run_config.nest``); ``RunError`` when it is missing or unreadable."""
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise RunError(f"{run_dir} holds no run (no run.json)")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise RunError(f"{path} is unreadable ({error})") from None
    if not isinstance(saved, dict):
        raise RunError(f"{path} is not a run configuration (a JSON object)")
    return nest(saved)


def config_of_run(run_dir, task: str, config_cls):
    """The task config (``config_cls``) a run directory of ``task`` was started with; ``RunError`` when
    ``run.json`` is missing, unreadable, of another task, or holds fields that are not valid."""
    saved = read_run_config(run_dir)
    if saved.pop("task", None) != task:
        raise RunError(f"{run_dir} holds a run of another task, not {task}")
    try:
        return from_dict(config_cls, saved)
    except (TypeError, ValueError) as error:
        raise RunError(f"{Path(run_dir) / 'run.json'}: {error}") from None


def read_tokenizer(path):
    """A ``tokenizers.Tokenizer`` saved in a run directory; ``RunError`` if it cannot be read."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust library raises plain Exceptions
        raise RunError(f"{path} is unreadable: {str(error)[:200]}") from None


def prepare_run_dir(run_dir, run_config: dict, *, resume: bool) -> Path:
    """Check that a new run would not overwrite another, or that ``resume`` continues the same run.

    Raises ``RunError`` (and changes nothing) when ``run_dir`` cannot be written, when a new
    run would overwrite an existing one, when there is nothing to resume, or when the
    configuration differs from the saved one. Creates nothing: ``open_run`` (or
    ``create_run_dir``) does, once the data has loaded, so that a run that fails on its
    input leaves no half-made run directory behind.
    """
    run_dir = check_out(run_dir)
    if resume:
        if not (run_dir / "run.json").is_file():
            raise RunError(f"--resume: {run_dir} holds no run (no run.json); start one with --out {run_dir}")
        try:
            saved = read_run_config(run_dir)
        except RunError as error:
            raise RunError(f"--resume: {error}") from None
        if "task" in run_config and saved.get("task") != run_config["task"]:
            raise RunError(f"--resume: {run_dir} holds a {saved.get('task')!r} run, not {run_config['task']!r}")
        diff = config_differences(saved, json.loads(json.dumps(run_config)))
        if diff:
            # one line (the CLI's rule), every differing field named
            raise RunError(f"--resume with a different configuration than the run in {run_dir}: " + "; ".join(diff) +
                           ". Resume with the same flags, or start a new run with another --out.")
        return run_dir
    if (run_dir / "run.json").exists() or ((run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())):
        raise RunError(f"{run_dir} already holds a run; continue it with --resume, or choose another --out")
    return run_dir


def _write_run_json(run_dir: Path, run_config: dict) -> None:
    files.write_text(run_dir / "run.json", json.dumps(run_config, indent=2) + "\n")


def create_run_dir(run_dir, run_config: dict) -> Path:
    """Make a new run's directory and write its ``run.json`` (after ``prepare_run_dir`` checked it).

    With several processes every one checks the folder first, then process 0 alone writes.
    ``open_run`` does the same and also locks the folder and cleans up after a failure.
    """
    run_dir = prepare_run_dir(run_dir, run_config, resume=False)
    barrier("create_run_dir: checked")  # no process may see process 0's run.json as "another run"
    if is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_run_json(run_dir, run_config)
    barrier("create_run_dir: written")
    return run_dir


def _make_dir(run_dir: Path) -> Path | None:
    """``mkdir -p run_dir``; the top-most folder this call created (None if it existed)."""
    top, where = None, run_dir.absolute()
    while not where.exists():
        top, where = where, where.parent
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)  # the folders this call made before it failed
        raise
    return top


_HELD: dict[str, list] = {}  # real path of a run directory -> [lock file descriptor or None, depth]


@contextlib.contextmanager
def lock_run_dir(run_dir):
    """Hold an exclusive lock on ``run_dir`` (made if missing) for the block; ``RunError`` if another
    process holds it. Re-entrant within a process. With several processes, process 0 takes it and
    all of them learn whether it could."""
    run_dir = Path(run_dir)
    if is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(run_dir)
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield run_dir
        finally:
            _HELD[key][1] -= 1
        return
    fd, error, busy = None, None, False
    if is_main_process():
        try:
            fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as failure:
            if fd is not None:
                os.close(fd)
                fd = None
            busy = failure.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
            if busy:
                error = (f"{run_dir} is in use by another process (the run, or a --resume of it, is going on): "
                         "wait until it ends, or choose another --out")
            else:
                error = f"cannot lock {run_dir / LOCK_NAME}: {failure.strerror or failure}"
    if not _all_agree(error is None):
        raise (RunDirBusy if busy else RunError)(error or f"process 0 could not lock {run_dir} (see its error)")
    _HELD[key] = [fd, 1]
    try:
        yield run_dir
    finally:
        _HELD[key][1] -= 1
        if _HELD[key][1] == 0:
            del _HELD[key]
            if fd is not None:
                os.close(fd)  # releases the lock


def _committed_steps(run_dir: Path) -> list[str]:
    folder = run_dir / "checkpoints"
    return [p.name for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []


def _remove_made(run_dir: Path, made: Path | None) -> None:
    """Remove ``run_dir`` and the empty folders above it up to ``made``, the top-most one this run created."""
    if made is None:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    where = run_dir.absolute().parent
    while made in (where, *where.parents):  # created along with it: removed only when nothing else is inside
        try:
            where.rmdir()
        except OSError:
            break
        where = where.parent


def _remove_unfinished(run_dir: Path, made: Path | None) -> None:
    """After a new run failed before its first checkpoint: remove what it wrote (its folder, if it made it)."""
    if _committed_steps(run_dir):
        return  # there is something to --resume
    if made is not None:
        _remove_made(run_dir, made)
        return
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


@contextlib.contextmanager
def open_run(run_dir, run_config: dict, *, resume: bool):
    """The run directory of a new run (created, with ``run.json``) or of a resumed one, locked for the block.

    Checks as ``prepare_run_dir`` does, again once the lock is held (another process may have
    started a run there meanwhile). When the block fails (any exception, Ctrl-C included) in
    a new run that has no checkpoint yet, what the run made is removed.
    """
    run_dir = prepare_run_dir(run_dir, run_config, resume=resume)
    made = _make_dir(run_dir.absolute()) if is_main_process() and not resume else None
    barrier("open_run: made")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(lock_run_dir(run_dir))
        except RunDirBusy:
            raise  # the folder is the other process's now
        except RunError:
            _remove_made(run_dir, made)
            raise
        wrote = False
        try:
            prepare_run_dir(run_dir, run_config, resume=resume)
            if not resume:
                barrier("open_run: checked")
                if is_main_process():
                    wrote = True
                    _write_run_json(run_dir, run_config)
                barrier("open_run: written")
            yield run_dir
        except BaseException:
            if wrote:
                _remove_unfinished(run_dir, made)
            raise


# ----------------------------------------------------------------------------- logs and curves


def _is_record(value) -> bool:
    return isinstance(value, dict) and isinstance(value.get("step"), int) and isinstance(value.get("split"), str)


def read_metrics(run_dir) -> list[dict]:
    """The records of ``metrics.jsonl`` (a torn last line, from a run killed mid-write, is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if _is_record(record):
            records.append(record)
    return records


def _write_records(path: Path, records: list[dict]) -> None:
    files.write_text(path, "".join(json.dumps(r) + "\n" for r in records), overwrite=True)


def append_metrics(run_dir, step: int, split: str, values: dict) -> None:
    """Add one record to ``metrics.jsonl``, replacing an earlier one of the same step and split."""
    records = [r for r in read_metrics(run_dir) if (r["step"], r["split"]) != (step, split)]
    _write_records(Path(run_dir) / "metrics.jsonl", records + [{"step": step, "split": split, **values}])


class _NoLog:
    """What processes other than the first log: nothing (process 0 writes the run's files)."""

    count = 0

    def write(self, step: int, split: str, metrics: dict) -> None:
        pass

    def close(self):
        pass


class MetricsLog:
    """``metrics.jsonl`` and TensorBoard scalars, each (step, split) once.

    ``start`` > 0 (resume) cuts both back to that step, and to the first ``lines`` records
    when given (how many the checkpoint had seen: a final evaluation logged after the last
    checkpoint is dropped, and logged again). ``count`` is the number of records so far.
    """

    def __init__(self, run_dir, start: int = 0, tensorboard: bool = True, lines: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        kept = read_metrics(run_dir)
        if isinstance(lines, int) and not isinstance(lines, bool):
            kept = kept[:lines]
        self.records = [r for r in kept if r["step"] <= start]
        _write_records(self.path, self.records)
        self.file = open(self.path, "a", encoding="utf-8")
        self.writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step hides every earlier event from step `start` on: those of `start` that the log keeps come back
            self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start or None)
            for record in self.records:
                if record["step"] == start:
                    self._scalars(record["step"], record["split"], record)

    @property
    def count(self) -> int:
        return len(self.records)

    def _scalars(self, step, split, metrics):
        for key, value in metrics.items():
            if key not in ("step", "split"):
                self.writer.add_scalar(f"{split}/{key}", float(value), step)

    def write(self, step: int, split: str, metrics: dict) -> None:
        record = {"step": step, "split": split, **{k: float(v) for k, v in metrics.items()}}
        if any((r["step"], r["split"]) == (step, split) for r in self.records):  # logged before: replace it
            self.records = [r for r in self.records if (r["step"], r["split"]) != (step, split)] + [record]
            self.file.close()
            _write_records(self.path, self.records)
            self.file = open(self.path, "a", encoding="utf-8")
        else:
            self.records.append(record)
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.writer is not None:
            self._scalars(step, split, metrics)

    def close(self):
        self.file.close()
        if self.writer is not None:
            self.writer.close()


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
            if key not in ("step", "split", "lr", "tokens_per_s", "eval_s", "grad_norm", "count"):
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
    try:
        files.write_file(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), overwrite=True)
    finally:
        plt.close(fig)
    return out
