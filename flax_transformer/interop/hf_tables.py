"""The converter rows between HuggingFace checkpoints and torch_reference names, one table per
``model_type`` (the llama family's five share one: torch_reference.llama keeps transformers' own names).

Each table is a list of ``converter.Row``: the HF name (the source) -> our torch_reference name
(canonical), with the ops between them. BERT's, DistilBERT's and RoBERTa's q/k/v are one tensor in
HF's files and one slice per head on our side (the notebook's ``AttentionHead`` layout):
``Split("h", size="num_attention_heads")``. One table serves both directions, lazily: a streamed
load or save reads each head's slice only when it is written.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import numpy as np

from flax_transformer.interop.converter import Row, convert
from flax_transformer.interop.converter_ops import MXFP4, FP8Blocks, Join, Split, Stack
from flax_transformer.interop.safetensors_io import read
from flax_transformer.models import hf_config_fields
from flax_transformer.models.configs import EncoderConfig, GPTConfig
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.llama_hf_config import MODEL_TYPES as LLAMA_TYPES
from flax_transformer.models.moe_config import MOE_TYPES

HEADS = (Split("h", axis=0, size="num_attention_heads"),)  # one HF tensor, a slice per head on our side

BERT_ROWS = [  # RoBERTa's are the same
    Row("embeddings.word_embeddings.weight", "embeddings.token_embeddings.weight"),
    Row("embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight"),
    Row("embeddings.token_type_embeddings.weight", "embeddings.token_type_embeddings.weight"),
    Row("embeddings.LayerNorm.{p}", "embeddings.layer_norm.{p}"),
    Row("encoder.layer.{i}.attention.self.query.{p}", "layers.{i}.attention.heads.{h}.q.{p}", HEADS),
    Row("encoder.layer.{i}.attention.self.key.{p}", "layers.{i}.attention.heads.{h}.k.{p}", HEADS),
    Row("encoder.layer.{i}.attention.self.value.{p}", "layers.{i}.attention.heads.{h}.v.{p}", HEADS),
    Row("encoder.layer.{i}.attention.output.dense.{p}", "layers.{i}.attention.output_linear.{p}"),
    Row("encoder.layer.{i}.attention.output.LayerNorm.{p}", "layers.{i}.layer_norm_1.{p}"),
    Row("encoder.layer.{i}.intermediate.dense.{p}", "layers.{i}.feed_forward.linear_1.{p}"),
    Row("encoder.layer.{i}.output.dense.{p}", "layers.{i}.feed_forward.linear_2.{p}"),
    Row("encoder.layer.{i}.output.LayerNorm.{p}", "layers.{i}.layer_norm_2.{p}"),
    Row("pooler.dense.{p}", "pooler.{p}"),
]

DISTILBERT_ROWS = [  # post-LN like BERT: sa_layer_norm after attention, output_layer_norm after the FFN
    Row("embeddings.word_embeddings.weight", "embeddings.token_embeddings.weight"),
    Row("embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight"),
    Row("embeddings.LayerNorm.{p}", "embeddings.layer_norm.{p}"),
    Row("transformer.layer.{i}.attention.q_lin.{p}", "layers.{i}.attention.heads.{h}.q.{p}", HEADS),
    Row("transformer.layer.{i}.attention.k_lin.{p}", "layers.{i}.attention.heads.{h}.k.{p}", HEADS),
    Row("transformer.layer.{i}.attention.v_lin.{p}", "layers.{i}.attention.heads.{h}.v.{p}", HEADS),
    Row("transformer.layer.{i}.attention.out_lin.{p}", "layers.{i}.attention.output_linear.{p}"),
    Row("transformer.layer.{i}.sa_layer_norm.{p}", "layers.{i}.layer_norm_1.{p}"),
    Row("transformer.layer.{i}.ffn.lin1.{p}", "layers.{i}.feed_forward.linear_1.{p}"),
    Row("transformer.layer.{i}.ffn.lin2.{p}", "layers.{i}.feed_forward.linear_2.{p}"),
    Row("transformer.layer.{i}.output_layer_norm.{p}", "layers.{i}.layer_norm_2.{p}"),
]

GPT2_ROWS = [
    Row("transformer.{emb}.weight", "transformer.{emb}.weight"),
    Row("transformer.h.{i}.{ln}.{p}", "transformer.h.{i}.{ln}.{p}"),
    Row("transformer.ln_f.{p}", "transformer.ln_f.{p}"),
    Row("transformer.h.{i}.{conv}.weight", "transformer.h.{i}.{conv}.matrix"),  # Conv1D: (in, out) both
    Row("transformer.h.{i}.{conv}.bias", "transformer.h.{i}.{conv}.bias"),
    Row("lm_head.weight", "lm_head.weight"),  # only when the head is not tied
]
GPT2_BUFFERS = (r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",)  # old causal-mask buffers

LLAMA_ROWS = [  # Llama, Mistral, Qwen2, Qwen3, Gemma: the same names on both sides
    Row("model.embed_tokens.weight", "model.embed_tokens.weight"),
    Row("model.layers.{i}.self_attn.{attn}.{p}", "model.layers.{i}.self_attn.{attn}.{p}"),
    Row("model.layers.{i}.self_attn.{qk_norm}.weight", "model.layers.{i}.self_attn.{qk_norm}.weight"),  # Qwen3
    Row("model.layers.{i}.self_attn.sinks", "model.layers.{i}.self_attn.sinks"),  # GPT-OSS
    Row("model.layers.{i}.mlp.{mlp}.{p}", "model.layers.{i}.mlp.{mlp}.{p}"),
    Row("model.layers.{i}.{norm}.weight", "model.layers.{i}.{norm}.weight"),
    # Gemma 2 and 3's sandwich norms: around the feed-forward too
    Row("model.layers.{i}.pre_feedforward_layernorm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
    Row("model.layers.{i}.post_feedforward_layernorm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
    Row("model.norm.weight", "model.norm.weight"),
    Row("lm_head.weight", "lm_head.weight"),  # only when the head is not tied
]
# Mixtures of experts. transformers 5 holds a layer's experts fused (``mlp.experts.gate_up_proj``
# (E, 2I, H), gate rows first, ``mlp.experts.down_proj`` (E, H, I)) and saves them per expert, as the
# original checkpoints do; a fused file reads as it is. Written back, they are per expert again.
def _experts(gate: str, up: str, down: str, size: str) -> list:
    """A layer's experts: per-expert files -> transformers 5's fused tensors, then fused files as they are."""
    fused = "model.layers.{i}.mlp.experts."
    return [Row((gate, up), fused + "gate_up_proj", (Stack("e", 0, size), Join("t", axis=1))),
            Row(down, fused + "down_proj", (Stack("e", 0, size),)),
            Row(fused + "gate_up_proj", fused + "gate_up_proj"), Row(fused + "down_proj", fused + "down_proj")]


MOE_ROWS = [  # qwen2_moe, qwen3_moe, olmoe: the llama family's attention and norms, a router, the experts
    *_experts("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
              "model.layers.{i}.mlp.experts.{e}.down_proj.weight", "num_experts"),
    Row("model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    Row("model.layers.{i}.mlp.shared_expert.{mlp}.weight", "model.layers.{i}.mlp.shared_expert.{mlp}.weight"),
    Row("model.layers.{i}.mlp.shared_expert_gate.weight", "model.layers.{i}.mlp.shared_expert_gate.weight"),
    *LLAMA_ROWS,
]
MIXTRAL_ROWS = [  # Mixtral's files say block_sparse_moe and w1 (gate), w3 (up), w2 (down)
    *_experts("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
              "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
              "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", "num_local_experts"),
    Row("model.layers.{i}.block_sparse_moe.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    Row("model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    *LLAMA_ROWS,
]
DEEPSEEK_V3_ROWS = [  # per-expert files as transformers 5 saves them (and fused ones), the MLA projections
    *_experts("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
              "model.layers.{i}.mlp.experts.{e}.down_proj.weight", "num_experts"),
    Row("model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    Row("model.layers.{i}.mlp.gate.e_score_correction_bias", "model.layers.{i}.mlp.gate.e_score_correction_bias"),
    Row("model.layers.{i}.mlp.shared_experts.{mlp}.weight", "model.layers.{i}.mlp.shared_experts.{mlp}.weight"),
    Row("model.layers.{i}.self_attn.{mla}.{p}", "model.layers.{i}.self_attn.{mla}.{p}"),
    Row("model.layers.{i}.self_attn.{mla_norm}.weight", "model.layers.{i}.self_attn.{mla_norm}.weight"),
    *LLAMA_ROWS,  # q_proj (no q_lora_rank), o_proj, the norms, the dense first layers' mlp
]
GPT_OSS_MXFP4_ROWS = [  # GPT-OSS's released files: the experts' weights in MXFP4, dequantised to bfloat16
    Row(("model.layers.{i}.mlp.experts.{proj}_blocks", "model.layers.{i}.mlp.experts.{proj}_scales"),
        "model.layers.{i}.mlp.experts.{proj}", (MXFP4(),)),
]
_GPT_OSS_PLAIN = [Row("model.layers.{i}.mlp.experts.{proj}", "model.layers.{i}.mlp.experts.{proj}")]
_GPT_OSS_REST = [  # the biases (never quantised), the router, then the llama rows (with the sinks)
    Row("model.layers.{i}.mlp.experts.{proj}_bias", "model.layers.{i}.mlp.experts.{proj}_bias"),
    Row("model.layers.{i}.mlp.router.{p}", "model.layers.{i}.mlp.router.{p}"),
    *LLAMA_ROWS,
]
# GPT-OSS: transformers 5 saves the experts as they are held (gate_up_proj (E, H, 2I) interleaved, down_proj
# (E, I, H)); the released folders hold them in MXFP4. Both read; the first row of a target is what is
# written, so the plain table writes plain tensors and the MXFP4 one quantises them again.
GPT_OSS_ROWS = [*_GPT_OSS_PLAIN, *GPT_OSS_MXFP4_ROWS, *_GPT_OSS_REST]
GPT_OSS_MXFP4_WRITE_ROWS = [*GPT_OSS_MXFP4_ROWS, *_GPT_OSS_PLAIN, *_GPT_OSS_REST]

# A multimodal Gemma 3 (model_type "gemma3"): its language model under the prefixes transformers 4.50-4.51
# (and 5's save_pretrained, which writes the older layout back) and 4.52-5's loaded models use; the vision
# tower and its projector, which LlamaForCausalLM has no place for, are left out
MULTIMODAL_TEXT = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
MULTIMODAL_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

# RoPE tables that older transformers saved (and still skip on load): computed, not weights
LLAMA_BUFFERS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")


@dataclass(frozen=True)
class Encoder:
    """What differs between the encoder ``model_type``s: their tables, names and classes."""

    rows: list  # the base model's table
    prefix: str  # the base model's prefix inside the *For* classes
    buffers: tuple  # regexes of stored tensors that are not parameters
    heads: tuple  # prefixes of task heads the base model lacks
    classifier_rows: list  # the sequence-classification head's table
    base: str  # transformers' class names
    classifier: str


ENCODERS = {
    "bert": Encoder(BERT_ROWS, "bert.", (r"embeddings\.position_ids",), ("cls.", "classifier.", "qa_outputs."),
                    [Row("classifier.{p}", "classifier.{p}")], "BertModel", "BertForSequenceClassification"),
    "distilbert": Encoder(DISTILBERT_ROWS, "distilbert.", (r"embeddings\.position_ids",),
                          ("vocab_transform.", "vocab_layer_norm.", "vocab_projector.", "pre_classifier.",
                           "classifier.", "qa_outputs."),
                          [Row("pre_classifier.{p}", "pre_classifier.{p}"), Row("classifier.{p}", "classifier.{p}")],
                          "DistilBertModel", "DistilBertForSequenceClassification"),
    "roberta": Encoder(BERT_ROWS, "roberta.", (r"embeddings\.position_ids", r"embeddings\.token_type_ids"),
                       ("lm_head.", "classifier.", "qa_outputs."),
                       [Row("classifier.dense.{p}", "pre_classifier.{p}"),
                        Row("classifier.out_proj.{p}", "classifier.{p}")],
                       "RobertaModel", "RobertaForSequenceClassification"),
}


# quantised folders read (dequantised on load) and written, by quantization_config's quant_method -> model_types
DEQUANTISED = {"mxfp4": ("gpt_oss",), "fp8": ("deepseek_v3",)}
# what transformers leaves unquantised in GPT-OSS's released folders (written with an MXFP4 export)
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


# DeepSeek-V3's released folders: float8 weights with one float32 ``weight_scale_inv`` per 128 x 128 tile
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
QUANTISATION_CONFIGS = {"mxfp4": MXFP4_CONFIG, "fp8": FP8_CONFIG}


def fp8_rows(block) -> list:
    """The FP8 stage of a DeepSeek-V3 folder: each quantised linear's ``weight`` + ``weight_scale_inv`` -> its
    float32 weight (``FP8Blocks``), run before the key table (a weight without its scale, or a scale without
    its weight, is named missing); backwards, the table's output quantised again."""
    return [Row(("{fp8}.weight", "{fp8}.weight_scale_inv"), "{fp8}.weight", (FP8Blocks(tuple(block)),))]


