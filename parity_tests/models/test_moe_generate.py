"""Greedy generation of the llama family's mixtures of experts against transformers' ``generate(do_sample=False)``.

A tiny random folder of each of Mixtral (a sliding window of 8 keys), Qwen2-MoE (a shared expert,
q/k/v biases, a dense layer after a sparse one), Qwen3-MoE (per-head q/k norms, head_dim 12 of a width
of 32, top-k renormalised) and OLMoE (q/k norms over the projection, clip_qkv), saved by transformers
and read with ``hf.from_pretrained``; 64 new tokens for one prompt and for a batch of three prompts
(9, 4, 6 long), right-padded for us and left-padded for transformers (``test_generate_hf``'s
conventions and helpers). The experts run in our default ``"grouped"`` implementation against
transformers' default ``grouped_mm``.

Vocabulary 64 and ``initializer_range`` 0.3: the logits spread over about +-7, so that greedy's top
two are never a near tie decided by float32 noise (asserted at each compared step), and the router's
logits over about +-5, so that a token's k-th and (k+1)-th experts are not a near tie either (a routing
flip would show as a jump in the log-probabilities, far above the tolerance). At 0.5 the tokens are the
same too, but transformers' own float32 logits are then 1.2e-4 from its float64 ones on Qwen2-MoE,
beyond ``test_generate_hf``'s tolerance (1e-5 of the logits' scale) for both frameworks alike.
"""

import numpy as np
import pytest
import torch

from flax_transformer.interop import hf

from .test_generate_hf import NEW, PAD, _assert_same_steps, _ours, _transformers_greedy

transformers = pytest.importorskip("transformers")

VOCAB = 64
LENGTHS = [9, 4, 6]
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=PAD, initializer_range=0.3)
KINDS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=40, moe_intermediate_size=24, num_experts=6,
                                         num_experts_per_tok=3, shared_expert_intermediate_size=20,
                                         mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=40, moe_intermediate_size=24, num_experts=5,
                                         num_experts_per_tok=2, norm_topk_prob=True, head_dim=12)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2, clip_qkv=3.0)),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch on one thread: on these 32-wide models a second thread only adds its handoffs (test_llama_generate)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(KINDS))
def family(request, tmp_path_factory):
    """(kind, transformers model, our model read from the folder transformers saved)."""
    config_class, switches = KINDS[request.param]
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_class)(**BASE, **switches)).eval()
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    assert reference.config._experts_implementation == "grouped_mm"  # transformers' default, on CPU too
    model = hf.from_pretrained(folder)
    assert model.config.moe is not None and model.config.model_type == request.param
    return request.param, reference, model


def _prompts(n_rows):
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB, size=n) for n in LENGTHS[:n_rows]]  # no pad, bos or eos inside


@pytest.mark.parametrize("n_rows", [1, 3], ids=["batch1", "ragged"])
@pytest.mark.keep_cases("qwen2_moe-ragged", reason="the kept case covers the others: Qwen2-MoE's ragged batch "
                        "(a shared expert, a dense layer, biases, padding)")
def test_greedy_moe_equals_transformers_token_for_token(family, n_rows):
    """64 new tokens per row: transformers' tokens, log-probabilities within 1e-5 of the logits' scale,
    the top two apart by more than twice that at every step."""
    kind, reference, model = family
    prompts = _prompts(n_rows)
    theirs, their_logits = _transformers_greedy(reference, prompts)
    ours, our_logits = _ours(model, prompts)
    assert ours.shape == theirs.shape == (n_rows, NEW)
    _assert_same_steps(ours, theirs, our_logits, their_logits, [NEW] * n_rows)
    assert len(set(ours[0])) > 10, f"{kind}: one token repeated, the steps test little"
