"""No pass without a comparison, in every way a verdict can be read (issue 36 item 1).

A transformers model as it comes (``use_cache=True``: logits beside a ``DynamicCache``) is compared
and bisected on its logits, the cache set aside by type and named with ``use_cache``; a wrong port
of it fails. A report that compared nothing, or whose outputs differ outright, reads as a failure
whichever way it is read: ``passed``, ``verdict()``, ``to_dict()``/JSON, the summary's last line, the
figures (NaN, not finite), and neither tuple unpacking nor a truth value is a reading (TypeError).
"""

import json
import re

import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import hf
from flax_transformer.verification import bisect, compare
from flax_transformer.verification.frameworks import CACHE_FIELDS

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")

IDS = np.random.default_rng(0).integers(0, 64, (2, 6))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny transformers Llama as it comes (use_cache on) and its Flax port through its folder."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.config.use_cache  # the default the test is about
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return model, hf.from_pretrained(folder)


def _readings_fail(report) -> None:
    """Every documented way of reading ``report`` says it did not pass."""
    assert not report.passed and report.verdict() == "FAIL"
    assert report.to_dict()["passed"] is False and json.loads(report.to_json())["passed"] is False
    assert report.summary().splitlines()[-1].startswith("FAIL") and str(report).splitlines()[-1].startswith("FAIL")
    assert not (report.finite and report.max_abs_err <= 1e-5)  # the docs' old reading of the figures fails too
    with pytest.raises(TypeError, match="report.passed"):
        err, finite = report
    with pytest.raises(TypeError, match="report.passed"):
        bool(report)


def test_a_transformers_model_as_it_comes_is_compared_on_its_logits(llama):
    model, flax_model = llama
    report = compare.compare(model, flax_model, (IDS,))
    assert report.passed, report
    assert [o["output"] for o in report.outputs] == ["output.logits (flax output)"]
    assert report.set_aside == ("output.cache (a DynamicCache: the model ran with use_cache=True (pass "
                                "use_cache=False to leave it out))",)
    assert "use_cache" in report.summary() and report.to_dict()["set_aside"] == list(report.set_aside)
    found = bisect.bisect(model, flax_model, (IDS,))
    assert found.passed and "use_cache" in found.summary() and found.to_dict()["outputs_set_aside"], found.summary()


def test_a_wrong_port_of_it_fails(llama):
    model, flax_model = llama
    wrong = nnx.clone(flax_model)
    q = wrong.model.layers[0].self_attn.q_proj.kernel
    q.set_value(q[...][:, ::-1])  # the query's features in another order (a forgotten RoPE permutation's kind)
    report = compare.compare(model, wrong, (IDS,))
    assert not report.passed and report.max_abs_err > 1e-5 and "use_cache" in report.summary()
    found = bisect.bisect(model, wrong, (IDS,))
    assert not found.passed and found.first_divergent.endswith("q_proj"), found.summary()
    assert found.verdict() == "FAIL" and json.loads(found.to_json())["passed"] is False
    with pytest.raises(TypeError, match="report.passed"):  # every report of the protocol: no truth value
        bool(found)


class _LegacyCache(torch.nn.Module):
    """transformers 4's reading: logits, and the cache as tuples of tensors in ``past_key_values``."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        out = self.proj(x)
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=out, past_key_values=((out, out),))


class _FlaxPlain:
    def __init__(self, torch_model, what):
        self.torch_model, self.what = torch_model, what

    def eval(self):
        return self

    def __call__(self, x):
        if self.what == "string":
            return "not an array"
        with torch.no_grad():
            return self.torch_model.proj(torch.from_numpy(np.array(x))).numpy() + (1.0 if self.what == "off" else 0.0)


def test_a_legacy_tuple_cache_is_set_aside_by_its_field():
    assert "past_key_values" in CACHE_FIELDS
    model = _LegacyCache().eval()
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    report = compare.compare(model, _FlaxPlain(model, "same"), (x,), use_jit=False)
    assert report.passed, report  # transformers 5 files the tuples under ``cache``, 4 under ``past_key_values``
    assert re.fullmatch(r"output\.(cache|past_key_values) \(transformers' \1 field: the model ran with use_cache=True "
                        r"\(pass use_cache=False to leave it out\)\)", report.set_aside[0]), report.set_aside
    _readings_fail(compare.compare(model, _FlaxPlain(model, "off"), (x,), use_jit=False))


def test_nothing_compared_reads_as_a_failure_every_way():
    model = _LegacyCache().eval()
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    report = compare.compare(model, _FlaxPlain(model, "string"), (x,), use_jit=False)
    _readings_fail(report)
    assert "differs" in report.summary() and np.isnan(report.max_abs_err)  # NaN: no comparison of it agrees


class _DictOut(torch.nn.Module):
    """A user's model returning a plain dict whose ``cache`` is an array like any other."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        out = self.proj(x)
        return {"logits": out, "cache": out * 2}


class _FlaxDict(_FlaxPlain):
    def __call__(self, x):
        with torch.no_grad():
            out = self.torch_model.proj(torch.from_numpy(np.array(x))).numpy()
        return {"logits": out, "cache": out * (2.5 if self.what == "off" else 2.0)}


def test_a_plain_dicts_cache_key_is_compared_not_set_aside():
    """Only transformers' caches are set aside: by their type, or in a transformers ModelOutput's field."""
    model = _DictOut().eval()
    x = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)
    assert compare.compare(model, _FlaxDict(model, "same"), (x,), use_jit=False).passed
    report = compare.compare(model, _FlaxDict(model, "off"), (x,), use_jit=False)
    assert not report.passed and report.set_aside == () and report.max_abs_err > 0.1, report


def test_the_first_gradient_not_compared_makes_the_gradient_figures_nan():
    """``rename`` sends the first torch parameter (``proj.weight``) nowhere: its gradient is not compared."""
    from flax_transformer.interop import porting

    model = _DictOut().eval()
    flax_model = porting.torch_to_flax(model.proj, nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    report = compare.compare(model.proj, flax_model, (x,), grads=True, use_jit=False,
                             rename=[(r"^weight$", "nowhere")])
    assert report.rows[1].skipped and not any(r.skipped for r in report.rows[2:]), report
    assert not report.passed and np.isnan(report.grad_err) and not report.grad_finite, report
