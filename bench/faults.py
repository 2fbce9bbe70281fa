"""Fault sweep: bad inputs and failing machines against the CLIs, the entry points and the library.

    python bench/faults.py [--out DIR] [--only SUBSTRING ...] [--keep]

Reproduces issue 12's figure (bad inputs tried, errors that were clean, data lost). Every case
runs in a fresh temp folder: one subprocess call of ``python -m flax_transformer ...``,
``python -m train.<task> ...`` or a short Python snippet (some cases add a follow-up call), and is
classified:

* clean: the expected exit status (2; 130 for Ctrl-C, 3 for a NaN stop; 0 where the input is
  legal and must simply work), stderr of exactly one non-empty ``[PROG: ]error: ...`` line (plus
  ``warning:`` lines, argparse's ``usage:`` block and a training run's ``TASK: ...`` summary line), and no "Traceback" anywhere; for a library
  snippet, the expected exception with a message naming the problem (the snippet checks it and
  prints OK).
* data lost: a file of the case folder (its prepared inputs and outputs, sha256 before the call)
  changed or vanished although the call failed; or a temp file (``.ft-tmp-``/``.ft-old-``) left
  behind; or a half-made run folder (the call failed before training and left its ``--out``).

Fixtures (a small CTransformer as safetensors/.pt, a tiny GPT-2 HF folder, a fake packed IMDB,
a finished 2-step classify run, a code-carrying pickle) are built once and copied into the case
folders that need them. Read-only-folder cases are skipped when running as root (root writes
anyway). Prints a table and the totals; ``--out DIR`` also writes ``DIR/faults.jsonl``. Exits 1
if any case is unclean or lost data.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
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


def _argv(module_or_code, args, *, fsize: int | None = None) -> list:
    """``python -m MODULE ARGS``, a snippet (``module_or_code`` starting with ``code:``), or the
    module run under RLIMIT_FSIZE (a full disk: writes past ``fsize`` bytes fail with EFBIG)."""
    if module_or_code.startswith("code:"):
        return [PY, "-c", module_or_code[5:], *args]
    if fsize is None:
        return [PY, "-m", module_or_code, *args]
    wrapper = (
        "import resource, runpy, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))\n"
        f"sys.argv = [{module_or_code!r}] + sys.argv[1:]\n"
        f"runpy.run_module({module_or_code!r}, run_name='__main__', alter_sys=True)\n")
    return [PY, "-c", wrapper, *args]


def run(cwd: Path, module_or_code: str, *args, fsize: int | None = None, timeout: int = TIMEOUT) -> Call:
    start = time.perf_counter()
    try:
        done = subprocess.run(_argv(module_or_code, args, fsize=fsize), cwd=cwd, env=_env(), capture_output=True,
                              timeout=timeout)
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

def stderr_problem(call: Call, codes=(2,)) -> str | None:
    """Why a call's exit status and stderr are not a clean error (None when they are)."""
    if "Traceback" in call.stderr:
        return "traceback on stderr"
    if call.rc not in codes:
        return f"exit status {call.rc}, expected {'/'.join(map(str, codes))}"
    lines = [line for line in call.stderr.splitlines() if line.strip()]
    if call.rc == 0:
        return None
    usage, rest = False, []
    for line in lines:  # argparse's usage block comes before its error line
        if line.startswith("usage:") or (usage and line[:1].isspace()):
            usage = True
            continue
        usage = False
        if not (WARNING_LINE.match(line) or BANNER_LINE.match(line)):
            rest.append(line)
    if len(rest) != 1:
        return f"{len(rest)} non-warning stderr lines, expected 1"
    if not ERROR_LINE.match(rest[0]):
        return "stderr line is not 'PROG: error: ...'"
    return None


def snapshot(folder: Path) -> dict[str, str]:
    """{relative path: sha256 (or the kind for what is not a regular file)} of everything in ``folder``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath, name)
            rel = str(path.relative_to(folder))
            mode = path.lstat().st_mode
            if stat.S_ISREG(mode):
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[rel] = f"<{stat.filemode(mode)[0]}>"
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


@dataclasses.dataclass
class Result:
    case: str
    klass: str
    outcome: str = "clean"  # clean | unclean | lost | unclean+lost | skipped
    rc: int | None = None
    stderr: str = ""
    stderr_tail: str = ""
    detail: str = ""
    command: str = ""
    seconds: float = 0.0


@dataclasses.dataclass
class Case:
    name: str
    klass: str
    function: Callable  # function(folder, fixtures) -> (call, unclean problems, lost problems, command)


CASES: list[Case] = []


def case(name: str, klass: str):
    def register(function):
        CASES.append(Case(name, klass, function))
        return function
    return register


def cli_case(name: str, klass: str, module: str, args, *, prepare=None, codes=(2,), fsize=None, new_run=None,
             check=None):
    """A case of one call: ``prepare(folder, fx)`` makes its inputs, ``check(folder, call)`` adds problems."""

    def function(folder: Path, fx: Path):
        if prepare is not None:
            prepare(folder, fx)
        before = snapshot(folder)
        argv = [a(folder) if callable(a) else a for a in args]
        call = run(folder, module, *argv, fsize=fsize)
        unclean = [p for p in [stderr_problem(call, codes)] if p]
        if check is not None:
            unclean += check(folder, call) or []
        lost = lost_data(folder, before, call, folder / new_run if new_run else None)
        shown = module if not module.startswith("code:") else "python -c <snippet>"
        return call, unclean, lost, f"{f'(RLIMIT_FSIZE={fsize}) ' if fsize else ''}{shown} " + " ".join(
            os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv)
    CASES.append(Case(name, klass, function))


def snippet_case(name: str, klass: str, body: str, *, prepare=None):
    """A library-API case: the snippet raises nothing unexpected and prints OK when the behaviour is right."""
    code = f"import sys\nsys.path.insert(0, {str(REPO)!r})\n" + textwrap.dedent(body)
    cli_case(name, klass, "code:" + code, [], prepare=prepare, codes=(0,),
             check=lambda folder, call: [] if call.stdout.strip().endswith("OK") else
             [f"snippet said: {(call.stdout.strip().splitlines() or ['nothing'])[-1][:160]}"])


# ------------------------------------------------------------------ fixtures

FIXTURE_CODE = r"""
import gzip, json, os, random, sys
import torch
sys.path.insert(0, sys.argv[1])
from flax_transformer import checkpoints, hf, porting
from flax_transformer.models.configs import GPTConfig
from torch_reference.former import CTransformer
from torch_reference.gpt import GPT2LMHeadModel

