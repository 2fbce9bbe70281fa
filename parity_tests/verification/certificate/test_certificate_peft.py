"""The certificate of a PEFT adapter export (``export.save_peft``, ``verification.certificate_peft``):
written only when ``peft`` loads the folder and computes the JAX model's output and adapter (and
head) gradients, and re-checked by ``verify --checkpoint ADAPTER_DIR``."""

import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_transformer.interop import hf, peft
from flax_transformer.models import lora
from flax_transformer.verification import certificate, export
from flax_transformer.verification.certificate import peft as certificate_peft
from flax_transformer.verification.certificate.schema import CertificateError

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("peft", reason="peft is not installed (the test extra installs it)")


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(a tiny BERT folder, a classifier on it with LoRA on query/value, non-zero B and a changed head)."""
    import torch

    torch.manual_seed(0)
    base = tmp_path_factory.mktemp("bert") / "hf"
    transformers.BertModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=16)).save_pretrained(base)
    model = lora.apply(hf.classifier_from_pretrained(base, num_labels=2), rank=4, alpha=8,
                       targets=["query", "value"], rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for layer in lora.layers(model).values():
        layer.lora_B.set_value(jnp.asarray(0.2 * rng.standard_normal(layer.lora_B.shape), jnp.float32))
    model.classifier.kernel.set_value(3 * model.classifier.kernel[...])
    return base, model


def _save(model, base, folder, **kwargs):
    return export.save_peft(model, folder, base=base, task_type="SEQ_CLS", modules_to_save=["classifier"], **kwargs)


@pytest.mark.slow(reason="test_a_changed_base_fails_the_recheck (the same certified export, measured through peft "
                        "and re-checked)")
def test_certified_export_measures_through_peft_and_rechecks(adapted, tmp_path, capsys):
    base, model = adapted
    _save(model, base, tmp_path / "adapter")
    record = json.loads((tmp_path / "adapter" / certificate_peft.FILE).read_text())
    assert record["forward"]["max_abs_err"] <= 1e-5 and record["forward"]["values"] > 0
    grads = record["adapter_grads"]
    assert grads["tensors"] == grads["of"] == 2 * 4 + 2  # A and B of 4 adapters, and the head's weight and bias
    assert grads["max_rel_err"] <= 1e-5
    assert set(record["base"]["files"]) >= {"config.json", "model.safetensors"}
    assert record["base"]["path"] == str(base)
    assert certificate_peft.recheck(tmp_path / "adapter").ok
    assert certificate.recheck(tmp_path / "adapter").passed  # the one re-check: an adapter goes to its subject's
    from flax_transformer.cli.commands import main

    assert main(["verify", "--checkpoint", str(tmp_path / "adapter")]) == 0  # and the command's
    assert "PEFT LoRA adapter certificate -> pass" in capsys.readouterr().out

    from safetensors.numpy import load_file, save_file  # a tensor changed after the export is named

    tensors = load_file(tmp_path / "adapter" / peft.WEIGHTS_FILE)
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key] = 0 * tensors[key]
    save_file(tensors, tmp_path / "adapter" / peft.WEIGHTS_FILE, metadata={"format": "pt"})
    report = certificate_peft.recheck(tmp_path / "adapter")
    assert not report.ok and any(key in f for f in report.failures)
    config = tmp_path / "adapter" / peft.CONFIG_FILE  # a config changed after the export (both sides read it)
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_alpha": 16}))
    assert any("adapter_config.json differs" in f for f in certificate_peft.recheck(tmp_path / "adapter").failures)


def test_a_measurement_that_compared_fewer_gradients_than_it_should_is_not_a_pass():
    good = {"forward": {"max_abs_err": 0.0, "tolerance": 1e-5}, "adapter_grads": {"max_rel_err": 0.0,
                                                                                  "tolerance": 1e-5, "tensors": 2, "of": 2}}
    assert certificate_peft.measured_passed(good)
    for grads in ({"tensors": 1, "of": 2}, {"tensors": 0, "of": 0}, {"max_rel_err": float("nan")}):
        assert not certificate_peft.measured_passed({**good, "adapter_grads": {**good["adapter_grads"], **grads}})
    assert not certificate_peft.measured_passed({**good, "forward": {"max_abs_err": float("nan"), "tolerance": 1e-5}})


@pytest.mark.parametrize("head", [True, False])
def test_an_adapter_peft_would_not_load_as_written_is_not_written(adapted, tmp_path, monkeypatch, head):
    """Keys without ``base_model.model.`` load in PEFT with a warning and lora_B at zero (Relax #262), or
    with a saved head, make peft raise: the export's check refuses both, and nothing is left behind."""
    base, model = adapted
    if not head:  # the bare encoder, as PEFT without a task type loads it: peft only warns
        model = lora.apply(hf.from_pretrained(base), rank=4, targets=["query"], rngs=nnx.Rngs(0))
    monkeypatch.setattr(peft, "PREFIX", "")
    why = "peft raised KeyError" if head else "lora_A in peft's model is not the JAX model's"
    with pytest.raises(CertificateError, match=f"peft does not load the adapter as written: .*{why}"):
        if head:
            _save(model, base, tmp_path / "adapter")
        else:
            export.save_peft(model, tmp_path / "adapter", base=base)
    assert not (tmp_path / "adapter").exists() and list(tmp_path.iterdir()) == []


def test_a_changed_base_fails_the_recheck(adapted, tmp_path, monkeypatch):
    """Also: ``base_model_name_or_path`` given to save_peft is written as given; a base that matches the
    certificate only on config.json (no weights file to compare) is refused; a tensor of the file that the
    certificate does not record is named by the recheck; an adapter gradient of another shape than peft's
    (here one that broadcasts to it) is not a pass."""
    import shutil

    base, model = adapted
    _save(model, base, tmp_path / "adapter", base_model_name_or_path="my/hub-name")
    assert json.loads((tmp_path / "adapter" / peft.CONFIG_FILE).read_text())["base_model_name_or_path"] == "my/hub-name"
    (tmp_path / "config-only").mkdir()
    shutil.copy(base / "config.json", tmp_path / "config-only" / "config.json")
    with pytest.raises(ValueError, match="records the base's weights as .*none of which .* has"):
        peft.check_base(tmp_path / "adapter", tmp_path / "config-only")
    record = json.loads((tmp_path / "adapter" / certificate_peft.FILE).read_text())
    record["base"]["files"]["model.safetensors"] = "0" * 64
    unrecorded = sorted(record["adapter"]["tensors"])[0]  # in the file, no longer in the certificate's record
    del record["adapter"]["tensors"][unrecorded]
    (tmp_path / "adapter" / certificate_peft.FILE).write_text(json.dumps(record))
    layout = peft.from_peft_layout

    def leading_axis(layer, leaf, x):  # peft's lora_A gradients, as measure reads them, with a leading axis
        ours = layout(layer, leaf, x)
        return ours[None] if leaf == "lora_A" and sys._getframe(1).f_code.co_name == "measure" else ours

    monkeypatch.setattr(peft, "from_peft_layout", leading_axis)
    report = certificate_peft.recheck(tmp_path / "adapter")
    assert not report.ok and any("is not the certified one: model.safetensors" in f for f in report.failures)
    assert any(f"(first: {unrecorded})" in f for f in report.failures)
    grads = report.measured["adapter_grads"]
    assert grads["tensors"] == grads["of"] - 4 and not certificate_peft.measured_passed(report.measured)


def test_an_adapter_for_another_base_is_refused(adapted, tmp_path):
    """Same shapes, other weights: by its certificate's base hashes; without one, by the config of the
    folder its base_model_name_or_path names."""
    import shutil

    import torch

    base, model = adapted
    _save(model, base, tmp_path / "adapter")
    torch.manual_seed(1)  # the same architecture, other weights
    other = tmp_path / "other"
    transformers.BertModel(transformers.BertConfig.from_pretrained(base)).save_pretrained(other)
    peft.check_base(tmp_path / "adapter", base)
    with pytest.raises(ValueError, match="is an adapter for another base: its certificate's base .* has other "
                                         "model.safetensors than"):
        peft.check_base(tmp_path / "adapter", other)
    (tmp_path / "adapter" / certificate_peft.FILE).unlink()
    peft.check_base(tmp_path / "adapter", other)  # same config.json: nothing to tell them apart by
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_dropout_prob": 0.3}))
    with pytest.raises(ValueError, match="its base_model_name_or_path .* holds another config.json than"):
        peft.check_base(tmp_path / "adapter", other)
    shutil.rmtree(other)


def test_a_file_holding_a_tensor_beyond_the_adapter_is_not_certified(adapted, tmp_path):
    """A base tensor written into adapter_model.safetensors beside the adapter: peft loads the folder, but
    the certificate checks every tensor of the file, so one it did not verify is refused, not certified."""
    from safetensors.numpy import load_file, save_file

    base, _ = adapted
    model = lora.apply(hf.from_pretrained(base), rank=4, targets=["query"], rngs=nnx.Rngs(0))
    folder = peft.save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(base))
    tensors = load_file(folder / peft.WEIGHTS_FILE)
    save_file({**tensors, f"{peft.PREFIX}pooler.dense.weight": np.ones((32, 32), np.float32)},
              folder / peft.WEIGHTS_FILE, metadata={"format": "pt"})
    with pytest.raises(CertificateError, match=r"the file holds 4 LoRA tensors and 1 others, the model 4 and 0"):
        certificate_peft.measure(model, folder, base)


