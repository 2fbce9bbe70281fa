"""The mixture of experts of the llama family in Flax NNX: the router, the experts held fused, the
load-balancing loss. ``llama.LlamaSparseMoeBlock`` puts them together (with Qwen2-MoE's shared expert);
GPT-OSS's block is ``GptOssMLP`` here (``router`` and ``experts``, both with biases).

The twin of ``torch_reference.moe``: same class names and parameter paths (``mlp.gate.weight`` (E, H),
``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``). The experts' kernels are stored as Flax
kernels are, input first: ``gate_up_proj`` (E, H, 2I) (gate in the first I columns, up in the last)
and ``down_proj`` (E, I, H); torch holds them (E, 2I, H) and (E, H, I), and porting transposes the two
named axes (``layer_kinds``: ``Layout("e out in", "e in out")``).

Ways to run the experts, one result (``LlamaExperts.implementation``, or ``set_experts``):

* ``"grouped"`` (the default): every expert computes only its own tokens, with no capacity and no
  token dropped: ``"blocked"`` on the CPU, ``"ragged"`` on the other backends;
* ``"ragged"``: the (token, choice) pairs sorted by expert, each expert's rows one group of
  ``jax.lax.ragged_dot`` (XLA's CPU backend runs it as slowly as the dense path or slower);
* ``"blocked"``: the sorted pairs padded per expert to whole blocks of ``block_rows`` rows (at most
  T k + E (block_rows - 1) rows, a static bound: dropless), a loop over the used blocks each
  multiplying by its expert's matrix, with its own backward (the same loop for the input's
  gradient, the weights' gradient accumulated per block into its expert);
* ``"dense"``: every expert on every token, the k chosen outputs picked after (E / k times the
  work: the reference the grouped paths are tested against).

Both weight each token's k outputs and sum them over its k choices in top-k's order (largest first),
as transformers' default ``grouped_mm`` does.

GPT-OSS (``GptOssTopKRouter``, ``GptOssExperts``, ``GptOssMLP``: transformers' names and layouts). Its
experts are already stored input first in transformers (``gate_up_proj`` (E, H, 2I), gate and up
interleaved column by column, ``down_proj`` (E, I, H), and biases (E, 2I), (E, H)), which is the Flax
kernel layout: the arrays port as they are (``layer_kinds``: ``"gpt_oss_experts"``, no transpose) and
stay interleaved, the gating reading the even and odd columns. They run on the same four
implementations as ``LlamaExperts`` (``run_experts``: the gating is a function, each row's expert adds
its bias), and ``set_experts`` reaches them too.

DeepSeek-V3 (``DeepseekV3TopkRouter``, ``DeepseekV3MoE``: transformers' names): sigmoid scores in float32,
the experts chosen by the scores plus ``e_score_correction_bias`` within the best groups and weighted by
the scores alone (``group_limited_route``), ``LlamaExperts``, and the always-on ``shared_experts``. The
router's ``weight`` and bias are stored in float32 whatever ``param_dtype`` is, as transformers keeps
them (``_keep_in_fp32_modules_strict``); the bias only chooses, so its gradient is zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from flax_transformer.models.constructor_records import RecordsInit
from flax_transformer.models.layers import ACTIVATIONS
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.models.llama_layers import LlamaMLP

__all__ = ["IMPLEMENTATIONS", "DeepseekV3MoE", "DeepseekV3TopkRouter", "GptOssExperts", "GptOssMLP", "GptOssTopKRouter",
           "LlamaExperts", "LlamaTopKRouter", "group_limited_route", "load_balancing_loss", "route", "run_experts",
           "set_experts"]

IMPLEMENTATIONS = ("grouped", "ragged", "blocked", "dense")
BLOCK_ROWS = 128  # "blocked": the most rows of one block (fewer when the experts get fewer rows on average)
_normal = nnx.initializers.normal(0.02)  # transformers' initializer_range


def route(logits, top_k: int, norm_topk_prob: bool, fp32_weights: bool):
    """Router logits (T, E) -> (weights (T, k), experts (T, k)): softmax over all experts in float32,
    the top k (largest first), divided by their sum if ``norm_topk_prob``; the weights stay float32
    with ``fp32_weights`` (Mixtral), else they take the logits' dtype."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return (weights if fp32_weights else weights.astype(logits.dtype)), experts


