"""A certificate is checked field by field before the re-check uses any of it (issue 22 item 6).

Every bad field is one line naming the file and the field (``CertificateError``; ``verify --checkpoint``
exits 2), never a traceback or an allocation its contents ask for; a certificate without inputs is
re-measured on the library's defaults, never echoed as "now"; a folder whose files changed gives
short summary lines. One tiny CTransformer exported once for the module; each test copies it.
"""

import json
import re
import shutil

import pytest
import torch

from flax_transformer.cli.commands import main
from flax_transformer.interop import porting
from flax_transformer.models.configs import GPTConfig
from flax_transformer.verification import certificate, export
from flax_transformer.verification.certificate import schema as certificate_schema


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    import torch_reference.former as tf

    torch.manual_seed(0)
    model = porting.torch_to_flax(tf.CTransformer(8, 2, 1, 8, 20, 2).eval())
    return export.save_safetensors(model, tmp_path_factory.mktemp("export") / "m.safetensors")


def _copy(exported, tmp_path, change=None, *, text: bytes | None = None):
    """The export copied into tmp_path, its certificate changed by ``change(record)`` or replaced by ``text``."""
    path = tmp_path / exported.name
    shutil.copy(exported, path)
    record = json.loads(certificate.path_for(exported).read_text())
    if change is not None:
        change(record)
    certificate.path_for(path).write_bytes(text if text is not None else json.dumps(record).encode())
    return path


