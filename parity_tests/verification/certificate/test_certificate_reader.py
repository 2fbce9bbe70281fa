"""A certificate says whether it was measured against an implementation that read the config on its
own (issue 36 item 6): an HF folder is also read by transformers (``certificate.independent``), the
figures recorded as ``reader``; any other export says that its check shares the config reader. A
convention that the library's writer and reader share but transformers reads otherwise (planted
here: the RoPE base written doubled and read halved) passes the torch twin and is refused. A tensor transformers had to initialise is no pass even where
the outputs agree, and a re-check's reader line that fails lands under the failures.
And the schema refuses a field it does not know. Tiny llama (1 layer, width 32).
"""

import json

import pytest
from flax import nnx

from flax_transformer.interop import hf
from flax_transformer.models import llama_hf_config
from flax_transformer.models.llama import LlamaForCausalLM
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification import certificate, export
from flax_transformer.verification.certificate import independent
from flax_transformer.verification.certificate import schema as certificate_schema
from flax_transformer.verification.certificate import subjects as certificate_subjects

pytest.importorskip("transformers", reason="transformers is not installed")


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1, rope_theta=10000.0), rngs=nnx.Rngs(0))


@pytest.mark.slow(reason="test_a_convention_transformers_reads_otherwise_is_refused (the same measurement, in torch)")
def test_an_hf_export_is_measured_against_transformers(model, tmp_path, monkeypatch):
    path = export.save_pretrained(model, tmp_path / "hf")
    reader = certificate.read(path)["reader"]
    assert reader["implementation"].startswith("transformers ") and reader["passed"]
    assert reader["max_rel_err"] <= reader["tolerance"]
    report = certificate.recheck(path)
    assert report.passed and report.reader.startswith("read independently by transformers")
    assert f"  reader  {report.reader}" in report.format()


def test_a_convention_transformers_reads_otherwise_is_refused(model, tmp_path, monkeypatch):
    """Written doubled and read halved: the torch twin (this library's reader) agrees, transformers does
    not, and the reader entry fails the export. Measured in torch alone (the twin against transformers)."""
    args = certificate_subjects.example_inputs(model)
    right = hf.save_pretrained(model, tmp_path / "right")
    assert independent.entry(right, "hf", hf.torch_from_pretrained(right), args)["passed"]
    write, read = llama_hf_config.write, llama_hf_config.read

    def doubled(config):
        out = write(config)
        out["rope_theta"] *= 2
        out["rope_parameters"]["rope_theta"] *= 2
        return out

    monkeypatch.setattr(llama_hf_config, "write", doubled)
    monkeypatch.setattr(llama_hf_config, "read", lambda config, defaults: {
        **(values := read(config, defaults)), "rope_theta": values["rope_theta"] / 2})
    wrong = hf.save_pretrained(model, tmp_path / "wrong")
    reader = independent.entry(wrong, "hf", hf.torch_from_pretrained(wrong), args)
    assert not reader["passed"] and reader["max_rel_err"] > reader["tolerance"]
    passed = {"passed": True}
    with pytest.raises(certificate_schema.CertificateError, match="read independently by transformers"):
        certificate.refuse_failed({"forward": passed, "backward": passed, "reader": reader}, "wrong", "reloaded")


def test_a_tensor_transformers_had_to_initialise_is_not_a_pass(model, tmp_path):
    """An HF folder without its final norm weight (all ones here, as transformers initialises it): the
    outputs agree, but the folder is not the model transformers reads, so the entry fails and says which."""
    from safetensors.numpy import load_file, save_file

    args = certificate_subjects.example_inputs(model)
    folder = hf.save_pretrained(model, tmp_path / "hf")
    twin = hf.torch_from_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    assert (weights.pop("model.norm.weight") == 1).all()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    reader = independent.entry(folder, "hf", twin, args)
    assert reader["max_rel_err"] <= reader["tolerance"] and not reader["passed"]
    assert reader["not_compared"] == "transformers found no model.norm.weight"


def _halved_reading(monkeypatch):
    """This library's config reader made to read rope_theta halved (transformers reads it as written)."""
    read = llama_hf_config.read
    monkeypatch.setattr(llama_hf_config, "read", lambda config, defaults: {
        **(values := read(config, defaults)), "rope_theta": values["rope_theta"] / 2})


