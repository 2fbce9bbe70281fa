"""Distribution-level checks for language models: KL(torch || JAX) per token, top-1 and top-5
agreement (``measure.lm_agreement``), in ``compare(..., lm=True)``, ``verify --checkpoint`` and the certificate.

Hand-computed cases first (exact KL, ties, masks, NaN), then a tiny ported gpt both ways, a tiny
GPT-2 from transformers (random weights from a config) and the command on its certified folder.
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from flax_transformer.cli.commands import main
from flax_transformer.interop import hf, porting
from flax_transformer.verification import certificate, compare, export, measure, verify
from flax_transformer.verification.certificate import schema as certificate_schema
from flax_transformer.verification.certificate.schema import CertificateError, validate


def _logits(rng, *shape, scale=3.0):
    return scale * rng.standard_normal(shape)


# ------------------------------------------------------------------ the figures, by hand


def test_kl_of_known_distributions_is_exact():
    """p = (0.4, 0.6), q = (0.9, 0.1): KL(p || q) = 0.4 ln(4/9) + 0.6 ln 6 = 0.7507 (KL(q || p) is
    0.5716: the direction matters); the second token is the same in both (KL 0). Logits are
    log-probabilities plus any constant."""
    p = np.log([[0.4, 0.6], [0.2, 0.8]])
    q = np.log([[0.9, 0.1], [0.2, 0.8]]) + 7.0  # a shift changes no distribution
    r = measure.lm_agreement(p, q)
    want = 0.4 * math.log(4 / 9) + 0.6 * math.log(6)
    assert r.kl_max == pytest.approx(want, rel=1e-12, abs=0)
    assert r.kl_mean == pytest.approx(want / 2, rel=1e-12, abs=0)
    assert r.tokens == 2 and r.vocab == 2
    assert r.top1 == 0.5 and r.top1_near_ties == 0  # token 0: argmax 1 vs 0, ln 1.5 apart in torch's log-probs
    assert r.top5 == 1.0  # vocab 2 < 5: the top-2 sets, all the vocabulary, are equal
    assert not r.passed and "top-1 0.5000 < 1" in "; ".join(r.problems())


def test_identical_logits_agree_fully_and_pass():
    x = _logits(np.random.default_rng(0), 2, 7, 50).astype(np.float32)
    r = measure.lm_agreement(x, x.copy())
    assert (r.kl_mean, r.kl_max, r.top1, r.top5, r.tokens) == (0.0, 0.0, 1.0, 1.0, 14)
    assert r.passed and r.finite and r.problems() == []
    assert "pass" in r.lines()[-1] and "MaxText's 0.015" in r.lines()[0]


@pytest.mark.parametrize("bug", ["temperature 1.01", "one position shifted"])
def test_a_planted_bug_raises_kl_above_the_gate_and_lowers_agreement(bug):
    x = _logits(np.random.default_rng(1), 2, 8, 64)
    y = x * 1.01 if bug == "temperature 1.01" else x.copy()
    if bug == "one position shifted":
        y[1, 3] = np.roll(x[1, 3], 1)  # one token's logits moved to the next vocabulary entries
    r = measure.lm_agreement(x, y)
    assert r.kl_max > 10 * measure.LM_FP32.kl_max and not r.passed
    if bug == "temperature 1.01":  # below MaxText's 0.015: a gate that loose would not see it
        assert r.kl_max < measure.MAXTEXT_KL_GATE and r.top1 == 1.0
    if bug == "one position shifted":
        assert r.top1 == 15 / 16 and r.top5 == 15 / 16 and r.kl_max > 1.0
    # a correct fp32 port differs by rounding alone: float32 noise of the logits' size stays far inside
    noise = x + x * np.float32(2 ** -23) * np.random.default_rng(2).standard_normal(x.shape)
    assert measure.lm_agreement(x, noise).passed


@pytest.mark.parametrize("where", ["jax", "torch", "both"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_logits_never_pass(where, bad):
    x = _logits(np.random.default_rng(3), 2, 4, 10)
    y = x.copy()
    for a in {"jax": (y,), "torch": (x,), "both": (x, y)}[where]:
        a[0, 2, 5] = bad
    r = measure.lm_agreement(x, y)
    assert not r.finite and not r.passed and math.isnan(r.kl_max) and math.isnan(r.kl_mean)
    assert r.top1 == 0.0 and "NaN/inf logits" in r.problems()


def test_masked_positions_are_left_out_and_no_real_token_is_not_a_pass():
    x = _logits(np.random.default_rng(4), 2, 5, 20)
    y = x.copy()
    y[1, 3:] = -x[1, 3:]  # garbage at the padded positions
    mask = np.ones((2, 5), np.int64)
    mask[1, 3:] = 0
    assert not measure.lm_agreement(x, y).passed
    r = measure.lm_agreement(x, y, mask)
    assert r.passed and r.tokens == 8 and r.kl_max == 0.0
    empty = measure.lm_agreement(x, y, np.zeros((2, 5)))
    assert not empty.measured and not empty.passed and empty.tokens == 0
    assert "not measured" in empty.lines()[0] and "FAIL" in empty.lines()[0]
    with pytest.raises(ValueError, match=r"mask's shape \[2, 4\]"):
        measure.lm_agreement(x, y, mask[:, :4])


def test_near_ties_are_not_disagreements():
    """Two candidates within TIE_MARGIN in torch's log-probs are the same choice; 0.1 apart they are not."""
    base = np.array([[2.0, 2.0 - 1e-4, 0.0, -1.0, -2.0, -3.0, -4.0]])
    flipped = base[:, [1, 0, 2, 3, 4, 5, 6]]  # JAX prefers the other of the two near-equal ones
    r = measure.lm_agreement(base, flipped, gates=measure.LM_FP32)
    assert r.top1 == 1.0 and r.top1_near_ties == 1
    far = base.copy()
    far[0, 1] = 1.9
    r = measure.lm_agreement(far, far[:, [1, 0, 2, 3, 4, 5, 6]])
    assert r.top1 == 0.0 and r.top1_near_ties == 0 and not r.passed
    # the 5th and 6th places nearly tied: JAX's top-5 takes the 6th; the sets are equal up to the tie
    edge = np.array([[5.0, 4.0, 3.0, 2.0, 1.0, 1.0 - 1e-4, -3.0]])
    assert measure.lm_agreement(edge, edge[:, [0, 1, 2, 3, 5, 4, 6]]).top5 == 1.0
    edge[0, 5] = 0.5
    assert measure.lm_agreement(edge, edge[:, [0, 1, 2, 3, 5, 4, 6]]).top5 == 0.0


