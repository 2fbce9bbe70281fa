"""The GPU check (issue 37 item 4): bf16 train steps, greedy decoding and a trace bisect on one CUDA card.

    python bench/gpu.py [--device auto|cuda|cpu] [--rounds 2] [--steps 10] [--only train|decode|bisect]
                        [--budget SECONDS] [--json OUT]

What runs (``--device cuda``; the shapes are ``SHAPES``, the work per device ``PRESETS``):

* train: the train step of a GPT-2-small-shaped model (12 x 768, vocab 50257, batch 8 x 1024
  tokens) and of Llama-3.2-1B's shape (16 x 2048, 32 query / 8 key-value heads, MLP 8192, vocab
  128256, tied head; batch 4 x 2048), bf16 parameters and compute on both sides, in JAX (jitted,
  state donated; attention ``set_attention(model, "cudnn")``, or "xla" when cuDNN's kernel does not
  compile for the model, said), transformers eager (its default ``sdpa`` attention) and
  ``torch.compile`` of the same transformers model. The step: next-token cross-entropy on fp32
  logits, gradients, clip to norm 1, AdamW (lr 1e-4, weight decay 0.01). Reported: tokens/s and MFU.
* decode: greedy decoding of the Llama-3.2-1B-shaped model, batch 1, a 128-token prompt, 128 new
  tokens, no eos: ``flax_transformer.models.generate.generate`` (its key/value cache: key/value
  heads only, allocated once for the prompt's bucket plus the new tokens, one compiled loop) against
  ``transformers.generate(do_sample=False)`` (its default cache, ``DynamicCache``, grown per token;
  the class used is read back and printed). New tokens/s = batch x new tokens / the wall time of a
  whole call, the prompt's prefill included; the tokens equal to JAX's are counted (bf16 near ties
  may part after a while).
* bisect: a bf16 JAX model against a float64 reference recorded elsewhere: one process on the CPU
  records the trace of the torch twin (``flax_transformer.verification.trace.record``, float64 and
  bf16 runs), another on the card bisects the JAX model against that file (``bisect(trace_path,
  flax_model)``), with no torch imported (checked). The model: Llama-3.2-1B's shape cut to 4 layers,
  one sequence of 64 tokens; bf16-exact weights, so both sides hold the same numbers. Printed: the
  first divergent module and the budget there (bf16's rule, ``verification/precision.py``).

How it measures (the project's benchmark rule, as ``bench/speed_isolated.py``): each framework's
contender runs alone in a process of its own, started with the thread settings stripped from the
environment (each framework's own defaults); the processes alternate round by round, the order
rotated each round; per process ``warmup`` untimed calls then ``--steps`` timed ones (garbage
collector off). Reported per contender: median, IQR and min over all timed calls of all rounds, and
the per-round ratio of each torch process's median to JAX's of the same round. Rounds are the
outer loop over the sections (bisect once, decode, train: the short ones first), so that
``--budget`` (stop starting processes after that many seconds, a running one killed then) falls on
the last rounds of the train step. JAX's compilation cache and inductor's are kept in a temporary folder across rounds.

FLOPs per token of a train step (``flops_per_token``; the same number for every contender)::

    6 * N + 12 * L * T * H * d_h
    N  = the weights of the matmuls: per layer q (D x H d_h), k and v (D x K d_h each), o (H d_h x D),
         the MLP (2 D I for GPT-2, 3 D I for a gated MLP), and the head D x V (tied or not); not the
         input embeddings, norms or biases
    12 L T H d_h: q k^T and the weights times v, 2 x 2 T H d_h per layer forward, x 3 for the train
         step; the full T x T scores, as PaLM's MFU counts them (a causal kernel skips about half)

GPT-2 small at T = 1024: N = 123,532,032, 6N = 741.2 MFLOP and attention 113.2 MFLOP per token.
Llama-3.2-1B at T = 2048: N = 1,235,746,816, 6N = 7,414.5 MFLOP and attention 805.3 MFLOP.
MFU = tokens/s x FLOPs per token / the card's peak dense bf16 FLOP/s (``PEAK_BF16_TFLOPS``, from
the device's name; an unknown card's MFU is "unknown peak"). Also given: the fraction of the bf16
matmul peak measured in each process (8192^3 on the card), the median over processes.

Without a GPU (``--device auto`` on such a machine, or ``--device cpu``) the smallest shapes run on
the CPU (``PRESETS["cpu"]``), so that the tests keep the script working: CPU smoke figures, not GPU
ones, and the output says so; there ``torch.compile`` uses the ``aot_eager`` backend (traced, no
code generated), to keep the smoke run short, and its rows say so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import cores, cpu_model, load_line, paired_ratio, spread
from speed_isolated import _environment

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # flax_transformer where it is not installed (the device's own Python)

from flax_transformer.interop import files  # noqa: E402  (pure Python)

JAX, EAGER, COMPILE = "jax", "torch eager", "torch.compile"
CONTENDERS = (JAX, EAGER, COMPILE)
RESULT = "GPU_BENCH_RESULT "  # a worker's line on stdout
SMOKE_NOTE = "CPU smoke figures, not GPU ones: the smallest shapes on this machine's CPU"

# every shape: L layers, D hidden, H query heads, K key/value heads, d_h head width, I MLP width,
# V vocabulary, mlp matrices (2: GPT-2's fc and proj; 3: a gated MLP's gate, up, down)
SHAPES = {
    "gpt2-small": dict(family="gpt2", layers=12, hidden=768, heads=12, kv_heads=12, head_dim=64, inner=3072,
                       vocab=50257, mlp_matrices=2, positions=1024),
    "llama-1b": dict(family="llama", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, inner=8192,
                     vocab=128256, mlp_matrices=3, positions=131072, llama3=True),  # Llama-3.2-1B
    "gpt2-tiny": dict(family="gpt2", layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16, inner=256, vocab=512,
                      mlp_matrices=2, positions=128),
    "llama-tiny": dict(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, inner=128, vocab=512,
                       mlp_matrices=3, positions=128),
}
PRESETS = {
    "cuda": dict(train=(("gpt2-small", 8, 1024), ("llama-1b", 4, 2048)), warmup=3, steps=10, rounds=2,
                 decode=dict(model="llama-1b", batch=1, prompt=128, new=128, reps=3, warmup=1),
                 bisect=dict(model="llama-1b", layers=4, batch=1, seq=64), peak_n=8192, compile_backend="inductor"),
    "cpu": dict(train=(("gpt2-tiny", 2, 32), ("llama-tiny", 2, 32)), warmup=1, steps=3, rounds=2,
                decode=dict(model="llama-tiny", batch=1, prompt=8, new=8, reps=2, warmup=1),
                bisect=dict(model="llama-tiny", layers=2, batch=1, seq=16), peak_n=512, compile_backend="aot_eager"),
}
# peak dense bf16 tensor-core TFLOP/s (no sparsity) by the device's name, the vendor's data sheets;
# the first pattern found in the name wins, so the more specific come first
PEAK_BF16_TFLOPS = (
    (r"GH200", 989.4), (r"H200 NVL", 835.5), (r"H200", 989.4), (r"H100 NVL", 835.5), (r"H100 PCIe", 756.0),
    (r"H100", 989.4), (r"H800", 989.4), (r"B200", 2250.0), (r"A100", 312.0), (r"A800", 312.0),
    (r"L40S", 362.1), (r"L40\b", 181.0), (r"\bL4\b", 121.0), (r"A10G", 70.0), (r"\bA10\b", 125.0),
    (r"RTX 4090", 165.2), (r"A6000", 154.8),
)


def flops_per_token(shape: dict, seq: int) -> dict:
    """A train step's FLOPs per token of ``shape`` at sequence length ``seq`` (the docstring's formula)."""
    d, hd = shape["hidden"], shape["head_dim"]
    layer = d * shape["heads"] * hd * 2 + d * shape["kv_heads"] * hd * 2 + shape["mlp_matrices"] * d * shape["inner"]
    n = shape["layers"] * layer + d * shape["vocab"]
    attention = 12 * shape["layers"] * seq * shape["heads"] * hd
    return dict(matmul_weights=n, weights_term=6 * n, attention_term=attention, total=6 * n + attention)


def peak_tflops(device_name: str) -> float | None:
    """The card's peak dense bf16 TFLOP/s from ``PEAK_BF16_TFLOPS``; None for a device not in it."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def llama_config(name: str, layers: int | None = None):
    """``LlamaConfig`` of a llama shape (``llama-1b``: ``LlamaConfig.llama3_1b``, its RoPE scaling included)."""
    from flax_transformer.models.llama_config import LlamaConfig

    s = SHAPES[name]
    sizes = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inner"],
                 num_hidden_layers=layers or s["layers"], num_attention_heads=s["heads"],
                 num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], max_position_embeddings=s["positions"],
                 tie_word_embeddings=True)
    return LlamaConfig.llama3_1b(**sizes) if s.get("llama3") else LlamaConfig(**sizes)


