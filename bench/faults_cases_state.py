"""Fault-sweep cases of issue 22: files whose contents lie.

Torch training checkpoints with bad numbers (non-finite or negative Adam moments, inconsistent
steps, state for no parameter, malformed ``param_groups``) through ``--init-from-torch`` and runs
whose optimizer state was poisoned through ``port --to torch-state --verify``; sharded HF folders
whose shards disagree with their index; certificates with bad fields, no inputs, 1 GiB of garbage,
or a stray weights file beside them; orbax re-checks and their asyncio noise.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from faults_fixtures import TORCH_STATES, copy, no_output
from faults_harness import (
    FT,
    PEAK_RSS_FILE,
    SILENT,
    case,
    cli_case,
    error_lines,
    lost_data,
    run,
    snapshot,
    snippet_case,
    stderr_problem,
    verdict_case,
)


def error_matches(pattern: str):
    """A ``check``: the one error line (exit 2) matches ``pattern``."""
    def check(folder, call):
        line = (error_lines(call) or [""])[-1]
        return [] if call.rc != 2 or re.search(pattern, line) else [f"the error line does not match /{pattern}/"]
    return check


# ------------------------------------------------------------------ 4: training state checked as numbers

SEQ2SEQ = ["--preset", "tiny", "--steps", "8", "--no-progress", "--out", "run"]
for label, pattern in TORCH_STATES.items():
    file = "state-" + label.replace(" ", "-") + ".pt"
    verdict_case(f"train.seq2seq --init-from-torch with {label}", "22.4 torch state", "train.seq2seq",
                 [*SEQ2SEQ, "--init-from-torch", file], error=[file], prepare=copy(file),
                 check=error_matches(pattern), new_run="run")
cli_case("train.seq2seq --init-from-torch an intact state (control)", "22 controls", "train.seq2seq",
         [*SEQ2SEQ, "--init-from-torch", "state-good.pt"], codes=(0,), prepare=copy("state-good.pt"))

for run_dir, pattern in (("run-inf-nu", r"exp_avg_sq of [\w.]+ holds 1 inf value"),
                         ("run-nan-mu", r"exp_avg of [\w.]+ holds 1 NaN value"),
                         ("run-neg-nu", r"exp_avg_sq of [\w.]+ holds 1 negative value")):
    for flags in (["--verify"], []):
        verdict_case(" ".join(["port", run_dir, "--to torch-state", *flags]) + ": a poisoned optimizer moment",
                     "22.4 torch state", FT, ["port", run_dir, "out.pt", "--to", "torch-state", *flags],
                     error=["exp_avg"], prepare=copy(run_dir),
                     check=lambda folder, call, p=pattern: error_matches(p)(folder, call) + no_output("out.pt")(
                         folder, call))
cli_case("port RUN --to torch-state --verify of an intact run (control)", "22 controls", FT,
         ["port", "run", "out.pt", "--to", "torch-state", "--verify"], codes=(0,), prepare=copy("run"))
snippet_case("check_export of a torch state whose exp_avg_sq went negative after the export", "22.4 torch state", """
import torch
from flax_transformer.training.torch_state.run_export import check_export, export_run
export_run("run", "good.pt")
ckpt = torch.load("good.pt", weights_only=True)
ckpt["optimizer"]["state"][0]["exp_avg_sq"].view(-1)[0] = -1e-6
torch.save(ckpt, "tampered.pt")
problems = check_export("run", "tampered.pt")
if not problems:
    print("SILENT: check_export passed a negative exp_avg_sq")
else:
    print("OK" if len(problems) == 1 and "negative" in problems[0] else f"problems: {problems}")
