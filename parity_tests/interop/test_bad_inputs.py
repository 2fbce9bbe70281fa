"""Bad configs, files, state_dicts and generation arguments: a clear error naming the problem.

One test per class of defect (issue 12, "Inputs and files"); models are tiny.
"""

import json
import tracemalloc

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file

import flax_transformer.models.classic as fc
import flax_transformer.models.encoder as fe
import flax_transformer.models.former as ff
import flax_transformer.models.gpt as fg
import flax_transformer.models.llama as fl
import torch_reference.classic as tc
import torch_reference.encoder as te
import torch_reference.former as tf
import torch_reference.gpt as tg
import torch_reference.llama as tl
from flax_transformer.interop import checkpoints, converter, hf, hf_tables, porting, targets
from flax_transformer.models import configs
from flax_transformer.models.configs import EncoderConfig, GPTConfig
from flax_transformer.models.generate import generate as flax_generate
from flax_transformer.models.state_dict_errors import StateDictError
from flax_transformer.verification import export
from torch_reference.generate import generate as torch_generate

# ------------------------------------------------------------------ configs


@pytest.mark.parametrize("cls,field,value", [
    (EncoderConfig, "hidden_dropout_prob", "0.1"),
    (EncoderConfig, "layer_norm_eps", "1e-12"),
    (EncoderConfig, "layer_norm_eps", float("nan")),
    (EncoderConfig, "layer_norm_eps", 0.0),
    (EncoderConfig, "layer_norm_eps_blocks", float("inf")),
    (EncoderConfig, "hidden_size", 2 ** 30),
    (EncoderConfig, "vocab_size", 10 ** 10),
    (EncoderConfig, "token_types", "2"),
    (EncoderConfig, "norm_first", "false"),
    (GPTConfig, "resid_pdrop", 5.0),
    (GPTConfig, "attn_pdrop", "0.1"),
    (GPTConfig, "layer_norm_epsilon", float("nan")),
    (GPTConfig, "n_inner", 0),
    (GPTConfig, "tie_word_embeddings", "no"),
])
def test_config_field_of_wrong_type_or_value_is_refused(cls, field, value):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field} must"):
        cls.tiny(**{field: value})


@pytest.mark.parametrize("model_type,field,value", [
    ("bert", "hidden_dropout_prob", "0.1"),
    ("bert", "layer_norm_eps", "1e-12"),
    ("bert", "layer_norm_eps", float("nan")),
    ("bert", "type_vocab_size", "2"),  # was int("2") silently
    ("bert", "position_embedding_type", "relative_key"),  # was computed as absolute
    ("gpt2", "resid_pdrop", "0.1"),
    ("gpt2", "layer_norm_epsilon", -1e-5),
    ("gpt2", "vocab_size", 10 ** 10),  # was a 298 GiB allocation in the mismatch report
    ("gpt2", "n_inner", "3072"),
])
@pytest.mark.parametrize("load", [hf.from_pretrained, hf.torch_from_pretrained])
def test_hf_config_json_with_bad_field_is_refused_naming_it(tmp_path, model_type, field, value, load):
    base = (EncoderConfig.bert(EncoderConfig.tiny().__dict__).to_bert_dict() if model_type == "bert"
            else GPTConfig.tiny().to_hf_dict())
    (tmp_path / "config.json").write_text(json.dumps({**base, field: value}))
    with pytest.raises(ValueError, match=rf"config\.json: .*{field}"):
        load(tmp_path)


def test_hf_classifier_config_fields_are_checked(tmp_path):
    base = EncoderConfig.bert(EncoderConfig.tiny().__dict__)
    export.save_pretrained(fe.TransformerEncoder(base, rngs=nnx.Rngs(0)), tmp_path / "b")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    for field, value in (("initializer_range", "0.02"), ("id2label", "negative,positive")):
        (tmp_path / "b" / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=rf"config\.json: {field} must"):
            hf.classifier_from_pretrained(tmp_path / "b")


# ------------------------------------------------------------------ constructors

