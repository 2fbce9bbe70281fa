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

from flax_transformer import porting, set_attention, verify

from .conftest import TOL

SPECS = verify.specs()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.family}-{s.name}")
def test_fused_attention_matches_torch(spec):
    for case in [c for c in spec.cases if c in ("padding", "causal+padding", "fully-masked-row")] or spec.cases[:1]:
        torch_module, args, kwargs = verify.case_inputs(spec, case, 0)
        verify.perturb_torch(torch_module, 0)
        flax_module = porting.torch_to_flax(torch_module)
        set_attention(flax_module, "xla")
        err, finite = verify.compare(torch_module, flax_module, args, kwargs)
        assert finite and err <= TOL, (case, err)


def test_the_switch_reaches_every_attention_module_and_retraces():
    from flax_transformer.gpt import GPT2LMHeadModel
    from flax_transformer.configs import GPTConfig

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
    from flax_transformer.configs import EncoderConfig
    from flax_transformer.encoder import MultiHeadAttention

    config = EncoderConfig.tiny(hidden_size=16, num_attention_heads=2, attention_probs_dropout_prob=0.5)
    module = MultiHeadAttention(config, rngs=nnx.Rngs(params=0, dropout=1))
    set_attention(module, "xla")
    module.train()
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    a, b = module(x), module(x)
    assert not np.allclose(np.asarray(a), np.asarray(b))  # dropout on the weights, as in the reference
