"""The mixture-of-experts settings of a llama-family decoder: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Pure Python, like ``llama_config``: torch_reference reads it without JAX. ``LlamaConfig.moe`` holds
one ``MoeConfig`` (None for a dense model); ``from_hf`` and ``to_hf`` read and write transformers'
field names for each ``model_type``, which differ:

=============  =====================  ======================  ===================  =============================
model_type     experts                expert width            renormalised top-k   also
=============  =====================  ======================  ===================  =============================
mixtral        ``num_local_experts``  ``intermediate_size``   always               routing weights kept in fp32,
                                                                                   ``router_jitter_noise``
qwen2_moe      ``num_experts``        ``moe_intermediate_..`` ``norm_topk_prob``   a shared expert with a sigmoid
                                                                                   gate; dense layers among sparse
qwen3_moe      ``num_experts``        ``moe_intermediate_..`` ``norm_topk_prob``   dense layers among sparse
olmoe          ``num_experts``        ``intermediate_size``   ``norm_topk_prob``   (q/k norms over the whole width)
gpt_oss        ``num_local_experts``  ``intermediate_size``   always (softmax of   a router and experts with biases,
                                                              the top k logits)    the clamped SwiGLU (``swiglu_*``)
=============  =====================  ======================  ===================  =============================

Every router but GPT-OSS's is transformers': a bias-free linear gate, softmax over all experts in
float32, then the top ``num_experts_per_tok`` (softmax before top-k), renormalised where the row
says. GPT-OSS's (``GptOssMLP``) has a bias and takes the softmax of the top k logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from flax_transformer.models.arg_checks import check_positive_float, check_size, shown
from flax_transformer.models.configs import _check_fields, _set

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
_AUX_COEF = {"mixtral": 0.001, "qwen2_moe": 0.001, "qwen3_moe": 0.001, "olmoe": 0.01, "gpt_oss": 0.001}  # transformers' defaults


@dataclass(frozen=True)
class MoeConfig:
    """The sparse feed-forward blocks of a decoder.

    Attributes:
        num_experts: experts per sparse layer (E).
        num_experts_per_tok: experts each token is routed to (k), 1 <= k <= E.
        moe_intermediate_size: the width of one expert's gated MLP (I).
        shared_expert_intermediate_size: Qwen2-MoE's always-on shared expert, scaled by
            ``sigmoid(shared_expert_gate(x))``; None: no shared expert.
        norm_topk_prob: the k chosen probabilities divided by their sum (Mixtral always).
        fp32_routing_weights: the routing weights stay float32 when the model computes in bf16
            (Mixtral); otherwise they are cast to the compute dtype (the Qwens, OLMoE).
        decoder_sparse_step, mlp_only_layers: layer i is sparse when ``i not in mlp_only_layers``
            and ``(i + 1) % decoder_sparse_step == 0``; the others have a dense ``LlamaMLP`` of
            ``LlamaConfig.intermediate_size``.
        router_aux_loss_coef: the load-balancing loss's weight in the training loss.
        router_jitter_noise: Mixtral's multiplicative U(1 - j, 1 + j) noise on the block's input,
            in train mode only.
        swiglu_limit, swiglu_alpha: GPT-OSS's experts: ``(clamp(up, -limit, limit) + 1) *
            g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 14336
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    fp32_routing_weights: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        _check_fields(self, sizes=("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                   "decoder_sparse_step"),
                      probabilities=("router_jitter_noise",),
                      flags=("norm_topk_prob", "fp32_routing_weights"))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MoeConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                             f"num_experts ({self.num_experts})")
        if self.shared_expert_intermediate_size is not None:
            _set(self, "shared_expert_intermediate_size", check_size(
                "MoeConfig.shared_expert_intermediate_size", self.shared_expert_intermediate_size))
        layers = self.mlp_only_layers
        if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                            and i >= 0 for i in layers):
            raise ValueError(f"MoeConfig.mlp_only_layers must list layer indices >= 0, got {shown(layers)}")
        _set(self, "mlp_only_layers", tuple(sorted(set(layers))))
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0 or coef == float("inf"):
            raise ValueError(f"MoeConfig.router_aux_loss_coef must be a finite number >= 0, got {shown(coef)}")
        _set(self, "router_aux_loss_coef", float(coef))
        for name in ("swiglu_limit", "swiglu_alpha"):
            _set(self, name, check_positive_float(f"MoeConfig.{name}", getattr(self, name)))

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has the sparse block (else a dense MLP), as transformers decides."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    # -------------------------------------------------------------- transformers

    @classmethod
    def from_hf(cls, get, kind: str) -> MoeConfig:
        """From a transformers config's getter (``get(name, default)``) of model_type ``kind``."""
        if kind not in MOE_TYPES:
            raise ValueError(f"model_type {kind!r} has no mixture of experts ({', '.join(MOE_TYPES)})")
        # transformers maps one name to the other by kind (Qwen3-MoE saves num_local_experts, Qwen2-MoE num_experts)
        experts = get("num_local_experts", None) or get("num_experts", None)
        if experts is None:
            raise ValueError(f"a {kind} config needs num_experts (or num_local_experts)")
        qwen = kind in ("qwen2_moe", "qwen3_moe")
        values = dict(num_experts=experts, num_experts_per_tok=get("num_experts_per_tok", 4 if kind == "gpt_oss" else 2),
                      moe_intermediate_size=get("moe_intermediate_size" if qwen else "intermediate_size", None),
                      norm_topk_prob=True if kind in ("mixtral", "gpt_oss") else bool(get("norm_topk_prob", False)),
                      fp32_routing_weights=kind == "mixtral",
                      router_aux_loss_coef=get("router_aux_loss_coef", _AUX_COEF[kind]))
        if values["moe_intermediate_size"] is None:
            raise ValueError(f"a {kind} config needs {'moe_intermediate_size' if qwen else 'intermediate_size'}")
        if kind == "qwen2_moe":
            values["shared_expert_intermediate_size"] = get("shared_expert_intermediate_size", None) or None
        if qwen:
            values.update(decoder_sparse_step=get("decoder_sparse_step", 1),
                          mlp_only_layers=tuple(get("mlp_only_layers", None) or ()))
        if kind == "mixtral":
            values["router_jitter_noise"] = get("router_jitter_noise", 0.0) or 0.0
        if kind == "gpt_oss":
            values.update(swiglu_limit=get("swiglu_limit", 7.0), swiglu_alpha=get("swiglu_alpha", 1.702))
        return cls(**values)

    def to_hf(self, kind: str, dense_intermediate_size: int) -> dict:
        """transformers' fields for model_type ``kind``; refuses what that class cannot hold."""
        wrong = []
        if kind in ("mixtral", "gpt_oss") and not self.norm_topk_prob:
            wrong.append(("norm_topk_prob", False, True))
        if self.fp32_routing_weights != (kind == "mixtral"):
            wrong.append(("fp32_routing_weights", self.fp32_routing_weights, kind == "mixtral"))
        if kind != "gpt_oss" and (self.swiglu_limit, self.swiglu_alpha) != (7.0, 1.702):
            wrong.append(("swiglu_limit, swiglu_alpha", (self.swiglu_limit, self.swiglu_alpha), "GPT-OSS's only"))
        if (kind == "qwen2_moe") != (self.shared_expert_intermediate_size is not None):
            wrong.append(("shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                          "a size" if kind == "qwen2_moe" else None))
        if kind not in ("qwen2_moe", "qwen3_moe") and (self.decoder_sparse_step != 1 or self.mlp_only_layers):
            wrong.append(("dense layers (decoder_sparse_step, mlp_only_layers)",
                          (self.decoder_sparse_step, self.mlp_only_layers), (1, ())))
        if kind in ("mixtral", "olmoe", "gpt_oss") and self.moe_intermediate_size != dense_intermediate_size:
            wrong.append(("moe_intermediate_size", self.moe_intermediate_size, dense_intermediate_size))
        if kind != "mixtral" and self.router_jitter_noise:
            wrong.append(("router_jitter_noise", self.router_jitter_noise, 0.0))
        if wrong:
            raise ValueError(f"transformers' {kind} model cannot hold this mixture of experts: " + "; ".join(
                f"{name}={value!r} (a {kind} has {want!r})" for name, value, want in wrong))
        out = dict(num_experts_per_tok=self.num_experts_per_tok, router_aux_loss_coef=self.router_aux_loss_coef,
                   output_router_logits=False)
        if kind == "mixtral":
            out.update(num_local_experts=self.num_experts, router_jitter_noise=self.router_jitter_noise)
        elif kind == "gpt_oss":
            out.update(num_local_experts=self.num_experts, swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        else:
            out.update(num_experts=self.num_experts, norm_topk_prob=self.norm_topk_prob)
        if kind in ("qwen2_moe", "qwen3_moe"):
            out.update(moe_intermediate_size=self.moe_intermediate_size, decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers))
        if kind == "qwen2_moe":
            out["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return out