def test_an_unreadable_adapter_certificate_is_an_error_not_a_weaker_check(adapted, tmp_path):
    """Two bases with equal config.json: only the certificate's hashes tell them apart, so a certificate
    that cannot be read (not JSON, no base.files, a value that is no sha256) is refused naming it, not
    read as "no certificate" (nor, for a short hash, as the certificate of another base)."""
    import re

    import torch

    base, _ = adapted
    torch.manual_seed(1)
    other = tmp_path / "other"
    transformers.BertModel(transformers.BertConfig.from_pretrained(base)).save_pretrained(other)
    model = lora.apply(hf.from_pretrained(base), rank=4, targets=["query"], rngs=nnx.Rngs(0))
    folder = peft.save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(base))
    cert = folder / certificate_peft.FILE
    cert.write_text(json.dumps({"kind": certificate_peft.KIND, "base": certificate_peft.base_identity(base)}))
    peft.check_base(folder, base)
    with pytest.raises(ValueError, match="its certificate's base .* has other model.safetensors than"):
        peft.check_base(folder, other)
    for broken, why in (("{not json", "not valid JSON"), ('{"base": {"path": "x"}}', "no 'base'"),
                        ('{"base": {"files": {"model.safetensors": 7}}}', "no 'base'"), ("[]", "no 'base'"),
                        (json.dumps({"base": {"files": {"model.safetensors": "0" * 63}}}), "no 'base'")):
        cert.write_text(broken)
        with pytest.raises(ValueError, match=rf"{re.escape(str(cert))} is unreadable \({why}"):
            peft.check_base(folder, other)


