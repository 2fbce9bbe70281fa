"""Fault-sweep cases: outputs (issue 12 items 1-4), corrupted and hostile files (13-16), bad
``config.json`` values and malformed shard indexes, against ``flax-transformer port``, ``summary``,
``verify`` and ``attention-map`` and the entry points' export flags."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from faults_fixtures import chain, copy, device_path, mkdir_with_file, no_marker, no_output, still_device, touch
from faults_harness import CT_CONFIG, FT, ROOT, TIMEOUT, case, cli_case, finish, popen, run, stderr_problem, temps

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
