"""compare and bisect on a user's own models (issue 23, verification side): outputs of any structure,
``rename=`` wherever a name is matched, convolutions compared through their layouts, tied gradients.

The models are small and written here, as a user would write them: a nanoGPT-style GPT whose head is
tied to its token embedding and whose forward returns ``(logits, loss)``, a one-layer model returning
HF ``ModelOutput``s, dicts and dataclasses, notebook 000's classifier under the published ``former``
library's names, and convolutions in 1-d and 2-d.
"""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx
from torch import nn

import flax_transformer.models.former as ff
import torch_reference.former as tf
from flax_transformer.interop import porting, targets
from flax_transformer.verification import bisect, bisect_report, compare
from parity_tests.user_models import FlaxConvTagger, TorchConvTagger

VOCAB, D, LENGTH = 12, 8, 6
RNG = np.random.default_rng(0)
IDS = RNG.integers(0, VOCAB, (2, 5))
TARGETS = RNG.integers(0, VOCAB, (2, 5))
FORMER_NAMES = [(r"\.attention\.", ".mhattention.")]  # the former library's names -> notebook 000's

# ------------------------------------------------------------------ a GPT with a tied head, (logits, loss)


class TorchTiedGPT(nn.Module):
    """(b, t) ids [, targets] -> (logits, loss or None); ``lm_head`` is the token embedding."""

    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D)
        self.pos_emb = nn.Parameter(0.1 * torch.randn(LENGTH, D))
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # nanoGPT's tie: one tensor, two state_dict keys

    def forward(self, ids, targets=None):
        x = self.tok_emb(ids) + self.pos_emb[: ids.shape[1]]  # (b, t, d)
        x = x + self.fc(F.gelu(self.ln(x)))
        logits = self.lm_head(self.ln_f(x))  # (b, t, vocab)
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return logits, loss


class FlaxTiedGPT(nnx.Module):
    """The twin: the head through ``tok_emb.attend`` (one tensor), or with ``twice`` a head of its own."""

    def __init__(self, twice: bool = False, *, rngs: nnx.Rngs):
        self.tok_emb = nnx.Embed(VOCAB, D, rngs=rngs)
        self.pos_emb = nnx.Param(jnp.zeros((LENGTH, D)))
        self.ln = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
        self.fc = nnx.Linear(D, D, rngs=rngs)
        self.ln_f = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
        self.lm_head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs) if twice else None

    def __call__(self, ids, targets=None):
        x = self.tok_emb(ids) + self.pos_emb[...][: ids.shape[1]]  # (b, t, d)
        x = x + self.fc(jax.nn.gelu(self.ln(x), approximate=False))
        h = self.ln_f(x)
        logits = self.tok_emb.attend(h) if self.lm_head is None else self.lm_head(h)  # (b, t, vocab)
        if targets is None:
            return logits, None
        logp = jax.nn.log_softmax(logits.reshape(-1, VOCAB))  # (b t, vocab)
        return logits, -jnp.take_along_axis(logp, targets.reshape(-1, 1), axis=1).mean()


class FlaxDeclaredGPT(FlaxTiedGPT):
    """The attend twin declaring the tie: ``porting.state_dict`` writes both names, one tensor's values."""

    tied_keys = (("lm_head.weight", "tok_emb.weight"),)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    torch_model = TorchTiedGPT().eval()
    attend = porting.torch_to_flax(torch_model, nnx.eval_shape(lambda: FlaxTiedGPT(rngs=nnx.Rngs(0))))
    state = {k: v.numpy() for k, v in torch_model.state_dict().items()}  # both keys of the tied tensor
    twice = nnx.eval_shape(lambda: FlaxTiedGPT(twice=True, rngs=nnx.Rngs(0)))
    porting.load_state_dict(twice, state)
    return torch_model, attend, twice


def _grad(report, name):
    return next(r for r in report.rows[1:] if r.module == name)


def test_logits_none_and_a_tied_head_compare_and_bisect_with_gradients(gpt):
    torch_model, attend, _ = gpt
    report = compare.compare(torch_model, attend, (IDS,), grads=True)
    assert report.passed and not report.skipped, str(report)
    assert [o["output"] for o in report.outputs] == ["output[0]"]
    assert report.others == ({"output": "output[1]", "torch": "None", "flax": "None", "equal": True},)
    names = [r.module for r in report.rows[1:]]
    assert names == [k for k, _ in torch_model.named_parameters()] and "lm_head.weight" not in names
    assert _grad(report, "tok_emb.weight").note == "tied: lm_head.weight = tok_emb.weight"
    assert "(tied: lm_head.weight = tok_emb.weight)" in str(report)

    found = bisect.bisect(torch_model, attend, (IDS,), grads=True)
    assert found.passed and not found.incomplete, str(found)
    assert [g.note for g in found.grad_rows if g.name == "tok_emb.weight"] == ["tied: lm_head.weight = tok_emb.weight"]
    assert "lm_head.weight" not in {g.name for g in found.grad_rows}


