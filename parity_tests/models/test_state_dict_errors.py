"""``StateDictError``'s hints (issue 36 item 5): a ``torch.compile``'d model's ``_orig_mod.`` keys and a training
checkpoint dict are named with their fix, by torch_reference's strict load, porting's and the file readers,
instead of a list of every key missing and unexpected."""

import warnings

import pytest
import torch

from flax_transformer.interop import porting, safetensors_io
from flax_transformer.models.state_dict_errors import COMPILED_HINT, StateDictError, weights_entry
from torch_reference.former import MHSelfAttention


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MHSelfAttention(8, 2)


def _loaders(model):
    return {"torch_reference": model.load_state_dict,
            "porting": lambda state: porting.load_state_dict(porting.torch_to_flax(model), state)}


@pytest.mark.parametrize("loader", ["torch_reference", "porting"])
def test_compiled_prefix_is_named_first(model, loader):
    state = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    with pytest.raises(StateDictError) as caught:
        _loaders(model)[loader](state)
    lines = str(caught.value).splitlines()
    assert lines[1].strip() == COMPILED_HINT, lines  # right under the headline, before the key lists
    with pytest.raises(StateDictError) as plain:  # a mere misnaming gets no such hint
        _loaders(model)[loader]({f"other.{k}": v for k, v in model.state_dict().items()})
    assert "_orig_mod" not in str(plain.value)


@pytest.mark.parametrize("entry", ["model", "state_dict"])
@pytest.mark.parametrize("loader", ["torch_reference", "porting"])
def test_training_checkpoint_dict_points_at_its_entry(model, loader, entry):
    checkpoint = {entry: model.state_dict(), "optimizer": {"state": {}}, "step": 3}
    with pytest.raises(StateDictError, match=rf"a training checkpoint \(entries: {entry}, optimizer, step\), not a "
                       rf"state_dict; nothing was loaded: its weights are its '{entry}' entry: "
                       rf"load_state_dict\(checkpoint\['{entry}'\]\)"):
        _loaders(model)[loader](checkpoint)


def test_file_readers_read_the_entry_and_say_so(model, tmp_path):
    """A torch file holding a training checkpoint: its ``model`` entry is read, with a warning naming it and
    what was left out; a plain state_dict file reads without one."""
    torch.save({"model": model.state_dict(), "optimizer": {}, "step": 3}, tmp_path / "train.pt")
    with pytest.warns(UserWarning, match=r"train\.pt is a training checkpoint: its weights read from its 'model' "
                                         r"entry \(left out: optimizer, step\)"):
        read = safetensors_io.read_torch_pickle(tmp_path / "train.pt")
    assert sorted(read) == sorted(model.state_dict())
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(safetensors_io.read_torch_pickle(tmp_path / "plain.pt")) == sorted(read)


def test_weights_entry():
    tensor = torch.zeros(2)
    assert weights_entry({"model": {"w": tensor}, "step": 1}) == "model"
    assert weights_entry({"model_state_dict": {"w": tensor}, "epoch": 2}) == "model_state_dict"
    assert weights_entry({"w": tensor, "b": tensor}) is None  # a state_dict
    assert weights_entry({"step": 1}) is None  # no entry holds weights
    # a training checkpoint whose step is itself a tensor is still a training checkpoint
    assert weights_entry({"model": {"w": tensor}, "step": torch.tensor(3)}) == "model"
