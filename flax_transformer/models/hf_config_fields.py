"""What each config reader reads: for every ``model_type``, the fields it computes and those it may ignore.

Pure Python (torch_reference reads ``llama_hf_config``, which calls ``check``). A configuration field
that changes the computation must never be read with a default or left unread: each reader checks
its input against these lists first (``check``) and refuses anything else in one line naming the
field, the ``model_type`` and the file. The rule:

* ``computed``: the reader reads the field and the model computes with it;
* ``IGNORED`` (every type) and ``ignored`` (one type): read by nothing, each with why that changes
  nothing the model computes (storage, runtime switches, tokenizer ids, what transformers' own
  class does not read either);
* ``INERT``: accepted only at the values that compute nothing different (null, ``False``, a zero
  dropout...); any other value is refused, naming the value that would be accepted.

``SUPERSEDED`` names the fields read only when another is absent (transformers 5 reads
``layer_types`` before ``max_window_layers``), for the tests that change each field alone.
"""

from __future__ import annotations

WHERE = "flax_transformer/models/hf_config_fields.py"

# every transformers config's bookkeeping: nothing here changes what the model computes
IGNORED = {
    "architectures": "the class names the folder was saved from: model_type chooses the model",
    "transformers_version": "the writer's version", "_name_or_path": "where it was loaded from",
    "torch_dtype": "storage: the weights' dtype (the model computes in its own)", "dtype": "storage (torch_dtype)",
    "use_cache": "runtime: generate's cache", "cache_implementation": "runtime: generate's cache",
    "output_attentions": "runtime: what a call returns", "output_hidden_states": "runtime: what a call returns",
    "return_dict": "runtime: what a call returns", "torchscript": "runtime", "use_bfloat16": "storage",
    "_attn_implementation": "runtime: the attention kernel", "_attn_implementation_autoset": "runtime",
    "_commit_hash": "where it was loaded from", "xla_device": "runtime: an old placement switch",
    "gradient_checkpointing": "runtime: training recomputes activations, the same values", "output_past": "runtime",
    "chunk_size_feed_forward": "runtime: transformers' feed-forward in chunks, the same sums",
    "initializer_range": "the initialisation of new weights; a folder's are read",
    "id2label": "the labels' names (a classifier's count: num_labels or its head's weights)",
    "label2id": "the labels' names", "problem_type": "the loss a transformers classifier trains with",
    "bos_token_id": "tokenizer id: carried to exports, not computed", "eos_token_id": "tokenizer id: carried",
    "sep_token_id": "tokenizer id", "decoder_start_token_id": "tokenizer id", "tokenizer_class": "tokenizer",
    "prefix": "tokenizer", "task_specific_params": "pipelines' defaults", "finetuning_task": "a name",
    "tf_legacy_loss": "TensorFlow's loss", "quantization_config": "checked apart: dequantised or refused "
    "(hf_tables.check_quantisation)", "auto_map": "remote code's class names: model_type's own class is read",
    **{name: "generation default (generation_config.json's), not the model's computation" for name in (
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
        "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
        "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens")},
}
# accepted at these values only (what computes nothing different), any type
INERT = {"is_encoder_decoder": (False,), "is_decoder": (False,), "add_cross_attention": (False,),
         "cross_attention_hidden_size": (None,), "tie_encoder_decoder": (False,), "pruned_heads": ({},)}

# ------------------------------------------------------------------ the llama family (llama_hf_config.read)

# LlamaConfig's own names, read as it takes them (a dict of its fields, a namespace)
OURS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
        "rope_scaling", "tie_word_embeddings", "attention_bias", "o_proj_bias", "mlp_bias", "qk_norm",
        "qk_norm_scope", "clip_qkv", "sliding_window", "layer_types", "norm_plus_one", "embed_scale", "sandwich_norms",
        "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "attention_sinks",
        "rope_local_base_freq", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id", "model_type")
