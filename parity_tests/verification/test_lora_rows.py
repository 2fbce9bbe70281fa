"""``verify``'s "lora" rows (``verification/lora_rows.py``): the library's LoRA against ``peft`` on the
torch twin, forward and every adapter gradient, for the layer and one adapted model of each family.

The rows pass within TOL (1e-5, fp32, matmul precision "highest") and compare a positive number of
gradients; and they can fail: a planted wrong scale, an A read without its transpose, a B lost on one
layer (Relax #262), adapters dropped from the Flax model, peft missing: each fails its rows.
"""

import numpy as np
import pytest

from flax_transformer.models import lora
from flax_transformer.verification import lora_rows
from parity_tests.conftest import TOL

pytest.importorskip("peft", reason="peft is not installed (the test extra installs it)")

CASES = {case.module: case for case in lora_rows.cases()}



@pytest.fixture(scope="module")
def results():
    """Every case measured once (seed 0 for each): {module: Result}."""
    return {name: lora_rows.measure(case) for name, case in CASES.items()}


@pytest.mark.slow(reason="test_a_planted_bug_fails_both_rows (the same rows measured), "
                  "test_moe_adapter_goes_both_ways_through_peft (LoRA against peft)")
@pytest.mark.parametrize("name", list(CASES))
def test_row_passes_forward_and_every_adapter_gradient(results, name):
    result = results[name]
    forward, grads = result.forward, result.grads
    assert forward.passed and forward.max_abs_err <= TOL and forward.budget is not None, forward.problems()
    assert grads.passed and grads.max_abs_err <= TOL and grads.budget is not None, grads.problems()
    assert result.compared > 0 and result.compared % 2 == 0  # lora_A and lora_B of each adapted layer
    assert grads.note == f"{result.compared} adapter gradients"


def test_every_family_and_the_layer_are_covered():
    families = {name.split()[0] for name in CASES}
    assert {"former", "encoder", "classic", "hf"} <= families
    assert {"LoRALinear", "LoRALinear(rsLoRA)", "LoRAConv1D(fan_in_fan_out)"} <= set(CASES)
    assert {"hf BertModel", "hf GPT2LMHeadModel", "hf LlamaForCausalLM"} <= set(CASES)  # encoder, gpt, llama
    assert all(case.targets for case in CASES.values())


@pytest.mark.slow(reason="test_a_planted_bug_fails_both_rows (the same rows measured)")
def test_counts_every_adapted_layer(results):
    # one adapted layer per target and per layer/head: GTransformer (1 block): toqueries, tovalues, ff.0
    assert results["former GTransformer"].compared == 2 * 3
    assert results["hf LlamaForCausalLM"].compared == 2 * 2  # q_proj, v_proj of its one layer
    assert results["LoRALinear"].compared == 2


# ------------------------------------------------------------------ the rows can fail


def _wrong_scale(model):  # alpha where alpha / r belongs
    for layer in lora.layers(model).values():
        layer.lora_scale = layer.lora_config.alpha


def _untransposed_a(model):  # torch's (r, in) A read in row-major order as (in, r), no transpose
    for layer in lora.layers(model).values():
        a = np.asarray(layer.lora_A[...])
        layer.lora_A.set_value(np.ascontiguousarray(a.T).reshape(a.shape))


def _one_b_lost(model):  # B at zero on one layer: the adapter silently adds nothing there
    layer = next(iter(lora.layers(model).values()))
    layer.lora_B.set_value(np.zeros(layer.lora_B.shape, np.float32))


@pytest.mark.parametrize("name, tamper", [
    ("LoRALinear", _wrong_scale),
    ("LoRALinear(rsLoRA)", _wrong_scale),  # alpha / sqrt(r) is 4, alpha 8
    ("LoRAConv1D(fan_in_fan_out)", _untransposed_a),
    ("LoRALinear", _untransposed_a),
    ("former GTransformer", _one_b_lost),
], ids=["scale", "rslora-scale", "conv1d-untransposed-A", "linear-untransposed-A", "former-one-B-lost"])
def test_a_planted_bug_fails_both_rows(name, tamper):
    result = lora_rows.measure(CASES[name], tamper=tamper)
    assert not result.forward.passed and result.forward.max_abs_err > 100 * TOL, result.forward
    assert not result.grads.passed and result.grads.max_abs_err > 100 * TOL, result.grads
    assert result.compared > 0  # measured, and wrong: not skipped


def test_adapters_missing_from_the_flax_model_fail_with_nothing_compared():
    result = lora_rows.measure(CASES["LoRALinear"], tamper=lambda m: lora.remove(m, merge_weights=False))
    assert not result.forward.passed and result.forward.max_abs_err > 100 * TOL
    assert result.compared == 0 and not result.grads.passed
    assert "peft adapts it, the Flax model does not" in result.grads.skipped
    assert "no adapter gradient compared" in result.grads.skipped


def test_without_peft_the_rows_are_not_run_and_fail(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    result = lora_rows.measure(CASES["LoRALinear"])
    for row in (result.forward, result.grads):
        assert not row.passed and row.skipped == "not run: peft is not installed", row
    assert result.compared == 0


def test_a_case_that_raises_fails_its_rows_with_the_message():
    def broken(seed):
        raise RuntimeError("boom")

    result = lora_rows.measure(lora_rows.Case("broken", broken, ("layer",)))
    assert not result.forward.passed and not result.grads.passed
    assert result.forward.skipped == "did not run (RuntimeError: boom)"


def test_verify_runs_the_rows_in_the_whole_table_only(monkeypatch):
    """verify.run() ends with the lora rows; with --family (families=...) it leaves them out."""
    from flax_transformer.verification import verify

    monkeypatch.setattr(verify, "specs", lambda: [])  # the module rows are other tests' business
    monkeypatch.setattr(lora_rows, "cases", lambda: [CASES["LoRALinear"]])
    rows = list(verify.run())
    assert [(r.family, r.module, r.direction) for r in rows] == [
        ("lora", "LoRALinear", "peft vs flax"), ("lora", "LoRALinear", "peft vs flax grads")]
    assert all(r.passed for r in rows)
    assert list(verify.run(families=("former",))) == []
