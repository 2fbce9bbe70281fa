"""The verification certificate: every export writes one, and a re-check catches what changed.

One tiny CTransformer for the file and orbax exports (one compile of the check, shared) and one
tiny GPT-2 for the HF folder, written sharded and in bf16 (the hardest case for the hashes).
"""

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from flax_transformer.cli.commands import main
from flax_transformer.interop import files, porting
from flax_transformer.models.configs import GPTConfig
from flax_transformer.verification import certificate, export
from flax_transformer.verification.certificate import schema as certificate_schema


@pytest.fixture(scope="module")
def former():
    import torch_reference.former as tf

    torch.manual_seed(0)
    return porting.torch_to_flax(tf.CTransformer(8, 2, 1, 8, 20, 2).eval())


def _gpt2():
    from torch_reference.gpt import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPTConfig.tiny()).eval()


EXPORTS = {  # name: (write(model, path), output name, the model to write)
    "safetensors": (export.save_safetensors, "m.safetensors", "former"),
    "torch": (export.save_torch, "m.pt", "former"),
    "orbax": (export.save_orbax, "orbax", "former"),
    "hf": (lambda m, p: export.save_pretrained(m, p, max_shard_size="30KB", dtype=jnp.bfloat16), "hf", "gpt2"),
}


@pytest.mark.parametrize("fmt", list(EXPORTS))
def test_every_export_writes_a_certificate_that_rechecks(tmp_path, former, fmt):
    write, name, which = EXPORTS[fmt]
    path = write(former if which == "former" else _gpt2(), tmp_path / name)
    cert = certificate.find(path)
    assert cert == (path / "verification.json" if path.is_dir() else tmp_path / f"{name}.verification.json")
    record = json.loads(cert.read_text())
    assert record["format"] == fmt and record["model"]["class"] in ("CTransformer", "GPT2LMHeadModel")
    tensors = certificate_schema.read_tensors(path, fmt)
    assert set(record["tensors"]) == set(tensors) and len(tensors) > 10
    dtype = "bfloat16" if fmt == "hf" else "float32"
    assert all(len(t["sha256"]) == 64 and t["dtype"] == dtype for t in record["tensors"].values())
    shards = {p.name for p in path.glob("model-*-of-*.safetensors")} if fmt == "hf" else set()
    assert len(record["files"]) == {"safetensors": 1, "torch": 1, "orbax": 1, "hf": 2 + len(shards)}[fmt]
    assert len(shards) > 1 and shards < set(record["files"]) if fmt == "hf" else True
    for key, tolerance in (("forward", 1e-5), ("backward", 1e-4)):
        assert record[key]["passed"] and record[key]["tolerance"] == tolerance and record[key]["finite"]
    assert 0 <= record["forward"]["max_abs_err"] <= 1e-5 and 0 <= record["backward"]["max_rel_err"] <= 1e-5
    forward = record["forward"]
    assert forward["relative_to"] == "max(1, max|output|)" and forward["scale"] >= 1
    assert forward["max_rel_err"] == forward["max_abs_err"] / forward["scale"]
    assert record["inputs"]["seed"] == 0 and record["inputs"]["shapes"][0] == [2, 8 if which == "former" else 9]
    assert record["dtypes"] == {"tensors": [dtype], "compute": "float32"}
    assert record["matmul_precision"] == "highest"
    assert {"jax", "flax", "torch", "transformers"} <= {k for k, v in record["versions"].items() if v}
    assert record["platform"]["jax_backend"] and record["platform"]["python"]
    report = certificate.recheck(path)
    assert report.passed and not report.notes, report.format()
    assert f"forward max relative err {record['forward']['max_rel_err']:.2e}" in report.format()


def _rewrite_tensor(path, name, change):
    """Rewrite one tensor of a safetensors file in place, header metadata kept."""
    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(path), metadata=metadata)