def fp8_block(raw: dict) -> tuple[int, int]:
    """The (rows, cols) tile of an FP8 folder's ``quantization_config`` (default 128 x 128), checked."""
    quantised = raw["quantization_config"]
    block = quantised.get("weight_block_size", [128, 128])
    if quantised.get("fmt", "e4m3") != "e4m3" or quantised.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"an fp8 quantization_config with fmt {quantised.get('fmt')!r} and activation_scheme "
                         f"{quantised.get('activation_scheme')!r} is not read here (only 'e4m3', 'dynamic')")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    return tuple(block)


def dequantised(raw: dict, weights: dict) -> dict:
    """A folder's tensors with an FP8 folder's quantised weights dequantised (lazily: each is computed when read,
    in float32 as transformers' ``Fp8Dequantize``); any other folder's as they are (MXFP4 is the table's)."""
    if check_quantisation(raw) != "fp8":
        return weights
    return convert(fp8_rows(fp8_block(raw)), weights, forward=True)


MTP_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def without_mtp(raw: dict, weights: dict) -> tuple[dict, list[str], list[int]]:
    """(a DeepSeek-V3 folder's tensors without its multi-token-prediction layers, the names left out, their layer
    indices). The released folders hold ``num_nextn_predict_layers`` layers after the model's
    ``num_hidden_layers`` (enorm, hnorm, eh_proj, shared_head, a decoder layer) that transformers' model does not
    run either; a tensor of any other layer beyond the model is kept, for the strict load to name."""
    if raw.get("model_type") != "deepseek_v3":
        return weights, [], []
    first = raw.get("num_hidden_layers")
    extra = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0
    if not isinstance(first, int) or not isinstance(extra, int) or extra <= 0:
        return weights, [], []
    kept, left_out, layers = {}, [], set()
    for key, value in weights.items():
        found = MTP_LAYER.match(key)
        if found and first <= int(found.group(1)) < first + extra:
            left_out.append(key)
            layers.add(int(found.group(1)))
        else:
            kept[key] = value
    return kept, left_out, sorted(layers)


