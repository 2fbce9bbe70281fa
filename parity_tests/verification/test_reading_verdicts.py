"""No pass without a comparison, in every way a verdict can be read (issue 36 item 1).

A transformers model as it comes (``use_cache=True``: logits beside a ``DynamicCache``) is compared
and bisected on its logits, the cache set aside by type and named with ``use_cache``; a wrong port
of it fails. A report that compared nothing, or whose outputs differ outright, reads as a failure
whichever way it is read: ``passed``, ``verdict()``, ``to_dict()``/JSON, the summary's last line, the
figures (NaN, not finite), and neither tuple unpacking nor a truth value is a reading (TypeError).
"""

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import hf
from flax_transformer.verification import bisect, compare, frameworks
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


# ------------------------------------------------ probe 2's survivors (#2 #3 #4 #5 #6 #7 #9): outputs leaf by leaf


def test_a_cache_field_of_a_mamba_output_is_set_aside():
    """Mutant #4: only ``past_key_values`` was a cache field; mamba's output holds its cache as a tuple under
    ``cache`` (transformers 5's ``MambaOutput``; ``cache_params`` in 4, which 5's ``ModelOutput`` no longer takes)."""

    @dataclasses.dataclass
    class MambaOutput(transformers.utils.ModelOutput):
        last_hidden_state: torch.Tensor | None = None
        cache: tuple | None = None

    lines = frameworks.set_aside_lines(MambaOutput(last_hidden_state=torch.ones(2), cache=(torch.zeros(3),)))
    assert len(lines) == 1 and "cache" in lines[0] and "use_cache" in lines[0], lines


def test_a_cache_on_the_flax_side_is_listed_as_set_aside_there():
    """Mutant #2: the Flax output's caches were left out of ``set_aside``."""
    model = _DictOut().eval()

    class FlaxWithCache(_FlaxDict):
        def __call__(self, x):
            return {**super().__call__(x), "extra": transformers.DynamicCache()}

    x = np.random.default_rng(4).standard_normal((2, 4)).astype(np.float32)
    report = compare.compare(model, FlaxWithCache(model, "same"), (x,), use_jit=False)
    assert [line for line in report.set_aside if line.endswith(" (flax)") and "DynamicCache" in line], report.set_aside


@pytest.fixture(scope="module")
def exact_linear():
    """compare(grads=True) of a Linear whose every product and sum is exact in both frameworks."""
    from flax_transformer.interop import porting

    torch_model = torch.nn.Linear(2, 2)
    with torch.no_grad():  # small integers
        torch_model.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, -1.0]]))
        torch_model.bias.copy_(torch.tensor([1.0, 0.0]))
    flax_model = porting.torch_to_flax(torch_model, nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    x = np.array([[1.0, 2.0], [0.0, -1.0]], np.float32)
    return compare.compare(torch_model, flax_model, (x,), grads=True, use_jit=False)


def test_gradients_all_exactly_equal_still_name_a_worst_parameter(exact_linear):
    """Mutant #3: ``>`` for ``>=`` left ``worst_grad_key`` empty when every gradient error is exactly 0."""
    assert exact_linear.passed and exact_linear.grad_err == 0.0, exact_linear
    assert exact_linear.worst_grad_key in {r.module for r in exact_linear.rows[1:]}, exact_linear.worst_grad_key


def test_the_gradient_summary_counts_the_parameters_that_pass(exact_linear):
    """Mutant #9: the summary printed the failing count as the passing one. A third gradient row, failing."""
    rows = exact_linear.rows
    report = dataclasses.replace(exact_linear, rows=(*rows, dataclasses.replace(rows[1], module="extra", max_abs_err=1.0)))
    assert [r.passed for r in report.rows[1:]] == [True, True, False], report.rows
    assert "gradients: 2 of 3 parameters pass" in report.summary() and "failing: extra" in report.summary(), report.summary()


ARR = np.ones(2, np.float32)


def test_none_on_one_side_against_an_array_on_the_other_is_no_equal_entry():
    """Mutant #5: a None on the torch side beside an array on the Flax side was also listed as "equal"."""
    _, others, mismatched = frameworks.match_outputs({"a": ARR, "b": None}, {"a": ARR, "b": ARR})
    assert not [o for o in others if o["output"].endswith("b")], others
    assert any("b" in m and "only in flax" in m for m in mismatched), mismatched


def test_an_array_against_a_string_is_a_mismatch():
    """Mutant #6: any number-like side made the pair an array pair."""
    arrays, _, mismatched = frameworks.match_outputs({"a": ARR}, {"a": "text"})
    assert not arrays and len(mismatched) == 1 and "text" in mismatched[0], (arrays, mismatched)


@pytest.mark.parametrize("pair", [(1, 1.0), (True, 1), ("1", "1")])
def test_equal_non_array_leaves_of_another_type_differ(pair):
    """Mutant #7: ``1 == 1.0`` and ``True == 1`` read as equal outputs."""
    t, j = pair
    _, others, mismatched = frameworks.match_outputs({"n": t}, {"n": j})
    assert others[0]["equal"] is (type(t) is type(j)) and bool(mismatched) is (type(t) is not type(j)), others