def write_folder(name: str, folder: Path, layers: int | None = None) -> None:
    """A random transformers model of shape ``name`` (``torch.manual_seed(0)``), saved in bf16 in ``folder``."""
    import torch
    import transformers

    s = SHAPES[name]
    torch.manual_seed(0)
    if s["family"] == "gpt2":
        config = transformers.GPT2Config(n_layer=layers or s["layers"], n_embd=s["hidden"], n_head=s["heads"],
                                         n_inner=s["inner"], vocab_size=s["vocab"], n_positions=s["positions"],
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0, pad_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        hf = dict(llama_config(name, layers).to_hf_dict(), bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
    model.to(torch.bfloat16).save_pretrained(folder)


# ----------------------------------------------------------------------------- processes


def _spawn(task: dict, env: dict, deadline: float | None) -> dict:
    """Run one worker (``gpu_workers.py``) in a process of its own; its result, or {"failed": why}."""
    timeout = None if deadline is None else deadline - time.monotonic()
    if timeout is not None and timeout <= 0:
        return dict(task, skipped="not run: --budget spent")
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_workers.py"), json.dumps(task)], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its compiler's workers go with it when it is killed
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return dict(task, failed="killed: --budget spent while it ran")
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT):
            return dict(task, **json.loads(line[len(RESULT):]))
    tail = [line for line in (out + err).splitlines() if line.strip()][-12:]
    return dict(task, failed=f"exited {proc.returncode} without a result: " + " | ".join(tail))


def _rotated(items, r: int) -> list:
    return list(items[r % len(items):]) + list(items[:r % len(items)])


def _say(res: dict) -> None:
    what = res["section"] + " " + " ".join(str(res[k]) for k in ("model", "contender") if k in res)
    if "failed" in res or "skipped" in res:
        print(f"round {res.get('round', 0) + 1} {what}: {res.get('failed') or res.get('skipped')}", flush=True)
    elif "times" in res:
        print(f"round {res['round'] + 1} {what}: median {statistics.median(res['times']) * 1e3:,.1f} ms "
              f"[process {res['wall_s']:.0f} s]", flush=True)
    else:
        print(f"{what}: done [process {res['wall_s']:.0f} s]", flush=True)


def run(args, device: str) -> dict:
    """Every process of the run, in order; the results by section, written to ``--json`` as they come."""
    preset = PRESETS[device]
    env, stripped = _environment()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    if device == "cpu":
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    sections = [args.only] if args.only else ["train", "decode", "bisect"]
    deadline = None if args.budget is None else time.monotonic() + args.budget
    out = dict(device=device, smoke=device == "cpu", note=SMOKE_NOTE if device == "cpu" else "",
               machine=f"{cpu_model()}, {cores()} cores", stripped_env=stripped, load_start=load_line("start"),
               settings=dict(rounds=args.rounds, steps=args.steps, warmup=preset["warmup"], budget=args.budget),
               results=[])
    print(out["load_start"])
    if out["note"]:
        print(f"NOTE: {SMOKE_NOTE}")
    print(f"stripped from the workers' environment: {', '.join(stripped) or 'nothing (none was set)'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env.update(JAX_COMPILATION_CACHE_DIR=str(tmp / "jax_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"))
        names = ({m for m, _, _ in preset["train"]} if "train" in sections else set()) | (
            {preset["decode"]["model"]} if "decode" in sections else set())
        for name in sorted(names):
            write_folder(name, tmp / name)
        b = preset["bisect"]
        if "bisect" in sections:
            write_folder(b["model"], tmp / "bisect", layers=b["layers"])

        def add(res):
            out["results"].append(res)
            _say(res)
            if args.json is not None:
                files.write_text(args.json, json.dumps(out, indent=1), overwrite=True)

        common = dict(device=device, warmup=preset["warmup"], peak_n=preset["peak_n"],
                      compile_backend=preset["compile_backend"])
        for r in range(args.rounds):  # the short sections first: a --budget cut falls on the train step's rounds
            if "bisect" in sections and r == 0:
                task = dict(section="bisect", round=0, model=b["model"], layers=b["layers"], batch=b["batch"],
                            seq=b["seq"], shape=SHAPES[b["model"]], folder=str(tmp / "bisect"),
                            trace=str(tmp / "trace"))
                cpu_env = dict(env, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")  # the reference: CPU, float64
                recorded = _spawn(dict(task, contender="record (CPU)", device="cpu"), cpu_env, deadline)
                add(recorded)
                if "failed" not in recorded and "skipped" not in recorded:
                    add(_spawn(dict(task, contender=f"bisect ({device})", device=device), env, deadline))
            if "decode" in sections:
                d = preset["decode"]
                for contender in _rotated((JAX, "transformers"), r):
                    add(_spawn(dict(common, section="decode", round=r, contender=contender, shape=SHAPES[d["model"]],
                                    folder=str(tmp / d["model"]), **d), env, deadline))
            for model, batch, seq in preset["train"] if "train" in sections else ():
                for contender in _rotated(CONTENDERS, r):
                    add(_spawn(dict(common, section="train", round=r, model=model, contender=contender,
                                    shape=SHAPES[model], batch=batch, seq=seq, steps=args.steps,
                                    folder=str(tmp / model)), env, deadline))
    out["load_end"] = load_line("end", warn=False)
    return out


# ----------------------------------------------------------------------------- the report


def _ratio(rows: list[dict], contender: str) -> dict | None:
    """``paired_ratio`` of this contender's per-round median time over JAX's, the rounds both ran."""
    mine = {r["round"]: statistics.median(r["times"]) for r in rows if r["contender"] == contender}
    jax = {r["round"]: statistics.median(r["times"]) for r in rows if r["contender"] == JAX}
    common = sorted(set(mine) & set(jax))
    return paired_ratio([mine[i] for i in common], [jax[i] for i in common]) if common else None


def _peak(results: list[dict]) -> tuple[float | None, str]:
    names = sorted({r["device_name"] for r in results if "device_name" in r})
    for name in names:
        tflops = peak_tflops(name)
        if tflops is not None:
            return tflops * 1e12, f"{name}: {tflops:g} TFLOP/s dense bf16 (PEAK_BF16_TFLOPS)"
    return None, f"unknown peak ({', '.join(names) or 'no device'} is not in PEAK_BF16_TFLOPS): MFU not given"


def summarize(out: dict) -> dict:
    """The train, decode and bisect sections (rows of numbers) from the processes' results."""
    ok = [r for r in out["results"] if "times" in r]
    peak, peak_note = _peak(ok)
    train = []
    for model in dict.fromkeys(r["model"] for r in ok if r["section"] == "train"):
        rows = [r for r in ok if r["section"] == "train" and r["model"] == model]
        measured = max(statistics.median(r["peak_flops"] for r in rows if (r["contender"] == JAX) == jax)
                       for jax in (True, False) if any((r["contender"] == JAX) == jax for r in rows))
        for contender in CONTENDERS:
            mine = [r for r in rows if r["contender"] == contender]
            if not mine:
                continue
            s = spread([t for r in mine for t in r["times"]])
            tokens = mine[0]["batch"] * mine[0]["seq"]
            flops = flops_per_token(mine[0]["shape"], mine[0]["seq"])
            rate = tokens / s["median"]
            train.append(dict(model=model, contender=contender, attention=mine[0]["attention"], tokens_per_step=tokens,
                              time_s=s, tokens_per_s=rate, flops_per_token=flops["total"],
                              mfu=None if peak is None else rate * flops["total"] / peak,
                              of_measured_peak=rate * flops["total"] / measured, measured_peak_flops=measured,
                              first_loss=mine[0]["first_loss"], first_call_s=mine[0]["first_call_s"],
                              time_over_jax=None if contender == JAX else _ratio(rows, contender)))
    decode = []
    rows = [r for r in ok if r["section"] == "decode"]
    jax_tokens = next((r["tokens"] for r in rows if r["contender"] == JAX), None)
    for contender in dict.fromkeys(r["contender"] for r in rows):
        mine = [r for r in rows if r["contender"] == contender]
        s = spread([t for r in mine for t in r["times"]])
        first = mine[0]
        same = None if jax_tokens is None else sum(
            a == b for ra, rb in zip(first["tokens"], jax_tokens) for a, b in zip(ra, rb)) / (first["batch"] * first["new"])
        decode.append(dict(model=first["model"], contender=contender, cache=first["cache"], batch=first["batch"],
                           prompt=first["prompt"], new=first["new"], time_s=s,
                           new_tokens_per_s=first["batch"] * first["new"] / s["median"],
                           time_over_jax=None if contender == JAX else _ratio(rows, contender),
                           tokens_equal_to_jax=same))
    done = [r for r in out["results"] if r["section"] == "bisect" and "report" in r]
    recorded = [r for r in out["results"] if r["section"] == "bisect" and "trace_bytes" in r]
    bisect = (dict(**done[0]["report"], record_s=recorded[0]["wall_s"], trace_bytes=recorded[0]["trace_bytes"],
                   bisect_s=done[0]["wall_s"]) if done else None)
    failed = [f"{r['section']} {r.get('model', '')} {r.get('contender', '')} round {r.get('round', 0) + 1}: "
              f"{r.get('failed') or r.get('skipped')}" for r in out["results"] if "failed" in r or "skipped" in r]
    return dict(peak_flops=peak, peak_note=peak_note, train=train, decode=decode, bisect=bisect, failed=failed)


def _cells(s: dict) -> str:
    return f"{s['median'] * 1e3:,.1f} | {s['p25'] * 1e3:,.1f}-{s['p75'] * 1e3:,.1f} | {s['min'] * 1e3:,.1f}"


def _table(head: str, rows: list[str]) -> list[str]:
    """A markdown table: a blank line, the header, its rule, the rows."""
    return ["", f"| {head} |", "|" + "---|" * (head.count("|") + 1), *rows]


def _r(x: dict | None) -> str:
    return "" if x is None else f"{x['median']:.2f}x [{x['p25']:.2f}-{x['p75']:.2f}]"


def report(out: dict, summary: dict) -> str:
    """The tables and lines the script prints."""
    lines = [f"NOTE: {SMOKE_NOTE}"] if out["smoke"] else []
    if summary["train"]:
        lines.append(f"peak: {summary['peak_note']}")
        lines += _table("model | contender | attention | tokens/step | median ms | IQR ms | min ms | tokens/s | MFU | "
                        "of measured bf16 matmul peak | time / JAX time per round", [
            f"| {row['model']} | {row['contender']} | {row['attention']} | {row['tokens_per_step']:,} | "
            f"{_cells(row['time_s'])} | {row['tokens_per_s']:,.0f} | "
            f"{'unknown peak' if row['mfu'] is None else format(row['mfu'], '.1%')} | "
            f"{row['of_measured_peak']:.1%} | {_r(row['time_over_jax'])} |" for row in summary["train"]])
        lines.append("FLOPs per token: 6 N + 12 L T H d_h (bench/gpu.py's docstring): "
                     + "; ".join(f"{m} {flops_per_token(SHAPES[m], t)['total'] / 1e6:,.1f} MFLOP (T = {t})"
                                 for m, _, t in PRESETS[out["device"]]["train"]))
        lines.append("first train-step loss, same weights and batch: " + ", ".join(
            f"{row['model']} {row['contender']} {row['first_loss']:.4f}" for row in summary["train"]))
    if summary["decode"]:
        lines += _table("model | contender | cache | batch | prompt | new | median ms | IQR ms | min ms | new tokens/s | "
                        "time / JAX time per round | tokens equal to JAX's", [
            f"| {row['model']} | {row['contender']} | {row['cache']} | {row['batch']} | {row['prompt']} | {row['new']} | "
            f"{_cells(row['time_s'])} | {row['new_tokens_per_s']:,.1f} | {_r(row['time_over_jax'])} | "
            f"{'' if row['tokens_equal_to_jax'] is None else format(row['tokens_equal_to_jax'], '.0%')} |"
            for row in summary["decode"]])
    b = summary["bisect"]
    if b is not None:
        where = b["first_divergent"] or "none (every module within its budget)"
        lines += ["", f"trace bisect ({b['what']}): first divergent module: {where}; {b['budget_line']}; "
                      f"torch imported in the bisecting process: {b['torch_imported']}; trace {b['trace_bytes']:,} "
                      f"bytes, recorded in {b['record_s']:.0f} s (CPU), bisected in {b['bisect_s']:.0f} s "
                      f"({out['device']})"]
    for line in summary["failed"]:
        lines.append(f"NOT MEASURED: {line}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, argparse's wording, exit 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _positive(kind):
    def read(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return read


def parse(argv=None) -> argparse.Namespace:
    p = _Parser(prog="gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda where torch sees a GPU, else the CPU smoke run")
    p.add_argument("--rounds", type=_positive(int), default=None, help="rounds (default: the device's preset, 2)")
    p.add_argument("--steps", type=_positive(int), default=None,
                   help="timed train steps per process (default 10 on the card, 3 on the CPU)")
    p.add_argument("--only", choices=("train", "decode", "bisect"), default=None, help="one section alone")
    p.add_argument("--budget", type=_positive(float), default=None, metavar="SECONDS",
                   help="start no process after this many seconds, kill a running one then")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.json is not None:
        try:
            files.check_target(args.json, overwrite=True)
        except files.OutputError as exc:
            p.error(f"--json: {exc}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = args.device
    if device != "cpu":
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            sys.stderr.write("gpu.py: error: --device cuda, but torch sees no CUDA device (use --device cpu)\n")
            return 2
        device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = PRESETS[device]
    args.rounds = args.rounds or preset["rounds"]
    args.steps = args.steps or preset["steps"]
    out = run(args, device)
    summary = summarize(out)
    out.update(summary)
    text = report(out, summary)
    print("\n" + text + "\n" + out["load_end"])
    if args.json is not None:
        files.write_text(args.json, json.dumps(out, indent=1), overwrite=True)
    return 1 if summary["failed"] and not all("--budget" in f for f in summary["failed"]) else 0


if __name__ == "__main__":
    sys.exit(main())
