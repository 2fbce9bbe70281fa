"""transformers' ``config.json`` conventions of each llama-family ``model_type``, read and written.

Pure Python, like ``llama_config``, which calls it (``LlamaConfig.from_hf``, ``to_hf_dict``): ``read``
gives a config's fields as ``LlamaConfig`` takes them, ``write`` a config as transformers' class for
its ``model_type`` reads it, and ``mismatches`` what that class could not hold. Each type brings its
conventions, and its class's defaults for the fields a ``config.json`` may leave out:

* Qwen2's q/k/v biases without an o bias, Qwen3's q/k norms, Mistral's and Qwen's sliding windows;
* Gemma's ``1 + w`` norms and sqrt(hidden) embedding scale, and Gemma 2's and 3's sandwich norms,
  ``query_pre_attn_scalar``, soft-capping (Gemma 2: 50 and 30 unless told), alternating windows
  (every other layer, every sixth full in Gemma 3), Gemma 3's q/k norms and its sliding layers' own
  RoPE base (``rope_local_base_freq``, transformers 5's ``rope_parameters["sliding_attention"]``);
* GPT-OSS's attention sinks, biases, 128-key windows on every other layer, YaRN, and its experts;
* DeepSeek-V3's latent attention (``MlaConfig``), its routing and dense first layers (``MoeConfig``).

The RoPE settings are read from ``rope_parameters`` (transformers 5, per layer kind where nested) or
``rope_scaling`` and ``rope_theta`` (older files), and written both ways. A multimodal Gemma 3's
``text_config`` is read as the ``gemma3_text`` model it holds. Options no class here computes are
refused, naming the option, rather than ignored.
"""

from __future__ import annotations

import math

from flax_transformer.models import hf_config_fields
from flax_transformer.models.mla_config import MlaConfig
from flax_transformer.models.moe_config import MOE_TYPES, MoeConfig
from flax_transformer.models.rope import RopeScaling

GEMMAS = ("gemma", "gemma2", "gemma3_text")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *GEMMAS, *MOE_TYPES)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# the fields a config.json may leave out, where the type's class has its own default (transformers 5)
DEFAULTS = {
    "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   sliding_window=4096, head_dim=256, rope_theta=10000.0),
    "gemma3_text": dict(query_pre_attn_scalar=256, sliding_window=4096, head_dim=256, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0),
    "gpt_oss": dict(sliding_window=128, head_dim=64, rope_theta=150000.0, attention_bias=True, rms_norm_eps=1e-5,
                    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                      original_max_position_embeddings=4096)),
}
# RoPE keys a scaling needs (transformers' _validate_*_rope_parameters); yarn's factor may be left out
# (DeepSeek's: max_position_embeddings / original_max_position_embeddings, rope.RopeScaling.from_any)
REQUIRED_ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
_ABSENT = object()  # a field a config leaves out, told from one it sets to null
WINDOWED = ("mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3_text", "gpt_oss")


def getter(config):
    """``get(name, default)`` on a dict (a ``config.json``) or any object with attributes."""
    return config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))


