"""Frozen configuration dataclasses, shared by flax_transformer and torch_reference.

Pure Python on purpose: torch_reference imports this module without pulling in JAX,
and flax_transformer without pulling in torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flax_transformer.models.arg_checks import (
    MAX_LAYERS,
    check_flag,
    check_positive_float,
    check_probability,
    check_size,
)


def _set(config, name, value):
    object.__setattr__(config, name, value)  # frozen; numpy scalars -> Python (hashable, JSON-able)


def _check_fields(config, *, sizes=(), counts=(), probabilities=(), epsilons=(), flags=()):
    """Check (and normalise) a config's fields by kind, naming the field in any error."""
    owner = type(config).__name__
    for name in sizes:
        _set(config, name, check_size(f"{owner}.{name}", getattr(config, name)))
    for name in counts:
        _set(config, name, check_size(f"{owner}.{name}", getattr(config, name), least=0, most=MAX_LAYERS))
    for name in probabilities:
        _set(config, name, check_probability(f"{owner}.{name}", getattr(config, name)))
    for name in epsilons:
        _set(config, name, check_positive_float(f"{owner}.{name}", getattr(config, name)))
    for name in flags:
        _set(config, name, check_flag(f"{owner}.{name}", getattr(config, name)))


@dataclass(frozen=True)
class EncoderConfig:
    """The BERT-like encoder of notebook 001, with BERT's attribute names.

    Any object with these attributes (a ``types.SimpleNamespace``, a transformers
    ``BertConfig``) is accepted by the encoder classes and converted once with
    ``EncoderConfig.from_any``; missing attributes take the defaults below.

    Attributes beyond BERT's:
        norm_first: pre-LN layers as in the notebook (True) or BERT's post-LN (False).
        layer_norm_eps_blocks: eps of the two LayerNorms inside each encoder layer.
            ``None`` means what the notebook does: ``nn.LayerNorm``'s default 1e-5 with
            ``norm_first=True``, and ``layer_norm_eps`` (BERT's 1e-12) with post-LN.
        token_types: size of BERT's token-type (segment) embedding table; 0 = none, as
            in the notebook. Not read from a ``BertConfig``'s ``type_vocab_size`` by
            ``from_any`` (a notebook model built from a BertConfig has no such table);
            ``EncoderConfig.bert`` sets it.
        pooler: add BERT's pooler (dense + tanh on the [CLS] state); off in the notebook.
        classifier_pooling: what ``TransformerForSequenceClassification`` classifies:
            "cls", the first ([CLS]) hidden state, through the pooler when there is one
            (HF's ``BertForSequenceClassification``); or "mean", the mean hidden state
            over real tokens (how sentence-transformers models such as all-MiniLM-L6-v2
            were trained; no pooler).
        classifier_head: what the classifier does with the pooled vector: "linear"
            (dropout, ``classifier``: BERT), "relu" (``pre_classifier``, ReLU, dropout,
            ``classifier``: DistilBERT) or "tanh" (dropout, ``pre_classifier``, tanh,
            dropout, ``classifier``: RoBERTa's head on ``<s>``).
        classifier_dropout: the head's dropout; None = ``hidden_dropout_prob`` (as
            transformers' ``classifier_dropout``; DistilBERT's ``seq_classif_dropout``).
        position_padding_idx: None = positions 0, 1, ... (BERT). An id = RoBERTa's
            positions: real tokens count from ``position_padding_idx + 1`` and tokens
            equal to that id (padding) take position ``position_padding_idx``, so the
            longest input is ``max_position_embeddings - position_padding_idx - 1``.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 512
    num_labels: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    norm_first: bool = True
    layer_norm_eps_blocks: float | None = None
    token_types: int = 0
    pooler: bool = False
    classifier_pooling: str = "cls"
    classifier_head: str = "linear"
    classifier_dropout: float | None = None
    position_padding_idx: int | None = None

    def __post_init__(self):
        _check_fields(self, sizes=("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size",
                                   "max_position_embeddings", "num_labels"),
                      counts=("num_hidden_layers",), probabilities=("hidden_dropout_prob",
                                                                    "attention_probs_dropout_prob"),
                      epsilons=("layer_norm_eps",), flags=("norm_first", "pooler"))
        _set(self, "token_types", check_size("EncoderConfig.token_types", self.token_types, least=0))
        if self.layer_norm_eps_blocks is not None:
            _set(self, "layer_norm_eps_blocks",
                 check_positive_float("EncoderConfig.layer_norm_eps_blocks", self.layer_norm_eps_blocks))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.classifier_pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling must be 'cls' or 'mean', got {self.classifier_pooling!r}")
        if self.classifier_head not in ("linear", "relu", "tanh"):
            raise ValueError(f"classifier_head must be 'linear', 'relu' or 'tanh', got {self.classifier_head!r}")
        if self.classifier_dropout is not None:
            _set(self, "classifier_dropout",
                 check_probability("EncoderConfig.classifier_dropout", self.classifier_dropout))
        if self.position_padding_idx is not None:
            _set(self, "position_padding_idx", check_size("EncoderConfig.position_padding_idx",
                                                          self.position_padding_idx, least=0))
            if self.position_padding_idx + 1 >= self.max_position_embeddings:
                raise ValueError(f"position_padding_idx ({self.position_padding_idx}) leaves no positions in a "
                                 f"table of max_position_embeddings={self.max_position_embeddings}")
        supported = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in supported:
            raise ValueError(f"EncoderConfig.hidden_act {self.hidden_act!r} is not supported ({', '.join(supported)})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def head_dropout(self) -> float:
        """The classifier head's dropout (``classifier_dropout``, else ``hidden_dropout_prob``)."""
        return self.hidden_dropout_prob if self.classifier_dropout is None else self.classifier_dropout

    @property
    def max_length(self) -> int:
        """The longest input: the position table, less RoBERTa's offset (``position_padding_idx + 1``)."""
        offset = 0 if self.position_padding_idx is None else self.position_padding_idx + 1
        return self.max_position_embeddings - offset

    @property
    def block_eps(self) -> float:
        """eps of the LayerNorms inside an encoder layer (see ``layer_norm_eps_blocks``)."""
        if self.layer_norm_eps_blocks is not None:
            return self.layer_norm_eps_blocks
        return 1e-5 if self.norm_first else self.layer_norm_eps

    @classmethod
    def from_any(cls, config) -> EncoderConfig:
        """Convert a duck-typed config (BertConfig, SimpleNamespace, dict) to this class."""
        if isinstance(config, cls):
            return config
        get = config.get if isinstance(config, dict) else (lambda k, d: getattr(config, k, d))
        values = {}
        for f in dataclasses.fields(cls):
            value = get(f.name, f.default)
            if value is None and f.name == "attention_probs_dropout_prob":
                value = 0.0
            values[f.name] = value
        return cls(**values)

    @classmethod
    def bert(cls, config) -> EncoderConfig:
        """The encoder with BERT's options, from a BERT config (dict, ``BertConfig``, namespace)."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        # BERT options this encoder does not implement: refuse rather than compute something else
        for name, plain in (("position_embedding_type", "absolute"), ("is_decoder", False),
                            ("add_cross_attention", False)):
            if get(name, plain) not in (plain, None):
                raise ValueError(f"BERT option {name}={get(name, plain)!r} is not supported (only {plain!r})")
        base = cls.from_any(config)
        attention_dropout = get("attention_probs_dropout_prob", 0.1)
        try:
            return dataclasses.replace(
                base, norm_first=False, layer_norm_eps_blocks=None, pooler=True,
                token_types=get("type_vocab_size", 2),
                attention_probs_dropout_prob=0.0 if attention_dropout is None else attention_dropout)
        except ValueError as error:  # name the BERT field, not ours
            raise ValueError(str(error).replace("EncoderConfig.token_types", "type_vocab_size")) from None

    @classmethod
    def distilbert(cls, config) -> EncoderConfig:
        """The encoder with DistilBERT's options, from its ``config.json`` names (``dim``,
        ``n_layers``, ...): post-LN with eps 1e-12 everywhere, no token types, no pooler."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        return cls(vocab_size=get("vocab_size", 30522), hidden_size=get("dim", 768), num_hidden_layers=get("n_layers", 6),
                   num_attention_heads=get("n_heads", 12), intermediate_size=get("hidden_dim", 3072),
                   hidden_dropout_prob=get("dropout", 0.1), attention_probs_dropout_prob=get("attention_dropout", 0.1),
                   max_position_embeddings=get("max_position_embeddings", 512), hidden_act=get("activation", "gelu"),
                   layer_norm_eps=1e-12, norm_first=False, token_types=0, pooler=False,
                   classifier_head="relu", classifier_dropout=get("seq_classif_dropout", 0.2))

    @classmethod
    def roberta(cls, config, *, pooler: bool = True) -> EncoderConfig:
        """BERT's options plus RoBERTa's positions (from ``pad_token_id + 1``, padding skipped)
        and its classifier head; ``pooler=False`` for ``RobertaForSequenceClassification``'s body."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        base = cls.bert(config)
        try:
            return dataclasses.replace(base, position_padding_idx=get("pad_token_id", 1), pooler=pooler,
                                       classifier_head="tanh")
        except ValueError as error:  # name RoBERTa's field, not ours
            raise ValueError(str(error).replace("EncoderConfig.position_padding_idx", "pad_token_id")) from None

    @property
    def hf_model_type(self) -> str | None:
        """The transformers ``model_type`` this encoder is, or None (a notebook-style encoder)."""
        if self.norm_first:
            return None
        if self.position_padding_idx is not None:
            return "roberta" if self.token_types else None
        if not self.token_types and not self.pooler and self.layer_norm_eps == self.block_eps == 1e-12:
            return "distilbert"
        return "bert" if self.token_types and self.pooler else None

    def to_hf_dict(self) -> dict:
        """A transformers ``config.json`` for this encoder (BERT, DistilBERT or RoBERTa; ``hf_model_type``)."""
        kind = self.hf_model_type
        if kind == "bert":
            return self.to_bert_dict()
        if kind == "roberta":
            return {**self.to_bert_dict(check=False), "architectures": ["RobertaModel"], "model_type": "roberta",
                    "pad_token_id": self.position_padding_idx, "bos_token_id": 0, "eos_token_id": 2,
                    "classifier_dropout": self.classifier_dropout}
        if kind == "distilbert":
            return dict(architectures=["DistilBertModel"], model_type="distilbert", vocab_size=self.vocab_size,
                        dim=self.hidden_size, n_layers=self.num_hidden_layers, n_heads=self.num_attention_heads,
                        hidden_dim=self.intermediate_size, dropout=self.hidden_dropout_prob,
                        attention_dropout=self.attention_probs_dropout_prob, activation=self.hidden_act,
                        max_position_embeddings=self.max_position_embeddings, sinusoidal_pos_embds=False,
                        initializer_range=0.02, qa_dropout=0.1, seq_classif_dropout=self.head_dropout,
                        pad_token_id=0, tie_word_embeddings=True)
        raise ValueError("this encoder is not a BERT, DistilBERT or RoBERTa (EncoderConfig.bert, .distilbert, "
                         f".roberta), so it has no transformers equivalent: norm_first={self.norm_first}, "
                         f"token_types={self.token_types}, pooler={self.pooler}, "
                         f"position_padding_idx={self.position_padding_idx}")

    def to_bert_dict(self, *, check: bool = True) -> dict:
        """A transformers ``config.json`` for this (BERT-style) encoder."""
        if check and (self.norm_first or not self.pooler):
            raise ValueError("only a BERT-style encoder (norm_first=False, pooler=True) has a BERT config")
        return dict(architectures=["BertModel"], model_type="bert", vocab_size=self.vocab_size,
                    hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                    num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
                    hidden_act=self.hidden_act, hidden_dropout_prob=self.hidden_dropout_prob,
                    attention_probs_dropout_prob=self.attention_probs_dropout_prob,
                    max_position_embeddings=self.max_position_embeddings, type_vocab_size=self.token_types,
                    layer_norm_eps=self.layer_norm_eps, initializer_range=0.02, pad_token_id=0,
                    position_embedding_type="absolute")

    # -------------------------------------------------------------- presets

    @classmethod
    def tiny(cls, **kw) -> EncoderConfig:
        """For tests: 2 layers of width 32."""
        return cls(**{**dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=64), **kw})

    @classmethod
    def small(cls, **kw) -> EncoderConfig:
        """A CPU-sized encoder: 4 layers of width 256."""
        return cls(**{**dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                             intermediate_size=1024), **kw})

    @classmethod
    def base(cls, **kw) -> EncoderConfig:
        """bert-base-uncased's shape (the config notebook 001 loads)."""
        return cls(**kw)


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 (HuggingFace's ``GPT2Config`` names), for ``gpt.GPT2LMHeadModel``.

    Pre-LN blocks, tanh GELU, a final LayerNorm, learned positions, and (by default)
    the output projection tied to the token embeddings.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # None: 4 * n_embd
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True

    def __post_init__(self):
        _check_fields(self, sizes=("vocab_size", "n_positions", "n_embd", "n_head"), counts=("n_layer",),
                      probabilities=("resid_pdrop", "embd_pdrop", "attn_pdrop"), epsilons=("layer_norm_epsilon",),
                      flags=("tie_word_embeddings",))
        if self.n_inner is not None:
            _set(self, "n_inner", check_size("GPTConfig.n_inner", self.n_inner))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        supported = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu")
        if not isinstance(self.activation_function, str) or self.activation_function not in supported:
            raise ValueError(f"GPTConfig.activation_function {self.activation_function!r} is not supported "
                             f"({', '.join(supported)})")

    @property
    def inner(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @classmethod
    def from_any(cls, config) -> GPTConfig:
        """From a ``GPT2Config``, a dict (config.json) or a namespace; missing names take defaults."""
        if isinstance(config, cls):
            return config
        get = config.get if isinstance(config, dict) else (lambda k, d: getattr(config, k, d))
        # GPT-2 switches this model does not implement: refuse rather than compute something else
        for name, plain in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                            ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
            if get(name, plain) != plain:
                raise ValueError(f"GPT-2 option {name}={get(name, plain)!r} is not supported (only {plain!r})")
        return cls(**{f.name: get(f.name, f.default) for f in dataclasses.fields(cls)})

    def to_hf_dict(self) -> dict:
        """A transformers ``config.json`` for ``GPT2LMHeadModel``."""
        return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", **dataclasses.asdict(self),
                    initializer_range=0.02, n_ctx=self.n_positions)

    @classmethod
    def tiny(cls, **kw) -> GPTConfig:
        return cls(**{**dict(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4), **kw})

    @classmethod
    def small(cls, **kw) -> GPTConfig:
        """GPT-2 small (124M)."""
        return cls(**kw)
