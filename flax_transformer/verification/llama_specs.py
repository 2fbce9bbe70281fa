"""The llama family's rows of ``flax-transformer verify``: the specs of its five ``--family`` names.

- ``llama``: Llama, Mistral, Qwen2/3 and Gemma 1's switches (``llama_specs``);
- ``moe``: the mixtures of experts of Mixtral, Qwen2/3-MoE and OLMoE (``moe_specs``);
- ``gemma``: Gemma 2 and Gemma 3 (``gemma_specs``);
- ``gpt_oss``: GPT-OSS (``gpt_oss_specs``), a family of its own: its rows are mostly attention (sinks,
  YaRN, a window on every other layer), which the ``moe`` rows, about routers, do not test;
- ``deepseek``: DeepSeek-V3 (``deepseek_specs``): multi-head latent attention and group-limited routing.

Every module is causal and reads ``attention_mask`` (b, t), 1 = token; the rows run the mask cases
``CASES`` (causal, causal with left padding, a row with no token) at positions from ``OFFSETS``: RoPE
scaling changes nothing at position 0 and more with each position, so the rows reach beyond 16,000,
past every ``original_max_position_embeddings`` used here.
"""

from __future__ import annotations

import numpy as np

from flax_transformer.verification.spec import Spec, floats, ids

# Each row's first position (b rows take them in turn).
OFFSETS = (0, 8190, 16380)
CASES = ("causal", "causal+padding", "fully-masked-row")


def long_positions(b: int, t: int) -> np.ndarray:
    """(b, t) int64 position ids: row i starts at ``OFFSETS[i % 3]``."""
    return (np.array(OFFSETS)[np.arange(b) % len(OFFSETS), None] + np.arange(t)).astype(np.int64)


def _base(vocab: int, emb: int, **switches):
    from flax_transformer.models.llama_config import LlamaConfig

    return LlamaConfig(**{**dict(vocab_size=vocab, hidden_size=emb, intermediate_size=2 * emb, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 max_position_embeddings=8192, rms_norm_eps=1e-5), **switches})


def _rows(family: str, b: int, t: int, emb: int, vocab: int, layers: dict, models: dict) -> list[Spec]:
    """Specs of ``layers`` {name: (torch class, config, layer_idx)} fed hidden states and of ``models``
    {name: config} (``LlamaForCausalLM``) fed ids, all at ``long_positions``, in ``CASES``."""
    from torch_reference import llama as tl

    positions = long_positions(b, t)
    x_in = lambda rng, m: ((floats(rng, b, t, emb), m, positions), {})  # noqa: E731
    ids_in = lambda rng, m: ((ids(rng, vocab, b, t), m, positions), {})  # noqa: E731
    return ([Spec(family, name, lambda c, cls=cls, cfg=cfg, i=i: _away_from_zero(cls(cfg, i)), x_in, CASES)
             for name, (cls, cfg, i) in layers.items()]
            + [Spec(family, name, lambda c, cfg=cfg: _away_from_zero(tl.LlamaForCausalLM(cfg)), ids_in, CASES)
               for name, cfg in models.items()])