def returned_loss(out):
    """The scalar for grads=True: the loss the model returns (one function for torch and JAX, one compile)."""
    return out[1]


def test_a_loss_the_model_returns_is_what_grads_differentiates(gpt):
    torch_model, attend, _ = gpt
    report = compare.compare(torch_model, attend, (IDS, TARGETS), grads=True, loss_fn=returned_loss)
    assert report.passed and [o["output"] for o in report.outputs] == ["output[0]", "output[1]"], str(report)
    # one function per framework, each used on its side (swapped, torch.mean would get JAX arrays): twice the
    # loss in Flax only is a wrong backward
    doubled = compare.compare(torch_model, attend, (IDS, TARGETS), grads=True,
                             loss_fn=(lambda out: torch.mean(out[1]), lambda out: 2 * jnp.mean(out[1])))
    assert report.rows[0].passed and not doubled.passed and doubled.grad_err > 1e-3, str(doubled)
    found = bisect.bisect(torch_model, attend, (IDS, TARGETS), grads=True, loss_fn=returned_loss)
    assert found.passed and found.grad_rows, str(found)
    with pytest.raises(ValueError, match="loss_fn must return one number"):
        compare.compare(torch_model, attend, (IDS,), grads=True, loss_fn=lambda out: out[0], fp64=False)


def test_a_flax_twin_holding_the_tied_tensor_twice_sums_its_gradients(gpt):
    torch_model, _, twice = gpt
    report = compare.compare(torch_model, twice, (IDS,), grads=True)
    assert report.passed and not report.skipped, str(report)
    note = _grad(report, "tok_emb.weight").note
    assert note.startswith("tied: lm_head.weight = tok_emb.weight; Flax holds it 2 times"), note
    assert "lm_head.weight" not in {r.module for r in report.rows[1:]}
    found = bisect.bisect(torch_model, twice, (IDS,), grads=True)
    assert found.passed and not found.incomplete, str(found)
    # a declared tie is one Flax tensor under two names: its gradient counted once, not twice
    declared = porting.torch_to_flax(torch_model, nnx.eval_shape(lambda: FlaxDeclaredGPT(rngs=nnx.Rngs(0))))
    assert {"lm_head.weight", "tok_emb.weight"} <= porting.state_dict(declared).keys()
    report = compare.compare(torch_model, declared, (IDS,), grads=True, fp64=False)
    assert report.passed and _grad(report, "tok_emb.weight").note == "tied: lm_head.weight = tok_emb.weight", str(report)


# ------------------------------------------------------------------ outputs of any structure


@dataclasses.dataclass
class Out:
    scores: object
    count: int
    tag: str


Scores = collections.namedtuple("Scores", ["logits", "extra"])


class TorchShaped(nn.Module):
    """One Linear; ``kind`` says how the output is wrapped."""

    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(4, 3), kind

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "model_output":
            from transformers.modeling_outputs import SequenceClassifierOutput

            return SequenceClassifierOutput(loss=None, logits=y, hidden_states=(x, y))
        if self.kind == "namedtuple":
            return Scores(y, None)
        return Out(y, 3, "scores") if self.kind == "dataclass" else {"logits": y, "extra": None}


class FlaxShaped(nnx.Module):
    def __init__(self, kind, tag="scores", *, rngs):
        self.lin, self.kind, self.tag = nnx.Linear(4, 3, rngs=rngs), kind, tag

    def __call__(self, x):
        y = self.lin(x)
        if self.kind == "model_output":  # a plain dict, its keys in another order, and the None loss
            return {"hidden_states": (x, y), "loss": None, "logits": y}
        if self.kind == "namedtuple":  # a plain tuple: matched by position
            return (y,)
        return Out(y, 3, self.tag) if self.kind == "dataclass" else {"logits": y}


def _shaped(kind, **kw):
    torch.manual_seed(0)
    torch_model = TorchShaped(kind).eval()
    flax_model = FlaxShaped(kind, **kw, rngs=nnx.Rngs(0))
    porting.load_state_dict(flax_model, {k: v.numpy() for k, v in torch_model.state_dict().items()})
    return torch_model, flax_model


X = RNG.standard_normal((2, 4)).astype(np.float32)


