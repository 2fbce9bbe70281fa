"""Both attention implementations against torch: the reference math and ``jax.nn.dot_product_attention``.

``set_attention(model, "xla")`` switches every attention module of a model to JAX's fused
attention (cuDNN's with "cudnn" on NVIDIA GPUs). Each module of every family, ported from
torch, must still agree with torch within 1e-5, with padding, causal and fully masked rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_transformer.interop import porting
from flax_transformer.models.attention import set_attention
from flax_transformer.verification import compare, verify
from parity_tests.conftest import TOL

SPECS = verify.specs()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.family}-{s.name}")
@pytest.mark.keep_cases("classic-DecoderBlock", "encoder-TransformerEncoderLayer(post-LN)", "encoder-TransformerForSequenceClassification(BERT)", "former-CTransformer(max)", "former-TransformerBlock(wide)", "gpt-GPT2LMHeadModel", "gpt-GPTMHTransformerLayer", "llama-LlamaDecoderLayer(MHA, q/k norm, linear RoPE)", "llama-LlamaDecoderLayer(q/k/v biases, MLP biases, window 3, dynamic RoPE)", "llama-LlamaForCausalLM(tied, Gemma)", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_fused_attention_matches_torch(spec):
    for case in [c for c in spec.cases if c in ("padding", "causal+padding", "fully-masked-row")] or spec.cases[:1]:
        torch_module, args, kwargs = verify.case_inputs(spec, case, 0)
        verify.perturb_torch(torch_module, 0)
        flax_module = porting.torch_to_flax(torch_module)
        set_attention(flax_module, "xla")
        report = compare.compare(torch_module, flax_module, args, kwargs)
        assert report.passed, (case, report)


def test_the_switch_reaches_every_attention_module_and_retraces():
    from flax_transformer.models.configs import GPTConfig
    from flax_transformer.models.gpt import GPT2LMHeadModel

    model = GPT2LMHeadModel(GPTConfig.tiny(vocab_size=40, n_positions=16, n_embd=16, n_head=2), rngs=nnx.Rngs(0))
    model.eval()
    impls = lambda: {m.attention_impl for _, m in nnx.iter_graph(model) if hasattr(m, "attention_impl")}  # noqa: E731
    assert impls() == {"reference"}
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 9)), jnp.int32)
    traces = []

    @nnx.jit
    def forward(m, x):
        traces.append(1)
        return m(x)

    reference = forward(model, ids)
    set_attention(model, "xla")
    assert impls() == {"xla"}
    fused = forward(model, ids)
    assert len(traces) == 2  # a static attribute: the new implementation is compiled, not the old one reused
    np.testing.assert_allclose(np.asarray(fused), np.asarray(reference), atol=TOL)
    with pytest.raises(ValueError, match="attention implementation"):
        set_attention(model, "flash")


def test_training_mode_with_attention_dropout_keeps_the_reference_path():
    """Fused kernels have no attention dropout: in train mode with dropout the reference path runs."""
    from flax_transformer.models.configs import EncoderConfig
    from flax_transformer.models.encoder import MultiHeadAttention

    config = EncoderConfig.tiny(hidden_size=16, num_attention_heads=2, attention_probs_dropout_prob=0.5)
    module = MultiHeadAttention(config, rngs=nnx.Rngs(params=0, dropout=1))
    set_attention(module, "xla")
    module.train()
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    a, b = module(x), module(x)
    assert not np.allclose(np.asarray(a), np.asarray(b))  # dropout on the weights, as in the reference


# --------------------------------------------------- the hand-written attention backward


def _plain_attend(q, k, v, mask, scale):
    """The reference math with JAX's own autodiff, for comparing gradients."""
    scores = (q @ jnp.swapaxes(k, -1, -2)) * (1.0 if scale is None else scale)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = weights if mask is None else jnp.where(mask, weights, 0.0)
    return weights @ v, weights


@pytest.mark.parametrize("case", ["none", "padding+empty-row", "causal", "broadcast-kv", "dropout"])
@pytest.mark.keep_cases("broadcast-kv", "causal", "dropout", "padding+empty-row", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_attend_custom_backward_equals_autodiff(case):
    """``attention.attend``'s custom VJPs (fast on XLA CPU) give autodiff's gradients of the same math,
    for the output and the weights, with fully masked rows (zero gradient there, no NaN)."""
    from flax_transformer.models.attention import attend

    rng = np.random.default_rng(0)
    b, h, t, d = 3, 2, 7, 5
    q, k, v = (jnp.asarray(rng.standard_normal((b, h, t, d)), jnp.float32) for _ in range(3))
    mask, scale = None, 0.4
    if case == "padding+empty-row":
        keep = rng.random((b, 1, 1, t)) > 0.3
        keep[1] = False  # every key of row 1 masked
        mask = jnp.asarray(keep)
    elif case == "causal":
        mask = jnp.tril(jnp.ones((t, t), bool))
    elif case == "broadcast-kv":  # one k/v for every head: the plain path
        k, v = k[:, :1], v[:, :1]
    w_out, w_weights = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, h, t, d), (b, h, t, t)))

    def loss(fn, q, k, v):
        out, weights = fn(q, k, v)
        return (out * w_out).sum() + (weights * w_weights).sum()

    if case == "dropout":  # the same dropout mask on both sides: the same key, made inside the trace
        mine = lambda q, k, v: attend(q, k, v, mask, scale=scale,  # noqa: E731
                                      dropout=nnx.Dropout(0.3, rngs=nnx.Rngs(dropout=5)))

        def ref(q, k, v):
            _, weights = _plain_attend(q, k, v, mask, scale)
            weights = nnx.Dropout(0.3, rngs=nnx.Rngs(dropout=5))(weights)
            return weights @ v, weights
    else:
        mine = lambda q, k, v: attend(q, k, v, mask, scale=scale)  # noqa: E731
        ref = lambda q, k, v: _plain_attend(q, k, v, mask, scale)  # noqa: E731
    for use_jit in (False, True):
        grad = jax.grad(loss, argnums=(1, 2, 3))
        grad = jax.jit(grad, static_argnums=0) if use_jit else grad
        got, want = grad(mine, q, k, v), grad(ref, q, k, v)
        for name, g, w in zip("qkv", got, want):
            assert np.isfinite(np.asarray(g)).all(), name
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-6, rtol=0, err_msg=f"d{name} jit={use_jit}")
    if case == "padding+empty-row":
        assert float(jnp.abs(got[0][1]).max()) == 0.0  # a row with no keys gets no gradient


def test_linear_custom_backward_equals_autodiff():
    from flax_transformer.models.layers import Linear

    layer = Linear(6, 4, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 6)), jnp.float32)
    fast = jax.grad(lambda kernel, x: (layer(x) ** 2).sum() + 0 * kernel.sum(), argnums=1)
    plain = jax.grad(lambda x: ((x @ layer.kernel[...] + layer.bias[...]) ** 2).sum())
    np.testing.assert_allclose(np.asarray(fast(layer.kernel[...], x)), np.asarray(plain(x)), atol=1e-6)
    graphdef, params = nnx.split(layer)
    kernel_grad = jax.grad(lambda p: (nnx.merge(graphdef, p)(x) ** 2).sum())(params)["kernel"][...]
    plain_kernel = jax.grad(lambda w: ((x @ w + layer.bias[...]) ** 2).sum())(layer.kernel[...])
    np.testing.assert_allclose(np.asarray(kernel_grad), np.asarray(plain_kernel), atol=1e-5)
