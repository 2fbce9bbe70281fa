"""LoRA (models.lora) against PEFT, and PEFT adapter folders both ways (interop.peft).

Reference: peft's own ``lora.Linear`` and ``PeftModel`` on tiny random transformers models (no
download). Tolerance: 1e-5 in fp32 with matmul precision "highest" (TOL). Every adapter compared
has a non-zero B, so that an adapter lost on the way (B zero, keys skipped) changes the logits
by far more than TOL; each such test also checks that difference.
"""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from flax_transformer.interop import hf, peft
from flax_transformer.models import gpt, lora
from parity_tests.conftest import TOL

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
peft_lib = pytest.importorskip("peft", reason="peft is not installed (the test extra installs it)")

IDS = np.random.default_rng(0).integers(0, 64, size=(2, 7))

GEMMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=32, sliding_window=3, query_pre_attn_scalar=12)
GEMMA_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# model_type -> (transformers model, our targets, PEFT's targets for the same modules)
CASES = {
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)),
        ("c_attn", "c_fc"), ["c_attn", "c_fc"]),
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32)), ("q_proj", "v_proj", "down_proj"),
        ["q_proj", "v_proj", "down_proj"]),
    # Gemma 2 (caps that bite, a 3-key window on layer 0) and Gemma 3 (q/k norms, two RoPEs): attention and MLP
    "gemma2": (lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)), GEMMA_TARGETS, list(GEMMA_TARGETS)),
    "gemma3_text": (lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **GEMMA, layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1e6),
            sliding_attention=dict(rope_type="default", rope_theta=100.0)))), GEMMA_TARGETS, list(GEMMA_TARGETS)),
    "bert": (lambda: transformers.BertModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=16)), ("query", "value", "output_linear", "linear_1", "linear_2"),
        r"encoder\.layer\.\d+\.(attention\.self\.(query|value)|(attention\.output|intermediate|output)\.dense)"),
}


def _err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.max(np.abs(a - b)))


@nnx.jit
def _call(model, ids):
    return model(ids)


def _ours(model, ids=IDS) -> np.ndarray:
    """A Flax model's output, jitted (one compile beats the first eager call's per-op ones)."""
    return np.asarray(_call(model, jnp.asarray(ids)))


def _torch_out(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(ids))
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float().numpy()


def _random_b(model, seed=0):
    """Give every adapter a non-zero B (a fresh one is zero and would hide a lost adapter)."""
    rng = np.random.default_rng(seed)  # numpy: jax.random would compile a program per shape
    for layer in lora.layers(model).values():
        layer.lora_B.set_value(jnp.asarray(0.2 * rng.standard_normal(layer.lora_B.shape), jnp.float32))


@pytest.fixture(scope="module", params=list(CASES))
def folder(request, tmp_path_factory):
    """(model_type, an HF folder of a tiny random model)."""
    torch.manual_seed(0)
    model = CASES[request.param][0]().eval()
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(path)
    return request.param, path


def _base(kind, path):
    return getattr(transformers, type(CASES[kind][0]()).__name__).from_pretrained(path).eval()


# ------------------------------------------------------------------ one layer against peft's lora.Linear


@pytest.mark.parametrize("conv1d, use_rslora", [(False, False), (False, True), (True, False)],
                         ids=["linear", "linear-rslora", "conv1d"])