@pytest.mark.parametrize("kind", ["model_output", "dataclass", "dict", "namedtuple"])
def test_any_output_structure_is_compared_by_path(kind):
    torch_model, flax_model = _shaped(kind)
    report = compare.compare(torch_model, flax_model, (X,), grads=True)
    assert report.passed and not report.skipped, str(report)
    arrays = {"model_output": ["output.logits", "output.hidden_states[0]", "output.hidden_states[1]"],
              "dataclass": ["output.scores"], "dict": ["output.logits"],
              "namedtuple": ["output.logits (flax output[0])"]}[kind]
    assert [o["output"] for o in report.outputs] == arrays
    others = {o["output"]: (o["torch"], o["flax"]) for o in report.others}
    assert others == {"model_output": {"output.loss": ("absent", "None")}, "dict": {"output.extra": ("None", "absent")},
                      "dataclass": {"output.count": ("3", "3"), "output.tag": ("'scores'", "'scores'")},
                      "namedtuple": {"output.extra": ("None", "absent")}}[kind]
    found = bisect.bisect(torch_model, flax_model, (X,), grads=True)
    assert found.passed and not found.incomplete, str(found)


class _Extra(nnx.Module):
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, x):
        out = self.inner(x)
        return {**out, "extra": out["logits"]}


def test_output_leaves_that_differ_or_are_missing_fail_naming_them():
    torch_model, flax_model = _shaped("dataclass", tag="logits")
    for use_jit in (True, False):  # the string leaves its compiled function in the output's structure
        report = compare.compare(torch_model, flax_model, (X,), use_jit=use_jit)
        assert not report.passed and report.rows[0].max_abs_err < 1e-6 and np.isnan(report.max_abs_err), str(report)
        assert "differs: output.tag: torch 'scores', flax 'logits'" in report.rows[0].problems()
    torch_model, flax_model = _shaped("dict")
    report = compare.compare(torch_model, _Extra(flax_model), (X,), use_jit=False)  # an array where torch has None
    assert not report.passed and "output.extra: only in flax (array(2, 3) float32)" in report.rows[0].mismatched
    torch_model, flax_model = _shaped("model_output")
    flax_model.kind = "dict"  # no hidden states: two arrays on the torch side only
    report = compare.compare(torch_model, flax_model, (X,))
    assert not report.passed and "output.hidden_states[1]: only in torch" in report.rows[0].mismatched, str(report)


# ------------------------------------------------------------------ rename= wherever a name is matched


class _FormerBlock(tf.TransformerBlock):
    """The published ``former`` library's block: its attention is ``attention``, not ``mhattention``."""

    @property
    def mhattention(self):
        return self.attention


def former_pair(rename=False):
    """Notebook 000's classifier under the former library's names, and the library's Flax CTransformer."""
    torch.manual_seed(0)
    torch_model = tf.CTransformer(8, 2, 1, 6, 20, 3).eval()
    for block in torch_model.tblocks:
        block.__class__ = _FormerBlock
        block.attention = block._modules.pop("mhattention")
    flax_model = porting.torch_to_flax(torch_model, targets.build_unfilled(ff.CTransformer, torch_model.init_kwargs()),
                                       rename=FORMER_NAMES)
    return torch_model, flax_model, (IDS[:, :6] % 20,)


class FlaxRenamed(nnx.Module):
    """``FlaxShaped("dict")`` with its layer named ``proj`` where torch says ``lin``."""

    def __init__(self, torch_model):
        self.proj = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        porting.load_state_dict(self, {k.replace("lin.", "proj."): v.numpy() for k, v in torch_model.state_dict().items()})

    def __call__(self, x):
        return {"logits": self.proj(x)}


def test_without_rename_every_unmatched_name_is_listed_and_with_it_none():
    torch_model, _ = _shaped("dict")
    flax_model = FlaxRenamed(torch_model)
    bare = bisect.bisect(torch_model, flax_model, (X,), grads=True)
    assert not bare.passed and bare.first_divergent == bisect_report.INCOMPLETE
    assert bare.incomplete == ["lin", "gradient lin.weight", "gradient lin.bias", "gradient proj.bias",
                               "gradient proj.weight"], str(bare)
    assert "gradients: every compared parameter within budget (4 of 4 not compared)" in bare.summary()
    assert "a Flax parameter that no torch key reaches (rename=?)" in str(bare)
    rename = [(r"^lin\.", "proj.")]
    report = bisect.bisect(torch_model, flax_model, (X,), grads=True, rename=rename)
    assert report.passed and not report.incomplete and report.rows[0].flax_path == "proj", str(report)
    assert [g.name for g in report.grad_rows] == ["lin.weight", "lin.bias"]
    assert not compare.compare(torch_model, flax_model, (X,), grads=True).passed
    assert compare.compare(torch_model, flax_model, (X,), grads=True, rename=rename).passed