def test_save_peft_names_a_merged_model_and_a_missing_base_before_any_work(adapted, tmp_path):
    base, model = adapted
    merged = lora.merge(nnx.clone(model))
    with pytest.raises(ValueError, match=r"^the model's LoRA is merged \(lora.merge\): unmerge it .* or save the "
                                         "merged model with save_pretrained$"):
        _save(merged, base, tmp_path / "adapter")
    with pytest.raises(FileNotFoundError, match=rf"^base='{tmp_path / 'nosuch'}' is not a folder: save_peft certifies"):
        _save(model, tmp_path / "nosuch", tmp_path / "adapter")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary folder left



def test_a_recheck_of_a_certificate_of_the_wrong_shape_names_the_file_and_field(adapted, tmp_path):
    """Checked before anything reads it: a one-line CertificateError, never an AttributeError half-way."""
    import re

    base, _ = adapted
    folder = peft.save_peft(lora.apply(hf.from_pretrained(base), rank=2, targets=["query"], rngs=nnx.Rngs(0)),
                            tmp_path / "adapter", base_model_name_or_path=str(base))
    for edit, field in ((lambda r: r["adapter"].update(tensors=["a list"]), "field 'adapter' must hold 'tensors'"),
                        (lambda r: r["base"].update(files={"model.safetensors": 7}),
                         "field 'base' must hold 'path' .* and 'files'"),
                        (lambda r: r.update(forward=None), "field 'forward' is missing or not an object")):
        record = {"kind": certificate_peft.KIND, "adapter": {"tensors": {}, "config_sha256": "0" * 64},
                  "base": certificate_peft.base_identity(base), "forward": {}, "adapter_grads": {}}
        edit(record)
        (folder / certificate_peft.FILE).write_text(json.dumps(record))
        with pytest.raises(CertificateError, match=rf"^{re.escape(str(folder / certificate_peft.FILE))}: {field}"):
            certificate_peft.recheck(folder)