torch.manual_seed(0)
config = json.loads(sys.argv[2])
ct = CTransformer(**config).eval()
torch.save(ct.state_dict(), "ct.pt")
export.save_safetensors(porting.torch_to_flax(ct), "ct.safetensors")
big = CTransformer(emb=256, heads=4, depth=4, seq_length=64, num_tokens=40000, num_classes=2).eval()
export.save_safetensors(porting.torch_to_flax(big), "big.safetensors")
export.save_pretrained(GPT2LMHeadModel(GPTConfig.tiny()), "gpt2")

class Evil:
    def __reduce__(self):
        return (os.system, ("touch ft-pwned-marker",))
torch.save({"tblocks.0.norm1.weight": Evil()}, "evil.pt")

random.seed(0)
words = "good bad great awful film movie plot actor boring fun loved hated the a and of it was".split()
os.makedirs("imdb-data/imdb")
for split in ("train", "test"):
    for label, name in ((0, "neg"), (1, "pos")):
        for shard in range(2):
            with gzip.open(f"imdb-data/imdb/{split}-{name}-{shard:02d}-of-02.jsonl.gz", "wt", encoding="utf-8") as f:
                for _ in range(150):
                    text = " ".join(random.choice(words) for _ in range(random.randint(5, 40)))
                    f.write(json.dumps({"text": text, "label": label}) + "\n")
