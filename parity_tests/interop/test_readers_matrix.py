"""Our exports read by the transformers that will load them: the oldest 4.x this project supports and the newest
5.x, each in a virtualenv of its own (issue 36 item 4; the exports, readers and cells: ``readers_matrix``).

The slow test builds the two venvs itself when they are missing (``reader_venvs.make_venvs``: pip reaches
PyPI), under ``FT_READERS_VENVS`` (kept: give CI a cached directory) or a temporary directory, or takes the
readers from ``FT_OLD_TRANSFORMERS_PYTHON`` / ``FT_NEW_TRANSFORMERS_PYTHON``. Where the venvs cannot be made
it fails under CI (``CI`` set) and is skipped elsewhere, saying why. ``python bench/readers.py --venvs DIR``
prints the same matrix.

The default run's test is pure: every ``model_type``'s ``config.json`` carries its RoPE both ways, the older
keys (``rope_theta``, ``rope_scaling``, Gemma 3's ``rope_local_base_freq``), which transformers 4.x reads and
5.x reads first, and 5.x's ``rope_parameters``, each set alone enough to read the same model.
"""

import os
import subprocess

import pytest

from flax_transformer.models.llama_config import LlamaConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")

from parity_tests.interop import reader_venvs, readers_matrix  # noqa: E402  (they import transformers)
from parity_tests.models.test_moe import hf_config as moe_config  # noqa: E402

OLDER = ("rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern", "max_window_layers")
NEWER = ("rope_parameters", "layer_types")


def _configs() -> dict:
    """{name: LlamaConfig} of the matrix's llama-family exports (transformers configs only: no model built)."""
    out = {}
    for name, (kind, _, cls, switches) in readers_matrix.CAUSAL.items():
        if kind != "gpt2":
            base = {} if "vocab_size" in switches else readers_matrix.DECODER
            out[name] = LlamaConfig.from_hf(getattr(transformers, cls)(**{**base, **switches}))
    out.update({kind: LlamaConfig.from_hf(moe_config(kind)) for kind in readers_matrix.MOE})
    out["deepseek_v3"] = LlamaConfig.from_hf(transformers.DeepseekV3Config(**readers_matrix.DEEPSEEK))
    return out


@pytest.mark.parametrize("name", list(_configs()))
def test_config_json_carries_the_rope_both_readers_read(name):
    config = _configs()[name]
    written = config.to_hf_dict()
    assert written["rope_theta"] == config.rope_theta
    if config.rope_scaling is None:
        assert written["rope_scaling"] is None
    else:  # 4.x reads the type under either name (rope_type from 4.42 on)
        assert written["rope_scaling"]["rope_type"] == written["rope_scaling"]["type"] == config.rope_scaling.rope_type
    older = {k: v for k, v in written.items() if k not in NEWER}
    newer = {k: v for k, v in written.items() if k not in OLDER}
    assert LlamaConfig.from_hf(older) == config, "what transformers 4.x reads is another model"
    assert LlamaConfig.from_hf(newer) == config, "what transformers 5.x's rope_parameters hold is another model"


def _readers(root) -> list:
    """[the oldest 4.x's Python, the newest 5.x's]: the given ones, or venvs made (or found) under ``root``."""
    old, new = (os.environ.get(f"FT_{which}_TRANSFORMERS_PYTHON") for which in ("OLD", "NEW"))
    try:
        old = old or reader_venvs.make_venv(root, reader_venvs.OLDEST)
        new = new or reader_venvs.make_venv(root, reader_venvs.newest(5))
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the readers' venvs could not be made ({error}); set FT_OLD_TRANSFORMERS_PYTHON and "
                    "FT_NEW_TRANSFORMERS_PYTHON, or FT_READERS_VENVS to a directory holding them")
    return [old, new]


@pytest.mark.slow(reason="test_config_json_carries_the_rope_both_readers_read")
def test_oldest_and_newest_transformers_read_every_export(tmp_path):
    readers = _readers(os.environ.get("FT_READERS_VENVS") or tmp_path / "venvs")
    readers_matrix.write_exports(tmp_path)
    rows = readers_matrix.read_all(readers, tmp_path)
    print(readers_matrix.table(rows))
    old, new = rows
    assert old["version"].startswith("4.") and new["version"].startswith("5."), (old["version"], new["version"])
    for reader in rows:
        assert readers_matrix.failures(reader) == []
        assert set(reader["cells"]) == set(readers_matrix.NAMES)
    assert [name for name, cell in new["cells"].items() if cell["status"] != "ok"] == []  # 5.x has every model_type
    ok = [name for name, cell in old["cells"].items() if cell["status"] == "ok"]
    assert {"llama-llama3", "qwen2-window", "gemma2", "mixtral", "bert", "gpt2", "peft-lora-llama"} <= set(ok)
