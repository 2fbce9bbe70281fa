"""Shards and sources: a tensor that exactly fills a shard stays in it, shards are filled as
transformers fills them, and a torch ``.pt`` source with NaN is named as the source.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
"""

import json

import numpy as np
import pytest
import torch

from flax_transformer.interop import safetensors_io
from flax_transformer.verification import (
    export,
)


def test_a_torch_pt_source_with_nan_is_named_as_the_source(tmp_path):
    # mutant E5: a .pt file was not taken as a source, so its NaN was blamed on "the model read from" it
    clean, bad = tmp_path / "clean.pt", tmp_path / "bad.pt"
    torch.save({"w": torch.ones(2)}, clean)
    torch.save({"w": torch.tensor([1.0, float("nan")])}, bad)
    assert export.check_source_finite(clean) is True
    with pytest.raises(export.NonFiniteWeights, match=rf"^{bad} holds NaN/inf in 1 tensor: w \(1 NaN"):
        export.check_source_finite(bad)


def test_a_tensor_that_exactly_fills_a_shard_stays_in_it():
    # mutant S6: >= for > opened a new shard at exactly the limit (transformers: a new one only past it)
    tensors = {name: np.zeros(4, np.float32) for name in "abc"}  # 16 bytes each
    assert [list(s) for s in safetensors_io.shard(tensors, 32)] == [["a", "b"], ["c"]]
    assert [list(s) for s in safetensors_io.shard(tensors, 31)] == [["a"], ["b"], ["c"]]


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
