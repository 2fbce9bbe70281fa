"""Nothing lost: every writer leaves the old output byte-identical when the write fails part-way,
leaves no temporary file, refuses what it must not replace, and gives the usual permissions.

Faults are injected three ways: the underlying writer raises after writing part of its
output (monkeypatched), a real size limit (``RLIMIT_FSIZE``, the same EFBIG a full disk
gives as ENOSPC) in a subprocess, and ``kill -9`` in the middle of a write.
"""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from flax_transformer.interop import checkpoints, files
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.verification import export

REPO = Path(__file__).resolve().parents[2]


def _snapshot(folder: Path) -> dict:
    """{relative path: sha256} of every file under ``folder`` (and the folder's own listing)."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            p = Path(root) / name
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _former():
    import torch_reference.former as tf

    torch.manual_seed(0)
    return tf.CTransformer(8, 2, 1, 8, 20, 2).eval()


def _bert():
    from torch_reference.encoder import TransformerEncoder

    torch.manual_seed(0)
    config = EncoderConfig.bert(dict(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=16))
    return TransformerEncoder(config).eval()


def _partial_then_fail(real_write_arg):
    """A stand-in for a writer: writes some bytes where the real one would, then fails like a full disk."""
    def fail(*args, **kwargs):
        target = real_write_arg(args, kwargs)
        if hasattr(target, "write"):  # torch.save is handed an open file
            target.write(b"partial")
        else:
            Path(target).write_bytes(b"partial")
        raise OSError(28, "No space left on device")
    return fail


# --------------------------------------------------------------------- the library's writers

WRITERS = {
    # name: (model factory, write(model, path, overwrite), object to monkeypatch, attribute, where it writes)
    "save_safetensors": (_former, lambda m, p, o: export.save_safetensors(m, p, overwrite=o), "safetensors.numpy",
                         "save_file", lambda a, k: a[1]),
    "save_torch": (_former, lambda m, p, o: export.save_torch(m, p, overwrite=o), "torch", "save",
                   lambda a, k: a[1]),
    "hf.save_pretrained": (_bert, lambda m, p, o: export.save_pretrained(m, p, overwrite=o),  # streams tensor by tensor
                           "flax_transformer.interop.safetensors_io", "write_safetensors", lambda a, k: a[1]),
}


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_failed_overwrite_leaves_the_old_output_and_no_temp(tmp_path, monkeypatch, name):
    import importlib

    factory, write, module, attribute, where = WRITERS[name]
    model = factory()
    out = tmp_path / ("out" if name == "hf.save_pretrained" else "out.bin")
    write(model, out, False)
    before = _snapshot(tmp_path)
    monkeypatch.setattr(importlib.import_module(module), attribute, _partial_then_fail(where))
    with pytest.raises(OSError, match="No space"):
        write(model, out, True)
    assert _snapshot(tmp_path) == before  # old output byte-identical, nothing else left
    beside = [] if name == "hf.save_pretrained" else [f"{out.name}.verification.json"]  # a file's certificate
    assert sorted(os.listdir(tmp_path)) == [out.name, *beside]


def test_a_failed_orbax_overwrite_leaves_the_old_folder(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    from flax_transformer.interop import porting

    flax_model = porting.torch_to_flax(_former())
    out = tmp_path / "orbax"
    export.save_orbax(flax_model, out)
    before = _snapshot(tmp_path)

    def fail(self, directory, *args, **kwargs):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "half").write_bytes(b"x")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", fail)
    with pytest.raises(OSError, match="No space"):
        export.save_orbax(flax_model, out, overwrite=True)
    assert _snapshot(tmp_path) == before and os.listdir(tmp_path) == ["orbax"]
    monkeypatch.undo()
    export.save_orbax(flax_model, out, overwrite=True)  # and a good overwrite does replace it
    assert checkpoints.load(out) is not None and os.listdir(tmp_path) == ["orbax"]


def test_every_writer_refuses_an_existing_output_without_overwrite(tmp_path):
    from flax_transformer.cli import inspection
    from flax_transformer.interop import porting

    former, bert = _former(), _bert()
    cases = [
        (lambda p, o: export.save_safetensors(former, p, overwrite=o), "a.safetensors", "file"),
        (lambda p, o: export.save_torch(former, p, overwrite=o), "a.pt", "file"),
        (lambda p, o: export.save_orbax(porting.torch_to_flax(former), p, overwrite=o), "orbax", "dir"),
        (lambda p, o: export.save_pretrained(bert, p, overwrite=o), "hf", "dir"),
        (lambda p, o: inspection.save_attention_html(["a", "b"], np.full((1, 1, 2, 2), 0.5), 0, 0, p, b_start=2,
                                                     title="t", overwrite=o), "a.html", "file"),
    ]
    for write, name, kind in cases:
        path = tmp_path / name
        if kind == "dir":
            path.mkdir()
            (path / "mine.txt").write_text("keep me")
        else:
            path.write_text("keep me")
        before = _snapshot(tmp_path)
        with pytest.raises(files.OutputExists, match="overwrite"):
            write(path, False)
        assert _snapshot(tmp_path) == before, name
        write(path, True)
        assert _snapshot(tmp_path) != before, name


def test_wrong_kinds_and_special_files_are_refused(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x").write_text("1")
    (tmp_path / "file").write_text("1")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with pytest.raises(files.OutputError, match="is a folder"):
        files.write_text(tmp_path / "folder", "x", overwrite=True)
    with pytest.raises(files.OutputError, match="is a file"):
        files.write_dir(tmp_path / "file", lambda tmp: None, overwrite=True)
    with pytest.raises(files.OutputError, match="not a regular"):
        files.write_text(tmp_path / "link", "x", overwrite=True)
    if os.path.exists("/dev/null"):  # a device node: os.replace would have replaced it
        with pytest.raises(files.OutputError, match="not a regular"):
            files.check_target("/dev/null", overwrite=True)
    with pytest.raises(files.OutputFolderMissing, match="parent folder"):
        files.write_text(tmp_path / "missing" / "a.txt", "x")
    with pytest.raises(files.OutputError, match="UTF-8"):
        files.check_target(os.fsdecode(bytes(tmp_path) + b"/\xff.txt"))
    assert (tmp_path / "file").read_text() == "1" and (tmp_path / "folder" / "x").read_text() == "1"


def test_port_refuses_a_device_node_and_a_folder_for_a_file(tmp_path, capsys):
    from flax_transformer.cli.commands import main

    src = tmp_path / "m.safetensors"
    export.save_safetensors(_former(), src)
    (tmp_path / "dir.safetensors").mkdir()
    assert main(["port", str(src), str(tmp_path / "dir.safetensors"), "--overwrite"]) == 2
    assert "is a folder" in capsys.readouterr().err
    if os.path.exists("/dev/null"):
        assert main(["port", str(src), "/dev/null", "--to", "safetensors", "--overwrite"]) == 2
        assert "not a regular" in capsys.readouterr().err
        assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_outputs_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        export.save_pretrained(_bert(), tmp_path / "hf")
        export.save_safetensors(_former(), tmp_path / "a.safetensors")
    finally:
        os.umask(old)
    assert (os.stat(tmp_path / "hf").st_mode & 0o777) == 0o755
    for p in [*(tmp_path / "hf").iterdir(), tmp_path / "a.safetensors"]:
        assert (os.stat(p).st_mode & 0o777) == 0o644, p


def test_save_pretrained_writes_into_an_existing_empty_folder(tmp_path):
    (tmp_path / "out").mkdir()
    export.save_pretrained(_bert(), tmp_path / "out")
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "out"))
    assert os.listdir(tmp_path) == ["out"]


# --------------------------------------------------------------- real faults, in a subprocess

_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from flax_transformer.interop import files
    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(b"x" * 1000)
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
    files.write_file(sys.argv[1], write, overwrite=True) if sys.argv[2] == "file" else \\
        files.write_dir(sys.argv[1], lambda d: write(d / "w"), overwrite=True)
""")


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_kill_9_mid_write_keeps_the_old_output_and_the_next_write_cleans_up(tmp_path, kind):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("old")
    else:
        out.mkdir()
        (out / "w").write_text("old")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(out), kind], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    left = [n for n in os.listdir(tmp_path) if n != "out"]
    assert len(left) == 1 and files.TMP_MARK in left[0]  # recognisable
    assert (out.read_text() if kind == "file" else (out / "w").read_text()) == "old"
    if kind == "file":
        files.write_text(out, "new", overwrite=True)
    else:
        files.write_dir(out, lambda d: (d / "w").write_text("new"), overwrite=True)
    assert os.listdir(tmp_path) == ["out"]  # the dead process's temp is gone