def _away_from_zero(module):
    """Every attention sink drawn from N(0, 2^2) (torch's seeded generator), not transformers' N(0, 0.02^2):
    a sink that takes half a row's probability or almost none shows a sink read wrong. Every DeepSeek-V3
    correction bias (a buffer: the rows' noise moves parameters only) from N(0, 0.4^2), beside sigmoid
    scores in (0, 1): it changes which experts and groups win, so a bias dropped or misread shows."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.rpartition(".")[2] == "sinks":
                p.copy_(2.0 * torch.randn(p.shape))
        for name, buffer in module.named_buffers():
            if name.rpartition(".")[2] == "e_score_correction_bias":
                buffer.copy_(0.4 * torch.randn(buffer.shape))
    return module


def llama_specs(b: int, t: int, emb: int, vocab: int) -> list[Spec]:
    """The llama family, every switch a real checkpoint uses: GQA and MQA, head_dim beyond hidden /
    heads, RoPE plain, linear, dynamic and llama3 at long positions, q/k norms, biases, a sliding
    window, Gemma's ``1 + w`` norms, tanh GELU and scaled embeddings, tied and untied heads."""
    from torch_reference import llama as tl

    config = lambda **switches: _base(vocab, emb, **switches)  # noqa: E731
    # head_dim 8 under llama3 puts one frequency in each band: kept, blended, divided by factor
    llama3 = dict(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
    gemma = dict(num_key_value_heads=1, head_dim=16, hidden_act="gelu_pytorch_tanh", norm_plus_one=True,
                 embed_scale=emb ** 0.5, model_type="gemma")
    layers = {
        "LlamaAttention(GQA, llama3 RoPE)": (tl.LlamaAttention, config(**llama3), 0),  # its other switches: blocks
        "LlamaDecoderLayer(GQA, llama3 RoPE)": (tl.LlamaDecoderLayer, config(**llama3), 0),
        "LlamaDecoderLayer(q/k/v biases, MLP biases, window 3, dynamic RoPE)": (tl.LlamaDecoderLayer, config(
            attention_bias=True, o_proj_bias=False, mlp_bias=True, sliding_window=3,
            rope_scaling=dict(rope_type="dynamic", factor=4.0)), 0),
        "LlamaDecoderLayer(MHA, q/k norm, linear RoPE)": (tl.LlamaDecoderLayer, config(
            num_key_value_heads=4, qk_norm=True, rope_scaling=dict(rope_type="linear", factor=4.0)), 0),
        "LlamaDecoderLayer(Gemma: 1+w norms, tanh GELU, MQA, head_dim 16)": (tl.LlamaDecoderLayer, config(**gemma), 0),
    }
    models = {
        "LlamaForCausalLM(untied, GQA, llama3 RoPE)": config(num_hidden_layers=2, **llama3),
        "LlamaForCausalLM(tied, Gemma)": config(tie_word_embeddings=True, pad_token_id=0, **gemma),  # 1 layer
    }
    return _rows("llama", b, t, emb, vocab, layers, models)


def moe_specs(b: int, t: int, emb: int, vocab: int) -> list[Spec]:
    """The llama family's mixtures of experts (family "moe"): the sparse block of each router kind (top-k
    renormalised or not, a shared expert), a decoder layer with OLMoE's q/k norms and clipping, and two
    models with dense layers among sparse, a window, a tied head. Routing near ties are ``compare``'s."""
    from flax_transformer.models.moe_config import MoeConfig
    from torch_reference import llama as tl

    def config(kind, moe, **switches):
        return _base(vocab, emb, **{**dict(max_position_embeddings=64, model_type=kind, moe=MoeConfig(**moe)),
                                    **switches})

    mixtral = config("mixtral", dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=2 * emb,
                                     fp32_routing_weights=True), sliding_window=3)
    qwen2 = config("qwen2_moe", dict(num_experts=7, num_experts_per_tok=3, moe_intermediate_size=16,
                                     norm_topk_prob=False, shared_expert_intermediate_size=20),
                   attention_bias=True, o_proj_bias=False)
    olmoe = config("olmoe", dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=2 * emb,
                                 norm_topk_prob=False), qk_norm=True, qk_norm_scope="projection", clip_qkv=2.0,
                   head_dim=None)
    qwen3 = config("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                     norm_topk_prob=True, decoder_sparse_step=2), num_hidden_layers=2, head_dim=12,
                   qk_norm=True, tie_word_embeddings=True)
    x_only = lambda rng, m: ((floats(rng, b, t, emb),), {})  # noqa: E731
    x_in = lambda rng, m: ((floats(rng, b, t, emb), m), {})  # noqa: E731
    ids_in = lambda rng, m: ((ids(rng, vocab, b, t), m), {})  # noqa: E731
    return [
        Spec("moe", "LlamaSparseMoeBlock(Mixtral: top-2 of 5, renormalised)",
             lambda c: tl.LlamaSparseMoeBlock(mixtral), x_only, ("none",)),
        Spec("moe", "LlamaSparseMoeBlock(Qwen2-MoE: top-3 of 7, shared expert)",
             lambda c: tl.LlamaSparseMoeBlock(qwen2), x_only, ("none",)),
        Spec("moe", "LlamaDecoderLayer(OLMoE: top-1 of 4, q/k norms, clip_qkv)",
             lambda c: tl.LlamaDecoderLayer(olmoe), x_in, CASES),
        Spec("moe", "LlamaForCausalLM(Qwen3-MoE: dense then sparse, head_dim 12, tied)",
             lambda c: tl.LlamaForCausalLM(qwen3), ids_in, CASES),
        Spec("moe", "LlamaForCausalLM(Mixtral: window 3)", lambda c: tl.LlamaForCausalLM(mixtral), ids_in, CASES),
    ]


