"""Fault-sweep cases: the library API (issue 12 items 15, 17, 18), training runs and their data
(7, 9-12), damaged checkpoints, kills and races, and the first cases of issues 14-16 (bisect,
certificates, torch training state)."""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from faults_fixtures import chain, copy, no_marker, touch
from faults_harness import (
    FT,
    TIMEOUT,
    case,
    cli_case,
    finish,
    popen,
    run,
    snippet_case,
    stderr_problem,
    temps,
    verdict_case,
)

RUN = ["--preset", "tiny", "--steps", "2", "--no-progress"]

# ------------------------------------------------------------------ library API, 15, 17, 18

LOAD = """
import numpy as np
from torch_reference.former import CTransformer
from flax_transformer.interop import porting
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
        print("SILENT: accepted"); raise SystemExit(0)
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
from flax_transformer.interop import checkpoints
try:
    checkpoints.load("/nonexistent/model.pt")
except FileNotFoundError as error:
    print("OK" if "bare state_dict" not in str(error) and "nonexistent" in str(error) else f"message: {error}")
""")
snippet_case("save_safetensors onto an existing file", "3 outputs", """
from torch_reference.former import CTransformer
from flax_transformer.interop import porting
from flax_transformer.verification import export
model = porting.torch_to_flax(CTransformer(emb=32, heads=4, depth=2, seq_length=16, num_tokens=100, num_classes=2))
try:
    export.save_safetensors(model, "out.safetensors")
except FileExistsError as error:
    print("OK" if "out.safetensors" in str(error) else f"message: {error}")
else:
    print("SILENT: wrote over the existing out.safetensors")
""", prepare=touch("out.safetensors"))
snippet_case("hf.save_pretrained into an existing empty folder", "6 outputs", """
from flax_transformer.verification import export
from flax_transformer.models.configs import GPTConfig
from torch_reference.gpt import GPT2LMHeadModel
export.save_pretrained(GPT2LMHeadModel(GPTConfig.tiny()), "out")
import os
print("OK" if os.path.isfile("out/model.safetensors") and os.stat("out/model.safetensors").st_mode & 0o044 else "perm")
""", prepare=lambda f, fx: (f / "out").mkdir())
snippet_case("generate temperature=1e-39 equals greedy", "17 generate", """
import numpy as np
from torch_reference.gpt import GPTTransformer
from flax_transformer.interop import porting
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
from flax_transformer.interop import porting
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
from flax_transformer.interop import porting
from flax_transformer.models import former
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
    print("SILENT: accepted")
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
        ("a record that is not UTF-8",
         gz_records([{"text": "fine", "label": 1}, b'{"text": "caf\xe9", "label": 1}\n'])),
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
verdict_case("verify --checkpoint of a folder changed after its certificate", "14 certificate", FT,
             ["verify", "--checkpoint", "gpt2"], verdict=r"differs|changed", prepare=tamper_certified)
