"""Writing outputs so that nothing is lost: every writer of the library goes through here.

The rule: check the target before any work, write the whole new output under a
temporary name beside it, then swap it in with one rename. A failure at any point (an
exception, a full disk, ``kill -9``) leaves the old output as it was.

* A target that exists is replaced only with ``overwrite=True`` (``--overwrite`` on the
  command line), and only when it is of the expected kind: a regular file for a file
  output, a real folder for a folder output. Device nodes, sockets, links and a file
  where a folder is expected (or the reverse) are refused. An existing *empty* folder
  counts as free for a folder output, as in transformers' ``save_pretrained``.
* Temporary names are ``.<name>.ft-tmp-<pid>-<random>`` (and ``.<name>.ft-old-<pid>-<random>``
  for a replaced folder while it is being swapped out), so they can be recognised. The
  next write of the same output removes those left by a process that no longer runs.
* Finished outputs get the usual permissions (``0666``/``0777`` less the umask);
  ``mkstemp`` would leave them ``0600``.
* A folder is swapped with ``renameat2(RENAME_EXCHANGE)`` where the kernel has it, so the
  path always names a complete folder; elsewhere with two renames and a restore on failure.

Pure Python: ``torch_reference`` users may call it without JAX.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

TMP_MARK = ".ft-tmp-"
OVERWRITE_HINT = "overwrite=True replaces it"  # in OutputExists' message; the command line says --overwrite instead
OLD_MARK = ".ft-old-"


class OutputError(ValueError):
    """An output path cannot be written: it exists, is of the wrong kind, or its folder is missing."""


class OutputExists(OutputError, FileExistsError):
    """The output exists and ``overwrite`` was not given."""


class OutputFolderMissing(OutputError, FileNotFoundError):
    """The folder the output should go into does not exist."""


def _kind_of(path: Path) -> str | None:
    """'file', 'dir', 'other' (device, socket, fifo, link) or None when nothing is there."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return "other"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "other"


def check_target(path, *, kind: str = "file", overwrite: bool = False) -> Path:
    """Refuse (``OutputError``) a target that this write must not replace; returns the path.

    Call it before any slow work, so that a wrong target fails at once. It creates nothing.
    """
    if kind not in ("file", "dir"):
        raise ValueError(f"kind must be 'file' or 'dir', got {kind!r}")
    path = Path(os.fsdecode(path))
    try:  # names are recorded in JSON and printed: undecodable bytes would fail later, mid-run
        str(path).encode("utf-8")
    except UnicodeError:
        raise OutputError(f"{ascii(str(path))} is not a UTF-8 file name: choose another") from None
    parent = path.parent
    if not parent.is_dir():
        if parent.exists():
            raise OutputError(f"cannot write {path}: {parent} is not a folder")
        raise OutputFolderMissing(f"cannot write {path}: the parent folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: no permission to write into {parent}")
    found = _kind_of(path)
    if found is None:
        return path
    if found == "other":
        raise OutputError(f"{path} exists and is not a regular {'file' if kind == 'file' else 'folder'} "
                          "(a link, device or socket): refusing to replace it")
    if found != kind:
        expected, there = ("a file", "a folder") if kind == "file" else ("a folder", "a file")
        raise OutputError(f"{path} is {there}, but this output is {expected}: choose another path")
    if kind == "dir" and not any(os.scandir(path)):
        return path  # an empty folder the user made for the output
    if not overwrite:
        raise OutputExists(f"{path} exists ({OVERWRITE_HINT})")
    return path


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(parent: Path, name: str, mark: str) -> list[Path]:
    """Leftovers of ``name``'s earlier writes (with ``mark``) whose process no longer runs."""
    prefix = f".{name}{mark}"
    out = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if not entry.name.startswith(prefix):
                continue
            pid = entry.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                out.append(Path(entry.path))
    return out


def _remove(path: Path) -> None:
    if _kind_of(path) == "dir":
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_stale(path) -> None:
    """Remove the temporary files an interrupted write of ``path`` left behind.

    A folder killed half-way through its swap is put back first when ``path`` is gone.
    """
    path = Path(path)
    for old in _stale(path.parent, path.name, OLD_MARK):
        if _kind_of(path) is None:
            os.rename(old, path)  # the old output, swapped out by a write that then died
        else:
            _remove(old)
    for tmp in _stale(path.parent, path.name, TMP_MARK):
        _remove(tmp)


def temp_name(path: Path, mark: str = TMP_MARK) -> Path:
    return path.parent / f".{path.name}{mark}{os.getpid()}-{secrets.token_hex(4)}"