def gemma_configs(vocab: int, emb: int):
    """(Gemma 2, Gemma 3) configs of two layers, a sliding one (window 3) then a full one.

    Gemma 2: ``query_pre_attn_scalar`` 6 for head_dim 8, caps that bite (the attention's 1.0 and the
    logits' 0.5 sit inside the spread of the scaled scores and of the logits, where tanh bends), sandwich
    norms, ``1 + w`` norms, tanh GELU, scaled embeddings, a tied head. Gemma 3: its q/k norms (``1 + w``
    too), ``query_pre_attn_scalar`` 12, no caps, RoPE base 1e6 with linear scaling by 8 on the full layer
    and ``rope_local_base_freq`` 10,000 unscaled on the sliding one."""
    gemma = dict(num_hidden_layers=2, layer_types=("sliding_attention", "full_attention"), sliding_window=3,
                 hidden_act="gelu_pytorch_tanh", norm_plus_one=True, embed_scale=emb ** 0.5, sandwich_norms=True,
                 tie_word_embeddings=True, pad_token_id=0)
    gemma2 = _base(vocab, emb, **gemma, query_pre_attn_scalar=6.0, attn_logit_softcapping=1.0,
                   final_logit_softcapping=0.5, model_type="gemma2")
    gemma3 = _base(vocab, emb, **gemma, num_key_value_heads=1, head_dim=16, qk_norm=True, query_pre_attn_scalar=12.0,
                   rope_theta=1e6, rope_scaling=dict(rope_type="linear", factor=8.0), rope_local_base_freq=10000.0,
                   model_type="gemma3_text")
    return gemma2, gemma3


def gemma_specs(b: int, t: int, emb: int, vocab: int) -> list[Spec]:
    """Gemma 2 and 3 (family "gemma"): Gemma 2's attention (caps, ``query_pre_attn_scalar``, its
    window) and sandwich-norm layer, Gemma 3's q/k-norm layer on a sliding layer (its local RoPE base),
    and both models of two layers (``gemma_configs``)."""
    from torch_reference import llama as tl

    gemma2, gemma3 = gemma_configs(vocab, emb)
    layers = {
        "LlamaAttention(Gemma 2: soft-cap 1, query_pre_attn_scalar 6, window 3)": (tl.LlamaAttention, gemma2, 0),
        "LlamaDecoderLayer(Gemma 2: sandwich norms, full layer)": (tl.LlamaDecoderLayer, gemma2, 1),
        "LlamaDecoderLayer(Gemma 3: q/k norms, sliding layer, local RoPE base)": (tl.LlamaDecoderLayer, gemma3, 0),
    }
    models = {
        "LlamaForCausalLM(Gemma 2: caps, sliding then full)": gemma2,
        "LlamaForCausalLM(Gemma 3: local RoPE base, linear scaling on the full layer)": gemma3,
    }
    return _rows("gemma", b, t, emb, vocab, layers, models)


def gpt_oss_config(vocab: int, emb: int):
    """A GPT-OSS config of two layers, a sliding one (window 3) then a full one: attention biases, sinks
    (``_away_from_zero`` in the torch builds), YaRN by 32 over an original context of 4096 (head_dim
    8 puts its four frequencies in every band: kept, two blended, interpolated), and its mixture of
    experts (4 experts, top 2, the clamped SwiGLU at limit 1: the tiny model's gates reach it)."""
    from flax_transformer.models.moe_config import MoeConfig

    yarn = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096,
                truncate=False)
    moe = MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, swiglu_limit=1.0)
    return _base(vocab, emb, num_hidden_layers=2, layer_types=("sliding_attention", "full_attention"),
                 sliding_window=3, attention_bias=True, attention_sinks=True, rope_theta=150000.0,
                 max_position_embeddings=131072, rope_scaling=yarn, moe=moe, model_type="gpt_oss")