CONSTRUCTOR_CASES = [  # (family, class, arguments, the argument named in the error)
    ("former", "CTransformer", dict(emb=-32, heads=2, depth=1, seq_length=8, num_tokens=10, num_classes=2), "emb"),
    ("former", "CTransformer", dict(emb=16, heads=2, depth=1, seq_length=8, num_tokens=0, num_classes=2), "num_tokens"),
    ("former", "CTransformer", dict(emb=16, heads=2, depth=1.5, seq_length=8, num_tokens=10, num_classes=2), "depth"),
    ("former", "CTransformer", dict(emb=16, heads=2.0, depth=1, seq_length=8, num_tokens=10, num_classes=2), "heads"),
    ("former", "GTransformer", dict(emb=16, heads=2, depth=1, seq_length=8, num_tokens=10, dropout=1.5), "dropout"),
    ("former", "GTransformer", dict(emb=16, heads=2, depth=1, seq_length=8, num_tokens=10, attention=5), "attention"),
    ("gpt", "GPTTransformer", dict(n_layers=1, d_embed=16, d_ff=-32, n_heads=2, voc_size=10, max_length=8), "d_ff"),
    ("gpt", "GPTTransformer", dict(n_layers=1, d_embed=16, d_ff=32, n_heads=2, voc_size=True, max_length=8),
     "voc_size"),
    ("gpt", "LayerNorm", dict(d=16, eps=float("nan")), "eps"),
    ("gpt", "GPT2LMHeadModel", dict(config=dict(n_embd=32, n_head=4, resid_pdrop=5.0)), "resid_pdrop"),
    ("encoder", "AttentionHead", dict(embed_dim=0, head_dim=4), "embed_dim"),
    ("encoder", "TransformerEncoder", dict(config=dict(hidden_size=32, num_attention_heads=4,
                                                       hidden_dropout_prob="0.1")), "hidden_dropout_prob"),
    ("classic", "Transformer", dict(src_vocab_size=10, tgt_vocab_size=0, d_model=16, n_heads=2), "tgt_vocab_size"),
    ("classic", "Transformer", dict(src_vocab_size=10, tgt_vocab_size=10, d_model=16, n_heads=2, max_len=0),
     "max_len"),
    ("classic", "MultiHeadAttention", dict(d_model=16, d_feature=8, n_heads=2, dropout=-0.5), "dropout"),
]
PACKAGES = {"flax": {"former": ff, "gpt": fg, "encoder": fe, "classic": fc, "llama": fl},
            "torch": {"former": tf, "gpt": tg, "encoder": te, "classic": tc, "llama": tl}}


@pytest.mark.parametrize("framework", ["flax", "torch"])
@pytest.mark.parametrize("family,name,kwargs,field", CONSTRUCTOR_CASES)
def test_constructor_refuses_bad_argument_naming_it(framework, family, name, kwargs, field):
    cls = getattr(PACKAGES[framework][family], name)
    extra = {"rngs": nnx.Rngs(0)} if framework == "flax" else {}
    with pytest.raises(ValueError, match=rf"\b{field}\b.* must"):
        cls(**kwargs, **extra)


def test_mismatch_report_allocates_nothing():
    """A config far larger than the weights is named in the report, not allocated (was np.empty(shape))."""
    model = targets.build_unfilled(fg.GPT2LMHeadModel, dict(config=GPTConfig.tiny(vocab_size=10 ** 7, n_embd=32)))
    state = porting.state_dict(fg.GPT2LMHeadModel(GPTConfig.tiny(), rngs=nnx.Rngs(0)))
    tracemalloc.start()
    try:
        with pytest.raises(StateDictError, match=r"transformer\.wte\.weight: checkpoint \(100, 32\) vs "
                                                         r"model \(10000000, 32\)"):
            porting.load_state_dict(model, state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50e6, f"the mismatch report allocated {peak / 1e6:.0f} MB"


# ------------------------------------------------------------------ sharded index


def _sharded_folder(tmp_path):
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "outside.safetensors"))
    save_file({"w": np.ones(2, np.float32)}, str(folder / "model-1.safetensors"))
    return folder