def test_a_reading_transformers_no_longer_shares_fails_the_recheck_on_its_reader_line(model, tmp_path, monkeypatch):
    """The re-check's reader line, when transformers now reads the folder otherwise than this library's
    reader (which built the twin): a failure, not only shown. Measured in torch alone, as
    ``verify --checkpoint`` does it (the full CLI run: the slow test below)."""
    args = certificate_subjects.example_inputs(model)
    folder = hf.save_pretrained(model, tmp_path / "hf")
    _halved_reading(monkeypatch)
    report = certificate.RecheckReport(path=folder, certificate=certificate.path_for(folder))
    independent.recheck(report, folder, {"format": "hf"}, hf.torch_from_pretrained(folder), args)
    assert report.reader.startswith("read independently by transformers") and report.reader.endswith(" now")
    assert report.failures == [report.reader] and not report.passed


@pytest.mark.slow(reason="test_a_reading_transformers_no_longer_shares_fails_the_recheck_on_its_reader_line")
def test_verify_checkpoint_fails_a_certified_folder_transformers_now_reads_otherwise(model, tmp_path, capsys,
                                                                                     monkeypatch):
    """Certified as written; then this library's reader reads rope_theta halved: the files and the
    Flax model against its twin still pass (both read alike), the reader line is the failure."""
    from flax_transformer.cli import main

    folder = export.save_pretrained(model, tmp_path / "hf")
    _halved_reading(monkeypatch)
    assert main(["verify", "--checkpoint", str(folder)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("  FAIL  ")] == [
        next(line for line in lines if line.startswith("  FAIL  read independently by transformers"))], lines


def test_the_recheck_of_another_format_says_it_shares_the_reader_and_does_not_fail(tmp_path):
    """A safetensors export: nothing but this library reads its description, so nothing is measured: its
    reader line says so, no failure (the whole re-check of such an export: the slow test below)."""
    path = tmp_path / "m.safetensors"
    report = certificate.RecheckReport(path=path, certificate=certificate.path_for(path))
    independent.recheck(report, path, {"format": "safetensors"}, None, None)
    assert report.reader.startswith(independent.SHARED) and report.failures == [] and report.passed

@pytest.mark.slow(reason="test_a_convention_transformers_reads_otherwise_is_refused")
def test_other_exports_say_their_check_shares_the_config_reader(model, tmp_path):
    path = export.save_safetensors(model, tmp_path / "m.safetensors")
    assert certificate.read(path)["reader"]["not_measured"].startswith(independent.SHARED)
    report = certificate.recheck(path)
    assert report.passed and report.reader.startswith(independent.SHARED) and not report.notes


@pytest.mark.parametrize("where", ["", "forward", "reader", "model"])
def test_the_schema_refuses_a_field_it_does_not_know(where):
    record = _record()
    certificate_schema.validate(json.loads(json.dumps(record)), "c.json")
    (record if where == "" else record.setdefault(where, {"not_measured": "x"}))["frobnicate"] = 1
    with pytest.raises(certificate_schema.CertificateError, match=f"field {where}.?'frobnicate': not a field"):
        certificate_schema.validate(record, "c.json")


def _record() -> dict:
    hex_ = "0" * 64
    return {"certificate": certificate_schema.FORMAT, "format": "safetensors",
            "model": {"family": "former", "class": "CTransformer", "init_kwargs": {}},
            "files": {"m.safetensors": hex_}, "tensors": {"w": {"sha256": hex_, "dtype": "float32", "shape": [2]}},
            "forward": {"max_rel_err": 0.0, "finite": True, "tolerance": 1e-5},
            "backward": {"max_rel_err": 0.0, "finite": True, "tolerance": 1e-4}, "versions": {}, "platform": {}}


def test_an_output_of_another_shape_than_the_twin_s_is_not_a_pass(monkeypatch):
    """transformers' logits (1, 3, 8) against a twin's (1, 1, 8) of the same values: numpy would broadcast
    them to an error of 0; a different shape is no agreement."""
    import numpy as np
    import torch

    monkeypatch.setattr(hf, "transformers_from_pretrained", lambda path: (object(), []))
    monkeypatch.setattr(hf, "transformers_output", lambda reference, ids, mask: np.ones((1, 3, 8), np.float32))
    ids = np.zeros((1, 3), np.int32)
    twin = lambda ids, mask: torch.ones(1, ids.shape[1], 8)  # noqa: E731 - the twin's shape matches
    assert independent.entry("folder", "hf", twin, (ids, np.ones_like(ids)))["passed"]
    twin = lambda ids, mask: torch.ones(1, 1, 8)  # noqa: E731
    entry = independent.entry("folder", "hf", twin, (ids, np.ones_like(ids)))
    assert not entry["passed"] and entry["max_abs_err"] == float("inf")