def test_layer_matches_peft_forward_and_gradients(conv1d, use_rslora):
    torch.manual_seed(0)
    d_in, d_out, rank, alpha = 12, 10, 4, 6
    if conv1d:  # GPT-2's layer: weight (in, out), PEFT adapts it with fan_in_fan_out
        from transformers.pytorch_utils import Conv1D
        base = Conv1D(d_out, d_in)
        ours = gpt.Linear(d_in, d_out, rngs=nnx.Rngs(0))
        ours.matrix.set_value(jnp.asarray(base.weight.detach().numpy()))
    else:
        base = torch.nn.Linear(d_in, d_out)
        ours = nnx.Linear(d_in, d_out, rngs=nnx.Rngs(0))
        ours.kernel.set_value(jnp.asarray(base.weight.detach().numpy().T))
    ours.bias.set_value(jnp.asarray(base.bias.detach().numpy()))
    config = peft_lib.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=use_rslora, fan_in_fan_out=conv1d,
                                 target_modules=["layer"])
    theirs = peft_lib.tuners.lora.Linear(base, "default", config=config, r=rank, lora_alpha=alpha)
    with torch.no_grad():
        theirs.lora_B["default"].weight.normal_(std=0.1)
    ours = (lora.LoRAConv1D if conv1d else lora.LoRALinear)(
        ours, lora.LoRAConfig(rank=rank, alpha=alpha, use_rslora=use_rslora), rngs=nnx.Rngs(1))
    fresh = np.abs(np.asarray(ours.lora_A[...]))  # PEFT's init: U(-1/sqrt(in), 1/sqrt(in)) for A, zeros for B
    assert fresh.max() <= 1 / np.sqrt(d_in) and fresh.max() > 0.7 / np.sqrt(d_in)
    assert ours.lora_A.shape == (d_in, rank) and not np.asarray(ours.lora_B[...]).any()
    ours.lora_A.set_value(jnp.asarray(theirs.lora_A["default"].weight.detach().numpy().T))
    ours.lora_B.set_value(jnp.asarray(theirs.lora_B["default"].weight.detach().numpy().T))
    assert ours.lora_scale == theirs.scaling["default"]

    x = np.random.default_rng(1).normal(size=(3, 5, d_in)).astype(np.float32)
    g = 0.1 * np.random.default_rng(2).normal(size=(3, 5, d_out)).astype(np.float32)  # a random cotangent
    tx = torch.from_numpy(x).requires_grad_()
    y = theirs(tx)
    (y * torch.from_numpy(g)).sum().backward()

    def loss(module, x):
        return (module(x) * g).sum()

    grads = nnx.jit(nnx.grad(loss, argnums=(nnx.DiffState(0, lora.LoRAParam), 1)))  # one compile, not one per op
    (grad_layer, grad_x) = grads(ours, jnp.asarray(x))
    assert _err(_ours(ours, x), y.detach().numpy()) < TOL
    assert _err(grad_x, tx.grad.numpy()) < TOL
    assert _err(grad_layer["lora_A"][...].T, theirs.lora_A["default"].weight.grad.numpy()) < TOL
    assert _err(grad_layer["lora_B"][...].T, theirs.lora_B["default"].weight.grad.numpy()) < TOL
    assert float(np.abs(np.asarray(grad_layer["lora_A"][...])).max()) > 1e-3  # B is not zero: A learns
    theirs.merge()  # PEFT's merge of this layout (fan_in_fan_out transposes for Conv1D) against ours
    lora.merge(ours)
    assert _err(getattr(ours, ours._weight)[...], base.weight.detach().numpy() if conv1d
                else base.weight.detach().numpy().T) < TOL
    assert _err(_ours(ours, x), y.detach().numpy()) < TOL


# ------------------------------------------------------------------ merge, dropout, optimizer state


@pytest.mark.parametrize("folder", ["llama"], indirect=True)  # the layer test merges the Conv1D layout
def test_fresh_adapter_merge_unmerge_and_remove_on_a_model(folder):
    kind, path = folder
    model = hf.from_pretrained(path)
    before = _ours(model)
    kernels = {p: np.asarray(layer.kernel[...]) for p, layer in lora.layers(
        lora.apply(model, rank=4, alpha=8, targets=CASES[kind][1], rngs=nnx.Rngs(0))).items()}
    assert len(kernels) == 6 and np.array_equal(_ours(model), before)  # B starts at zero
    _random_b(model)
    adapted = _ours(model)
    assert _err(adapted, before) > 100 * TOL
    lora.merge(model)
    assert _err(_ours(model), adapted) < TOL
    with pytest.raises(ValueError, match="already merged"):
        lora.merge(model)
    lora.unmerge(model)
    for p, layer in lora.layers(model).items():
        assert _err(layer.kernel[...], kernels[p]) < 1e-6
    assert _err(_ours(model), adapted) < TOL
    merged = lora.remove(lora.merge(nnx.clone(model)))  # a merged model's adapters are folded in once, not twice
    assert not lora.layers(merged) and _err(_ours(merged), adapted) < TOL
    lora.remove(model)  # merged into plain layers again: what hf.save_pretrained writes
    assert not lora.layers(model) and _err(_ours(model), adapted) < TOL
    assert type(model.model.layers[0].self_attn.q_proj) is nnx.Linear
    again = lora.apply(hf.from_pretrained(path), rank=4, alpha=8, targets=CASES[kind][1], rngs=nnx.Rngs(0))
    _random_b(again)
    lora.remove(lora.merge(again), merge_weights=False)  # a merged adapter taken out again: the base as it was
    assert _err(_ours(again), before) < TOL


