"""Parity of the ``llama`` family against transformers' own classes, and torch against Flax.

Every variant is a transformers model (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``GemmaForCausalLM``) built from a tiny random config
(no download), its ``state_dict`` loaded strictly into ``torch_reference.llama`` and ported to
Flax. Logits and every parameter's gradient are compared with transformers' (torch against
torch, and Flax against transformers with ``compare(grads=True)`` and its float64 budget), then
Flax against torch_reference where queries see no key (transformers gives them the mean of the
values, this library zeros). Inputs reach position 16,388: RoPE scaling errors are zero at
position 0 and grow with it. One compiled Flax step per variant serves both comparisons.

Tolerance: max abs error <= 1e-5 in fp32 with matmul precision "highest" (TOL).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import flax_transformer.models.llama as fl
import flax_transformer.models.llama_layers as fll
import torch_reference.llama as tl
import torch_reference.llama_layers as tll
from flax_transformer.interop import porting
from flax_transformer.models.attention import set_attention
from flax_transformer.models.input_specs import InputSpec
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification import frameworks
from flax_transformer.verification.compare import compare
from flax_transformer.verification.verify import perturb_torch
from parity_tests.conftest import TOL

B, T = 3, 9
OFFSETS = np.array([0, 8190, 16380])  # each row's first position: llama3's and dynamic's context is 8192
BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-5)
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)
LINEAR = dict(rope_type="linear", rope_theta=10000.0, factor=4.0)
DYNAMIC = dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)  # NTK from position 8192 (max_position_embeddings)
# YaRN as GPT-OSS sets it (no truncation), and with DeepSeek's mscale pair and a truncated ramp
YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=4096)
YARN_MSCALE = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                   mscale_all_dim=0.707, original_max_position_embeddings=4096)

# name -> (transformers family, config switches): each switch is one that real checkpoints use. One
# layer where two add nothing (compiling the gradient is most of a variant's time)
VARIANTS = {
    "llama3-gqa-tied": ("Llama", dict(rope_parameters=LLAMA3, max_position_embeddings=131072, head_dim=16,
                                      tie_word_embeddings=True)),
    "linear-mha-biases-gelu": ("Llama", dict(rope_parameters=LINEAR, num_key_value_heads=4, attention_bias=True,
                                             mlp_bias=True, hidden_act="gelu")),
    "mistral-window-dynamic-mqa": ("Mistral", dict(sliding_window=3, rope_parameters=DYNAMIC, num_key_value_heads=1)),
    "qwen2-bias-tied-window": ("Qwen2", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
                                             max_window_layers=1, num_hidden_layers=2)),  # full, then sliding
    "qwen3-qk-norm": ("Qwen3", dict(head_dim=16, num_key_value_heads=1)),
    "gemma": ("Gemma", dict(head_dim=64, num_key_value_heads=1, hidden_act="gelu_pytorch_tanh", pad_token_id=0)),
    # Gemma 2: sandwich norms, caps that bite (scores of a few units against a cap of 1; logits against 2),
    # query_pre_attn_scalar, a 3-key window on layer 0 and a full layer 1
    "gemma2-caps-window": ("Gemma2", dict(head_dim=16, sliding_window=3, attn_logit_softcapping=1.0,
                                          final_logit_softcapping=2.0, query_pre_attn_scalar=10, num_hidden_layers=2,
                                          pad_token_id=0)),
    # Gemma 3: q/k norms in 1 + w, the sliding layer's own RoPE base, linear scaling on the full layer only
    "gemma3-local-rope": ("Gemma3Text", dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                             rope_parameters=dict(full_attention=dict(rope_type="linear", factor=4.0,
                                                                                      rope_theta=1e6),
                                                                  sliding_attention=dict(rope_type="default",
                                                                                         rope_theta=1e4)),
                                             layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2,
                                             pad_token_id=0)),
}
CAUSAL_LM = {"Gemma3Text": "Gemma3"}  # families whose *ForCausalLM is named otherwise than their config


def hf_model(family: str, switches: dict, seed: int = 0):
    """A transformers model of a random tiny config, eager attention, every weight perturbed (fresh
    norms are ones, or Gemma's zeros: a wrong convention would hide). Called as
    ``model(input_ids, attention_mask, position_ids)``, it returns the logits alone."""
    config = getattr(transformers, f"{family}Config")(**{**BASE, **switches})
    config._attn_implementation = "eager"
    base = getattr(transformers, f"{CAUSAL_LM.get(family, family)}ForCausalLM")

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return base.forward(self, input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).logits

    torch.manual_seed(seed)
    model = type(f"{family}Logits", (base,), {"forward": forward})(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    return model


def inputs(*, empty_rows: bool):
    """ids (b, t) with token 0 in every row, position ids from OFFSETS, and a mask: rows right-padded
    (``empty_rows=False``: what transformers computes as this library does), or a fully masked row 0,
    a right- and a left-padded row (whose first queries see no key)."""
    ids = np.random.default_rng(0).integers(0, BASE["vocab_size"], size=(B, T))
    ids[:, 1] = 0  # Gemma's pad id: its embedding row gets no gradient
    mask = np.ones((B, T), np.int64)
    if empty_rows:
        mask[0] = 0
        mask[1, 6:] = 0
        mask[2, :3] = 0
    else:  # padding shorter than the windows, so that every query sees a real key
        mask[1, 7:] = 0
        mask[2, 8:] = 0
    return ids, mask, OFFSETS[:, None] + np.arange(T)[None]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    """(name, transformers model, torch_reference twin, Flax twin), built once per variant."""
    hf = hf_model(*VARIANTS[request.param])
    reference = tl.LlamaForCausalLM(LlamaConfig.from_hf(hf.config)).eval()
    reference.load_state_dict(hf.state_dict(), strict=True)
    return request.param, hf, reference, porting.torch_to_flax(reference)


def _grads(model, args, weights) -> tuple[np.ndarray, dict]:
    """(logits, d sum(logits * weights) / d every parameter by torch name)."""
    model.zero_grad(set_to_none=True)
    logits = model(*(torch.from_numpy(a) for a in args))
    (logits * torch.from_numpy(weights)).sum().backward()
    return logits.detach().numpy(), {k: p.grad.numpy() for k, p in model.named_parameters()}


@pytest.mark.slow_cases({
    "linear-mha-biases-gelu": "test_attention_impl's llama blocks",
    "mistral-window-dynamic-mqa": "test_attention_impl's llama blocks",
    "qwen3-qk-norm": "test_attention_impl's llama blocks",
})
def test_forward_and_gradients(variant):
    """Logits and every parameter's gradient, at positions up to 16,388: torch_reference against
    transformers (same keys), Flax against transformers (``compare``, with its float64 budget),
    and Flax against torch_reference where queries see no key (zeros here, no NaN)."""
    name, hf, reference, flax_model = variant
    args = inputs(empty_rows=False)
    weights = np.random.default_rng(1).standard_normal((B, T, BASE["vocab_size"])).astype(np.float32)
    (want, want_grads), (got, got_grads) = _grads(hf, args, weights), _grads(reference, args, weights)
    assert np.abs(got - want).max() <= TOL, f"{name}: torch_reference logits vs transformers"
    assert got_grads.keys() == want_grads.keys()
    for key, g in want_grads.items():
        err = np.abs(got_grads[key] - g).max() / max(1.0, np.abs(g).max())
        assert err <= TOL, f"{name}: {key} gradient, torch_reference vs transformers: {err:.3g}"
    empty = inputs(empty_rows=True)
    back, perturbed = flax_to_torch_perturbed(flax_model)
    for torch_model, flax_side, case in ((hf, flax_model, args), (reference, flax_model, empty), (back, perturbed, empty)):
        report = compare(torch_model, flax_side, case, grads=True, tol=TOL)  # one compiled Flax step serves all
        assert report.passed and report.grad_err <= TOL, f"{name}, Flax vs {type(torch_model).__name__}:\n{report}"


def flax_to_torch_perturbed(flax_model):
    """The Flax -> torch direction: a copy of ``flax_model`` with every weight moved (numpy noise, so
    nothing new compiles) and its torch twin from ``porting.flax_to_torch``."""
    copy, rng = nnx.clone(flax_model), np.random.default_rng(2)
    for _, param in nnx.iter_graph(copy):
        if isinstance(param, nnx.Param):
            value = np.asarray(param[...])
            param.set_value(jnp.asarray(value + 0.1 * rng.standard_normal(value.shape).astype(value.dtype)))
    return porting.flax_to_torch(copy), copy


# ------------------------------------------------------------------ attention and block level


def test_block_both_ways(rng):
    """A block with every switch at once (GQA, llama3 scaling past its context, q/k norms, a window,
    q/k/v biases, 1 + w norms, tanh GELU), padding and a fully masked row: torch -> Flax and
    Flax -> torch, outputs and every parameter's gradient; and with ``set_attention(.., "xla")``."""
    cfg = LlamaConfig.tiny(vocab_size=64, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                           rope_scaling=dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=16),
                           qk_norm=True, sliding_window=3, attention_bias=True, o_proj_bias=False, mlp_bias=True,
                           norm_plus_one=True, hidden_act="gelu_pytorch_tanh")
    block = tl.LlamaDecoderLayer(cfg, 1).eval()
    perturb_torch(block, seed=3)  # fresh 1 + w norms are zeros: a lost + 1 would hide
    x = rng.standard_normal((B, T, cfg.hidden_size)).astype(np.float32)
    _, mask, _ = inputs(empty_rows=True)
    args = (x, mask, np.arange(T)[None] + 40)
    flax_block = porting.torch_to_flax(block)
    for torch_side, flax_side in ((block, flax_block), flax_to_torch_perturbed(flax_block)):
        report = compare(torch_side, flax_side, args, grads=True, tol=TOL)
        assert report.passed and report.grad_err <= TOL, str(report)
    set_attention(flax_block, "xla")  # jax.nn.dot_product_attention on the repeated heads, the same mask
    assert compare(block, flax_block, args, tol=TOL).passed


