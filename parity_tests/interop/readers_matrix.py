"""The reader matrix: this library's exports loaded by the transformers that will read them (the oldest 4.x this
project supports and the newest 5.x, each in a virtualenv of its own: ``reader_venvs``), their logits against
the installed transformers' on the same ids.

Each export starts as a random tiny model of the installed transformers (seeded, every weight moved: fresh
norms are ones, or Gemma's zeros, and would hide a wrong convention), saved by transformers, read by
``hf.from_pretrained`` and written by ``hf.save_pretrained``; the reference is the installed transformers'
model itself. The PEFT adapter is ``peft.save_peft``'s, of a LoRA on our Flax Llama (read from the llama
export, which is its base folder), its reference our Flax model's logits. A reader loads each export in its
own process (``reader_load.py``: ``output_loading_info``, eager attention) on a full row and a right-padded
row of 24 tokens (windows of 3-4, positions past ``max_position_embeddings`` and past YaRN's and llama3's
original contexts); a cell is the largest error on the real tokens over the logits' scale (at least 1),
``absent`` where that transformers has no such ``model_type``, or ``refused`` with the reader's reason.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from flax_transformer.interop import hf, peft
from flax_transformer.models import lora
from parity_tests.interop.test_llama_hf import logits
from parity_tests.models.deepseek_models import eager_deepseek
from parity_tests.models.test_moe import hf_model as moe_model

LOADER = Path(__file__).with_name("reader_load.py")
TOLERANCE = 1e-5  # of the logits' scale: fp32 on both sides
T, VOCAB = 24, 64
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
GEMMA = dict(DECODER, head_dim=8, intermediate_size=32, num_hidden_layers=4, max_position_embeddings=8,
             sliding_window=3, query_pre_attn_scalar=12)
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)  # short, so llama3's scaling bites within the 24 positions
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
            original_max_position_embeddings=8)  # with max_position_embeddings 32: 4 x 8
# name -> (model_type, the causal LM class, its config, switches): transformers' names (5.x keywords)
CAUSAL = {
    "llama-llama3": ("llama", "LlamaForCausalLM", "LlamaConfig", dict(
        rope_parameters=LLAMA3, tie_word_embeddings=True, mlp_bias=True)),
    "mistral-window": ("mistral", "MistralForCausalLM", "MistralConfig", dict(sliding_window=3)),
    "qwen2-window": ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(  # a full layer, then a sliding one
        use_sliding_window=True, sliding_window=3, max_window_layers=1)),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, attention_bias=True)),
    "gemma": ("gemma", "GemmaForCausalLM", "GemmaConfig", dict(
        head_dim=16, num_key_value_heads=1, max_position_embeddings=8)),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(
        GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3-two-ropes": ("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        GEMMA, layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1e6),
            sliding_attention=dict(rope_type="default", rope_theta=100.0)))),
    "gemma3-every-sixth": ("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(GEMMA, num_hidden_layers=7)),
    "gpt_oss-yarn": ("gpt_oss", "GptOssForCausalLM", "GptOssConfig", dict(  # 4.57 fixes the SwiGLU limit at 7
        DECODER, head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        tie_word_embeddings=False, max_position_embeddings=32, rope_parameters=dict(YARN, truncate=False))),
    "gpt2": ("gpt2", "GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)),
}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # test_moe's tiny models
DEEPSEEK = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
                num_experts_per_tok=3, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4,
                qk_nope_head_dim=6, v_head_dim=5, rope_interleave=True, tie_word_embeddings=False,
                max_position_embeddings=32, rope_parameters=dict(YARN, mscale=0.7, mscale_all_dim=0.8))
BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
            max_position_embeddings=32)
NAMES = [*CAUSAL, *MOE, "deepseek_v3", "bert", "peft-lora-llama"]


def inputs() -> tuple[np.ndarray, np.ndarray]:
    """ids (2, 24) and a mask: a full row and one right-padded from position 20."""
    ids = np.random.default_rng(0).integers(8, VOCAB, size=(2, T))
    mask = np.ones((2, T), np.int64)
    mask[1, 20:] = 0
    return ids, mask


def _moved(model):
    """``model`` in eval mode, eager attention, every weight moved by N(0, 0.2^2)."""
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    return model.eval()


def source_model(name: str):
    """(model_type, kind, the installed transformers' random model of the export ``name``), seeded."""
    torch.manual_seed(0)
    if name in CAUSAL:
        kind, cls, config, switches = CAUSAL[name]
        base = {} if kind == "gpt2" or "vocab_size" in switches else DECODER
        return kind, "causal", _moved(getattr(transformers, cls)(getattr(transformers, config)(**{**base, **switches})))
    if name in MOE:
        return name, "causal", moe_model(name)
    if name == "deepseek_v3":
        return name, "causal", _moved(eager_deepseek(transformers.DeepseekV3Config(**DEEPSEEK)))
    if name == "bert":
        return name, "encoder", _moved(transformers.BertModel(transformers.BertConfig(**BERT)))
    raise ValueError(f"no export {name!r}: one of {NAMES}")


def _peft_export(base: Path, folder: Path, ids, mask) -> np.ndarray:
    """A LoRA on our Llama read from ``base`` (B moved from zero), saved by ``peft.save_peft``; its logits."""
    model = lora.apply(hf.from_pretrained(base), rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"),
                       rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    for layer in lora.layers(model).values():  # a fresh B is zero, and a lost adapter would pass
        layer.lora_B.set_value(jnp.asarray(0.2 * rng.standard_normal(layer.lora_B.shape), jnp.float32))
    peft.save_peft(model, folder, base_model_name_or_path=str(base), overwrite=True)
    return logits(model, ids, mask)


def write_exports(root, names=NAMES) -> list[dict]:
    """Every export of ``names`` written under ``root`` with its reference logits; the readers' jobs."""
    root = Path(root)
    (root / "exports").mkdir(parents=True, exist_ok=True)
    ids, mask = inputs()
    np.savez(root / "inputs.npz", ids=ids, mask=mask)
    jobs = []
    for name in names:
        job = dict(name=name, folder=str(root / "exports" / name), inputs=str(root / "inputs.npz"))
        if name == "peft-lora-llama":
            base = root / "exports" / "llama-llama3"
            if not base.exists():
                write_exports(root, ["llama-llama3"])
            want = _peft_export(base, Path(job["folder"]), ids, mask)
            job.update(model_type="llama", kind="peft", base=str(base))
        else:
            model_type, kind, model = source_model(name)
            model.save_pretrained(root / "sources" / name)
            hf.save_pretrained(hf.from_pretrained(root / "sources" / name), job["folder"], overwrite=True)
            want = logits(model, ids, mask)
            job.update(model_type=model_type, kind=kind)
        np.save(root / f"{name}.want.npy", want)
        jobs.append(job)
    (root / "jobs.json").write_text(json.dumps(jobs, indent=1), encoding="utf-8")
    return jobs


def read_all(pythons, root) -> list[dict]:
    """Each reader's row of the exports under ``root`` (the readers run side by side, each in its own process):
    ``{"version", "file", "cells": {name: cell}}``, a cell ``{"status": "ok", "error", "info"}`` (error: on the
    real tokens, over the logits' scale), ``absent`` or ``refused``."""
    root = Path(root)
    runs = []
    for i, python in enumerate(pythons):
        out = root / "read" / f"reader{i}"
        out.mkdir(parents=True, exist_ok=True)
        runs.append((python, out, subprocess.Popen([str(python), str(LOADER), str(root / "jobs.json"), str(out)],
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    return [_row(python, out, process, root) for python, out, process in runs]


def _row(python, out: Path, process, root: Path) -> dict:
    stdout, stderr = process.communicate(timeout=900)
    if process.returncode:
        raise RuntimeError(f"{python} failed to run the reader: {stderr.strip()[-2000:]}")
    report = json.loads(stdout.strip().splitlines()[-1])
    keep = inputs()[1].astype(bool)
    for name, cell in report["rows"].items():
        if cell["status"] == "ok":
            want, got = np.load(root / f"{name}.want.npy"), np.load(out / f"{name}.npy")
            scale = max(1.0, float(np.abs(want[keep]).max()))
            cell["error"] = float(np.abs(got - want)[keep].max()) / scale if got.shape == want.shape else float("inf")
    return {"version": report["version"], "file": report["file"], "cells": report["rows"]}


def cell_text(cell: dict) -> str:
    """A cell as the matrix prints it."""
    if cell["status"] == "absent":
        return "not in version"
    if cell["status"] == "refused":
        return f"refused: {cell['reason']}"
    loading = "" if not cell["info"] else f" ({'; '.join(f'{k}: {len(v)}' for k, v in cell['info'].items())})"
    return f"{cell['error']:.1e}{loading}"


def table(readers: list[dict]) -> str:
    """The matrix in markdown: a row per export, a column per reader version."""
    versions = [r["version"] for r in readers]
    lines = ["| export | " + " | ".join(f"transformers {v}" for v in versions) + " |",
             "|---|" + "---|" * len(versions)]
    for name in NAMES:
        if all(name in r["cells"] for r in readers):
            lines.append(f"| {name} | " + " | ".join(cell_text(r["cells"][name]) for r in readers) + " |")
    return "\n".join(lines)


def failures(reader: dict) -> list[str]:
    """What keeps a reader's row from agreeing: a refusal, anything missing or unexpected, an error over the
    tolerance (``absent`` is not a failure: that transformers has no such model)."""
    out = []
    for name, cell in reader["cells"].items():
        if cell["status"] == "refused" or (cell["status"] == "ok" and (cell["info"] or not cell["error"] <= TOLERANCE)):
            out.append(f"{name} in transformers {reader['version']}: {cell_text(cell)}")
    return out
