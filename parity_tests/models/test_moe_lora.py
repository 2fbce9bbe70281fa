"""LoRA on the llama family's mixtures of experts against peft: attention (``target_modules``) and the
fused experts (``target_parameters``, peft's ``ParamWrapper``: one LoRA per expert on transformers 5's
``experts.gate_up_proj`` / ``experts.down_proj``), both ways through PEFT folders. transformers holds
Mixtral's and Qwen3-MoE's expert weights (E, out, in) (peft swaps in and out) and GPT-OSS's (E, in, out)
as ours (``is_transposed``: peft does not swap); the adapter files hold A (E r, in) and B (out, r E) either way.

Reference: ``peft.PeftModel`` on tiny random transformers Qwen3-MoE, Mixtral and GPT-OSS models (no download;
GPT-OSS's attention projections have biases, its experts biases that take no LoRA).
Tolerance: TOL (1e-5, fp32, matmul precision "highest"). Every compared adapter has a non-zero B
(a fresh one is zero and would hide a lost adapter), and each test checks that the adapters change
the output by far more than TOL. Gradients: of sum(output * W) for a fixed random W, for every
adapter tensor, peft's mapped to our layout by this file's own ``_ours_of`` (not the library's).
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_transformer.interop import hf, peft
from flax_transformer.models import lora, lora_experts
from flax_transformer.models.moe import GptOssExperts, LlamaExperts
from parity_tests.conftest import TOL

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
peft_lib = pytest.importorskip("peft", reason="peft is not installed (the test extra installs it)")

IDS = np.random.default_rng(0).integers(0, 64, size=(2, 6))
PROJECTION = np.random.default_rng(1).standard_normal((2, 6, 64)).astype(np.float32)  # W of sum(logits * W)
TINY = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, num_experts_per_tok=2, max_position_embeddings=32)
MODELS = {  # model_type -> transformers model of a tiny config
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=24, moe_intermediate_size=8, num_experts=4, **TINY)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=8, num_local_experts=4, **TINY)),
    "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
        intermediate_size=12, num_local_experts=4, sliding_window=4, tie_word_embeddings=False, **TINY)),
}
INPUT_FIRST = {"gpt_oss"}  # transformers' expert weights (E, in, out) as ours; the others' (E, out, in)
EXPERTS = {"qwen3_moe": LlamaExperts, "mixtral": LlamaExperts, "gpt_oss": GptOssExperts}  # our experts' class
# model_type -> (target_modules, target_parameters), sorted as peft writes them, so that the JAX model
# load_peft builds is the one apply built (one compiled program for both). Mixtral adapts one expert
# weight, so that peft wraps it alone (experts.lora_A), Qwen3-MoE both (gate_up_proj one base_layer deeper)
TARGETS = {"qwen3_moe": (["o_proj", "q_proj"], ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]),
           "mixtral": (["v_proj"], ["experts.down_proj"]),
           "gpt_oss": (["o_proj", "q_proj"], ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])}


@pytest.fixture(scope="module", params=list(MODELS))
def folder(request, tmp_path_factory):
    """(model_type, an HF folder of a tiny random MoE model)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    MODELS[request.param]().save_pretrained(path)
    return request.param, path


def _base(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.max(np.abs(a - b)))


@nnx.jit
def _forward_and_grads(model, ids):
    def loss(model):
        logits = model(ids)
        return jnp.sum(logits * PROJECTION), logits

    grads, logits = nnx.grad(loss, argnums=nnx.DiffState(0, lora.LoRAParam), has_aux=True)(model)
    return logits, grads


def _theirs(model) -> tuple[np.ndarray, dict]:
    """peft's logits and {our adapter path: {leaf: (value, gradient)}} in our layout."""
    model.zero_grad()
    logits = model(torch.from_numpy(IDS)).logits
    (logits * torch.from_numpy(PROJECTION)).sum().backward()
    out = {}
    for name, module in model.named_modules():
        path = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if isinstance(module, peft_lib.tuners.lora.ParamWrapper):
            path = f"{path}.{module.parameter_name}_lora"
        elif not isinstance(module, peft_lib.tuners.lora.Linear):
            continue
        out[path] = {leaf: tuple(_ours_of(module, leaf, t) for t in (weight.detach(), weight.grad))
                     for leaf in ("lora_A", "lora_B") for weight in [getattr(module, leaf)["default"].weight]}
    return logits.detach().numpy(), out


def _ours_of(module, leaf: str, tensor) -> np.ndarray:
    """peft's tensor in our layout: a Linear's (r, in) / (out, r) transposed; a ParamWrapper's A (E r, in)
    -> (E, in, r) and B (out, r E) -> (E, r, out), as its get_delta_weight reads them."""
    t = tensor.numpy()
    if not isinstance(module, peft_lib.tuners.lora.ParamWrapper):
        return t.T
    e = module.num_experts
    return t.reshape(e, -1, t.shape[1]).transpose(0, 2, 1) if leaf == "lora_A" else \
        t.reshape(t.shape[0], -1, e).transpose(2, 1, 0)