def test_modules_to_save_match_as_peft_matches_them():
    """PEFT's ``_set_trainable``: a module whose path *ends with* a listed name, as a string, is saved whole
    (so ``classifier`` takes DistilBERT's ``pre_classifier``), with everything under it."""
    assert peft._under(["classifier"], "pre_classifier") and peft._under(["classifier"], "distilbert.pre_classifier")
    assert peft._under(["classifier"], "classifier.out_proj") and peft._under(["score"], "score")
    assert not peft._under(["classifier"], "classifier_x") and not peft._under(["lm_head"], "model.embed_tokens")


def test_dropout_acts_on_the_lora_branch_and_follows_eval_and_train():
    layer = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    x = np.ones((4, 16), np.float32)
    base = np.asarray(layer(jnp.asarray(x)))
    adapted = lora.LoRALinear(layer, lora.LoRAConfig(rank=2, alpha=4, dropout=0.5), rngs=nnx.Rngs(1))
    adapted.lora_B.set_value(jnp.ones((2, 8)))
    full = 2.0 * x @ np.asarray(adapted.lora_A[...]) @ np.ones((2, 8), np.float32)  # scale 4/2, no dropout
    train = _ours(adapted, x)  # a fresh LoRA layer trains: dropout on its input
    assert np.abs(train - base).max() > 1e-3 and _err(train, base + full) > 1e-3
    assert _err(_ours(adapted, x), train) > 1e-3  # a new mask each call
    adapted.eval()
    assert _err(_ours(adapted, x), base + full) < TOL  # eval: no dropout, the whole branch


@pytest.mark.parametrize("folder", ["llama"], indirect=True)
def test_optimizer_state_holds_only_the_adapters(folder):
    kind, path = folder
    model = lora.apply(hf.from_pretrained(path), rank=4, alpha=8, targets=CASES[kind][1], rngs=nnx.Rngs(0))
    _random_b(model)
    sizes = lora.state_sizes(model)
    full = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) - sizes.adapted
    assert sizes.full == full and 0 < sizes.adapted < full / 5
    assert sizes.adapted == 2 * 4 * (32 + 32) + 2 * 4 * (32 + 16) + 2 * 4 * (48 + 32)  # per layer: q, v, down
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=lora.LoRAParam)
    moments = sum(x.size for x in jax.tree.leaves(nnx.state(optimizer.opt_state)) if x.size > 1)
    assert moments == 2 * sizes.adapted  # Adam's mu and nu, for the adapters only
    base = {k: np.asarray(v) for k, v in jax.tree.leaves_with_path(nnx.state(model, nnx.All(nnx.Param, nnx.Not(lora.LoRAParam))))
            for k in [jax.tree_util.keystr(k)]}
    adapters = [np.asarray(x) for x in jax.tree.leaves(lora.trainable(model))]

    @nnx.jit
    def step(model, optimizer, ids):
        loss = lambda m: jnp.mean(m(ids) ** 2)  # noqa: E731
        grads = nnx.grad(loss, argnums=nnx.DiffState(0, lora.LoRAParam))(model)
        optimizer.update(model, grads)

    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes int32 and float
        step(model, optimizer, jnp.asarray(IDS))
    after = {jax.tree_util.keystr(k): np.asarray(v)
             for k, v in jax.tree.leaves_with_path(nnx.state(model, nnx.All(nnx.Param, nnx.Not(lora.LoRAParam))))}
    assert all(np.array_equal(after[k], v) for k, v in base.items())
    assert all(not np.array_equal(a, np.asarray(b)) for a, b in zip(adapters, jax.tree.leaves(lora.trainable(model))))


