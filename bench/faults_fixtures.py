"""The fault sweep's fixtures, built once per sweep and copied into the case folders that need them,
and the small ``prepare``/``check`` helpers the case files share.

Built in three subprocesses (the sweep itself imports neither torch nor JAX): the models and files
(``FIXTURE_CODE``), a finished 2-step ``train.classify`` run, and copies of that run whose optimizer
state was poisoned after training (``POISON_CODE``).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from faults_harness import CT_CONFIG, REPO, ROOT, run

FIXTURE_CODE = r"""
import copy, gzip, json, os, random, sys
import numpy as np
import torch
sys.path.insert(0, sys.argv[1])
from safetensors.numpy import load_file, save_file
from flax_transformer.interop import hf, porting
from flax_transformer.models.configs import GPTConfig
from flax_transformer.training import seq2seq
from flax_transformer.training.torch_state.to_jax import torch_optimizer
from flax_transformer.training.torch_state.to_torch import run_optim
from flax_transformer.verification import export
from torch_reference.former import CTransformer
from torch_reference.gpt import GPT2LMHeadModel

torch.manual_seed(0)
config = json.loads(sys.argv[2])
ct = CTransformer(**config).eval()
torch.save(ct.state_dict(), "ct.pt")
export.save_safetensors(porting.torch_to_flax(ct), "ct.safetensors")
export.save_orbax(porting.torch_to_flax(ct), "ct-orbax")
big = CTransformer(emb=256, heads=4, depth=4, seq_length=64, num_tokens=40000, num_classes=2).eval()
export.save_safetensors(porting.torch_to_flax(big), "big.safetensors")
export.save_pretrained(GPT2LMHeadModel(GPTConfig.tiny()), "gpt2")
export.save_pretrained(GPT2LMHeadModel(GPTConfig.tiny()), "gpt2-sharded", max_shard_size="30KB")

# NaN and inf in the source weights: written only without the certificate, as a user's broken file would be
with torch.no_grad():
    ct.toprobs.weight[0, 0] = float("nan")
    ct.toprobs.weight[1, 2] = float("inf")
export.save_safetensors(porting.torch_to_flax(ct), "nan-ct.safetensors", certify=False)
hf.save_pretrained(GPT2LMHeadModel(GPTConfig.tiny()), "gpt2-nan")
tensors = load_file("gpt2-nan/model.safetensors")
tensors["transformer.h.1.attn.c_attn.bias"] = tensors["transformer.h.1.attn.c_attn.bias"].copy()
tensors["transformer.h.1.attn.c_attn.bias"][5] = np.nan
save_file(tensors, "gpt2-nan/model.safetensors", metadata={"format": "pt"})

class Evil:
    def __reduce__(self):
        return (os.system, ("touch ft-pwned-marker",))
torch.save({"tblocks.0.norm1.weight": Evil()}, "evil.pt")

# a torch training checkpoint of train.seq2seq --preset tiny --steps 8's model at step 2, and its tampered copies
config = seq2seq.Seq2SeqConfig.tiny(steps=8)
twin = porting.flax_to_torch(seq2seq.build_model(config))
optimizer, scheduler = torch_optimizer(twin, run_optim(config))
for i in range(2):
    optimizer.zero_grad()
    sum(((p - 0.1 * (i + 1)) ** 2).sum() for p in twin.parameters()).backward()
    optimizer.step()
    scheduler.step()
