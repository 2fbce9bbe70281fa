"""A certificate says whether it was measured against an implementation that read the config on its
own (issue 36 item 6): an HF folder is also read by transformers (``certificate.independent``), the
figures recorded as ``reader``; any other export says that its check shares the config reader. A
convention that the library's writer and reader share but transformers reads otherwise (planted
here: the RoPE base written doubled and read halved) passes the torch twin and is refused.
And the schema refuses a field it does not know. Tiny llama (1 layer, width 32).
"""

import json

import pytest
from flax import nnx

from flax_transformer.models import llama_hf_config
from flax_transformer.models.llama import LlamaForCausalLM
from flax_transformer.models.llama_config import LlamaConfig
from flax_transformer.verification import certificate, export
from flax_transformer.verification.certificate import independent
from flax_transformer.verification.certificate import schema as certificate_schema

pytest.importorskip("transformers", reason="transformers is not installed")


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1, rope_theta=10000.0), rngs=nnx.Rngs(0))


def test_an_hf_export_is_measured_against_transformers(model, tmp_path):
    path = export.save_pretrained(model, tmp_path / "hf")
    reader = certificate.read(path)["reader"]
    assert reader["implementation"].startswith("transformers ") and reader["passed"]
    assert reader["max_rel_err"] <= reader["tolerance"]
    report = certificate.recheck(path)
    assert report.passed and any(line.startswith("read independently by transformers") for line in report.passes)


def test_a_convention_transformers_reads_otherwise_is_refused(model, tmp_path, monkeypatch):
    """Written doubled and read halved: the torch twin (this library's reader) agrees, transformers does not."""
    write, read = llama_hf_config.write, llama_hf_config.read

    def doubled(config):
        out = write(config)
        out["rope_theta"] *= 2
        out["rope_parameters"]["rope_theta"] *= 2
        return out

    monkeypatch.setattr(llama_hf_config, "write", doubled)
    monkeypatch.setattr(llama_hf_config, "read", lambda config, defaults: {
        **(values := read(config, defaults)), "rope_theta": values["rope_theta"] / 2})
    with pytest.raises(certificate_schema.CertificateError, match="read independently by transformers"):
        export.save_pretrained(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_other_exports_say_their_check_shares_the_config_reader(model, tmp_path):
    path = export.save_safetensors(model, tmp_path / "m.safetensors")
    assert certificate.read(path)["reader"]["not_measured"].startswith(independent.SHARED)
    assert any(note.startswith(independent.SHARED) for note in certificate.recheck(path).notes)


@pytest.mark.parametrize("where", ["", "forward", "reader", "model"])
def test_the_schema_refuses_a_field_it_does_not_know(model, tmp_path, where):
    path = export.save_safetensors(model, tmp_path / "m.safetensors") if where == "" else None
    record = json.loads((tmp_path / "m.safetensors.verification.json").read_text()) if path else _record()
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