ROPE = ("rope_parameters",)
WINDOWS = ("use_sliding_window", "max_window_layers")
MOE_RUNTIME = {"output_router_logits": "runtime: whether a call returns the routers' logits"}
LLAMA_FAMILY = {
    "llama": dict(computed=ROPE, ignored={"pretraining_tp": "transformers 4's matmuls split in pretraining_tp "
                                          "slices: the same sums (5.x does not read it)"},
                  inert={"clip_qkv": (None,)}),
    "mistral": dict(computed=ROPE, inert={"clip_qkv": (None,), "mlp_bias": (False, None),
                                          "attention_bias": (False, None)}),
    "qwen2": dict(computed=ROPE + WINDOWS, ignored={
        "attention_bias": "Qwen2's q/k/v are always biased, its o never (transformers' Qwen2Attention)",
        "o_proj_bias": "Qwen2's o is never biased"}, inert={"clip_qkv": (None,), "mlp_bias": (False, None),
                                                            "use_mrope": (False, None)}),
    "qwen3": dict(computed=ROPE + WINDOWS, inert={"clip_qkv": (None,), "mlp_bias": (False, None)}),
    "gemma": dict(computed=ROPE + ("hidden_activation",), inert={
        "use_bidirectional_attention": (None, False), "clip_qkv": (None,), "mlp_bias": (False, None)}),
    "gemma2": dict(computed=ROPE + ("hidden_activation",), ignored={
        "hidden_act": "transformers' Gemma 2 MLP reads hidden_activation alone",
        "sliding_window_size": "an old duplicate of sliding_window that transformers does not read"},
        inert={"use_bidirectional_attention": (None, False), "clip_qkv": (None,), "mlp_bias": (False, None)}),
    "gemma3_text": dict(computed=ROPE + ("hidden_activation", "sliding_window_pattern"), ignored={
        "hidden_act": "transformers' Gemma 3 MLP reads hidden_activation alone", "_sliding_window_pattern":
        "transformers 5's copy of sliding_window_pattern: it reads sliding_window_pattern (and layer_types)"},
                        inert={"use_bidirectional_attention": (None, False), "clip_qkv": (None,),
                               "mlp_bias": (False, None)}),
    "mixtral": dict(computed=ROPE + ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
                                     "router_jitter_noise"), ignored=MOE_RUNTIME,
                    inert={"clip_qkv": (None,), "mlp_bias": (False, None), "attention_bias": (False, None)}),
    "qwen2_moe": dict(computed=ROPE + WINDOWS + (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "router_aux_loss_coef"),
        ignored={**MOE_RUNTIME, "attention_bias": "Qwen2-MoE's q/k/v biases are qkv_bias's",
                 "o_proj_bias": "Qwen2-MoE's o is never biased"},
        inert={"clip_qkv": (None,), "mlp_bias": (False, None)}),
    "qwen3_moe": dict(computed=ROPE + ("use_sliding_window", "num_experts", "num_local_experts",
                                       "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                       "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef"),
                      ignored={**MOE_RUNTIME, "max_window_layers": "transformers' Qwen3-MoE slides every layer "
                               "or none (use_sliding_window)"}, inert={"clip_qkv": (None,), "mlp_bias": (False, None)}),
    "olmoe": dict(computed=ROPE + ("clip_qkv", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                                   "router_aux_loss_coef"), ignored=MOE_RUNTIME, inert={"mlp_bias": (False, None)}),
    "gpt_oss": dict(computed=ROPE + ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
                                     "swiglu_limit", "swiglu_alpha"),
                    ignored={**MOE_RUNTIME, "experts_per_token": "the original release's name; transformers reads "
                             "num_experts_per_tok", "initial_context_length": "the original release's name; "
                             "transformers reads the RoPE's original_max_position_embeddings"},
                    inert={"clip_qkv": (None,), "mlp_bias": (False, None)}),
    "deepseek_v3": dict(computed=ROPE + (
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group", "norm_topk_prob",
        "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace", "router_aux_loss_coef", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"),
        ignored={**MOE_RUNTIME, "qk_head_dim": "derived: qk_nope_head_dim + qk_rope_head_dim",
                 "head_dim": "derived: qk_rope_head_dim (transformers' DeepseekV3Config sets it so)",
                 "num_nextn_predict_layers": "the multi-token-prediction layers, left out (hf_tables.drop_mtp)",
                 "num_mtp_layers": "the multi-token-prediction layers, left out", "pretraining_tp": "transformers "
                 "4's split matmuls, the same sums", "ep_size": "the original code's expert placement",
                 "aux_loss_alpha": "the original code's balancing loss; transformers' DeepseekV3 trains without it",
                 "seq_aux": "the original code's balancing loss"},
        inert={"scoring_func": ("sigmoid", None), "topk_method": ("noaux_tc", None), "moe_layer_freq": (1, None),
               "clip_qkv": (None,), "mlp_bias": (False, None)}),
}
# a multimodal Gemma 3: its text_config is read as gemma3_text; the rest is the vision tower, left out
GEMMA3_VISION = {name: "the vision tower and its tokens, left out (the language model is read)" for name in (
    "vision_config", "boi_token_index", "eoi_token_index", "image_token_index", "mm_tokens_per_image",
    "vision_soft_tokens_per_image", "vision_feature_layer", "vision_feature_select_strategy")}
MULTIMODAL = {"gemma3": dict(computed=("text_config",), ignored={
    **GEMMA3_VISION, "tie_word_embeddings": "the text_config's is read"})}