def read(config, defaults: dict) -> dict:
    """``LlamaConfig``'s fields from a transformers config (object, ``config.json`` dict or namespace);
    ``defaults``: ``LlamaConfig``'s own, for what neither the file nor its type gives."""
    get = getter(config)
    if get("model_type", None) == "gemma3" and get("text_config", None) is not None:
        text = get("text_config", None)  # the language model of a multimodal Gemma 3
        hf_config_fields.check(hf_config_fields.fields_of(config), "gemma3")
        config, get = text, getter(text)
        kind = "gemma3_text"
    else:
        kind = get("model_type", "llama")
    if kind not in MODEL_TYPES:
        raise ValueError(f"model_type {kind!r} is not a llama-family model ({', '.join(MODEL_TYPES)})")
    # every field read or knowingly ignored (hf_config_fields): a field that changes the computation is
    # never read with a default or left unread
    hf_config_fields.check(hf_config_fields.fields_of(config), kind)
    own = DEFAULTS.get(kind, {})

    def field(name, fallback=None):
        value = get(name, None)
        return own.get(name, fallback) if value is None else value

    def cap(name):  # a null soft-cap is no cap (transformers' Gemma2Config(attn_logit_softcapping=None)): only a
        value = get(name, _ABSENT)  # cap the file or object leaves out takes its type's default
        return own.get(name) if value is _ABSENT else value

    for name, plain in (("use_bidirectional_attention", False), ("partial_rotary_factor", None)):
        if get(name, plain) not in (plain, None, False, 1.0):
            raise ValueError(f"{kind} option {name}={get(name, plain)!r} is not supported")
    if kind == "deepseek_v3":  # the original configs' names for what transformers' class always computes
        for name, plain in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
            if get(name, plain) not in (plain, None):
                raise ValueError(f"{kind} option {name}={get(name, plain)!r} is not supported (transformers' "
                                 f"DeepseekV3 computes {name}={plain!r})")
    if kind not in ("gemma2", "gemma3_text"):
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(name, None) is not None:
                raise ValueError(f"{kind} option {name}={get(name, None)!r} is not supported")
    heads, hidden = get("num_attention_heads", defaults["num_attention_heads"]), get("hidden_size", defaults["hidden_size"])
    layers = get("num_hidden_layers", defaults["num_hidden_layers"])
    max_positions = get("max_position_embeddings", defaults["max_position_embeddings"])
    theta, scaling, local = _read_rope(get, kind, own, max_positions, defaults["rope_theta"])
    gemma = kind in GEMMAS
    values = dict(
        vocab_size=get("vocab_size", defaults["vocab_size"]), hidden_size=hidden,
        intermediate_size=get("intermediate_size", defaults["intermediate_size"]),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads", None) or heads,
        head_dim=field("head_dim"), hidden_act=_hidden_act(get, kind),
        max_position_embeddings=max_positions, rms_norm_eps=field("rms_norm_eps", defaults["rms_norm_eps"]),
        rope_theta=theta, rope_scaling=scaling, rope_local_base_freq=local,
        tie_word_embeddings=get("tie_word_embeddings", gemma),
        attention_bias=bool(field("attention_bias", False)), o_proj_bias=get("o_proj_bias", None),
        mlp_bias=get("mlp_bias", None) or False,
        qk_norm=get("qk_norm", kind in ("qwen3", "qwen3_moe", "olmoe", "gemma3_text")),
        qk_norm_scope=get("qk_norm_scope", "projection" if kind == "olmoe" else "head"),
        clip_qkv=get("clip_qkv", None),  # OLMoE's; null elsewhere (hf_config_fields.INERT)
        moe=MoeConfig.from_hf(get, kind) if kind in MOE_TYPES else None,
        mla=MlaConfig.from_hf(get) if kind == "deepseek_v3" else None,
        norm_plus_one=get("norm_plus_one", gemma),
        embed_scale=get("embed_scale", math.sqrt(hidden) if gemma else 1.0),
        sandwich_norms=get("sandwich_norms", kind in ("gemma2", "gemma3_text")),
        query_pre_attn_scalar=field("query_pre_attn_scalar"),
        attn_logit_softcapping=cap("attn_logit_softcapping"), final_logit_softcapping=cap("final_logit_softcapping"),
        attention_sinks=get("attention_sinks", kind == "gpt_oss"),
        attention_dropout=get("attention_dropout", 0.0) or 0.0, pad_token_id=get("pad_token_id", None),
        bos_token_id=get("bos_token_id", None), eos_token_id=get("eos_token_id", None), model_type=kind)
    if kind == "deepseek_v3":  # RoPE turns the shared RoPE part (LlamaConfig checks num_key_value_heads = heads)
        values["head_dim"] = values["mla"].qk_rope_head_dim
    if kind == "qwen2":  # q/k/v always biased, o never (transformers' Qwen2Attention)
        values.update(attention_bias=True, o_proj_bias=False)
    if kind == "qwen2_moe":  # q/k/v biased as qkv_bias says, o never
        values.update(attention_bias=bool(get("qkv_bias", True)), o_proj_bias=False)
    values.update(_read_windows(get, kind, layers, field("sliding_window")))
    return values


