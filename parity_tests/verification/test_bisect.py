"""``bisect.bisect``: defects real ports get wrong, each planted on the Flax side after porting,
must be named at the exact module with nothing flagged upstream; correct ports flag nothing.

Small models (width 16-24, two blocks), run eagerly where the test is about what bisect finds
(no compile per model); the CLI and gradient tests take the default path, under ``nnx.jit``.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import torch_reference.encoder as te
import torch_reference.former as tf
from flax_transformer.interop import porting
from flax_transformer.models.configs import EncoderConfig
from flax_transformer.models.former import _self_attention
from flax_transformer.verification import bisect, bisect_report, measure, verify

IDS = np.random.default_rng(0).integers(0, 20, (2, 8))


def _former(cls=tf.CTransformer, **kw):
    torch_model = (cls(16, 4, 2, 8, 20, 3, **kw) if cls is tf.CTransformer else cls(16, 4, 2, 8, 20, **kw)).eval()
    verify.perturb_torch(torch_model, 0)  # fresh LayerNorms are ones and zeros: noise makes them matter
    return torch_model, porting.torch_to_flax(torch_model)


def _bert():
    cfg = EncoderConfig.tiny(vocab_size=20, hidden_size=24, num_attention_heads=4, max_position_embeddings=16)
    torch_model = te.TransformerEncoder(EncoderConfig.bert(dataclasses.asdict(cfg))).eval()  # post-LN, eps 1e-12
    verify.perturb_torch(torch_model, 0)
    return torch_model, porting.torch_to_flax(torch_model)


def _replace_call(module, call):
    """Give one module instance its own ``__call__`` (Python looks calls up on the type)."""
    cls = type(module)
    module.__class__ = type(cls)(f"Broken{cls.__name__}", (cls,), {"__call__": call})


def _assert_named(report, path):
    assert report.first_divergent == path, str(report)
    rows = [r.path for r in report.rows]
    row = report.rows[rows.index(path)]
    assert row.status == "introduced", str(report)
    # what ran before it, apart from its own submodules (inside it: they may carry its error)
    upstream = [r for r in report.rows[:rows.index(path)] if not r.path.startswith(path + ".")]
    assert all(r.status == "ok" or r.status.startswith(("skipped", "covered")) for r in upstream), str(report)


def test_transposed_square_kernel():
    torch_model, flax_model = _former()
    kernel = flax_model.tblocks[1].mhattention.tokeys.kernel
    kernel.set_value(kernel[...].T)
    _assert_named(bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False), "tblocks.1.mhattention.tokeys")


def test_two_heads_query_weights_swapped():
    torch_model, flax_model = _bert()
    heads = flax_model.layers[1].attention.heads
    q0, q1 = heads[0].q.kernel[...], heads[1].q.kernel[...]
    heads[0].q.kernel.set_value(q1)
    heads[1].q.kernel.set_value(q0)
    _assert_named(bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False), "layers.1.attention")


def test_layer_norm_eps_1e5_instead_of_1e12():
    torch_model, flax_model = _bert()
    assert flax_model.layers[1].layer_norm_1.eps == 1e-12
    flax_model.layers[1].layer_norm_1.eps = 1e-5
    _assert_named(bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False), "layers.1.layer_norm_1")


def test_tanh_gelu_instead_of_exact():
    torch_model, flax_model = _bert()
    flax_model.layers[0].feed_forward.hidden_act = "gelu_new"
    _assert_named(bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False), "layers.0.feed_forward")


def test_off_by_one_causal_mask():
    torch_model, flax_model = _former(tf.GTransformer)
    attention = flax_model.tblocks[1].mhattention

    def call(self, x, mask=None, **_):
        b, t, _ = x.shape
        sees_next = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool), k=1), (b, t, t))  # one future token too
        return _self_attention(self, x, sees_next, self.emb // self.heads, self.emb)

    attention.causal = False  # the broken mask replaces the causal one
    _replace_call(attention, call)
    _assert_named(bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False), "tblocks.1.mhattention")


def test_missing_residual():
    torch_model, flax_model = _former()

    def call(self, x, mask=None, **_):
        x = self.do(self.norm1(self.mhattention(x, mask)))  # "+ x" forgotten
        return self.do(self.norm2(self.ff(x) + x))

    _replace_call(flax_model.tblocks[1], call)
    report = bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False)
    _assert_named(report, "tblocks.1")
    # its norm1 is the first output to go wrong, but it computes right on the right input
    assert next(r for r in report.rows if r.path == "tblocks.1.norm1").status == "inherited"


def test_wrong_attention_scale():
    torch_model, flax_model = _former()
    flax_model.tblocks[0].mhattention.scale = "head"  # sqrt of the head width, not of emb
    _assert_named(bisect.bisect(torch_model, flax_model, (IDS,), use_jit=False), "tblocks.0.mhattention")


@pytest.mark.parametrize("name", ["CTransformer(max)", "TransformerForSequenceClassification(BERT)", "GPTTransformer",
                                  "Transformer"])
@pytest.mark.keep_cases("GPTTransformer", "TransformerForSequenceClassification(BERT)", reason="the kept cases cover the others: the hardest masks (padding, causal+padding, fully masked rows), one model of each family")
def test_a_correct_port_of_every_family_flags_nothing(name):
    spec = next(s for s in verify.specs() if s.name == name)
    torch_model, args, kwargs = verify.case_inputs(spec, spec.cases[1], 0)  # padding (GPT: causal+padding)
    verify.perturb_torch(torch_model, 0)
    report = bisect.bisect(torch_model, porting.torch_to_flax(torch_model), args, kwargs, use_jit=False)
    assert report.first_divergent is None and report.passed, str(report)
    assert sum(r.status == "ok" for r in report.rows) >= 10  # it did compare modules, not skip them all
    # torch modules the Flax twin does not call (embeddings it reads as tables, parameter-free layers) are
    # listed as covered by their parent's row: no gap, so a correct port passes without allow_skipped
    assert not report.incomplete and not any(r.status.startswith("skipped") for r in report.rows), str(report)


def test_grads_name_the_transposed_parameter():
    torch_model, flax_model = _former()
    kernel = flax_model.tblocks[1].mhattention.tokeys.kernel
    kernel.set_value(kernel[...].T)
    report = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False)
    assert report.first_divergent_grad == "tblocks.1.mhattention.tokeys.weight", str(report)
    data = json.loads(report.to_json())
    assert data["first_divergent"] == "tblocks.1.mhattention.tokeys" and len(data["gradients"]) == 30
    assert "tblocks.1.mhattention.tokeys" in report.tree()


PAIR = '''
import numpy as np
import torch_reference.former as tf
from flax_transformer.interop import porting

def make():
    model = tf.CTransformer(16, 4, 1, 8, 20, 3).eval()
    flax_model = porting.torch_to_flax(model)
    flax_model.toprobs.bias.set_value(flax_model.toprobs.bias[...].at[0].add(1e-3))  # one class's bias
    return model, flax_model, (np.random.default_rng(0).integers(0, 20, (2, 8)),)

def wrong():
    return 1, 2
'''


def test_cli_pair(tmp_path, capsys):
    from flax_transformer.cli.commands import main

    (tmp_path / "pair.py").write_text(PAIR)
    out = tmp_path / "report.json"
    assert main(["verify", "--pair", f"{tmp_path}/pair.py:make", "--bisect", "--json", str(out)]) == 1
    assert "error introduced in toprobs (Linear)" in capsys.readouterr().out
    assert json.loads(out.read_text())["first_divergent"] == "toprobs"
    assert main(["verify", "--pair", f"{tmp_path}/pair.py:make", "--json", str(out)]) == 2  # exists: no --overwrite
    assert "exists" in capsys.readouterr().err
    # without --bisect: compare.compare's table, one row for the outputs and one per gradient
    assert main(["verify", "--pair", f"{tmp_path}/pair.py:make", "--grads", "--json", str(out), "--overwrite"]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["direction"] == "torch vs flax" and not rows[0]["passed"] and len(rows) == 1 + 17
    assert "toprobs.bias" in capsys.readouterr().out
    for spec, message in ((f"{tmp_path}/pair.py:wrong", "must return (torch_model, flax_model, args)"),
                          (f"{tmp_path}/pair.py:nothing", "has no function 'nothing'"),
                          ("no_such_module_here:make", "cannot import 'no_such_module_here'"),
                          ("pair.py", "must be MODULE:FACTORY")):
        assert main(["verify", "--pair", spec]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow(reason="test_cli_pair (verify --bisect on the command line), "
                  "test_cli_pair_float64_inputs_and_mismatched_shapes")
def test_cli_checkpoint_bisect_json(tmp_path, capsys):
    from flax_transformer.cli.commands import main
    from flax_transformer.verification import export

    torch_model, flax_model = _former()
    export.save_safetensors(flax_model, tmp_path / "model.safetensors")
    out = tmp_path / "bisect.json"
    assert main(["verify", "--checkpoint", str(tmp_path / "model.safetensors"), "--bisect", "--json", str(out),
                 "--no-jit"]) == 0  # the embeddings the Flax model reads as tables are covered, not gaps
    data = json.loads(out.read_text())
    assert data["first_divergent"] is None and data["passed"]
    assert {"tblocks.1.mhattention.tokeys", ""} <= {m["path"] for m in data["modules"]}
    assert "every module within budget" in capsys.readouterr().out
    assert main(["verify", "--checkpoint", str(tmp_path / "model.safetensors"), "--bisect", "--text", "hi"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    pt = export.save_torch(flax_model, tmp_path / "m.pt")  # a bare .pt: its certificate says its model
    assert main(["verify", "--checkpoint", str(pt), "--bisect", "--no-jit"]) == 0
    assert "every module within budget" in capsys.readouterr().out


def test_tuple_outputs_and_repeated_calls():
    """A layer returning (output, attention weights) is compared leaf by leaf; a module called
    twice (the block's dropout) gets a row per call; a defect in the weights alone is found."""
    cfg = EncoderConfig.tiny(vocab_size=20, hidden_size=24, num_attention_heads=4, max_position_embeddings=16)
    torch_layer = te.TransformerEncoderLayer(cfg).eval()
    verify.perturb_torch(torch_layer, 0)
    flax_layer = porting.torch_to_flax(torch_layer)
    x = np.random.default_rng(0).standard_normal((2, 5, 24)).astype(np.float32)
    report = bisect.bisect(torch_layer, flax_layer, (x,), {"return_weights": True}, use_jit=False, allow_skipped=True)
    assert report.first_divergent is None, str(report)
    assert {"", "attention"} <= {r.path for r in report.rows if r.status == "ok"}
    assert {"tblocks.0.do", "tblocks.0.do#1"} <= {r.path for r in bisect.bisect(*_former(), (IDS,), use_jit=False).rows}
    heads = flax_layer.attention.heads  # one head's key weights 1% off
    heads[1].k.kernel.set_value(heads[1].k.kernel[...] * 1.01)
    _assert_named(bisect.bisect(torch_layer, flax_layer, (x,), {"return_weights": True}, use_jit=False), "attention")


def _linears(out_flax=3, dtype=None):
    """A torch Linear(4, 3) and a Flax Linear(4, out_flax) holding its weights (where they fit)."""
    import torch
    from flax import nnx

    torch.manual_seed(0)
    torch_model = torch.nn.Linear(4, 3).eval()
    flax_model = nnx.Linear(4, out_flax, dtype=dtype, rngs=nnx.Rngs(0))
    if out_flax == 3:
        flax_model.kernel.set_value(jnp.asarray(torch_model.weight.detach().numpy().T))
        flax_model.bias.set_value(jnp.asarray(torch_model.bias.detach().numpy()))
    return torch_model, flax_model


X64 = np.random.default_rng(0).standard_normal((2, 4))  # float64: the float32 runs take it as float32


def test_err_zero_d_infinities_and_nan():
    inf, nan = np.inf, np.nan
    assert measure.err([np.float32(1.5)], [np.float64(1.0)]) == 0.5  # 0-d outputs
    assert measure.err([np.array(2.0)], [np.array(2.0)]) == 0.0
    assert measure.err([np.array([[-inf, 5.0]])], [np.array([[-inf, 1.0]])]) == 4.0  # equal infinities agree
    assert measure.err([np.array([inf])], [np.array([-inf])]) == inf
    assert measure.err([np.array([nan, 1.0])], [np.array([nan, 1.0])]) == 0.0
    assert measure.err([np.array([nan])], [np.array([1.0])]) == inf
    assert measure.scale([np.array([-inf, 2.0, nan])]) == 2.0  # an infinity must not make the budget infinite
    assert measure.err([jnp.ones(3, jnp.bfloat16)], [np.full(3, 1.25)]) == 0.25


def test_error_per_position():
    """Per position: max over batch and features; NaN never agrees (not even with a NaN in float64),
    equal infinities do; arrays that are not (b, t, ...) sequences of the input's length stay out."""
    inf, nan = np.inf, np.nan
    want = [np.array([[[0.0, 0.0], [nan, 0.0], [inf, 0.0]]]), np.zeros((1, 5))]
    got = [np.array([[[0.0, 1e-3], [nan, 0.0], [inf, 2e-3]]]), np.ones((1, 5))]
    assert measure.per_position(want, got, 3).tolist() == [1e-3, inf, 2e-3]
    assert measure.per_position(want, got, 4) is None and measure.per_position(want, got, None) is None
    found = bisect_report.PositionErrors(np.zeros(3), np.array([1e-7, 5e-6, nan]), budget=1e-6)
    assert found.onset == 1 and found.peak == 2  # NaN: beyond any budget
    assert bisect_report.PositionErrors(np.zeros(2), np.array([0.0, 1e-7]), budget=1e-6).onset is None
    data = found.to_dict()
    assert data["onset"] == 1 and data["jax"][:2] == [1e-7, 5e-6] and np.isnan(data["jax"][2])
    assert measure.sequence_length(((np.zeros(3), np.zeros((2, 7), np.int64)), {})) == 7  # the first 2-d input
    assert measure.sequence_length((np.zeros(4),)) is None


def test_bfloat16_outputs_are_compared():
    report = bisect.bisect(*_linears(dtype=jnp.bfloat16), (X64.astype(np.float32),), use_jit=False)
    root = report.rows[0]
    assert root.path == "" and root.jax_err is not None and not root.status.startswith("skipped"), str(report)
    assert report.passed and report.precision == "bfloat16", str(report)  # judged by bf16's budget (its own rule)
    as_fp32 = bisect.bisect(*_linears(dtype=jnp.bfloat16), (X64.astype(np.float32),), use_jit=False, precision="float32")
    assert not as_fp32.passed  # bf16 rounding is beyond the float32 budget


def test_nothing_compared_fails():
    report = bisect.bisect(*_linears(out_flax=2), (X64,), use_jit=False)
    assert report.rows[0].status.startswith("skipped") and "(2, 2)" in report.rows[0].status
    assert report.first_divergent == bisect_report.INCOMPLETE and not report.passed and report.to_dict()["unverified"]
    assert "NOT VERIFIED" in str(report) and "every module within budget" not in str(report)


LINEAR_PAIR = '''
import numpy as np
import torch
from flax import nnx
from flax_transformer.verification import export

def make(out=3):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).eval()
    flax_model = nnx.Linear(4, out, rngs=nnx.Rngs(0))
    if out == 3:
        flax_model.kernel.set_value(model.weight.detach().numpy().T)
        flax_model.bias.set_value(model.bias.detach().numpy())
    return model, flax_model, (np.random.default_rng(0).standard_normal((2, 4)),)  # float64 inputs

def narrow():
    return make(2)
'''


def test_cli_pair_float64_inputs_and_mismatched_shapes(tmp_path, capsys):
    from flax_transformer.cli.commands import main

    (tmp_path / "lin.py").write_text(LINEAR_PAIR)
    assert main(["verify", "--pair", f"{tmp_path}/lin.py:make", "--no-jit"]) == 0  # float64 numpy inputs run
    assert main(["verify", "--pair", f"{tmp_path}/lin.py:make", "--bisect", "--no-jit"]) == 0
    capsys.readouterr()
    assert main(["verify", "--pair", f"{tmp_path}/lin.py:narrow", "--bisect", "--no-jit"]) == 1
    out = capsys.readouterr().out
    assert "NOT VERIFIED" in out and "every module within budget" not in out
    assert main(["verify", "--pair", f"{tmp_path}/lin.py:narrow", "--no-jit"]) == 2  # compare: shapes differ
    err = capsys.readouterr().err
    assert "shapes differ" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_cli_pair_factory_that_exits_or_a_model_that_raises_is_one_line(tmp_path, capsys):
    """A factory calling sys.exit(0) must not end the check with exit 0 and no verdict; a Flax model
    that raises KeyError when run is one line and exit 2, not a traceback."""
    from flax_transformer.cli.commands import main

    (tmp_path / "odd.py").write_text(
        "import sys\n"
        "import numpy as np\n"
        "import torch\n"
        "from flax import nnx\n"
        "def exits():\n"
        "    sys.exit(0)\n"
        "class Raises(nnx.Module):\n"
        "    def __call__(self, x):\n"
        "        raise KeyError('no such head')\n"
        "def raises():\n"
        "    return torch.nn.Identity(), Raises(), (np.zeros((2, 3), np.float32),)\n")
    for spec, message in ((f"{tmp_path}/odd.py:exits", "called sys.exit(0) instead of returning a pair"),
                          (f"{tmp_path}/odd.py:raises", "failed: KeyError")):
        for bisect_flag in ([], ["--bisect"]):
            assert main(["verify", "--pair", spec, "--no-jit", *bisect_flag]) == 2, (spec, bisect_flag)
            err = capsys.readouterr().err
            assert message in err and len(err.strip().splitlines()) == 1, err