@pytest.mark.parametrize("rope", [LLAMA3, LINEAR, DYNAMIC, dict(rope_type="default", rope_theta=10000.0), YARN,
                                  YARN_MSCALE], ids=lambda rope: rope["rope_type"] + ("-mscale" if "mscale" in rope else ""))
@pytest.mark.slow_cases({
    "dynamic": "test_rope_against_transformers_at_long_positions: the llama3, linear, default RoPE",
})
def test_rope_against_transformers_at_long_positions(rope):
    """Every RoPE type at positions 0 to 16,388, head_dim 128. The inverse frequencies lie within one
    ulp of transformers' (its float32 pow is not correctly rounded: ``rope_inverse_frequencies``),
    so cos and sin within what that ulp and float32 angles allow at these positions; torch's and
    Flax's share their table, and their cos and sin agree to rounding (dynamic: within the bound)."""
    hf = hf_model("Llama", dict(rope_parameters=rope, head_dim=128))
    cfg = LlamaConfig.from_hf(hf.config)
    positions = OFFSETS[:, None] + np.arange(T)[None]
    x, t_positions = torch.zeros(1), torch.from_numpy(positions)
    with torch.no_grad():
        want = [a.numpy() for a in hf.model.rotary_emb(x, t_positions)]  # sets its dynamic frequencies
        ours = [a.numpy() for a in tl.LlamaRotaryEmbedding(cfg)(x, t_positions)]
    theirs = hf.model.rotary_emb.inv_freq.numpy()
    ulps = 4 if rope["rope_type"] == "dynamic" else 1  # dynamic: two float32 pows per call, torch's and XLA's
    for framework, freq in (("torch", tll.inverse_frequencies(cfg, torch.float32, "cpu", t_positions).numpy()),
                            ("Flax", np.asarray(fll.inverse_frequencies(cfg, jnp.asarray(positions))))):
        assert np.all(np.abs(freq - theirs) <= ulps * np.spacing(theirs)), f"{framework} inverse frequencies"
    got = [np.asarray(a) for a in frameworks.apply(fl.LlamaRotaryEmbedding(cfg), (jnp.zeros(1), jnp.asarray(positions)), {})]
    largest = np.float32(positions.max())  # the largest angle: position * inv_freq[0], which is 1
    bound = positions.max() * ulps * 2.0 ** -24 + np.spacing(largest)  # frequencies' ulps times p, an angle's ulp
    tight = bound if rope["rope_type"] == "dynamic" else 2e-6  # one table: the same float32 angles
    for a, b, c in zip(ours, got, want):
        assert np.abs(a - c).max() <= bound and np.abs(b - c).max() <= bound and np.abs(a - b).max() <= tight


