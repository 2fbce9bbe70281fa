"""The porting API: round trips, strict checking, dtypes, the key tables."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

import flax_transformer.models.former as ff
import torch_reference.encoder as te
import torch_reference.former as tf
from flax_transformer.interop import family_tables, porting, targets
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.models.state_dict_errors import StateDictError


def _models():
    return [
        tf.CTransformer(16, 4, 2, 12, 40, 3, attention=["narrow", "wide"]),
        tf.GTransformer(12, 3, 2, 10, 30),
        tf.TransformerBlock(8, 2, True, 5),
        tf.SelfAttention(6, 2),
        te.TransformerForSequenceClassification(EncoderConfig.tiny()),
        te.MultiHeadAttention(EncoderConfig.tiny()),
        te.AttentionHead(8, 4),
    ]


@pytest.mark.parametrize("model", _models(), ids=lambda m: type(m).__name__)
@pytest.mark.keep_cases("AttentionHead", "CTransformer", "MultiHeadAttention", "TransformerBlock", "TransformerForSequenceClassification", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_round_trips_are_bit_exact(model):
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    flax_model = porting.torch_to_flax(model)
    # torch -> Flax -> torch names
    out = porting.state_dict(flax_model)
    assert out.keys() == sd.keys()
    for k in sd:
        assert out[k].dtype == sd[k].dtype and np.array_equal(out[k], sd[k]), k
    # Flax state_dict -> load -> state_dict
    other = porting.flax_class(model)(**model.init_kwargs(), rngs=nnx.Rngs(9))
    porting.load_state_dict(other, out)
    again = porting.state_dict(other)
    assert all(np.array_equal(again[k], out[k]) for k in out)
    # Flax -> torch module -> state_dict
    back = porting.flax_to_torch(flax_model).state_dict()
    assert all(torch.equal(back[k], model.state_dict()[k]) for k in sd)


def _snapshot(model):
    return {k: np.array(v) for k, v in porting.state_dict(model).items()}


def test_strict_load_reports_every_problem_and_loads_nothing():
    model = ff.CTransformer(16, 4, 2, 12, 40, 3, rngs=nnx.Rngs(0))
    before = _snapshot(model)
    sd = {k: v + 1.0 for k, v in porting.state_dict(model).items()}
    del sd["tblocks.1.norm2.bias"]
    del sd["toprobs.weight"]
    sd["tblocks.0.extra.weight"] = np.zeros(3, np.float32)
    sd["decoder.weight"] = np.zeros(3, np.float32)
    sd["tblocks.0.mhattention.tokeys.weight"] = np.zeros((16, 15), np.float32)
    with pytest.raises(StateDictError) as info:
        porting.load_state_dict(model, sd)
    err = info.value
    assert sorted(err.missing) == ["tblocks.1.norm2.bias", "toprobs.weight"]
    assert sorted(err.unexpected) == ["decoder.weight", "tblocks.0.extra.weight"]
    assert err.mismatched == [("tblocks.0.mhattention.tokeys.weight", (16, 15), (16, 16))]  # torch layout
    message = str(err)
    for name in ("tblocks.1.norm2.bias", "toprobs.weight", "decoder.weight", "tokeys", "nothing was loaded",
                 "checkpoint (16, 15) vs model (16, 16)"):
        assert name in message
    after = _snapshot(model)
    assert all(np.array_equal(before[k], after[k]) for k in before), "a failed load changed parameters"


def test_non_strict_load_reports_and_still_rejects_shape_mismatch():
    model = ff.GTransformer(8, 2, 1, 6, 11, rngs=nnx.Rngs(0))
    sd = porting.state_dict(model)
    partial = {k: v * 0 for k, v in sd.items() if not k.startswith("toprobs")}
    partial["junk.weight"] = np.zeros(1, np.float32)
    result = porting.load_state_dict(model, partial, strict=False)
    assert sorted(result.missing_keys) == ["toprobs.bias", "toprobs.weight"]
    assert result.unexpected_keys == ["junk.weight"]
    assert np.all(np.asarray(model.token_embedding.embedding[...]) == 0)
    assert np.any(np.asarray(model.toprobs.kernel[...]) != 0)
    partial["toprobs.bias"] = np.zeros(5, np.float32)
    with pytest.raises(StateDictError, match="toprobs.bias: checkpoint \\(5,\\) vs model \\(11,\\)"):
        porting.load_state_dict(model, partial, strict=False)


def test_loading_another_family_fails_with_the_full_list():
    encoder_sd = te.TransformerEncoder(EncoderConfig.tiny()).state_dict()
    with pytest.raises(StateDictError) as info:
        porting.load_state_dict(ff.GTransformer(8, 2, 1, 6, 11, rngs=nnx.Rngs(0)), encoder_sd)
    assert len(info.value.unexpected) == len(encoder_sd)
    assert "token_embedding.weight" in info.value.missing


def test_bf16_weights_load_into_fp32_and_bf16_models():
    model = tf.CTransformer(8, 2, 1, 6, 20, 2).eval()
    bf16 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    fp32_model = ff.CTransformer(8, 2, 1, 6, 20, 2, rngs=nnx.Rngs(0))
    porting.load_state_dict(fp32_model, bf16)
    assert fp32_model.toprobs.kernel.dtype == jnp.float32
    expected = bf16["toprobs.weight"].float().numpy().T
    assert np.array_equal(np.asarray(fp32_model.toprobs.kernel[...]), expected)  # widening is exact
    bf16_model = ff.CTransformer(8, 2, 1, 6, 20, 2, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    porting.load_state_dict(bf16_model, model.state_dict())
    assert bf16_model.toprobs.kernel.dtype == jnp.bfloat16
    sd = porting.state_dict(bf16_model)
    assert sd["toprobs.weight"].dtype == ml_dtypes.bfloat16
    assert np.array_equal(sd["toprobs.weight"].astype(np.float32), bf16["toprobs.weight"].float().numpy())
    # and a bf16-parameter model ports to torch (widened to fp32)
    assert porting.flax_to_torch(bf16_model).toprobs.weight.dtype == torch.float32


def test_torch_to_flax_keeps_mode_and_options():
    model = tf.CTransformer(8, 2, 2, 6, 20, 2, max_pool=False, dropout=0.3, attention=["wide", "narrow"], scale="head")
    flax_model = porting.torch_to_flax(model)
    assert not flax_model.do.deterministic  # torch modules start in train mode
    assert isinstance(flax_model.tblocks[0].mhattention, ff.SelfAttention)
    assert isinstance(flax_model.tblocks[1].mhattention, ff.MHSelfAttention)
    assert flax_model.tblocks[1].mhattention.scale == "head" and not flax_model.max_pool
    assert porting.torch_to_flax(model.eval()).do.deterministic


@pytest.mark.slow(reason="test_bf16_weights_load_into_fp32_and_bf16_models")
def test_torch_to_flax_dtypes():
    model = te.TransformerEncoder(EncoderConfig.tiny()).eval()
    flax_model = porting.torch_to_flax(model, dtype=jnp.bfloat16)
    ids = jnp.ones((2, 5), jnp.int32)
    out = flax_model(ids)
    assert out.dtype == jnp.bfloat16
    assert flax_model.layers[0].attention.output_linear.kernel.dtype == jnp.float32


def test_unknown_modules_are_refused():
    """No twin can be built for a model outside the families; its weights still port by layer type."""
    with pytest.raises(TypeError, match="not a flax_transformer or torch_reference model.*flax_module"):
        porting.torch_to_flax(torch.nn.Linear(2, 2))
    linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="not a flax_transformer or torch_reference model.*torch_module"):
        porting.flax_to_torch(linear)
    assert {k: v.shape for k, v in porting.state_dict(linear).items()} == {"weight": (3, 2), "bias": (3,)}


def test_every_torch_key_has_exactly_one_rule():
    """Each family's table covers every parameter of every class, and no key two ways."""
    for model in _models():
        family = porting.family_of(model)
        for key in model.state_dict():
            path, _ = porting.torch_key_to_flax(family, key)
            assert porting.flax_path_to_torch(family, path)[0] == key
            module_path = key.rpartition(".")[0]
            hits = [p for p in family_tables.KEY_MAPS[family] if re.fullmatch(rf"(?:.+\.)?(?:{p})", module_path)]
            assert len(hits) == 1, (key, hits)