def check_quantisation(raw: dict) -> str | None:
    """The quant_method of a ``config.json`` (None: not quantised), refused where this library cannot
    dequantise it for that model_type."""
    quantised = raw.get("quantization_config")
    if quantised is None:
        return None
    method = quantised.get("quant_method") if isinstance(quantised, dict) else None
    if raw.get("model_type") not in DEQUANTISED.get(method, ()):
        known = "; ".join(f"{m!r} for {', '.join(kinds)}" for m, kinds in DEQUANTISED.items())
        raise ValueError(f"quantization_config with quant_method {method!r} on a {raw.get('model_type')!r} "
                         f"model is not read here (dequantised on load: {known})")
    return method


def config_of(raw: dict, *, pooler: bool = True):
    """(model_type, our config) of a ``config.json``; ``pooler`` for RoBERTa (its classifier has none)."""
    check_quantisation(raw)
    model_type = raw.get("model_type")
    if model_type in hf_config_fields.ENCODERS:  # every field read or knowingly ignored (the llama family: in from_hf)
        hf_config_fields.check(raw, model_type)
    if model_type == "bert":
        return "bert", EncoderConfig.bert(raw)
    if model_type == "distilbert":
        return "distilbert", EncoderConfig.distilbert(raw)
    if model_type == "roberta":
        return "roberta", EncoderConfig.roberta(raw, pooler=pooler)
    if model_type == "gpt2":
        return "gpt2", GPTConfig.from_any(raw)
    if model_type in LLAMA_TYPES:
        return model_type, LlamaConfig.from_hf(raw)
    if model_type == "gemma3" and isinstance(raw.get("text_config"), dict):  # the language model of a multimodal one
        return "gemma3_text", LlamaConfig.from_hf(raw)
    raise ValueError(f"unsupported model_type {model_type!r}: flax_transformer.interop.hf reads 'bert', 'distilbert', "
                     f"'roberta', 'gpt2' and {', '.join(repr(k) for k in LLAMA_TYPES)}")


