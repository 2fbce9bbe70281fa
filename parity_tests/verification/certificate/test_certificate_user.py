"""Certified exports of a user's own model (issue 23 item 7): a nanoGPT-style GPT whose head is its token
embedding, written in plain torch, exported from its NNX twin with the torch names of its reference and a
certificate, re-checked through the library and the CLI with the pair's factory."""

import hashlib
import json
import re
import shutil

import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from flax_transformer.cli.commands import main
from flax_transformer.interop import porting
from flax_transformer.models.state_dict_errors import StateDictError
from flax_transformer.verification import certificate, export
from flax_transformer.verification.certificate.schema import CertificateError, validate
from parity_tests.user_models_tied import LENGTH, VOCAB, FlaxTiedGPT, TorchTiedGPT

SPEC = "parity_tests.verification.certificate.test_certificate_user:renamed_pair"  # FACTORY() returns (torch GPT, Flax twin, (ids,))
TIED_SPEC = "parity_tests.user_models_tied:make_pair"  # the same GPT with FlaxTiedGPT: another Flax class
RENAME = [(r"^ln_f\.", "ln_final.")]  # torch names -> the Flax model's, as torch_to_flax and compare take it
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH))  # make_pair's ids


class FinalNormGPT(FlaxTiedGPT):
    """The tied twin with its last norm called ``ln_final``: torch's ``ln_f.*`` reach it through RENAME."""

    ln_f = property(lambda self: self.ln_final, lambda self, value: setattr(self, "ln_final", value))


