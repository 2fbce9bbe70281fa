"""``generation_bisect.bisect_generation`` against transformers: per-step figures of two correct ports.

    python bench/generation_bisect.py [--new 16]

A random GPT-2 (2 layers, width 32, vocabulary 97, ``initializer_range=0.5`` so that logits
spread over about +-10) and a random Llama (2 layers, width 32, 4 query heads on 2 key/value
heads, vocabulary 64, every weight perturbed by 0.5 x N(0, 1)), each a transformers model saved
with ``save_pretrained`` and read with ``hf.from_pretrained``. The torch side is transformers
itself (fp32 and a float64 copy; the cache compared is its ``past_key_values``), the JAX side our
cached decode. Prints a Markdown table per model: each step's torch fp32 and JAX errors against
float64, the budget, JAX's error as a fraction of it, fp64's top-2 margin; then the cache rows.
Under a minute on one core.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = [[5, 9, 17, 3, 11, 40, 8, 21]]  # 8 tokens, within both vocabularies


def _models(folder: Path):
    import torch
    import transformers

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=64, initializer_range=0.5, bos_token_id=1,
        eos_token_id=2)).eval()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():
        for p in llama.parameters():  # spread the logits, as parity_tests/cli/test_llama_cli.py
            p.add_(0.5 * torch.randn(p.shape))
    for name, model in (("gpt2", gpt2), ("llama", llama)):
        model.save_pretrained(folder / name)
        yield name, model, folder / name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=16, help="steps to decode (default 16)")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from flax_transformer.interop import hf
    from flax_transformer.verification.generation_bisect import bisect_generation

    with tempfile.TemporaryDirectory() as tmp:
        for name, torch_model, folder in _models(Path(tmp)):
            start = time.perf_counter()
            report = bisect_generation(torch_model, hf.from_pretrained(folder), PROMPT, args.new)
            seconds = time.perf_counter() - start
            print(f"\n{name}: {report.verdict()} ({seconds:.1f} s)\n")
            print("| step | torch fp32 err | JAX err | budget | JAX / budget | fp64 top-2 margin |")
            print("|---|---|---|---|---|---|")
            for r in report.steps:
                print(f"| {r.step} | {r.torch_err:.2e} | {r.jax_err:.2e} | {r.budget:.2e} | "
                      f"{r.jax_err / r.budget:.2f} | {r.margin:.2e} |")
            worst = max(report.steps, key=lambda r: r.jax_err / r.budget)
            print(f"\nlargest JAX / budget: {worst.jax_err / worst.budget:.2f} (step {worst.step}); cache at step "
                  f"{report.cache_step}: " + ", ".join(f"layer {c.layer} {c.jax_err:.1e} / {c.budget:.1e}"
                                                       for c in report.cache_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
