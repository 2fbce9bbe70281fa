"""Shared settings and helpers for the parity tests.

fp32 parity is checked with full-precision matmuls, and with JAX's strict dtype
promotion so that an accidental float64/bool promotion in the library shows up here.
"""

import jax
import numpy as np
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_dtype_promotion", "strict")
torch.use_deterministic_algorithms(True)

TOL = 1e-5  # fp32, matmul precision "highest": a larger error is a bug, not noise


def assert_both_directions(torch_module, args, kwargs=None, *, seed=0, tol=TOL, eager_too=False):
    """torch->Flax and Flax->torch parity under jit, and also eagerly if asked.

    Eager Flax runs op by op (each op compiled for its shapes), so it costs more than
    jit on small inputs; the tests ask for it where masks are hardest and at model level.
    """
    from flax_transformer import verify

    for use_jit in (True, False) if eager_too else (True,):
        results = verify.both_directions(torch_module, args, kwargs, seed=seed, use_jit=use_jit)
        for direction, err, finite in results:
            assert finite, f"{direction} (jit={use_jit}): NaN or inf in the outputs"
            assert err <= tol, f"{direction} (jit={use_jit}): max abs err {err:.3g} > {tol:g}"


def assert_parameter_gradients_match(torch_model, args, rng):
    """d<model(*args), W>/d(every parameter) agrees between torch and the ported Flax model.

    W is a fixed random tensor of the output's shape. Tolerance: TOL relative to the
    gradient's scale (max(1, max |g|)).
    """
    import jax.numpy as jnp
    from flax import nnx

    from flax_transformer import porting

    torch_model.eval()
    flax_model = porting.torch_to_flax(torch_model)
    out = torch_model(*(torch.from_numpy(a) for a in args))
    w = rng.standard_normal(tuple(out.shape)).astype(np.float32)
    (out * torch.from_numpy(w)).sum().backward()
    grads = nnx.grad(lambda m: (m(*(jnp.asarray(a) for a in args)) * w).sum())(flax_model)
    holder = nnx.clone(flax_model)
    nnx.update(holder, grads)  # gradients in the parameters' places, to read them under torch names
    flax_grads = porting.state_dict(holder)
    torch_grads = {k: p.grad.numpy() for k, p in torch_model.named_parameters()}
    assert set(flax_grads) == set(torch_grads)
    for key, g in torch_grads.items():
        scale = max(1.0, float(np.abs(g).max()))
        err = float(np.abs(flax_grads[key] - g).max())
        assert err <= TOL * scale, f"{key}: grad max abs err {err:.3g} (scale {scale:.3g})"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
