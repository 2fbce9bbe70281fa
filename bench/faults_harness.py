"""The fault sweep's machinery: one call in a fresh folder, how its outcome is judged, the case registry.

``bench/faults.py`` runs the sweep; the ``faults_cases_*.py`` files register its cases here through
``cli_case`` (one call whose correct outcome is an error, or a legal input that must work),
``verdict_case`` (one call whose correct outcome is a *failing verdict*), ``snippet_case`` (a short
library snippet) and ``case`` (a function of its own, for kills and races).

A case's problems are strings; the prefix says which column they count in:
``silent: ...`` (the call reported success, exit 0 or a normal return, for something broken, or a
figure it did not measure), ``lost: ...`` (never used here: lost data has its own list), a note in
parentheses (shown, never counted), anything else unclean (a traceback, a wrong exit status, more
than one error line, asyncio noise).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
ROOT = os.geteuid() == 0
TIMEOUT = 240
TEMP_MARKS = (".ft-tmp-", ".ft-old-")
CT_CONFIG = {"emb": 32, "heads": 4, "depth": 2, "seq_length": 16, "num_tokens": 100, "num_classes": 2}
ERROR_LINE = re.compile(r"^(?:[\w.\- ]+: )?error: \S")
WARNING_LINE = re.compile(r"^(?:[\w.\- ]+: )?warning: ", re.IGNORECASE)
BANNER_LINE = re.compile(r"^(?:lm|classify|seq2seq): (?!error)")  # a training run's summary line, printed first
# orbax/tensorstore's asyncio complaints after a read or a failed write: noise a user cannot act on
NOISE = ("Event loop is closed", "was never retrieved")
SILENT = "silent: "
FT = "flax_transformer"
PEAK_RSS_FILE = "ft-peak-rss-kib"


# ------------------------------------------------------------------ running one call

@dataclasses.dataclass
class Call:
    rc: int | None
    stdout: str
    stderr: str
    seconds: float


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _argv(module_or_code, args, *, fsize: int | None = None, peak_rss: bool = False) -> list:
    """``python -m MODULE ARGS``, a snippet (``module_or_code`` starting with ``code:``), or the
    module run under RLIMIT_FSIZE (a full disk: writes past ``fsize`` bytes fail with EFBIG) and/or
    writing its peak RSS (KiB) to ``PEAK_RSS_FILE`` in its folder when it ends."""
    if module_or_code.startswith("code:"):
        return [PY, "-c", module_or_code[5:], *args]
    if fsize is None and not peak_rss:
        return [PY, "-m", module_or_code, *args]
    lines = ["import resource, runpy, signal, sys"]
    if fsize is not None:
        lines += ["signal.signal(signal.SIGXFSZ, signal.SIG_IGN)",
                  f"resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))"]
    lines += [f"sys.argv = [{module_or_code!r}] + sys.argv[1:]", "try:",
              f"    runpy.run_module({module_or_code!r}, run_name='__main__', alter_sys=True)", "finally:"]
    lines += [f"    open({PEAK_RSS_FILE!r}, 'w').write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))"
              if peak_rss else "    pass"]
    return [PY, "-c", "\n".join(lines) + "\n", *args]


def run(cwd: Path, module_or_code: str, *args, fsize: int | None = None, peak_rss: bool = False,
        timeout: int = TIMEOUT) -> Call:
    start = time.perf_counter()
    try:
        done = subprocess.run(_argv(module_or_code, args, fsize=fsize, peak_rss=peak_rss), cwd=cwd, env=_env(),
                              capture_output=True, timeout=timeout)
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as error:
        rc, out, err = None, error.stdout or b"", (error.stderr or b"") + b"\n[timed out]"
    return Call(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), time.perf_counter() - start)


def popen(cwd: Path, module: str, *args) -> subprocess.Popen:
    return subprocess.Popen(_argv(module, args), cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(process: subprocess.Popen, start: float, timeout: int = TIMEOUT) -> Call:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        err += b"\n[timed out]"
    return Call(process.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                time.perf_counter() - start)


# ------------------------------------------------------------------ judging a call

def has_traceback(call: Call) -> bool:
    return "Traceback" in call.stderr or "Traceback (most recent call last)" in call.stdout


def error_lines(call: Call) -> list[str]:
    """stderr's lines that are neither warnings, argparse's usage block nor a training run's banner."""
    usage, rest = False, []
    for line in (x for x in call.stderr.splitlines() if x.strip()):
        if line.startswith("usage:") or (usage and line[:1].isspace()):
            usage = True
            continue
        usage = False
        if not (WARNING_LINE.match(line) or BANNER_LINE.match(line)):
            rest.append(line)
    return rest


def stderr_problem(call: Call, codes=(2,)) -> str | None:
    """Why a call's exit status and stderr are not a clean outcome (None when they are). Exit 0 where
    only a failure is correct is a silent wrong result: the input was broken and the call said nothing."""
    if has_traceback(call):
        return "traceback on stderr"
    noise = [n for n in NOISE if n in call.stderr]
    if noise:
        return f"asyncio noise on stderr ({call.stderr.count(noise[0])}x {noise[0]!r})"
    if call.rc not in codes:
        expected = "/".join(map(str, codes))
        return (f"{SILENT}exit 0 where exit {expected} is correct" if call.rc == 0
                else f"exit status {call.rc}, expected {expected}")
    if call.rc == 0:
        return None
    rest = error_lines(call)
    if len(rest) != 1:
        return f"{len(rest)} non-warning stderr lines, expected 1"
    if not ERROR_LINE.match(rest[0]):
        return "stderr line is not 'PROG: error: ...'"
    return None


