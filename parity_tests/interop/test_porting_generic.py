"""Porting with no table entry: a user's own models, placed by Flax layer type, and ``rename=``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_transformer.models.former as ff
import torch_reference.former as tf
from flax_transformer.interop import porting, targets
from flax_transformer.models.state_dict_errors import StateDictError
from flax_transformer.verification import compare
from parity_tests.user_models import FlaxConvTagger, FlaxPostCTransformer, TorchConvTagger, TorchPostCTransformer

IDS = np.random.default_rng(0).integers(0, 20, (2, 5))
FORMER_NAMES = [(r"\.attention\.", ".mhattention.")]  # Bloem's former library -> notebook 000


def _snapshot(model):
    return {k: np.array(v) for k, v in porting.state_dict(model).items()}


def _unchanged(model, before):
    after = _snapshot(model)
    return after.keys() == before.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def test_own_model_ports_by_layer_type_into_the_given_module():
    torch_model = TorchConvTagger().eval()
    flax_model = nnx.eval_shape(lambda: FlaxConvTagger(rngs=nnx.Rngs(0)))  # abstract: no random init
    assert porting.torch_to_flax(torch_model, flax_model) is flax_model  # loaded in place
    report = compare.compare(torch_model, flax_model, (IDS,))
    assert report.passed, report
    # every weight bit-exact in torch's layout (a grouped Conv1d: (out, in/groups, k)); the buffer stays in torch
    ours, theirs = porting.state_dict(flax_model), torch_model.state_dict()
    assert ours.keys() == theirs.keys() - {"temperature"}
    assert all(np.array_equal(ours[k], theirs[k].numpy()) for k in ours)
    assert flax_model.conv.kernel.shape == (3, 4, 16)
    with pytest.raises(ValueError, match="keeps its own types"):
        porting.torch_to_flax(torch_model, flax_model, dtype=jnp.bfloat16)


def test_every_layer_type_ports_on_its_own():
    """Each known Flax layer type, as the root of a model, takes its torch layer's state_dict bit-exactly."""
    import flax_transformer.models.gpt as fg
    import torch_reference.gpt as tg
    from flax_transformer.models import layers

    pairs = [  # Flax layers built abstract (nnx.eval_shape): loading fills them, no random init to compile
        (lambda: layers.Linear(4, 3, rngs=nnx.Rngs(0)), torch.nn.Linear(4, 3)),
        (lambda: nnx.Linear(4, 3, use_bias=False, rngs=nnx.Rngs(0)), torch.nn.Linear(4, 3, bias=False)),
        (lambda: layers.Embed(5, 3, rngs=nnx.Rngs(0)), torch.nn.Embedding(5, 3)),
        (lambda: layers.LayerNorm(4), torch.nn.LayerNorm(4)),
        (lambda: nnx.LayerNorm(4, rngs=nnx.Rngs(0)), torch.nn.LayerNorm(4)),
        (lambda: nnx.RMSNorm(4, rngs=nnx.Rngs(0)), torch.nn.RMSNorm(4)),
        (lambda: nnx.Conv(4, 6, kernel_size=(3,), feature_group_count=2, rngs=nnx.Rngs(0)),
         torch.nn.Conv1d(4, 6, 3, groups=2)),
        (lambda: fg.Linear(4, 3, rngs=nnx.Rngs(0)), tg.Linear(4, 3)),
        (lambda: fg.LayerNorm(4), tg.LayerNorm(4)),
        (lambda: fg.Embeddings(5, 3, rngs=nnx.Rngs(0)), tg.Embeddings(5, 3)),
    ]
    for build, torch_layer in pairs:
        flax_layer = nnx.eval_shape(build)
        theirs = {k: v + 1 for k, v in torch_layer.state_dict().items()}  # not the initial values
        porting.load_state_dict(flax_layer, theirs)
        ours = porting.state_dict(flax_layer)
        assert ours.keys() == theirs.keys(), type(flax_layer)
        assert all(np.array_equal(ours[k], theirs[k].numpy()) for k in ours), type(flax_layer)