# GPT-OSS's full-attention layer (1): sinks far from zero (set below), YaRN, q/k/v/o biases
GPT_OSS = dict(head_dim=16, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, rope_parameters=YARN,
               max_position_embeddings=131072)


@pytest.mark.parametrize("family,cls,layer", [("Qwen3", "LlamaAttention", 0), ("Gemma", "LlamaDecoderLayer", 0),
                                              ("GptOss", "LlamaAttention", 1)])
def test_attention_and_block_equal_transformers(family, cls, layer, rng):
    """Our attention (Qwen3's q/k norms; GPT-OSS's sinks and YaRN) and block (Gemma's) load
    transformers' strictly and give its outputs for its RoPE and causal mask, in torch and in Flax."""
    hf = hf_model(family, {"Qwen3": VARIANTS["qwen3-qk-norm"][1], "Gemma": VARIANTS["gemma"][1],
                           "GptOss": GPT_OSS}[family])
    ours = getattr(tl, cls)(LlamaConfig.from_hf(hf.config), layer)
    theirs = hf.model.layers[layer].self_attn if cls == "LlamaAttention" else hf.model.layers[layer]
    if family == "GptOss":
        with torch.no_grad():  # sinks that take a real share of each row: logits of a few units
            theirs.sinks.copy_(torch.linspace(-3.0, 3.0, theirs.sinks.numel()))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = rng.standard_normal((B, T, hf.config.hidden_size)).astype(np.float32)
    positions = OFFSETS[:, None] + np.arange(T)[None]
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    tx, tpos = torch.from_numpy(x), torch.from_numpy(positions)
    with torch.no_grad():
        rope = hf.model.rotary_emb(tx, tpos)
        want = (theirs(tx, rope, causal)[0] if cls == "LlamaAttention" else theirs(tx, causal, position_embeddings=rope))
        assert (ours(tx, None, tpos) - want).abs().max().item() <= TOL
    got = frameworks.apply(porting.torch_to_flax(ours), (jnp.asarray(x), None, jnp.asarray(positions)), {})
    assert np.abs(np.asarray(got) - want.numpy()).max() <= TOL