def test_a_three_label_distilbert_head_is_certified_with_its_own_size(tmp_path):
    """The head's size comes from the adapter's saved ``classifier`` (3 labels; the base folder's config says
    none, so transformers would build 2), not from ``pre_classifier`` (32 wide), which PEFT saves beside it."""
    import torch

    torch.manual_seed(0)
    base = tmp_path / "distilbert"
    transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=64, dim=32, n_layers=1, n_heads=2, hidden_dim=48, max_position_embeddings=16)).save_pretrained(base)
    model = lora.apply(hf.classifier_from_pretrained(base, num_labels=3), rank=4, targets=["q_lin"],
                       rngs=nnx.Rngs(0))
    export.save_peft(model, tmp_path / "adapter", base=base, task_type="SEQ_CLS",
                     modules_to_save=["pre_classifier", "classifier"])
    grads = json.loads((tmp_path / "adapter" / certificate_peft.FILE).read_text())["adapter_grads"]
    assert grads["tensors"] == grads["of"] == 2 * 1 + 4  # A and B of one adapter, both heads' weight and bias



def test_load_peft_reads_a_bf16_adapter_and_names_a_nan_in_its_saved_head(adapted, tmp_path):
    """An adapter file stored in bfloat16 (as peft saves a bf16 model's) loads; a NaN in a
    ``modules_to_save`` tensor (the classifier head), not only in A/B, is named at load_peft."""
    import torch
    from safetensors.torch import load_file, save_file

    base, model = adapted
    folder = peft.save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(base), task_type="SEQ_CLS",
                            modules_to_save=["classifier"])
    tensors = load_file(folder / peft.WEIGHTS_FILE)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, folder / peft.WEIGHTS_FILE,
              metadata={"format": "pt"})
    loaded = peft.load_peft(hf.classifier_from_pretrained(base, num_labels=2), folder)
    assert len(lora.layers(loaded)) == 4
    head = next(k for k in tensors if "classifier" in k and k.endswith("weight"))
    tensors[head][0, 1] = float("nan")
    save_file(tensors, folder / peft.WEIGHTS_FILE, metadata={"format": "pt"})
    fresh = hf.classifier_from_pretrained(base, num_labels=2)
    with pytest.raises(ValueError, match=rf"NaN/inf in 1 adapter tensor: {head} \(1 NaN"):
        peft.load_peft(fresh, folder)
    assert not lora.layers(fresh)