def _random_tagger(seed):
    """A FlaxConvTagger with random weights, filled from numpy: no eager random init to compile (~10 s)."""
    model = nnx.eval_shape(lambda: FlaxConvTagger(rngs=nnx.Rngs(seed)))
    rng = np.random.default_rng(seed)
    shapes = {k: tuple(v.shape) for k, v in TorchConvTagger().state_dict().items() if k != "temperature"}
    porting.load_state_dict(model, {k: rng.standard_normal(shape).astype(np.float32) for k, shape in shapes.items()})
    return model


def test_own_model_round_trips_flax_to_torch():
    flax_model = _random_tagger(1)
    torch_model = TorchConvTagger()
    assert porting.flax_to_torch(flax_model, torch_model) is torch_model
    assert torch_model.temperature.item() == 2.0  # torch's buffer kept
    report = compare.compare(torch_model, flax_model, (IDS,))
    assert report.passed, report
    again = porting.torch_to_flax(torch_model, nnx.eval_shape(lambda: FlaxConvTagger(rngs=nnx.Rngs(2))))
    before = _snapshot(flax_model)
    assert all(np.array_equal(before[k], v) for k, v in _snapshot(again).items())


def test_modified_ctransformer_ports_with_no_table_edit():
    torch_model = TorchPostCTransformer(8, 2, 1, 6, 20, 3).eval()
    twin = targets.build_unfilled(FlaxPostCTransformer, torch_model.init_kwargs())  # abstract, RNG streams set
    flax_model = porting.torch_to_flax(torch_model, twin)
    report = compare.compare(torch_model, flax_model, (IDS,))
    assert report.passed, report
    back = porting.flax_to_torch(flax_model, TorchPostCTransformer(8, 2, 1, 6, 20, 3))
    assert all(torch.equal(v, torch_model.state_dict()[k]) for k, v in back.state_dict().items())
    # the library's own CTransformer has no `post`: refused, both keys named, nothing loaded
    plain = targets.build_unfilled(ff.CTransformer, torch_model.init_kwargs())
    with pytest.raises(StateDictError, match=r"unexpected keys \(2\): post.weight, post.bias"):
        porting.torch_to_flax(torch_model, plain)
    assert isinstance(plain.toprobs.kernel.get_value(), jax.ShapeDtypeStruct)  # still unfilled


def test_former_library_names_port_with_rename():
    torch_model = tf.CTransformer(8, 2, 1, 6, 20, 3).eval()
    theirs = {k.replace(".mhattention.", ".attention."): v for k, v in torch_model.state_dict().items()}
    assert "tblocks.0.attention.tokeys.weight" in theirs
    model = targets.build_unfilled(ff.CTransformer, torch_model.init_kwargs())
    with pytest.raises(StateDictError, match="rename=") as info:
        porting.load_state_dict(model, theirs)
    assert "tblocks.0.attention.tokeys.weight" in info.value.unexpected
    assert "tblocks.0.mhattention.tokeys.weight" in info.value.missing
    assert isinstance(model.toprobs.kernel.get_value(), jax.ShapeDtypeStruct)  # nothing loaded
    porting.load_state_dict(model, theirs, rename=FORMER_NAMES)
    report = compare.compare(torch_model, model, (IDS,))
    assert report.passed, report
    # and back under their names
    out = porting.state_dict(model, rename=[(r"\.mhattention\.", ".attention.")])
    assert out.keys() == theirs.keys() and all(np.array_equal(out[k], theirs[k].numpy()) for k in out)


