"""The readers' virtualenvs: the oldest transformers 4.x this project supports and the newest 5.x on PyPI,
each in a virtualenv of its own, made cheaply and the same way every time.

A reader's venv holds transformers and the packages its version pins (tokenizers, huggingface_hub, ...) in
its own site-packages, and a ``.pth`` file that appends this environment's site-packages after them, so
torch, numpy and peft are not downloaded again while the reader's transformers shadows ours. transformers
itself always goes into the venv; then pip resolves its requirements against both (``pip --python
VENV/bin/python install transformers==X``): what this environment already has at a version the reader
accepts is taken from it, anything else goes into the venv (pip leaves packages outside the venv alone). A venv is built under a temporary name and renamed when whole, and is reused
when it holds the right version.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

OLDEST = "4.53.3"  # pyproject's lower bound (transformers>=4.53; older ones misread windows), last patch
PTH = "flax_transformer_main_env.pth"
VERSION = "import json, transformers; print(json.dumps([transformers.__version__, transformers.__file__]))"


def newest(major: int = 5) -> str:
    """The newest transformers ``major``.x on the package index (``pip index versions``)."""
    run = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"], capture_output=True,
                         text=True, timeout=120)
    found = re.search(r"Available versions: (.*)", run.stdout)
    if run.returncode or not found:
        raise RuntimeError(f"pip index versions transformers failed: {(run.stderr or run.stdout).strip()[-300:]}")
    versions = [v.strip() for v in found.group(1).split(",") if v.strip().startswith(f"{major}.")]
    if not versions:
        raise RuntimeError(f"the package index lists no transformers {major}.x")
    return versions[0]


def reader_version(python) -> tuple[str, str]:
    """(transformers' version, the file it was imported from) in the Python ``python``."""
    run = subprocess.run([str(python), "-c", VERSION], capture_output=True, text=True, timeout=300)
    if run.returncode:
        raise RuntimeError(f"{python} cannot import transformers: {run.stderr.strip().splitlines()[-1:]}")
    version, file = json.loads(run.stdout.strip().splitlines()[-1])
    return version, file


def make_venv(root, version: str) -> Path:
    """``root/transformers-VERSION``'s Python (made when missing): transformers ``version`` over this
    environment's torch."""
    venv = Path(root) / f"transformers-{version}"
    venv.parent.mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    if python.exists():
        got, file = reader_version(python)
        if got == version and Path(file).is_relative_to(venv):
            return python
        raise RuntimeError(f"{venv} holds transformers {got} ({file}), not {version}: remove it")
    partial = venv.with_name(venv.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(partial)], check=True, timeout=300)
    own = Path(subprocess.run([str(partial / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    main = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (own / PTH).write_text("".join(f"{p}\n" for p in sorted(main)), encoding="utf-8")
    pip = [sys.executable, "-m", "pip", "--python", str(partial / "bin" / "python"), "install", "-q", "--no-compile",
           "--disable-pip-version-check"]
    for extra in (["--no-deps", "--ignore-installed"], []):  # its own transformers even where ours is that version
        run = subprocess.run(pip + extra + [f"transformers=={version}"], capture_output=True, text=True, timeout=900)
        if run.returncode:
            raise RuntimeError(f"pip could not install transformers=={version}: {run.stderr.strip()[-500:]}")
    partial.rename(venv)
    got, file = reader_version(python)
    if got != version or not Path(file).is_relative_to(venv):
        raise RuntimeError(f"{venv} imports transformers {got} from {file}, not its own {version}")
    return python


def make_venvs(root, versions=None) -> dict[str, Path]:
    """{version: its Python}: the oldest supported 4.x and the newest 5.x (or ``versions``) under ``root``."""
    return {v: make_venv(root, v) for v in (versions or (OLDEST, newest(5)))}
