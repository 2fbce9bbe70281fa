"""Tests that catch what they guard (issue 22 item 9): each kills one realistic bug that a mutation
probe planted and the rest of the suite let through. The bug each one guards is named in its docstring.

Tiny models throughout (eager bisects, a two-block classifier, random HF configs), so the file stays fast.
"""

import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import torch_reference.former as tf
from flax_transformer.interop import files, porting
from flax_transformer.verification import bisect, verify

IDS = np.random.default_rng(0).integers(0, 20, (2, 8))


def _former():
    torch_model = tf.CTransformer(8, 2, 1, 8, 20, 3).eval()
    verify.perturb_torch(torch_model, 0)  # fresh LayerNorms are ones and zeros: noise makes them matter
    return torch_model, porting.torch_to_flax(torch_model)


# ------------------------------------------------------------------ 1. bisect: first_divergent_grad


def test_first_divergent_grad_is_the_first_wrong_parameter_of_the_wrong_module():
    """Guards ``_first_divergent_grad`` naming the *last* diverged parameter of the module where the
    forward first went wrong: both of ``toprobs``' parameters are wrong, the weight comes first."""
    torch_model, flax_model = _former()
    head = flax_model.toprobs
    head.kernel.set_value(head.kernel[...].at[0, 0].add(0.1))  # one class's score: not a shift of all
    head.bias.set_value(head.bias[...].at[1].add(0.1))
    report = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False)
    assert report.first_divergent == "toprobs", str(report)
    wrong = [g.name for g in report.grad_rows if g.status == "diverged"]
    assert {"toprobs.weight", "toprobs.bias"} <= set(wrong), str(report)
    assert report.first_divergent_grad == "toprobs.weight", str(report)


def _wrong_backward_linear(module):
    """Give one ``nnx.Linear`` a right forward and a wrong backward: its weight and bias gradients doubled."""

    @jax.custom_vjp
    def dense(x, w, b):
        return x @ w + b

    def fwd(x, w, b):
        return dense(x, w, b), (x, w)

    def bwd(res, g):
        x, w = res
        flat_x, flat_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        return g @ w.T, 2 * flat_x.T @ flat_g, 2 * flat_g.sum(0)

    dense.defvjp(fwd, bwd)
    cls = type(module)
    module.__class__ = type(cls)(f"WrongBackward{cls.__name__}", (cls,),
                                 {"__call__": lambda self, x: dense(x, self.kernel[...], self.bias[...])})


def test_first_divergent_grad_with_a_right_forward_is_the_first_wrong_parameter():
    """The same bug on the other path: the forward agrees, one Linear's backward is wrong for both its
    parameters; the first in backward order (its weight, then its bias) is named, not the last."""
    torch_model, flax_model = _former()
    _wrong_backward_linear(flax_model.tblocks[0].ff[0])
    report = bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False, allow_skipped=True)
    wrong = [g.name for g in report.grad_rows if g.status == "diverged"]
    assert wrong == ["tblocks.0.ff.0.weight", "tblocks.0.ff.0.bias"], str(report)
    assert report.first_divergent == bisect.GRADIENTS, str(report)
    assert report.first_divergent_grad == "tblocks.0.ff.0.weight", str(report)


# ------------------------------------------------------------------ 2. capture: super().__call__


class _Doubled(nnx.Linear):
    """A user's layer on top of a library one: its ``__call__`` calls ``super().__call__``."""

    def __call__(self, x):
        return 2.0 * super().__call__(x)


