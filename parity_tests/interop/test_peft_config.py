"""``adapter_config.json`` read field by field (``interop.peft_config``): every field peft's ``LoraConfig``
knows is computed, ignorable or refused by name, and PEFT's LoRA variants are refused rather than loaded
as plain LoRA (aLoRA, PiSSA/OLoRA saved without conversion, layer_replication, KaSA, BD-LoRA); a NaN in
an adapter is named at ``load_peft``.

The variant adapters are made by peft itself (``get_peft_model`` + ``save_pretrained``) on a tiny random
llama; the field sweep needs no model.
"""

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from flax_transformer.interop import hf, peft, peft_config
from flax_transformer.models import lora

peft_lib = pytest.importorskip("peft", reason="peft is not installed (the test extra installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
from peft.tuners.lora import config as lora_configs  # noqa: E402

# every LoraConfig field at a value that is not its default, as peft's own config objects serialise it
NON_DEFAULT = {
    "alora_invocation_tokens": [5, 6], "alpha_pattern": {"q_proj": 4}, "arrow_config": lora_configs.ArrowConfig(),
    "auto_mapping": {"base_model_class": "LlamaForCausalLM", "parent_library": "transformers"},
    "base_model_name_or_path": "somewhere/else", "bias": "all", "corda_config": lora_configs.CordaConfig(),
    "ensure_weight_tying": True, "eva_config": lora_configs.EvaConfig(), "exclude_modules": ["o_proj"],
    "fan_in_fan_out": True, "inference_mode": True, "init_lora_weights": "pissa",
    "kasa_config": lora_configs.KasaConfig(), "layer_replication": [[0, 2], [1, 2]], "layers_pattern": "layers",
    "layers_to_transform": [0], "loftq_config": lora_configs.LoftQConfig(loftq_bits=8), "lora_alpha": 3,
    "lora_bias": True, "lora_dropout": 0.1, "lora_ga_config": lora_configs.LoraGAConfig(),
    "megatron_config": {"tensor_model_parallel_size": 2}, "megatron_core": "my.megatron",
    "modules_to_save": ["lm_head"], "monteclora_config": lora_configs.MontecloraConfig(), "peft_type": "IA3",
    "peft_version": "0.1.0", "qalora_group_size": 32, "r": 2, "rank_pattern": {"q_proj": 2}, "revision": "v2",
    "runtime_config": lora_configs.LoraRuntimeConfig(ephemeral_gpu_offload=True), "target_modules": ["k_proj"],
    "target_parameters": ["mlp.experts.down_proj"], "task_type": "SEQ_CLS", "trainable_token_indices": [1, 2],
    "use_bdlora": lora_configs.BdLoraConfig(target_modules_bd_a=["q_proj"], nblocks=2),
    "use_dora": True, "use_qalora": True, "use_rslora": True, "velora_config": lora_configs.VeloraConfig(),
}
# computed fields whose non-default value above is one load_peft refuses (the others are read)
REFUSED_COMPUTED = {"bias": "bias='all' trains base biases", "peft_type": "peft_type 'IA3' is not 'LORA'",
                    "init_lora_weights": "path_initial_model_for_weight_conversion"}
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


def _fields() -> set[str]:
    return {f.name for f in dataclasses.fields(peft_lib.LoraConfig)}


def _write(folder, config: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _saved(folder, **config) -> dict:
    """adapter_config.json as peft's own ``save_pretrained`` writes the ``LoraConfig`` of ``config``."""
    peft_lib.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **config}).save_pretrained(
        folder)
    return json.loads((folder / "adapter_config.json").read_text())


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    """A LoRA adapter's config as peft writes it, every field at its default."""
    return _saved(tmp_path_factory.mktemp("plain"))


def test_every_loraconfig_field_is_computed_ignored_or_refused():
    tables = set(peft_config.COMPUTED) | set(peft_config.IGNORED) | set(peft_config.REFUSED)
    sizes = len(peft_config.COMPUTED) + len(peft_config.IGNORED) + len(peft_config.REFUSED)
    assert len(tables) == sizes, "a field in two of the tables"
    assert _fields() - tables == set(), "a LoraConfig field in none of peft_config's tables"
    assert set(NON_DEFAULT) == _fields(), "the sweep below must set every LoraConfig field"
    default = peft_lib.LoraConfig()
    for name, (off, _) in peft_config.REFUSED.items():  # "off" is peft's own default
        assert off == getattr(default, name, off), name  # (peft 0.2's fields are no LoraConfig's now)