def names_all(words) -> Callable:
    """A ``check``: the error line (exit 2) names each of ``words`` (strings or callables of the folder)."""
    def check(folder, call):
        if call.rc != 2:
            return []
        line = (error_lines(call) or [""])[-1]
        wanted = [w(folder) if callable(w) else w for w in words]
        return [f"the error line does not name {w!r}" for w in wanted if w not in line]
    return check


def snapshot(folder: Path) -> dict[str, str]:
    """{relative path: sha256 (or the kind for what is not a regular file)} of everything in ``folder``.
    A sparse file over 64 MiB is named by its size and mtime instead (reading it would cost more than its case)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath, name)
            rel = str(path.relative_to(folder))
            info = path.lstat()
            if stat.S_ISREG(info.st_mode) and info.st_size > 64 << 20:
                out[rel] = f"<{info.st_size} bytes, mtime {info.st_mtime_ns}>"
            elif stat.S_ISREG(info.st_mode):
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[rel] = f"<{stat.filemode(info.st_mode)[0]}>"
    return out


def temps(folder: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames + dirnames:
            if any(mark in name for mark in TEMP_MARKS):
                found.append(str(Path(dirpath, name).relative_to(folder)))
    return found


def lost_data(folder: Path, before: dict, call: Call, new_run: Path | None = None) -> list[str]:
    problems = [f"temp left: {t}" for t in temps(folder)]
    if call.rc != 0:
        after = snapshot(folder)
        changed = [rel for rel, digest in before.items() if after.get(rel) != digest]
        problems += [f"{'changed' if rel in after else 'vanished'}: {rel}" for rel in changed]
        if new_run is not None and new_run.exists():
            kind = "run.json without a checkpoint" if (new_run / "run.json").exists() else "a folder"
            problems.append(f"half-made run {new_run.name}/ ({kind})")
    return problems


# ------------------------------------------------------------------ the registry

@dataclasses.dataclass
class Case:
    name: str
    klass: str
    function: Callable  # function(folder, fixtures) -> (call, problems, lost problems, command)


CASES: list[Case] = []


def case(name: str, klass: str):
    def register(function):
        CASES.append(Case(name, klass, function))
        return function
    return register


def _shown(module: str, argv, fsize) -> str:
    shown = module if not module.startswith("code:") else "python -c <snippet>"
    return f"{f'(RLIMIT_FSIZE={fsize}) ' if fsize else ''}{shown} " + " ".join(
        os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv)


def cli_case(name: str, klass: str, module: str, args, *, prepare=None, codes=(2,), fsize=None, new_run=None,
             check=None, judge=None):
    """A case of one call: ``prepare(folder, fx)`` makes its inputs, ``check(folder, call)`` adds problems;
    ``judge(call)`` replaces ``stderr_problem`` (a verdict case's own rule)."""

    def function(folder: Path, fx: Path):
        if prepare is not None:
            prepare(folder, fx)
        before = snapshot(folder)
        argv = [a(folder) if callable(a) else a for a in args]
        call = run(folder, module, *argv, fsize=fsize)
        problem = judge(call) if judge is not None else stderr_problem(call, codes)
        problems = [problem] if problem else []
        if check is not None:
            problems += check(folder, call) or []
        lost = lost_data(folder, before, call, folder / new_run if new_run else None)
        return call, problems, lost, _shown(module, argv, fsize)
    CASES.append(Case(name, klass, function))


def verdict_case(name: str, klass: str, module: str, args, *, verdict: str | None = None, error=None,
                 prepare=None, check=None, new_run=None):
    """A case whose correct outcome is a failing verdict: exit 1 with ``verdict`` (a regex) on stdout, or,
    where ``error`` lists what its line must name, exit 2 with that one error line. Exit 0 is a silent
    wrong result; so is exit 1 without the failing verdict (a verdict that was not reached)."""
    codes = tuple(c for c, wanted in ((1, verdict), (2, error)) if wanted is not None)

    def judge(call: Call) -> str | None:
        if call.rc == 1 and verdict is not None:
            if has_traceback(call):
                return "traceback on stderr"
            noise = [n for n in NOISE if n in call.stderr]
            if noise:
                return f"asyncio noise on stderr ({noise[0]!r})"
            return None if re.search(verdict, call.stdout) else f"exit 1 without the verdict /{verdict}/ on stdout"
        return stderr_problem(call, codes)

    checks = [c for c in (names_all(error) if error else None, check) if c is not None]
    cli_case(name, klass, module, args, prepare=prepare, codes=codes, new_run=new_run, judge=judge,
             check=lambda folder, call: [p for c in checks for p in (c(folder, call) or [])])


def snippet_case(name: str, klass: str, body: str, *, prepare=None):
    """A library-API case: the snippet prints OK when the behaviour is right, ``SILENT: why`` when the
    library returned normally for something broken (or with a figure it did not measure)."""
    code = f"import sys\nsys.path.insert(0, {str(REPO)!r})\n" + textwrap.dedent(body)

    def said(folder, call):
        last = (call.stdout.strip().splitlines() or ["nothing"])[-1][:160]
        if last == "OK":
            return []
        return [SILENT + last[len("SILENT: "):]] if last.startswith("SILENT: ") else [f"snippet said: {last}"]
    cli_case(name, klass, "code:" + code, [], prepare=prepare, codes=(0,), check=said)