print("fixtures done")
"""


def build_fixtures(fx: Path) -> None:
    call = run(fx, "code:" + FIXTURE_CODE, str(REPO), json.dumps(CT_CONFIG))
    if call.rc != 0:
        raise SystemExit(f"building the fixtures failed:\n{call.stderr}")
    call = run(fx, "train.classify", "--preset", "tiny", "--steps", "2", "--data-dir", "imdb-data", "--out", "run",
               "--no-progress")
    if call.rc != 0 or not (fx / "run" / "checkpoints" / "2").is_dir():
        raise SystemExit(f"the finished tiny run failed:\n{call.stderr}")


def copy(*names):
    """A ``prepare`` that copies fixtures into the case folder."""
    def prepare(folder: Path, fx: Path):
        for name in names:
            (shutil.copytree if (fx / name).is_dir() else shutil.copy2)(fx / name, folder / name)
    return prepare


def chain(*prepares):
    def prepare(folder, fx):
        for p in prepares:
            p(folder, fx)
    return prepare


def touch(name: str, data: bytes = b"old output\n"):
    def prepare(folder, fx):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return prepare


def mkdir_with_file(name: str):
    def prepare(folder, fx):
        (folder / name).mkdir(parents=True)
        (folder / name / "keep.txt").write_text("keep me\n")
    return prepare


def copy_as(src: str, dst: str):
    def prepare(folder, fx):
        (shutil.copytree if (fx / src).is_dir() else shutil.copy2)(fx / src, folder / dst)
    return prepare


def device_path(folder: Path) -> str:
    """A character device to write to: our own /dev/null node in the case folder as root (so a
    broken writer cannot replace the system's), else /dev/null (which a non-root user cannot replace)."""
    if ROOT:
        node = folder / "null-device"
        if not node.exists():
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        return str(node)
    return "/dev/null"


def still_device(folder, call):
    path = Path(device_path(folder))
    return [] if stat.S_ISCHR(path.lstat().st_mode) else [f"{path} is no longer a device node"]


def no_output(*names):
    def check(folder, call):
        return [f"{n} was written although the call failed" for n in names
                if call.rc != 0 and (folder / n).exists()]
    return check


def no_marker(folder, call):
    return ["the pickle's code RAN (ft-pwned-marker exists)"] if (folder / "ft-pwned-marker").exists() else []


FT = "flax_transformer"
CT_FLAGS = ["--family", "former", "--class", "CTransformer", "--config", json.dumps(CT_CONFIG)]
RUN = ["--preset", "tiny", "--steps", "2", "--no-progress"]

# ------------------------------------------------------------------ 1-4: outputs

cli_case("port existing .safetensors, no --overwrite", "1-4 outputs", FT, ["port", "ct.safetensors", "out.safetensors"],
         prepare=chain(copy("ct.safetensors"), touch("out.safetensors")))
cli_case("port existing .pt, no --overwrite", "1-4 outputs", FT, ["port", "ct.safetensors", "out.pt"],
         prepare=chain(copy("ct.safetensors"), touch("out.pt")))
cli_case("port existing orbax folder, no --overwrite", "1-4 outputs", FT,
         ["port", "ct.safetensors", "out-orbax", "--to", "orbax"],
         prepare=chain(copy("ct.safetensors"), mkdir_with_file("out-orbax")))
cli_case("port existing HF folder, no --overwrite", "1-4 outputs", FT, ["port", "gpt2", "out-hf", "--to", "hf"],
         prepare=chain(copy("gpt2"), mkdir_with_file("out-hf")))
cli_case("port to a device node --overwrite", "2 wrong kind", FT,
         ["port", "ct.safetensors", device_path, "--to", "safetensors", "--overwrite"],
         prepare=chain(copy("ct.safetensors"), lambda f, fx: device_path(f)), check=still_device)
cli_case("port to a FIFO --overwrite", "2 wrong kind", FT,
         ["port", "ct.safetensors", "pipe.safetensors", "--overwrite"],
         prepare=chain(copy("ct.safetensors"), lambda f, fx: os.mkfifo(f / "pipe.safetensors")))
cli_case("port .safetensors onto a folder --overwrite", "2 wrong kind", FT,
         ["port", "ct.safetensors", "out.safetensors", "--overwrite"],
         prepare=chain(copy("ct.safetensors"), mkdir_with_file("out.safetensors")))
cli_case("port orbax onto a file --overwrite", "2 wrong kind", FT,
         ["port", "ct.safetensors", "out-orbax", "--to", "orbax", "--overwrite"],
         prepare=chain(copy("ct.safetensors"), touch("out-orbax")))
cli_case("port onto a symlink --overwrite", "2 wrong kind", FT,
         ["port", "ct.safetensors", "link.safetensors", "--overwrite"],
         prepare=chain(copy("ct.safetensors"), touch("target.bin"),
                       lambda f, fx: os.symlink("target.bin", f / "link.safetensors")))
cli_case("port into a missing parent folder", "18 files", FT, ["port", "ct.safetensors", "no/such/out.safetensors"],
         prepare=copy("ct.safetensors"))
cli_case("port full disk --overwrite safetensors", "1 full disk", FT,
         ["port", "big.safetensors", "out.safetensors", "--overwrite"], fsize=1 << 20,
         prepare=chain(copy("big.safetensors"), touch("out.safetensors")))
cli_case("port full disk --overwrite orbax", "1 full disk", FT,
         ["port", "big.safetensors", "out-orbax", "--to", "orbax", "--overwrite"], fsize=1 << 20,
         prepare=chain(copy("big.safetensors"), mkdir_with_file("out-orbax")))
cli_case("port full disk --overwrite hf", "1 full disk", FT, ["port", "gpt2", "out-hf", "--to", "hf", "--overwrite"],
         fsize=4096, prepare=chain(copy("gpt2"), mkdir_with_file("out-hf")))
cli_case("port full disk torch .pt", "1 full disk", FT, ["port", "big.safetensors", "out.pt"], fsize=1 << 20,
         prepare=copy("big.safetensors"), check=no_output("out.pt"))
cli_case("attention-map existing --out, no --overwrite", "3 outputs", FT,
         ["attention-map", "--text", "time flies", "--layer", "0", "--out", "map.png"], prepare=touch("map.png"))
cli_case("attention-map --out is a folder", "2 wrong kind", FT,
         ["attention-map", "--text", "time flies", "--layer", "0", "--out", "map.html", "--overwrite"],
         prepare=mkdir_with_file("map.html"))
cli_case("attention-map --layer 99", "18 flags", FT, ["attention-map", "--text", "time flies", "--layer", "99",
                                                      "--out", "map.png"])
cli_case("attention-map non-UTF-8 --text", "18 flags", FT,
         ["attention-map", b"--text", b"caf\xe9 \xff", "--layer", "0", "--out", "map.png"], codes=(0, 2))
cli_case("train --export-torch existing file", "3 outputs", "train.seq2seq",
         [*RUN, "--out", "run", "--export-torch", "w.safetensors"], prepare=touch("w.safetensors"), new_run="run")
cli_case("train --export-torch to a device", "2 wrong kind", "train.seq2seq",
         [*RUN, "--out", "run", "--export-torch", device_path, "--overwrite"], new_run="run",
         prepare=lambda f, fx: device_path(f), check=still_device)
cli_case("train --export-torch in a missing folder", "7 flags first", "train.seq2seq",
         [*RUN, "--out", "run", "--export-torch", "no/such/w.safetensors"], new_run="run")
if not ROOT:
    cli_case("port into a read-only folder", "18 files", FT, ["port", "ct.safetensors", "ro/out.safetensors"],
             prepare=chain(copy("ct.safetensors"), lambda f, fx: ((f / "ro").mkdir(), (f / "ro").chmod(0o555))))
    cli_case("train --out in a read-only folder", "18 files", "train.lm", [*RUN, "--out", "ro/run"],
             prepare=lambda f, fx: ((f / "ro").mkdir(), (f / "ro").chmod(0o555)))


@case("kill -9 during port --overwrite, then port again", "4 temps")
def kill_port(folder: Path, fx: Path):
    shutil.copy2(fx / "big.safetensors", folder)
    (folder / "out.safetensors").write_bytes(b"old output\n")
    process = popen(folder, FT, "port", "big.safetensors", "out.safetensors", "--overwrite")
    start, landed = time.perf_counter(), False
    while process.poll() is None and time.perf_counter() - start < TIMEOUT:
        if temps(folder):
            time.sleep(0.01)
            process.send_signal(signal.SIGKILL)
            landed = True
            break
        time.sleep(0.002)
    first = finish(process, start)
    unclean, lost = [], []
    if landed and (folder / "out.safetensors").read_bytes() != b"old output\n":
        lost.append("the old out.safetensors changed after kill -9")
    if not landed:
        unclean.append("(kill landed after the write: the port finished first)")
    again = run(folder, FT, "port", "big.safetensors", "out.safetensors", "--overwrite")
    problem = stderr_problem(again, (0,))
    unclean += [f"the next port: {problem}"] if problem else []
    lost += [f"temp left after the next write: {t}" for t in temps(folder)]
    again.stderr = f"[kill -9 {'during the write' if landed else 'missed'}, rc {first.rc}] " + again.stderr
    return again, unclean, lost, "flax_transformer port big.safetensors out.safetensors --overwrite; kill -9; again"


# ------------------------------------------------------------------ corrupted inputs, 13-16

def truncated(name, size_fraction=0.5):
    def prepare(folder, fx):
        data = (fx / "ct.safetensors").read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * size_fraction)])
    return prepare


