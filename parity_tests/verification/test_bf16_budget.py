"""bf16 budgets (issue 26 item 5): a correct bf16 port passes ``bisect`` and ``compare``, a bug
planted in a bf16 model is still named, and the same bf16 model judged by float32's rule fails.

A bf16 model is judged against float64 by bf16's rule (``verification/precision.py``): torch runs
as a ``torch.bfloat16`` copy of the model, and JAX's error may be 4 times torch's there, or one
bf16 step of the output's scale. Models are the tiny llama-family ones of ``test_llama_bisect``
(one layer, width 32, 4 query heads on 2 key/value heads), eager, so that the small programs each
op compiles are shared with that file's tests.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from flax_transformer.cli.commands import main
from flax_transformer.interop import porting
from flax_transformer.verification import bisect, bisect_report, compare, measure, precision
from parity_tests.verification import test_llama_bisect as planted
from parity_tests.verification.planting import check_named

ATTN = planted.ATTN


def _bf16_pair(**switches):
    """(config, torch model in fp32, its Flax port computing in bf16 with fp32 parameters)."""
    config, torch_model, _ = planted._pair(**switches)
    return config, torch_model, porting.torch_to_flax(torch_model, dtype=jnp.bfloat16)


# ------------------------------------------------------------------ the rule


def test_the_rule_and_how_a_model_gives_its_precision():
    assert precision.FP32.budget(1e-6, 2.0) == max(10 * 1e-6, 16 * 2.0 ** -23 * 2.0)
    assert precision.BF16.budget(1e-4, 2.0) == 2.0 * 2.0 ** -7  # the floor: one bf16 step of the scale
    assert precision.BF16.budget(1e-2, 2.0) == 4e-2
    _, _, fp32 = planted._pair()
    _, _, bf16 = _bf16_pair()
    assert precision.of_model(fp32) is precision.FP32 and precision.of_model(bf16) is precision.BF16
    assert precision.resolve(None, bf16) is precision.BF16 and precision.resolve("float32", bf16) is precision.FP32
    assert precision.resolve("bf16", fp32) is precision.BF16
    with pytest.raises(ValueError, match="precision='fp16'"):
        precision.resolve("fp16", fp32)
    class Wrap(nnx.Module):  # the top module has no dtype: its submodule's decides
        def __init__(self, dtype):
            self.inner = nnx.Linear(2, 2, dtype=dtype, rngs=nnx.Rngs(0))

    assert precision.of_model(Wrap(jnp.bfloat16)) is precision.BF16
    assert precision.of_model(Wrap(jnp.float32)) is precision.FP32
    with pytest.raises(ValueError, match="computes in float16"):
        precision.of_model(Wrap(jnp.float16))
    assert precision.BF16.rule() == {"precision": "bfloat16", "slack": 4.0, "floor_ulps": 1.0, "eps": 2.0 ** -7}
    assert precision.FP32.rule()["eps32"] == 2.0 ** -23  # the key fp32 reports always had


# ------------------------------------------------------------------ bisect


@pytest.mark.slow(reason="test_compare_judges_a_bf16_model_by_its_budget (the same bf16 rule, through compare)")
def test_a_correct_bf16_port_passes_bisect_and_fails_float32s_rule():
    """Gemma's switches (1 + w norms, scaled tied embedding, tanh GELU) and GQA: forward and every
    gradient within bf16's budget; the same model by float32's rule diverges (bf16 costs that)."""
    _, torch_model, flax_model = _bf16_pair(**planted.GEMMA)
    report = bisect.bisect(torch_model, flax_model, (planted.IDS,), grads=True, use_jit=False)
    assert report.passed and report.precision == "bfloat16", str(report)
    assert all(r.precision == "bfloat16" for r in report.rows if r.torch_err is not None)
    ratios = [r.jax_err / r.budget for r in report.rows if r.budget] + [g.jax_err / g.budget for g in report.grad_rows]
    assert max(ratios) < 0.7, max(ratios)  # measured 0.31 (docs/verification.md, "bf16 budgets")
    root = report.rows[-1]
    assert root.path == "" and root.jax_err > 1e-3  # bf16 rounding, far beyond float32's budget ...
    assert root.torch_err > 1e-3  # ... and torch's in bf16 too: that is what sets the budget
    data = report.to_dict()
    assert data["budget_rule"]["precision"] == "bfloat16" and "torch ran in bfloat16 too" in report.summary()
    assert "torch bf16 err" in str(report)
    as_fp32 = bisect.bisect(torch_model, flax_model, (planted.IDS,), use_jit=False, precision="float32")
    assert not as_fp32.passed and as_fp32.rows[-1].status in bisect_report.DIVERGED


@pytest.mark.parametrize("bug", ["q-norm-after-rope", "window+1"])
@pytest.mark.slow(reason="test_compare_judges_a_bf16_model_by_its_budget (bf16's rule), test_llama_bisect (the same "
                  "planted llama bugs, named in float32)")
def test_a_bug_in_a_bf16_model_is_named(bug):
    """Qwen3's norms after RoPE is the bug nearest bf16's budget (2.2 times it at the attention);
    the sliding window one key too wide is 27 times it."""
    case = planted.BUGS[bug]
    config, torch_model, flax_model = _bf16_pair(**case.switches)
    report = bisect.bisect(torch_model, case.plant(config, flax_model), (planted.IDS,), grads=True, use_jit=False)
    check_named(report, case.named)
    assert report.precision == "bfloat16"


# ------------------------------------------------------------------ compare


def test_a_nonfinite_value_in_torchs_bf16_run_is_not_compared_never_an_infinite_budget():
    out = measure.check(np.array([1.0, 2.0, 3.0], np.float32), np.array([1.0, 2.0, 50.0], np.float32),
                            np.array([1.0, 2.0, 3.0]), measured=True, low=np.array([1.0, 2.0, np.inf], np.float32),
                            precision=precision.BF16)
    assert "torch in bfloat16" in out["skipped"] and np.isfinite(out["budget"]), out


def test_compare_judges_a_bf16_model_by_its_budget(monkeypatch):
    _, torch_model, flax_model = _bf16_pair(**planted.QWEN3)
    seen = []
    real = compare.grad_budget
    monkeypatch.setattr(compare, "grad_budget", lambda own, rule: seen.append(rule) or real(own, rule))
    report = compare.compare(torch_model, flax_model, (planted.IDS,), grads=True)
    assert seen == [precision.BF16]  # the gradients' one budget is bf16's too
    assert report.passed and report.precision == "bfloat16" and report.tol == float("inf"), str(report)
    assert report.max_abs_err > 1e-3  # far beyond float32's tolerance: the budget is what judges
    assert report.to_dict()["budget_rule"]["precision"] == "bfloat16"
    assert "no abs tolerance" in report.summary()
    assert not compare.compare(torch_model, flax_model, (planted.IDS,), precision="float32").passed
    with pytest.raises(ValueError, match="fp64=False leaves nothing"):
        compare.compare(torch_model, flax_model, (planted.IDS,), fp64=False)
    lm = compare.compare(torch_model, flax_model, (planted.IDS,), lm=True)
    assert lm.passed and lm.lm.gates is measure.LM_BF16  # a bf16 model's LM gates by default
    assert lm.precision == "bfloat16" and lm.to_dict()["budget_rule"]["precision"] == "bfloat16"  # without grads too
    assert "no abs tolerance" in lm.summary()
    case = planted.BUGS["q-norm-after-rope"]
    config, _, broken = _bf16_pair(**case.switches)
    bad = compare.compare(torch_model, case.plant(config, broken), (planted.IDS,))
    assert not bad.passed and "its float64 budget" in bad.summary().splitlines()[-1], bad.summary()


# ------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama") / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_verify_bisect_dtype_bf16(llama_folder, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["verify", "--checkpoint", str(llama_folder), "--bisect", "--dtype", "bfloat16", "--json",
                 str(out)]) == 0
    printed = capsys.readouterr().out
    assert "forward: every module within budget" in printed and "precision: bfloat16" in printed
    data = json.loads(out.read_text())
    assert data["passed"] and data["budget_rule"]["precision"] == "bfloat16"
    assert np.isfinite(data["modules"][-1]["jax_err"]) and data["modules"][-1]["jax_err"] > 1e-4  # bf16 ran
    for wrong in (["--dtype", "bf16", "--grads"], ["--dtype", "bf16", "--train-steps", "2"]):  # refused, one line
        assert main(["verify", "--checkpoint", str(llama_folder), *wrong]) == 2
        assert "--dtype goes with --checkpoint PATH [--bisect]" in capsys.readouterr().err
    assert main(["verify", "--dtype", "bf16"]) == 2 and "--dtype goes with" in capsys.readouterr().err


def test_verify_checkpoint_dtype_bf16_judges_every_row_by_its_budget(llama_folder, capsys):
    """The torch twin's rows and transformers' (against its own model in float64 and bf16), with the
    bf16 LM gates: all pass for a correct folder, where float32's tolerance would fail them all."""
    assert main(["verify", "--checkpoint", str(llama_folder), "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("llama ")]
    assert len(rows) == 4 and all(line.endswith("pass") for line in rows), out
    assert sum("transformers vs flax" in line for line in rows) == 2
    errors = [float(line.split()[-4]) for line in rows]  # max abs err: bf16's, far beyond 1e-5
    assert min(errors) > 1e-4, rows
    assert out.count("(gate 0.15, bf16") == 4 and "bf16: each row by bf16's float64 budget" in out
