"""The llama family's configuration in one frozen dataclass: Llama, Mistral, Qwen2/3, Gemma 1-3, the
mixtures of experts (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS), DeepSeek-V3.

Pure Python, like ``configs.py``: torch_reference reads it without JAX. Each switch is a
variant that real checkpoints use; ``LlamaConfig.from_hf`` reads a transformers config (or its
``config.json`` as a dict) and converts it once (``llama_hf_config``: each type's conventions);
the RoPE settings are ``rope.py``'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from flax_transformer.models import llama_hf_config
from flax_transformer.models.arg_checks import check_positive_float, check_size, shown
from flax_transformer.models.configs import _check_fields, _set
from flax_transformer.models.llama_hf_config import MODEL_TYPES
from flax_transformer.models.mla_config import MlaConfig
from flax_transformer.models.moe_config import MOE_TYPES, MoeConfig
from flax_transformer.models.rope import RopeScaling, llama3_scaling

QK_NORMS = ("head", "projection")
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


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
        moe: the sparse feed-forward blocks (``MoeConfig``: Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS,
            DeepSeek-V3); None = dense.
        mla: multi-head latent attention (``MlaConfig``: DeepSeek-V3) in place of grouped-query
            attention; ``head_dim`` is then its RoPE part's width (``qk_rope_head_dim``), and
            ``num_key_value_heads`` equals ``num_attention_heads``.
        sliding_window: each query sees at most this many keys, itself included (Mistral).
        layer_types: per layer, "full_attention" or "sliding_attention" (Qwen2/3); None = every
            layer slides when ``sliding_window`` is set, none otherwise.
        norm_plus_one: RMSNorm weights stored as ``w`` and applied as ``1 + w``, the product in
            float32 (Gemma); initialised to zeros then.
        embed_scale: the embeddings are multiplied by it, rounded to the compute dtype (Gemma:
            sqrt(hidden_size)).
        sandwich_norms: Gemma 2/3's four norms a block: the attention's output normalised
            (``post_attention_layernorm``) before the residual, the feed-forward between
            ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``.
        query_pre_attn_scalar: the scores are scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma 2/3);
            None: ``head_dim ** -0.5``.
        attn_logit_softcapping, final_logit_softcapping: ``cap * tanh(x / cap)`` on the scaled
            scores before the mask, and on the logits (Gemma 2); None: no cap.
        attention_sinks: a learned logit per query head (``self_attn.sinks``) joins each softmax's
            denominator, taking its share of the probability (GPT-OSS).
        rope_local_base_freq: the RoPE base of the sliding layers, unscaled (Gemma 3); None: every
            layer takes ``rope_theta`` and ``rope_scaling``.
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
    mla: MlaConfig | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    norm_plus_one: bool = False
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    attention_sinks: bool = False
    rope_local_base_freq: float | None = None
    attention_dropout: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    model_type: str = "llama"

    def __post_init__(self):
        _check_fields(self, sizes=("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                   "max_position_embeddings"), counts=("num_hidden_layers",),
                      probabilities=("attention_dropout",), epsilons=("rms_norm_eps", "rope_theta", "embed_scale"),
                      flags=("tie_word_embeddings", "attention_bias", "mlp_bias", "qk_norm", "norm_plus_one",
                             "sandwich_norms", "attention_sinks"))
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_base_freq"):
            if getattr(self, name) is not None:
                _set(self, name, check_positive_float(f"LlamaConfig.{name}", getattr(self, name)))
        heads = self.num_attention_heads
        if isinstance(self.mla, dict):
            _set(self, "mla", MlaConfig(**self.mla))
        if self.mla is not None:
            if not isinstance(self.mla, MlaConfig):
                raise ValueError(f"LlamaConfig.mla must be an MlaConfig, a dict of its fields or None, got "
                                 f"{shown(self.mla)}")
            if self.model_type != "deepseek_v3":
                raise ValueError(f"a {self.model_type} model has no latent attention (LlamaConfig.mla)")
            for name, want in (("head_dim", self.mla.qk_rope_head_dim), ("num_key_value_heads", heads)):
                if getattr(self, name) not in (None, want):
                    raise ValueError(f"LlamaConfig.{name} is {getattr(self, name)!r}; with latent attention it is "
                                     f"{want} ({'mla.qk_rope_head_dim' if name == 'head_dim' else 'one per query head'})")
            _set(self, "head_dim", self.mla.qk_rope_head_dim)
        elif self.model_type == "deepseek_v3":
            raise ValueError("a deepseek_v3 model needs latent attention (LlamaConfig.mla)")
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

    def layer_type(self, layer_idx: int) -> str:
        """"full_attention" or "sliding_attention": the kind of layer ``layer_idx`` (its window and RoPE)."""
        if self.layer_types is None:
            return "full_attention" if self.sliding_window is None else "sliding_attention"
        return self.layer_types[layer_idx]

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None: it sees every earlier key)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    # -------------------------------------------------------------- transformers

    @classmethod
    def from_any(cls, config) -> LlamaConfig:
        """This class, a dict of exactly its fields (``dataclasses.asdict``, nested dicts as ``__post_init__``
        takes them), or any transformers config / ``config.json`` dict / namespace (``from_hf``)."""
        if isinstance(config, cls):
            return config
        if isinstance(config, dict) and set(config) == {f.name for f in dataclasses.fields(cls)}:
            return cls(**config)
        return cls.from_hf(config)

    @classmethod
    def from_hf(cls, config) -> LlamaConfig:
        """From a transformers config of a llama-family ``model_type`` (``MODEL_TYPES``: ``LlamaConfig``,
        ``MistralConfig``, ``Qwen2Config``, ``Gemma2Config``, ``Gemma3TextConfig`` or a multimodal
        ``Gemma3Config``'s text part, ``GptOssConfig``, the MoE ones...), or its ``config.json`` dict, or a
        namespace, converted once with that type's conventions and defaults (``llama_hf_config``)."""
        return cls(**llama_hf_config.read(config, {f: getattr(cls, f) for f in (
            "num_attention_heads", "hidden_size", "num_hidden_layers", "max_position_embeddings", "rope_theta",
            "vocab_size", "intermediate_size", "rms_norm_eps")}))

    def to_hf_dict(self) -> dict:
        """A transformers ``config.json`` for this model's ``model_type`` (``llama_hf_config.write``).

        The RoPE settings go under ``rope_parameters`` (transformers 5) and ``rope_scaling`` /
        ``rope_theta`` (what older readers take), so that either reads them. A switch that
        transformers' class for this ``model_type`` does not have (a Mistral with biases, a Llama
        with q/k norms) is refused, naming it: the folder would load as another model.
        """
        return llama_hf_config.write(self)

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
                             rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=llama3_scaling(8.0)), **kw})

    @classmethod
    def llama3_1b(cls, **kw) -> LlamaConfig:
        """Llama 3.2 1B's shape (tied embeddings)."""
        return cls(**{**dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                             max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                             rope_scaling=llama3_scaling(32.0), tie_word_embeddings=True), **kw})

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
