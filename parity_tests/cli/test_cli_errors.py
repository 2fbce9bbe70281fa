"""The command line's errors are one line and its flags go together: a pair factory that raises,
``--allow-nonfinite`` (what it allows, and only with ``--bisect`` or ``--pair``), ``--text`` (with
``--checkpoint`` and ``--bisect`` only; longer than the model reads), ``port --verify`` on NaN in both
source and output.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
Pair factories written to a file here (``x * nan`` in both frameworks).
"""

import json

import pytest
import torch
from flax import nnx

from flax_transformer.cli import bisect_cli
from flax_transformer.cli.commands import main
from flax_transformer.interop import porting
from flax_transformer.models.former import CTransformer


@pytest.fixture(scope="module")
def tiny_former():
    return CTransformer(8, 2, 1, 6, 5, 2, rngs=nnx.Rngs(0))


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