def flip_header(folder, fx):
    data = bytearray((fx / "ct.safetensors").read_bytes())
    for offset in (12, 40, 41):  # inside the JSON header
        data[offset] ^= 0xFF
    (folder / "flip.safetensors").write_bytes(bytes(data))


def huge_header(folder, fx):
    data = bytearray((fx / "ct.safetensors").read_bytes())
    data[:8] = (1 << 62).to_bytes(8, "little")
    (folder / "huge.safetensors").write_bytes(bytes(data))


def rewrite_metadata(change: Callable[[dict], None], name="meta.safetensors"):
    def prepare(folder, fx):
        data = (fx / "ct.safetensors").read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        description = json.loads(header["__metadata__"]["flax_transformer"])
        change(description)
        header["__metadata__"]["flax_transformer"] = json.dumps(description)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        (folder / name).write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    return prepare


cli_case("port a truncated .safetensors", "13 corrupted", FT, ["port", "trunc.safetensors", "out.pt"],
         prepare=truncated("trunc.safetensors"), check=no_output("out.pt"))
cli_case("verify a truncated .safetensors", "13 corrupted", FT, ["verify", "--checkpoint", "t.safetensors"],
         prepare=truncated("t.safetensors", 0.9))
cli_case("port flipped bytes in the safetensors header", "13 corrupted", FT, ["port", "flip.safetensors", "o.pt"],
         prepare=flip_header)
cli_case("summary a safetensors header length of 2**62", "13 corrupted", FT, ["summary", "huge.safetensors"],
         prepare=huge_header)
cli_case("port a .pt pickle carrying code", "16 pickles", FT, ["port", "evil.pt", "out.safetensors", *CT_FLAGS],
         prepare=copy("evil.pt"), check=no_marker)
cli_case("port an HF folder whose pytorch_model.bin carries code", "16 pickles", FT,
         ["port", "gpt2-evil", "out.safetensors"], check=no_marker,
         prepare=lambda f, fx: (shutil.copytree(fx / "gpt2", f / "gpt2-evil"),
                                (f / "gpt2-evil" / "model.safetensors").unlink(),
                                shutil.copy2(fx / "evil.pt", f / "gpt2-evil" / "pytorch_model.bin")))
cli_case("safetensors metadata naming os.system as class", "16 metadata", FT, ["summary", "meta.safetensors"],
         prepare=rewrite_metadata(lambda d: d.update({"family": "former", "class": "system"})))
cli_case("safetensors metadata family 'os'", "16 metadata", FT, ["port", "meta.safetensors", "o.pt"],
         prepare=rewrite_metadata(lambda d: d.update({"family": "os", "class": "system"})))
cli_case("safetensors metadata __config__ 'subprocess.Popen'", "16 metadata", FT, ["summary", "meta.safetensors"],
         prepare=rewrite_metadata(lambda d: d["init_kwargs"].update({"emb": {"__config__": "Popen", "args": "id"}})))
cli_case("port --config '[1,2]'", "18 flags", FT, ["port", "ct.pt", "o.safetensors", "--family", "former",
                                                   "--class", "CTransformer", "--config", "[1,2]"],
         prepare=copy("ct.pt"))
cli_case("port --config with emb=-32", "13 config", FT,
         ["port", "ct.pt", "o.safetensors", "--family", "former", "--class", "CTransformer",
          "--config", json.dumps({**CT_CONFIG, "emb": -32})], prepare=copy("ct.pt"))
cli_case("port --config with depth=1.5", "13 config", FT,
         ["port", "ct.pt", "o.safetensors", "--family", "former", "--class", "CTransformer",
          "--config", json.dumps({**CT_CONFIG, "depth": 1.5})], prepare=copy("ct.pt"))
cli_case("port --class os.system", "16 metadata", FT,
         ["port", "ct.pt", "o.safetensors", "--family", "former", "--class", "__import__",
          "--config", "{}"], prepare=copy("ct.pt"))


def gpt2_config(**changes):
    def prepare(folder, fx):
        shutil.copytree(fx / "gpt2", folder / "gpt2")
        path = folder / "gpt2" / "config.json"
        config = json.loads(path.read_text())
        config.update(changes)
        path.write_text(json.dumps(config))  # allow_nan: NaN is written as the bare token NaN
    return prepare


for field, value in [("layer_norm_epsilon", "1e-5"), ("layer_norm_epsilon", float("nan")), ("resid_pdrop", 1.5),
                     ("attn_pdrop", -0.1), ("n_head", -2), ("n_layer", 1.5), ("vocab_size", 1e10),
                     ("n_embd", True), ("n_positions", 10 ** 12)]:
    cli_case(f"HF config.json {field}={value!r}", "13 config", FT, ["port", "gpt2", "out.safetensors"],
             prepare=gpt2_config(**{field: value}), check=no_output("out.safetensors"))


def sharded(index):
    def prepare(folder, fx):
        shutil.copytree(fx / "gpt2", folder / "gpt2")
        shard = folder / "gpt2" / "model-00001-of-00001.safetensors"
        (folder / "gpt2" / "model.safetensors").rename(shard)
        shutil.copy2(shard, folder / "outside.safetensors")
        value = index(folder) if callable(index) else index
        (folder / "gpt2" / "model.safetensors.index.json").write_text(json.dumps(value))
    return prepare


def every_key(shard):
    def index(folder):
        from safetensors import safe_open
        with safe_open(str(folder / "gpt2" / "model-00001-of-00001.safetensors"), "np") as f:
            return {"weight_map": {k: shard(folder) for k in f.keys()}}
    return index


cli_case("index.json that is a list", "14 index", FT, ["port", "gpt2", "o.safetensors"],
         prepare=sharded(["model-00001-of-00001.safetensors"]))
cli_case("index.json weight_map a string", "14 index", FT, ["port", "gpt2", "o.safetensors"],
         prepare=sharded({"weight_map": "model-00001-of-00001.safetensors"}))