# ------------------------------------------------------------------ PEFT folders


@pytest.mark.slow_cases({"gemma2": "test_save_peft_loads_in_peft_with_the_same_logits[gemma3_text] (the same adapters on Gemma's sandwich blocks)"})
def test_save_peft_loads_in_peft_with_the_same_logits(folder, tmp_path):
    kind, path = folder
    model = lora.apply(hf.from_pretrained(path), rank=4, alpha=8, targets=CASES[kind][1], rngs=nnx.Rngs(0))
    _random_b(model)
    peft.save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(path))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is (kind == "gpt2")
    base_logits = _torch_out(_base(kind, path))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*missing adapter keys.*")
        theirs = peft_lib.PeftModel.from_pretrained(_base(kind, path), tmp_path / "adapter").eval()
    result = theirs.load_adapter(tmp_path / "adapter", adapter_name="again")
    assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys
    adapted = [m for m in theirs.modules() if isinstance(m, peft_lib.tuners.lora.LoraLayer)]
    assert len(adapted) == len(lora.layers(model))
    assert all(m.lora_B["default"].weight.abs().max() > 0.05 for m in adapted)  # B arrived, not zero
    want = _torch_out(theirs)
    assert _err(_ours(model), want) < TOL
    assert _err(want, base_logits) > 100 * TOL  # the adapter changes the logits: a lost one would show


def _peft_trained(kind, path, tmp_path, use_rslora=False):
    """A PEFT adapter made by peft itself: get_peft_model, then 3 SGD steps; (its folder, its logits)."""
    torch.manual_seed(0)
    config = peft_lib.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=CASES[kind][2],
                                 fan_in_fan_out=kind == "gpt2", use_rslora=use_rslora)
    model = peft_lib.get_peft_model(_base(kind, path), config)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):  # a random linear loss: BERT's output is layer-normed, so a mean square would not move
        optimizer.zero_grad()
        out = model(torch.from_numpy(IDS))
        out = out.logits if hasattr(out, "logits") else out.last_hidden_state
        (out * torch.from_numpy(np.random.default_rng(3).normal(size=out.shape).astype(np.float32))).sum().backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(tmp_path / "trained")
    return tmp_path / "trained", _torch_out(model)


@pytest.mark.slow_cases({
    "gemma2": "test_save_peft_loads_in_peft_with_the_same_logits[gemma3_text] (Gemma's adapters both ways), "
              "test_load_peft_of_a_peft_trained_adapter_gives_peft_logits[llama] (gemma2: 20 s)",
    "gemma3_text": "test_save_peft_loads_in_peft_with_the_same_logits[gemma3_text] (Gemma's adapters both ways), "
                   "test_load_peft_of_a_peft_trained_adapter_gives_peft_logits[llama] (gemma3_text: 20 s)",
})
def test_load_peft_of_a_peft_trained_adapter_gives_peft_logits(folder, tmp_path):
    kind, path = folder
    adapter, want = _peft_trained(kind, path, tmp_path)
    model = peft.load_peft(hf.from_pretrained(path), adapter)
    assert lora.config_of(model).rank == 4
    assert _err(_ours(model), want) < TOL
    assert _err(want, _torch_out(_base(kind, path))) > 100 * TOL  # trained: B is no longer zero
    peft.save_peft(model, tmp_path / "again")  # and back: peft reads our copy of its adapter
    theirs = peft_lib.PeftModel.from_pretrained(_base(kind, path), tmp_path / "again").eval()
    assert _err(_torch_out(theirs), want) < TOL


@pytest.mark.parametrize("folder", ["llama"], indirect=True)
def test_load_peft_reads_rslora_from_the_folder(folder, tmp_path):
    """A folder peft wrote with ``use_rslora=True``: scale alpha / sqrt(r) = 4, not alpha / r = 2."""
    kind, path = folder
    adapter, want = _peft_trained(kind, path, tmp_path, use_rslora=True)
    model = peft.load_peft(hf.from_pretrained(path), adapter)
    assert _err(_ours(model), want) < TOL
    assert lora.config_of(model).use_rslora and all(layer.lora_scale == 4.0 for layer in lora.layers(model).values())