def test_unplaceable_keys_are_refused_with_every_offender_named():
    model = _random_tagger(0)
    before = _snapshot(model)
    state = {k: v + 1 for k, v in TorchConvTagger().state_dict().items() if k != "temperature"}
    state["decoder.weight"] = torch.zeros(3)  # no Flax module at decoder
    state["conv.scale"] = torch.zeros(16)  # a Conv takes weight and bias only
    with pytest.raises(StateDictError) as info:
        porting.load_state_dict(model, state)
    assert sorted(info.value.unexpected) == ["conv.scale", "decoder.weight"]
    message = str(info.value)
    for part in ("no Flax module at 'decoder'", "the Conv at 'conv' is a conv layer; it takes bias, weight, not "
                 "'scale'", "rename=", "nothing was loaded"):
        assert part in message, part
    assert _unchanged(model, before)
    # a torch *parameter* with no place is refused by torch_to_flax too (buffers alone are skipped)
    extra = TorchConvTagger()
    extra.gate = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(StateDictError, match=r"unexpected keys \(1\): gate"):
        porting.torch_to_flax(extra, model)
    assert _unchanged(model, before)


def test_keys_placed_two_ways_are_refused_naming_both():
    model = _random_tagger(0)
    before = _snapshot(model)
    state = {k: v + 1 for k, v in TorchConvTagger().state_dict().items() if k != "temperature"}
    state["proj2.weight"] = state["proj.weight"]
    for strict in (True, False):  # ambiguity is an error either way
        with pytest.raises(StateDictError, match=r"proj2\.weight \(renamed proj\.weight\) and proj\.weight all "
                           r"land on proj\.kernel|proj\.weight and proj2\.weight \(renamed proj\.weight\) all land"):
            porting.load_state_dict(model, state, strict, rename=[(r"^proj2\.", "proj.")])
    assert _unchanged(model, before)

    class LinearEmbed(nnx.Linear, nnx.Embed):  # a layer of two kinds: torch's `weight` fits both
        pass

    tied = LinearEmbed(3, 3, rngs=nnx.Rngs(0))
    tied.embedding = nnx.Param(jnp.zeros((3, 3)))
    with pytest.raises(StateDictError, match=r"weight fits embedding -> embedding and linear -> kernel") as info:
        porting.load_state_dict(tied, {"weight": np.ones((3, 3), np.float32), "bias": np.ones(3, np.float32)})
    assert not info.value.missing
    assert np.all(np.asarray(tied.bias[...]) != 1)
    with pytest.raises(StateDictError, match="embedding and kernel both become weight"):
        porting.state_dict(tied)


def test_bad_rename_is_refused_before_any_work():
    model = nnx.eval_shape(lambda: FlaxConvTagger(rngs=nnx.Rngs(0)))
    for rename, message in [("x", "list of"), ([("(", "x")], "not a valid regex"), ([(r"a", r"\1")], "group"),
                            ([("a",)], "pair")]:
        with pytest.raises(ValueError, match=message):
            porting.load_state_dict(model, {}, rename=rename)


def test_ported_weights_do_not_share_memory_with_the_torch_tensors():
    """On CPU ``jnp.asarray`` of a numpy array may alias it, and ``tensor.numpy()`` shares the tensor's
    memory: an in-place torch update (an optimizer step) must not reach the Flax weights."""
    import torch

    from flax_transformer.models.former import CTransformer as FlaxCTransformer
    from torch_reference.former import CTransformer

    torch_model = CTransformer(32, 4, 1, 16, 100, 2)
    flax_model = porting.torch_to_flax(torch_model)
    before = np.array(flax_model.toprobs.kernel[...])
    with torch.no_grad():
        for p in torch_model.parameters():
            p.add_(1.0)
    np.testing.assert_array_equal(np.array(flax_model.toprobs.kernel[...]), before)
    target = targets.build_unfilled(FlaxCTransformer, dict(emb=32, heads=4, depth=1, seq_length=16, num_tokens=100,
                                                           num_classes=2))
    state = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    porting.load_state_dict(target, state)
    state["token_embedding.weight"] += 1.0  # the caller's numpy array, changed afterwards
    assert not np.array_equal(np.array(target.token_embedding.embedding[...]), state["token_embedding.weight"])
