"""Pairs for the fault sweep's ``verify --pair bench/faults_pairs.py:FACTORY`` cases (issue 22).

Each FACTORY() returns (torch_model, flax_model, args), broken in one way a port or a user's model
can be (NaN or inf on one side or both, a layer with no twin, an output that cannot be compared, an
error only the float64 reference sees), or misbehaves as a factory (exits, raises, returns nothing).
``ok`` is the control: a correct port that must pass.
"""

import sys

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import torch_reference.encoder as te
import torch_reference.former as tf
from flax_transformer.interop import porting
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.verification import verify

IDS = (np.random.default_rng(0).integers(0, 20, (2, 8)),)


def _former():
    torch.manual_seed(0)
    model = tf.CTransformer(16, 4, 2, 8, 20, 3).eval()
    verify.perturb_torch(model, 0)
    return model


def _set(param, index, value):
    param.set_value(param[...].at[index].set(value))


def ok():
    model = _former()
    return model, porting.torch_to_flax(model), IDS


def nan_both():  # a NaN weight in both frameworks: every output is NaN on both sides
    model = _former()
    with torch.no_grad():
        model.tblocks[1].ff[0].bias[3] = float("nan")
    return model, porting.torch_to_flax(model), IDS


def nan_jax():
    model = _former()
    flax_model = porting.torch_to_flax(model)
    _set(flax_model.tblocks[1].ff[0].bias, 3, jnp.nan)
    return model, flax_model, IDS


def nan_torch():
    model = _former()
    flax_model = porting.torch_to_flax(model)
    with torch.no_grad():
        model.tblocks[1].ff[0].bias[3] = float("nan")
    return model, flax_model, IDS


def inf_jax():
    model = _former()
    flax_model = porting.torch_to_flax(model)
    _set(flax_model.tblocks[0].ff[0].bias, 0, jnp.inf)
    return model, flax_model, IDS


def overflow():  # a module whose own computation makes the inf from finite inputs
    model = _former()
    flax_model = porting.torch_to_flax(model)
    norm = flax_model.tblocks[0].norm2
    cls = type(norm)
    norm.__class__ = type(cls)("Overflowing" + cls.__name__, (cls,),
                               {"__call__": lambda self, x: cls.__call__(self, x) * jnp.float32(1e38) * 10})
    return model, flax_model, IDS


def nan_grad():  # one NaN in a weight of the JAX side's gradient path
    model = _former()
    flax_model = porting.torch_to_flax(model)
    _set(flax_model.toprobs.kernel, (0, 0), jnp.nan)
    return model, flax_model, IDS


def skipped():  # a torch layer with parameters and no Flax twin, called: not compared
    model = _former()

    class WithExtra(type(model)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs) + 0 * self.extra(self.extra.weight.new_zeros(1, 2)).sum()

    flax_model = porting.torch_to_flax(model)
    model.extra = torch.nn.Linear(2, 2)
    model.__class__ = WithExtra
    return model, flax_model, IDS


class _Tagged(torch.nn.Module):
    """Returns (output, label): an array of strings is not numeric, so it cannot be compared; a plain
    string is compared exactly (a leaf that is not an array must be equal)."""

    def __init__(self, label):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.label = label

    def forward(self, x):
        return self.linear(x), self.label


class _FlaxTagged(nnx.Module):
    def __init__(self, torch_module, label):
        self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.linear.kernel.set_value(jnp.asarray(torch_module.linear.weight.detach().numpy().T))
        self.linear.bias.set_value(jnp.asarray(torch_module.linear.bias.detach().numpy()))
        self.label = label

    def __call__(self, x):
        return self.linear(x), self.label


X = (np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32),)


def _tagged(torch_label, flax_label):
    torch.manual_seed(0)
    model = _Tagged(torch_label)
    return model, _FlaxTagged(model, flax_label), X


def labelled():  # an array of strings on both sides: not compared
    return _tagged(np.array(["label"]), np.array(["label"]))


def mislabelled():  # plain strings that differ: compared, and unequal
    return _tagged("positive", "negative")


def _linears(out=3, shift=0.0):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).eval()
    flax_model = nnx.Linear(4, out, rngs=nnx.Rngs(0))
    if out == 3:
        flax_model.kernel.set_value(jnp.asarray(model.weight.detach().numpy().T))
        flax_model.bias.set_value(jnp.asarray(model.bias.detach().numpy()) + shift)
    return model, flax_model, X


def narrow():  # a Flax Linear with 2 outputs against torch's 3: nothing to compare
    return _linears(out=2)


def model_only():  # wrong only at the whole model's level (it has no submodules)
    return _linears(shift=1e-3)


def _gelu(seed):
    """A small-activation feed-forward block with tanh GELU for exact GELU: error below 1e-5,
    yet many times torch's own float32 error against float64."""
    cfg = EncoderConfig.tiny(vocab_size=20, hidden_size=16, num_attention_heads=4, max_position_embeddings=8)
    torch.manual_seed(seed)
    model = te.FeedForward(cfg).eval()
    flax_model = porting.torch_to_flax(model)
    flax_model.hidden_act = "gelu_new"
    return model, flax_model, (0.2 * np.random.default_rng(seed).standard_normal((2, 6, 16)).astype(np.float32),)


for _seed in range(5):  # tanh_gelu_0 ... tanh_gelu_4
    globals()[f"tanh_gelu_{_seed}"] = lambda seed=_seed: _gelu(seed)


def exits():
    sys.exit(0)


def exits_bare():
    sys.exit()


def exits_one():
    sys.exit(1)


def returns_none():
    return None


def factory_raises():
    raise KeyError("no such layer")


class _Raises(nnx.Module):
    def __call__(self, x):
        raise KeyError("no such head")


class _Exits(nnx.Module):
    def __call__(self, x):
        sys.exit(0)


class _TorchExits(torch.nn.Module):
    def forward(self, x):
        sys.exit(0)


class _TorchRaises(torch.nn.Module):
    def forward(self, x):
        raise KeyError("no such head")


def flax_raises():
    return torch.nn.Identity(), _Raises(), (np.zeros((2, 3), np.float32),)


def flax_exits():
    return torch.nn.Identity(), _Exits(), (np.zeros((2, 3), np.float32),)


def torch_exits():
    return _TorchExits(), nnx.Linear(3, 3, rngs=nnx.Rngs(0)), (np.zeros((2, 3), np.float32),)


def torch_raises():
    return _TorchRaises(), nnx.Linear(3, 3, rngs=nnx.Rngs(0)), (np.zeros((2, 3), np.float32),)