cli_case("index.json shard '../outside.safetensors'", "14 index", FT, ["port", "gpt2", "o.safetensors"],
         prepare=sharded(every_key(lambda f: "../outside.safetensors")), check=no_output("o.safetensors"))
cli_case("index.json absolute shard path", "14 index", FT, ["port", "gpt2", "o.safetensors"],
         prepare=sharded(every_key(lambda f: str(f / "outside.safetensors"))), check=no_output("o.safetensors"))
cli_case("index.json shard that does not exist", "14 index", FT, ["port", "gpt2", "o.safetensors"],
         prepare=sharded(every_key(lambda f: "model-00002-of-00002.safetensors")))

# ------------------------------------------------------------------ library API, 15, 17, 18

LOAD = """
import numpy as np
from torch_reference.former import CTransformer
from flax_transformer import porting
model = porting.torch_to_flax(CTransformer(emb=32, heads=4, depth=2, seq_length=16, num_tokens=100, num_classes=2))
before = porting.state_dict(model)
good = {k: np.zeros_like(v) for k, v in before.items()}
def expect(kinds, words, state):
    try:
        porting.load_state_dict(model, state)
    except kinds as error:
        message = str(error)
        if not any(w in message for w in words):
            print("message does not name the problem:", message); raise SystemExit(1)
    else:
        print("accepted"); raise SystemExit(1)
    after = porting.state_dict(model)
    if any(not np.array_equal(before[k], after[k]) for k in before):
        print("half-loaded: weights changed"); raise SystemExit(1)
    print("OK")
"""
for label, state, words in [
        ("a list", "list(good.items())", "'mapping', 'dict', 'list'"),
        ("None", "None", "'mapping', 'dict', 'None'"),
        ("non-string keys", "{1: v for v in good.values()}", "'str', 'key'"),
        ("complex values", "{k: v.astype(np.complex64) + 1j for k, v in good.items()}", "'complex', 'imaginary'"),
        ("float64 1e300", "{k: np.full(v.shape, 1e300) for k, v in good.items()}", "'range', 'inf'"),
        ("strings as values", "{k: np.full(v.shape, 'a') for k, v in good.items()}", "'dtype', 'numeric', 'real'"),
        ("one wrong shape among good keys", "dict(good, **{'toprobs.bias': np.zeros(3)})", "'toprobs.bias',")]:
    snippet_case(f"load_state_dict with {label}", "15 state_dict",
                 LOAD + f"expect((TypeError, ValueError), ({words}), {state})\n")

snippet_case("checkpoints.load('/nonexistent.pt')", "18 files", """
from flax_transformer import checkpoints
try:
    checkpoints.load("/nonexistent/model.pt")
except FileNotFoundError as error:
    print("OK" if "bare state_dict" not in str(error) and "nonexistent" in str(error) else f"message: {error}")
""")
snippet_case("save_safetensors onto an existing file", "3 outputs", """
from torch_reference.former import CTransformer
from flax_transformer import checkpoints, porting
model = porting.torch_to_flax(CTransformer(emb=32, heads=4, depth=2, seq_length=16, num_tokens=100, num_classes=2))
try:
    export.save_safetensors(model, "out.safetensors")
except FileExistsError as error:
    print("OK" if "out.safetensors" in str(error) else f"message: {error}")
""", prepare=touch("out.safetensors"))
snippet_case("hf.save_pretrained into an existing empty folder", "6 outputs", """
from flax_transformer import hf
from flax_transformer.models.configs import GPTConfig
from torch_reference.gpt import GPT2LMHeadModel
export.save_pretrained(GPT2LMHeadModel(GPTConfig.tiny()), "out")
import os
print("OK" if os.path.isfile("out/model.safetensors") and os.stat("out/model.safetensors").st_mode & 0o044 else "perm")
""", prepare=lambda f, fx: (f / "out").mkdir())
snippet_case("generate temperature=1e-39 equals greedy", "17 generate", """
import numpy as np
from torch_reference.gpt import GPTTransformer
from flax_transformer import porting
from flax_transformer.models.generate import generate
model = porting.torch_to_flax(GPTTransformer(n_layers=1, d_embed=32, d_ff=64, n_heads=2, voc_size=50,
                                             max_length=32, dropout=0.0).eval())
prompt = np.array([[1, 2, 3, 4]])
a = np.asarray(generate(model, prompt, 8, temperature=1e-39, seed=1))
b = np.asarray(generate(model, prompt, 8, greedy=True))
print("OK" if np.array_equal(a, b) else f"differs: {a} vs {b}")
""")
snippet_case("batch 0 through GPT, encoder and generate", "17 generate", """
import numpy as np
from torch_reference.gpt import GPTTransformer
from torch_reference.encoder import TransformerEncoder
from flax_transformer import porting
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.models.generate import generate
gpt = porting.torch_to_flax(GPTTransformer(n_layers=1, d_embed=32, d_ff=64, n_heads=2, voc_size=50,
                                           max_length=32, dropout=0.0).eval())
enc = porting.torch_to_flax(TransformerEncoder(EncoderConfig.tiny()).eval())
empty = np.zeros((0, 5), np.int32)
shapes = [np.shape(gpt(empty)), np.shape(enc(empty)), np.shape(generate(gpt, empty, 3, greedy=True))]
print("OK" if all(s[0] == 0 for s in shapes) else f"shapes {shapes}")
""")
for label, code, words in [
        ("CTransformer(emb=-32)", "former.CTransformer(emb=-32, heads=4, depth=2, seq_length=16, num_tokens=100, "
                                  "num_classes=2, rngs=nnx.Rngs(0))", "'emb',"),
        ("CTransformer(num_tokens=0)", "former.CTransformer(emb=32, heads=4, depth=2, seq_length=16, num_tokens=0, "
                                       "num_classes=2, rngs=nnx.Rngs(0))", "'num_tokens',"),
        ("CTransformer(depth=1.5)", "former.CTransformer(emb=32, heads=4, depth=1.5, seq_length=16, num_tokens=100, "
                                    "num_classes=2, rngs=nnx.Rngs(0))", "'depth',"),
        ("GPTConfig(resid_pdrop=5.0)", "GPTConfig.tiny(resid_pdrop=5.0)", "'resid_pdrop',"),
        ("EncoderConfig(layer_norm_eps=nan)", "EncoderConfig.tiny(layer_norm_eps=float('nan'))", "'layer_norm_eps',"),
        ("generate(max_new_tokens=-1)", "generate(gpt, np.zeros((1, 3), np.int32), -1)", "'max_new_tokens',"),
        ("generate(temperature=nan)", "generate(gpt, np.zeros((1, 3), np.int32), 2, temperature=float('nan'))",
         "'temperature',"),
        ("generate(top_p=1.5)", "generate(gpt, np.zeros((1, 3), np.int32), 2, top_p=1.5)", "'top_p',")]:
    snippet_case(f"{label} refused", "13 constructors", f"""
import numpy as np
from flax import nnx
from flax_transformer import former, porting
from flax_transformer.models.configs import EncoderConfig, GPTConfig
from flax_transformer.models.generate import generate
from torch_reference.gpt import GPTTransformer
from flax_transformer.verification import export
gpt = porting.torch_to_flax(GPTTransformer(n_layers=1, d_embed=32, d_ff=64, n_heads=2, voc_size=50,
                                           max_length=32, dropout=0.0).eval())
try:
    {code}
except (TypeError, ValueError) as error:
    print("OK" if any(w in str(error) for w in ({words})) else f"message: {{error}}")
else:
    print("accepted")
""")