def test_a_certificate_catches_a_changed_tensor(tmp_path, former, capsys):
    path = export.save_safetensors(former, tmp_path / "m.safetensors")
    assert main(["verify", "--checkpoint", str(path)]) == 0
    assert "certificate: 3 passed, 0 failed" in capsys.readouterr().out
    victim = "tblocks.0.ff.0.weight"
    _rewrite_tensor(path, victim, lambda a: np.where(np.arange(a.size).reshape(a.shape) == 5, -a, a))
    report = certificate.recheck(path)
    assert not report.passed
    assert [f for f in report.failures if f.startswith("tensor")] == [
        next(f for f in report.failures if f.startswith(f"tensor {victim!r} changed (sha256 "))]  # that one, named
    assert any(f.startswith("file m.safetensors changed") for f in report.failures)
    assert main(["verify", "--checkpoint", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  tensor {victim!r} changed" in out
    # a changed shape cannot even be loaded: the certificate still names the tensor, exit 1
    _rewrite_tensor(path, victim, lambda a: a[:, :4])
    assert main(["verify", "--checkpoint", str(path)]) == 1
    assert f"tensor {victim!r} changed (float32 [32, 8] at export, float32 [32, 4] now)" in capsys.readouterr().out


def test_a_larger_error_and_a_changed_version_are_reported_with_both_values(tmp_path, former, monkeypatch):
    path = export.save_torch(former, tmp_path / "m.pt")
    cert = certificate.path_for(path)
    record = json.loads(cert.read_text())
    measured = record["backward"]["max_rel_err"]
    assert 0 < measured < 1e-7
    record["backward"]["max_rel_err"] = measured / 100  # the certificate claims a smaller error than re-measured
    cert.write_text(json.dumps(record))
    report = certificate.recheck(path)  # but the growth stays within the margin's 1e-7: rounding, a pass
    assert report.passed and not report.notes, report.format()
    monkeypatch.setattr(certificate, "RECHECK_SLACK", 0.0)  # this tiny model's errors are below the slack
    report = certificate.recheck(path)
    assert not report.passed and len(report.failures) == 1, report.format()
    assert f"{measured:.2e} now, {measured / 100:.2e} at export" in report.failures[0]
    record["backward"]["max_rel_err"] = measured / 1.5  # larger, but within the re-check margin (2x): a pass
    cert.write_text(json.dumps(record))
    report = certificate.recheck(path)
    assert report.passed and not report.notes, report.format()
    record["backward"]["max_rel_err"] = measured / 100
    record["versions"]["jax"] = "0.0.1"  # after an upgrade a larger error within the tolerance is a note
    cert.write_text(json.dumps(record))
    report = certificate.recheck(path)
    assert report.passed, report.format()
    assert f"jax 0.0.1 at export, {certificate_schema.versions()['jax']} now" in report.notes
    assert any("larger than recorded" in n and f"{measured:.2e} now" in n for n in report.notes)
    record["backward"]["tolerance"] = measured / 2  # above the tolerance: a failure whatever changed
    cert.write_text(json.dumps(record))
    assert not certificate.recheck(path).passed
    assert main(["verify", "--checkpoint", str(path)]) == 1
    cert.write_text("{")  # not a certificate: one line, exit 2
    assert main(["verify", "--checkpoint", str(path)]) == 2


def test_a_certificate_for_other_weights_is_caught(tmp_path, former):
    """What a kill -9 between the certificate's and the weights' renames would leave: the old
    weights under the new certificate."""
    a = export.save_safetensors(former, tmp_path / "a.safetensors")
    other = porting.torch_to_flax(porting.flax_to_torch(former))
    porting.load_state_dict(other, {k: v * 2 for k, v in porting.state_dict(former).items()})
    b = export.save_safetensors(other, tmp_path / "b.safetensors")
    certificate.path_for(a).write_bytes(certificate.path_for(b).read_bytes())
    report = certificate.recheck(a)
    assert report.failures[0].startswith("file a.safetensors (certified as b.safetensors) changed")
    assert report.failures[1].startswith("tensors changed (15): ")  # every tensor: one summary line


def test_a_failed_weights_swap_puts_the_old_certificate_back(tmp_path, former, monkeypatch):
    path = export.save_safetensors(former, tmp_path / "m.safetensors")
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    real = os.replace

    def fail_for_the_weights(src, dst):
        if os.fspath(dst) == os.fspath(path):
            raise OSError(28, "No space left on device")
        return real(src, dst)
    monkeypatch.setattr(os, "replace", fail_for_the_weights)
    with pytest.raises(OSError, match="No space"):
        export.save_safetensors(former, path, overwrite=True)
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before  # both byte-identical, no temp left
    assert certificate.recheck(path).passed


def test_an_export_that_fails_its_check_writes_nothing(tmp_path, former, monkeypatch):
    """A writer that corrupts a tensor: the check compares the model with the file and refuses."""
    real = files.save_safetensors_file

    def corrupting(tensors, path, metadata=None):
        real({k: v * 1.001 if k == "toprobs.weight" else v for k, v in tensors.items()}, path, metadata)
    monkeypatch.setattr(files, "save_safetensors_file", corrupting)
    with pytest.raises(certificate_schema.CertificateError, match=r"forward \S+ \(tolerance 1e-05\).*nothing was written"):
        export.save_safetensors(former, tmp_path / "m.safetensors")
    assert os.listdir(tmp_path) == []
    export.save_safetensors(former, tmp_path / "m.safetensors", certify=False)  # on purpose, unchecked
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_certify_false_writes_none_and_removes_a_stale_one(tmp_path, former):
    path = export.save_torch(former, tmp_path / "m.pt")
    assert certificate.find(path)
    export.save_torch(former, path, overwrite=True, certify=False)
    assert os.listdir(tmp_path) == ["m.pt"]
    export.save_orbax(former, tmp_path / "o", certify=False)
    assert "verification.json" not in os.listdir(tmp_path / "o")


def test_without_torch_the_certificate_records_hashes_and_says_why_errors_are_missing(tmp_path, former, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    path = export.save_safetensors(former, tmp_path / "m.safetensors")
    record = json.loads(certificate.path_for(path).read_text())
    assert record["forward"] == record["backward"] == {"not_measured": "not measured: torch not installed"}
    assert record["versions"]["torch"] is None and record["versions"]["jax"] and len(record["tensors"]) > 10
    report = certificate.recheck(path)
    assert report.passed and any("torch not installed" in n for n in report.notes)
    monkeypatch.undo()  # with torch back, the re-check measures what the export could not
    report = certificate.recheck(path)
    assert report.passed and any("not measured: torch not installed at export" in n for n in report.notes)


def test_cli_port_certifies_and_verify_reads_a_bare_torch_file_by_its_certificate(tmp_path, former, capsys):
    src = export.save_safetensors(former, tmp_path / "m.safetensors", certify=False)
    assert main(["port", str(src), str(tmp_path / "m.pt")]) == 0
    assert f"certificate {tmp_path / 'm.pt.verification.json'}" in capsys.readouterr().out
    assert main(["verify", "--checkpoint", str(tmp_path / "m.pt")]) == 0  # a bare .pt: its certificate says what
    out = capsys.readouterr().out
    assert "torch twin vs flax" in out and "certificate: 3 passed, 0 failed" in out
    assert main(["verify", "--checkpoint", str(src)]) == 0  # no certificate: the table as before
    out = capsys.readouterr().out
    assert "torch twin vs flax" in out and "certificate:" not in out  # no certificate's rows, and a line saying so:
    assert out.rstrip().splitlines()[-1].startswith("no certificate found and no --source: this checks that the "
                                                    "checkpoint loads")


def test_the_exported_model_keeps_its_mode(tmp_path, former):
    """The check runs an eval-mode view: a model exported mid-training stays in training mode."""
    former.train()
    try:
        export.save_safetensors(former, tmp_path / "m.safetensors")
        assert former.do.deterministic is False
    finally:
        former.eval()
    assert certificate.recheck(tmp_path / "m.safetensors").passed


def _loud_gpt2():
    """A tiny GPT-2 whose logits reach ~100: its final LayerNorm scaled up."""
    from torch_reference.gpt import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPTConfig.tiny()).eval()
    with torch.no_grad():
        ids = torch.from_numpy(np.arange(18).reshape(2, 9) % model.voc_size)
        factor = 100.0 / float(model(ids).abs().max())
        model.transformer.ln_f.weight.mul_(factor)
        model.transformer.ln_f.bias.mul_(factor)
    return porting.torch_to_flax(model)


def test_the_forward_error_is_relative_to_the_outputs_scale(tmp_path, monkeypatch):
    """Large outputs carry larger fp32 rounding: a correct model with logits ~100 exports and
    re-checks; an error of relative size 1e-4 is still refused."""
    model = _loud_gpt2()
    path = export.save_safetensors(model, tmp_path / "m.safetensors")
    cert = certificate.path_for(path)
    record = json.loads(cert.read_text())
    forward = record["forward"]
    assert 50 < forward["scale"] < 200 and forward["relative_to"] == "max(1, max|output|)", forward
    assert forward["passed"] and forward["max_rel_err"] == forward["max_abs_err"] / forward["scale"] <= 1e-5
    assert certificate.recheck(path).passed
    # a certificate written before the forward error was relative (max_abs_err alone) still re-checks
    record["forward"] = {k: forward[k] for k in ("max_abs_err", "finite", "tolerance", "passed")}
    cert.write_text(json.dumps(record))
    report = certificate.recheck(path)
    assert report.passed and any(p.startswith("forward max abs err") for p in report.passes), report.format()
    # a planted error of relative size 1e-4 on logits ~100 fails, and nothing is written
    real = files.save_safetensors_file

    def corrupting(tensors, path, metadata=None):
        real({k: v * (1 + 1e-4) if k == "transformer.ln_f.weight" else v for k, v in tensors.items()},
             path, metadata)
    monkeypatch.setattr(files, "save_safetensors_file", corrupting)
    with pytest.raises(certificate_schema.CertificateError, match=r"forward \S+ \(tolerance 1e-05\)"):
        export.save_safetensors(model, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


def test_a_file_added_to_a_folder_after_export_fails_the_recheck(tmp_path):
    path = export.save_pretrained(_gpt2(), tmp_path / "hf")
    assert certificate.recheck(path).passed
    (path / "stray.bin").write_bytes(b"not in the certificate")
    report = certificate.recheck(path)
    assert not report.passed
    assert report.failures == ["file stray.bin is not in the certificate (added after the export)"], report.format()
