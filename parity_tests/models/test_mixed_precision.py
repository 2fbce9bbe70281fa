"""bf16 compute with fp32 parameters: every full model stays close to its fp32 self.

Bound: max |out_bf16 - out_fp32| <= 3e-2 * max(1, max |out_fp32|). bf16 keeps 8 significant
bits (a relative rounding step of 2**-8 = 3.9e-3 per operation); through 1-2 blocks of
matmuls on these small models the measured worst case is 1.8e-2 (the post-LN encoder
classifier and the classic encoder-decoder). Softmax and LayerNorm statistics run in fp32
(that is why the error stays at this level), and parameters stay fp32 for the optimizer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_transformer.interop import porting
from flax_transformer.verification import frameworks, verify

# A mixture of experts is left out: in bf16 a token's top-k may flip at a near tie, and its output moves far
# beyond this bound though both runs are right (GPT-OSS's model: one of 21 tokens chose other experts, 0.30
# there, every other token within 0.035 of a scale of 2.2). Its bf16 check tells flips from bugs:
# compare's routing check under bf16's budget (bench/bf16_budget.py --family gpt_oss, test_bf16_budget).
# DeepSeek-V3's models likewise (eager, as here): the q_lora_rank model sends one token of 21 to other experts in
# bf16 (0.21 there of a scale of 2.4, every other token within 0.022), the q_proj model none (0.045 of 2.6);
# compare, which checks routing, passes both (0.29 and 0.45 of bf16's budget: bench/bf16_budget.py --family deepseek).
ROUTED_APART = ("gpt_oss", "deepseek")
MODEL_SPECS = [s for s in verify.specs() if s.name in verify.MODELS and s.family not in ROUTED_APART]
BOUND = 3e-2


@pytest.mark.parametrize("spec", MODEL_SPECS, ids=lambda s: f"{s.family}-{s.name}")
@pytest.mark.slow_cases({
    "former-CTransformer(max)": "test_bf16_compute_stays_within_the_bound: the same bound on CTransformer(mean)",
    "former-GTransformer": "test_bf16_compute_stays_within_the_bound: the same bound on CTransformer(mean)",
    "classic-Transformer": "test_bf16_compute_stays_within_the_bound: the same bound on the classic TransformerEncoder",
    "gpt-GPT2LMHeadModel": "test_bf16_compute_stays_within_the_bound[gpt-GPTTransformer]: the same bound on GPTTransformer",
    "llama-LlamaForCausalLM(tied, Gemma)": "test_bf16_compute_stays_within_the_bound: the same bound on the untied GQA llama",
    "former-CTransformer(mean)": "test_bf16_compute_stays_within_the_bound: the same bound on the encoder and gpt models",
    "llama-LlamaForCausalLM(untied, GQA, llama3 RoPE)": "test_llama_hf's bf16 folders, the same bound on gpt",
    "encoder-TransformerEncoder": "test_bf16_compute_stays_within_the_bound: the same bound on TransformerForSequenceClassification",
    "classic-TransformerEncoder": "test_bf16_compute_stays_within_the_bound: the same bound on the encoder family's TransformerEncoder(BERT)",
    "encoder-TransformerForSequenceClassification(BERT)": "test_bf16_compute_stays_within_the_bound: the same bound on TransformerForSequenceClassification",
    "encoder-TransformerForSequenceClassification(BERT, mean)": "test_bf16_compute_stays_within_the_bound: the same bound on TransformerForSequenceClassification",
    "gemma-LlamaForCausalLM(Gemma 2: caps, sliding then full)": "test_bf16_compute_stays_within_the_bound: the same bound on gpt; test_softmax_norm_and_pooling_statistics_are_float32_under_bf16 traces it in bf16",
    "gemma-LlamaForCausalLM(Gemma 3: local RoPE base, linear scaling on the full layer)": "test_bf16_compute_stays_within_the_bound: the same bound on gpt; test_softmax_norm_and_pooling_statistics_are_float32_under_bf16 traces it in bf16",
})
def test_bf16_compute_stays_within_the_bound(spec):
    case = "padding" if "padding" in spec.cases else spec.cases[0]
    torch_module, args, kwargs = verify.case_inputs(spec, case, 0)
    verify.perturb_torch(torch_module, 0)
    fp32 = porting.torch_to_flax(torch_module)
    bf16 = type(fp32)(**torch_module.init_kwargs(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    bf16.eval()
    nnx.update(bf16, nnx.state(fp32, nnx.Param))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(bf16, nnx.Param)))  # fp32 storage
    to = lambda a: None if a is None else jnp.asarray(a)  # noqa: E731
    want = list(frameworks.leaves(fp32(*map(to, args), **{k: to(v) for k, v in kwargs.items()})))
    got = list(frameworks.leaves(bf16(*map(to, args), **{k: to(v) for k, v in kwargs.items()})))
    for a, b in zip(want, got, strict=True):
        err = float(jnp.abs(a - b.astype(jnp.float32)).max())
        assert np.isfinite(err) and err <= BOUND * max(1.0, float(jnp.abs(a).max())), err

