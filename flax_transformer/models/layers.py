"""Torch-like layers every flax_transformer family shares: ``Linear``, ``Embed``, ``LayerNorm``,
activations, ``Sequential``, embedding lookup with an out-of-range guard, masked mean pooling.

PyTorch's initialisations, so that a model trained from scratch starts from the same
distribution in both frameworks: nn.Linear draws weight and bias from
U(-1/sqrt(fan_in), 1/sqrt(fan_in)); nn.Embedding from N(0, 1); nn.LayerNorm has ones
and zeros.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from flax_transformer.models.fast_backward import linear_dot_general


def _uniform_fan_in(fan_in: int):
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def Linear(d_in: int, d_out: int, *, use_bias: bool = True, rngs: nnx.Rngs, dtype=jnp.float32,
           param_dtype=jnp.float32) -> nnx.Linear:
    """``nnx.Linear`` initialised like ``torch.nn.Linear``; kernel is (d_in, d_out).

    Its matmul has the fast weight gradient of ``linear_dot_general``."""
    return nnx.Linear(d_in, d_out, use_bias=use_bias, kernel_init=_uniform_fan_in(d_in),
                      bias_init=_uniform_fan_in(d_in), dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                      dot_general=linear_dot_general)


def Embed(num_embeddings: int, features: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
          param_dtype=jnp.float32, std: float = 1.0) -> nnx.Embed:
    """``nnx.Embed`` initialised like ``torch.nn.Embedding`` (N(0, std^2), std 1 by default)."""
    return nnx.Embed(num_embeddings, features, embedding_init=jax.nn.initializers.normal(std),
                     dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class LayerNorm(nnx.Module):
    """``torch.nn.LayerNorm`` over the last axis: two-pass variance, statistics in fp32.

    Written out rather than ``nnx.LayerNorm`` so that the whole normalisation, not
    only the statistics, runs in float32 before the cast back to ``dtype``.
    Parameters are ``scale`` (ones) and ``bias`` (zeros), of shape (features,).
    """

    def __init__(self, features: int, *, eps: float = 1e-5, rngs: nnx.Rngs | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.eps, self.dtype = eps, dtype
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype))

    def __call__(self, x):
        """(..., features) -> (..., features) in ``dtype``."""
        x = x.astype(jnp.float32)
        mean = x.mean(axis=-1, keepdims=True)
        var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)


def lookup(embed: nnx.Embed, ids: jax.Array, dtype) -> jax.Array:
    """Gather rows of an embedding table.

    Out-of-range ids (negative ones too) give NaN rows instead of JAX's silent clamp
    to the last row or NumPy-style wrap from the end. The
    models check ids eagerly whenever the values are known; this is the guard that
    stays under ``jit``, where they are not.
    """
    return gather_rows(embed.embedding[...], ids).astype(dtype)


def gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] where an id outside [0, len(table)) gives a NaN row (negative ids do not wrap)."""
    return table.at[ids].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)


# activation by HF's ``hidden_act`` / ``activation_function`` name; "gelu" is the exact
# (erf) GELU, as torch's nn.GELU(); the "_new"/"_pytorch_tanh" names are the tanh form
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


class ReLU(nnx.Module):
    """Parameter-free, so that ``Sequential`` indices match torch's ``nn.Sequential``."""

    def __call__(self, x):
        return jax.nn.relu(x)


class Sequential(nnx.List):
    """A list of layers applied in order; parameter paths are ``name.<index>.*`` as in torch."""

    def __call__(self, x):
        for layer in self:
            x = layer(x)
        return x


def masked_mean(hidden, attention_mask=None):
    """Mean of (b, t, d) over the tokens whose mask is nonzero -> (b, d); a row with no token gives zeros.

    Summed in float32 whatever the compute dtype (a statistic, like LayerNorm's)."""
    if attention_mask is None:
        return hidden.astype(jnp.float32).mean(axis=1).astype(hidden.dtype)
    weight = jnp.asarray(attention_mask).astype(jnp.bool_).astype(jnp.float32)[..., None]  # (b, t, 1)
    total = (hidden.astype(jnp.float32) * weight).sum(axis=1)
    return (total / jnp.maximum(weight.sum(axis=1), 1.0)).astype(hidden.dtype)


def _active_lora(layer) -> bool:
    """Whether ``layer`` carries an unmerged LoRA (``models.lora``; duck-typed: models do not import it)."""
    return callable(getattr(layer, "delta", None)) and not getattr(layer, "merged", True)


def stacked_projection(x, layers, dtype, fused=None):
    """(..., e) -> (..., h*d) through every head's own linear layer (e -> d) in one matmul.

    The families that keep one ``Linear`` per head (the notebooks' layout) call this instead of the
    layers, so a LoRA on a head's layer (``lora.LoRALinear``) adds its ``delta`` here, in that
    head's columns, and ``fused`` (a ``lora.FusedLoRA`` over all heads, as PEFT's on BERT's whole
    ``query``) adds its delta to all of them; merged adapters are in the kernels already.
    """
    kernel = jnp.concatenate([layer.kernel[...] for layer in layers], axis=1).astype(dtype)  # (e, h*d)
    bias = jnp.concatenate([layer.bias[...] for layer in layers]).astype(dtype)  # (h*d,)
    x = x.astype(dtype)
    y = x @ kernel + bias
    if any(_active_lora(layer) for layer in layers):
        y = y + jnp.concatenate([layer.delta(x).astype(dtype) if _active_lora(layer)
                                 else jnp.zeros((*x.shape[:-1], layer.kernel.shape[1]), dtype)
                                 for layer in layers], axis=-1)
    if fused is not None and _active_lora(fused):
        y = y + fused.delta(x).astype(dtype)
    return y
