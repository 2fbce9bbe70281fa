"""The decoding cache's bytes at a long context: sliding layers' rings against a full cache (issue 34).

    python bench/cache_memory.py [--length 8192]

For the released shapes of Gemma 2 2B, Gemma 3 4B and GPT-OSS 20B (their ``config.json`` fields, built
with transformers' config classes; no weights), the bytes of ``LlamaForCausalLM.init_cache(1, length)``
in bfloat16, read from its shapes (``nnx.eval_shape`` of the model, ``jax.eval_shape`` of the cache),
against the same config with its windows off (every layer caching ``length`` positions). A sliding
layer keeps ``ring_cache.ring_slots`` slots (W - 1 + min(W, 128)); a full layer ``length``.
DeepSeek-V3 671B (``DeepseekV3Config()``) has no window (ring = full): its row shows the latent cache's
size (kv_lora_rank + qk_rope_head_dim numbers a layer and token); ``bench/mla_decode.py bytes`` compares
it with transformers' and with an expanded cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import transformers
from flax import nnx

from flax_transformer.models.llama import LlamaForCausalLM
from flax_transformer.models.llama_config import LlamaConfig


def cache_bytes(config: LlamaConfig, length: int) -> tuple[int, list[int]]:
    """(bytes of a batch-1 bf16 cache of ``length`` positions, each layer's slots)."""
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    shapes = jax.eval_shape(lambda: model.init_cache(1, length))
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(shapes)), [c[0].shape[2] for c in shapes]


def models() -> dict[str, LlamaConfig]:
    """The released configs' shapes (GPT-OSS: ``GptOssConfig()``'s defaults are the 120b's, so 24 layers)."""
    return {name: LlamaConfig.from_hf(hf) for name, hf in {
        "Gemma 2 2B": transformers.Gemma2Config(
            vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, sliding_window=4096, query_pre_attn_scalar=256),
        "Gemma 3 4B": transformers.Gemma3TextConfig(
            vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, sliding_window=1024),
        "GPT-OSS 20B": transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32),
        # no window: every layer full, but latent (kv_lora_rank + qk_rope_head_dim a token; bench/mla_decode.py)
        "DeepSeek-V3 671B": transformers.DeepseekV3Config(),
    }.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192, help="cached positions (default 8192)")
    length = parser.parse_args(argv).length
    print("| model | slots (sliding / full layers) | ring cache | full cache | ring / full |\n|---|---|---|---|---|")
    for name, config in models().items():
        ring, slots = cache_bytes(config, length)
        full, _ = cache_bytes(dataclasses.replace(config, sliding_window=None, layer_types=None), length)
        sliding = min(slots)
        print(f"| {name} ({config.num_hidden_layers} layers, window {config.sliding_window}) | {sliding} / {length} | "
              f"{ring / 2**20:.1f} MiB | {full / 2**20:.1f} MiB | {ring / full:.3f} |")


if __name__ == "__main__":
    main()
