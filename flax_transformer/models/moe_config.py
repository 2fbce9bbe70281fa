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
deepseek_v3    ``n_routed_experts``   ``moe_intermediate_..`` ``norm_topk_prob``   sigmoid scores, group-limited
                                                              (+ 1e-20)            choice with a correction bias,
                                                                                   ``routed_scaling_factor``,
                                                                                   ``n_shared_experts``, dense
                                                                                   first layers
=============  =====================  ======================  ===================  =============================

Every router but GPT-OSS's is transformers': a bias-free linear gate, softmax over all experts in
float32, then the top ``num_experts_per_tok`` (softmax before top-k), renormalised where the row
says. GPT-OSS's (``GptOssMLP``) has a bias and takes the softmax of the top k logits. DeepSeek-V3's
(``DeepseekV3TopkRouter``) scores every expert with a sigmoid in float32 and chooses by the scores plus
``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups, weighting by the scores
alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from flax_transformer.models.arg_checks import check_positive_float, check_size, shown
from flax_transformer.models.configs import _check_fields, _set

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3")
# transformers' defaults (its DeepSeek-V3 adds no load-balancing loss: the correction bias balances instead)
_AUX_COEF = {"mixtral": 0.001, "qwen2_moe": 0.001, "qwen3_moe": 0.001, "olmoe": 0.01, "gpt_oss": 0.001,
             "deepseek_v3": 0.0}


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
        n_group, topk_group: DeepSeek-V3's group-limited choice: the experts in ``n_group`` equal groups,
            a group scored by the sum of its two best (bias-corrected) scores, the top k chosen among the
            ``topk_group`` best groups only.
        routed_scaling_factor: DeepSeek-V3's routing weights are multiplied by it (after renormalising).
        n_shared_experts: DeepSeek-V3's always-on ``shared_experts``, one gated MLP of
            ``n_shared_experts * moe_intermediate_size`` (0: none).
        first_k_dense_replace: DeepSeek-V3's first layers are dense (``LlamaConfig.intermediate_size``).
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
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0

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
        for name in ("swiglu_limit", "swiglu_alpha", "routed_scaling_factor"):
            _set(self, name, check_positive_float(f"MoeConfig.{name}", getattr(self, name)))
        _check_fields(self, sizes=("n_group", "topk_group"), counts=("n_shared_experts", "first_k_dense_replace"))
        e, groups = self.num_experts, self.n_group
        if e % groups or self.topk_group > groups:
            raise ValueError(f"MoeConfig: n_group ({groups}) must divide num_experts ({e}) and topk_group "
                             f"({self.topk_group}) be at most n_group")
        if groups > 1 and e // groups < 2:  # a group is scored by its two best experts
            raise ValueError(f"MoeConfig: each of the n_group={groups} groups needs 2 or more experts, "
                             f"num_experts={e} gives {e // groups}")
        if self.num_experts_per_tok > self.topk_group * (e // groups):
            raise ValueError(f"MoeConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be at most the "
                             f"experts of topk_group={self.topk_group} groups ({self.topk_group * (e // groups)})")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has the sparse block (else a dense MLP), as transformers decides."""
        return (layer_idx >= self.first_k_dense_replace and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    # -------------------------------------------------------------- transformers

    @classmethod
    def from_hf(cls, get, kind: str) -> MoeConfig:
        """From a transformers config's getter (``get(name, default)``) of model_type ``kind``."""
        if kind not in MOE_TYPES:
            raise ValueError(f"model_type {kind!r} has no mixture of experts ({', '.join(MOE_TYPES)})")
        # transformers maps one name to the other by kind (Qwen3-MoE saves num_local_experts, Qwen2-MoE num_experts)
        experts = get("num_local_experts", None) or get("num_experts", None) or get("n_routed_experts", None)
        if experts is None:
            raise ValueError(f"a {kind} config needs num_experts (or num_local_experts)")
        qwen = kind in ("qwen2_moe", "qwen3_moe", "deepseek_v3")  # a moe_intermediate_size of their own
        per_token = {"gpt_oss": 4, "deepseek_v3": 8}.get(kind, 2)
        values = dict(num_experts=experts, num_experts_per_tok=get("num_experts_per_tok", None) or per_token,
                      moe_intermediate_size=get("moe_intermediate_size" if qwen else "intermediate_size", None),
                      norm_topk_prob=True if kind in ("mixtral", "gpt_oss") else bool(
                          get("norm_topk_prob", kind == "deepseek_v3")),
                      fp32_routing_weights=kind in ("mixtral", "deepseek_v3"),
                      router_aux_loss_coef=get("router_aux_loss_coef", _AUX_COEF[kind]))
        if values["moe_intermediate_size"] is None:
            raise ValueError(f"a {kind} config needs {'moe_intermediate_size' if qwen else 'intermediate_size'}")
        if kind == "qwen2_moe":
            values["shared_expert_intermediate_size"] = get("shared_expert_intermediate_size", None) or None
        if kind == "deepseek_v3":  # DeepseekV3Config's defaults
            values.update(n_group=get("n_group", None) or 8, topk_group=get("topk_group", None) or 4,
                          routed_scaling_factor=get("routed_scaling_factor", 2.5),
                          n_shared_experts=get("n_shared_experts", 1) or 0,
                          first_k_dense_replace=get("first_k_dense_replace", None) or 0)
        elif qwen:
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
        fp32 = kind in ("mixtral", "deepseek_v3")
        if self.fp32_routing_weights != fp32:
            wrong.append(("fp32_routing_weights", self.fp32_routing_weights, fp32))
        if kind != "deepseek_v3":
            plain = dict(n_group=1, topk_group=1, routed_scaling_factor=1.0, n_shared_experts=0, first_k_dense_replace=0)
            wrong.extend((name, getattr(self, name), value) for name, value in plain.items()
                         if getattr(self, name) != value)
        if kind != "gpt_oss" and (self.swiglu_limit, self.swiglu_alpha) != (7.0, 1.702):
            wrong.append(("swiglu_limit, swiglu_alpha", (self.swiglu_limit, self.swiglu_alpha), "GPT-OSS's only"))
        if (kind == "qwen2_moe") != (self.shared_expert_intermediate_size is not None):
            wrong.append(("shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                          "a size" if kind == "qwen2_moe" else None))
        if kind not in ("qwen2_moe", "qwen3_moe") and (self.decoder_sparse_step != 1 or self.mlp_only_layers):
            wrong.append(("dense layers (decoder_sparse_step, mlp_only_layers)",
                          (self.decoder_sparse_step, self.mlp_only_layers), (1, ())))
        if kind == "deepseek_v3" and self.router_aux_loss_coef:
            wrong.append(("router_aux_loss_coef", self.router_aux_loss_coef, 0.0))
        if kind in ("mixtral", "olmoe", "gpt_oss") and self.moe_intermediate_size != dense_intermediate_size:
            wrong.append(("moe_intermediate_size", self.moe_intermediate_size, dense_intermediate_size))
        if kind != "mixtral" and self.router_jitter_noise:
            wrong.append(("router_jitter_noise", self.router_jitter_noise, 0.0))
        if wrong:
            raise ValueError(f"transformers' {kind} model cannot hold this mixture of experts: " + "; ".join(
                f"{name}={value!r} (a {kind} has {want!r})" for name, value, want in wrong))
        out = dict(num_experts_per_tok=self.num_experts_per_tok, output_router_logits=False)
        if kind != "deepseek_v3":
            out["router_aux_loss_coef"] = self.router_aux_loss_coef
        if kind == "deepseek_v3":
            out.update(n_routed_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                       n_group=self.n_group, topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                       routed_scaling_factor=self.routed_scaling_factor, n_shared_experts=self.n_shared_experts,
                       first_k_dense_replace=self.first_k_dense_replace)
        elif kind == "mixtral":
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