# ------------------------------------------------------------------ refusals


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    """(a tiny Flax llama, a PEFT adapter folder for it written by save_peft, the llama's HF folder);
    tests take ``nnx.clone``s."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama") / "hf"
    CASES["llama"][0]().save_pretrained(path)
    base = hf.from_pretrained(path)
    peft.save_peft(lora.apply(nnx.clone(base), rank=4, alpha=8, targets=("q_proj", "v_proj"), rngs=nnx.Rngs(0)),
                   path.parent / "adapter")
    return base, path.parent / "adapter", path


def _edited(tmp_path, adapter, config=None, weights=None):
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "edited"
    out.mkdir()
    raw = json.loads((adapter / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**raw, **(config or {})}))
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file(weights(tensors) if weights else tensors, out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize("config, weights, message", [
    ({"peft_type": "IA3"}, None, "peft_type 'IA3' is not 'LORA'"),
    ({"peft_type": "PREFIX_TUNING"}, None, "peft_type 'PREFIX_TUNING' is not 'LORA'"),
    ({"use_dora": True}, None, "DoRA"),
    ({"rank_pattern": {"q_proj": 8}}, None, "per-module ranks"),
    ({"modules_to_save": ["lm_head"]}, None, r"missing keys \(1\)"),  # named to be saved, but not in the file
    ({"r": 8}, None, r"shape mismatches \(8\)"),  # the config's rank does not fit the tensors
    ({"target_modules": ["query"]}, None, "name no linear layer"),
    ({"target_modules": ["q_proj", "v_proj", "k_proj"]}, None, r"missing keys \(4\)"),
    (None, lambda t: {k.replace("base_model.model.", ""): v for k, v in t.items()}, "lack PEFT's 'base_model.model.'"),
    (None, lambda t: {**t, "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": t[next(iter(t))]},
     r"unexpected keys \(1\)"),
])
def test_load_peft_refuses(llama_adapter, tmp_path, config, weights, message):
    base, adapter, _ = llama_adapter
    model = nnx.clone(base)
    with pytest.raises(ValueError, match=message):
        peft.load_peft(model, _edited(tmp_path, adapter, config, weights))
    assert not lora.layers(model)  # nothing was added


def test_load_peft_accepts_its_own_adapter_and_refuses_a_second(llama_adapter):
    base, adapter, _ = llama_adapter
    model = peft.load_peft(nnx.clone(base), adapter)
    assert sorted(lora.layers(model)) == [f"model.layers.{i}.self_attn.{n}" for i in (0, 1) for n in ("q_proj", "v_proj")]
    with pytest.raises(ValueError, match="already has LoRA"):
        peft.load_peft(model, adapter)


@pytest.mark.parametrize("kwargs, message", [
    (dict(targets=("query",)), r"targets \['query'\] match no module of the LlamaForCausalLM"),
    (dict(rank=0), "rank must be an integer >= 1"),
    (dict(targets=("self_attn",)), "model.layers.0.self_attn, a LlamaAttention, not a linear layer"),
    (dict(targets=(r".*\.mlp",)), "a LlamaMLP, not a linear layer"),
    (dict(dropout=1.0), "dropout must be in"),
])
def test_apply_refuses(llama_adapter, kwargs, message):
    model = nnx.clone(llama_adapter[0])
    with pytest.raises(ValueError, match=message):
        lora.apply(model, rngs=nnx.Rngs(0), **kwargs)
    assert not lora.layers(model)


@pytest.mark.parametrize("folder", ["bert"], indirect=True)
def test_bert_takes_lora_over_all_heads_or_per_head_and_peft_only_the_first(folder, tmp_path):
    """transformers' names (``query``) put one LoRA over all heads, as PEFT's on BERT's whole ``query``;
    ours (``q``) one per head, which computes too but has no transformers module to be saved as."""
    kind, path = folder
    fused = lora.apply(hf.from_pretrained(path), rank=2, targets=("query",), rngs=nnx.Rngs(0))
    assert sorted(lora.layers(fused)) == [f"layers.{i}.attention.q_lora" for i in (0, 1)]
    per_head = lora.apply(hf.from_pretrained(path), rank=2, targets=("q",), rngs=nnx.Rngs(0))
    assert len(lora.layers(per_head)) == 2 * 4 and all(k.endswith(".q") for k in lora.layers(per_head))
    for model in (fused, per_head):
        _random_b(model)
        before = _ours(model)
        lora.merge(model)  # merged weights compute what the adapters did: neither was skipped
        assert _err(_ours(model), before) < TOL
        assert _err(before, _torch_out(_base(kind, path))) > 100 * TOL  # and they change the output
    with pytest.raises(ValueError, match=r"heads\.0\.q is a LoRA on one head's slice"):
        peft.save_peft(lora.apply(hf.from_pretrained(path), targets=("q",), rngs=nnx.Rngs(0)), tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_targets_follow_peft_rules(llama_adapter):
    model = llama_adapter[0]
    assert lora.find(model, "q_proj") == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert sorted(lora.find(model, r"model\.layers\.1\..*_proj")) == sorted([
        f"model.layers.1.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")])
    with pytest.raises(ValueError, match="match no module"):  # a plain name is a whole last part, not a suffix
        lora.find(model, "proj")


def test_save_peft_writes_modules_to_save_that_peft_loads(llama_adapter, tmp_path):
    base, _, path = llama_adapter
    model = lora.apply(nnx.clone(base), rank=4, alpha=8, targets=("q_proj",), rngs=nnx.Rngs(0))
    _random_b(model)
    model.lm_head.kernel.set_value(2 * model.lm_head.kernel[...])  # a fully trained head, saved beside the adapter
    peft.save_peft(model, tmp_path / "adapter", modules_to_save=["lm_head"])
    theirs = peft_lib.PeftModel.from_pretrained(_base("llama", path), tmp_path / "adapter").eval()
    assert _err(_ours(model), _torch_out(theirs)) < TOL
    back = peft.load_peft(nnx.clone(base), tmp_path / "adapter")  # the saved head comes back with the adapter
    assert _err(_ours(back), _torch_out(theirs)) < TOL
    assert _err(_ours(back), _ours(lora.apply(nnx.clone(base), targets=("q_proj",), rngs=nnx.Rngs(0)))) > 100 * TOL
    with pytest.raises(ValueError, match=r"modules_to_save \['classifier'\] name no module"):
        peft.save_peft(model, tmp_path / "other", modules_to_save=["classifier"])
    assert not (tmp_path / "other").exists()


def test_a_peft_sequence_classifier_adapter_loads_with_its_head_and_goes_back(tmp_path):
    """PEFT's SEQ_CLS adapter (``modules_to_save`` ["classifier", "score"]: BERT has the first) on
    transformers' BERT classifier, after two torch steps: ours computes its logits, and writes it back."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=40, max_position_embeddings=16, num_labels=2)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "hf")

    def base():
        return transformers.BertForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    theirs = peft_lib.get_peft_model(base(), peft_lib.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                                   target_modules=["query", "value"]))
    optimizer = torch.optim.SGD([p for p in theirs.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        theirs(torch.from_numpy(IDS), labels=torch.tensor([0, 1])).loss.backward()
        optimizer.step()
    theirs.eval().save_pretrained(tmp_path / "adapter")
    want = _torch_out(theirs)
    model = peft.load_peft(hf.classifier_from_pretrained(tmp_path / "hf"), tmp_path / "adapter")
    assert sorted(lora.layers(model)) == [f"encoder.layers.{i}.attention.{p}_lora" for i in (0, 1) for p in "qv"]
    assert _err(_ours(model), want) < TOL
    assert _err(want, _torch_out(base())) > 100 * TOL
    peft.save_peft(model, tmp_path / "again", task_type="SEQ_CLS", modules_to_save=["classifier"])
    again = peft_lib.PeftModel.from_pretrained(base(), tmp_path / "again").eval()
    assert _err(_torch_out(again), want) < TOL
