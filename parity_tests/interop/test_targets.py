"""Building a porting target (``targets.build_unfilled``) without jax's quadratic tracer messages."""

from jax._src.interpreters import partial_eval

from flax_transformer.interop import targets
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.models.encoder import TransformerEncoder


def test_build_unfilled_walks_no_traced_equations(monkeypatch):
    """Each RNG count update of ``nnx.eval_shape`` probes a tracer's ``.sharding``; jax's message for
    that AttributeError walked every equation traced so far (MiniLM's target: 27 s instead of 6).
    build_unfilled walks none, and leaves jax's tracer as it found it."""
    walks = []
    real = partial_eval.JaxprStackFrame.find_progenitors
    monkeypatch.setattr(partial_eval.JaxprStackFrame, "find_progenitors",
                        lambda self, tracer: walks.append(1) or real(self, tracer))
    origin = vars(partial_eval.DynamicJaxprTracer)["_origin_msg"]
    model = targets.build_unfilled(TransformerEncoder, dict(config=EncoderConfig.tiny()))
    assert walks == [] and type(model).__name__ == "TransformerEncoder"
    assert vars(partial_eval.DynamicJaxprTracer)["_origin_msg"] is origin


def test_each_abstract_rng_stream_gets_its_own_key():
    """Two RNG streams left abstract by ``nnx.eval_shape`` get distinct keys (the same seed, not the same key)."""
    import jax
    import numpy as np
    from flax import nnx

    class TwoStreams(nnx.Module):
        def __init__(self, rngs):
            self.rngs = rngs

    model = nnx.eval_shape(lambda: TwoStreams(nnx.Rngs(params=0, dropout=1)))
    targets.fill_rng_state(model, 0)
    keys = [np.asarray(jax.random.key_data(v.get_value())) for _, v in nnx.iter_graph(model)
            if isinstance(v, nnx.RngKey)]
    assert len(keys) == 2 and not np.array_equal(keys[0], keys[1])
