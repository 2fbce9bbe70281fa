"""``params.json``'s reader (issue 36 items 5 and 6): what it computes, what it ignores, and the refusals
that point at the fix. Pure: a params.json in a temporary folder, no weights read.
"""

import dataclasses
import json

import pytest

from flax_transformer.interop import meta_llama


@dataclasses.dataclass
class ModelArgs:  # llama2.c's model.py, field for field (its defaults)
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 32000
    hidden_dim: int | None = None
    multiple_of: int = 256
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    dropout: float = 0.0


def params_of(tmp_path, **fields) -> tuple[dict, object]:
    (tmp_path / "params.json").write_text(json.dumps(fields))
    params = meta_llama.read_params(tmp_path)
    return params, meta_llama.config_of(params, params["vocab_size"], tmp_path / "params.json")


def test_llama2c_model_args_are_read_with_their_null_and_zero(tmp_path):
    """llama2.c writes ``dropout: 0.0`` and ``hidden_dim: null``: they compute nothing different."""
    args = dataclasses.asdict(ModelArgs(dim=288, n_layers=6, n_heads=6, vocab_size=32000, multiple_of=32))
    _, config = params_of(tmp_path, **args)
    assert config.intermediate_size == 768 and config.num_key_value_heads == 6  # llama2.c's FeedForward width


@pytest.mark.parametrize("field, value, named", [("dropout", 0.1, "dropout=0.1"), ("dropout", True, "dropout=True")])
def test_a_dropout_is_refused_naming_it(tmp_path, field, value, named):
    with pytest.raises(ValueError, match=named):
        params_of(tmp_path, **{**dataclasses.asdict(ModelArgs(dim=64, n_heads=4, n_layers=1)), field: value})


@pytest.mark.parametrize("dim, multiple_of, width", [(288, 32, 1024), (4096, 1024, 14336), (64, 32, 96)])
def test_a_width_is_refused_naming_the_ffn_dim_multiplier_that_gives_it(tmp_path, dim, multiple_of, width):
    """hidden_dim (llama2.c's width) is refused, naming the ffn_dim_multiplier that gives it, which is then read."""
    args = dataclasses.asdict(ModelArgs(dim=dim, n_heads=4, n_layers=1, multiple_of=multiple_of, hidden_dim=width))
    with pytest.raises(ValueError, match="ffn_dim_multiplier") as error:
        params_of(tmp_path, **args)
    multiplier = float(str(error.value).split('"ffn_dim_multiplier": ')[1].split(" ")[0])
    _, config = params_of(tmp_path, **{**args, "hidden_dim": None, "ffn_dim_multiplier": multiplier})
    assert config.intermediate_size == width


def test_a_width_no_multiplier_gives_says_so():
    assert "no ffn_dim_multiplier gives the width 100" in meta_llama.width_hint({"dim": 64, "multiple_of": 32}, 100)


def test_an_unknown_field_is_refused_with_the_lists(tmp_path):
    with pytest.raises(ValueError, match="does not compute: rope_frobnicate .*ignored: max_batch_size, max_seq_len"):
        params_of(tmp_path, **dataclasses.asdict(ModelArgs(dim=64, n_heads=4, n_layers=1)), rope_frobnicate=1)


def test_a_params_json_without_norm_eps_reads_meta_s_default(tmp_path):
    """Meta's ModelArgs default norm_eps is 1e-5: a params.json without it reads that."""
    args = dataclasses.asdict(ModelArgs(dim=64, n_heads=4, n_layers=1))
    del args["norm_eps"]
    _, config = params_of(tmp_path, **args)
    assert config.rms_norm_eps == ModelArgs.norm_eps


@pytest.mark.parametrize("vocab", [0, -2])
def test_a_vocab_size_not_positive_nor_minus_one_is_refused(tmp_path, vocab):
    with pytest.raises(ValueError, match=f"vocab_size must be a positive integer or -1.*got {vocab}"):
        params_of(tmp_path, **dataclasses.asdict(ModelArgs(dim=64, n_heads=4, n_layers=1, vocab_size=vocab)))