def _read_rope(get, kind: str, own: dict, max_positions: int, default_theta: float):
    """(theta, scaling, the sliding layers' base or None) from transformers 5's ``rope_parameters``
    (one dict, or one per layer kind) or the older ``rope_theta``/``rope_scaling``/``rope_local_base_freq``."""
    # rope_scaling first, as transformers 5 reads a config.json (a config object has both, equal)
    rope = get("rope_scaling", None) or get("rope_parameters", None) or {}
    local = None
    if isinstance(rope, dict) and ("full_attention" in rope or "sliding_attention" in rope):
        sliding = rope.get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(f"{kind}: a scaled RoPE on the sliding layers ({sliding.get('rope_type')!r}) is not "
                             "supported (Gemma 3 scales the full layers only)")
        local = sliding.get("rope_theta", None)
        rope = rope.get("full_attention") or {}
    if kind == "gemma3_text":
        local = local or get("rope_local_base_freq", None) or own["rope_local_base_freq"]
    rope = rope or own.get("rope_scaling", {})
    if isinstance(rope, dict):  # the keys transformers requires: never filled with a default
        kind_of = rope.get("rope_type", rope.get("type", "default"))
        for key in REQUIRED_ROPE_KEYS.get(kind_of, ()):
            if rope.get(key) is None:
                raise ValueError(f"{kind}: rope_scaling of type {kind_of!r} has no {key!r} (transformers refuses it "
                                 f"too): give it, as {kind_of!r} computes with it")
    theta = (rope.get("rope_theta", None) if isinstance(rope, dict) else None) or get("rope_theta", None) or \
        own.get("rope_theta", default_theta)
    return theta, RopeScaling.from_any(rope or None, max_position_embeddings=max_positions), local


def _read_windows(get, kind: str, layers: int, window) -> dict:
    """``sliding_window`` and ``layer_types`` as each type's class decides which layers slide."""
    if kind not in WINDOWED or window is None:
        return {}
    if kind == "mistral" and get("layer_types", None) is not None:
        # transformers 5's AutoConfig reads a mistral with layer_types as Ministral: per layer
        types = tuple(get("layer_types", None))
        return {"sliding_window": window, "layer_types": types} if "sliding_attention" in types else {}
    if kind in ("mistral", "mixtral"):
        return {"sliding_window": window}
    if kind == "qwen3_moe":  # every layer slides, or none
        return {"sliding_window": window if get("use_sliding_window", False) else None}
    types = get("layer_types", None)
    if kind in ("gemma2", "gpt_oss", "gemma3_text"):
        every = get("sliding_window_pattern", 6) if kind == "gemma3_text" else 2
        types = types or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    elif get("use_sliding_window", types is not None):
        first = get("max_window_layers", 0)
        types = types or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    else:
        return {}
    return {"sliding_window": window, "layer_types": tuple(types)} if "sliding_attention" in types else {}


def write(config) -> dict:
    """A transformers ``config.json`` for ``config`` (a ``LlamaConfig``) as its ``model_type``'s class reads it."""
    kind = config.model_type
    wrong = mismatches(config)
    if wrong:
        raise ValueError(f"transformers' {kind} model cannot hold this config: " + "; ".join(
            f"{name}={value!r} (a {kind} has {want!r})" for name, value, want in wrong))
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope.update(config.rope_scaling.to_dict())
        rope.pop("type")
    out = dict(architectures=[ARCHITECTURES[kind]], model_type=kind, vocab_size=config.vocab_size,
               hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
               num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
               num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act=config.hidden_act,
               max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
               rope_theta=config.rope_theta, rope_parameters=rope,
               rope_scaling=None if config.rope_scaling is None else config.rope_scaling.to_dict(),
               tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.attention_bias,
               attention_dropout=config.attention_dropout, initializer_range=0.02,
               pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id,
               eos_token_id=list(config.eos_token_id) if isinstance(config.eos_token_id, tuple) else config.eos_token_id)
    if kind == "llama":
        out["mlp_bias"] = config.mlp_bias
    if config.moe is not None:
        out.update(config.moe.to_hf(kind, config.intermediate_size))
    if config.mla is not None:
        out.update(config.mla.to_hf(), num_mtp_layers=0)
    if kind == "qwen2_moe":
        out["qkv_bias"] = config.attention_bias
    if kind == "olmoe":
        out["clip_qkv"] = config.clip_qkv
    if kind in WINDOWED:
        out["sliding_window"] = config.sliding_window
    if kind == "qwen3_moe":
        out["use_sliding_window"] = config.sliding_window is not None
    if kind in ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3_text", "gpt_oss"):
        sliding = config.sliding_window is not None
        types = list(config.layer_types or (
            ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers))
        out["layer_types"] = types
        if kind in ("qwen2", "qwen3", "qwen2_moe"):
            # older readers slide from layer max_window_layers on (exact where full layers come first)
            first = types.index("sliding_attention") if sliding else config.num_hidden_layers
            out.update(use_sliding_window=sliding, max_window_layers=first)
    if kind in GEMMAS:  # transformers 4.x's Gemmas read hidden_activation, 5.x hidden_act
        out["hidden_activation"] = config.hidden_act
    if kind in ("gemma2", "gemma3_text"):
        scalar = config.query_pre_attn_scalar or config.head_dim  # transformers takes an int
        out.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                   attn_logit_softcapping=config.attn_logit_softcapping,
                   final_logit_softcapping=config.final_logit_softcapping)
    if kind == "gemma3_text":  # per layer kind (transformers 5), and the older flat keys
        local = config.rope_local_base_freq or config.rope_theta
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": local}}
        out["rope_local_base_freq"] = local
        pattern = _full_every(out["layer_types"])
        if pattern is not None:  # transformers 4.50-4.52 read which layers slide from this alone
            out["sliding_window_pattern"] = pattern
    return out


