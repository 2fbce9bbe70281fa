"""The precision advisor (``verification/advisor.py``) on the llama family and GPT-2: which modules a
bf16 model keeps in float32 to meet a target, against every norm and attention in float32 and all bf16.

    python bench/precision_advisor.py [--target kl=1e-3] [--model llama|qwen3|gemma|gpt2 ...]

Models: ``torch_reference`` twins with tiny-but-real shapes (4 layers, width 64, 4 query heads on 2
key/value heads of 16, vocabulary 256; GPT-2: 4 blocks, width 64, 4 heads), random weights perturbed
(``verify.perturb_torch``) and given a trained-looking scale (``test_advisor.trained_looking``: the query
and key projections times 3, so that attention is sharp as in a trained model, and an untied LM head
times 4, so that logits spread; GPT-2's head is the tied embedding and keeps its scale). Not trained
weights: at plain random init bf16's error is spread over every module evenly and there is little to
advise. Their Flax ports compute in bf16 with float32 parameters. Inputs: 2 rows of 32 random ids;
the advised set is then measured on a held-out batch (2 other rows) too, so that a set fitted to the
roundings of one batch shows. One Markdown table; about 5 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
FAMILY = {"llama": {}, "qwen3": dict(qk_norm=True, model_type="qwen3"),
          "gemma": dict(norm_plus_one=True, embed_scale=64 ** 0.5, hidden_act="gelu_pytorch_tanh",
                        tie_word_embeddings=True, model_type="gemma")}


def pair(name: str):
    import jax.numpy as jnp
    import torch

    import torch_reference.gpt as tg
    import torch_reference.llama as tl
    from flax_transformer.interop import porting
    from flax_transformer.models.configs import GPTConfig
    from flax_transformer.models.llama_config import LlamaConfig
    from flax_transformer.verification import verify
    from parity_tests.verification.test_advisor import trained_looking

    torch.manual_seed(0)
    if name == "gpt2":
        torch_model = tg.GPT2LMHeadModel(GPTConfig(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4))
    else:
        torch_model = tl.LlamaForCausalLM(LlamaConfig(**{**SHAPE, **FAMILY[name]}))
    verify.perturb_torch(torch_model.eval(), 0)
    trained_looking(torch_model)
    return torch_model, porting.torch_to_flax(torch_model, dtype=jnp.bfloat16)


def held_out(torch_model, flax_model, modules, ids, target) -> float:
    """The target's metric with ``modules`` in float32 on other ids (``advisor.measure_set``)."""
    from flax_transformer.verification import advisor

    return target.metric(advisor.measure_set(torch_model, flax_model, (ids,), modules=modules, target=target))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="kl=1e-3", help="advise_precision's target (default kl=1e-3)")
    parser.add_argument("--model", action="append", choices=["llama", "qwen3", "gemma", "gpt2"])
    options = parser.parse_args()
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    from flax_transformer.verification import advisor

    target = advisor.Target.parse(options.target)
    rng = np.random.default_rng(0)
    ids, other = rng.integers(0, 256, (2, 32)), rng.integers(0, 256, (2, 32))
    print(f"target: {target.kind} ({target.describe()}); metric on the advisor's batch / on a held-out batch\n")
    print("| model | all bf16 | every norm and attention in fp32 | advised | advised set (by) | "
          "candidates, sets tried, s |")
    print("|---|---|---|---|---|---|")
    sets = []
    for name in options.model or ["llama", "qwen3", "gemma", "gpt2"]:
        torch_model, flax_model = pair(name)
        start = time.perf_counter()
        report = advisor.advise_precision(torch_model, flax_model, (ids,), target=target)
        seconds = time.perf_counter() - start
        cells = []
        for trial in (report.all_bf16, report.norms_and_softmax, report.advised):
            again = held_out(torch_model, flax_model, trial.modules, other, target)
            cells.append(f"{len(trial.modules)}: {target.metric(trial.metric):.2e} / {again:.2e} "
                         f"({'meets' if trial.met else 'misses'})")
        kinds = {c.path: c.kind for c in report.candidates}
        counted = {k: sum(kinds.get(p) == k for p in report.modules) for k in dict.fromkeys(map(kinds.get,
                                                                                               report.modules))}
        members = ", ".join(f"{k.split(':')[1]} x{n}" if n > 1 else k.split(":")[1] for k, n in counted.items())
        print(f"| {name} | {' | '.join(cells)} | {members or '(none)'} (by {report.search}) | "
              f"{len(report.candidates)}, {len(report.trials)}, {seconds:.0f} |")
        sets.append(f"{name}: " + (", ".join(p or "<model>" for p in report.modules) or "(none)"))
    print("\nadvised sets:\n" + "\n".join(sets))


if __name__ == "__main__":
    main()
