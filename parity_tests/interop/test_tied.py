"""A user's GPT whose head is tied to its embedding, ported both ways with no rename and no key deleted;
``nnx.eval_shape`` targets that run after porting; ``--pair FILE.py:FACTORY`` importing its sibling."""

import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import porting
from flax_transformer.models.state_dict_errors import StateDictError
from flax_transformer.verification import compare
from parity_tests.user_models_tied import LENGTH, VOCAB, FlaxTiedGPT, FlaxUntiedGPT, TorchTiedGPT

IDS = np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH))
ROOT = Path(__file__).resolve().parents[2]


class UndeclaredGPT(FlaxTiedGPT):
    """The attend twin without its declaration: ties are then known by shared memory only."""

    tied_keys = ()


def _target(cls):
    return nnx.eval_shape(lambda: cls(rngs=nnx.Rngs(0)))  # as the docs build targets: abstract, RNG state too


def _same_weights(torch_model, reference):
    theirs = reference.state_dict()
    return torch_model.state_dict().keys() == theirs.keys() and all(
        torch.equal(v, theirs[k]) for k, v in torch_model.state_dict().items())


def _passes(torch_model, flax_model):
    report = compare.compare(torch_model, flax_model, (IDS,))
    assert report.passed, report


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TorchTiedGPT().eval()


@pytest.fixture(scope="module")
def attend_twin(gpt):
    """The attend twin ported into an ``nnx.eval_shape`` target, compared once."""
    flax_model = porting.torch_to_flax(gpt, _target(FlaxTiedGPT))  # lm_head.weight has no place: it is tok_emb's
    _passes(gpt, flax_model)  # runs: compare fails on a target whose RNG state is still abstract
    return flax_model


def test_tied_keys_groups_the_names_of_one_tensor(gpt):
    assert porting.tied_keys(gpt) == [("tok_emb.weight", "lm_head.weight")]
    untied = TorchTiedGPT()
    untied.lm_head.weight = torch.nn.Parameter(untied.tok_emb.weight.detach().clone())  # equal, not one
    assert porting.tied_keys(untied) == []
    assert porting.tied_keys(_target(FlaxTiedGPT)) == [("lm_head.weight", "tok_emb.weight")]  # declared
    assert porting.tied_keys(_target(FlaxUntiedGPT)) == porting.tied_keys(_target(UndeclaredGPT)) == []


def test_untied_twin_both_ways_and_differing_copies_refused(gpt):
    flax_model = porting.torch_to_flax(gpt, _target(FlaxUntiedGPT))
    _passes(gpt, flax_model)
    np.testing.assert_array_equal(flax_model.lm_head.kernel[...], flax_model.tok_emb.embedding[...].T)
    back = porting.flax_to_torch(flax_model, TorchTiedGPT())  # bit-exact weights: gpt's outputs, compared above
    assert back.lm_head.weight is back.tok_emb.weight and _same_weights(back, gpt)
    # the Flax head trained apart from the embedding: torch keeps one tensor, so one would be lost
    flax_model.lm_head.kernel.set_value(flax_model.lm_head.kernel[...] + 0.5)
    fresh = TorchTiedGPT()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(StateDictError) as info:  # every problem at once, nothing written
        porting.flax_to_torch(flax_model, fresh, rename=[(r"^ln_f\.", "ln_final.")])
    assert info.value.tied == ["tok_emb.weight and lm_head.weight are one tensor in the torch module, but the Flax "
                               "model's differ (largest difference 0.5); writing both would lose one"]
    assert info.value.missing == ["ln_f.weight", "ln_f.bias"] and "lm_head.weight" not in info.value.missing
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_attend_twin_both_ways_with_no_rename(gpt, attend_twin):
    ours = porting.state_dict(attend_twin)  # the declared tie: both names, one array
    assert ours.keys() == gpt.state_dict().keys() and ours["lm_head.weight"] is ours["tok_emb.weight"]
    undeclared = porting.torch_to_flax(gpt, _target(UndeclaredGPT))  # known tied by the torch storage alone
    assert "lm_head.weight" not in porting.state_dict(undeclared)
    assert all(np.array_equal(v, ours[k]) for k, v in porting.state_dict(undeclared).items())
    back = porting.flax_to_torch(undeclared, TorchTiedGPT())  # the torch module's tie names both keys
    assert back.lm_head.weight is back.tok_emb.weight and _same_weights(back, gpt)
    # numpy: views of the torch tensors share memory and load; copies load where the model declares the tie
    views = {k: v.numpy() for k, v in gpt.state_dict().items()}
    copies = {k: v.copy() for k, v in views.items()}
    porting.load_state_dict(_target(UndeclaredGPT), views)
    porting.load_state_dict(_target(FlaxTiedGPT), copies)
    porting.load_state_dict(_target(FlaxTiedGPT), {k: v for k, v in copies.items() if k != "lm_head.weight"})
    with pytest.raises(StateDictError, match=r"lm_head\.weight: no Flax module at 'lm_head'; it equals "
                       r"tok_emb\.weight: .* tied_keys = \(\('lm_head\.weight', 'tok_emb\.weight'\),\)"):
        porting.load_state_dict(_target(UndeclaredGPT), copies)
    foreign = {f"transformer.{k}": v for k, v in copies.items()}  # the hint declares the model's names, not the file's
    with pytest.raises(StateDictError, match=r"it equals transformer\.tok_emb\.weight: .* "
                       r"tied_keys = \(\('lm_head\.weight', 'tok_emb\.weight'\),\)"):
        porting.load_state_dict(_target(UndeclaredGPT), foreign, rename=[(r"^transformer\.", "")])
    copies["lm_head.weight"] = copies["lm_head.weight"] + 1
    target = _target(FlaxTiedGPT)
    with pytest.raises(StateDictError, match=r"tok_emb\.weight and lm_head\.weight are declared one tensor "
                       r"\(tied_keys\) but differ \(largest difference 1\)"):
        porting.load_state_dict(target, copies)
    assert isinstance(target.tok_emb.embedding.get_value(), jax.ShapeDtypeStruct)  # nothing loaded
    # the old workaround, a rename onto the embedding, is still two keys on one parameter, and says why
    with pytest.raises(StateDictError, match=r"all land on tok_emb\.embedding \(one tied tensor: tied keys load "
                       "with no rename"):
        porting.torch_to_flax(gpt, _target(FlaxTiedGPT), rename=[(r"^lm_head\.", "tok_emb.")])