def _as_ours(kind: str, weight) -> np.ndarray:
    """A transformers expert weight (or peft's delta of one) in our (E, in, out) layout."""
    weight = weight.detach().numpy()
    return weight if kind in INPUT_FIRST else weight.transpose(0, 2, 1)


def _compare(ours, theirs, base_logits, kind="qwen3_moe"):
    """Ours and peft's: the same adapters (values), logits and gradients of every adapter tensor."""
    want, adapters = _theirs(theirs)
    logits, grads = _forward_and_grads(ours, jnp.asarray(IDS))
    layers = lora.layers(ours)
    assert sorted(layers) == sorted(adapters)
    assert any(isinstance(layer, lora_experts.ParamLoRA) for layer in layers.values())
    assert _err(logits, want) < TOL
    assert _err(want, base_logits) > 100 * TOL  # the adapters change the output: a lost one would show
    for path, layer in layers.items():
        for leaf, (value, grad) in adapters[path].items():
            assert _err(getattr(layer, leaf)[...], value) == 0.0, (path, leaf)
            assert _err(_at(grads, path)[leaf][...], grad) < TOL, (path, leaf)
            assert np.abs(grad).max() > 1e-4, (path, leaf)  # B is not zero: A learns too
        if isinstance(layer, lora_experts.ParamLoRA):  # the delta peft adds to the weight, in our (E, in, out) layout
            wrapper = _wrapper(theirs, path)
            assert _err(layer.update_matrix(), _as_ours(kind, wrapper.get_delta_weight("default"))) < TOL
    return np.asarray(logits)


def _at(state, path: str):
    for part in path.split("."):
        state = state[int(part) if part.isdigit() else part]
    return state


def _wrapper(theirs, path: str):
    module, _, name = path.rpartition(".")
    found = theirs.base_model.model.get_submodule(module)
    while found.parameter_name != name[:-len("_lora")]:
        found = found.base_layer
    return found


def _random_b(model, seed=0):
    rng = np.random.default_rng(seed)
    for layer in lora.layers(model).values():
        layer.lora_B.set_value(jnp.asarray(0.2 * rng.standard_normal(layer.lora_B.shape), jnp.float32))


def _experts_weights(model) -> dict[str, np.ndarray]:
    experts = model.model.layers[0].mlp.experts
    return {name: np.asarray(getattr(experts, name)[...]) for name in lora_experts.EXPERT_PARAMETERS}


@pytest.mark.slow_cases({"mixtral": "test_moe_adapter_goes_both_ways_through_peft[qwen3_moe] (the same code on "
                                    "Mixtral's names; one expert weight alone: "
                                    "test_one_expert_weight_alone_goes_both_ways_and_bad_configs_are_refused)",
                         "gpt_oss": "test_moe_adapter_goes_both_ways_through_peft[qwen3_moe] (the same code) and "
                                    "test_gpt_oss_expert_adapters_hold_peft_s_tensors_and_delta (GPT-OSS's layout "
                                    "and wrappers; about 25 s: its own compile of forward and gradients)"})