class _Pair(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 6, rngs=rngs)  # the parent class is in the model too
        self.b = _Doubled(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


class _TorchDoubled(torch.nn.Linear):
    def forward(self, x):
        return 2.0 * super().forward(x)


class _TorchPair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 6), _TorchDoubled(6, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("use_jit", [False, True])
def test_a_subclass_calling_super_is_recorded_once(use_jit):
    """Guards ``capture``'s wrapper recording a layer twice when its ``__call__`` calls ``super().__call__``
    and the parent class is also in the model (both classes wrapped): the inner call, without the
    subclass's own step, would be compared with torch's whole layer and flag a correct port."""
    from flax_transformer.verification import capture

    torch.manual_seed(0)
    torch_model = _TorchPair().eval()
    flax_model = _Pair(nnx.Rngs(0))
    porting.load_state_dict(flax_model, {k: v.numpy() for k, v in torch_model.state_dict().items()})
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    _, calls = capture.nnx_calls(flax_model, (jnp.asarray(x),), {}, use_jit=use_jit)
    assert [c.path for c in calls] == ["a", "b", ""]
    report = bisect.bisect(torch_model, flax_model, (x,), use_jit=use_jit)
    assert [r.path for r in report.rows] == ["a", "b", ""], str(report)
    assert report.passed and report.first_divergent is None, str(report)
    assert all(r.status == "ok" for r in report.rows), str(report)


# ------------------------------------------------------------------ 3, 4. certificates


@pytest.fixture(scope="module")
def former():
    torch.manual_seed(0)
    return porting.torch_to_flax(tf.CTransformer(8, 2, 1, 8, 20, 2).eval())


def test_a_threefold_error_growth_in_the_same_environment_fails_the_recheck(tmp_path, former, monkeypatch):
    """Guards the re-check's margin (``RECHECK_FACTOR``, 2): an error re-measured 3x the recorded one,
    same versions and platform, is a failure (a factor of 20 would let it pass)."""
    from flax_transformer.verification import certificate, certificate_check, export

    path = export.save_safetensors(former, tmp_path / "m.safetensors")
    monkeypatch.setattr(certificate, "RECHECK_SLACK", 0.0)  # this tiny model's errors are below the 1e-7 slack
    cert = certificate.path_for(path)
    record = json.loads(cert.read_text())
    measured = record["backward"]["max_rel_err"]
    assert measured > 0, record["backward"]
    record["backward"]["max_rel_err"] = measured / 3  # re-measured: 3x what the certificate claims
    cert.write_text(json.dumps(record))
    report = certificate_check.recheck(path)
    assert not report.passed and len(report.failures) == 1, report.format()
    assert "larger than recorded" in report.failures[0] and "same versions" in report.failures[0], report.format()
    assert f"{measured:.2e} now, {measured / 3:.2e} at export" in report.failures[0], report.format()


def _no_space_for(suffix, real):
    def write_bytes(path, data, **kwargs):
        if os.fspath(path).endswith(suffix):
            raise OSError(28, "No space left on device")
        return real(path, data, **kwargs)
    return write_bytes


def test_a_failed_certificate_write_leaves_no_weights_without_their_certificate(tmp_path, former, monkeypatch):
    """Guards the certificate going in with the weights (inside the writer's swap), not after it: a
    fault at the certificate's write leaves the old weights with the old certificate, and a first
    export leaves nothing at all (never weights without a certificate)."""
    from flax_transformer.verification import certificate, certificate_check, export

    save, name = export.save_safetensors, "m.safetensors"  # save_torch: the same files.write_file
    monkeypatch.setattr(files, "write_bytes", _no_space_for(".verification.json", files.write_bytes))
    with pytest.raises(OSError, match="No space"):
        save(former, tmp_path / name)
    assert os.listdir(tmp_path) == []  # no weights, no certificate, no temporary file
    monkeypatch.undo()

    path = save(former, tmp_path / name)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(before) == {name, name + ".verification.json"}
    other = porting.torch_to_flax(porting.flax_to_torch(former))
    porting.load_state_dict(other, {k: v * 2 for k, v in porting.state_dict(former).items()})
    for module, attribute, broken in ((files, "write_bytes", _no_space_for(".verification.json", files.write_bytes)),
                                      (certificate, "to_json", lambda record: 1 / 0)):  # the certificate's JSON
        with monkeypatch.context() as patch:
            patch.setattr(module, attribute, broken)
            with pytest.raises((OSError, ZeroDivisionError)):
                save(other, path, overwrite=True)
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # old weights, old certificate
    assert certificate_check.recheck(path).passed


# ------------------------------------------------------------------ 5. layer kinds: conv layouts, rename=


class _FlaxConv(nnx.Module):
    def __init__(self, ndim, rngs):
        window = (3, 2, 2)[:ndim]  # not square: a permutation and its inverse differ in shape too
        self.conv = nnx.Conv(4, 6, kernel_size=window, padding=[(1, 1)] * ndim, feature_group_count=2,
                             kernel_init=nnx.initializers.zeros, rngs=rngs)  # filled by the port

    def __call__(self, x):
        return self.conv(x)


@pytest.mark.parametrize("ndim", [2, 3])
def test_nd_conv_round_trips_and_matches_torch(ndim):
    """Guards ``layer_kinds.to_torch`` taking a Flax kernel back with the inverse of ``to_flax``'s permutation
    (1-d convolutions cannot tell: (2, 1, 0) is its own inverse; 2-d's (2, 3, 1, 0) is not)."""
    torch.manual_seed(ndim)

    class TorchConv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = getattr(torch.nn, f"Conv{ndim}d")(4, 6, kernel_size=(3, 2, 2)[:ndim], padding=1, groups=2)

    conv = TorchConv().eval().conv
    theirs = {f"conv.{k}": v.detach().numpy() for k, v in conv.state_dict().items()}

    model = _FlaxConv(ndim, nnx.Rngs(0))
    porting.load_state_dict(model, theirs)
    x = np.random.default_rng(0).standard_normal((2, 4, *(5, 6, 3)[:ndim])).astype(np.float32)  # torch: (b, c, ...)
    with torch.no_grad():
        want = conv(torch.from_numpy(x)).numpy()
    got = np.moveaxis(np.asarray(model(jnp.asarray(np.moveaxis(x, 1, -1)))), -1, 1)  # Flax: channels last
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    back = porting.state_dict(model)  # Flax -> torch names and layouts
    assert back.keys() == theirs.keys()
    for key in theirs:
        assert back[key].shape == theirs[key].shape, key
        np.testing.assert_array_equal(back[key], theirs[key], err_msg=key)
    fresh = TorchConv()
    torch.nn.init.zeros_(fresh.conv.weight)
    porting.flax_to_torch(model, fresh)  # into torch again: the same outputs
    with torch.no_grad():
        np.testing.assert_allclose(fresh.conv(torch.from_numpy(x)).numpy(), want, atol=1e-6, rtol=0)


class _Inner(nnx.Module):
    def __init__(self, rngs):
        self.b = nnx.Linear(3, 2, kernel_init=nnx.initializers.zeros, rngs=rngs)


class _Outer(nnx.Module):
    def __init__(self, rngs):
        self.a = _Inner(rngs)


def test_rename_replaces_every_match_in_a_key():
    """Guards ``rename=`` applying each regex to every match in a key (``re.sub``), not only the first."""
    model = _Outer(nnx.Rngs(0))
    ours = porting.state_dict(model)
    assert set(ours) == {"a.b.weight", "a.b.bias"}
    theirs = porting.state_dict(model, rename=[(r"\.", "/")])  # two dots in each key
    assert set(theirs) == {"a/b/weight", "a/b/bias"}
    weights = {"x_a.x_b.weight": ours["a.b.weight"] + 1, "x_a.x_b.bias": ours["a.b.bias"] - 1}
    porting.load_state_dict(model, weights, rename=[(r"x_", "")])  # "x_" twice in each key
    np.testing.assert_array_equal(np.asarray(model.a.b.kernel[...]), weights["x_a.x_b.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.a.b.bias[...]), weights["x_a.x_b.bias"])


# ------------------------------------------------------------------ 6. sharded safetensors


def test_shards_are_filled_as_transformers_fills_them(tmp_path):
    """Guards the sharded writer's size counter (reset for each new shard): every shard but the last
    is full to within one tensor of ``max_shard_size``, and the split is huggingface_hub's (what
    transformers' ``save_pretrained(max_shard_size=...)`` uses) for tensors within the limit."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import safe_open

    from flax_transformer.interop import safetensors_io

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 400, 40)  # float32 vectors of 4 to 1600 bytes
    tensors = {f"t{i:02d}": rng.standard_normal(int(n)).astype(np.float32) for i, n in enumerate(sizes)}
    limit = 2000
    shards = safetensors_io.shard(tensors, limit)
    nbytes = [sum(v.nbytes for v in part.values()) for part in shards]
    assert len(shards) > 5 and all(b <= limit for b in nbytes)
    for part, following in zip(shards, shards[1:]):  # the next shard's first tensor did not fit
        assert sum(v.nbytes for v in part.values()) + next(iter(following.values())).nbytes > limit
    hub = split_torch_state_dict_into_shards({k: torch.from_numpy(v) for k, v in tensors.items()},
                                             max_shard_size=limit)
    assert [list(part) for part in shards] == list(hub.filename_to_tensors.values())
    # the files: the same split, each shard holding its tensors
    names = safetensors_io.write_checkpoint(tensors, tmp_path, max_shard_size=limit)
    assert len(names) == len(shards) + 1  # and the index
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == hub.tensor_to_filename and index["metadata"]["total_size"] == sum(nbytes)
    for name, part in zip(sorted(set(index["weight_map"].values())), shards):
        with safe_open(tmp_path / name, "np") as f:
            assert sorted(f.keys()) == sorted(part)
    # a tensor larger than the limit gets a shard of its own, and the next shard starts empty
    big = {"a": np.zeros(100, np.float32), "b": np.zeros(1000, np.float32), "c": np.zeros(100, np.float32),
           "d": np.zeros(100, np.float32)}
    assert [list(p) for p in safetensors_io.shard(big, 1000)] == [["a"], ["b"], ["c", "d"]]


# ------------------------------------------------------------------ 7. HF masked-LM folders


def _masked_lm_config(kind):
    import transformers

    common = dict(vocab_size=53, max_position_embeddings=20)
    if kind == "distilbert":
        return transformers.DistilBertConfig(dim=12, n_layers=1, n_heads=2, hidden_dim=20, **common)
    if kind == "roberta":
        return transformers.RobertaConfig(hidden_size=12, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=20, type_vocab_size=1, pad_token_id=1, **common)
    return transformers.BertConfig(hidden_size=12, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20,
                                   **common)


@pytest.mark.parametrize("kind,cls", [
    ("bert", "BertForPreTraining"),  # bert-base-uncased on the hub: cls.predictions and cls.seq_relationship
    ("bert", "BertForMaskedLM"),  # saved without a pooler: the encoder is built without one (hf._open)
    ("distilbert", "DistilBertForMaskedLM"),  # distilbert-base-uncased on the hub
    ("roberta", "RobertaForMaskedLM"),  # roberta-base on the hub
])
def test_masked_lm_folders_load(tmp_path, kind, cls):
    """Guards the masked-LM heads each encoder's table sets aside (DistilBERT's ``vocab_transform``,
    ``vocab_layer_norm``, ``vocab_projector``; BERT's ``cls.``; RoBERTa's ``lm_head.``): a folder of
    the class the hub's checkpoints are loads as the base model, whose hidden states are transformers'
    own."""
    transformers = pytest.importorskip("transformers")
    from flax_transformer.interop import hf

    torch.manual_seed(0)
    reference = getattr(transformers, cls)(_masked_lm_config(kind)).eval()
    reference.save_pretrained(tmp_path / kind)
    ids = np.random.default_rng(0).integers(3, 53, (2, 7))
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    ids[mask == 0] = 1 if kind == "roberta" else 0
    with pytest.warns(UserWarning, match="task-head tensors"):
        model = hf.from_pretrained(tmp_path / kind)
    with torch.no_grad():
        want = reference.base_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    got = np.asarray(model(ids, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want.last_hidden_state.numpy()[real], atol=1e-5, rtol=0)


# ------------------------------------------------------------------ 8. torch training checkpoint, bit for bit


def test_the_torch_state_round_trip_check_is_bit_for_bit(tmp_path, monkeypatch, former):
    """Guards ``torch_export.check_export``'s round trip being bit for bit (``array_equal``), not
    ``allclose``: a parameter, or an Adam moment, one float32 step (``np.nextafter``) off is reported.
    The run is an in-memory one (Adam moments set as after a step), given to ``check_export`` in place
    of a run directory."""
    from flax_transformer.training import torch_export
    from flax_transformer.training.optim import OptimConfig, make_optimizer

    optim = OptimConfig(optimizer="adamw", lr=1e-2, warmup_steps=2, weight_decay=0.1)
    model = nnx.clone(former)
    model.train()
    optimizer = nnx.Optimizer(model, make_optimizer(optim), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    for path, variable in nnx.to_flat_state(nnx.state(optimizer)):  # as after a step (an eager one costs ~10 s)
        value = variable.get_value()
        if "mu" in path or "nu" in path:
            mu = rng.standard_normal(value.shape).astype(np.float32) * 1e-2
            variable.set_value(jnp.asarray(mu if "mu" in path else mu**2 + 1e-6))
        else:  # the step and the counts
            variable.set_value(jnp.ones_like(value))

    def restore_run(run_dir, *, step=None, optim=optim):  # a fresh copy of the run's model and optimizer
        return *nnx.clone((model, optimizer)), optim, 1

    monkeypatch.setattr(torch_export, "restore_run", restore_run)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes a Python float with its int32 count
        path = torch_export.save_torch_state(tmp_path / "run.pt", model, optimizer, optim)
        assert torch_export.check_export("run", path) == []
        key = next(iter(torch.load(path, weights_only=True)["model"]))
        for what, where in (("parameter", ("model", key)), ("optimizer state", ("optimizer", "state", 0, "exp_avg"))):
            tampered = torch.load(path, weights_only=True)
            holder = tampered
            for name in where[:-1]:
                holder = holder[name]
            value = holder[where[-1]].numpy().copy()
            value.flat[0] = np.nextafter(value.flat[0], np.float32(np.inf), dtype=np.float32)  # one float32 step
            holder[where[-1]] = torch.from_numpy(value)
            torch.save(tampered, tmp_path / "tampered.pt")
            problems = torch_export.check_export("run", tmp_path / "tampered.pt")
            assert len(problems) == 1 and problems[0].startswith(what) and "differs" in problems[0], problems


# ------------------------------------------------------------------ 9. generation: buckets and source masks


def test_bucketed_seq2seq_generation_keeps_each_rows_source_mask():
    """Guards ``generate(bucket=True)`` carrying ``src_attention_mask`` into the padded batch row for row
    (batch 3 runs as a bucket of 4): each row, its source right-padded by a different amount, gets the
    tokens and logits of that row generated alone from its unpadded source (torch_reference's loop,
    no cache: no compilation), and of torch_reference's masked batch."""
    import torch_reference.classic as tc
    from flax_transformer.models.generate import bucket_shape, generate
    from torch_reference.generate import generate as torch_generate

    torch.manual_seed(0)
    torch_model = tc.Transformer(30, 40, 16, 4, 1, 32, max_len=24, dropout=0.0).eval()
    verify.perturb_torch(torch_model, 0)
    model = porting.torch_to_flax(torch_model)
    lengths = [7, 4, 2]
    src = np.random.default_rng(0).integers(1, 30, (3, 7))
    src_mask = (np.arange(7)[None] < np.array(lengths)[:, None]).astype(np.int64)
    src[src_mask == 0] = 0
    prompt = np.ones((3, 1), np.int64)
    assert bucket_shape(3, 1, 8, 24)[0] == 4
    tokens, logits = generate(model, jnp.asarray(prompt), 8, greedy=True, src_ids=jnp.asarray(src),
                              src_attention_mask=jnp.asarray(src_mask), return_logits=True)
    tokens, logits = np.asarray(tokens), np.asarray(logits)
    for i, n in enumerate(lengths):
        alone, alone_logits = torch_generate(torch_model, torch.from_numpy(prompt[i:i + 1]), 8, greedy=True,
                                             src_ids=torch.from_numpy(src[i:i + 1, :n]), return_logits=True)
        np.testing.assert_array_equal(tokens[i], alone.numpy()[0], err_msg=f"row {i}")
        np.testing.assert_allclose(logits[i], alone_logits.numpy()[0], atol=1e-5, rtol=0, err_msg=f"row {i}")
    want, want_logits = torch_generate(torch_model, torch.from_numpy(prompt), 8, greedy=True,
                                       src_ids=torch.from_numpy(src), src_attention_mask=torch.from_numpy(src_mask),
                                       return_logits=True)
    np.testing.assert_array_equal(tokens, want.numpy())
    np.testing.assert_allclose(logits, want_logits.numpy(), atol=1e-5, rtol=0)
    # the masks matter here: row 1's source with its padding unmasked gives other logits
    unmasked = torch_generate(torch_model, torch.from_numpy(prompt[1:2]), 8, greedy=True,
                              src_ids=torch.from_numpy(src[1:2]), return_logits=True)[1]
    assert np.abs(unmasked.numpy()[0, 0] - logits[1, 0]).max() > 1e-2


# ------------------------------------------------------------------ 10. the bf16 attention backward


def test_bf16_attention_backward_starts_from_the_fp32_weights():
    """Guards ``fast_backward._attention``'s bf16 backward taking the softmax's backward over the fp32
    weights it saved (``dS = W32 * (dW - sum(W32 * dW))``), not over the bf16-rounded ones: the intended
    math in float64 from the fp32 weights and the documented rounding points (dW rounded to bf16, dS
    rounded to bf16 before the matmuls). Values that all equal one row make dW constant along each
    row, so the exact dS is 0: the fp32 weights sum to 1 within 1e-7, the bf16 ones only within ~1e-3."""
    from flax_transformer.models import fast_backward

    rng = np.random.default_rng(0)
    b, h, t, d = 2, 2, 6, 8
    q, k, d_out = (jnp.asarray(rng.standard_normal((b, h, t, d)), jnp.bfloat16) for _ in range(3))
    v = jnp.asarray(np.broadcast_to(rng.standard_normal((b, h, 1, d)), (b, h, t, d)), jnp.bfloat16)
    mask = jnp.broadcast_to(jnp.asarray(np.arange(t) < np.array([t, 4])[:, None])[:, None, None], (b, h, t, t))
    scale = 1 / d**0.5  # a Python float, as the layers pass it
    (_, weights), vjp = jax.vjp(lambda q, k, v: fast_backward._attention(q, k, v, mask, scale), q, k, v)
    dq, dk, dv = (np.asarray(g.astype(jnp.float32), np.float64) for g in vjp((d_out, jnp.zeros_like(weights))))

    f64 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)  # noqa: E731
    w32 = f64(fast_backward._attention_weights(q, k, mask, scale))  # the forward's fp32 softmax
    dw = f64((d_out @ jnp.swapaxes(v, -1, -2)).astype(jnp.float32))  # rounded to bf16 by the matmul
    assert (dw == dw[..., :1]).all()  # constant along each row of keys
    ds = w32 * (dw - (w32 * dw).sum(-1, keepdims=True)) * scale
    q64, k64 = f64(q), f64(k)
    want_dq, want_dk = ds @ k64, np.swapaxes(ds, -1, -2) @ q64
    want_dv = np.swapaxes(f64(weights), -1, -2) @ f64(d_out)  # the bf16 weights, as the forward used them
    size = np.abs(dw).max() * np.abs(k64).max()
    assert np.abs(want_dq).max() < 1e-6 * size and np.abs(want_dk).max() < 1e-6 * size
    np.testing.assert_allclose(dq, want_dq, atol=1e-5 * size, rtol=0)  # bf16-rounded weights: ~3e-4 * size
    np.testing.assert_allclose(dk, want_dk, atol=1e-5 * size, rtol=0)
    np.testing.assert_allclose(dv, want_dv, atol=1e-2 * np.abs(want_dv).max(), rtol=0)


# ------------------------------------------------------------------ 11. files: live writers' temporaries, the swap


def test_another_write_leaves_live_writers_temporaries_alone(tmp_path):
    """Guards the stale-temporary cleanup removing only what dead processes left: a temporary named
    after a live process (this one, its parent, a sleeping child) survives another write of the same
    output; one named after a process that has exited is removed."""
    out = tmp_path / "out.bin"
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = [tmp_path / f".out.bin{files.TMP_MARK}{pid}-0123abcd" for pid in (os.getpid(), os.getppid(), child.pid)]
        dead = tmp_path / f".out.bin{files.TMP_MARK}{done.pid}-0123abcd"
        for temp in (*live, dead):
            temp.write_bytes(b"half written")
        files.write_bytes(out, b"new")
        assert out.read_bytes() == b"new"
        assert all(temp.read_bytes() == b"half written" for temp in live)
        assert not dead.exists()
        files.write_bytes(out, b"newer", overwrite=True)
        assert all(temp.exists() for temp in live)
    finally:
        child.kill()
        child.wait()


def test_the_output_is_swapped_in_whole_never_copied_over(tmp_path, monkeypatch):
    """Guards the swap being a rename of the finished temporary file: a copy onto the output path would
    show readers a truncated, half-written file. A reader that opened the old file keeps reading the
    old bytes (a new inode went in); nothing copies bytes onto the path; a reader polling the path
    during writes sees whole versions only."""
    import shutil

    out = tmp_path / "out.bin"
    versions = [bytes([i]) * (4 << 20) for i in range(4)]  # 4 MiB each
    files.write_bytes(out, versions[0])
    seen: list[str] = []

    def spy(real):
        def copying(*args, **kwargs):
            data = out.read_bytes() if out.exists() else None
            seen.append("copy onto the path while it holds " + ("nothing" if data is None else f"{len(data)} bytes"))
            return real(*args, **kwargs)
        return copying

    for module, name in ((os, "sendfile"), (os, "copy_file_range"), (shutil, "copyfileobj"), (shutil, "copyfile")):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, spy(getattr(module, name)))
    with open(out, "rb") as old_reader:
        inode = os.fstat(old_reader.fileno()).st_ino
        files.write_bytes(out, versions[1], overwrite=True)
        assert old_reader.read() == versions[0]
    assert os.stat(out).st_ino != inode and out.read_bytes() == versions[1]
    assert seen == []

    bad: list[int] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:
                data = out.read_bytes()
            except FileNotFoundError:
                bad.append(-1)
                continue
            if data not in versions:
                bad.append(len(data))

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for version in versions[2:] + versions[:2]:
            files.write_bytes(out, version, overwrite=True)
            time.sleep(0.01)
    finally:
        stop.set()
        reader.join()
    assert bad == [] and seen == []
