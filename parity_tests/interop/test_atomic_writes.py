"""Writes are atomic: another write leaves live writers' temporaries alone, and the output is
swapped in whole, never copied over.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
"""

import os
import subprocess
import sys
import threading
import time

from flax_transformer.interop import files


def test_another_write_leaves_live_writers_temporaries_alone(tmp_path):
    """Guards the stale-temporary cleanup removing only what dead processes left: a temporary named
    after a live process (this one, its parent, a sleeping child) survives another write of the same
    output; one named after a process that has exited is removed."""
    out = tmp_path / "out.bin"
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = [tmp_path / f".out.bin{files.TMP_MARK}{pid}-0123abcd" for pid in (os.getpid(), os.getppid(), child.pid)]
        dead = tmp_path / f".out.bin{files.TMP_MARK}{done.pid}-0123abcd"
        for temp in (*live, dead):
            temp.write_bytes(b"half written")
        files.write_bytes(out, b"new")
        assert out.read_bytes() == b"new"
        assert all(temp.read_bytes() == b"half written" for temp in live)
        assert not dead.exists()
        files.write_bytes(out, b"newer", overwrite=True)
        assert all(temp.exists() for temp in live)
    finally:
        child.kill()
        child.wait()


def test_the_output_is_swapped_in_whole_never_copied_over(tmp_path, monkeypatch):
    """Guards the swap being a rename of the finished temporary file: a copy onto the output path would
    show readers a truncated, half-written file. A reader that opened the old file keeps reading the
    old bytes (a new inode went in); nothing copies bytes onto the path; a reader polling the path
    during writes sees whole versions only."""
    import shutil

    out = tmp_path / "out.bin"
    versions = [bytes([i]) * (4 << 20) for i in range(4)]  # 4 MiB each
    files.write_bytes(out, versions[0])
    seen: list[str] = []

    def spy(real):
        def copying(*args, **kwargs):
            data = out.read_bytes() if out.exists() else None
            seen.append("copy onto the path while it holds " + ("nothing" if data is None else f"{len(data)} bytes"))
            return real(*args, **kwargs)
        return copying

    for module, name in ((os, "sendfile"), (os, "copy_file_range"), (shutil, "copyfileobj"), (shutil, "copyfile")):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, spy(getattr(module, name)))
    with open(out, "rb") as old_reader:
        inode = os.fstat(old_reader.fileno()).st_ino
        files.write_bytes(out, versions[1], overwrite=True)
        assert old_reader.read() == versions[0]
    assert os.stat(out).st_ino != inode and out.read_bytes() == versions[1]
    assert seen == []

    bad: list[int] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:
                data = out.read_bytes()
            except FileNotFoundError:
                bad.append(-1)
                continue
            if data not in versions:
                bad.append(len(data))

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for version in versions[2:] + versions[:2]:
            files.write_bytes(out, version, overwrite=True)
            time.sleep(0.01)
    finally:
        stop.set()
        reader.join()
    assert bad == [] and seen == []