def language_model(weights: dict) -> tuple[dict, list]:
    """(the language model's tensors under a ``gemma3_text`` folder's names, the names of those left out:
    the vision tower and projector) of a multimodal Gemma 3 folder. A tensor of neither part is kept as
    it is, for the strict load to name."""
    out, left_out = {}, []
    for key, value in weights.items():
        if key.startswith(MULTIMODAL_VISION):
            left_out.append(key)
            continue
        for old, new in MULTIMODAL_TEXT:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out, left_out


def table_of(kind: str) -> list:
    """The key table of a ``model_type``."""
    if kind in ENCODERS:
        return ENCODERS[kind].rows
    if kind == "mixtral":
        return MIXTRAL_ROWS
    if kind == "gpt_oss":
        return GPT_OSS_ROWS
    if kind == "deepseek_v3":
        return DEEPSEEK_V3_ROWS
    if kind in MOE_TYPES:
        return MOE_ROWS
    return LLAMA_ROWS if kind in LLAMA_TYPES else GPT2_ROWS


def normalise_hf_names(kind: str, weights: dict) -> dict:
    """Drop buffers and the *For* classes' body prefix (``bert.``, ``distilbert.``, ``roberta.``);
    GPT-2's ``transformer.`` (the llama family's ``model.``) is added where a base model has none."""
    out = {}
    for key, value in weights.items():
        if kind in LLAMA_TYPES:
            key = key if key.startswith(("model.", "lm_head.")) else "model." + key
            if any(re.fullmatch(p, key) for p in LLAMA_BUFFERS):
                continue
        elif kind in ENCODERS:
            spec = ENCODERS[kind]
            key = key[len(spec.prefix):] if key.startswith(spec.prefix) else key
            # the hub's bert-base-uncased (and other TF-era BERTs) say LayerNorm.gamma/beta; transformers
            # renames them on load, and so do we
            key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key))
            if any(re.fullmatch(p, key) for p in spec.buffers):
                continue
        else:
            if not key.startswith(("transformer.", "lm_head.")):
                key = "transformer." + key
            if any(re.fullmatch(p, key) for p in GPT2_BUFFERS):
                continue
        out[key] = value
    return out