# read for these types only (llama_hf_config.read); elsewhere accepted only at null (transformers' classes
# for the other types have no such field, and a dict of LlamaConfig's own fields must not lose it)
ONLY_FOR = {"rope_local_base_freq": ("gemma3_text",),
            "attn_logit_softcapping": ("gemma2", "gemma3_text"), "final_logit_softcapping": ("gemma2", "gemma3_text"),
            "sliding_window": ("mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
                               "gemma3_text", "gpt_oss"),
            "layer_types": ("mistral", "qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3_text", "gpt_oss")}
# read only when the first is absent (transformers 5: layer_types before the older switches)
SUPERSEDED = {"max_window_layers": "layer_types", "use_sliding_window": "layer_types",
              "sliding_window_pattern": "layer_types",
              "rope_theta": "rope_parameters", "rope_scaling": "rope_parameters", "hidden_act": "hidden_activation"}

# ------------------------------------------------------------------ encoders and GPT-2 (hf_tables.config_of)

_ENCODER = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "layer_norm_eps",
            "hidden_act", "type_vocab_size", "classifier_dropout", "num_labels", "classifier_pooling")
_MLM = {"tie_word_embeddings": "the masked-LM head's tie: no such head is built here"}
ENCODERS = {
    "bert": dict(computed=_ENCODER, ignored={**_MLM, "pad_token_id": "BERT's padding row: no gradient in "
                                             "transformers' training, the same forward"},
                 inert={"position_embedding_type": ("absolute", None)}),
    "roberta": dict(computed=_ENCODER + ("pad_token_id",), ignored=_MLM,
                    inert={"position_embedding_type": ("absolute", None)}),
    "distilbert": dict(computed=("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "dropout",
                                 "attention_dropout", "max_position_embeddings", "activation", "seq_classif_dropout"),
                       ignored={"qa_dropout": "the question-answering head's dropout: no such head here",
                                "pad_token_id": "the padding row's gradient only", "tie_weights_": "tied on load",
                                **_MLM},
                       inert={"sinusoidal_pos_embds": (False,)}),
    "gpt2": dict(computed=("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
                           "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "tie_word_embeddings"),
                 ignored={"n_ctx": "an old duplicate of n_positions that transformers does not read",
                          "pad_token_id": "tokenizer id", **{name: "GPT2DoubleHeadsModel's summary head: not built "
                                                             "here" for name in (
                              "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                              "summary_first_dropout")}},
                 inert={"scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
                        "reorder_and_upcast_attn": (False,)}),
}


def lists(model_type: str) -> tuple[set, dict, dict]:
    """(computed, ignored with reasons, inert values) of a ``model_type``'s reader."""
    if model_type in LLAMA_FAMILY:
        own = LLAMA_FAMILY[model_type]
        computed = set(OURS) | set(own.get("computed", ()))
    else:
        own = ENCODERS.get(model_type) or MULTIMODAL[model_type]
        computed = {"model_type", *own["computed"]}
    ignored = {**IGNORED, **own.get("ignored", {})}
    inert = {**INERT, **own.get("inert", {})}
    if model_type in LLAMA_FAMILY:
        inert.update({name: (None,) for name, kinds in ONLY_FOR.items() if model_type not in kinds})
    computed -= set(ignored) | set(inert)
    return computed, ignored, inert


def check(fields, model_type: str, source: str | None = None) -> None:
    """Refuse, in one line, a field of ``fields`` (names -> values) that the ``model_type``'s reader
    neither computes nor may ignore, or an inert field at a value that would compute something else;
    ``source``: the file, named first (the folder readers name it themselves)."""
    computed, ignored, inert = lists(model_type)
    where = f"{source}: " if source else ""
    for name, value in fields.items():
        if name in computed or name in ignored:
            continue
        if name in inert:
            if any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in inert[name]):
                continue
            raise ValueError(f"{where}{model_type} field {name}={_shown(value)} is not computed here (accepted: "
                             f"{' or '.join(_shown(v) for v in inert[name])}, which computes nothing different); "
                             f"refused rather than computed without it (the lists: {WHERE})")
        raise ValueError(f"{where}{model_type} field {name!r} (= {_shown(value)}) is neither computed nor "
                         f"ignorable here: refused rather than computed without it (the lists: {WHERE})")


def fields_of(config) -> dict:
    """A config's fields by name: a dict as it is, a transformers config's ``to_dict()``, a namespace's ``vars``."""
    if isinstance(config, dict):
        return config
    if callable(getattr(config, "to_dict", None)):
        return config.to_dict()
    return {k: v for k, v in vars(config).items() if not k.startswith("__")}


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "…"