def test_moe_adapter_goes_both_ways_through_peft(folder, tmp_path):
    """Ours saved and loaded by peft, then peft's own loaded by ours: adapters, output and gradients
    equal; our merge equals peft's merge_and_unload; remove gives the base experts back."""
    kind, path = folder
    modules, parameters = TARGETS[kind]
    base_logits = _base(path)(torch.from_numpy(IDS)).logits.detach().numpy()
    ours = lora.apply(hf.from_pretrained(path), rank=2, alpha=6, targets=modules, parameters=parameters,
                      rngs=nnx.Rngs(0))
    ours.eval()
    base_weights = _experts_weights(ours)
    experts = [layer for layer in lora.layers(ours).values() if isinstance(layer, lora_experts.ParamLoRA)]
    assert experts and all(e.lora_A.shape[0] == 4 and not np.asarray(e.lora_B[...]).any() for e in experts)
    bound = np.abs(np.asarray(experts[0].lora_A[...])).max()  # peft's init: U(-1/sqrt(in), 1/sqrt(in)) per expert
    assert 0.7 / np.sqrt(experts[0].lora_A.shape[1]) < bound <= 1 / np.sqrt(experts[0].lora_A.shape[1])
    _random_b(ours)
    peft.save_peft(ours, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["target_parameters"] == [p.removeprefix("mlp.") for p in parameters]
    theirs = peft_lib.PeftModel.from_pretrained(_base(path), tmp_path / "ours", is_trainable=True).eval()
    result = theirs.load_adapter(tmp_path / "ours", adapter_name="again")
    assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys
    theirs.set_adapter("default")
    _compare(ours, theirs, base_logits, kind)
    lora.merge(ours)  # the experts' weights take the update, as peft's merge does
    merged = theirs.merge_and_unload().model.layers[0].mlp.experts
    for name, weight in _experts_weights(ours).items():
        assert _err(weight, _as_ours(kind, getattr(merged, name))) < TOL
    lora.remove(ours, merge_weights=False)
    assert not lora.layers(ours) and type(ours.model.layers[0].mlp.experts) is EXPERTS[kind]
    assert all(_err(w, base_weights[n]) < 1e-6 for n, w in _experts_weights(ours).items())

    torch.manual_seed(0)  # and back: an adapter peft made itself, loaded by ours
    theirs = peft_lib.get_peft_model(_base(path), peft_lib.LoraConfig(
        r=2, lora_alpha=6, target_modules=modules, target_parameters=parameters))
    with torch.no_grad():
        for name, weight in theirs.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.2)
    theirs.save_pretrained(tmp_path / "theirs")
    ours = peft.load_peft(hf.from_pretrained(path), tmp_path / "theirs")
    ours.eval()
    assert lora.config_of(ours).parameters == tuple(parameters)
    _compare(ours, theirs.eval(), base_logits, kind)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """An HF folder of a tiny random Qwen3-MoE."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("moe") / "hf"
    MODELS["qwen3_moe"]().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe(moe_folder):
    return hf.from_pretrained(moe_folder)


@pytest.mark.parametrize("kwargs, message", [
    (dict(parameters=["experts.down_proj"], dropout=0.1), "takes no dropout"),
    (dict(parameters=["mlp.gate.weight"]), "model.layers.0.mlp.gate.weight, which is not an expert weight"),
    (dict(parameters=["experts.up_proj"]), r"parameters \['experts.up_proj'\] match no parameter"),
    (dict(targets=["experts"]), "a LlamaExperts, not a linear layer"),
    (dict(targets=(), parameters=()), "targets must be non-empty"),
])
def test_apply_refuses(moe, kwargs, message):
    model = nnx.clone(moe)
    with pytest.raises(ValueError, match=message):
        lora.apply(model, rngs=nnx.Rngs(0), **kwargs)
    assert not lora.layers(model) and type(model.model.layers[0].mlp.experts) is LlamaExperts


def test_one_expert_weight_alone_goes_both_ways_and_bad_configs_are_refused(moe, tmp_path):
    """An adapter on down_proj alone: peft wraps it once (``experts.lora_A``, no ``base_layer``) and holds
    our tensors; ours reads it back. Then its config edited: each problem refused, nothing added."""
    ours = lora.apply(nnx.clone(moe), rank=2, targets=(), parameters=["experts.down_proj"], rngs=nnx.Rngs(0))
    _random_b(ours)
    peft.save_peft(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == [] and config["target_parameters"] == ["experts.down_proj"]
    adapter = lora.layers(ours)["model.layers.0.mlp.experts.down_proj_lora"]
    MODELS["qwen3_moe"]().save_pretrained(tmp_path / "hf")  # peft needs a base of the same shapes only
    theirs = peft_lib.PeftModel.from_pretrained(_base(tmp_path / "hf"), tmp_path / "adapter")
    wrapper = theirs.base_model.model.model.layers[0].mlp.experts
    assert isinstance(wrapper, peft_lib.tuners.lora.ParamWrapper) and wrapper.parameter_name == "down_proj"
    assert not isinstance(wrapper.base_layer, peft_lib.tuners.lora.ParamWrapper)
    for leaf in ("lora_A", "lora_B"):
        assert _err(getattr(adapter, leaf)[...], _ours_of(wrapper, leaf, getattr(wrapper, leaf)["default"].weight
                                                           .detach())) == 0.0
    back = lora.layers(peft.load_peft(nnx.clone(moe), tmp_path / "adapter"))
    assert list(back) == ["model.layers.0.mlp.experts.down_proj_lora"]
    assert all(_err(getattr(back[k], leaf)[...], getattr(adapter, leaf)[...]) == 0.0
               for k in back for leaf in ("lora_A", "lora_B"))
    for edit, message in [({"target_parameters": ["experts.gate_up_proj"]}, r"shape mismatches \(1\)"),
                          ({"target_parameters": ["mlp.gate"]}, "name no expert weight"),
                          ({"target_parameters": "experts.down_proj"}, "must be a list")]:
        (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, **edit}))
        model = nnx.clone(moe)
        with pytest.raises(ValueError, match=message):
            peft.load_peft(model, tmp_path / "adapter")
        assert not lora.layers(model)


@pytest.mark.slow(reason="test_moe_adapter_goes_both_ways_through_peft (the experts' adapter paths and layouts the "
                        "certificate reads, through peft both ways) and test_certified_export_measures_through_peft_and_"
                        "rechecks (the certificate on linear layers); about 50 s cold, its own peft model and eager grads")
def test_certified_export_of_expert_lora_passes_and_rechecks(moe, moe_folder, tmp_path, capsys):
    """``verification.export.save_peft`` of attention and expert LoRA: the certificate compares peft's
    model with ours (each ParamWrapper's A (E r, in) / B (out, r E) against ours (E, in, r) / (E, r, out),
    the output, every adapter's gradient), and ``verify --checkpoint`` re-checks it, reading the experts'
    adapters back with ``load_peft``; an expert tensor changed after the export is named."""
    from safetensors.numpy import load_file, save_file

    from flax_transformer.cli.commands import main
    from flax_transformer.verification import export
    from flax_transformer.verification.certificate import peft as certificate_peft

    ours = lora.apply(nnx.clone(moe), rank=2, alpha=6, targets=["q_proj"],
                      parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], rngs=nnx.Rngs(0))
    _random_b(ours)
    export.save_peft(ours, tmp_path / "adapter", base=moe_folder, task_type="CAUSAL_LM")
    record = json.loads((tmp_path / "adapter" / certificate_peft.FILE).read_text())
    assert record["adapter_tensors_loaded"] == 2 * 3  # A and B of q_proj and of the experts' two weights
    assert record["adapter_grads"]["tensors"] == record["adapter_grads"]["of"] == 2 * 3
    assert record["adapter_grads"]["max_rel_err"] <= TOL and record["forward"]["max_abs_err"] <= TOL
    capsys.readouterr()
    assert main(["verify", "--checkpoint", str(tmp_path / "adapter")]) == 0
    assert "PEFT LoRA adapter certificate -> pass" in capsys.readouterr().out

    tensors = load_file(tmp_path / "adapter" / peft.WEIGHTS_FILE)
    key = next(k for k in tensors if k.endswith("experts.base_layer.lora_A.weight"))  # gate_up_proj's A
    tensors[key] = 2 * tensors[key]
    save_file(tensors, tmp_path / "adapter" / peft.WEIGHTS_FILE, metadata={"format": "pt"})
    report = certificate_peft.recheck(tmp_path / "adapter")
    assert not report.ok and any(key in f for f in report.failures), report.failures


def test_gpt_oss_expert_adapters_hold_peft_s_tensors_and_delta(tmp_path):
    """GPT-OSS's experts (transformers' (E, in, out), as ours: peft does not swap in and out) with both
    weights adapted, saved by ours and loaded by peft: each ``ParamWrapper`` holds our A and B, its delta
    is our update (E, in, out) as it stands, and ours reads the folder back. No forward (the slow case of
    test_moe_adapter_goes_both_ways_through_peft compares outputs and gradients)."""
    torch.manual_seed(0)
    MODELS["gpt_oss"]().save_pretrained(tmp_path / "hf")
    base = hf.from_pretrained(tmp_path / "hf")
    ours = lora.apply(nnx.clone(base), rank=2, alpha=6, targets=(), parameters=TARGETS["gpt_oss"][1],
                      rngs=nnx.Rngs(0))
    assert type(ours.model.layers[0].mlp.experts) is lora_experts.GptOssLoRAExperts
    _random_b(ours)
    peft.save_peft(ours, tmp_path / "adapter")
    theirs = peft_lib.PeftModel.from_pretrained(_base(tmp_path / "hf"), tmp_path / "adapter")
    layers = lora.layers(ours)
    assert sorted(layers) == [f"model.layers.0.mlp.experts.{n}_lora" for n in ("down_proj", "gate_up_proj")]
    for path, layer in layers.items():
        wrapper = _wrapper(theirs, path)
        assert wrapper.num_experts == 4 and wrapper.get_param().shape == layer.update_matrix().shape
        for leaf in ("lora_A", "lora_B"):
            assert _err(getattr(layer, leaf)[...], _ours_of(wrapper, leaf, getattr(wrapper, leaf)["default"].weight
                                                               .detach())) == 0.0, (path, leaf)
        delta = _as_ours("gpt_oss", wrapper.get_delta_weight("default"))
        assert _err(layer.update_matrix(), delta) < TOL and np.abs(delta).max() > 100 * TOL, path
    back = lora.layers(peft.load_peft(nnx.clone(base), tmp_path / "adapter"))
    assert sorted(back) == sorted(layers)
    assert all(_err(getattr(back[k], leaf)[...], getattr(layers[k], leaf)[...]) == 0.0
               for k in back for leaf in ("lora_A", "lora_B"))
    lora.remove(ours, merge_weights=False)
    assert type(ours.model.layers[0].mlp.experts) is GptOssExperts
