"""Our Gemma 2, Gemma 3 and GPT-OSS exports read by an older transformers (4.50-4.57), in its own virtualenv.

Skipped unless ``FT_OLD_TRANSFORMERS_PYTHON`` names a Python with that transformers and torch installed,
for example (docs/porting.md)::

    python3.11 -m venv /tmp/old && /tmp/old/bin/pip install "transformers==4.57.*" torch==2.13.0 safetensors
    FT_OLD_TRANSFORMERS_PYTHON=/tmp/old/bin/python pytest parity_tests/interop/test_older_transformers.py

Each folder is a random tiny transformers 5 model read by ``hf.from_pretrained`` and written back by
``hf.save_pretrained``; the older transformers loads it with nothing missing or unexpected and computes
transformers 5's logits on the real tokens of a full and a right-padded row 24 long (windows of 3-4, positions
past ``max_position_embeddings`` and YaRN's original context) within 1e-5 of their scale. What the older
reader needs is in config.json's older keys: ``rope_scaling``/``rope_theta`` (YaRN, Gemma 3's linear scaling
of its full layers), ``rope_local_base_freq``, ``sliding_window_pattern``. (transformers 4.57's GPT-OSS
fixes the clamped SwiGLU's limit and alpha at 7.0 and 1.702: the case keeps those.)
"""

import json
import os
import subprocess

import numpy as np
import pytest
import torch

from flax_transformer.interop import hf

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")
OLD = os.environ.get("FT_OLD_TRANSFORMERS_PYTHON")
pytestmark = pytest.mark.skipif(not OLD, reason="FT_OLD_TRANSFORMERS_PYTHON (a Python with transformers 4.x) is not set")

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=8)
TWO_KINDS = ["sliding_attention", "full_attention"] * 2
CASES = {  # name -> (causal LM class, config class, switches)
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(sliding_window=3, query_pre_attn_scalar=12,
                                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        sliding_window=3, query_pre_attn_scalar=12, layer_types=TWO_KINDS, rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1e6),
            sliding_attention=dict(rope_type="default", rope_theta=100.0)))),
    "gemma3_text_every_sixth": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(sliding_window=3, num_hidden_layers=7)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=8.0,
                                                        beta_slow=1.0, original_max_position_embeddings=8,
                                                        truncate=False))),
}
READ = """
import json, sys, numpy as np, torch, transformers
folder, out = sys.argv[1], sys.argv[2]
data = np.load(folder + "/inputs.npz")
model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                                 output_loading_info=True, attn_implementation="eager")
with torch.no_grad():
    logits = model.eval()(torch.from_numpy(data["ids"]), attention_mask=torch.from_numpy(data["mask"])).logits
np.save(out, logits.float().numpy())
print(json.dumps({"version": transformers.__version__, "info": {k: list(v) for k, v in info.items() if v}}))
"""


@pytest.fixture(scope="module")
def old_version() -> tuple:
    """(major, minor) of the older transformers."""
    out = subprocess.run([OLD, "-c", "import transformers; print(transformers.__version__)"], capture_output=True,
                         text=True, check=True).stdout.strip()
    return tuple(int(part) for part in out.split(".")[:2])


@pytest.mark.parametrize("name", list(CASES))
def test_older_transformers_reads_our_export(name, old_version, tmp_path):
    model_class, config_class, switches = CASES[name]
    if name == "gpt_oss" and old_version < (4, 55):
        pytest.skip(f"GPT-OSS came with transformers 4.55 (this one is {old_version})")
    torch.manual_seed(0)
    reference = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**BASE, **switches})).eval()
    with torch.no_grad():  # fresh norms are ones, or Gemma's zeros: a wrong convention would hide
        for p in reference.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    reference.save_pretrained(tmp_path / "theirs")
    ids = np.random.default_rng(0).integers(8, BASE["vocab_size"], size=(2, 24))
    mask = np.ones((2, 24), np.int64)
    mask[1, 20:] = 0
    with torch.no_grad():
        want = reference(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.float().numpy()
    hf.save_pretrained(hf.from_pretrained(tmp_path / "theirs"), tmp_path / "ours")
    np.savez(tmp_path / "ours" / "inputs.npz", ids=ids, mask=mask)
    run = subprocess.run([OLD, "-c", READ, str(tmp_path / "ours"), str(tmp_path / "logits.npy")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["version"].startswith("4.") and report["info"] == {}, report
    got = np.load(tmp_path / "logits.npy")
    error = float(np.abs(got - want)[mask == 1].max())  # padded queries whose window holds only padding are noise
    assert error <= 1e-5 * max(1.0, float(np.abs(want).max())), (name, report["version"], error)
