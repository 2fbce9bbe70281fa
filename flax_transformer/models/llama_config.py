"""The llama family's configuration: Llama, Mistral, Qwen2, Qwen3 and Gemma in one frozen dataclass.

Pure Python, like ``configs.py``: torch_reference reads it without JAX. Each switch is a
variant that real checkpoints use; ``LlamaConfig.from_hf`` reads a transformers config
(``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``, ``GemmaConfig``, or
their ``config.json`` as a dict) and converts it once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from flax_transformer.models.arg_checks import check_positive_float, check_size, shown
from flax_transformer.models.configs import _check_fields, _set
from flax_transformer.models.moe_config import MOE_TYPES, MoeConfig

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", *MOE_TYPES)
QK_NORMS = ("head", "projection")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


def _getter(config):
    """``get(name, default)`` on a dict (a ``config.json``) or any object with attributes."""
    return config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched for contexts longer than the training one.

    rope_type:
        ``"linear"``: every frequency divided by ``factor`` (positions interpolated).
        ``"dynamic"``: NTK scaling; once a call's largest position reaches
            ``max_position_embeddings``, theta grows with it. Computed from each call alone
            (transformers' module also remembers the longest call it has seen).
        ``"llama3"``: Llama 3.1's: wavelengths above ``original_max_position_embeddings /
            low_freq_factor`` divided by ``factor``, below ``.../ high_freq_factor`` kept, and a
            smooth blend between. Its error is zero at position 0 and grows with position.
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported ({', '.join(ROPE_TYPES[1:])}; "
                             "or rope_scaling=None for plain RoPE)")
        factor = check_positive_float("rope_scaling.factor", self.factor)
        if factor < 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor!r}")
        _set(self, "factor", factor)
        if self.rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor"):
                _set(self, name, check_positive_float(f"rope_scaling.{name}", getattr(self, name)))
            if not self.low_freq_factor < self.high_freq_factor:
                raise ValueError(f"rope_scaling.low_freq_factor ({self.low_freq_factor}) must be below "
                                 f"high_freq_factor ({self.high_freq_factor})")
            if self.original_max_position_embeddings is None:
                raise ValueError("rope_scaling of type 'llama3' needs original_max_position_embeddings")
        if self.original_max_position_embeddings is not None:
            _set(self, "original_max_position_embeddings", check_size(
                "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings))

    @classmethod
    def from_any(cls, value, *, max_position_embeddings: int | None = None) -> RopeScaling | None:
        """From a dict in transformers' form (``rope_type`` or the older ``type``), or None.

        ``{"rope_type": "default"}`` is plain RoPE: None. llama3 without
        ``original_max_position_embeddings`` takes ``max_position_embeddings``, as transformers does.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"rope_scaling must be None or a dict with 'rope_type', got {shown(value)}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind == "default":
            return None
        if value.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("rope partial_rotary_factor other than 1 is not supported")
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in value.items() if k in known and k != "rope_type"}
        if kind == "llama3" and fields.get("original_max_position_embeddings") is None:
            fields["original_max_position_embeddings"] = max_position_embeddings
        return cls(rope_type=kind, **fields)

    def to_dict(self) -> dict:
        """transformers' ``rope_scaling`` dict (``rope_type`` and the older ``type`` both written)."""
        out = {"rope_type": self.rope_type, "type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        return out


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder (transformers' attribute names), for ``llama.LlamaForCausalLM``.

    Pre-norm blocks of RMSNorm -> attention with rotary positions -> residual -> RMSNorm ->
    gated MLP (``down(act(gate(x)) * up(x))``) -> residual; a final RMSNorm; the LM head.
    Defaults are Llama 2 7B's; the presets give the other real shapes.

    Attributes beyond Llama's:
        num_key_value_heads: grouped-query attention; None = ``num_attention_heads``.
        head_dim: the width of a head, independent of ``hidden_size``; None = hidden / heads.
        attention_bias: biases on q, k and v (Qwen2) and, unless ``o_proj_bias`` says
            otherwise, on o (Llama's ``attention_bias`` covers all four).
        o_proj_bias: bias on the output projection; None = ``attention_bias``.
        qk_norm: RMSNorm of q and k before RoPE (``q_norm``/``k_norm``): per head over ``head_dim``
            (Qwen3), or over the whole projection before the heads are split (``qk_norm_scope=
            "projection"``: OLMoE).
        clip_qkv: q, k and v clamped to [-clip, clip] after the norms (OLMoE); None = no clamp.
        moe: the sparse feed-forward blocks (``MoeConfig``: Mixtral, Qwen2/3-MoE, OLMoE); None = dense.
        sliding_window: each query sees at most this many keys, itself included (Mistral).
        layer_types: per layer, "full_attention" or "sliding_attention" (Qwen2/3); None = every
            layer slides when ``sliding_window`` is set, none otherwise.
        norm_plus_one: RMSNorm weights stored as ``w`` and applied as ``1 + w``, the product in
            float32 (Gemma); initialised to zeros then.
        embed_scale: the embeddings are multiplied by it, rounded to the compute dtype (Gemma:
            sqrt(hidden_size)).
        pad_token_id: the embedding row that gets no gradient (``nn.Embedding(padding_idx=)``).
        bos_token_id, eos_token_id: the tokenizer's begin and end ids as the checkpoint's
            ``config.json`` gives them (an end id may be a list: Llama 3 has three), carried to
            exported folders so that transformers' ``generate`` stops where the original does;
            the model's computation does not read them.
        model_type: the transformers family this config came from or exports to.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool | None = None
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: str = "head"
    clip_qkv: float | None = None
    moe: MoeConfig | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    norm_plus_one: bool = False
    embed_scale: float = 1.0
    attention_dropout: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    model_type: str = "llama"

    def __post_init__(self):
        _check_fields(self, sizes=("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                   "max_position_embeddings"), counts=("num_hidden_layers",),
                      probabilities=("attention_dropout",), epsilons=("rms_norm_eps", "rope_theta", "embed_scale"),
                      flags=("tie_word_embeddings", "attention_bias", "mlp_bias", "qk_norm", "norm_plus_one"))
        heads = self.num_attention_heads
        kv = check_size("LlamaConfig.num_key_value_heads", heads if self.num_key_value_heads is None
                        else self.num_key_value_heads)
        if kv > heads:
            raise ValueError(f"num_key_value_heads ({kv}) must be at most num_attention_heads ({heads})")
        if heads % kv:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
        _set(self, "num_key_value_heads", kv)
        if self.head_dim is None and self.hidden_size % heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({heads}) "
                             "when head_dim is not given")
        head_dim = check_size("LlamaConfig.head_dim", self.hidden_size // heads if self.head_dim is None
                              else self.head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs of features), got {head_dim}")
        _set(self, "head_dim", head_dim)
        if self.o_proj_bias is None:
            _set(self, "o_proj_bias", self.attention_bias)
        _check_fields(self, flags=("o_proj_bias",))
        _set(self, "rope_scaling", RopeScaling.from_any(self.rope_scaling,
                                                       max_position_embeddings=self.max_position_embeddings))
        if self.sliding_window is not None:
            _set(self, "sliding_window", check_size("LlamaConfig.sliding_window", self.sliding_window))
        if self.layer_types is not None:
            kinds = tuple(self.layer_types) if isinstance(self.layer_types, (list, tuple)) else None
            if kinds is None or len(kinds) != self.num_hidden_layers or not set(kinds) <= set(LAYER_TYPES):
                raise ValueError(f"layer_types must list {self.num_hidden_layers} of {LAYER_TYPES}, one per layer, "
                                 f"got {shown(self.layer_types)}")
            if "sliding_attention" in kinds and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
            _set(self, "layer_types", kinds)
        if self.pad_token_id is not None:
            _set(self, "pad_token_id", check_size("LlamaConfig.pad_token_id", self.pad_token_id, least=0,
                                                  most=self.vocab_size - 1))
        if self.bos_token_id is not None:  # ids only: transformers checks them against no vocabulary either
            _set(self, "bos_token_id", check_size("LlamaConfig.bos_token_id", self.bos_token_id, least=0))
        if isinstance(self.eos_token_id, (list, tuple)):
            _set(self, "eos_token_id", tuple(check_size("LlamaConfig.eos_token_id", i, least=0)
                                             for i in self.eos_token_id))
        elif self.eos_token_id is not None:
            _set(self, "eos_token_id", check_size("LlamaConfig.eos_token_id", self.eos_token_id, least=0))
        if not isinstance(self.hidden_act, str) or self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"LlamaConfig.hidden_act {self.hidden_act!r} is not supported ({', '.join(HIDDEN_ACTS)})")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"LlamaConfig.model_type must be one of {MODEL_TYPES}, got {shown(self.model_type)}")
        if self.qk_norm_scope not in QK_NORMS:
            raise ValueError(f"LlamaConfig.qk_norm_scope must be one of {QK_NORMS}, got {shown(self.qk_norm_scope)}")
        if self.clip_qkv is not None:
            _set(self, "clip_qkv", check_positive_float("LlamaConfig.clip_qkv", self.clip_qkv))
        if isinstance(self.moe, dict):
            _set(self, "moe", MoeConfig(**self.moe))
        if self.moe is not None and not isinstance(self.moe, MoeConfig):
            raise ValueError(f"LlamaConfig.moe must be a MoeConfig, a dict of its fields or None, got {shown(self.moe)}")
        if (self.moe is not None) != (self.model_type in MOE_TYPES):
            raise ValueError(f"a {self.model_type} model {'has no' if self.moe is not None else 'needs a'} "
                             "mixture of experts (LlamaConfig.moe)")

    @property
    def num_key_value_groups(self) -> int:
        """How many query heads share one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None: it sees every earlier key)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    # -------------------------------------------------------------- transformers

    @classmethod
    def from_any(cls, config) -> LlamaConfig:
        """This class, or any transformers config / ``config.json`` dict / namespace (``from_hf``)."""
        return config if isinstance(config, cls) else cls.from_hf(config)

    @classmethod
    def from_hf(cls, config) -> LlamaConfig:
        """From a transformers ``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config`` or
        ``GemmaConfig`` (or its ``config.json`` dict, or a namespace), converted once.

        Each ``model_type`` brings its own conventions: Qwen2's q/k/v biases without an o bias,
        Qwen3's q/k norms, Gemma's ``1 + w`` norms and sqrt(hidden) embedding scale, Mistral's and
        Qwen's sliding windows. The RoPE settings are read from ``rope_parameters`` (transformers 5)
        or ``rope_scaling`` and ``rope_theta`` (older files). Options this model does not compute are
        refused, naming the option, rather than ignored.
        """
        get = _getter(config)
        kind = get("model_type", "llama")
        if kind not in MODEL_TYPES:
            raise ValueError(f"model_type {kind!r} is not a llama-family model ({', '.join(MODEL_TYPES)})")
        for name, plain in (("use_bidirectional_attention", False), ("attn_logit_softcapping", None),
                            ("final_logit_softcapping", None), ("partial_rotary_factor", None)):
            if get(name, plain) not in (plain, None, False, 1.0):
                raise ValueError(f"{kind} option {name}={get(name, plain)!r} is not supported")
        heads, hidden = get("num_attention_heads", cls.num_attention_heads), get("hidden_size", cls.hidden_size)
        max_positions = get("max_position_embeddings", cls.max_position_embeddings)
        # rope_scaling first, as transformers 5 reads a config.json (a config object has both, equal)
        rope = get("rope_scaling", None) or get("rope_parameters", None) or {}
        theta = (rope.get("rope_theta", None) if isinstance(rope, dict) else None) or get("rope_theta", None)
        scaling = RopeScaling.from_any(rope or None, max_position_embeddings=max_positions)
        values = dict(
            vocab_size=get("vocab_size", cls.vocab_size), hidden_size=hidden,
            intermediate_size=get("intermediate_size", cls.intermediate_size),
            num_hidden_layers=get("num_hidden_layers", cls.num_hidden_layers), num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", None) or heads,
            head_dim=get("head_dim", None),
            hidden_act=_hidden_act(get, kind),
            max_position_embeddings=max_positions, rms_norm_eps=get("rms_norm_eps", cls.rms_norm_eps),
            rope_theta=theta or cls.rope_theta, rope_scaling=scaling,
            tie_word_embeddings=get("tie_word_embeddings", kind in ("gemma",)),
            attention_bias=get("attention_bias", None) or False, o_proj_bias=get("o_proj_bias", None),
            mlp_bias=get("mlp_bias", None) or False, qk_norm=get("qk_norm", kind in ("qwen3", "qwen3_moe", "olmoe")),
            qk_norm_scope=get("qk_norm_scope", "projection" if kind == "olmoe" else "head"),
            clip_qkv=get("clip_qkv", None) if kind == "olmoe" else None,
            moe=MoeConfig.from_hf(get, kind) if kind in MOE_TYPES else None,
            norm_plus_one=get("norm_plus_one", kind == "gemma"),
            embed_scale=get("embed_scale", math.sqrt(hidden) if kind == "gemma" else 1.0),
            attention_dropout=get("attention_dropout", 0.0) or 0.0, pad_token_id=get("pad_token_id", None),
            bos_token_id=get("bos_token_id", None), eos_token_id=get("eos_token_id", None), model_type=kind)
        if kind == "qwen2":  # q/k/v always biased, o never (transformers' Qwen2Attention)
            values.update(attention_bias=True, o_proj_bias=False)
        if kind == "qwen2_moe":  # q/k/v biased as qkv_bias says, o never
            values.update(attention_bias=bool(get("qkv_bias", True)), o_proj_bias=False)
        if kind in ("mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"):
            window = get("sliding_window", None)
            if kind in ("mistral", "mixtral"):
                values["sliding_window"] = window
            elif kind == "qwen3_moe":  # every layer slides, or none
                values["sliding_window"] = window if get("use_sliding_window", False) else None
            elif window is not None and get("use_sliding_window", get("layer_types", None) is not None):
                first = get("max_window_layers", 0)
                types = get("layer_types", None) or [
                    "sliding_attention" if i >= first else "full_attention" for i in range(values["num_hidden_layers"])]
                if "sliding_attention" in types:
                    values.update(sliding_window=window, layer_types=tuple(types))
        return cls(**values)

    def to_hf_dict(self) -> dict:
        """A transformers ``config.json`` for this model's ``model_type``.

        The RoPE settings go under ``rope_parameters`` (transformers 5) and ``rope_scaling`` /
        ``rope_theta`` (what older readers take), so that either reads them. A switch that
        transformers' class for this ``model_type`` does not have (a Mistral with biases, a Llama
        with q/k norms) is refused, naming it: the folder would load as another model.
        """
        kind = self.model_type
        wrong = _hf_mismatches(self)
        if wrong:
            raise ValueError(f"transformers' {kind} model cannot hold this config: " + "; ".join(
                f"{name}={value!r} (a {kind} has {want!r})" for name, value, want in wrong))
        architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "mixtral": "MixtralForCausalLM",
                         "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                         "olmoe": "OlmoeForCausalLM"}
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling.to_dict())
            rope.pop("type")
        out = dict(architectures=[architectures[kind]], model_type=kind, vocab_size=self.vocab_size,
                   hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                   num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                   num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, hidden_act=self.hidden_act,
                   max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
                   rope_theta=self.rope_theta, rope_parameters=rope,
                   rope_scaling=None if self.rope_scaling is None else self.rope_scaling.to_dict(),
                   tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
                   attention_dropout=self.attention_dropout, initializer_range=0.02,
                   pad_token_id=self.pad_token_id, bos_token_id=self.bos_token_id,
                   eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id)
        if kind == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.moe is not None:
            out.update(self.moe.to_hf(kind, self.intermediate_size))
        if kind == "qwen2_moe":
            out["qkv_bias"] = self.attention_bias
        if kind == "olmoe":
            out["clip_qkv"] = self.clip_qkv
        if kind in ("mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"):
            out["sliding_window"] = self.sliding_window
        if kind == "qwen3_moe":
            out["use_sliding_window"] = self.sliding_window is not None
        if kind in ("qwen2", "qwen3", "qwen2_moe"):
            sliding = self.sliding_window is not None
            types = list(self.layer_types or (
                ["sliding_attention" if sliding else "full_attention"] * self.num_hidden_layers))
            # older readers slide from layer max_window_layers on (exact where full layers come first)
            first = types.index("sliding_attention") if sliding else self.num_hidden_layers
            out.update(use_sliding_window=sliding, layer_types=types, max_window_layers=first)
        if kind == "gemma":  # transformers 4.x's Gemma reads hidden_activation, 5.x hidden_act
            out["hidden_activation"] = self.hidden_act
        return out

    # -------------------------------------------------------------- presets

    @classmethod
    def tiny(cls, **kw) -> LlamaConfig:
        """For tests: 2 layers of width 32, 4 query heads sharing 2 key/value heads."""
        return cls(**{**dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), **kw})

    @classmethod
    def small(cls, **kw) -> LlamaConfig:
        """A CPU-sized decoder: 4 layers of width 256, grouped-query attention."""
        return cls(**{**dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512), **kw})

    @classmethod
    def llama3_8b(cls, **kw) -> LlamaConfig:
        """Llama 3.1 8B's shape (128k context through llama3 RoPE scaling)."""
        return cls(**{**dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                             rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING(8.0)), **kw})

    @classmethod
    def llama3_1b(cls, **kw) -> LlamaConfig:
        """Llama 3.2 1B's shape (tied embeddings)."""
        return cls(**{**dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                             max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                             rope_scaling=_LLAMA3_SCALING(32.0), tie_word_embeddings=True), **kw})

    @classmethod
    def mistral_7b(cls, **kw) -> LlamaConfig:
        """Mistral 7B v0.1's shape (a 4096-key sliding window)."""
        return cls(**{**dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
                             sliding_window=4096, model_type="mistral"), **kw})

    @classmethod
    def qwen2_0_5b(cls, **kw) -> LlamaConfig:
        """Qwen2.5 0.5B's shape (q/k/v biases, tied embeddings)."""
        return cls(**{**dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             rope_theta=1000000.0, attention_bias=True, o_proj_bias=False, tie_word_embeddings=True,
                             model_type="qwen2"), **kw})

    @classmethod
    def qwen3_0_6b(cls, **kw) -> LlamaConfig:
        """Qwen3 0.6B's shape (q/k norms, head_dim 128 > hidden / heads)."""
        return cls(**{**dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=40960, rope_theta=1000000.0, qk_norm=True,
                             tie_word_embeddings=True, model_type="qwen3"), **kw})

    @classmethod
    def gemma_2b(cls, **kw) -> LlamaConfig:
        """Gemma 2B's shape (one key/value head of width 256, 1 + w norms, scaled embeddings)."""
        return cls(**{**dict(vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                             num_attention_heads=8, num_key_value_heads=1, head_dim=256, max_position_embeddings=8192,
                             hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, norm_plus_one=True,
                             embed_scale=math.sqrt(2048), pad_token_id=0, model_type="gemma"), **kw})


