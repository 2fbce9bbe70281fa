"""torch_reference's forward under ``torch.compile``: this tree against an older revision, interleaved.

    python bench/compile_checks.py [--against REV] [--family former encoder gpt classic] [--reps 15]
                                   [--size speed|tiny] [--backend inductor] [--no-mask]
                                   [--omp-wait-policy passive|default]

Issue 21, item 4: the value checks of the forward pass (ids in range, masks of 0/1) read tensor
values on the host (``int(ids.max())``, ``if mask.all()``), a graph break in every compiled
model; they are now ``torch._assert_async`` under compile. This script measures what that
changes. It extracts ``torch_reference/`` as it was at ``--against`` (default ``HEAD``: commit
first, or name the commit before the change) with ``git show`` into a temporary package
``torch_reference_old`` (the package imports itself relatively, so both copies load side by side),
builds one model per family from each copy with the same weights, and for each prints:

* the graphs and graph breaks ``torch._dynamo.explain`` finds in each copy's forward;
* the forward time, eager and compiled, old and new, in ``--reps`` interleaved rounds (the
  order rotated each round, ``benchlib.interleaved_seconds``, after 3 untimed calls each, which
  include compilation), under ``torch.inference_mode()``: median (p25-p75) and the paired ratio
  new / old of the compiled calls.

The inputs carry an integer 0/1 padding mask (the checked case; ``--no-mask`` leaves it out).
Sizes (``--size speed``, the default): former and gpt are bench/speed.py's configs (a) and (b),
the encoder and the classic Transformer of the same order; ``--size tiny``: forwards of well
under a millisecond, where a graph break's per-call cost (guards, a return to Python, the host
read) is not lost in the compute. Compilation with inductor takes minutes on 2 cores; the old copy's extra
graphs compile too. fp32; torch's OpenMP threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE``,
as in bench/speed.py; the script restarts itself to set it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import exec_with_env, interleaved_seconds, load_line, paired_ratio, spread

ROOT = Path(__file__).resolve().parent.parent
OLD = "torch_reference_old"
POLICIES = {"passive": "PASSIVE", "default": None}


def _extract(rev: str, into: Path) -> str:
    """``torch_reference/*.py`` at ``rev`` -> ``into/torch_reference_old/``; returns the commit."""
    commit = subprocess.check_output(["git", "rev-parse", "--short", rev], cwd=ROOT, text=True).strip()
    names = subprocess.check_output(["git", "ls-tree", "--name-only", rev, "torch_reference/"], cwd=ROOT,
                                    text=True).split()
    package = into / OLD
    package.mkdir()
    for name in names:
        if name.endswith(".py"):
            source = subprocess.check_output(["git", "show", f"{rev}:{name}"], cwd=ROOT)
            (package / Path(name).name).write_bytes(source)
    return commit


def _families(size: str):
    """family -> (label, batch, length, vocab, build(package), args(ids, mask))."""
    from flax_transformer.models.configs import EncoderConfig

    if size == "tiny":  # a forward of well under a millisecond: the per-call overhead shows
        tiny = EncoderConfig.tiny(vocab_size=100, max_position_embeddings=16)
        return {
            "former": ("CTransformer emb32 h4 d2 len16 b2 V100", 2, 16, 100,
                       lambda p: p.former.CTransformer(32, 4, 2, 16, 100, 2), lambda ids, mask: (ids, mask)),
            "gpt": ("GPTTransformer d32 L2 h4 len16 b2 V100", 2, 16, 100,
                    lambda p: p.gpt.GPTTransformer(2, 32, 64, 4, 100, 16, dropout=0.0), lambda ids, mask: (ids, mask)),
            "encoder": ("TransformerEncoder EncoderConfig.tiny len16 b2 V100", 2, 16, 100,
                        lambda p: p.encoder.TransformerEncoder(tiny), lambda ids, mask: (ids, mask)),
            "classic": ("classic Transformer d32 1+1 blocks h4 len16 b2 V100", 2, 16, 100,
                        lambda p: p.classic.Transformer(100, 100, 32, 4, 1, 64, dropout=0.0, max_len=16),
                        lambda ids, mask: (ids, ids.flip(1), mask, mask)),
        }
    enc = EncoderConfig(vocab_size=30_522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=128, hidden_dropout_prob=0.0)
    return {
        "former": ("CTransformer emb128 h8 d3 len256 b4 V50k", 4, 256, 50_000,
                   lambda p: p.former.CTransformer(128, 8, 3, 256, 50_000, 2), lambda ids, mask: (ids, mask)),
        "gpt": ("GPTTransformer d256 L4 h4 len128 b16 V10k", 16, 128, 10_000,
                lambda p: p.gpt.GPTTransformer(4, 256, 1024, 4, 10_000, 128, dropout=0.0),
                lambda ids, mask: (ids, mask)),
        "encoder": ("TransformerEncoder d256 L4 h4 len128 b8 V30k", 8, 128, 30_522,
                    lambda p: p.encoder.TransformerEncoder(enc), lambda ids, mask: (ids, mask)),
        "classic": ("classic Transformer d256 2+2 blocks h4 len64 b8 V8k", 8, 64, 8_000,
                    lambda p: p.classic.Transformer(8_000, 8_000, 256, 4, 2, 1024, dropout=0.0, max_len=64),
                    lambda ids, mask: (ids, ids.flip(1), mask, mask)),
    }


def _import(package: str):
    import importlib
    import types

    return types.SimpleNamespace(**{name: importlib.import_module(f"{package}.{name}")
                                    for name in ("former", "encoder", "gpt", "classic")})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", default="HEAD", help="the git revision whose torch_reference/ is 'old'")
    parser.add_argument("--family", nargs="+", choices=["former", "encoder", "gpt", "classic"],
                        default=["former", "encoder", "gpt", "classic"])
    parser.add_argument("--reps", type=int, default=15, help="interleaved rounds after 3 untimed calls each")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--size", choices=["speed", "tiny"], default="speed",
                        help="speed: bench/speed.py's sizes (former, gpt) and kin; tiny: sub-millisecond forwards")
    parser.add_argument("--no-mask", action="store_true", help="call without the 0/1 padding mask")
    parser.add_argument("--omp-wait-policy", choices=list(POLICIES), default="passive")
    args = parser.parse_args(argv)
    exec_with_env({"OMP_WAIT_POLICY": POLICIES[args.omp_wait_policy]}, os.path.abspath(__file__),
                  sys.argv[1:] if argv is None else argv)
    print(load_line("start"))

    import torch
    import torch._dynamo

    sys.path.insert(0, str(ROOT))
    tmp = tempfile.TemporaryDirectory()
    commit = _extract(args.against, Path(tmp.name))
    sys.path.insert(0, tmp.name)
    new, old = _import("torch_reference"), _import(OLD)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, backend {args.backend}, old = torch_reference at "
          f"{commit}, new = this tree, mask {'no' if args.no_mask else 'int 0/1'}, size {args.size}, {args.reps} rounds")

    # the backend's one-time start-up (imports, caches), so that no model's first call pays it
    torch.compile(lambda x: (x * 2).sum(), backend=args.backend)(torch.ones(4))
    for family in args.family:
        label, b, t, vocab, build, call_args = _families(args.size)[family]
        torch.manual_seed(0)
        models = {"new": build(new).eval()}
        models["old"] = build(old).eval()
        models["old"].load_state_dict(models["new"].state_dict())
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (b, t), generator=gen)
        mask = None
        if not args.no_mask:
            mask = torch.ones(b, t, dtype=torch.long)
            mask[1::2, t // 2:] = 0  # every other row half padding
        inputs = call_args(ids, mask)

        graphs = {}
        for name, model in models.items():
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model)(*inputs)
            graphs[name] = (explained.graph_count, explained.graph_break_count)
        torch._dynamo.reset()

        contenders, compile_s = {}, {}
        with torch.inference_mode():
            reference = models["new"](*inputs)
            for name, model in models.items():
                compiled = torch.compile(model, backend=args.backend)
                start = time.perf_counter()
                out = compiled(*inputs)
                compile_s[name] = time.perf_counter() - start
                err = float((out - reference).abs().max())
                assert err < 1e-4, f"{family} {name}: compiled output differs from eager by {err:.3g}"
                contenders[f"eager {name}"] = lambda m=model, a=inputs: m(*a)
                contenders[f"compiled {name}"] = lambda c=compiled, a=inputs: c(*a)
            times = interleaved_seconds(contenders, args.reps)

        print(f"\n{family}: {label}")
        for name in ("old", "new"):
            print(f"  {name}: {graphs[name][0]} graph(s), {graphs[name][1]} graph break(s); "
                  f"first compiled call {compile_s[name]:.1f} s")
        for name, values in times.items():
            s = spread(values)
            print(f"  {name:13s} {s['median'] * 1e3:9.3f} ms ({s['p25'] * 1e3:.3f}-{s['p75'] * 1e3:.3f}), "
                  f"min {s['min'] * 1e3:.3f}")
        for kind in ("compiled", "eager"):
            r = paired_ratio(times[f"{kind} new"], times[f"{kind} old"])
            print(f"  {kind} new / old: {r['median']:.3f}x [{r['p25']:.3f}-{r['p75']:.3f}]")
        print("  " + load_line("end of " + family, warn=False))
    tmp.cleanup()


if __name__ == "__main__":
    main()
