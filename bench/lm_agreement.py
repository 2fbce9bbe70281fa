"""Distribution-level agreement of torch and Flax language models: KL(torch || JAX) per token,
top-1 and top-5 agreement (``measure.lm_agreement``), in fp32 and with the Flax model computing in
bf16 (fp32 parameters) against the fp32 torch model.

    python bench/lm_agreement.py [--models gpt2 llama gpt] [--batch 4] [--length 32] [--seed 0]

The models, random weights from a config (nothing is downloaded), each weight given
``verify.NOISE`` (0.1 standard normal) as ``verify`` does, so the next-token distributions are
peaked (a fresh init's logits are near zero: a near-uniform distribution would make KL trivially
small and every argmax a near tie):

* gpt2: transformers' ``GPT2LMHeadModel`` (vocab 2000, 2 layers of width 64, tied head), written
  as an HF folder and read by ``hf.from_pretrained``; the reference is transformers' model itself;
* llama: this repo's ``torch_reference.llama.LlamaForCausalLM`` (``LlamaConfig.tiny``, vocab 2000,
  grouped-query attention, RoPE), ported by ``porting.torch_to_flax``;
* gpt: notebook 002's ``GPTTransformer`` (vocab 2000), ported by ``porting.torch_to_flax``.

Inputs: ``batch`` rows of ``length`` random ids, the last row right-padded by a quarter; padded
positions are left out of the figures. fp32 with matmul precision "highest". Under a minute on
2 CPU cores.
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from flax_transformer.interop import hf, porting
from flax_transformer.verification import measure as core
from flax_transformer.verification import verify

MODELS = ("gpt2", "llama", "gpt")
VOCAB = 2000


def _pair(name: str, folder: str):
    """(torch model taking (ids, mask) -> logits, fp32 Flax model, bf16-compute Flax model)."""
    torch.manual_seed(0)
    if name == "gpt2":
        import transformers

        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4)
        reference = transformers.GPT2LMHeadModel(config).eval()
        verify.perturb_torch(reference, 0)
        reference.save_pretrained(folder)
        fp32 = hf.from_pretrained(folder)
        bf16 = hf.from_pretrained(folder, dtype=jnp.bfloat16)

        def run(ids, mask):
            return reference(ids, attention_mask=mask).logits
        return run, fp32, bf16
    if name == "llama":
        from flax_transformer.models.llama_config import LlamaConfig
        from torch_reference.llama import LlamaForCausalLM

        reference = LlamaForCausalLM(LlamaConfig.tiny(vocab_size=VOCAB)).eval()
    else:
        from torch_reference.gpt import GPTTransformer

        reference = GPTTransformer(2, 64, 128, 4, VOCAB, 64).eval()
    verify.perturb_torch(reference, 0)
    fp32 = porting.torch_to_flax(reference)
    bf16 = type(fp32)(**reference.init_kwargs(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(bf16, nnx.state(fp32, nnx.Param))
    bf16.eval()
    return reference, fp32, bf16


def measure(name: str, batch: int, length: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(batch, length))
    mask = np.ones((batch, length), np.int64)
    mask[-1, length - length // 4:] = 0  # right padding
    with tempfile.TemporaryDirectory() as folder:
        run, fp32, bf16 = _pair(name, folder)
        with torch.no_grad():
            want = run(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    out = {}
    for label, model, gates in (("fp32", fp32, core.LM_FP32), ("bf16", bf16, core.LM_BF16)):
        got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).astype(jnp.float32))
        out[label] = core.lm_agreement(want, got, mask, gates=gates)
        out[label + "_max_abs_err"] = float(np.abs(got - want)[mask.astype(bool)].max())
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    print("model  compute  tokens  max abs err  KL mean   KL max    top-1   top-5   near ties  verdict (gates)")
    for name in args.models:
        result = measure(name, args.batch, args.length, args.seed)
        for label in ("fp32", "bf16"):
            r = result[label]
            print(f"{name:<6} {label:<8} {r.tokens:<7} {result[label + '_max_abs_err']:<12.2e} {r.kl_mean:<9.2e} "
                  f"{r.kl_max:<9.2e} {r.top1:<7.4f} {r.top5:<7.4f} {r.top1_near_ties:<10} "
                  f"{'pass' if r.passed else 'FAIL: ' + '; '.join(r.problems())} ({r.gates.name})")


if __name__ == "__main__":
    main()