def test_a_near_tie_is_judged_in_torchs_log_probs_not_jaxs():
    """The margins differ between the frameworks: torch's decides. Torch 0.1 apart, JAX 1e-4 the other way: a
    disagreement, though JAX sees a near tie; torch 1e-4 apart, JAX 1.0 the other way: a near tie."""
    torch_far = np.array([[2.0, 1.9, 0.0, -1.0, -2.0, -3.0, -4.0]])
    jax_close = np.array([[2.0, 2.0 + 1e-4, 0.0, -1.0, -2.0, -3.0, -4.0]])
    r = measure.lm_agreement(torch_far, jax_close)
    assert r.top1 == 0.0 and r.top1_near_ties == 0 and not r.passed
    torch_close, jax_far = jax_close[:, [1, 0, 2, 3, 4, 5, 6]], np.array([[1.0, 2.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    r = measure.lm_agreement(torch_close, jax_far)
    assert r.top1 == 1.0 and r.top1_near_ties == 1


def test_what_is_not_logits_is_refused():
    for bad, match in ((np.zeros((2, 3), np.int64), "floating-point"), (np.zeros(5), "shape \\[5\\]"),
                       (np.zeros((2, 3, 1)), "vocabulary of at least 2"), (None, "no such array")):
        with pytest.raises(ValueError, match=match):
            measure.check_logits(bad)
    with pytest.raises(ValueError, match="shapes differ"):
        measure.lm_agreement(np.zeros((2, 3)), np.zeros((2, 4)))
    assert measure.logits_path({"loss": np.zeros(()), "logits": np.zeros((1, 2))}) == "output.logits"
    assert measure.logits_path((np.zeros((1, 2)), None)) == "output[0]"


# ------------------------------------------------------------------ compare(..., lm=True)


def _gpt():
    from torch_reference.gpt import GPTTransformer

    torch.manual_seed(0)
    model = GPTTransformer(1, 16, 32, 2, 50, 16).eval()
    verify.perturb_torch(model, 0)  # peaked distributions, not near-uniform ones
    return model


IDS = np.random.default_rng(0).integers(0, 50, (2, 9))
MASK = np.array([[1] * 9, [1] * 6 + [0] * 3])


def test_compare_lm_on_a_ported_gpt_both_ways_and_a_planted_bug():
    torch_model = _gpt()
    flax_model = porting.torch_to_flax(torch_model)
    report = compare.compare(torch_model, flax_model, (IDS, MASK), lm=True, lm_mask=MASK)
    assert report.passed and report.lm.passed and report.lm.tokens == 15 and report.lm.kl_max < 1e-10
    assert report.to_dict()["lm"]["top1"] == 1.0 and "LM KL(torch || JAX) per token over 15 tokens" in str(report)
    plain = compare.compare(torch_model, flax_model, (IDS, MASK), fp64=False)  # lm=False: as before
    assert plain.lm is None and plain.to_dict()["lm"] is None and "LM " not in str(plain)
    failing = measure.lm_agreement(np.zeros((1, 3)), np.eye(1, 3))
    assert plain.passed and not dataclasses.replace(report, lm=failing).passed  # the verdict includes lm
    # flax -> torch: weights changed on the Flax side (numpy noise: no eager init to compile), ported to torch
    fresh, rng = nnx.clone(flax_model), np.random.default_rng(1)
    nnx.update(fresh, jax.tree.map(lambda p: p + 0.1 * rng.standard_normal(p.shape).astype(np.float32),
                                   nnx.state(fresh, nnx.Param)))
    back = compare.compare(porting.flax_to_torch(fresh), fresh, (IDS, MASK), lm=True, lm_mask=MASK)
    assert back.passed and back.lm.kl_max < 1e-10
    # a planted bug: the output projection 0.5 % too large in Flax, a temperature change
    head = flax_model.lm_head if hasattr(flax_model, "lm_head") else flax_model.output_linear
    head.kernel.set_value(head.kernel[...] * 1.005)
    bad = compare.compare(torch_model, flax_model, (IDS, MASK), lm=True, lm_mask=MASK, fp64=False)
    assert not bad.lm.passed and not bad.passed and bad.lm.kl_max > measure.LM_FP32.kl_max
    assert any(line.startswith("LM top-1 agreement") and "FAIL: KL mean" in line for line in bad.summary().splitlines())


def test_compare_lm_refuses_an_output_that_is_not_logits_before_the_flax_model_runs():
    class Pooled(torch.nn.Module):
        def forward(self, ids):
            return ids.float().sum(-1)  # (b,): no vocabulary axis

    class NeverRun(nnx.Module):
        def __call__(self, ids):
            raise AssertionError("the Flax model ran")

    with pytest.raises(ValueError, match=r"lm=True: the torch model's output must be logits \[..., vocab\]"):
        compare.compare(Pooled(), NeverRun(), (IDS,), lm=True)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A tiny GPT-2 of transformers, random weights from a config (noised as verify does), as a folder."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    reference = transformers.GPT2LMHeadModel(config).eval()
    verify.perturb_torch(reference, 0)
    folder = tmp_path_factory.mktemp("gpt2") / "hf"
    reference.save_pretrained(folder)
    return reference, folder


class _Logits(torch.nn.Module):
    """transformers' GPT-2 as (ids, mask) -> logits, the call the Flax model takes."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(ids, attention_mask=mask, use_cache=False).logits


def test_compare_lm_on_gpt2_from_transformers(gpt2_folder):
    reference, folder = gpt2_folder
    flax_model = hf.from_pretrained(folder)
    ids = np.random.default_rng(1).integers(0, 97, (2, 9))
    report = compare.compare(_Logits(reference), flax_model, (ids, MASK), lm=True, lm_mask=MASK)
    assert report.passed and report.lm.top1 == 1.0 and report.lm.top5 == 1.0 and report.lm.kl_max < 1e-10
    bf16 = hf.from_pretrained(folder, dtype=jnp.bfloat16)  # bf16 compute: fails fp32's gates, meets bf16's
    with torch.no_grad():
        want = _Logits(reference)(torch.from_numpy(ids), torch.from_numpy(MASK)).numpy()
    got = np.asarray(verify.flax_module_call(bf16, ids, MASK).astype(jnp.float32))  # compiled: eager bf16 is slow
    assert not measure.lm_agreement(want, got, MASK).passed
    assert measure.lm_agreement(want, got, MASK, gates=measure.LM_BF16).passed


# ------------------------------------------------------------------ verify --checkpoint and the certificate


def test_verify_checkpoint_prints_kl_and_top_k_and_the_certificate_records_them(gpt2_folder, tmp_path, capsys):
    _, folder = gpt2_folder
    path = export.save_pretrained(hf.from_pretrained(folder), tmp_path / "ours")  # certified
    record = json.loads(certificate.find(path).read_text())
    assert record["lm"]["passed"] and record["lm"]["tokens"] == 15 and record["lm"]["gates"]["name"] == "fp32"
    capsys.readouterr()
    assert main(["verify", "--checkpoint", str(path)]) == 0
    out = capsys.readouterr().out
    for what in ("torch twin vs flax, none", "torch twin vs flax, padding", "transformers vs flax, padding"):
        block = out.split(f"\n{what}:\n")[1].splitlines()
        assert block[0].startswith("  LM KL(torch || JAX) per token over ") and "(gate 1e-07, fp32" in block[0]
        assert block[1].startswith("  LM top-1 agreement 1.0000, top-5 1.0000") and block[1].endswith("pass")
    assert "8 passed, 0 failed" in out  # 4 rows, 4 distribution checks
    assert "  pass  LM KL(torch || JAX) mean " in out and "certificate: 4 passed, 0 failed" in out
    # a certificate from before the LM fields still verifies, with no LM line of its own
    cert = certificate.find(path)
    cert.write_text(json.dumps({k: v for k, v in record.items() if k != "lm"}))
    assert main(["verify", "--checkpoint", str(path)]) == 0
    assert "certificate: 4 passed" in capsys.readouterr().out


def test_the_schema_checks_the_lm_fields_and_a_failed_lm_check_refuses_the_export():
    entry = measure.lm_agreement(np.zeros((2, 3)), np.zeros((2, 3))).to_dict()
    record = {"certificate": certificate_schema.FORMAT, "format": "safetensors", "files": {"m": "0" * 64}, "tensors": {},
              "model": {"family": "gpt", "class": "GPTTransformer", "init_kwargs": {}}, "versions": {}, "platform": {},
              "forward": {"max_abs_err": 0.0, "finite": True, "tolerance": 1e-5},
              "backward": {"max_rel_err": 0.0, "finite": True, "tolerance": 1e-4}}
    assert validate(record | {"lm": entry}, "c.json")
    with pytest.raises(CertificateError, match=r"field lm.top1: a number in \[0, 1\], not 2"):
        validate(record | {"lm": entry | {"top1": 2}}, "c.json")
    with pytest.raises(CertificateError, match="field lm.passed: true or false"):
        validate(record | {"lm": entry | {"passed": "yes"}}, "c.json")
    failed = measure.lm_agreement(np.zeros((2, 3)), np.eye(2, 3) * 5).to_dict()
    with pytest.raises(CertificateError, match="the export check failed: LM KL"):
        certificate.refuse_failed(record | {"lm": failed}, "m", "reloaded in torch")


def test_one_token_over_the_max_gate_fails_though_the_mean_is_within_its_own():
    """100 tokens, one of them off (KL about 5e-7) and the rest exact: the mean (about 5e-9) is within
    LM_FP32's 1e-8, the max is not within 1e-7, and the max alone must fail the verdict."""
    p = np.tile(np.arange(10, dtype=np.float64) * 0.3, (100, 1))  # well-separated logits: no near tie
    q = p.copy()
    q[0, 0] += 7e-3  # the least likely word of token 0
    r = measure.lm_agreement(p, q)
    assert r.kl_mean <= measure.LM_FP32.kl_mean < measure.LM_FP32.kl_max < r.kl_max  # the case is what it says
    assert r.top1 == 1.0 and r.top5 == 1.0
    assert not r.passed
    assert any("KL max" in problem for problem in r.problems()), r.problems()