def _refused(path, capsys, *expected):
    """Refused by the library and the CLI alike: one line naming the certificate and ``expected``, exit 2."""
    cert = str(certificate.path_for(path))
    with pytest.raises(certificate_schema.CertificateError) as caught:
        certificate.recheck(path)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400 and cert in message, message
    for text in expected:
        assert text in message, message
    capsys.readouterr()
    assert main(["verify", "--checkpoint", str(path)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and cert in err and "Traceback" not in out + err, err
    assert all(text in err for text in expected), err
    return message


def _set(record, keys, value):
    *parents, last = keys
    for key in parents:
        record = record[key]
    record[last] = value


FIRST_TENSOR = "pos_embedding.weight"
BAD_FIELDS = {  # name: (path of keys, value, the field named in the message)
    "a null batch": (("inputs", "batch"), None, "field inputs.batch"),
    "a string tensor record": (("tensors", FIRST_TENSOR), "abc", f"field tensors['{FIRST_TENSOR}']"),
    "an empty forward": (("forward",), {}, "field forward"),
    "batch -1": (("inputs", "batch"), -1, "field inputs.batch"),
    "batch 10**7": (("inputs", "batch"), 10**7, "field inputs.batch"),
    "batch true": (("inputs", "batch"), True, "field inputs.batch"),
    "a huge length": (("inputs", "length"), 10**9, "field inputs.length"),
    "a seed past 2**32": (("inputs", "seed"), 2**32, "field inputs.seed"),
    "a bad tensor hash": (("tensors", FIRST_TENSOR, "sha256"), "xyz", f"field tensors['{FIRST_TENSOR}'].sha256"),
    "a bad file hash": (("files", "m.safetensors"), "0" * 63 + "g", "field files['m.safetensors']"),
    "an unknown dtype": (("tensors", FIRST_TENSOR, "dtype"), "float33", f"field tensors['{FIRST_TENSOR}'].dtype"),
    "a negative dimension": (("tensors", FIRST_TENSOR, "shape"), [-1, 8], f"field tensors['{FIRST_TENSOR}'].shape[0]"),
    "a string error": (("backward", "max_rel_err"), "small", "field backward.max_rel_err"),
    "a negative error": (("forward", "max_rel_err"), -1.0, "field forward.max_rel_err"),
    "no versions": (("versions",), None, "field versions"),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_a_bad_field_is_refused_in_one_line_naming_file_and_field(exported, tmp_path, capsys, case):
    keys, value, field = BAD_FIELDS[case]
    path = _copy(exported, tmp_path, lambda record: _set(record, keys, value))
    _refused(path, capsys, field)


@pytest.mark.parametrize("case", ["not JSON", "binary", "deeply nested", "a list", "20 MiB of garbage"])
def test_a_certificate_that_is_no_json_object_is_refused_in_one_line(exported, tmp_path, capsys, case):
    text, expected = {"not JSON": (b"{", "is not valid JSON"),
                      "binary": (b"\xff\xfe\x00garbage", "is not valid JSON"),
                      "deeply nested": (b"[" * 200_000 + b"]" * 200_000, "is not valid JSON"),
                      "a list": (b"[1, 2]", "field (top level)"),
                      "20 MiB of garbage": (b"x" * (20 << 20), "16 MiB")}[case]
    path = _copy(exported, tmp_path, text=text)
    message = _refused(path, capsys, expected)
    if case == "20 MiB of garbage":
        assert "not read" in message


def test_a_recorded_tolerance_can_tighten_the_recheck_never_loosen_it(exported, tmp_path):
    path = _copy(exported, tmp_path, lambda record: _set(record, ("forward", "tolerance"), 0.5))
    report = certificate.recheck(path)
    assert report.passed and any(p.startswith("forward") and "(tolerance 1e-05)" in p for p in report.passes)
    path = _copy(exported, tmp_path, lambda record: _set(record, ("forward", "tolerance"), 1e-12))
    assert not certificate.recheck(path).passed


def test_a_certificate_without_inputs_is_re_measured_never_echoed(exported, tmp_path, capsys):
    """``inputs: null`` with made-up errors: the re-check measures on the library's defaults and prints
    what it measured, not the recorded figures as if they were now."""
    fake = 4.321e-07

    def change(record):
        record["inputs"] = None
        record["forward"]["max_rel_err"] = record["backward"]["max_rel_err"] = fake
    path = _copy(exported, tmp_path, change)
    report = certificate.recheck(path)
    text = report.format()
    assert f"{fake:.2e} now" not in text, text
    assert sum(f"{fake:.2e} at export" in line for line in report.passes + report.failures) == 2, text
    assert any("no inputs recorded" in n and "re-measured on the library's defaults" in n for n in report.notes), text
    record = json.loads(certificate.path_for(exported).read_text())
    measured = record["forward"]["max_rel_err"]  # the defaults are what every export measures on
    assert any(p.startswith(f"forward max relative err {measured:.2e} now") for p in report.passes), text
    assert main(["verify", "--checkpoint", str(path)]) == 0
    assert f"{fake:.2e} now" not in capsys.readouterr().out


@pytest.fixture(scope="module")
def sharded_hf(tmp_path_factory):
    from torch_reference.gpt import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPTConfig.tiny()).eval()
    return export.save_pretrained(model, tmp_path_factory.mktemp("hf") / "hf", max_shard_size="30KB")


def test_a_stray_weights_file_in_a_certified_folder_gives_short_lines_and_fails(sharded_hf, exported, tmp_path,
                                                                                capsys):
    """A model.safetensors of another model dropped into a sharded folder: read before the index, it hides
    every certified tensor. Counts and the first names, not a line per key; the table says nothing was
    compared instead of "0 passed, 0 failed"."""
    path = tmp_path / "hf"
    shutil.copytree(sharded_hf, path)
    shutil.copy(exported, path / "model.safetensors")
    report = certificate.recheck(path)
    assert not report.passed and len(report.failures) <= 5, report.format()
    assert "file model.safetensors is not in the certificate (added after the export)" in report.failures
    assert any(f.startswith("tensors missing (28): ") and f.endswith("… and 23 more") for f in report.failures)
    assert all(len(line) < 500 for line in report.failures), report.format()
    capsys.readouterr()
    assert main(["verify", "--checkpoint", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "0 passed, 0 failed" not in out and "nothing compared" in out, out
    assert all(len(line) < 500 for line in (out + err).splitlines()) and len(out + err) < 2500, out + err


def _validate(exported, change):
    record = json.loads(certificate.path_for(exported).read_text())
    certificate_schema.validate(json.loads(json.dumps(record)), "c.json")  # the unchanged record passes
    change(record)
    with pytest.raises(certificate_schema.CertificateError) as caught:
        certificate_schema.validate(record, "c.json")
    return str(caught.value)


def test_an_unknown_top_level_field_is_refused(exported):
    assert "field 'frobnicate': not a field" in _validate(exported, lambda r: r.update(frobnicate=1))


def test_a_single_file_export_with_no_files_is_refused(exported):
    assert "field files: one weights file for a safetensors export, not 0" in _validate(
        exported, lambda r: r.update(files={}))


def test_a_shape_over_the_element_limit_is_refused_though_each_dimension_is_within_it(exported):
    def change(record):
        record["tensors"][FIRST_TENSOR]["shape"] = [2**20, 2**20, 2]
    assert f"field tensors['{FIRST_TENSOR}'].shape: at most 2**40 elements" in _validate(exported, change)


def test_a_passing_table_with_a_failing_certificate_recheck_exits_1(exported, tmp_path, capsys):
    """Probe 2's mutant #55: the exit code looked at the table only. The file is unchanged (every row
    passes), but its certificate's recorded hash was edited: the re-check fails, so the command does."""
    def change(record):
        record["files"]["m.safetensors"] = "0" * 64
    path = _copy(exported, tmp_path, change)
    assert main(["verify", "--checkpoint", str(path)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"\n(\d+) passed, 0 failed", out), out  # the table passed: only the certificate fails