def test_an_adapter_written_by_peft_0_2_reads_and_its_fields_on_are_refused(tmp_path):
    """alpaca-lora's adapter_config.json (peft 0.2: enable_lora, merge_weights) as it was published."""
    old = {"base_model_name_or_path": "decapoda-research/llama-7b-hf", "bias": "none", "enable_lora": None,
           "fan_in_fan_out": False, "inference_mode": True, "lora_alpha": 16, "lora_dropout": 0.05,
           "merge_weights": False, "modules_to_save": None, "peft_type": "LORA", "r": 16,
           "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "task_type": "CAUSAL_LM"}
    assert peft_config.read_config(_write(tmp_path / "old", old))["r"] == 16
    for name, value in (("enable_lora", [True, False, True]), ("merge_weights", True)):
        with pytest.raises(ValueError, match=f"adapter_config.json: {name}=.* is not supported"):
            peft_config.read_config(_write(tmp_path / name, {**old, name: value}))


def test_peft_defaults_are_read_and_each_field_off_its_default_is_read_or_refused_by_name(plain, tmp_path):
    assert peft_config.read_config(_write(tmp_path / "plain", plain))["r"] == 4  # every field at its default
    for name, value in NON_DEFAULT.items():
        if name in ("peft_type", "runtime_config", "layers_pattern"):  # not a LoraConfig's to set alone (peft
            # refuses layers_pattern without layers_to_transform); runtime_config is never written
            serialised = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        else:
            serialised = _saved(tmp_path / f"peft-{name}", **{name: value})[name]
        folder = _write(tmp_path / name, {**plain, name: serialised})
        if name in peft_config.REFUSED:
            with pytest.raises(ValueError, match=f"adapter_config.json: {name}=.* is not supported"):
                peft_config.read_config(folder)
        elif name in REFUSED_COMPUTED:
            with pytest.raises(ValueError, match=REFUSED_COMPUTED[name]):
                peft_config.read_config(folder)
        else:
            assert peft_config.read_config(folder)[name] == serialised, name


def test_a_field_no_table_holds_is_refused_by_name_and_off_means_null_or_the_default(plain, tmp_path):
    with pytest.raises(ValueError, match="field 'lora_magic' is not one that load_peft computes or may ignore"):
        peft_config.read_config(_write(tmp_path / "a", {**plain, "lora_magic": 1}))
    for name, value in (("use_dora", None), ("layer_replication", None), ("rank_pattern", {}), ("use_qalora", False)):
        peft_config.read_config(_write(tmp_path / name, {**plain, name: value}))
    with pytest.raises(ValueError, match="layers_to_transform=0 is not supported"):  # layer 0, though 0 == False
        peft_config.read_config(_write(tmp_path / "zero", {**plain, "layers_to_transform": 0}))
    for name, value in (("use_dora", 0), ("use_qalora", 0.0)):  # the default only as Python compares (0 == False):
        with pytest.raises(ValueError, match=f"{name}={value!r} is not supported"):  # no file peft writes
            peft_config.read_config(_write(tmp_path / f"{name}-typed", {**plain, name: value}))
    for start in (True, False, None, "gaussian", "orthogonal", "eva"):
        peft_config.read_config(_write(tmp_path / f"init-{start}", {**plain, "init_lora_weights": start}))
    for start, message in (("olora", "path_initial_model_for_weight_conversion"), ("pissa_niter_4", "residual base"),
                           ("corda", "residual"), ("lora_ga", "residual"), ("loftq", "quantized base"),
                           ("mica", "lora_B frozen"), ("xavier", "not one of peft's starts")):
        with pytest.raises(ValueError, match=message):
            peft_config.read_config(_write(tmp_path / f"init-{start}", {**plain, "init_lora_weights": start}))


# ------------------------------------------------------------------ variants made by peft itself


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(a tiny random llama's HF folder, the Flax model of it)."""
    import torch

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama") / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(path)
    return path, hf.from_pretrained(path)


def _peft_saved(path, out, **config):
    """An adapter that peft makes on the llama of ``path`` with ``config`` and saves as it is."""
    import torch

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM.from_pretrained(path)
    config.setdefault("init_lora_weights", False)  # a random B: the adapter changes the logits
    model = peft_lib.get_peft_model(base, peft_lib.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                              **config))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("config, message", [
    (dict(alora_invocation_tokens=[3, 5]), "alora_invocation_tokens=.* only from its invocation tokens on"),
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa' .* path_initial_model_for_weight_conversion"),
    (dict(init_lora_weights="olora"), "init_lora_weights='olora' .* path_initial_model_for_weight_conversion"),
    (dict(layer_replication=[[0, 2], [1, 2]]), "layer_replication=.* is not supported: the base's layers repeated"),
    (dict(layer_replication=[[0, 1], [1, 2]]), "layer_replication=.* is not supported"),  # tensors that fit
    (dict(kasa_config=lora_configs.KasaConfig()), "kasa_config=.* is not supported: KaSA"),
    (dict(use_bdlora=lora_configs.BdLoraConfig(target_modules_bd_a=["q_proj"], target_modules_bd_b=["v_proj"],
                                               nblocks=2)),
     "use_bdlora=.* is not supported: BD-LoRA"),
])
def test_peft_variants_are_refused_naming_the_field(llama, tmp_path, config, message):
    path, base = llama
    adapter = _peft_saved(path, tmp_path / "adapter", **config)
    model = nnx.clone(base)
    with pytest.raises(ValueError, match=message):
        peft.load_peft(model, adapter)
    assert not lora.layers(model)  # refused before anything was added


def test_a_nan_in_an_adapter_is_named_at_load_peft(llama, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, base = llama
    adapter = _peft_saved(path, tmp_path / "adapter")
    tensors = load_file(adapter / peft.WEIGHTS_FILE)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[key] = np.where(np.arange(tensors[key].size).reshape(tensors[key].shape) == 3, np.nan, tensors[key])
    save_file(tensors, adapter / peft.WEIGHTS_FILE, metadata={"format": "pt"})
    model = nnx.clone(base)
    with pytest.raises(ValueError, match=rf"NaN/inf in 1 adapter tensor: {key} \(1 NaN of 64 values\)"):
        peft.load_peft(model, adapter)
    assert not lora.layers(model)


@pytest.mark.slow(reason="test_peft_variants_are_refused_naming_the_field (the refusal whose conversion this runs)")
def test_a_pissa_adapter_converted_as_the_refusal_says_loads_and_gives_peft_logits(llama, tmp_path):
    """The refusal's fix works: ``save_pretrained(..., path_initial_model_for_weight_conversion=...)`` writes
    plain LoRA (r doubled) for the unchanged base, which load_peft reads to PEFT's PiSSA model's logits."""
    import torch

    path, base = llama
    torch.manual_seed(0)
    model = peft_lib.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(path), peft_lib.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="pissa"))
    model.save_pretrained(tmp_path / "init")  # the adapter as initialised, marked plain as peft's example does
    config = json.loads((tmp_path / "init" / "adapter_config.json").read_text())
    (tmp_path / "init" / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": True}))
    with torch.no_grad():  # trained: every A and B moved off its start
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "converted", path_initial_model_for_weight_conversion=str(tmp_path / "init"))
    ids = np.random.default_rng(0).integers(0, 64, size=(2, 7))
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(ids)).logits.numpy()
    ours = peft.load_peft(nnx.clone(base), tmp_path / "converted")
    assert lora.config_of(ours).rank == 8
    got = np.asarray(nnx.jit(lambda m, x: m(x))(ours, ids))  # one compile, not one per op
    assert float(np.abs(got - want).max()) < 1e-5  # measured 1.0e-7


