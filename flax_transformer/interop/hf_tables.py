"""The key tables between HuggingFace checkpoints and torch_reference names, one per ``model_type``
(the llama family's five share one: torch_reference.llama keeps transformers' own names).

Each row is (HF name, our torch_reference name, rule), both sides templates whose
``{fields}`` match ``PLACEHOLDERS``, so one table serves both directions. Rules: "as_is";
"split_heads": an HF (hidden, hidden) weight or (hidden,) bias is one slice per head on
our side, ``{h}`` in our name (the notebook's ``AttentionHead`` layout).

Values may be numpy arrays or ``safetensors_io.Lazy`` tensors: splitting and joining
heads stays lazy, so a streamed load or save reads each slice only when it is written.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from functools import cache

import numpy as np

from flax_transformer.interop.safetensors_io import join_rows, read, split_rows
from flax_transformer.models._shared import StateDictError
from flax_transformer.models.configs import EncoderConfig, GPTConfig
from flax_transformer.models.llama_config import MODEL_TYPES as LLAMA_TYPES
from flax_transformer.models.llama_config import LlamaConfig

AS_IS, SPLIT_HEADS = "as_is", "split_heads"

PLACEHOLDERS = {"i": r"\d+", "h": r"\d+", "p": "weight|bias", "emb": "wte|wpe", "ln": "ln_1|ln_2",
                "conv": r"attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj",
                "attn": "q_proj|k_proj|v_proj|o_proj", "qk_norm": "q_norm|k_norm", "mlp": "gate_proj|up_proj|down_proj",
                "norm": "input_layernorm|post_attention_layernorm"}

BERT_KEYS = [  # RoBERTa's are the same
    ("embeddings.word_embeddings.weight", "embeddings.token_embeddings.weight", AS_IS),
    ("embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight", AS_IS),
    ("embeddings.token_type_embeddings.weight", "embeddings.token_type_embeddings.weight", AS_IS),
    ("embeddings.LayerNorm.{p}", "embeddings.layer_norm.{p}", AS_IS),
    ("encoder.layer.{i}.attention.self.query.{p}", "layers.{i}.attention.heads.{h}.q.{p}", SPLIT_HEADS),
    ("encoder.layer.{i}.attention.self.key.{p}", "layers.{i}.attention.heads.{h}.k.{p}", SPLIT_HEADS),
    ("encoder.layer.{i}.attention.self.value.{p}", "layers.{i}.attention.heads.{h}.v.{p}", SPLIT_HEADS),
    ("encoder.layer.{i}.attention.output.dense.{p}", "layers.{i}.attention.output_linear.{p}", AS_IS),
    ("encoder.layer.{i}.attention.output.LayerNorm.{p}", "layers.{i}.layer_norm_1.{p}", AS_IS),
    ("encoder.layer.{i}.intermediate.dense.{p}", "layers.{i}.feed_forward.linear_1.{p}", AS_IS),
    ("encoder.layer.{i}.output.dense.{p}", "layers.{i}.feed_forward.linear_2.{p}", AS_IS),
    ("encoder.layer.{i}.output.LayerNorm.{p}", "layers.{i}.layer_norm_2.{p}", AS_IS),
    ("pooler.dense.{p}", "pooler.{p}", AS_IS),
]

DISTILBERT_KEYS = [  # post-LN like BERT: sa_layer_norm after attention, output_layer_norm after the FFN
    ("embeddings.word_embeddings.weight", "embeddings.token_embeddings.weight", AS_IS),
    ("embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight", AS_IS),
    ("embeddings.LayerNorm.{p}", "embeddings.layer_norm.{p}", AS_IS),
    ("transformer.layer.{i}.attention.q_lin.{p}", "layers.{i}.attention.heads.{h}.q.{p}", SPLIT_HEADS),
    ("transformer.layer.{i}.attention.k_lin.{p}", "layers.{i}.attention.heads.{h}.k.{p}", SPLIT_HEADS),
    ("transformer.layer.{i}.attention.v_lin.{p}", "layers.{i}.attention.heads.{h}.v.{p}", SPLIT_HEADS),
    ("transformer.layer.{i}.attention.out_lin.{p}", "layers.{i}.attention.output_linear.{p}", AS_IS),
    ("transformer.layer.{i}.sa_layer_norm.{p}", "layers.{i}.layer_norm_1.{p}", AS_IS),
    ("transformer.layer.{i}.ffn.lin1.{p}", "layers.{i}.feed_forward.linear_1.{p}", AS_IS),
    ("transformer.layer.{i}.ffn.lin2.{p}", "layers.{i}.feed_forward.linear_2.{p}", AS_IS),
    ("transformer.layer.{i}.output_layer_norm.{p}", "layers.{i}.layer_norm_2.{p}", AS_IS),
]

GPT2_KEYS = [
    ("transformer.{emb}.weight", "transformer.{emb}.weight", AS_IS),
    ("transformer.h.{i}.{ln}.{p}", "transformer.h.{i}.{ln}.{p}", AS_IS),
    ("transformer.ln_f.{p}", "transformer.ln_f.{p}", AS_IS),
    ("transformer.h.{i}.{conv}.weight", "transformer.h.{i}.{conv}.matrix", AS_IS),  # Conv1D: (in, out) both
    ("transformer.h.{i}.{conv}.bias", "transformer.h.{i}.{conv}.bias", AS_IS),
    ("lm_head.weight", "lm_head.weight", AS_IS),  # only when the head is not tied
]
GPT2_BUFFERS = (r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",)  # old causal-mask buffers

LLAMA_KEYS = [  # Llama, Mistral, Qwen2, Qwen3, Gemma: the same names on both sides
    ("model.embed_tokens.weight", "model.embed_tokens.weight", AS_IS),
    ("model.layers.{i}.self_attn.{attn}.{p}", "model.layers.{i}.self_attn.{attn}.{p}", AS_IS),
    ("model.layers.{i}.self_attn.{qk_norm}.weight", "model.layers.{i}.self_attn.{qk_norm}.weight", AS_IS),  # Qwen3
    ("model.layers.{i}.mlp.{mlp}.{p}", "model.layers.{i}.mlp.{mlp}.{p}", AS_IS),
    ("model.layers.{i}.{norm}.weight", "model.layers.{i}.{norm}.weight", AS_IS),
    ("model.norm.weight", "model.norm.weight", AS_IS),
    ("lm_head.weight", "lm_head.weight", AS_IS),  # only when the head is not tied
]
# RoPE tables that older transformers saved (and still skip on load): computed, not weights
LLAMA_BUFFERS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")


@dataclass(frozen=True)
class Encoder:
    """What differs between the encoder ``model_type``s: their tables, names and classes."""

    keys: list  # the base model's table
    prefix: str  # the base model's prefix inside the *For* classes
    buffers: tuple  # regexes of stored tensors that are not parameters
    heads: tuple  # prefixes of task heads the base model lacks
    classifier_keys: list  # the sequence-classification head's table
    base: str  # transformers' class names
    classifier: str


ENCODERS = {
    "bert": Encoder(BERT_KEYS, "bert.", (r"embeddings\.position_ids",), ("cls.", "classifier.", "qa_outputs."),
                    [("classifier.{p}", "classifier.{p}", AS_IS)], "BertModel", "BertForSequenceClassification"),
    "distilbert": Encoder(DISTILBERT_KEYS, "distilbert.", (r"embeddings\.position_ids",),
                          ("vocab_transform.", "vocab_layer_norm.", "vocab_projector.", "pre_classifier.",
                           "classifier.", "qa_outputs."),
                          [("pre_classifier.{p}", "pre_classifier.{p}", AS_IS), ("classifier.{p}", "classifier.{p}", AS_IS)],
                          "DistilBertModel", "DistilBertForSequenceClassification"),
    "roberta": Encoder(BERT_KEYS, "roberta.", (r"embeddings\.position_ids", r"embeddings\.token_type_ids"),
                       ("lm_head.", "classifier.", "qa_outputs."),
                       [("classifier.dense.{p}", "pre_classifier.{p}", AS_IS),
                        ("classifier.out_proj.{p}", "classifier.{p}", AS_IS)],
                       "RobertaModel", "RobertaForSequenceClassification"),
}


@cache
def _pattern(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)  # literal, field, literal, field, ...
    regex = "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>{PLACEHOLDERS[part]})"
                    for i, part in enumerate(parts))
    return re.compile(regex)


def convert(table, state: dict, *, forward: bool, heads: int | None = None) -> dict:
    """Rename (and split or join heads) by the table, HF -> ours if ``forward``, else back."""
    out, joins = {}, {}
    for key, value in state.items():
        for hf_name, our_name, rule in table:
            match = _pattern(hf_name if forward else our_name).fullmatch(key)
            if not match:
                continue
            fields = match.groupdict()
            if forward and rule == SPLIT_HEADS:
                if np.ndim(value) == 0 or np.shape(value)[0] % heads:
                    raise StateDictError(mismatched=[(key, tuple(np.shape(value)),
                                                      f"(a multiple of num_attention_heads={heads}, ...)")])
                for h, part in enumerate(split_rows(value, heads)):
                    out[our_name.format(**fields, h=h)] = part
            elif not forward and rule == SPLIT_HEADS:
                joins.setdefault(hf_name.format(**fields), {})[int(fields["h"])] = value
            else:
                out[(our_name if forward else hf_name).format(**fields)] = value
            break
        else:
            if not forward:
                raise ValueError(f"{key}: no HuggingFace name for it in the key table")
            out[key] = value  # unknown: kept, so that the strict load names it
    for hf_key, parts in joins.items():
        out[hf_key] = join_rows([parts[h] for h in sorted(parts)])
    return out


def config_of(raw: dict, *, pooler: bool = True):
    """(model_type, our config) of a ``config.json``; ``pooler`` for RoBERTa (its classifier has none)."""
    model_type = raw.get("model_type")
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
    if model_type == "gemma2":  # Gemma 2's sandwich norms, query_pre_attn_scalar, soft-capping and alternating
        # windows are another block than the llama file's: refused, not approximated
        raise ValueError("model_type 'gemma2' is not supported: its soft-capping, alternating sliding windows and "
                         "extra norms do not fit the llama family")
    raise ValueError(f"unsupported model_type {model_type!r}: flax_transformer.interop.hf reads 'bert', 'distilbert', "
                     f"'roberta', 'gpt2' and {', '.join(repr(k) for k in LLAMA_TYPES)}")


def table_of(kind: str) -> list:
    """The key table of a ``model_type``."""
    return ENCODERS[kind].keys if kind in ENCODERS else LLAMA_KEYS if kind in LLAMA_TYPES else GPT2_KEYS


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
        return convert(spec.keys, weights, forward=True, heads=config.num_attention_heads)
    table = "model.embed_tokens.weight" if kind in LLAMA_TYPES else "transformer.wte.weight"
    if config.tie_word_embeddings and "lm_head.weight" in weights:  # a tied file may still hold its head: a copy
        tied = read(weights.pop("lm_head.weight"))
        embedding = weights.get(table)
        if embedding is not None and (tied.shape != embedding.shape or not np.array_equal(tied, read(embedding))):
            raise ValueError(f"lm_head.weight differs from {table} but the config ties them (tie_word_embeddings)")
    return convert(table_of(kind), weights, forward=True)


def ours_to_hf(kind: str, state: dict) -> dict:
    """torch_reference names -> HF names and layouts (the inverse of ``hf_to_ours``)."""
    return convert(table_of(kind), state, forward=False)
