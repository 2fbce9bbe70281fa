"""Layer kinds: n-d convolutions round-trip through their layouts and match torch; ``rename=``
replaces every match in a key.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import porting


class _FlaxConv(nnx.Module):
    def __init__(self, ndim, rngs):
        window = (3, 2, 2)[:ndim]  # not square: a permutation and its inverse differ in shape too
        self.conv = nnx.Conv(4, 6, kernel_size=window, padding=[(1, 1)] * ndim, feature_group_count=2,
                             kernel_init=nnx.initializers.zeros, rngs=rngs)  # filled by the port

    def __call__(self, x):
        return self.conv(x)


@pytest.mark.parametrize("ndim", [2, 3])
def test_nd_conv_round_trips_and_matches_torch(ndim):
    """Guards ``layer_kinds.to_torch`` taking a Flax kernel back with the inverse of ``to_flax``'s permutation
    (1-d convolutions cannot tell: (2, 1, 0) is its own inverse; 2-d's (2, 3, 1, 0) is not)."""
    torch.manual_seed(ndim)

    class TorchConv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = getattr(torch.nn, f"Conv{ndim}d")(4, 6, kernel_size=(3, 2, 2)[:ndim], padding=1, groups=2)

    conv = TorchConv().eval().conv
    theirs = {f"conv.{k}": v.detach().numpy() for k, v in conv.state_dict().items()}

    model = _FlaxConv(ndim, nnx.Rngs(0))
    porting.load_state_dict(model, theirs)
    x = np.random.default_rng(0).standard_normal((2, 4, *(5, 6, 3)[:ndim])).astype(np.float32)  # torch: (b, c, ...)
    with torch.no_grad():
        want = conv(torch.from_numpy(x)).numpy()
    got = np.moveaxis(np.asarray(model(jnp.asarray(np.moveaxis(x, 1, -1)))), -1, 1)  # Flax: channels last
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    back = porting.state_dict(model)  # Flax -> torch names and layouts
    assert back.keys() == theirs.keys()
    for key in theirs:
        assert back[key].shape == theirs[key].shape, key
        np.testing.assert_array_equal(back[key], theirs[key], err_msg=key)
    fresh = TorchConv()
    torch.nn.init.zeros_(fresh.conv.weight)
    porting.flax_to_torch(model, fresh)  # into torch again: the same outputs
    with torch.no_grad():
        np.testing.assert_allclose(fresh.conv(torch.from_numpy(x)).numpy(), want, atol=1e-6, rtol=0)


class _Inner(nnx.Module):
    def __init__(self, rngs):
        self.b = nnx.Linear(3, 2, kernel_init=nnx.initializers.zeros, rngs=rngs)


class _Outer(nnx.Module):
    def __init__(self, rngs):
        self.a = _Inner(rngs)


def test_rename_replaces_every_match_in_a_key():
    """Guards ``rename=`` applying each regex to every match in a key (``re.sub``), not only the first."""
    model = _Outer(nnx.Rngs(0))
    ours = porting.state_dict(model)
    assert set(ours) == {"a.b.weight", "a.b.bias"}
    theirs = porting.state_dict(model, rename=[(r"\.", "/")])  # two dots in each key
    assert set(theirs) == {"a/b/weight", "a/b/bias"}
    weights = {"x_a.x_b.weight": ours["a.b.weight"] + 1, "x_a.x_b.bias": ours["a.b.bias"] - 1}
    porting.load_state_dict(model, weights, rename=[(r"x_", "")])  # "x_" twice in each key
    np.testing.assert_array_equal(np.asarray(model.a.b.kernel[...]), weights["x_a.x_b.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.a.b.bias[...]), weights["x_a.x_b.bias"])
