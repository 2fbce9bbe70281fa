"""Seeds outside what a random key holds, [0, 2**32 - 1], are one clear error (issue 22 item 7):
``generate(..., seed=)`` raises ``ValueError``; ``flax-transformer generate --seed`` exits 2 with one
line naming the flag and the range, before the run is read."""

import jax
import numpy as np
import pytest
import torch

import torch_reference.gpt as tg
from flax_transformer.interop import porting
from flax_transformer.models.generate import MAX_SEED, generate


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return porting.torch_to_flax(tg.GPTTransformer(2, 16, 32, 4, 40, 24).eval())


@pytest.mark.parametrize("seed", [2**63, 2**64, 2**32, -1, -2**63])
def test_generate_refuses_a_seed_outside_the_range(model, seed):
    with pytest.raises(ValueError, match=rf"seed must be an integer in \[0, 4294967295\] .*got {seed}$"):
        generate(model, np.array([[1, 2, 3]]), 2, seed=seed)


def test_the_range_ends_are_seeds_and_a_key_needs_none(model):
    ids = np.array([[1, 2, 3]])
    assert MAX_SEED == 2**32 - 1
    assert generate(model, ids, 2, seed=MAX_SEED).shape == (1, 2)
    assert generate(model, ids, 2, seed=0).shape == (1, 2)
    assert generate(model, ids, 2, rng=jax.random.key(3), seed=-1).shape == (1, 2)  # the key decides; seed unused


@pytest.mark.parametrize("seed", [str(2**63), "-1", str(2**32)])
def test_cli_generate_refuses_a_seed_in_one_line(seed, tmp_path, capsys):
    from flax_transformer.cli import commands as cli

    assert cli.main(["generate", "--checkpoint", str(tmp_path / "no-run"), "--prompt", "hi", "--seed", seed]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "--seed must be an integer in [0, 4294967295]" in err and err.rstrip().endswith(f"got {seed}"), err