# ------------------------------------------------------------------ training runs, 7, 9-12

for flags in (["--steps", "0"], ["--batch-size", "0"], ["--lr", "-1"], ["--lr", "nan"], ["--steps", "-5"],
              ["--seed", "-1"]):
    cli_case(f"train.lm {' '.join(flags)}", "7 flags", "train.lm", [*RUN, *flags, "--out", "run"], new_run="run")
cli_case("train.classify --epochs 0", "7 flags", "train.classify",
         ["--preset", "tiny", "--epochs", "0", "--no-progress", "--data-dir", "imdb-data", "--out", "run"],
         prepare=copy("imdb-data"), new_run="run")
cli_case("train.seq2seq --max-digits 10000", "12 resources", "train.seq2seq", [*RUN, "--max-digits", "10000",
                                                                               "--out", "run"], new_run="run")
cli_case("train.lm --batch-size 10**9", "12 resources", "train.lm", [*RUN, "--batch-size", str(10 ** 9),
                                                                     "--out", "run"], new_run="run")
cli_case("train.lm --max-digits (other task's flag)", "7 flags", "train.lm", [*RUN, "--max-digits", "5",
                                                                              "--out", "run"], new_run="run")
cli_case("train.lm --out is a file", "18 files", "train.lm", [*RUN, "--out", "run"], prepare=touch("run"))
cli_case("train.lm --out non-UTF-8 name", "7 flags", "train.lm", [*RUN, "--out", b"run-\xff"], codes=(0, 2),
         new_run=None, check=lambda f, call: [f"half-made run: {p.name!r}" for p in f.iterdir()
                                              if call.rc != 0 and p.name.startswith("run")])
cli_case("train.lm --text shorter than one window", "7 data", "train.lm", [*RUN, "--text", "tiny.txt", "--out", "run"],
         prepare=touch("tiny.txt", b"To be or not.\n"), new_run="run")
cli_case("train.lm --data-dir with a tiny Shakespeare", "7 data", "train.lm",
         [*RUN, "--data-dir", "data", "--out", "run"], prepare=touch("data/tinyshakespeare/input.txt", b"Hi.\n"),
         new_run="run")
cli_case("train.lm --text not UTF-8", "11 data", "train.lm", [*RUN, "--text", "latin1.txt", "--out", "run"],
         prepare=touch("latin1.txt", "café crème ".encode("latin-1") * 500), new_run="run")
cli_case("train.lm --text missing", "11 data", "train.lm", [*RUN, "--text", "nope.txt", "--out", "run"],
         new_run="run")
cli_case("train.lm full disk during the first checkpoint", "1 full disk", "train.lm", [*RUN, "--out", "run"],
         fsize=60_000, new_run="run")
cli_case("train.lm --resume of no run", "18 files", "train.lm", ["--resume", "--out", "run", "--no-progress"],
         new_run="run")


def imdb(change: Callable[[Path], None]):
    def prepare(folder, fx):
        shutil.copytree(fx / "imdb-data", folder / "imdb-data")
        change(folder / "imdb-data" / "imdb")
    return prepare


def gz_records(records: list, name="train-pos-01-of-02.jsonl.gz"):
    def change(imdb_dir: Path):
        with gzip.open(imdb_dir / name, "wb") as f:
            for record in records:
                f.write(record if isinstance(record, bytes) else (json.dumps(record) + "\n").encode())
    return change


def truncate_gz(imdb_dir: Path):
    path = imdb_dir / "train-neg-00-of-02.jsonl.gz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


CLASSIFY = ["--preset", "tiny", "--steps", "2", "--no-progress", "--data-dir", "imdb-data", "--out", "run"]
for label, change in [
        ("a zero-byte shard", lambda d: (d / "test-neg-01-of-02.jsonl.gz").write_bytes(b"")),
        ("an empty gzip shard", gz_records([])),
        ("a missing shard", lambda d: (d / "train-pos-00-of-02.jsonl.gz").unlink()),
        ("a truncated .gz", truncate_gz),
        ("a record without text", gz_records([{"text": "fine", "label": 1}, {"label": 1}])),
        ("a record with a string label", gz_records([{"text": "fine", "label": "pos"}])),
        ("a record that is not UTF-8", gz_records([{"text": "fine", "label": 1}, b'{"text": "caf\xe9", "label": 1}\n'])),
        ("a record that is not JSON", gz_records([b"{this is not json\n"])),
        ("a label 7 (outside num_classes)", gz_records([{"text": "fine film", "label": 7}]))]:
    cli_case(f"IMDB data with {label}", "11 data", "train.classify", CLASSIFY, prepare=imdb(change), new_run="run")