class LlamaTopKRouter(RecordsInit, nnx.Module):
    """The gate: ``weight`` (E, H), no bias, as torch's. (T, H) -> (logits (T, E), weights (T, k), experts (T, k))."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        moe = config.moe
        self.top_k, self.norm_topk_prob, self.fp32_weights = (moe.num_experts_per_tok, moe.norm_topk_prob,
                                                              moe.fp32_routing_weights)
        self.dtype = dtype
        self.weight = nnx.Param(_normal(rngs.params(), (moe.num_experts, config.hidden_size), param_dtype))

    def __call__(self, x):
        logits = x.astype(self.dtype) @ self.weight[...].astype(self.dtype).T
        weights, experts = route(logits, self.top_k, self.norm_topk_prob, self.fp32_weights)
        return logits, weights, experts


class LlamaExperts(RecordsInit, nnx.Module):
    """E gated MLPs held fused: ``gate_up_proj`` (E, H, 2I), ``down_proj`` (E, I, H).

    ``__call__(x (T, H), experts (T, k), weights (T, k))`` -> (T, H): for each token,
    sum_j weights[t, j] * (act(x @ gate[e]) * (x @ up[e])) @ down[e] with e = experts[t, j].
    """

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        moe = config.moe
        e, inner, hidden = moe.num_experts, moe.moe_intermediate_size, config.hidden_size
        self.num_experts, self.intermediate_size, self.dtype = e, inner, dtype
        self.hidden_act = config.hidden_act
        self.implementation = "grouped"
        self.gate_up_proj = nnx.Param(_normal(rngs.params(), (e, hidden, 2 * inner), param_dtype))
        self.down_proj = nnx.Param(_normal(rngs.params(), (e, inner, hidden), param_dtype))

    def __call__(self, x, experts, weights):
        return self.run_on(x, experts, weights, self.gate_up_proj[...], self.down_proj[...])

    def run_on(self, x, experts, weights, gate_up_proj, down_proj):
        """The experts on the weights given, ``gate_up_proj`` (E, H, 2I) and ``down_proj`` (E, I, H), in place
        of their own: the hook through which ``lora_experts.LoRAExperts`` runs them on adapted weights.
        (T, H), (T, k), (T, k) -> (T, H), as ``__call__``."""
        gate = functools.partial(_gated, act=ACTIVATIONS[self.hidden_act], inner=self.intermediate_size)
        return run_experts(self.implementation, x, experts, weights, gate_up_proj, down_proj, gate, dtype=self.dtype)


def run_experts(implementation: str, x, experts, weights, gate_up_proj, down_proj, gate, gate_up_bias=None,
                down_bias=None, *, dtype=jnp.float32):
    """The experts' shared body, one of ``IMPLEMENTATIONS``: (T, H), (T, k), (T, k) -> (T, H).

    ``gate_up_proj`` (E, H, G) and ``down_proj`` (E, I, H); ``gate`` maps a row's (.., G) to (.., I)
    (``LlamaExperts``: act(first half) * second half; ``GptOssExperts``: the clamped SwiGLU on
    interleaved columns); ``gate_up_bias`` (E, G) and ``down_bias`` (E, H), when given, are added to
    each row of its expert. Each token's k outputs are weighted and summed over its choices.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"the experts' implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    # jnp arrays, also where a caller holds numpy ones (bisect's eager run): a loop indexes them by tracers
    x, gate_up, down = (jnp.asarray(a, dtype) for a in (x, gate_up_proj, down_proj))
    biases = tuple(None if b is None else jnp.asarray(b, dtype) for b in (gate_up_bias, down_bias))
    if implementation == "grouped":
        implementation = "blocked" if jax.default_backend() == "cpu" else "ragged"
    run = {"ragged": _grouped, "blocked": _blocked, "dense": _dense}[implementation]
    chosen = run(x, experts, gate_up, down, gate, *biases)  # (T, k, H)
    # the wider of the two (Mixtral's fp32 weights on bf16 outputs: fp32 through the sum, as grouped_mm);
    # chosen by width, since strict dtype promotion has no bf16 -> fp32 rule
    wide = weights.dtype if jnp.finfo(weights.dtype).bits > jnp.finfo(chosen.dtype).bits else chosen.dtype
    out = chosen.astype(wide) * weights.astype(wide)[..., None]
    return jnp.sum(out, axis=1).astype(dtype)


