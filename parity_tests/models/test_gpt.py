"""Parity of the ``gpt`` family (notebook 002): attention, layer, model.

Tolerance: max abs error <= 1e-5 in fp32 with matmul precision "highest" (TOL).
The multi-head attention, blocks and model under every mask case, both directions: the
spec-driven test_family_parity.py (family_specs.GPT); here, what is special to the family.
"""

import io

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_transformer.models.gpt as fg
import torch_reference.gpt as tg
from flax_transformer.interop import porting
from flax_transformer.verification.verify import padding_mask
from parity_tests.conftest import TOL, assert_both_directions, assert_parameter_gradients_match

from . import notebook_classes as nb

CASES = {
    "none": lambda rng, b, t: None,
    "padding": lambda rng, b, t: padding_mask(rng, b, t, empty_row=False),
    "left-padding (fully masked rows)": lambda rng, b, t: padding_mask(rng, b, t, empty_row=False, left=True),
    "empty row": lambda rng, b, t: padding_mask(rng, b, t, empty_row=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cls", ["Attention", "GPTAttention", "TransformerLayer", "GPTTransformerLayer"])
def test_tutorial_steps(cls, case, rng):
    module = getattr(tg, cls)(12) if "Attention" in cls and "Layer" not in cls else getattr(tg, cls)(12, 20, dropout=0.4)
    x = rng.standard_normal((3, 6, 12)).astype(np.float32)
    assert_both_directions(module, (x, CASES[case](rng, 3, 6)))


def test_basic_layers(rng):
    x = rng.standard_normal((2, 3, 6)).astype(np.float32)
    assert_both_directions(tg.Linear(6, 4), (x,))
    assert_both_directions(tg.Linear(6, 4, bias=False), (x,))
    assert_both_directions(tg.LayerNorm(6), (x,))
    assert_both_directions(tg.FeedForward(6, 10, dropout=0.5), (x,))
    assert_both_directions(tg.Embeddings(11, 5), (rng.integers(0, 11, size=(2, 3)),))


def test_n_layers_is_honoured():
    """The notebook built one layer whatever n_layers said."""
    assert len(tg.GPTTransformer(4, 8, 16, 2, 10, 6).transformer_stack) == 4
    assert len(fg.GPTTransformer(4, 8, 16, 2, 10, 6, rngs=nnx.Rngs(0)).transformer_stack) == 4


def test_value_projection_is_v_proj(rng):
    """The notebook's Attention computed v with k_proj: v_proj must matter here."""
    module = tg.Attention(6).eval()
    x = torch.from_numpy(rng.standard_normal((1, 4, 6)).astype(np.float32))
    before = module(x)
    with torch.no_grad():
        module.v_proj.matrix.mul_(2)
    assert not torch.allclose(module(x), before)


def test_dropout_is_off_in_eval_mode(rng):
    """The notebook's FeedForward dropped units in eval mode too."""
    for module in (tg.FeedForward(6, 10, dropout=0.5), tg.GPTTransformerLayer(6, 10, dropout=0.5)):
        module.eval()
        x = torch.from_numpy(rng.standard_normal((2, 3, 6)).astype(np.float32))
        assert torch.equal(module(x), module(x))
        module.train()
        assert not torch.equal(module(x), module(x))


def test_parameter_gradients(rng):
    torch.manual_seed(0)
    ids, mask = rng.integers(0, 50, size=(3, 7)), padding_mask(rng, 3, 7, empty_row=False)
    assert_parameter_gradients_match(tg.GPTTransformer(2, 16, 24, 4, 50, 9), (ids, mask), rng)


def test_notebook_002_checkpoint(rng):
    """A notebook GPTTransformer(n_layers=1) loads strictly and gives the same logits (eval, dropout 0)."""
    torch.manual_seed(7)
    args = dict(n_layers=1, d_embed=20, d_ff=36, n_heads=5, voc_size=97, max_length=23, dropout=0.0)
    notebook = nb.GPTTransformer(**args).eval()
    buffer = io.BytesIO()
    torch.save(notebook.state_dict(), buffer)
    buffer.seek(0)
    reference = tg.GPTTransformer(**args)
    reference.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    reference.eval()
    ids = torch.from_numpy(rng.integers(0, 97, size=(3, 23)))
    mask = torch.from_numpy(padding_mask(rng, 3, 23, empty_row=False)).float()  # the collator's mask
    want = notebook(ids, mask).detach().numpy()
    np.testing.assert_allclose(reference(ids, mask).detach().numpy(), want, atol=1e-6, rtol=0)
    got = np.asarray(porting.torch_to_flax(reference)(jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy())))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