def usual_permissions(path, *, directory: bool = False) -> None:
    """Give a finished output the umask's usual permissions (recursively for a folder)."""
    umask = os.umask(0)
    os.umask(umask)
    path = Path(path)
    if not directory:
        os.chmod(path, 0o666 & ~umask)
        return
    os.chmod(path, 0o777 & ~umask)
    for root, dirs, names in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~umask)
        for n in names:
            os.chmod(os.path.join(root, n), 0o666 & ~umask)


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _swap_in_dir(tmp: Path, path: Path) -> None:
    if _kind_of(path) is None:
        os.rename(tmp, path)
        return
    if _exchange(tmp, path):  # path is the new folder; tmp now holds the old one
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = temp_name(path, OLD_MARK)
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_path(path, *, kind: str = "file", overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write the whole output into; swap it in when the block ends.

    ``kind="file"`` yields a path where no file exists yet (write it); ``kind="dir"`` yields
    an empty folder. On any exception the temporary output is removed and ``path`` is
    untouched.
    """
    path = check_target(path, kind=kind, overwrite=overwrite)
    remove_stale(path)
    tmp = temp_name(path)
    if kind == "dir":
        tmp.mkdir()
    try:
        yield tmp
        if kind == "file" and not tmp.is_file():
            raise OutputError(f"the writer of {path} wrote nothing")
        usual_permissions(tmp, directory=kind == "dir")
        _fsync(tmp)
        check_target(path, kind=kind, overwrite=overwrite)  # nothing else appeared there meanwhile
        if kind == "dir":
            _swap_in_dir(tmp, path)
        else:
            os.replace(tmp, path)
    except OSError as error:  # a full disk, a permission: name the output, not our temporary file
        _remove(tmp)
        message = str(error.strerror or error)  # without the "[Errno N]" the new error adds again
        message = message.replace(str(tmp), str(path)).replace(tmp.name, path.name)
        if error.filename:
            message = f"{message}: {path}"
        try:
            renamed = type(error)(error.errno, message) if error.errno else type(error)(message)
        except TypeError:  # an OSError subclass with another constructor
            raise error from None
        raise renamed from None
    except BaseException:
        _remove(tmp)
        raise


# A hook a writer runs on its finished output before the swap: ``before_swap(tmp, path)`` gets the
# temporary output and the final path, may read and check what was written (and raise, so that
# nothing is written), and returns further files ``{name: bytes}`` that belong with the output:
# inside a folder output, beside a file output. The writer knows nothing of what they hold; a layer
# above uses it (``verification.export`` puts the verification certificate there).
BeforeSwap = Callable[[Path, Path], dict[str, bytes]]


def _beside(path: Path, name: str) -> Path:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or os.sep in name:
        raise ValueError(f"a file written with {path.name} must be a plain file name, got {name!r}")
    return path.with_name(name)


def write_file(path, write: Callable[[Path], object], *, overwrite: bool = False,
               before_swap: BeforeSwap | None = None) -> Path:
    """``write(tmp)`` writes the file at ``tmp``; it becomes ``path`` only if that succeeds.

    ``before_swap`` (see ``BeforeSwap``): the files it returns go beside ``path``. Two files cannot
    be swapped in one step, so they go in first (each atomically, replacing what was there) and
    the file second; should anything fail after they went in, each is put back as it was. A kill
    between the two steps leaves the new side files with the old file, never the new file
    without them."""
    path = Path(path)
    placed: list[tuple[Path, bytes | None]] = []
    try:
        with atomic_path(path, kind="file", overwrite=overwrite) as tmp:
            write(tmp)
            if before_swap is not None:
                extra = {_beside(path, name): data for name, data in before_swap(tmp, path).items()}
                for side in extra:  # all refused before any is written
                    check_target(side, kind="file", overwrite=True)
                for side, data in extra.items():
                    previous = side.read_bytes() if side.is_file() else None
                    write_bytes(side, data, overwrite=True)
                    placed.append((side, previous))
    except BaseException:
        for side, previous in reversed(placed):  # the file did not go in: what went beside it must not stay
            if previous is None:
                side.unlink(missing_ok=True)
            else:
                write_bytes(side, previous, overwrite=True)
        raise
    return path


def read_json_object(folder, name: str) -> dict:
    """``folder/name``, a JSON object (a config file): one line naming the file when it is missing
    (``FileNotFoundError``), not JSON or not an object (``ValueError``)."""
    import json

    file = Path(folder) / name
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no {name}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, not a {type(config).__name__}")
    return config


def write_text(path, text: str, *, overwrite: bool = False) -> Path:
    return write_file(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), overwrite=overwrite)


def write_bytes(path, data: bytes, *, overwrite: bool = False) -> Path:
    return write_file(path, lambda tmp: Path(tmp).write_bytes(data), overwrite=overwrite)


def save_safetensors_file(tensors: dict, path, metadata: dict | None = None) -> None:
    """``safetensors.numpy.save_file``, with its I/O failures (a full disk) raised as ``OSError``."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as error:
        raise OSError(f"cannot write {path}: {error}") from None


def save_torch_file(obj, path) -> None:
    """``torch.save`` through a Python file, so that a failed write (a full disk) raises ``OSError``
    (given a path, torch's own writer raises ``RuntimeError`` with messages that vary)."""
    import torch

    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as error:  # torch's zip writer fails in its cleanup after the OSError
            cause = error.__context__ or error.__cause__
            if isinstance(cause, OSError):
                raise OSError(cause.errno, f"cannot write {path}: {cause.strerror or cause}") from None
            raise


def write_dir(path, write: Callable[[Path], object], *, overwrite: bool = False,
              before_swap: BeforeSwap | None = None) -> Path:
    """``write(tmp)`` fills the empty folder ``tmp``; it becomes ``path`` only if that succeeds.
    ``before_swap`` (see ``BeforeSwap``): the files it returns go into the folder, swapped in with it."""
    path = Path(path)
    with atomic_path(path, kind="dir", overwrite=overwrite) as tmp:
        write(tmp)
        if before_swap is not None:
            for name, data in before_swap(tmp, path).items():
                (tmp / _beside(path, name).name).write_bytes(data)
    return path


def sha256_file(path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks (a checkpoint need not fit in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
