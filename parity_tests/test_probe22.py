"""Issue 22's blind mutation probe: one test per mutant that survived the existing tests.

Each test names the planted bug it catches (/tmp/work/probe22.md has the table). The mutants
were realistic slips in the issue-22 code: a check dropped, ``min`` for ``max``, ``>=`` for
``>``, a branch skipped. Tiny hand-made pairs (``x * 2`` in both frameworks, two Linears) and
hand-built certificates and training checkpoints keep the whole file cheap.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.cli import bisect_cli
from flax_transformer.cli.commands import main
from flax_transformer.interop import files, porting, safetensors_io
from flax_transformer.models.former import CTransformer
from flax_transformer.training import torch_state
from flax_transformer.training.optim import OptimConfig
from flax_transformer.verification import bisect, certificate, certificate_check, export
from flax_transformer.verification import compare as compare_module
from flax_transformer.verification.compare import TOLERANCE, Row, compare

X = np.ones((2, 3), np.float32)


class TorchTimes2(torch.nn.Module):
    """``x * 2`` (and ``x * 3`` with ``two``); ``nan64``: NaN in float64 only, as a model whose float64 copy breaks."""

    def __init__(self, *, two=False, nan64=False):
        super().__init__()
        self.two, self.nan64 = two, nan64

    def forward(self, x):
        y = x * 2
        if self.nan64 and x.dtype == torch.float64:
            y = y * float("nan")
        return (y, x * 3) if self.two else y


class FlaxTimes2(nnx.Module):
    """``x * 2 + err`` (and ``x * 3`` with ``two``)."""

    def __init__(self, *, two=False, err=0.0):
        self.two, self.err = two, err

    def __call__(self, x):
        y = x * 2 + self.err
        return (y, x * 3) if self.two else y


# ------------------------------------------------------------------ compare.py


def test_a_row_with_nan_on_one_side_fails_even_when_nan_on_both_sides_is_allowed():
    # mutant C1: Row.passed looked at nonfinite_jax only
    for side in ("nonfinite_torch", "nonfinite_jax"):
        row = Row("f", "m", "c", "d", 0.0, False, nonfinite_both=1, allow_nonfinite=True, **{side: 1})
        assert not row.passed, side
    assert Row("f", "m", "c", "d", 0.0, False, nonfinite_both=1, allow_nonfinite=True).passed


def test_nan_in_the_float64_reference_alone_makes_compare_incomplete():
    # mutant C6: values NaN in the float64 copy but finite in both frameworks were dropped silently
    x = np.full((2, 3), 1e-3, np.float32)
    report = compare(TorchTimes2(nan64=True), FlaxTimes2(), (x,))
    assert not report.passed and report.incomplete, str(report)
    assert "NaN/inf in the float64 reference" in report.skipped[0], report.skipped
    assert compare(TorchTimes2(nan64=True), FlaxTimes2(), (x,), allow_skipped=True).passed


def test_the_output_row_holds_the_output_furthest_beyond_its_budget():
    # mutant C7: min for max picked the output nearest its budget, hiding the other one
    x = np.random.default_rng(0).uniform(-1e-3, 1e-3, (2, 3)).astype(np.float32)
    report = compare(TorchTimes2(two=True), FlaxTimes2(two=True, err=1e-7), (x,))  # 1e-7: far below 1e-5
    assert report.max_abs_err < TOLERANCE
    assert not report.passed, str(report)
    assert report.jax_err > report.budget  # the first output's figures, not the exact second one's


# ------------------------------------------------------------------ bisect.py


class TorchLog(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)  # NaN for x < 0


class TorchWithLog(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = TorchLog()

    def forward(self, x):
        return self.a(x) * 1.0


class FlaxLogAbs(nnx.Module):
    def __call__(self, x):
        return jnp.log(jnp.abs(x))


class FlaxWithLog(nnx.Module):
    def __init__(self):
        self.a = FlaxLogAbs()

    def __call__(self, x):
        return self.a(x) * 1.0


def test_bisect_names_the_module_that_made_a_nan_in_torch_only():
    # mutant B2: only JAX was asked whether a call produced the NaN
    report = bisect.bisect(TorchWithLog(), FlaxWithLog(), (-X,), use_jit=False)
    assert not report.passed and report.first_nonfinite == "a" == report.first_divergent, str(report)
    assert report._row("a").produced == "torch" and report._row("a").status == bisect.TORCH_NONFINITE
    assert "first produced at a" in report.summary()


@jax.custom_vjp
def _doubled_backward(x):
    return x


_doubled_backward.defvjp(lambda x: (x, None), lambda _, g: (2 * g,))


class TorchTwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.lin2(self.lin1(x))


class FlaxTwoLinearsWrongBackward(nnx.Module):
    """The right forward pass; every gradient doubled (the backward goes wrong after lin2)."""

    def __init__(self):
        self.lin1, self.lin2 = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 3, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return _doubled_backward(self.lin2(self.lin1(x)))


def test_first_divergent_grad_is_the_first_wrong_one_in_backward_order():
    # mutant B4: min for max took the first-called module's parameter (lin1), not where the backward first shows
    torch.manual_seed(0)
    torch_model, flax_model = TorchTwoLinears(), FlaxTwoLinearsWrongBackward()
    porting.load_state_dict(flax_model, {k: v.detach().numpy() for k, v in torch_model.state_dict().items()},
                            strict=True)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    report = bisect.bisect(torch_model, flax_model, (x,), grads=True, use_jit=False)
    assert report.first_divergent == bisect.GRADIENTS, str(report)  # the forward agrees
    assert all(g.status == "diverged" for g in report.grad_rows), str(report)
    assert report.first_divergent_grad.startswith("lin2."), str(report)


def test_grad_budget_takes_the_largest_torch_error_and_scale_over_the_model():
    # mutant B5: min for max on torch's gradient error made the budget too tight for correct ports
    scale, limit = bisect.grad_budget({"a.weight": (1e-6, 1.0), "b.bias": (0.0, 2.0)})
    assert scale == 2.0 and limit == pytest.approx(bisect.budget(1e-6, 2.0)) == pytest.approx(1e-5)


def test_a_module_whose_flax_twin_holds_only_some_of_its_parameters_is_skipped():
    # mutant B7: any() for all() called a Linear "covered" when Flax held its weight but no bias
    linear = torch.nn.Linear(4, 4)
    assert bisect._not_called_status(linear, "emb", (set(), {"emb.weight"})).startswith("skipped")
    assert bisect._not_called_status(linear, "emb", (set(), {"emb.weight", "emb.bias"})) == bisect.COVERED_READ


# ------------------------------------------------------------------ certificate.py and certificate_check.py

HEX = "0" * 64


def _record(**fields) -> dict:
    """A certificate that passes the schema (hashes and figures made up), with ``fields`` replaced."""
    record = {"certificate": certificate.FORMAT, "format": "safetensors",
              "model": {"family": "former", "class": "CTransformer", "init_kwargs": {}},
              "files": {"m.safetensors": HEX}, "tensors": {"w": {"sha256": HEX, "dtype": "float32", "shape": [2]}},
              "forward": {"max_rel_err": 0.0, "finite": True, "tolerance": 1e-5},
              "backward": {"max_rel_err": 0.0, "finite": True, "tolerance": 1e-4},
              "inputs": {"seed": 0, "batch": 2, "length": 9}, "versions": {}, "platform": {}}
    return record | fields


def test_the_schema_takes_its_limits_as_documented():
    certificate.validate(_record(), "c.json")
    # mutant K2: batch x length at most 4096 tokens, 4096 included
    certificate.validate(_record(inputs={"seed": 0, "batch": 64, "length": 64}), "c.json")
    for record, field in ((_record(inputs={"seed": 0, "batch": 64, "length": 65}), "inputs.length"),
                          # mutant K4: a tolerance of 0 would fail every re-check, or mean nothing
                          (_record(forward={"max_rel_err": 0.0, "finite": True, "tolerance": 0}), "forward.tolerance"),
                          # mutant K5: a single-file export with no file hash would re-check nothing of its file
                          (_record(files={}), "files")):
        with pytest.raises(certificate.CertificateError, match=f"c.json: field {field}"):
            certificate.validate(record, "c.json")


@pytest.fixture(scope="module")
def tiny_former():
    return CTransformer(8, 2, 1, 6, 5, 2, rngs=nnx.Rngs(0))


def test_an_export_beyond_its_float64_budget_fails_the_forward_check(tiny_former):
    # mutant K6: measure's forward verdict left out the float64 rule
    torch_model = porting.flax_to_torch(tiny_former).eval()
    with torch.no_grad():
        for p in torch_model.parameters():
            p.mul_(1 + 1.2e-5)  # every weight 1.2e-5 off: ~5e-6 at the output, below 1e-5, ~3x its float64 budget
    forward = certificate.measure(tiny_former, torch_model)["forward"]
    assert forward["max_rel_err"] <= TOLERANCE and forward["finite"], forward
    assert not forward["float64"]["passed"] and not forward["passed"], forward


def test_an_export_whose_float64_reference_did_not_run_fails(tiny_former, monkeypatch):
    # mutant K7: the float64 entry passed while the float64 reference had not run ("skipped")
    monkeypatch.setattr(compare_module, "_reference",
                        lambda *args, **kwargs: (None, None, "the float64 reference did not run (KeyError: x)"))
    forward = certificate.measure(tiny_former, porting.flax_to_torch(tiny_former).eval())["forward"]
    assert not forward["float64"]["passed"] and not forward["passed"], forward


def test_the_recheck_fails_on_the_float64_rule():
    # mutant K11: the re-check held the errors to the tolerance only
    was = {"max_rel_err": 1e-7, "finite": True, "tolerance": 1e-5}
    now = was | {"float64": {"jax_err": 1e-6, "torch_err": 1e-8, "budget": 1e-7, "passed": False}}
    report = certificate_check.Report(None, None)
    certificate_check._compare_errors(report, {"forward": was, "backward": was}, {"forward": now, "backward": was}, True)
    assert len(report.failures) == 1 and "float64 rule failed" in report.failures[0], report.failures
    assert report.failures[0].startswith("forward"), report.failures


def test_the_recheck_names_a_tensor_the_certificate_does_not_list(tmp_path):
    # mutant K12: only the recorded tensors were looked at, so a certificate missing one passed
    path = tmp_path / "m.safetensors"
    safetensors_io.write_safetensors({"a": np.ones(3, np.float32), "b": np.zeros(2, np.float32)}, path)
    record = {"format": "safetensors", "files": {path.name: files.sha256_file(path)},
              "tensors": certificate.tensor_hashes({"a": np.ones(3, np.float32)})}
    report = certificate_check.Report(path, tmp_path / "c.json")
    certificate_check._check_hashes(report, path, record)
    assert report.failures == ["tensor 'b' is not in the certificate"] and not report.passes, report.failures


def test_up_to_shown_failures_are_one_line_each():
    # mutant K14: exactly SHOWN items became "... and 0 more"
    shown = certificate_check.SHOWN
    report = certificate_check.Report(None, None)
    certificate_check._group(report, "tensors missing", [f"t{i}" for i in range(shown)], lambda k: f"tensor {k}")
    assert report.failures == [f"tensor t{i}" for i in range(shown)]
    certificate_check._group(report, "tensors missing", [f"t{i}" for i in range(shown + 1)], None)
    assert report.failures[-1] == f"tensors missing ({shown + 1}): {', '.join(f't{i}' for i in range(shown))} … and 1 more"


# ------------------------------------------------------------------ export.py and safetensors_io.py


def test_a_torch_pt_source_with_nan_is_named_as_the_source(tmp_path):
    # mutant E5: a .pt file was not taken as a source, so its NaN was blamed on "the model read from" it
    clean, bad = tmp_path / "clean.pt", tmp_path / "bad.pt"
    torch.save({"w": torch.ones(2)}, clean)
    torch.save({"w": torch.tensor([1.0, float("nan")])}, bad)
    assert export.check_source_finite(clean) is True
    with pytest.raises(export.NonFiniteWeights, match=rf"^{bad} holds NaN/inf in 1 tensor: w \(1 NaN"):
        export.check_source_finite(bad)


def test_a_tensor_that_exactly_fills_a_shard_stays_in_it():
    # mutant S6: >= for > opened a new shard at exactly the limit (transformers: a new one only past it)
    tensors = {name: np.zeros(4, np.float32) for name in "abc"}  # 16 bytes each
    assert [list(s) for s in safetensors_io.shard(tensors, 32)] == [["a", "b"], ["c"]]
    assert [list(s) for s in safetensors_io.shard(tensors, 31)] == [["a"], ["b"], ["c"]]


# ------------------------------------------------------------------ torch_state.py

ADAM = OptimConfig(optimizer="adam", lr=1e-3, weight_decay=0.0)


def _checkpoint(**state_changes) -> dict:
    """A one-parameter torch training checkpoint at step 2 that the checks accept, its state[0] changed."""
    state = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)} | state_changes
    group = {"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
             "maximize": False}
    return {"model": {"w": torch.ones(3)}, "step": 2, "scheduler": None,
            "optimizer": {"state": {0: state}, "param_groups": [group]}}


def test_moments_are_adams_own_two_of_one_shape():
    torch_state.check_torch_state(_checkpoint(), ADAM)
    # mutant T10: an AMSGrad entry (or any other) was let through
    with pytest.raises(torch_state.TorchStateError, match=r"state\[0\] has .*max_exp_avg_sq.*not Adam's"):
        torch_state.check_torch_state(_checkpoint(max_exp_avg_sq=torch.zeros(3)), ADAM)
    # mutant T11: moments of two shapes passed the checks that run before anything is created
    with pytest.raises(torch_state.TorchStateError, match=r"state\[0\] exp_avg has shape \(3,\) and exp_avg_sq \(4,\)"):
        torch_state.check_torch_state(_checkpoint(exp_avg_sq=torch.zeros(4)), ADAM)


def test_a_parameter_without_optimizer_state_after_some_steps_is_refused(tiny_former):
    # mutant T9: its moments were taken as zeros, whatever the step
    torch_model = porting.flax_to_torch(tiny_former)
    optimizer, scheduler = torch_state.torch_optimizer(torch_model, ADAM)
    torch_model(torch.zeros(2, 6, dtype=torch.long)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    ckpt = {"model": torch_model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": 1}
    torch_state.read_torch_state(ckpt, tiny_former, ADAM)  # whole: accepted
    name = ckpt["optimizer"]["param_groups"][0]["param_names"][0]
    del ckpt["optimizer"]["state"][0]
    with pytest.raises(torch_state.TorchStateError, match=rf"no state for {name} after 1 steps"):
        torch_state.read_torch_state(ckpt, tiny_former, ADAM)


# ------------------------------------------------------------------ the CLI (commands.py, bisect_cli.py)

FACTORIES = '''
import numpy as np, torch, jax.numpy as jnp
from flax import nnx

class T(torch.nn.Module):
    def forward(self, x): return x * float("nan")

class F(nnx.Module):
    def __call__(self, x): return x * jnp.nan

def nan_in_both(): return T(), F(), (np.ones((2, 3), np.float32),)
def raises_keyerror(): raise KeyError("no such weight")
'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "probe_pairs.py"
    path.write_text(FACTORIES)
    return path


def _one_line(capsys, code, *expected):
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in out + err, (code, out, err)
    assert all(text in err for text in expected), err


def test_a_factory_that_raises_anything_is_one_line(factories, capsys):
    # mutant L2: a factory's KeyError (not a ValueError) was a traceback
    _one_line(capsys, main(["verify", "--pair", f"{factories}:raises_keyerror"]), "KeyError", "no such weight")


def test_allow_nonfinite_is_the_flag_that_allows_nan_on_both_sides(factories, capsys):
    # mutant L4: --allow-nonfinite read --allow-skipped's value
    pair = f"{factories}:nan_in_both"
    assert main(["verify", "--pair", pair]) == 1
    assert main(["verify", "--pair", pair, "--allow-nonfinite"]) == 0
    assert main(["verify", "--pair", pair, "--allow-skipped"]) == 1
    capsys.readouterr()


def test_text_goes_with_checkpoint_and_bisect_only(factories, capsys, tmp_path):
    # mutant L5: and/or swapped let --pair --bisect --text through, to a TypeError on the missing checkpoint
    _one_line(capsys, main(["verify", "--pair", f"{factories}:nan_in_both", "--bisect", "--text", "hi"]),
              "--text goes with --checkpoint PATH --bisect")
    # mutant L14: the UTF-8 check dropped (a tokenizer's TypeError once the folder has one)
    _one_line(capsys, main(["verify", "--checkpoint", str(tmp_path), "--bisect", "--text", "a\udcffb"]),
              "--text is not valid UTF-8")


def test_a_text_longer_than_the_model_reads_is_refused(tiny_former, tmp_path):
    # mutant L6: one token too many was let through
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    longest = tiny_former.input_spec().max_length  # 6
    ids, mask = bisect_cli.text_inputs(tmp_path, tiny_former, [" ".join("a" * longest)])
    assert ids.shape == mask.shape == (1, longest)
    with pytest.raises(ValueError, match=f"--text is {longest + 1} tokens; the model reads at most {longest}"):
        bisect_cli.text_inputs(tmp_path, tiny_former, [" ".join("a" * (longest + 1))])


def test_allow_nonfinite_without_bisect_or_pair_is_refused(capsys, tmp_path):
    # mutant L8: the flag was silently ignored by verify --checkpoint (a check it does not apply to)
    _one_line(capsys, main(["verify", "--allow-nonfinite", "--checkpoint", str(tmp_path / "none")]),
              "--allow-nonfinite", "go with --bisect or --pair")


def test_port_verify_fails_on_nan_in_both_source_and_output(tiny_former, capsys, tmp_path):
    # mutant L12: port --verify held the error to the tolerance only; NaN on both sides measured 0 and passed
    state = porting.flax_to_torch(tiny_former).state_dict()
    state["tblocks.0.mhattention.tokeys.weight"][0, 0] = float("nan")
    torch.save(state, tmp_path / "src.pt")
    config = json.dumps(tiny_former.init_kwargs())
    code = main(["port", str(tmp_path / "src.pt"), str(tmp_path / "dst.safetensors"), "--family", "former",
                 "--class", "CTransformer", "--config", config, "--no-certify", "--verify"])
    out = capsys.readouterr().out
    assert code == 1 and "(NaN/inf)" in out and "-> FAIL" in out, out
