"""Generation speed: JAX with and without the key/value cache, the torch reference loop and transformers.generate.

    python bench/generate.py [--family gpt2|llama] [--new 256] [--prompt 32] [--batch 1 8] [--reps 5]
                             [--slow-reps 1] [--threads N] [--sweep] [--sweep-new 8] [--out DIR]

The model (``--family``): ``gpt2``, a random GPT-2 of notebook 002's recommended size (4 layers,
n_embd 256, inner 1024, 4 heads, 10k vocabulary), written as a transformers folder and read back
by ``flax_transformer.interop.hf`` (Flax and the torch_reference twin); ``llama``, a random
transformers ``LlamaForCausalLM`` of ``LlamaConfig.small``'s shape (4 layers, hidden 256, MLP 704,
4 query heads sharing 2 key/value heads, 10k vocabulary), its state_dict loaded strictly into
``torch_reference.llama`` and ported to Flax. Every contender runs the same weights on the same
prompt: greedy, ``--new`` new tokens, no eos (so transformers cannot stop early). Contenders:

  * jax, kv cache: ``flax_transformer.models.generate.generate`` (one compiled loop; llama:
    the grouped cache, key/value heads only);
  * transformers.generate: ``GPT2LMHeadModel.generate(do_sample=False)`` (``LlamaForCausalLM``'s)
    with its default key/value cache (``DynamicCache``);
  * jax, no cache and torch loop (no cache): rerun the whole prefix per token (``--slow-reps``
    rounds; 0 skips them).

Method (as ``bench/speed.py``): every contender runs once untimed (compilation for JAX,
allocator and kernels for torch), then rounds interleave the contenders, the order rotated each
round, Python's garbage collector off; reported: median, IQR, new tokens per second from the
median, and the per-round ratio to the JAX cached run. Both frameworks use ``--threads`` intra-op
threads (``NPROC`` for XLA's pool, ``torch.set_num_threads``), torch's OpenMP threads sleep when
idle (``OMP_WAIT_POLICY=PASSIVE``), and one malloc setting; fp32 matmuls at full precision.

``--sweep``: how many XLA compilations ``generate`` makes over batch sizes 1-8 and prompt
lengths 1-100 (``--sweep-new`` new tokens each), counted with ``generate.count_compiles``, with
its prompt buckets, and without them (``bucket=False``) on batch sizes 1-2 and prompts 1-8.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers
from benchlib import exec_with_env, interleaved_seconds, load_average, load_line, paired_ratio, record, spread
from speed import settings

import torch_reference.llama as tl
from flax_transformer.interop import hf, porting
from flax_transformer.models.generate import bucket_shape, count_compiles
from flax_transformer.models.generate import generate as flax_generate
from flax_transformer.models.input_specs import input_spec
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.training.malloc import keep_freed_memory
from torch_reference.generate import generate as torch_generate

VOCAB = 10_000
CACHED = "jax, kv cache"


def gpt2_folder(folder: Path, n_positions: int) -> transformers.GPT2LMHeadModel:
    """A random GPT-2 (4 x 256, inner 1024, 4 heads, 10k vocabulary) saved in ``folder``."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_inner=1024, n_head=4, vocab_size=VOCAB,
                                     n_positions=n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder)
    return model


def gpt2_models(n_positions: int):
    """(transformers GPT-2, Flax twin, torch_reference twin, a description), through one HF folder."""
    with tempfile.TemporaryDirectory() as folder:
        reference = gpt2_folder(Path(folder), n_positions)
        flax_model, torch_model = hf.from_pretrained(folder), hf.torch_from_pretrained(folder)
    described = f"GPT-2 4 x 256 (inner 1024, 4 heads, vocab {VOCAB}, {n_positions} positions)"
    return reference, flax_model, torch_model, described


def llama_models(n_positions: int):
    """(transformers LlamaForCausalLM of ``LlamaConfig.small``'s shape, Flax twin, torch_reference twin, a description).

    The state_dict goes through torch_reference (loaded strictly) and ``porting.torch_to_flax``."""
    torch.manual_seed(0)
    small = LlamaConfig.small()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=small.hidden_size, intermediate_size=small.intermediate_size,
        num_hidden_layers=small.num_hidden_layers, num_attention_heads=small.num_attention_heads,
        num_key_value_heads=small.num_key_value_heads, max_position_embeddings=n_positions,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    reference = transformers.LlamaForCausalLM(config).eval()
    torch_model = tl.LlamaForCausalLM(LlamaConfig.from_hf(config)).eval()
    torch_model.load_state_dict(reference.state_dict(), strict=True)
    return reference, porting.torch_to_flax(torch_model), torch_model, (
        f"Llama {small.num_hidden_layers} x {small.hidden_size} (MLP {small.intermediate_size}, "
        f"{small.num_attention_heads} query heads, {small.num_key_value_heads} key/value heads, vocab {VOCAB}, "
        f"{n_positions} positions)")