def flip_orbax(folder: Path, fx: Path, every: bool = True):
    shutil.copytree(fx / "run", folder / "run")
    shutil.copytree(fx / "imdb-data", folder / "imdb-data")
    files = sorted((p for p in (folder / "run" / "checkpoints").rglob("*") if p.is_file() and "/d/" in str(p)),
                   key=lambda p: p.stat().st_size)
    for file in files if every else files[-1:]:
        data = bytearray(file.read_bytes())  # every array data file: the model's and the optimizer's
        for i in range(len(data) // 2, min(len(data), len(data) // 2 + 64)):
            data[i] ^= 0x5A
        file.write_bytes(bytes(data))


def names_checkpoint(folder, call):
    if call.rc == 0:
        return [] if "warning" in call.stderr.lower() else ["a corrupted checkpoint was used without a warning"]
    return [] if "checkpoint" in call.stderr.lower() else ["the error does not name the checkpoint"]


cli_case("classify --resume with flipped bytes in one checkpoint file", "8 checkpoints", "train.classify",
         ["--resume", "--out", "run", "--data-dir", "imdb-data", "--no-progress"],
         prepare=lambda f, fx: flip_orbax(f, fx, every=False),
         codes=(0, 2), check=names_checkpoint)
cli_case("classify --predict with flipped bytes in every checkpoint file", "8 checkpoints", "train.classify",
         ["--predict", "a fine film", "--checkpoint", "run"], prepare=flip_orbax, codes=(0, 2),
         check=names_checkpoint)
cli_case("classify --predict non-UTF-8 text", "18 flags", "train.classify",
         ["--predict", b"caf\xe9 \xff", "--checkpoint", "run"], prepare=copy("run"), codes=(0, 2))
cli_case("classify --resume with a garbage run.json", "18 files", "train.classify",
         ["--resume", "--out", "run", "--data-dir", "imdb-data", "--no-progress"],
         prepare=chain(copy("run", "imdb-data"), lambda f, fx: (f / "run" / "run.json").write_text("{\"lr\": ")))
cli_case("classify --resume with a different --lr", "18 flags", "train.classify",
         ["--resume", "--out", "run", "--data-dir", "imdb-data", "--no-progress", "--preset", "tiny", "--lr", "0.5"],
         prepare=copy("run", "imdb-data"))


@case("two --resume of one run at once", "9 lock")
def two_resumes(folder: Path, fx: Path):
    shutil.copytree(fx / "run", folder / "run")
    shutil.copytree(fx / "imdb-data", folder / "imdb-data")
    args = ["--resume", "--out", "run", "--data-dir", "imdb-data", "--no-progress"]
    start = time.perf_counter()
    a, b = popen(folder, "train.classify", *args), popen(folder, "train.classify", *args)
    first, second = finish(a, start), finish(b, start)
    calls = sorted([first, second], key=lambda c: c.rc or 0)
    unclean = []
    if sorted([first.rc, second.rc]) == [0, 0]:
        unclean.append("(both finished: they did not overlap)")
    elif sorted([first.rc, second.rc]) != [0, 2]:
        unclean.append(f"exit statuses {first.rc}, {second.rc}: expected 0 and 2")
    loser = calls[-1]
    problem = stderr_problem(loser, (2,)) if loser.rc else None
    unclean += [problem] if problem else []
    unclean += ["traceback in the winner"] if "Traceback" in calls[0].stderr else []
    lines = (folder / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [(json.loads(x).get("step"), json.loads(x).get("split", json.loads(x).get("kind"))) for x in lines]
    if len(steps) != len(set(map(str, steps))):
        unclean.append("metrics.jsonl holds a step twice")
    lost = [f"temp left: {t}" for t in temps(folder)]
    return loser, unclean, lost, "train.classify --resume --out run ... (twice, at once)"


@case("kill -9 during a training save, then --resume", "4 temps, 8 checkpoints")
def kill_training(folder: Path, fx: Path):
    args = ["--preset", "tiny", "--no-progress", "--out", "run"]
    start = time.perf_counter()
    process = popen(folder, "train.lm", *args)
    landed = False
    while process.poll() is None and time.perf_counter() - start < TIMEOUT:
        ckpt = folder / "run" / "checkpoints"
        if ckpt.is_dir() and any(ckpt.iterdir()):
            process.send_signal(signal.SIGKILL)
            landed = True
            break
        time.sleep(0.002)
    first = finish(process, start)
    again = run(folder, "train.lm", "--resume", "--out", "run", "--no-progress")
    unclean = [] if landed else ["(kill landed after the run ended)"]
    problem = stderr_problem(again, (0,))
    unclean += [f"the --resume: {problem}"] if problem else []
    metrics = folder / "run" / "metrics.jsonl"
    if metrics.exists():
        keys = [(r.get("step"), tuple(sorted(r))) for r in map(json.loads, metrics.read_text().splitlines())]
        if len(keys) != len(set(keys)):
            unclean.append("metrics.jsonl holds a step twice after the resume")
    lost = [f"temp left: {t}" for t in temps(folder)]
    again.stderr = f"[kill -9 {'during the save' if landed else 'missed'}, rc {first.rc}] " + again.stderr
    return again, unclean, lost, "train.lm --preset tiny --out run; kill -9 at the first checkpoint; --resume"


# ------------------------------------------------------------------ issues 14-16: bisect, certificates, torch state


def tamper_certified(folder: Path, fx: Path):
    """The certified tiny GPT-2 folder with one tensor changed after the export."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(fx / "gpt2", folder / "gpt2")
    weights = load_file(folder / "gpt2" / "model.safetensors")
    key = sorted(weights)[0]
    weights[key] = weights[key] + 1.0
    save_file(weights, folder / "gpt2" / "model.safetensors", metadata={"format": "pt"})


def names_tensor(folder, call):
    return [] if "differs" in call.stdout or "changed" in call.stdout else ["the re-check did not name the tensor"]


cli_case("train.seq2seq --init-from-torch a text file", "15 torch state", "train.seq2seq",
         ["--preset", "tiny", "--steps", "10", "--init-from-torch", "notes.pt", "--out", "run", "--no-progress"],
         prepare=touch("notes.pt", b"hello world\n"), new_run="run")
cli_case("train.seq2seq --init-from-torch a pickle carrying code", "15 torch state, 16 pickles", "train.seq2seq",
         ["--preset", "tiny", "--steps", "10", "--init-from-torch", "evil.pt", "--out", "run", "--no-progress"],
         prepare=copy("evil.pt"), check=no_marker, new_run="run")
cli_case("port --to torch-state of a file, not a run", "15 torch state", FT,
         ["port", "ct.safetensors", "out.pt", "--to", "torch-state"], prepare=copy("ct.safetensors"))
cli_case("verify --pair of a module that does not exist", "14 bisect", FT, ["verify", "--pair", "nope_nope:make"])
cli_case("verify --bisect with nothing to bisect", "14 bisect", FT, ["verify", "--bisect"])
@case("verify --checkpoint of a folder changed after its certificate", "14 certificate")
def tampered_certificate(folder: Path, fx: Path):
    """Not a user mistake but a failed check: exit 1 and the tensor named on stdout; stderr may hold
    transformers' own loading messages (the table compares with it), but no traceback."""
    tamper_certified(folder, fx)
    before = snapshot(folder)
    call = run(folder, FT, "verify", "--checkpoint", "gpt2")
    unclean = ["traceback on stderr"] if "Traceback" in call.stderr else []
    unclean += [] if call.rc == 1 else [f"exit status {call.rc}, expected 1"]
    unclean += names_tensor(folder, call)
    return call, unclean, lost_data(folder, before, call), f"{FT} verify --checkpoint gpt2"


# ------------------------------------------------------------------ the sweep

def run_case(item: Case, fx: Path, base: Path) -> Result:
    folder = Path(tempfile.mkdtemp(prefix="case-", dir=base))
    result = Result(item.name, item.klass)
    start = time.perf_counter()
    try:
        call, unclean, lost, command = item.function(folder, fx)
        result.rc, result.command, result.stderr_tail = call.rc, command, call.stderr[-2000:]
        lines = [x for x in call.stderr.splitlines() if x.strip()]
        errors = [x for x in lines if ERROR_LINE.match(x) or "Error" in x]
        result.stderr = (errors[-1] if errors else lines[-1] if lines else "").strip()
        notes = [p for p in unclean if p.startswith("(")]
        unclean = [p for p in unclean if not p.startswith("(")]
        result.outcome = "+".join(x for x, bad in (("unclean", unclean), ("lost", lost)) if bad) or "clean"
        result.detail = "; ".join(unclean + lost + notes)
        if "Traceback" in call.stderr:
            result.detail += " | " + " / ".join(call.stderr.strip().splitlines()[-3:])
    except Exception as error:  # a bug of the sweep itself: shown, not hidden
        result.outcome, result.detail = "unclean", f"sweep error: {type(error).__name__}: {error}"
    finally:
        result.seconds = time.perf_counter() - start
        for path in folder.rglob("*"):  # undo read-only folders before removing
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(folder, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write DIR/faults.jsonl")
    parser.add_argument("--only", nargs="+", help="run the cases whose name contains one of these")
    parser.add_argument("--keep", action="store_true", help="keep the fixtures folder (printed)")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.only or any(s in c.name for s in args.only)]
    start = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="ft-faults-"))
    results = []
    try:
        fx = base / "fixtures"
        fx.mkdir()
        print(f"building fixtures in {fx} ...", flush=True)
        build_fixtures(fx)
        print(f"fixtures: {time.perf_counter() - start:.0f} s; {len(cases)} cases"
              f"{' (root: read-only-folder cases skipped)' if ROOT else ''}", flush=True)
        for i, item in enumerate(cases, 1):
            result = run_case(item, fx, base)
            results.append(result)
            print(f"[{i:2d}/{len(cases)}] {result.outcome:13s} rc={result.rc!s:4s} {result.seconds:5.1f}s  "
                  f"{item.name}", flush=True)
    finally:
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)

    width = max(len(r.case) for r in results)
    print(f"\n{'case':{width}s}  {'class':22s} {'outcome':13s} {'rc':>4s}  first stderr line")
    for r in results:
        print(f"{r.case:{width}s}  {r.klass:22s} {r.outcome:13s} {r.rc!s:>4s}  {r.stderr[:100]}")
    bad = [r for r in results if r.outcome != "clean"]
    if bad:
        print("\nunclean or lost:")
        for r in bad:
            tail = "\n      ".join(r.stderr_tail.strip().splitlines()[-6:])
            print(f"- {r.case} [{r.outcome}]: {r.command}\n    {r.detail[:600]}\n    stderr:\n      {tail}")
    unclean = sum("unclean" in r.outcome for r in results)
    lost = sum("lost" in r.outcome for r in results)
    clean = sum(r.outcome == "clean" for r in results)
    print(f"\n{len(results)} cases, {clean} clean, {unclean} unclean (tracebacks or wrong codes), "
          f"{lost} with data lost  ({time.perf_counter() - start:.0f} s"
          f"{'; as root: read-only folders not tried' if ROOT else ''})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "faults.jsonl", "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
    return 1 if unclean or lost else 0


if __name__ == "__main__":
    sys.exit(main())