""", prepare=copy("run"))

# ------------------------------------------------------------------ 5: sharded folders as transformers reads them

NAME = "transformer.h.0.ln_1.weight"  # in the first shard
SHARD_WORDS: dict[str, list[str]] = {}  # a case folder: what its refusal must name


def _index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _shards(folder: Path) -> list[str]:
    return sorted(set(_index(folder)["weight_map"].values()))


def _edit(folder: Path, shard: str, change) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / shard)
    change(tensors)
    save_file(tensors, folder / shard, metadata={"format": "pt"})


def _two_copies(folder, last=True):
    """NAME also in another shard, with other values (transformers loads the last copy)."""
    import numpy as np
    from safetensors.numpy import load_file

    first = _index(folder)["weight_map"][NAME]
    other = [s for s in _shards(folder) if s != first][-1 if last else 0]
    value = load_file(folder / first)[NAME]
    _edit(folder, other, lambda t: t.update({NAME: np.full_like(value, 7.0)}))
    return [first, other]


def _moved(folder):
    from safetensors.numpy import load_file

    first, other = _index(folder)["weight_map"][NAME], _shards(folder)[-1]
    value = load_file(folder / first)[NAME]
    _edit(folder, first, lambda t: t.pop(NAME))
    _edit(folder, other, lambda t: t.update({NAME: value}))
    return [first, other]


def _unlisted(folder):
    index = _index(folder)
    shard = index["weight_map"].pop(NAME)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return [shard]


def _missing(folder):
    shard = _index(folder)["weight_map"][NAME]
    _edit(folder, shard, lambda t: t.pop(NAME))
    return [shard]


def _stray(folder):
    import numpy as np
    from safetensors.numpy import save_file

    save_file({NAME: np.full(32, 7.0, np.float32)}, folder / "model-00099-of-00099.safetensors",
              metadata={"format": "pt"})
    return ["model-00099-of-00099.safetensors"]


def _gone(folder):
    last = _shards(folder)[-1]
    (folder / last).unlink()
    return [last]


def _no_metadata(folder):
    index = _index(folder)
    del index["metadata"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return []


def sharded(edit):
    def prepare(folder: Path, fx: Path):
        shutil.copytree(fx / "gpt2-sharded", folder / "gpt2")
        SHARD_WORDS[str(folder)] = edit(folder / "gpt2") + ([] if edit in (_gone, _no_metadata) else [NAME])
    return prepare


def names_shards(folder, call):
    line = (error_lines(call) or [""])[-1]
    return [f"the error line does not name {w!r}" for w in SHARD_WORDS.get(str(folder), []) if call.rc == 2
            and w not in line]


SHARD_CASES = {"a tensor in two shards, the last copy not the index's": _two_copies,
               "a tensor in two shards, the first copy not the index's": lambda f: _two_copies(f, last=False),
               "a tensor in a shard the index does not list it in": _moved,
               "a tensor in no index entry": _unlisted,
               "a listed tensor missing from its shard": _missing,
               "a shard file the index does not name": _stray,
               "a shard the index names that does not exist": _gone}
for label, edit in SHARD_CASES.items():
    verdict_case(f"port --verify of a sharded folder with {label}", "22.5 shards", FT,
                 ["port", "gpt2", "out.safetensors", "--verify"], error=[], prepare=sharded(edit),
                 check=lambda folder, call: names_shards(folder, call) + no_output("out.safetensors")(folder, call))
for label in ("a tensor in two shards, the last copy not the index's", "a tensor in no index entry"):
    verdict_case(f"verify --checkpoint of a sharded folder with {label}", "22.5 shards", FT,
                 ["verify", "--checkpoint", "gpt2"], verdict=r"FAIL|differs|changed", error=[],
                 prepare=sharded(SHARD_CASES[label]), check=names_shards)
verdict_case("summary of a sharded folder with a tensor in two shards", "22.5 shards", FT, ["summary", "gpt2"],
             error=[], prepare=sharded(_two_copies), check=names_shards)
verdict_case("port --verify --no-certify of a sharded folder transformers cannot load (index without metadata)",
             "22.5 shards", FT, ["port", "gpt2", "out.safetensors", "--verify", "--no-certify"],
             verdict=r"transformers cannot load", prepare=sharded(_no_metadata))

# ------------------------------------------------------------------ 6: the certificate validated before it is trusted

CERT = "ct.safetensors.verification.json"
FIRST_TENSOR = "pos_embedding.weight"
BAD_FIELDS = {  # name: (path of keys, value, the field named in the message)
    "inputs.batch null": (("inputs", "batch"), None, "field inputs.batch"),
    "a string where a tensor record belongs": (("tensors", FIRST_TENSOR), "abc", f"field tensors['{FIRST_TENSOR}']"),
    "an empty forward": (("forward",), {}, "field forward"),
    "batch -1": (("inputs", "batch"), -1, "field inputs.batch"),
    "batch 10**7": (("inputs", "batch"), 10**7, "field inputs.batch"),
    "batch true": (("inputs", "batch"), True, "field inputs.batch"),
    "length 10**9": (("inputs", "length"), 10**9, "field inputs.length"),
    "seed 2**32": (("inputs", "seed"), 2**32, "field inputs.seed"),
    "a bad tensor hash": (("tensors", FIRST_TENSOR, "sha256"), "xyz", f"field tensors['{FIRST_TENSOR}'].sha256"),
    "an unknown dtype": (("tensors", FIRST_TENSOR, "dtype"), "float33", f"field tensors['{FIRST_TENSOR}'].dtype"),
    "a negative dimension": (("tensors", FIRST_TENSOR, "shape"), [-1, 8], f"field tensors['{FIRST_TENSOR}'].shape[0]"),
    "a string error": (("backward", "max_rel_err"), "small", "field backward.max_rel_err"),
    "a negative error": (("forward", "max_rel_err"), -1.0, "field forward.max_rel_err"),
    "a NaN error": (("forward", "max_rel_err"), float("nan"), "field forward.max_rel_err"),
    "no versions": (("versions",), None, "field versions"),
    "tensors a list": (("tensors",), [], "field tensors"),
}


def certificate(change=None, *, text: bytes | None = None):
    """ct.safetensors and its certificate, changed by ``change(record)`` or replaced by ``text``."""
    def prepare(folder: Path, fx: Path):
        shutil.copy2(fx / "ct.safetensors", folder)
        record = json.loads((fx / CERT).read_text())
        if change is not None:
            change(record)
        (folder / CERT).write_bytes(text if text is not None else json.dumps(record).encode())
    return prepare


def _set(keys, value):
    def change(record):
        *parents, last = keys
        for key in parents:
            record = record[key]
        record[last] = value
    return change


for label, (keys, value, field) in BAD_FIELDS.items():
    verdict_case(f"verify --checkpoint, certificate with {label}", "22.6 certificate", FT,
                 ["verify", "--checkpoint", "ct.safetensors"], error=[CERT, field],
                 prepare=certificate(_set(keys, value)))
for label, text, words in (("not JSON", b"{", "is not valid JSON"),
                           ("binary", b"\xff\xfe\x00garbage", "is not valid JSON"),
                           ("nested 200000 deep", b"[" * 200_000 + b"]" * 200_000, "is not valid JSON"),
                           ("a list", b"[1, 2]", "field (top level)"), ("empty", b"", "")):
    verdict_case(f"verify --checkpoint, certificate that is {label}", "22.6 certificate", FT,
                 ["verify", "--checkpoint", "ct.safetensors"], error=[CERT, words], prepare=certificate(text=text))
verdict_case("verify --checkpoint, certificate with a tolerance of 1e-12 (tightened)", "22.6 certificate", FT,
             ["verify", "--checkpoint", "ct.safetensors"], verdict=r"FAIL|fail",
             prepare=certificate(_set(("forward", "tolerance"), 1e-12)))

FAKE = 4.321e-07


def _no_inputs(record):
    record["inputs"] = None
    record["forward"]["max_rel_err"] = record["backward"]["max_rel_err"] = FAKE


def not_echoed(folder, call):
    """The recorded figure printed as "now" was never measured: a silent wrong result."""
    if f"{FAKE:.2e} now" in call.stdout:
        return [f"{SILENT}the recorded {FAKE:.2e} printed as measured now"]
    return [] if "re-measured" in call.stdout or call.rc else [f"{SILENT}no word that the inputs were missing"]


cli_case("verify --checkpoint, certificate with inputs: null and made-up errors", "22.6 certificate", FT,
         ["verify", "--checkpoint", "ct.safetensors"], codes=(0,), prepare=certificate(_no_inputs), check=not_echoed)


@case("verify --checkpoint, a 1 GiB garbage certificate (sparse)", "22.6 certificate")
def huge_certificate(folder: Path, fx: Path):
    """Refused by its size before it is read: one line, and no more memory than a small bad certificate costs."""
    peaks = {}
    for label, size in (("small", 1), ("1 GiB", 1 << 30)):
        (folder / label).mkdir()
        shutil.copy2(fx / "ct.safetensors", folder / label)
        with open(folder / label / CERT, "wb") as f:
            f.write(b"{")
            f.truncate(size)  # sparse: costs no disk
        before = snapshot(folder / label)
        call = run(folder / label, FT, "verify", "--checkpoint", "ct.safetensors", peak_rss=True)
        rss = folder / label / PEAK_RSS_FILE
        peaks[label] = int(rss.read_text()) if rss.is_file() else None
        rss.unlink(missing_ok=True)
    problems = [p for p in [stderr_problem(call, (2,))] if p]
    if call.rc == 2 and CERT not in (error_lines(call) or [""])[-1]:
        problems.append("the error line does not name the file")
    if None in peaks.values():
        problems.append("(peak RSS not measured)")
    elif peaks["1 GiB"] - peaks["small"] > 256 << 10:  # KiB
        problems.append(f"reading the certificate cost {(peaks['1 GiB'] - peaks['small']) >> 10} MiB more than a "
                        "1-byte one: it was read whole")
    call.stderr = f"[peak RSS small {peaks['small']} KiB, 1 GiB {peaks['1 GiB']} KiB] " + call.stderr
    return call, problems, lost_data(folder / "1 GiB", before, call), f"{FT} verify --checkpoint ct.safetensors"


def stray_weights(folder: Path, fx: Path):
    shutil.copytree(fx / "gpt2-sharded", folder / "gpt2")
    shutil.copy2(fx / "ct.safetensors", folder / "gpt2" / "model.safetensors")


def short_and_says_nothing_compared(folder, call):
    problems = [] if "0 passed, 0 failed" not in call.stdout else ["'0 passed, 0 failed' printed"]
    long = [line for line in (call.stdout + call.stderr).splitlines() if len(line) >= 500]
    problems += [f"{len(long)} lines of 500+ characters (longest {max(map(len, long))})"] if long else []
    return problems


verdict_case("verify --checkpoint of a certified sharded folder with a stray model.safetensors", "22.6 certificate",
             FT, ["verify", "--checkpoint", "gpt2"], verdict=r"nothing compared|not in the certificate",
             prepare=stray_weights, check=short_and_says_nothing_compared)

# ------------------------------------------------------------------ 7: orbax's asyncio noise never reaches stderr

cli_case("verify --checkpoint of a certified orbax folder", "22.7 noise", FT, ["verify", "--checkpoint", "ct-orbax"],
         codes=(0,), prepare=copy("ct-orbax"))
cli_case("port a certified orbax folder to safetensors --verify", "22.7 noise", FT,
         ["port", "ct-orbax", "out.safetensors", "--verify"], codes=(0,), prepare=copy("ct-orbax"))


def flipped_orbax(folder: Path, fx: Path):
    shutil.copytree(fx / "ct-orbax", folder / "ct-orbax")
    for file in (p for p in (folder / "ct-orbax").rglob("*") if p.is_file() and "/d/" in str(p)):
        data = bytearray(file.read_bytes())
        for i in range(len(data) // 2, min(len(data), len(data) // 2 + 64)):
            data[i] ^= 0x5A
        file.write_bytes(bytes(data))


verdict_case("verify --checkpoint of an orbax folder with flipped bytes", "22.7 noise", FT,
             ["verify", "--checkpoint", "ct-orbax"], verdict=r"FAIL|differs|changed", error=["ct-orbax"],
             prepare=flipped_orbax)
verdict_case("port an orbax folder with flipped bytes", "22.7 noise", FT, ["port", "ct-orbax", "out.safetensors"],
             error=["ct-orbax"], prepare=flipped_orbax, check=no_output("out.safetensors"))