good = {"model": twin.state_dict(), "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(), "step": 2}
torch.save(good, "state-good.pt")

def first(tensor, value):
    tensor.view(-1)[0] = value

def tamper(case, ckpt):
    state, groups = ckpt["optimizer"]["state"], ckpt["optimizer"]["param_groups"]
    {"inf exp_avg_sq": lambda: first(state[1]["exp_avg_sq"], float("inf")),
     "nan exp_avg_sq": lambda: first(state[1]["exp_avg_sq"], float("nan")),
     "negative exp_avg_sq": lambda: first(state[1]["exp_avg_sq"], -1e-3),
     "nan exp_avg": lambda: first(state[1]["exp_avg"], float("nan")),
     "inf exp_avg": lambda: first(state[1]["exp_avg"], -float("inf")),
     "one step behind": lambda: state[1].update(step=torch.tensor(1.0)),
     "step of two values": lambda: state[1].update(step=torch.tensor([2.0, 2.0])),
     "state[999]": lambda: state.update({999: copy.deepcopy(state[0])}),
     "lr a string": lambda: groups[0].update(lr="fast"),
     "betas of one": lambda: groups[1].update(betas=(0.9,)),
     "no eps": lambda: groups[0].pop("eps"),
     "group a string": lambda: groups.__setitem__(1, "group"),
     "index in two groups": lambda: groups[1]["params"].__setitem__(0, groups[0]["params"][0]),
     "index a string": lambda: groups[1]["params"].__setitem__(0, "a"),
     "name in two groups": lambda: groups[1]["param_names"].__setitem__(0, groups[0]["param_names"][0]),
     "param_groups a dict": lambda: ckpt["optimizer"].update(param_groups={"lr": 1e-3}),
     "nan weight": lambda: first(next(iter(ckpt["model"].values())), float("nan"))}[case]()

for case in json.loads(sys.argv[3]):
    ckpt = copy.deepcopy(good)
    tamper(case, ckpt)
    torch.save(ckpt, "state-" + case.replace(" ", "-") + ".pt")

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

# the tampered torch training states: what each refusal must say (a regex of its one error line)
TORCH_STATES = {
    "inf exp_avg_sq": r"state\[1\] \([\w.]+\) exp_avg_sq holds 1 inf value",
    "nan exp_avg_sq": r"state\[1\] \([\w.]+\) exp_avg_sq holds 1 NaN value",
    "negative exp_avg_sq": r"state\[1\] \([\w.]+\) exp_avg_sq holds 1 negative value",
    "nan exp_avg": r"state\[1\] \([\w.]+\) exp_avg holds 1 NaN value",
    "inf exp_avg": r"state\[1\] \([\w.]+\) exp_avg holds 1 inf value",
    "one step behind": r"the optimizer has taken 1 steps for state\[1\]",
    "step of two values": r"state\[1\] \([\w.]+\) step is a tensor of shape \(2,\)",
    "state[999]": r"state\[999\] is for no parameter",
    "lr a string": r"param_groups\[0\]\['lr'\] is 'fast'",
    "betas of one": r"param_groups\[1\]\['betas'\] is \(0.9,\)",
    "no eps": r"param_groups\[0\] has no 'eps'",
    "group a string": r"param_groups\[1\] is a str, not a parameter group",
    "index in two groups": r"params entry 0 is in param_groups\[0\] and param_groups\[1\]",
    "index a string": r"param_groups\[1\]\[\"params\"\] holds 'a', not a parameter index",
    "name in two groups": r"param_names entry '[\w.]+' is in param_groups\[0\] and param_groups\[1\]",
    "param_groups a dict": r"param_groups",
    "nan weight": r"\"model\" entry's [\w.]+ holds 1 NaN value",
}

# copies of the finished classify run with one optimizer moment poisoned in its last checkpoint
POISON_CODE = r"""
import shutil, sys
import jax
import numpy as np
from flax import nnx
sys.path.insert(0, sys.argv[1])
from flax_transformer.training.run_checkpoints import Checkpoints
from flax_transformer.training.torch_state.run_export import restore_run
from flax_transformer.training.torch_state.to_jax import _field_and_param

def poisoned(optimizer, field, value):
    hit = []
    def poison(path, leaf):
        name, _ = _field_and_param(path)
        if name == field and not hit and leaf.ndim:
            hit.append(name)
            return leaf.at[(0,) * leaf.ndim].set(value)
        return leaf
    pure = jax.tree_util.tree_map_with_path(poison, nnx.as_pure(optimizer.opt_state))
    nnx.update(optimizer.opt_state, nnx.state(pure))

for name, field, value in (("run-inf-nu", "nu", np.inf), ("run-nan-mu", "mu", np.nan), ("run-neg-nu", "nu", -1.0)):
    shutil.copytree("run", name)
    model, optimizer, _, step = restore_run(name)
    like = {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
    reader = Checkpoints(name, read_only=True)
    _, meta = reader.restore(step, like)
    reader.close()
    poisoned(optimizer, field, value)
    shutil.rmtree(f"{name}/checkpoints/{step}")
    writer = Checkpoints(name)
    writer.save(step, {"model": nnx.to_pure_dict(nnx.state(model)),
                       "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}, meta)
    writer.close()
print("poisoned runs done")
"""


def build_fixtures(fx: Path) -> None:
    steps = [("the fixtures", "code:" + FIXTURE_CODE,
              [str(REPO), json.dumps(CT_CONFIG), json.dumps(list(TORCH_STATES))]),
             ("the finished tiny run", "train.classify", ["--preset", "tiny", "--steps", "2", "--data-dir", "imdb-data",
                                                          "--out", "run", "--no-progress"]),
             ("the poisoned runs", "code:" + POISON_CODE, [str(REPO)])]
    for what, module, args in steps:
        call = run(fx, module, *args)
        if call.rc != 0:
            raise SystemExit(f"building {what} failed:\n{call.stderr}")


# ------------------------------------------------------------------ prepare and check helpers

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