def hf_to_ours(kind: str, weights: dict, config) -> dict:
    """HF tensor names and layouts -> torch_reference names (the ``porting.state_dict`` layout).

    Task heads the base model lacks are dropped with a warning; unknown keys are kept
    as they are, so that the strict load reports them.
    """
    weights = normalise_hf_names(kind, weights)
    if kind in ENCODERS:
        spec = ENCODERS[kind]
        dropped = sorted(k for k in weights if k.startswith(spec.heads))
        if dropped:
            warnings.warn(f"ignoring {len(dropped)} task-head tensors a {spec.base} does not have: {dropped[:4]}",
                          stacklevel=3)
        weights = {k: v for k, v in weights.items() if not k.startswith(spec.heads)}
        return convert(spec.rows, weights, forward=True, config=config)
    table = "model.embed_tokens.weight" if kind in LLAMA_TYPES else "transformer.wte.weight"
    if config.tie_word_embeddings and "lm_head.weight" in weights:  # a tied file may still hold its head: a copy
        tied = read(weights.pop("lm_head.weight"))
        embedding = weights.get(table)
        if embedding is not None and (tied.shape != embedding.shape or not np.array_equal(tied, read(embedding))):
            raise ValueError(f"lm_head.weight differs from {table} but the config ties them (tie_word_embeddings)")
    return convert(table_of(kind), weights, forward=True, config=config)


def ours_to_hf(kind: str, state: dict, config=None, *, quantisation: str | None = None) -> dict:
    """torch_reference names -> HF names and layouts (the inverse of ``hf_to_ours``); with ``config``,
    every head of a split tensor must be there. ``quantisation="mxfp4"`` (GPT-OSS): the experts' weights
    as ``*_blocks`` + ``*_scales`` (exact only for weights MXFP4 holds: others are rounded); ``"fp8"``
    (DeepSeek-V3): the linear layers' weights as float8 ``weight`` + ``weight_scale_inv`` in 128 x 128 tiles."""
    check_write_quantisation(kind, quantisation)
    table = GPT_OSS_MXFP4_WRITE_ROWS if quantisation == "mxfp4" else table_of(kind)
    out = convert(table, state, forward=False, config=config, format_name="HuggingFace")
    if quantisation == "fp8":
        out = convert(fp8_rows(FP8_CONFIG["weight_block_size"]), out, forward=False, keep_unknown=True)
    return out


def check_write_quantisation(kind: str, quantisation: str | None) -> None:
    """A quantised export is written for GPT-OSS in MXFP4 only; anything else is refused before any work."""
    if quantisation is not None and kind not in DEQUANTISED.get(quantisation, ()):
        known = "; ".join(f"{m!r} for {', '.join(kinds)}" for m, kinds in DEQUANTISED.items())
        raise ValueError(f"quantisation {quantisation!r} is not written for a {kind!r} model (written: {known})")