@pytest.mark.parametrize("index,message", [
    ([1, 2], "not a sharded-checkpoint index"),
    ({"weight_map": "model-1.safetensors"}, "'weight_map' must map"),
    ({"weight_map": {"w": 3}}, "'weight_map' must map"),
    ({"weight_map": {"w": "../outside.safetensors"}}, "not a file name in the index's own folder"),
    ({"weight_map": {"w": "ABSOLUTE"}}, "not a file name in the index's own folder"),
    ({"weight_map": {"w": "model.safetensors.index.json"}}, "not a .safetensors or torch"),
])
def test_malformed_or_escaping_shard_index_is_refused(tmp_path, index, message):
    folder = _sharded_folder(tmp_path)
    if isinstance(index, dict) and index["weight_map"] == {"w": "ABSOLUTE"}:
        index = {"weight_map": {"w": str(tmp_path / "outside.safetensors")}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message):
        hf.read_weights(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    assert list(hf.read_weights(folder)) == ["w"]  # a good index still reads


def test_torch_pickle_with_non_string_keys_is_not_a_state_dict(tmp_path):
    torch.save({1: torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="does not hold a state_dict"):
        hf.read_weights(tmp_path / "pytorch_model.bin")


@pytest.mark.parametrize("load", [hf.from_pretrained, hf.torch_from_pretrained])
def test_hf_weights_beyond_float32_are_refused_in_both_frameworks(tmp_path, load):
    export.save_pretrained(fg.GPT2LMHeadModel(GPTConfig.tiny(), rngs=nnx.Rngs(0)), tmp_path / "g")
    weights = hf.read_weights(tmp_path / "g")
    wte = weights["transformer.wte.weight"].astype(np.float64)
    wte[0, 0] = 1e300
    save_file({**weights, "transformer.wte.weight": wte}, str(tmp_path / "g" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"wte\.weight'\] holds 1e\+300, beyond the range"):
        load(tmp_path / "g")


def test_heads_that_do_not_divide_a_weight_are_named():
    with pytest.raises(StateDictError, match=r"encoder\.layer\.0\.attention\.self\.query\.weight.*"
                                                     r"num_attention_heads=4"):
        converter.convert(hf_tables.BERT_ROWS, {"encoder.layer.0.attention.self.query.weight": np.zeros((6, 8))},
                          forward=True, context=converter.Context(num_attention_heads=4))


# ------------------------------------------------------------------ state_dict values


def _bad_states(state, framework):
    key = "gamma"
    value = state[key]
    big = (value.double() if framework == "torch" else value.astype(np.float64)) * 0 + 1e300
    return [
        (list(state.items()), TypeError, "must be a mapping"),
        (None, TypeError, "must be a mapping"),
        ({**state, 3: value}, TypeError, "keys must be strings"),
        ({**state, key: value + 1j}, TypeError, "complex"),
        ({**state, key: big}, ValueError, "beyond the range"),
    ]


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("framework", ["flax", "torch"])
def test_load_state_dict_refuses_odd_values_and_loads_nothing(framework, case):
    if framework == "flax":
        model = fg.LayerNorm(4)
        state = porting.state_dict(model)
        before = {k: v.copy() for k, v in state.items()}
        load = lambda s: porting.load_state_dict(model, s)  # noqa: E731
        after = lambda: porting.state_dict(model)  # noqa: E731
    else:
        model = tg.LayerNorm(4)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        before = {k: v.numpy().copy() for k, v in state.items()}
        load = model.load_state_dict
        after = lambda: {k: v.numpy() for k, v in model.state_dict().items()}  # noqa: E731
    bad, error, message = _bad_states(state, framework)[case]
    with pytest.raises(error, match=message):
        load(bad)
    for key, value in after().items():
        np.testing.assert_array_equal(value, before[key])


# ------------------------------------------------------------------ safetensors metadata


def test_metadata_can_name_only_the_library_model_classes_and_configs(tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(ff, "not_a_model", lambda **kw: called.append(kw), raising=False)
    monkeypatch.setattr(configs, "not_a_config", lambda **kw: called.append(kw), raising=False)
    bad = [
        ({"family": "former", "class": "not_a_model", "init_kwargs": {}}, "is not a former model class"),
        ({"family": "former", "class": "Sequence", "init_kwargs": {}}, "is not a former model class"),
        ({"family": "gpt", "class": "GPT2LMHeadModel", "init_kwargs": {"config": {"__config__": "not_a_config"}}},
         "unknown config type"),
        ({"family": "os", "class": "system", "init_kwargs": {}}, "unknown family"),
        ({"family": "former", "class": "CTransformer", "init_kwargs": [1]}, "not a model description"),
    ]
    for description, message in bad:
        with pytest.raises(ValueError, match=message):
            checkpoints.build(description)
    with pytest.raises(ValueError, match="framework must be"):
        checkpoints.build({"family": "gpt", "class": "LayerNorm", "init_kwargs": {"d": 4}}, framework="tf")
    assert not called
    state = porting.state_dict(fg.LayerNorm(4))
    save_file(state, str(tmp_path / "m.safetensors"), metadata={"flax_transformer": json.dumps(bad[0][0])})
    with pytest.raises(ValueError, match=r"m\.safetensors: 'not_a_model' is not a former model class"):
        checkpoints.load(tmp_path / "m.safetensors")
    save_file(state, str(tmp_path / "m.safetensors"), metadata={"flax_transformer": "{not json"})
    with pytest.raises(ValueError, match="header entry is not valid JSON"):
        checkpoints.load(tmp_path / "m.safetensors")
    assert not called


def test_model_class_table_lists_every_model_class_of_both_packages():
    import inspect

    from flax_transformer.interop.family_tables import MODULE_FAMILIES
    from flax_transformer.models.constructor_records import RecordsInit

    def home(c) -> str:  # the family of the module a class is defined in (llama_layers, mla: llama's)
        name = c.__module__.rpartition(".")[2]
        return MODULE_FAMILIES.get(name, name)

    for family, names in checkpoints.MODEL_CLASSES.items():
        for package in PACKAGES.values():
            module = package[family]
            public = {n for n, c in vars(module).items() if inspect.isclass(c) and issubclass(c, RecordsInit)
                      and home(c) == family and c.__module__.startswith(module.__name__.rpartition(".")[0])
                      and not n.startswith("_")}
            assert public == set(names), f"{module.__name__}: {sorted(public ^ set(names))}"


def test_load_of_a_missing_path_says_it_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint file or folder"):
        checkpoints.load(tmp_path / "nonexistent.pt")


# ------------------------------------------------------------------ generation

GEN = dict(n_layers=1, d_embed=16, d_ff=32, n_heads=2, voc_size=10, max_length=8)


@pytest.fixture(scope="module")
def gpt_pair():
    torch.manual_seed(0)
    torch_model = tg.GPTTransformer(**GEN).eval()
    return torch_model, porting.torch_to_flax(torch_model)


@pytest.mark.parametrize("framework", ["flax", "torch"])
def test_tiny_temperature_is_greedy(gpt_pair, framework):
    if framework == "flax":
        model, ids, run = gpt_pair[1], jnp.array([[1, 2], [3, 4]]), flax_generate
    else:
        model, ids, run = gpt_pair[0], torch.tensor([[1, 2], [3, 4]]), torch_generate
    greedy = np.asarray(run(model, ids, 4, greedy=True))
    for temperature in (1e-39, 1e-45):
        np.testing.assert_array_equal(np.asarray(run(model, ids, 4, temperature=temperature)), greedy)


@pytest.mark.parametrize("framework", ["flax", "torch"])
def test_batch_of_zero_gives_empty_outputs_everywhere(framework):
    if framework == "flax":
        gpt, enc = fg.GPTTransformer(**GEN, rngs=nnx.Rngs(0)), fe.TransformerEncoder(EncoderConfig.tiny(), rngs=nnx.Rngs(0))
        ids, run = jnp.zeros((0, 3), jnp.int32), flax_generate
    else:
        gpt, enc = tg.GPTTransformer(**GEN).eval(), te.TransformerEncoder(EncoderConfig.tiny()).eval()
        ids, run = torch.zeros((0, 3), dtype=torch.long), torch_generate
    assert tuple(gpt(ids).shape) == (0, 3, 10)
    assert tuple(enc(ids).shape) == (0, 3, 32)
    assert tuple(run(gpt, ids, 2).shape) == (0, 2)
    tokens, logits = run(gpt, ids, 2, return_logits=True)
    assert tuple(tokens.shape) == (0, 2) and tuple(logits.shape) == (0, 2, 10)


@pytest.mark.parametrize("framework", ["flax", "torch"])
@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature="0.5"), "temperature must be > 0 and finite"),
    (dict(temperature=float("inf")), "temperature must be > 0 and finite"),
    (dict(top_p="0.9"), r"top_p must lie in \(0, 1\]"),
    (dict(greedy="no"), "greedy must be True or False"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(src_attention_mask=np.array([[1, 1]])), "only for classic.Transformer"),  # was ignored
])
def test_generate_refuses_arguments_of_the_wrong_type(gpt_pair, framework, kwargs, message):
    if framework == "flax":
        model, ids, run, conv = gpt_pair[1], jnp.array([[1, 2]]), flax_generate, jnp.asarray
    else:
        model, ids, run, conv = gpt_pair[0], torch.tensor([[1, 2]]), torch_generate, torch.as_tensor
    kwargs = {k: conv(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        run(model, ids, 2, **kwargs)


def test_generate_checks_the_source_mask_values_before_compiling():
    """Inside generate's jit the model cannot see mask values: 2 counted as a token."""
    model = fc.Transformer(10, 10, d_model=16, n_heads=2, n_blocks=1, d_ff=32, max_len=6, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"src_attention_mask must hold only 0 \(pad\) and 1"):
        flax_generate(model, jnp.array([[1]]), 2, src_ids=jnp.array([[1, 2]]), src_attention_mask=jnp.array([[1, 2]]))


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "Transformer"])
def test_generate_with_zero_layers_uses_the_empty_cache(name):
    if name == "GPT2LMHeadModel":
        model, extra = fg.GPT2LMHeadModel(GPTConfig.tiny(n_layer=0), rngs=nnx.Rngs(0)), {}
    else:
        model = fc.Transformer(10, 10, d_model=16, n_heads=2, n_blocks=0, d_ff=32, max_len=8, rngs=nnx.Rngs(0))
        extra = dict(src_ids=jnp.array([[1, 2]]))
    cached = flax_generate(model, jnp.array([[1, 2]]), 3, greedy=True, **extra)
    plain = flax_generate(model, jnp.array([[1, 2]]), 3, greedy=True, use_cache=False, **extra)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(plain))
