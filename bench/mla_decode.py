"""DeepSeek-V3's latent cache: its bytes per token against transformers', and the decode speed of its two ways.

    python bench/mla_decode.py bytes
    python bench/mla_decode.py speed [--lengths 256 1024 4096] [--rounds 5] [--torch-rounds 3]

``bytes``, for DeepSeek-V3 671B (``DeepseekV3Config()``'s defaults: 61 layers, 128 heads, kv_lora_rank
512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128), DeepSeek-V2-Lite's attention shapes
(27 layers, 16 heads, no q_lora_rank) and the tiny config of parity_tests/models/test_deepseek_generate.py,
each at bfloat16 (2 bytes a number), batch 1:

* ours: ``LlamaForCausalLM.init_cache(1, length)``'s arrays (``jax.eval_shape``: shapes only) / length;
* transformers 5.24: the ``DynamicCache`` a real forward of 8 tokens fills (a bf16
  ``DeepseekV3ForCausalLM``), its tensors' bytes / 8; 5.24 caches the normalised latent and the RoPE key
  too (``cache.update(kv_nope, k_rot)`` before ``expand_kv``). For the two large configs the model
  built has the config's attention (ranks, heads, dims) but one layer, width 64 and vocabulary 256 (none of
  which the cache's shape depends on), and the bytes of that one layer are multiplied by the layers; the
  tiny config is measured whole;
* an expanded cache, what transformers 4.x (checked in 4.57.6's modeling_deepseek_v3.py:
  ``past_key_values.update(key_states, value_states)`` after ``kv_b_proj``) held: per layer and token
  heads x (qk_nope_head_dim + qk_rope_head_dim) keys and heads x v_head_dim values (computed from the
  config: 4.x is not installed here).

``speed``: a reduced config of DeepSeek-V3's attention shapes (hidden 7168, 128 heads, q_lora_rank 1536,
kv_lora_rank 512, dims 128/64/128; 2 layers: a dense one (intermediate 2048) and a sparse one of 8 experts
of 256 in 4 groups, 2 groups, 2 a token, one shared; vocabulary 1024), float32, random weights. For each
context length L: a cache of L + 1 slots whose first L hold random latents and RoPE keys (the speed does
not depend on their values), and one jitted ``decode_step`` of one token at position L, the
``"absorbed"`` and ``"expanded"`` programs timed in alternated rounds (``benchlib.interleaved_seconds``):
median, quartiles, min and max, and the per-round ratio expanded / absorbed. Then, in its own process
(``speed --torch``), transformers' ``DeepseekV3ForCausalLM`` (eager attention) of the same config, one
token at position L after a ``DynamicCache`` of L random entries (cropped back to L after each step).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchlib import cores, interleaved_seconds, load_line, paired_ratio, spread

FEW = 8  # tokens of the forward that fills transformers' cache


def deepseek_configs():
    """name -> (transformers config, whether its model is built whole (else one layer, width 64, vocab 256))."""
    import transformers

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
                num_experts_per_tok=3, first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=12,
                qk_nope_head_dim=6, v_head_dim=5, q_lora_rank=16, qk_rope_head_dim=4)
    lite = dict(num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    return {"DeepSeek-V3 671B": (transformers.DeepseekV3Config(), False),
            "DeepSeek-V2-Lite's attention": (transformers.DeepseekV3Config(**lite), False),
            "tiny (test_deepseek_generate)": (transformers.DeepseekV3Config(**tiny), True)}


def transformers_cache_bytes(config, whole: bool) -> tuple[float, str]:
    """(bytes a token of transformers' DynamicCache after a bf16 forward of FEW tokens, what it holds)."""
    import torch
    import transformers

    config = config.__class__(**{**config.to_dict(), **({} if whole else dict(
        num_hidden_layers=1, first_k_dense_replace=1, hidden_size=64, intermediate_size=64, vocab_size=256))})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        out = model(torch.randint(0, config.vocab_size, (1, FEW)), use_cache=True)
    layers = out.cache.layers
    held = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    shapes = f"{tuple(layers[0].keys.shape)} + {tuple(layers[0].values.shape)} {layers[0].keys.dtype}"
    return held / FEW, shapes


def bytes_table(length: int = 4096) -> None:
    import jax.numpy as jnp
    from cache_memory import cache_bytes  # bench/cache_memory.py: init_cache's bytes from its shapes

    from flax_transformer.models.llama_config import LlamaConfig

    print("| config | ours (init_cache) | transformers 5.24 (DynamicCache) | expanded keys + values (transformers 4.x) "
          "| expanded / ours |\n|---|---|---|---|---|")
    for name, (hf, whole) in deepseek_configs().items():
        ours_config = LlamaConfig.from_hf(hf)
        ours = cache_bytes(ours_config, length)[0] / length  # bf16, batch 1
        layer_tokens, shapes = transformers_cache_bytes(hf, whole)
        theirs = layer_tokens * (1 if whole else hf.num_hidden_layers)
        per_layer = hf.num_attention_heads * (hf.qk_nope_head_dim + hf.qk_rope_head_dim + hf.v_head_dim)
        expanded = hf.num_hidden_layers * per_layer * jnp.dtype(jnp.bfloat16).itemsize
        stated = hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 2
        assert ours == stated, f"{name}: init_cache holds {ours} bytes a token, not layers x (r + rope) x 2 = {stated}"
        print(f"| {name} ({hf.num_hidden_layers} layers, {hf.num_attention_heads} heads, r {hf.kv_lora_rank} + "
              f"rope {hf.qk_rope_head_dim}) | {ours:,.0f} B | {theirs:,.0f} B (a layer: {shapes}"
              f"{'' if whole else ', one layer measured'}) | {expanded:,} B | {expanded / ours:.1f}x |")


def speed_config(layers: int = 2):
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=1024, num_hidden_layers=layers, first_k_dense_replace=1, intermediate_size=2048,
        moe_intermediate_size=256, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        n_shared_experts=1, max_position_embeddings=8192)