# ------------------------------------------------------------------ conventions, by hand


def test_conventions_by_hand():
    """Numbers computed on paper: half-split rotation, head-by-head repetition, RoPE's angle, w and 1 + w."""
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    for framework, to in ((tll, torch.from_numpy), (fll, jnp.asarray)):
        np.testing.assert_array_equal(np.asarray(framework.rotate_half(to(x))), [[-3.0, -4.0, 1.0, 2.0]])
        heads = to(np.arange(2, dtype=np.float32).reshape(1, 2, 1, 1))  # two key/value heads
        assert np.asarray(framework.repeat_kv(heads, 2)).ravel().tolist() == [0, 0, 1, 1]  # not tile's 0, 1, 0, 1
    cfg = LlamaConfig.tiny(head_dim=2, hidden_size=8, num_attention_heads=4, num_key_value_heads=4)
    cos, sin = fl.LlamaRotaryEmbedding(cfg)(jnp.zeros(1), jnp.array([[0, 3]]))
    np.testing.assert_allclose(np.asarray(cos)[0], np.cos([[0, 0], [3, 3]]), atol=1e-6)  # inv_freq[0] = 1
    np.testing.assert_allclose(np.asarray(sin)[0], np.sin([[0, 0], [3, 3]]), atol=1e-6)
    for plus_one in (False, True):  # a bare norm ports both ways: weight <-> scale
        norm = tl.LlamaRMSNorm(2, eps=1e-12, plus_one=plus_one)
        with torch.no_grad():
            norm.weight.copy_(torch.tensor([1.0, -1.0]))  # applied as 2, 0 with plus_one
        twin = porting.torch_to_flax(norm)
        want = [2 * 3 / np.sqrt(12.5), 0.0] if plus_one else [3 / np.sqrt(12.5), -4 / np.sqrt(12.5)]
        np.testing.assert_allclose(np.asarray(twin(jnp.array([3.0, 4.0]))), want, rtol=1e-6)
        np.testing.assert_allclose(norm(torch.tensor([3.0, 4.0])).detach().numpy(), want, rtol=1e-6)
        assert torch.equal(porting.flax_to_torch(twin).weight, norm.weight)