def _gated(h, act, inner: int):
    return act(h[..., :inner]) * h[..., inner:]


def _plus(h, bias, rows_expert):
    """h (.., N) plus each row's expert's bias (E, N); ``rows_expert`` indexes the bias rows like h's leading axes."""
    return h if bias is None else h + bias[rows_expert]


def _grouped(x, experts, gate_up, down, gate, gate_up_bias=None, down_bias=None):
    """(T, k, H): each (token, choice) pair's expert output, the pairs sorted by expert and run as
    one ragged group per expert."""
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # (T k,): pairs grouped by expert, tokens in order within
    sizes = jnp.bincount(flat, length=gate_up.shape[0]).astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)  # (T k, H)
    sorted_expert = flat[order]
    h = gate(_plus(jax.lax.ragged_dot(rows, gate_up, sizes), gate_up_bias, sorted_expert))
    out = _plus(jax.lax.ragged_dot(h, down, sizes), down_bias, sorted_expert)  # (T k, H), sorted
    return jnp.take(out, jnp.argsort(order), axis=0).reshape(tokens, k, -1)


def _block_rows(pairs: int, experts: int) -> int:
    """Rows per block: the power of two nearest above the mean rows per expert, 8 to ``BLOCK_ROWS``."""
    mean = -(-pairs // experts)
    return max(8, min(BLOCK_ROWS, 1 << (mean - 1).bit_length()))


def _blocked(x, experts, gate_up, down, gate, gate_up_bias=None, down_bias=None):
    """(T, k, H): the pairs sorted by expert, padded per expert to whole blocks, one matmul per used block."""
    tokens, k = experts.shape
    num_experts, hidden = gate_up.shape[0], x.shape[1]
    flat = experts.reshape(-1)
    pairs = flat.shape[0]
    rows_per = _block_rows(pairs, num_experts)
    blocks = -(-(pairs + num_experts * (rows_per - 1)) // rows_per)  # the dropless bound, in blocks
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    padded = -(-sizes // rows_per) * rows_per
    padded_end = jnp.cumsum(padded)
    shift = (padded_end - padded) - (jnp.cumsum(sizes) - sizes)  # padded start - start, per expert
    slot = jnp.arange(pairs, dtype=jnp.int32) + shift[flat[order]]  # the padded row of each sorted pair
    source = jnp.full((blocks * rows_per,), tokens, jnp.int32).at[slot].set(order // k)  # token of each row
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(blocks) * rows_per, side="right"),
                               num_experts - 1).astype(jnp.int32)
    used = (padded_end[-1] // rows_per).astype(jnp.int32)
    rows = jnp.concatenate([x, jnp.zeros((1, hidden), x.dtype)])[source].reshape(blocks, rows_per, hidden)
    row_expert = block_expert[:, None]  # (blocks, 1): a padded row's bias is never read back
    h = gate(_plus(_block_matmul(rows, gate_up, block_expert, used), gate_up_bias, row_expert))
    out = _plus(_block_matmul(h, down, block_expert, used), down_bias, row_expert).reshape(blocks * rows_per, hidden)
    where = jnp.zeros((pairs,), jnp.int32).at[order].set(slot)  # the padded row of each (token, choice)
    return out[where].reshape(tokens, k, hidden)


def _block_loop(rows, weights, block_expert, used):
    """(n, B, K) x (E, K, N) -> (n, B, N): block b times weights[block_expert[b]], for b < used (zeros after)."""
    def body(b, out):
        return out.at[b].set(rows[b] @ weights[block_expert[b]])

    return jax.lax.fori_loop(0, used, body, jnp.zeros(rows.shape[:2] + weights.shape[2:], rows.dtype))


def _weight_grad(rows, grads, block_expert, used, num_experts: int):
    def body(b, total):
        return total.at[block_expert[b]].add(rows[b].T @ grads[b])

    return jax.lax.fori_loop(0, used, body, jnp.zeros((num_experts, rows.shape[2], grads.shape[2]), rows.dtype))


@jax.custom_vjp
def _block_matmul(rows, weights, block_expert, used):
    return _block_loop(rows, weights, block_expert, used)


def _block_matmul_fwd(rows, weights, block_expert, used):
    return _block_loop(rows, weights, block_expert, used), (rows, weights, block_expert, used)


def _block_matmul_bwd(saved, grads):
    rows, weights, block_expert, used = saved
    d_rows = _block_loop(grads, jnp.swapaxes(weights, 1, 2), block_expert, used)
    d_weights = _weight_grad(rows, grads, block_expert, used, weights.shape[0]).astype(weights.dtype)
    return d_rows, d_weights, None, None


_block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def _dense(x, experts, gate_up, down, gate, gate_up_bias=None, down_bias=None):
    """(T, k, H): every expert on every token, then each token's chosen k."""
    every = jnp.arange(gate_up.shape[0])
    h = gate(_plus(jnp.einsum("th,ehi->eti", x, gate_up), gate_up_bias, every[:, None]))  # (E, T, I)
    out = _plus(jnp.einsum("eti,eih->teh", h, down), down_bias, every[None, :])  # (T, E, H)
    return jnp.take_along_axis(out, experts[..., None], axis=1)


# ------------------------------------------------------------------ GPT-OSS


def _clamped_swiglu(h, limit: float, alpha: float):
    """GPT-OSS's gating on interleaved columns (gate even, up odd): (up' + 1) * g * sigmoid(alpha g) with
    g = min(gate, limit), up' = clip(up, -limit, limit). ``where``, not ``minimum``: the gradient at the
    limit itself passes, as torch's ``clamp`` lets it."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = jnp.where(gate > limit, limit, gate)
    up = jnp.where(up > limit, limit, jnp.where(up < -limit, -limit, up))
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class GptOssTopKRouter(RecordsInit, nnx.Module):
    """GPT-OSS's router: ``weight`` (E, H) and ``bias`` (E,). (T, H) -> (logits (T, E), scores (T, k),
    experts (T, k)): the k largest logits, then the softmax of those k alone (its statistics in float32,
    where transformers' run in the logits' dtype), the scores in the logits' dtype."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        moe = config.moe
        self.top_k, self.dtype = moe.num_experts_per_tok, dtype
        self.weight = nnx.Param(_normal(rngs.params(), (moe.num_experts, config.hidden_size), param_dtype))
        self.bias = nnx.Param(_normal(rngs.params(), (moe.num_experts,), param_dtype))  # transformers' init: both normal

    def __call__(self, x):
        logits = x.astype(self.dtype) @ self.weight[...].astype(self.dtype).T + self.bias[...].astype(self.dtype)
        top, experts = jax.lax.top_k(logits, self.top_k)
        return logits, jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(logits.dtype), experts


class GptOssExperts(RecordsInit, nnx.Module):
    """GPT-OSS's E experts held fused, in transformers' layout (already input first): ``gate_up_proj``
    (E, H, 2I) with gate and up interleaved column by column, ``gate_up_proj_bias`` (E, 2I), ``down_proj``
    (E, I, H), ``down_proj_bias`` (E, H).

    ``__call__(x (T, H), experts (T, k), weights (T, k))`` -> (T, H): for each token, sum_j weights[t, j] *
    (swiglu(x @ gate_up[e] + gate_up_bias[e]) @ down[e] + down_bias[e]) with e = experts[t, j] and the
    clamped SwiGLU of ``MoeConfig.swiglu_limit`` / ``swiglu_alpha``. ``implementation`` as ``LlamaExperts``'s.
    """

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        moe = config.moe
        e, inner, hidden = moe.num_experts, moe.moe_intermediate_size, config.hidden_size
        self.num_experts, self.intermediate_size, self.dtype = e, inner, dtype
        self.limit, self.alpha = moe.swiglu_limit, moe.swiglu_alpha
        self.implementation = "grouped"
        self.gate_up_proj = nnx.Param(_normal(rngs.params(), (e, hidden, 2 * inner), param_dtype))
        self.gate_up_proj_bias = nnx.Param(jnp.zeros((e, 2 * inner), param_dtype))
        self.down_proj = nnx.Param(_normal(rngs.params(), (e, inner, hidden), param_dtype))
        self.down_proj_bias = nnx.Param(jnp.zeros((e, hidden), param_dtype))

    def __call__(self, x, experts, weights):
        return self.run_on(x, experts, weights, self.gate_up_proj[...], self.down_proj[...])

    def run_on(self, x, experts, weights, gate_up_proj, down_proj):
        """As ``LlamaExperts.run_on``: the experts (with their own biases) on the weights given, the hook
        through which ``lora_experts.GptOssLoRAExperts`` runs them on adapted weights."""
        gate = functools.partial(_clamped_swiglu, limit=self.limit, alpha=self.alpha)
        return run_experts(self.implementation, x, experts, weights, gate_up_proj, down_proj,
                           gate, self.gate_up_proj_bias[...], self.down_proj_bias[...], dtype=self.dtype)


class GptOssMLP(RecordsInit, nnx.Module):
    """GPT-OSS's sparse block: ``router`` then ``experts``. (b, t, H) -> ((b, t, H), router scores (b t, k));
    ``router_logits``, a list, gets the (b t, E) logits, as transformers records them."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.router = GptOssTopKRouter(config, **kw)
        self.experts = GptOssExperts(config, **kw)

    def __call__(self, x, router_logits=None):
        b, t, _ = x.shape
        flat = x.astype(self.dtype).reshape(-1, self.hidden_size)  # (b t, H)
        logits, scores, experts = self.router(flat)
        if router_logits is not None:
            router_logits.append(logits)
        return self.experts(flat, experts, scores).reshape(b, t, -1), scores


def set_experts(model, implementation: str):
    """Run every ``LlamaExperts`` and ``GptOssExperts`` of ``model`` one of ``IMPLEMENTATIONS``; returns how many there are."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    found = [node for _, node in nnx.iter_graph(model) if isinstance(node, (LlamaExperts, GptOssExperts))]
    for node in found:
        node.implementation = implementation
    return len(found)


def load_balancing_loss(router_logits, num_experts: int, top_k: int, attention_mask=None):
    """Switch Transformer's auxiliary loss as transformers computes it (``load_balancing_loss_func``).

    ``router_logits``: one (b * t, E) array per sparse layer. Over every layer's tokens (the padded
    ones left out when ``attention_mask`` (b, t) is given): ``E * sum_e f_e * P_e``, where f_e is the
    fraction of the k choices that went to expert e and P_e the mean router probability of e. It is
    k for a perfectly even load. The softmax runs in the logits' dtype, as transformers' does.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one sparse layer")
    counts = probs_sum = rows = 0.0
    for logits in router_logits:
        probs = jax.nn.softmax(logits, axis=-1)
        _, chosen = jax.lax.top_k(probs, top_k)
        hits = jnp.sum(jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32), axis=1)  # (T, E)
        probs = probs.astype(jnp.float32)
        if attention_mask is None:
            keep = jnp.ones((logits.shape[0],), jnp.float32)
        else:
            keep = jnp.reshape(attention_mask, (-1,)).astype(jnp.float32)
            if keep.shape[0] != logits.shape[0]:
                raise ValueError(f"attention_mask has {keep.shape[0]} positions, the router logits {logits.shape[0]}")
        counts = counts + jnp.sum(hits * keep[:, None], axis=0)
        probs_sum, rows = probs_sum + jnp.sum(probs * keep[:, None], axis=0), rows + jnp.sum(keep)
    return num_experts * jnp.sum((counts / rows) * (probs_sum / rows))


def group_limited_route(logits, bias, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                        scaling: float):
    """DeepSeek-V3's choice, as transformers' ``DeepseekV3TopkRouter``: logits (T, E) -> (weights (T, k),
    experts (T, k)). Scores are ``sigmoid(logits)``; the experts are chosen by ``scores + bias`` (the
    correction bias) among the ``topk_group`` groups whose two best corrected scores sum highest, and
    weighted by the scores alone, divided by their sum (+ 1e-20) if ``norm_topk_prob``, times ``scaling``."""
    scores = jax.nn.sigmoid(logits)
    choice = scores + jax.lax.stop_gradient(bias)
    tokens, experts = scores.shape
    group_scores = jax.lax.top_k(choice.reshape(tokens, n_group, experts // n_group), 2)[0].sum(axis=-1)
    groups = jax.lax.top_k(group_scores, topk_group)[1]  # (T, topk_group)
    kept = jnp.any(groups[..., None] == jnp.arange(n_group), axis=-2)  # (T, n_group)
    choice = jnp.where(jnp.repeat(kept, experts // n_group, axis=-1), choice, -jnp.inf)
    chosen = jax.lax.top_k(choice, top_k)[1]
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, chosen


class DeepseekV3TopkRouter(RecordsInit, nnx.Module):
    """DeepSeek-V3's gate: ``weight`` (E, H) and ``e_score_correction_bias`` (E,), stored in float32. (T, H) ->
    (logits (T, E), weights (T, k), experts (T, k)), the logits and weights in float32."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        moe = config.moe
        self.top_k, self.n_group, self.topk_group = moe.num_experts_per_tok, moe.n_group, moe.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = moe.norm_topk_prob, moe.routed_scaling_factor
        # the statistics' type: float32, or float64 in a float64 model (no implicit bf16 -> fp32 promotion)
        self.dtype = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
        self.weight = nnx.Param(_normal(rngs.params(), (moe.num_experts, config.hidden_size), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((moe.num_experts,), jnp.float32))

    def __call__(self, x):
        logits = x.astype(self.dtype) @ self.weight[...].astype(self.dtype).T
        weights, experts = group_limited_route(logits, self.e_score_correction_bias[...].astype(self.dtype),
                                               self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
                                               self.routed_scaling_factor)
        return logits, weights, experts


class DeepseekV3MoE(RecordsInit, nnx.Module):
    """DeepSeek-V3's sparse block: ``gate``, ``experts`` and the always-on ``shared_experts`` (one gated MLP of
    ``n_shared_experts * moe_intermediate_size``, no gate). (b, t, H) -> (b, t, H); ``router_logits``, a
    list, gets the (b t, E) logits."""

    _init_converters = {"config": LlamaConfig.from_any}

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        config = LlamaConfig.from_any(config)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        moe = config.moe
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.gate = DeepseekV3TopkRouter(config, **kw)
        self.experts = LlamaExperts(config, **kw)
        self.shared_experts = LlamaMLP(config, moe.moe_intermediate_size * moe.n_shared_experts, **kw) \
            if moe.n_shared_experts else None

    def __call__(self, x, router_logits=None):
        b, t, _ = x.shape
        flat = x.astype(self.dtype).reshape(-1, self.hidden_size)
        logits, weights, experts = self.gate(flat)
        if router_logits is not None:
            router_logits.append(logits)
        out = self.experts(flat, experts, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(b, t, -1)
