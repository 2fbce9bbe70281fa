"""The error lines of LoRA runs (``training.lora_runs``): an ``--init-adapter`` that PEFT made for a base
other than the one given (PiSSA saved without conversion) is refused before the run starts, with what
to do; a full disk at ``--export-peft``, after the whole run, names the folder and says that the
run's checkpoint is saved and how to write the adapter from it; a NaN logit difference in the
--export-peft check fails it.
"""

import errno
import types

import numpy as np
import pytest
from flax import nnx

from flax_transformer.interop import hf, safetensors_io
from flax_transformer.models import lora
from flax_transformer.training import errors, lora_runs

peft_lib = pytest.importorskip("peft", reason="pip install peft")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random llama's HF folder."""
    import torch

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama") / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32)).save_pretrained(path)
    return path


def test_init_adapter_of_a_pissa_adapter_saved_unconverted_is_refused_before_the_run(llama, tmp_path):
    """PiSSA trains on the residual base (its start subtracted from the weights): onto the unchanged base
    it computes something else, and a run from it would report its validation loss as if it did not."""
    base = transformers.LlamaForCausalLM.from_pretrained(llama)
    peft_lib.get_peft_model(base, peft_lib.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights="pissa")).save_pretrained(tmp_path / "pissa")
    config = types.SimpleNamespace(lora=types.SimpleNamespace(init_adapter=str(tmp_path / "pissa")),
                                   run=types.SimpleNamespace(seed=0))
    model = hf.from_pretrained(llama)
    with pytest.raises(errors.RunError, match=r"^--init-adapter .*pissa: .*init_lora_weights='pissa' subtracts .* "
                                              "path_initial_model_for_weight_conversion"):
        lora_runs.adapt(model, config, task="lm", folder=llama, run_dir=tmp_path / "run", fresh=True)
    assert not lora.layers(model) and not (tmp_path / "run").exists()


def test_a_full_disk_at_export_peft_names_the_folder_and_the_saved_checkpoint(llama, tmp_path, monkeypatch):
    model = lora.apply(hf.from_pretrained(llama), rank=2, targets=["q_proj"], rngs=nnx.Rngs(0))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors_io, "write_safetensors", full)
    out, run = tmp_path / "peft", tmp_path / "run"
    with pytest.raises(errors.RunError) as caught:
        lora_runs.export_peft(model, out, folder=llama, task="lm", run_dir=run, ids=np.arange(5))
    assert str(caught.value) == (
        f"--export-peft {out}: not written (No space left on device); training finished and its checkpoint is saved "
        f"in {run}: make room and write the adapter with `flax-transformer port {run} {out} --to peft`")
    assert list(tmp_path.iterdir()) == []  # no folder, no temporary one


def test_a_nan_logit_difference_at_export_peft_is_a_failure(tmp_path, monkeypatch):
    """check_peft's max abs difference NaN (a NaN logit on one side) fails the export, as a large one does."""
    from flax_transformer.verification import export

    monkeypatch.setattr(export, "save_peft", lambda *args, **kwargs: None)
    monkeypatch.setattr(lora_runs, "check_peft", lambda *args, **kwargs: {"loading_info": {},
                                                                          "max_abs_diff": float("nan")})
    with pytest.raises(errors.RunError, match="does not match in peft: .*max abs logit difference nan"):
        lora_runs.export_peft(None, tmp_path / "peft", folder=tmp_path, task="lm")