def _full_every(types: list) -> int | None:
    """k where every k-th layer is full and the others slide (Gemma 3's ``sliding_window_pattern``), else None."""
    for k in range(1, len(types) + 2):
        if types == ["full_attention" if (i + 1) % k == 0 else "sliding_attention" for i in range(len(types))]:
            return k
    return None


def mismatches(config) -> list[tuple[str, object, object]]:
    """(option, the config's value, what transformers' class for its model_type computes) for each
    switch that class cannot express."""
    kind = config.model_type
    gemma, sandwich = kind in GEMMAS, kind in ("gemma2", "gemma3_text")
    want = dict(norm_plus_one=gemma, embed_scale=math.sqrt(config.hidden_size) if gemma else 1.0,
                qk_norm=kind in ("qwen3", "qwen3_moe", "olmoe", "gemma3_text"), o_proj_bias=config.attention_bias,
                qk_norm_scope="projection" if kind == "olmoe" else "head", sandwich_norms=sandwich,
                attention_sinks=kind == "gpt_oss")
    if not sandwich:
        want.update(query_pre_attn_scalar=None, attn_logit_softcapping=None, final_logit_softcapping=None)
    if kind != "gemma3_text":
        want["rope_local_base_freq"] = None
    if kind != "olmoe":
        want["clip_qkv"] = None
    elif config.head_dim * config.num_attention_heads != config.hidden_size:  # its q norm is over hidden_size
        want["head_dim"] = config.hidden_size // config.num_attention_heads
    if kind != "llama":
        want["mlp_bias"] = False
    if kind in ("mistral", "mixtral") + GEMMAS:
        want["attention_bias"] = False
    if kind == "qwen2":  # q/k/v always biased, o never
        want.update(attention_bias=True, o_proj_bias=False)
    if kind == "qwen2_moe":  # q/k/v as qkv_bias says, o never
        want["o_proj_bias"] = False
    if kind in ("llama", "gemma", "olmoe", "deepseek_v3"):
        want["sliding_window"] = None
    if kind in ("mistral", "mixtral", "qwen3_moe") and config.sliding_window is not None:  # one window for all
        want["layer_types"] = config.layer_types if set(config.layer_types or ()) <= {"sliding_attention"} else None
    if kind == "gemma" and config.hidden_act == "gelu":
        want["hidden_act"] = "gelu_pytorch_tanh"  # transformers reads a Gemma's "gelu" so
    return [(name, getattr(config, name), value) for name, value in want.items() if getattr(config, name) != value]


def _hidden_act(get, kind: str) -> str:
    """The activation transformers computes for a config. A Gemma config.json's "gelu" is a legacy
    spelling of the tanh approximation (transformers 5 reads it so; 4.x read ``hidden_activation``);
    our own fields (``dataclasses.asdict``, which has ``norm_plus_one``) mean what they say."""
    if kind in ("gemma2", "gemma3_text"):  # their MLP reads hidden_activation alone
        return get("hidden_activation", None) or "gelu_pytorch_tanh"
    act = get("hidden_act", None) or get("hidden_activation", None) or ("gelu_pytorch_tanh" if kind == "gemma" else "silu")
    if kind == "gemma" and act == "gelu" and get("norm_plus_one", None) is None:
        return "gelu_pytorch_tanh"
    return act