def test_rename_matches_every_module_and_gradient():
    torch_model, flax_model, args = former_pair()
    assert "tblocks.0.attention.tokeys.weight" in dict(torch_model.named_parameters())
    report = bisect.bisect(torch_model, flax_model, args, grads=True, rename=FORMER_NAMES)
    assert report.passed and not report.incomplete, str(report)
    assert len(report.grad_rows) == len(list(torch_model.parameters()))
    row = next(r for r in report.rows if r.path == "tblocks.0.attention")
    assert row.status == "ok" and row.flax_path == "tblocks.0.mhattention", str(report)
    compared = compare.compare(torch_model, flax_model, args, grads=True, rename=FORMER_NAMES)
    assert compared.passed and not compared.skipped and len(compared.rows) == 1 + len(report.grad_rows), str(compared)
    with pytest.raises(ValueError, match="not a valid regex"):
        compare.compare(torch_model, flax_model, args, rename=[("(", "x")])


def test_rename_flag_splits_at_the_first_plain_equals_sign():
    from flax_transformer.cli.bisect_cli import parse_renames

    assert parse_renames([r"\.attention\.=.mhattention.", r"^(h)\.=\1.x="]) == [
        (r"\.attention\.", ".mhattention."), (r"^(h)\.", r"\1.x=")]
    assert parse_renames([r"a(?=b)=c", r"a(?<=b)=c", r"(?P<n>a)(?P=n)=c", r"a\=b=c"]) == [
        ("a(?=b)", "c"), ("a(?<=b)", "c"), ("(?P<n>a)(?P=n)", "c"), (r"a\=b", "c")]
    assert parse_renames(None) == []


def test_verify_pair_takes_rename(capsys):
    from flax_transformer.cli.commands import main

    spec = ["verify", "--pair", "parity_tests.verification.test_any_outputs:former_pair", "--grads"]
    assert main([*spec, "--rename", r"\.attention\.=.mhattention."]) == 0, capsys.readouterr().out
    assert "gradients: 17 of 17 parameters pass" in capsys.readouterr().out
    assert main(spec) == 1
    assert "INCOMPLETE: 10 not compared" in capsys.readouterr().out
    for bad, message in ((["--rename", "no-equals-sign"], "--rename must be REGEX=REPL"),
                         (["--rename", "(=x"], "--rename: rename[0]")):
        assert main([*spec, *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert main(["verify", "--rename", "a=b"]) == 2
    assert "--rename go with --bisect or --pair" in capsys.readouterr().err


# ------------------------------------------------------------------ layouts by layer kind: convolutions


def _tagger():
    torch.manual_seed(0)
    torch_model = TorchConvTagger().eval()
    return torch_model, porting.torch_to_flax(torch_model, nnx.eval_shape(lambda: FlaxConvTagger(rngs=nnx.Rngs(0))))


def test_conv1d_is_compared_channels_first_and_a_flipped_kernel_is_named():
    torch_model, flax_model = _tagger()
    report = bisect.bisect(torch_model, flax_model, (IDS,))
    assert report.passed and not report.incomplete, str(report)
    conv = next(r for r in report.rows if r.path == "conv")
    assert conv.status == "ok" and "channels last in Flax" in conv.note, str(report)
    flax_model.conv.kernel.set_value(flax_model.conv.kernel[...][::-1])  # the window reversed: a porting bug
    broken = bisect.bisect(torch_model, flax_model, (IDS,))
    assert broken.first_divergent == "conv", str(broken)
    assert next(r for r in broken.rows if r.path == "conv").status == "introduced", str(broken)


class TorchConv2d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=(2, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x):  # (b, 2, h, w) -> (b, h', w', 2)
        return self.head(self.conv(x).permute(0, 2, 3, 1))


class FlaxConv2d(nnx.Module):
    def __init__(self, *, rngs):
        self.conv = nnx.Conv(2, 3, kernel_size=(2, 3), padding="VALID", rngs=rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):  # torch's (b, 2, h, w) in, channels moved last first
        return self.head(self.conv(jnp.transpose(x, (0, 2, 3, 1))))


def test_conv2d_is_compared_through_its_layout_and_rerun_alone():
    torch.manual_seed(0)
    torch_model = TorchConv2d().eval()
    flax_model = porting.torch_to_flax(torch_model, nnx.eval_shape(lambda: FlaxConv2d(rngs=nnx.Rngs(0))))
    x = RNG.standard_normal((2, 2, 4, 5)).astype(np.float32)  # h != w: a wrong axis order cannot pass
    report = bisect.bisect(torch_model, flax_model, (x,), grads=True)
    assert report.passed and not report.incomplete, str(report)
    kernel = flax_model.conv.kernel[...]
    flax_model.conv.kernel.set_value(kernel.at[0, 0, 0, 0].add(0.5))  # one weight off
    broken = bisect.bisect(torch_model, flax_model, (x,))
    conv = next(r for r in broken.rows if r.path == "conv")
    assert broken.first_divergent == "conv" and conv.status == "introduced", str(broken)
    assert conv.local_jax_err is not None and conv.local_jax_err > conv.budget  # its rerun alone ran
    assert re.search(r"conv .*introduced \(channels last in Flax", str(broken)), str(broken)