def test_a_folder_killed_mid_swap_is_restored_on_the_next_write(tmp_path):
    """The two-rename fallback: a kill between the renames leaves the old folder under its ft-old name."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)  # a pid that no longer runs
    old = tmp_path / f".out{files.OLD_MARK}{dead}-abcd"
    old.mkdir()
    (old / "w").write_text("old")
    files.remove_stale(out)
    assert (out / "w").read_text() == "old" and os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "orbax"])
@pytest.mark.slow_cases({
    "torch": "test_port_on_a_full_disk_keeps_the_old_output: the safetensors case (the same files.write_atomic)",
    "orbax": "test_port_on_a_full_disk_keeps_the_old_output: the safetensors case (the same files.write_atomic)",
})
def test_port_on_a_full_disk_keeps_the_old_output(tmp_path, fmt):
    """A real write error: RLIMIT_FSIZE makes the kernel refuse the write (EFBIG), as a full disk does (ENOSPC)."""
    src, dst = tmp_path / "src.safetensors", tmp_path / {"safetensors": "dst.safetensors", "torch": "dst.pt",
                                                         "orbax": "dst"}[fmt]
    export.save_safetensors(_former(), src)
    if fmt == "orbax":
        dst.mkdir()
        (dst / "old").write_bytes(b"the old output")
    else:
        dst.write_bytes(b"the old output")
    before = _snapshot(tmp_path)
    limit = src.stat().st_size // 2
    code = textwrap.dedent(f"""
        import os, resource, signal, sys
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # the tests' shared cache would hit the size limit too
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        from flax_transformer.cli.commands import main
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        sys.exit(main(["port", {str(src)!r}, {str(dst)!r}, "--to", {fmt!r}, "--overwrite"]))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "error:" in result.stderr, result.stderr[-2000:]
    assert _snapshot(tmp_path) == before  # the old output byte-identical, no temp file


def test_cli_errors_are_one_line(tmp_path, capsys):
    """A read-only folder, --config that is not an object, non-UTF-8 text: one line, exit 2, nothing written.
    The non-UTF-8 text goes through a real process's argv; the others run in-process (``main``'s status and
    stderr are the process's)."""
    from flax_transformer.cli.commands import main

    src = tmp_path / "m.safetensors"
    export.save_safetensors(_former(), src)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    bad = os.fsdecode(b"caf\xe9")
    commands = [["port", str(src), str(tmp_path / "x.safetensors"), "--family", "former", "--class", "CTransformer",
                 "--config", "[1, 2]"],
                ["attention-map", "--text", bad, "--layer", "0", "--out", str(tmp_path / "a.png")]]
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        commands.append(["port", str(src), str(ro / "x.safetensors")])
    for argv in commands:
        if bad in argv:
            result = subprocess.run([sys.executable, "-m", "flax_transformer", *argv], capture_output=True,
                                    timeout=300, cwd=REPO)
            status, err = result.returncode, result.stderr.decode("utf-8", "replace")
        else:
            status, err = main(argv), capsys.readouterr().err
        assert status == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors", "m.safetensors.verification.json", "ro"]