def _hidden_act(get, kind: str) -> str:
    """The activation transformers computes for a config. A Gemma config.json's "gelu" is a legacy
    spelling of the tanh approximation (transformers 5 reads it so; 4.x read ``hidden_activation``);
    our own fields (``dataclasses.asdict``, which has ``norm_plus_one``) mean what they say."""
    act = get("hidden_act", None) or get("hidden_activation", None) or (
        "gelu_pytorch_tanh" if kind == "gemma" else "silu")
    if kind == "gemma" and act == "gelu" and get("norm_plus_one", None) is None:
        return "gelu_pytorch_tanh"
    return act


def _hf_mismatches(config: LlamaConfig) -> list[tuple[str, object, object]]:
    """(option, this config's value, what transformers' class for its model_type computes) for each
    switch that class cannot express."""
    kind, gemma = config.model_type, config.model_type == "gemma"
    want = dict(norm_plus_one=gemma, embed_scale=math.sqrt(config.hidden_size) if gemma else 1.0,
                qk_norm=kind in ("qwen3", "qwen3_moe", "olmoe"), o_proj_bias=config.attention_bias,
                qk_norm_scope="projection" if kind == "olmoe" else "head")
    if kind != "olmoe":
        want["clip_qkv"] = None
    elif config.head_dim * config.num_attention_heads != config.hidden_size:  # its q norm is over hidden_size
        want["head_dim"] = config.hidden_size // config.num_attention_heads
    if kind != "llama":
        want["mlp_bias"] = False
    if kind in ("mistral", "mixtral"):
        want["attention_bias"] = False
    if kind == "qwen2":  # q/k/v always biased, o never
        want.update(attention_bias=True, o_proj_bias=False)
    if kind == "qwen2_moe":  # q/k/v as qkv_bias says, o never
        want["o_proj_bias"] = False
    if kind in ("llama", "gemma", "olmoe"):
        want["sliding_window"] = None
    if kind in ("mistral", "mixtral", "qwen3_moe") and config.sliding_window is not None:  # one window for all
        want["layer_types"] = config.layer_types if set(config.layer_types or ()) <= {"sliding_attention"} else None
    if gemma and config.hidden_act == "gelu":
        want["hidden_act"] = "gelu_pytorch_tanh"  # transformers reads a Gemma's "gelu" so
    return [(name, getattr(config, name), value) for name, value in want.items() if getattr(config, name) != value]