def jax_speed(lengths, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from flax_transformer.models.llama import LlamaForCausalLM
    from flax_transformer.models.llama_config import LlamaConfig
    from flax_transformer.models.mla import set_mla_decode

    model = LlamaForCausalLM(LlamaConfig.from_hf(speed_config()), rngs=nnx.Rngs(0))
    graphs = {}
    for decode in ("absorbed", "expanded"):
        set_mla_decode(model, decode)
        graphs[decode], state = nnx.split(model)  # one state, two programs: only the static attribute differs
    del model
    rng = np.random.default_rng(0)
    results, token = {}, jnp.asarray([[7]])
    for length in lengths:
        cache = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape).astype(np.float32)),
                             nnx.merge(graphs["absorbed"], state).init_cache(1, length + 1))
        steps = {}
        for decode, graph in graphs.items():
            step = jax.jit(lambda state, token, cache, graph=graph, at=length: nnx.merge(graph, state).decode_step(
                token, at, cache)[0])
            steps[decode] = lambda step=step, cache=cache: jax.block_until_ready(step(state, token, cache))
        outs = {decode: np.asarray(fn()) for decode, fn in steps.items()}
        gap = float(np.abs(outs["absorbed"] - outs["expanded"]).max())
        times = interleaved_seconds(steps, rounds, warmup=2)
        results[length] = dict({d: spread(t) for d, t in times.items()},
                               ratio=paired_ratio(times["expanded"], times["absorbed"]), logits_gap=gap)
        print(json.dumps({"context": length, **results[length]}), flush=True)
    return results


def torch_speed(lengths, rounds: int) -> dict:
    import torch
    import transformers
    from transformers.cache_utils import DynamicCache

    config = speed_config()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    results = {}
    for length in lengths:
        cache = DynamicCache(config=config)
        for i in range(config.num_hidden_layers):
            cache.update(torch.randn(1, 1, length, config.kv_lora_rank), torch.randn(1, 1, length,
                                                                                    config.qk_rope_head_dim), i)

        def step(cache=cache, at=length):
            with torch.no_grad():
                model(torch.tensor([[7]]), position_ids=torch.tensor([[at]]), cache=cache, use_cache=True)
            cache.crop(-1)  # back to `at` entries (5.24: a negative count removes tokens)

        times = interleaved_seconds({"transformers": step}, rounds, warmup=1)["transformers"]
        results[length] = spread(times)
        print(json.dumps({"context": length, "transformers": results[length]}), flush=True)
    return results


def ms(s: dict) -> str:
    return f"{s['median'] * 1e3:,.0f} ms (IQR {s['p25'] * 1e3:,.0f}-{s['p75'] * 1e3:,.0f}, n {s['n']})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["bytes", "speed"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096], help="context lengths")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds of the JAX decodes")
    parser.add_argument("--torch-rounds", type=int, default=3, help="rounds of transformers' step (0: skip it)")
    parser.add_argument("--torch", action="store_true", help="(internal) time transformers only, print JSON")
    args = parser.parse_args(argv)
    if args.what == "bytes":
        bytes_table()
        return
    if args.torch:
        print("RESULT " + json.dumps(torch_speed(args.lengths, args.torch_rounds)))
        return
    print(load_line("start"), f"({cores()} cores)")
    ours = jax_speed(args.lengths, args.rounds)
    theirs = {}
    if args.torch_rounds:
        run = subprocess.run([sys.executable, __file__, "speed", "--torch", "--torch-rounds", str(args.torch_rounds),
                              "--lengths", *map(str, args.lengths)], capture_output=True, text=True, check=True)
        line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
        theirs = {int(k): v for k, v in json.loads(line[len("RESULT "):]).items()}
    print("\n| context | absorbed | expanded | expanded / absorbed (per round) | transformers 5.24 (CPU, eager) |\n"
          "|---|---|---|---|---|")
    for length in args.lengths:
        r = ours[length]
        ratio = r["ratio"]
        torch_cell = ms(theirs[length]) if length in theirs else "not run"
        print(f"| {length} | {ms(r['absorbed'])} | {ms(r['expanded'])} | {ratio['median']:.2f}x "
              f"[{ratio['p25']:.2f}-{ratio['p75']:.2f}] | {torch_cell} |")
    print(f"\n(largest |absorbed - expanded| logit: {max(r['logits_gap'] for r in ours.values()):.2g}; "
          "one token a step, batch 1, float32)")


if __name__ == "__main__":
    main()
