"""PEFT LoRA variants read as plain LoRA, against PEFT's own model: what ``interop.peft_config`` refuses.

    python bench/peft_variants.py

On a tiny random llama (2 layers, width 32; LoRA r=4 on q_proj and v_proj, every A and B moved off its
start as training would), for each variant: the largest logit difference between PEFT's model and the
adapter read by ``load_peft`` as plain LoRA (the refused field set back to its default, which is what a
reader that ignored it computed), and for PiSSA and OLoRA the adapter converted as the refusal says
(``save_pretrained(..., path_initial_model_for_weight_conversion=...)``) read by ``load_peft``.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np


def _llama(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32)).save_pretrained(folder)


def _peft(base: Path, **config):
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", **config))
    return model


def _moved(model) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.05 * torch.randn_like(param))


def _ours(base: Path, folder: Path, ids, **plain) -> np.ndarray:
    from flax import nnx

    from flax_transformer.interop import hf, peft

    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **plain}))
    model = peft.load_peft(hf.from_pretrained(base), folder)
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, ids))


def _theirs(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model.eval()(torch.from_numpy(ids)).logits.float().numpy()


def main() -> int:
    warnings.simplefilter("ignore")
    jax.config.update("jax_default_matmul_precision", "highest")
    tmp = Path(tempfile.mkdtemp())
    _llama(tmp / "hf")
    ids = np.random.default_rng(0).integers(6, 64, size=(2, 9))
    for start in ("pissa", "olora"):
        model = _peft(tmp / "hf", init_lora_weights=start)
        model.save_pretrained(tmp / f"{start}-init")
        config = json.loads((tmp / f"{start}-init" / "adapter_config.json").read_text())
        (tmp / f"{start}-init" / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": True}))
        _moved(model)
        model.save_pretrained(tmp / f"{start}-raw")
        model.save_pretrained(tmp / f"{start}-conv", path_initial_model_for_weight_conversion=str(tmp / f"{start}-init"))
        want = _theirs(model, ids)
        plain = np.abs(_ours(tmp / "hf", tmp / f"{start}-raw", ids, init_lora_weights=True) - want).max()
        converted = np.abs(_ours(tmp / "hf", tmp / f"{start}-conv", ids) - want).max()
        print(f"{start}: unconverted, read as plain LoRA: max abs logit diff {plain:.3f}; converted "
              f"(r {json.loads((tmp / f'{start}-conv' / 'adapter_config.json').read_text())['r']}), "
              f"read by load_peft: {converted:.1e}")
    model = _peft(tmp / "hf", init_lora_weights=False, alora_invocation_tokens=[3, 4])
    _moved(model)
    model.save_pretrained(tmp / "alora")
    prompt = ids.copy()
    prompt[:, 4:6] = [3, 4]  # the invocation tokens at positions 4-5: aLoRA acts from there on
    want = _theirs(model, prompt)
    plain = np.abs(_ours(tmp / "hf", tmp / "alora", prompt, alora_invocation_tokens=None) - want).max()
    print(f"alora: read as plain LoRA: max abs logit diff {plain:.3f} (aLoRA leaves the tokens before its "
          "invocation to the base, and so their keys and values)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