def speed(reference, flax_model, torch_model, args) -> None:
    print(f"\n| batch | variant | median s | IQR s | new tokens/s | time / ({CACHED}) time |")
    print("|---|---|---|---|---|---|")
    for b in args.batch:
        ids = np.random.default_rng(b).integers(0, VOCAB, size=(b, args.prompt))
        tids = torch.from_numpy(ids)

        def hf_generate(tids=tids):
            with torch.inference_mode():
                return reference.generate(tids, attention_mask=torch.ones_like(tids), do_sample=False,
                                          max_new_tokens=args.new, eos_token_id=None, pad_token_id=0)

        def jax_generate(use_cache, ids=ids):
            return np.asarray(flax_generate(flax_model, ids, args.new, greedy=True, use_cache=use_cache))

        ours, theirs = jax_generate(True), hf_generate().numpy()[:, args.prompt:]
        same = float((ours == theirs).mean())  # random weights: near ties may go either way after many steps
        groups = [({CACHED: lambda: jax_generate(True), "transformers.generate (kv cache)": hf_generate},
                   args.reps)]
        if args.slow_reps:
            groups.append(({"jax, no cache": lambda: jax_generate(False),
                            "torch loop (no cache)": lambda tids=tids: torch_generate(torch_model, tids, args.new,
                                                                                      greedy=True)},
                           args.slow_reps))
        times = {}
        for contenders, reps in groups:
            times.update(interleaved_seconds(contenders, reps, warmup=1))
        for name, seconds in times.items():
            s = spread(seconds)
            ratio = ""
            if name in groups[0][0] and name != CACHED:  # timed in the same rounds: paired ratios
                r = paired_ratio(seconds, times[CACHED])
                ratio = f"{r['median']:.2f}x [{r['p25']:.2f}-{r['p75']:.2f}]"
            elif name != CACHED:  # other rounds: a ratio of medians
                ratio = f"{s['median'] / spread(times[CACHED])['median']:.2f}x (medians)"
            print(f"| {b} | {name} | {s['median']:.3f} | {s['p25']:.3f}-{s['p75']:.3f} | "
                  f"{b * args.new / s['median']:,.0f} | {ratio} |", flush=True)
            if args.out is not None:
                record(args.out, dict(family=args.family, batch=b, variant=name, prompt=args.prompt, new=args.new,
                                      times_s=seconds, **s, load=load_average(), threads=args.threads), echo=False)
        print(f"| {b} | (tokens equal to transformers': {same:.1%}) | | | | |", flush=True)


def sweep(flax_model, args) -> None:
    """Compilations of ``generate`` over batch sizes 1-8 and prompt lengths 1-100, bucketed and exact."""
    rng = np.random.default_rng(0)

    def count(batches, lengths, bucket):
        start = time.perf_counter()
        with count_compiles() as compiles:
            for b in batches:
                for p in lengths:
                    ids = rng.integers(0, VOCAB, size=(b, p))
                    flax_generate(flax_model, ids, args.sweep_new, greedy=True, bucket=bucket).block_until_ready()
        return compiles.n, time.perf_counter() - start

    max_length = input_spec(flax_model).max_length
    buckets = {bucket_shape(b, p, args.sweep_new, max_length) for b in range(1, 9) for p in range(1, 101)}
    n, seconds = count(range(1, 9), range(1, 101), True)
    print(f"\ncompilations over batch 1-8 x prompt 1-100 ({args.sweep_new} new tokens), buckets on: {n} "
          f"for {len(buckets)} buckets {sorted(buckets)}, 800 calls in {seconds:.0f} s")
    n, seconds = count(range(1, 3), range(1, 9), False)
    print(f"bucket=False over batch 1-2 x prompt 1-8: {n} compilations for 16 shapes, 16 calls in {seconds:.0f} s")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["gpt2", "llama"], default="gpt2", help="the model (see above)")
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds of the cached contenders")
    parser.add_argument("--slow-reps", type=int, default=1, help="rounds of the uncached ones (0: skip them)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="intra-op threads for both torch and XLA (default: the cores available)")
    parser.add_argument("--sweep", action="store_true", help="count compilations over batch 1-8 x prompt 1-100")
    parser.add_argument("--sweep-new", type=int, default=8, help="new tokens per call of the sweep")
    parser.add_argument("--out", type=Path, help="also append each row to OUT/results.jsonl")
    args = parser.parse_args(argv)
    load_start = load_line("start")
    exec_with_env({"OMP_WAIT_POLICY": "PASSIVE", "NPROC": str(args.threads)}, os.path.abspath(__file__),
                  sys.argv[1:] if argv is None else list(argv))
    torch.set_num_threads(args.threads)
    kept = keep_freed_memory()
    jax.config.update("jax_default_matmul_precision", "highest")
    n_positions = max(args.prompt + args.new, 128 + args.sweep_new if args.sweep else 0)
    models = gpt2_models if args.family == "gpt2" else llama_models
    reference, flax_model, torch_model, described = models(n_positions)
    jax.block_until_ready(flax_model(np.zeros((1, 1), np.int32)))  # starts XLA's pool before settings counts it
    print(settings(kept, args.threads, "PASSIVE", load_start))
    print(f"{described}, prompt {args.prompt}, {args.new} new tokens, greedy; {args.reps} interleaved rounds "
          f"(uncached: {args.slow_reps})")
    if args.batch and args.reps:
        speed(reference, flax_model, torch_model, args)
    if args.sweep:
        sweep(flax_model, args)
    print("\n" + load_line("end", warn=False) + " (this run's own threads included)")


if __name__ == "__main__":
    main()