def renamed_pair():
    torch.manual_seed(0)
    torch_model = TorchTiedGPT().eval()
    return torch_model, porting.torch_to_flax(torch_model, FinalNormGPT(rngs=nnx.Rngs(0)), rename=RENAME), (IDS,)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One twin (its norm renamed), exported three ways: one compile of the check for all of them.
    safetensors and orbax name their reference by its factory; torch's is a fresh torch GPT (its own
    weights are not used) with the inputs given."""
    folder = tmp_path_factory.mktemp("own")
    torch_model, flax_model, _ = renamed_pair()
    return {"torch_model": torch_model, "flax_model": flax_model,
            "safetensors": export.save_safetensors(flax_model, folder / "gpt.safetensors", reference=SPEC,
                                                   rename=RENAME),
            "orbax": export.save_orbax(flax_model, folder / "gpt-orbax", reference=SPEC, rename=RENAME),
            "torch": export.save_torch(flax_model, folder / "gpt.pt", reference=TorchTiedGPT(), rename=RENAME,
                                       inputs=(IDS,))}


def _record(path):
    return json.loads(certificate.path_for(path).read_text())


def test_exports_hold_the_reference_names_and_recheck(exported, capsys):
    reference = exported["torch_model"].state_dict()
    stored = load_file(exported["safetensors"])  # both names of the tied tensor, as separate equal copies
    assert stored.keys() == reference.keys() and {"lm_head.weight", "tok_emb.weight"} <= stored.keys()
    assert all(np.array_equal(v, reference[k].numpy()) for k, v in stored.items())
    loaded = torch.load(exported["torch"], weights_only=True)  # the tie kept, as torch.save(state_dict()) keeps it
    assert loaded["lm_head.weight"].data_ptr() == loaded["tok_emb.weight"].data_ptr()
    TorchTiedGPT().load_state_dict(loaded, strict=True)  # the reference's names, the renamed norm's included
    assert torch.equal(loaded["ln_f.weight"], reference["ln_f.weight"])
    for fmt in ("safetensors", "orbax", "torch"):
        record = _record(exported[fmt])
        assert record["format"] == fmt and record["model"] == {
            "family": "user", "class": "TorchTiedGPT", "module": "parity_tests.user_models_tied",
            "flax_class": "FinalNormGPT", "flax_module": "parity_tests.verification.certificate.test_certificate_user",
            "reference": None if fmt == "torch" else SPEC, "rename": [list(RENAME[0])]}
        assert record["inputs"]["args"] == [{"shape": [2, LENGTH], "dtype": "int64",
                                             "sha256": hashlib.sha256(IDS.tobytes()).hexdigest()}]
        assert record["inputs"]["drawn_by"] == ("given (inputs=)" if fmt == "torch" else
                                                f"the args of the reference factory {SPEC}")
        assert record["forward"]["passed"] and record["backward"]["passed"] and record["forward"]["max_abs_err"] > 0
        assert ("lm_head.weight" in record["tensors"]) == (fmt != "orbax")  # orbax: the Flax tree, no head
        report = certificate.recheck(exported[fmt], pair=SPEC)
        assert report.passed and not report.notes and len(report.passes) == 3, report.format()
    capsys.readouterr()
    assert main(["verify", "--checkpoint", str(exported["torch"]), "--pair", SPEC]) == 0
    assert "certificate: 3 passed, 0 failed, 0 notes" in capsys.readouterr().out


def test_a_changed_tensor_is_named(exported, tmp_path, capsys):
    path = tmp_path / "gpt.safetensors"
    shutil.copy(exported["safetensors"], path)
    shutil.copy(certificate.path_for(exported["safetensors"]), certificate.path_for(path))
    tensors = load_file(path)
    tensors["blocks.0.c_fc.weight"][0, 0] += 1e-3
    save_file(tensors, path, metadata={"format": "pt"})
    assert main(["verify", "--checkpoint", str(path), "--pair", SPEC]) == 1
    out = capsys.readouterr().out
    assert "FAIL  tensor 'blocks.0.c_fc.weight' changed (sha256" in out and "certificate: 2 passed, 2 failed" in out
    tensors["lm_head.weight"][0, 0] += 1  # one copy of the tied tensor: the two names now disagree
    save_file(tensors, path, metadata={"format": "pt"})
    report = certificate.recheck(path, pair=SPEC)
    assert "tensor 'lm_head.weight' changed" in report.format()
    assert any("lm_head.weight and tok_emb.weight are declared one tensor (tied_keys) but differ" in f
               for f in report.failures), report.format()


def test_wrong_references_and_pairs_refused(exported, tmp_path, capsys):
    flax_model, path = exported["flax_model"], tmp_path / "gpt.safetensors"
    with pytest.raises(StateDictError, match=r"tok_emb\.weight: .*\(32, 16\).*\(32, 8\)"):
        export.save_safetensors(flax_model, path, reference=TorchTiedGPT(d=8), rename=RENAME, inputs=(IDS,))
    other = TorchTiedGPT()
    other.ln_f.eps = 1e-2  # the same names and shapes, another computation: the check fails
    with pytest.raises(CertificateError, match=r"the export check failed: forward .* reloaded into a fresh copy of "
                                               r"TorchTiedGPT; nothing was written"):
        export.save_torch(flax_model, tmp_path / "gpt.pt", reference=other, rename=RENAME, inputs=(IDS,))
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"gives a FlaxTiedGPT; .* made with a FinalNormGPT"):
        certificate.recheck(exported["torch"], pair=TIED_SPEC)
    capsys.readouterr()  # other inputs: refused, not compared with figures measured on the recorded ones
    assert main(["verify", "--checkpoint", str(exported["torch"]), "--pair",
                 "parity_tests.verification.certificate.test_certificate_user:other_ids_pair"]) == 2
    err = capsys.readouterr().err
    assert "gives other inputs than" in err and "args[0]: int64 [2, 8] sha256" in err and len(err.splitlines()) == 1


def other_ids_pair():
    torch_model, flax_model, (ids,) = renamed_pair()
    return torch_model, flax_model, (ids[:, ::-1].copy(),)


def test_no_reference_and_no_inputs_refused_with_the_hint(exported, tmp_path, capsys):
    flax_model, path = exported["flax_model"], tmp_path / "gpt.safetensors"
    with pytest.raises(TypeError, match=r"FinalNormGPT is not a flax_transformer or torch_reference model; to "
                                        r"export your own model, give the torch model it twins: reference=.*"
                                        r"'MODULE:FACTORY'.*--pair MODULE:FACTORY"):
        export.save_safetensors(flax_model, path)
    with pytest.raises(ValueError, match=r"FinalNormGPT has no input_spec\(\) .*: pass inputs="):
        export.save_safetensors(flax_model, path, reference=TorchTiedGPT())
    assert not list(tmp_path.iterdir())
    with pytest.raises(CertificateError, match=f"re-check it with .* pair='{SPEC}'"):
        certificate.recheck(exported["safetensors"])
    assert main(["verify", "--checkpoint", str(exported["safetensors"])]) == 2
    err = capsys.readouterr().err
    assert f"--pair {SPEC}" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("field, change, message", [
    ("model.rename[0]", lambda r: r["model"].update(rename=[["(", "x"]]), "not a valid regex"),
    ("model.flax_class", lambda r: r["model"].pop("flax_class"), "a string"),
    ("inputs", lambda r: r.pop("inputs"), "a JSON object"),
    ("inputs.args[0].sha256", lambda r: r["inputs"]["args"][0].update(sha256="00"), "a sha256"),
    ("inputs.args", lambda r: r["inputs"].update(args=[None] * 17), "at most 16 inputs"),
    ("format", lambda r: r.update(format="hf"), "for a user's model"),
])
def test_user_fields_checked_by_the_schema(exported, field, change, message):
    record = _record(exported["torch"])
    validate(json.loads(json.dumps(record)), "c.json")
    change(record)
    with pytest.raises(CertificateError, match=rf"c\.json: field {re.escape(field)}: .*{message}"):
        validate(record, "c.json")