# ------------------------------------------------------------------ configs and checkpoints


@pytest.mark.parametrize("family", ["Llama", "Mistral", "Qwen2", "Qwen3", "Gemma"])
def test_config_from_transformers_and_back(family):
    config = getattr(transformers, f"{family}Config")(**BASE)
    ours = LlamaConfig.from_hf(config)
    assert ours.model_type == config.model_type and ours.num_key_value_heads == 2
    assert LlamaConfig.from_hf(ours.to_hf_dict()) == ours == LlamaConfig.from_any(dataclasses.asdict(ours))
    again = getattr(transformers, f"{family}Config")(**{k: v for k, v in ours.to_hf_dict().items()
                                                         if k not in ("architectures", "model_type")})
    assert LlamaConfig.from_hf(again) == ours


def test_rope_settings_read_from_either_key():
    """transformers 5's rope_parameters and older files' rope_scaling + rope_theta give one config."""
    new = LlamaConfig.from_hf(dict(model_type="llama", rope_parameters=LLAMA3))
    old = LlamaConfig.from_hf(dict(model_type="llama", rope_theta=500000.0, rope_scaling={
        "type": "llama3", **{k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")}}))
    assert new == old and new.rope_scaling.rope_type == "llama3" and new.rope_theta == 500000.0
    written = new.to_hf_dict()
    assert written["rope_scaling"]["rope_type"] == written["rope_scaling"]["type"] == "llama3"
    assert written["rope_parameters"]["rope_theta"] == written["rope_theta"] == 500000.0


@pytest.mark.parametrize("bad, message", [
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(num_key_value_heads=8), "at most num_attention_heads"),
    (dict(head_dim=7), "must be even"),
    (dict(rope_scaling=dict(rope_type="longrope", factor=2.0)), "'longrope' is not supported"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0, beta_fast=-1.0)), "beta_fast must be a finite number > 0"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)),
     "must be below"),
    (dict(layer_types=("sliding_attention", "full_attention")), "sliding_window is None"),
    (dict(hidden_act="tanh"), "not supported"),
])
def test_config_refuses_what_it_cannot_compute(bad, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.tiny(**bad)


def test_tied_checkpoints():
    """A tied head is one tensor under both of transformers' names; an untied checkpoint is refused by
    a tied model, naming both keys, rather than loaded one over the other."""
    tied = tl.LlamaForCausalLM(LlamaConfig.tiny(tie_word_embeddings=True))
    state = tied.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    untied = tl.LlamaForCausalLM(LlamaConfig.tiny()).state_dict()
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        tied.load_state_dict(untied)
    once = {k: v + 1 for k, v in state.items() if k != "lm_head.weight"}  # as transformers' files keep it
    tied.load_state_dict(once)
    assert torch.equal(tied.lm_head.weight, once["model.embed_tokens.weight"])
    state = tied.state_dict()
    flax_model = porting.torch_to_flax(tied)
    assert flax_model.lm_head is None
    back = porting.flax_to_torch(flax_model).state_dict()
    assert torch.equal(back["lm_head.weight"], state["model.embed_tokens.weight"])


def test_input_spec_and_bad_inputs_before_any_computation():
    cfg = LlamaConfig.tiny()
    model = nnx.eval_shape(lambda: fl.LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))  # no weights: nothing may run
    assert model.input_spec() == tl.LlamaForCausalLM(cfg).input_spec() == InputSpec(128, 128, generates=True)
    ids = jnp.zeros((2, 3), jnp.int32)
    for mask, positions, message in ((None, jnp.zeros((2, 4), jnp.int32), "position_ids must have shape"),
                                     (None, jnp.full((1, 3), -1), "position_ids must be >= 0"),
                                     (jnp.full((2, 3), 2), None, "attention_mask must be boolean or hold only 0")):
        with pytest.raises(ValueError, match=message):
            model(ids, mask, positions)
    with pytest.raises(ValueError, match="position_ids must be >= 0"):
        tl.LlamaForCausalLM(cfg)(torch.zeros(2, 3, dtype=torch.long), None, torch.full((1, 3), -1))