def test_porting_builds_the_target_without_random_init():
    """Parameters stay abstract until loaded: porting a 50k x 8 table draws no random numbers."""
    unfilled = targets.build_unfilled(ff.GTransformer, dict(emb=8, heads=2, depth=1, seq_length=4, num_tokens=50_000))
    assert isinstance(unfilled.token_embedding.embedding.get_value(), jax.ShapeDtypeStruct)
    model = tf.GTransformer(8, 2, 1, 4, 50_000)
    porting.load_state_dict(unfilled, model.state_dict())
    assert np.array_equal(np.asarray(unfilled.token_embedding.embedding[...]), model.token_embedding.weight.detach().numpy())


def test_torch_reference_load_is_all_or_nothing_too():
    """torch's own loader copies matching keys before raising; torch_reference's does not."""
    model = tf.CTransformer(8, 2, 1, 6, 20, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {k: v + 1 for k, v in before.items()}
    sd["extra.weight"] = torch.zeros(1)
    sd["toprobs.weight"] = torch.zeros(3, 8)
    with pytest.raises(RuntimeError) as info:  # also a StateDictError (a ValueError)
        model.load_state_dict(sd)
    assert isinstance(info.value, StateDictError)
    assert info.value.unexpected == ["extra.weight"]
    assert info.value.mismatched == [("toprobs.weight", (3, 8), (2, 8))]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_config_mutated_after_construction_does_not_break_porting():
    """Notebook 001 sets config.num_labels after building models; the recorded config is a frozen copy."""
    import types

    cfg = types.SimpleNamespace(vocab_size=30, hidden_size=8, num_attention_heads=2, num_hidden_layers=1,
                                intermediate_size=16, max_position_embeddings=10, num_labels=2)
    model = te.TransformerForSequenceClassification(cfg)
    cfg.num_labels = 3
    flax_model = porting.torch_to_flax(model)
    assert flax_model.classifier.kernel.shape == (8, 2)
    assert porting.flax_to_torch(flax_model).classifier.weight.shape == (2, 8)


def test_unconvertible_values_load_nothing():
    model = ff.GTransformer(8, 2, 1, 6, 11, rngs=nnx.Rngs(0))
    before = _snapshot(model)
    sd = porting.state_dict(model)
    sd = {k: v + 1 for k, v in sd.items()}
    sd["toprobs.bias"] = np.array(["x"] * 11)
    with pytest.raises(TypeError, match="nothing was loaded"):
        porting.load_state_dict(model, sd)
    assert all(np.array_equal(before[k], v) for k, v in _snapshot(model).items())
