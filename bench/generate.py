"""Generation speed: JAX with and without the key/value cache, and the torch reference loop.

    python bench/generate.py [--new 256] [--prompt 32] [--batch 1 8] [--reps 3]

A small GPT (notebook 002's recommended size: 4 layers, d_embed 256, d_ff 1024, 4 heads,
10k vocabulary), greedy decoding. Each timing excludes compilation/warm-up (one
untimed run first) and reports the median of ``--reps`` runs (the slow uncached
variants run ``--slow-reps`` times). Prints new tokens per second per variant.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import torch
from benchlib import median_seconds

from flax_transformer import porting
from flax_transformer.generate import generate as flax_generate
from torch_reference.generate import generate as torch_generate
from torch_reference.gpt import GPTTransformer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--slow-reps", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPTTransformer(n_layers=4, d_embed=256, d_ff=1024, n_heads=4, voc_size=10_000,
                           max_length=args.prompt + args.new, dropout=0.0).eval()
    flax_model = porting.torch_to_flax(model)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); GPT 4x256, prompt {args.prompt}, {args.new} new tokens, greedy")
    print(f"{'batch':>5}  {'variant':<22} {'seconds':>9} {'new tokens/s':>13}")
    for b in args.batch:
        ids = np.random.default_rng(b).integers(0, 10_000, size=(b, args.prompt))
        jids, tids = jnp.asarray(ids), torch.from_numpy(ids)
        runs = {  # the lambdas bind this batch's inputs as defaults (they run within this iteration anyway)
            "jax, kv cache": (lambda jids=jids: np.asarray(flax_generate(flax_model, jids, args.new, greedy=True)),
                              args.reps),
            "jax, no cache": (lambda jids=jids: np.asarray(flax_generate(flax_model, jids, args.new, greedy=True,
                                                                         use_cache=False)), args.slow_reps),
            "torch loop (no cache)": (lambda tids=tids: torch_generate(model, tids, args.new, greedy=True),
                                      args.slow_reps),
        }
        results = {}
        for name, (fn, reps) in runs.items():
            seconds = median_seconds(fn, reps, warmup=1)  # one warm-up: compilation for JAX, allocator and kernels for torch
            results[name] = b * args.new / seconds
            print(f"{b:>5}  {name:<22} {seconds:>9.3f} {results[name]:>13.1f}", flush=True)
        cached = results["jax, kv cache"]
        print(f"{b:>5}  cache speed-up {cached / results['jax, no cache']:.1f}x over jax without cache, "
              f"{cached / results['torch loop (no cache)']:.1f}x over the torch loop")


if __name__ == "__main__":
    main()
