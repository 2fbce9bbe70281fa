"""The four families' and the llama family's porting tables: which kind of layer sits at which
module path (``porting`` reads them; ``layer_kinds.LEAF_RULES`` says what each kind's leaves are).

A user's own model needs no entry here: its layers' kinds are read from their Flax types.
"""

from __future__ import annotations

# family -> {regex matching the end of a module path: kind(s) of layer}. A pattern
# matches a whole path or a dotted suffix of it, so the same table serves a full
# model and any submodule ported on its own (an attention, a block); "" is the root
# module itself. Where one name is used by two kinds of layer in a family (notebook
# 002 has ``q_proj`` as its own Linear in ``Attention`` and as ``nn.Linear`` in
# ``GPTMHAttention``), the entry lists both kinds: their leaf names tell them apart.
KEY_MAPS: dict[str, dict[str, str | tuple[str, ...]]] = {
    "former": {
        r"token_embedding|pos_embedding": "embedding",
        r"tokeys|toqueries|tovalues|unifyheads|toprobs": "linear",
        r"ff\.0|ff\.2": "linear",
        r"norm1|norm2": "layer_norm",
    },
    "encoder": {
        r"token_embeddings|position_embeddings|token_type_embeddings": "embedding",
        r"q|k|v|output_linear|linear_1|linear_2|pre_classifier|classifier|pooler": "linear",
        r"layer_norm|layer_norm_1|layer_norm_2": "layer_norm",
    },
    "gpt": {
        r"": ("matrix_linear", "gamma_beta_norm", "table"),  # a bare Linear, LayerNorm or Embeddings
        r"token_embeddings|position_embeddings": "embedding",
        r"q_proj|k_proj|v_proj": ("linear", "matrix_linear"),
        r"q|k|v|w1|w2": "matrix_linear",
        r"lm_head": "linear",
        r"input_layer_norm|attention_layer_norm|layer_norm_feed_forward|out_layer_norm|embedding_norm":
            "gamma_beta_norm",
        r"layer_norm_attention": ("layer_norm", "gamma_beta_norm"),
        r"layer_norm_input": "layer_norm",
        # GPT-2 (HuggingFace's module names; Conv1D is the notebook's matrix layout)
        r"wte|wpe": "embedding",
        r"c_attn|c_proj|c_fc": "matrix_linear",
        r"ln_1|ln_2|ln_f": "layer_norm",
    },
    "classic": {
        r"src_embedding|tgt_embedding": "embedding",
        r"query_tfm|key_tfm|value_tfm|projection|out": "linear",
        r"position_wise_feed_forward\.0|position_wise_feed_forward\.2": "linear",
        r"layer_norm1|layer_norm2|layer_norm3": "layer_norm",
    },
    "llama": {  # transformers' own module names (Llama, Mistral, Qwen2/3, Gemma 1-3, the MoEs, GPT-OSS, DeepSeek-V3)
        r"": "rms_norm",  # a bare LlamaRMSNorm
        r"embed_tokens": "embedding",
        r"q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|lm_head|shared_expert_gate": "linear",
        r"q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj": "linear",  # DeepSeek-V3's latent attention
        r"mlp\.gate|mlp\.router": "router",  # the MoEs' gate, GPT-OSS's router (with a bias)
        # one path, two layouts: the module's type decides (a lookup by path alone, porting.flax_path_to_torch,
        # gets the last kind's rule for the shared leaves: Mixtral's)
        r"experts": ("gpt_oss_experts", "experts"),
        r"input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm|norm"
        r"|q_norm|k_norm|q_a_layernorm|kv_a_layernorm": "rms_norm",
    },
}

# modules whose classes belong to a family named otherwise: the llama family's shared layers and its
# latent attention port with the llama table (``llama`` imports every one of their classes)
MODULE_FAMILIES = {"llama_layers": "llama", "mla": "llama"}