def test_r_alpha_bias_and_empty_targets_are_checked_field_by_field(plain, tmp_path):
    """A config without ``bias`` reads (peft's default 'none'); ``r: 0``, a NaN/infinite ``lora_alpha`` and
    ``target_modules: []`` without ``target_parameters`` are refused by name; with them, ``[]`` reads."""
    bare = {k: v for k, v in plain.items() if k != "bias"}
    assert peft_config.read_config(_write(tmp_path / "no-bias", bare))["r"] == 4
    with pytest.raises(ValueError, match="r must be an integer >= 1, got 0"):
        peft_config.read_config(_write(tmp_path / "r0", {**plain, "r": 0}))
    for alpha in (float("nan"), float("inf")):  # json writes NaN / Infinity, as Python's json reads them
        with pytest.raises(ValueError, match="lora_alpha must be a finite number"):
            peft_config.read_config(_write(tmp_path / f"alpha-{alpha}", {**plain, "lora_alpha": alpha}))
    no_targets = {**plain, "target_modules": [], "target_parameters": None}
    with pytest.raises(ValueError, match=r"target_modules must be a regex or a list of module names, got \[\]"):
        peft_config.read_config(_write(tmp_path / "empty", no_targets))
    experts = {**no_targets, "target_parameters": ["mlp.experts.down_proj"]}
    assert peft_config.read_config(_write(tmp_path / "experts", experts))["target_modules"] == []