def test_eval_shape_target_runs_after_porting(gpt, attend_twin):
    loaded = _target(FlaxTiedGPT)
    porting.load_state_dict(loaded, gpt.state_dict(), seed=1)  # load_state_dict fills the RNG state too
    for model in (attend_twin, loaded):
        assert not [v for v in jax.tree.leaves(nnx.state(model)) if isinstance(v, jax.ShapeDtypeStruct)]
    drop = loaded.blocks[0].drop  # in training, dropout draws from a stream that eval_shape left abstract
    drop.deterministic = False
    kept = np.asarray(drop(jax.numpy.ones((4, 8))))
    assert 0 < np.count_nonzero(kept) < kept.size

    class Masked(FlaxTiedGPT):  # state that no torch weight gives: refused before anything is loaded
        def __init__(self, *, rngs):
            super().__init__(rngs=rngs)
            self.causal = nnx.Variable(jax.numpy.tril(jax.numpy.ones((LENGTH, LENGTH), bool)))

    target = _target(Masked)
    with pytest.raises(ValueError, match=r"left state that is not a parameter abstract \(1\): causal \(Variable\); "
                       r"the torch weights cannot fill it: build the target concretely"):
        porting.torch_to_flax(gpt, target)
    assert isinstance(target.tok_emb.embedding.get_value(), jax.ShapeDtypeStruct)


PAIR = """
from my_gpt import make_pair  # a sibling module of this file


def make():
    return make_pair()


def raises():
    import my_gpt
    return my_gpt.no_such_factory()
"""


def test_pair_file_imports_its_sibling(tmp_path, capsys):
    from flax_transformer.cli.commands import main

    shutil.copy(ROOT / "parity_tests" / "user_models_tied.py", tmp_path / "my_gpt.py")
    (tmp_path / "pair.py").write_text(PAIR)
    path = list(sys.path)  # in-process: the subprocess it was cost a start-up and tested nothing more
    assert main(["verify", "--pair", f"{tmp_path}/pair.py:make"]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip().endswith("pass"), out.out + out.err
    assert sys.path == path  # the sibling imported (the pair passed), the path put back
    assert main(["verify", "--pair", f"{tmp_path}/pair.py:raises"]) == 2  # a factory that raises: one line
    err = capsys.readouterr().err
    assert "raised AttributeError" in err and len(err.strip().splitlines()) == 1, err
    assert sys.path == path  # the file's folder was on the path only while it imported