def gpt_oss_specs(b: int, t: int, emb: int, vocab: int) -> list[Spec]:
    """GPT-OSS (family "gpt_oss"): its attention on the sliding layer and on the full one (sinks away from
    zero, YaRN at positions past the original context), its decoder layer with the mixture of experts
    (``GptOssMLP``: the router's bias, gate and up interleaved, the clamped SwiGLU) and the model of
    two layers."""
    from torch_reference import llama as tl

    config = gpt_oss_config(vocab, emb)
    layers = {
        "LlamaAttention(GPT-OSS: sinks, YaRN, biases, window 3)": (tl.LlamaAttention, config, 0),
        "LlamaAttention(GPT-OSS: sinks, YaRN, biases, full layer)": (tl.LlamaAttention, config, 1),
        # the block within its layer: porting maps torch_reference.moe's classes inside a llama model only
        "LlamaDecoderLayer(GPT-OSS: GptOssMLP top-2 of 4, biases, clamped SwiGLU)": (tl.LlamaDecoderLayer, config, 0),
    }
    models = {"LlamaForCausalLM(GPT-OSS: sinks, YaRN, sliding then full, top-2 of 4)": config}
    return _rows("gpt_oss", b, t, emb, vocab, layers, models)


def deepseek_configs(vocab: int, emb: int):
    """Two DeepSeek-V3 configs of two layers, a dense one (``first_k_dense_replace`` 1) then a sparse one,
    YaRN by 40 over an original context of 4096 with ``mscale`` 1 and ``mscale_all_dim`` 0.707 (the
    softmax scale and RoPE's attention factor both change; the rows reach 16,386), 8 experts in 4 groups,
    the best 2 groups kept, top 3 within them, scaled by 2.5. The first: queries through ``q_lora_rank``
    12, RoPE interleaved, attention biases, one shared expert, renormalised weights; the second: a plain
    ``q_proj``, half-split RoPE, no biases, two shared experts, weights not renormalised."""
    from flax_transformer.models.mla_config import MlaConfig
    from flax_transformer.models.moe_config import MoeConfig

    yarn = dict(rope_type="yarn", factor=40.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707,
                original_max_position_embeddings=4096)
    routing = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=12, fp32_routing_weights=True, n_group=4,
                   topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1)

    def config(q_lora_rank, interleave, bias, shared, norm):
        mla = MlaConfig(q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6,
                        rope_interleave=interleave)
        return _base(vocab, emb, num_hidden_layers=2, num_key_value_heads=4, head_dim=8, attention_bias=bias,
                     o_proj_bias=bias, rope_theta=10000.0, max_position_embeddings=163840, rope_scaling=yarn, mla=mla,
                     moe=MoeConfig(**routing, n_shared_experts=shared, norm_topk_prob=norm), model_type="deepseek_v3")

    return config(12, True, True, 1, True), config(None, False, False, 2, False)


def deepseek_specs(b: int, t: int, emb: int, vocab: int) -> list[Spec]:
    """DeepSeek-V3 (family "deepseek", ``deepseek_configs``): the latent attention with both query forms
    and both RoPE layouts, the dense first layer, the sparse layer of each config (``DeepseekV3MoE``: the
    group-limited router with its correction bias, the experts, the shared experts; porting maps the
    block within its layer), and both models. Routing near ties are ``compare``'s (``routing.py``)."""
    from torch_reference import llama as tl

    lora, plain = deepseek_configs(vocab, emb)
    layers = {
        "DeepseekV3Attention(q_lora_rank 12, interleaved RoPE, YaRN mscale, biases)": (tl.DeepseekV3Attention, lora, 0),
        "DeepseekV3Attention(q_proj, half-split RoPE, YaRN mscale)": (tl.DeepseekV3Attention, plain, 0),
        "LlamaDecoderLayer(DeepSeek-V3: dense first layer)": (tl.LlamaDecoderLayer, lora, 0),
        "LlamaDecoderLayer(DeepSeek-V3: DeepseekV3MoE top-3 of 8 in 2 of 4 groups, bias, 1 shared)":
            (tl.LlamaDecoderLayer, lora, 1),
        "LlamaDecoderLayer(DeepSeek-V3: q_proj, DeepseekV3MoE not renormalised, 2 shared)": (tl.LlamaDecoderLayer, plain, 1),
    }
    models = {
        "LlamaForCausalLM(DeepSeek-V3: q_lora_rank, interleaved RoPE, dense then sparse)": lora,
        "LlamaForCausalLM(DeepSeek-V3: q_proj, half-split RoPE, dense then sparse)": plain,
    }
    return _rows("deepseek", b, t, emb, vocab, layers, models)