def rope_inverse_frequencies(config: LlamaConfig, dtype=np.float32) -> np.ndarray:
    """RoPE's inverse frequencies (head_dim / 2,) in ``dtype``, computed once on the host and shared
    by both packages. ``dynamic`` scaling changes them per call (the models do that); this is its
    table below ``max_position_embeddings``.

    transformers' formulas in its order of float32 roundings (its ``scalar / tensor`` is
    ``tensor.reciprocal() * scalar``), with one difference: ``theta ** exponent`` is rounded once
    from float64. torch's vectorised float32 pow is within one ulp of that and differs from it on
    about 1.6% of the entries, and differently on other CPUs (AVX-512, AVX2 and scalar code
    paths); XLA's differs again between its constant folder and its kernels. At position p a
    one-ulp frequency moves the angle by up to p * 2**-24 radians (1e-3 at 16k).
    """
    dim, theta, scaling = config.head_dim, config.rope_theta, config.rope_scaling
    one = dtype(1)
    exponents = np.arange(0, dim, 2).astype(dtype) / dtype(dim)
    inv_freq = one / (float(dtype(theta)) ** exponents.astype(np.float64)).astype(dtype)
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq
    factor = dtype(scaling.factor)
    if scaling.rope_type == "linear":
        return inv_freq / factor
    # llama3: long wavelengths divided by factor, short ones kept, a smooth blend between
    low, high, context = scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = context / low, context / high
    wavelen = (one / inv_freq) * dtype(2 * math.pi)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = ((one / wavelen) * dtype(context) - dtype(low)) / dtype(high - low)
    smoothed = (one - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(dtype)


def _LLAMA3_SCALING(factor: float) -> RopeScaling:
    return RopeScaling("llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)
