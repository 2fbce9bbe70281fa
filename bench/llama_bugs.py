"""Issue 24 item 6's porting bugs, each planted in a tiny Flax llama: what ``bisect.bisect`` says.

    python bench/llama_bugs.py [--png docs/images/bisect_positions.png]
    python bench/llama_bugs.py --tests gemma_gpt_oss    # issue 34's: Gemma 2, Gemma 3 and GPT-OSS
    python bench/llama_bugs.py --tests deepseek         # issue 35's: DeepSeek-V3

The bugs, models and inputs are ``parity_tests/verification/test_llama_bisect.py``'s (``BUGS``, ``run``: the
test asserts these verdicts). Prints a Markdown table: each bug, the module ``bisect`` names
(JAX's error there over its budget), the first wrong gradient, and where the error starts
(``report.positions``: the first position whose JAX error leaves the budget) in that module and
in the model's output. ``--png`` draws the error per position of the two bugs that depend on
position, a sliding window one too wide and llama3 RoPE scaling ignored: JAX and torch fp32
against float64, for the module named and for the model's output, with their budgets.
About 40 s on one core. ``--tests gemma_gpt_oss`` takes the bugs of
``parity_tests/verification/test_gemma_gpt_oss_bisect.py`` instead (about 3 minutes), ``--tests deepseek``
those of ``parity_tests/verification/test_deepseek_bisect.py`` (all with gradients; about 2 minutes). A module
with no positions of its own (a router or experts, which see the tokens flattened) has no onset: "-". After
DeepSeek-V3's table, the tokens each routing bug sends to other experts (float64 torch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", metavar="OUT", help="also draw the error per position of window+1 and rope-scaling")
    parser.add_argument("--tests", choices=("llama", "gemma_gpt_oss", "deepseek"), default="llama",
                        help="whose planted bugs: test_llama_bisect's, test_gemma_gpt_oss_bisect's or "
                             "test_deepseek_bisect's")
    args = parser.parse_args()
    if args.png and args.tests != "llama":
        parser.error("--png draws test_llama_bisect's bugs")

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run
    import importlib

    bugs = importlib.import_module(f"parity_tests.verification.test_{args.tests}_bisect")

    print("| bug | module named | JAX / budget there | first wrong gradient | error starts at (module; model output) |")
    print("|---|---|---|---|---|")
    reports = {}
    for name, bug in bugs.BUGS.items():
        report = reports[name] = bugs.run(name)
        path = "" if report.first_divergent == "<model>" else report.first_divergent  # the model's own row
        row = next(r for r in report.rows if r.path == path)
        out = report.positions.get("")
        onset = report.onset(path)
        starts = f"{'-' if onset is None else onset}; {None if out is None else out.onset}"
        print(f"| {bug.what} | `{report.first_divergent}` ({row.status}) | {row.jax_err / row.budget:.2g} | "
              f"{'`' + report.first_divergent_grad + '`' if report.first_divergent_grad else '(forward only)'} | "
              f"{starts} |")
    for name, bug in bugs.BUGS.items():  # DeepSeek-V3's routing bugs: which tokens they send to other experts
        if getattr(bug, "rerouted", None) is not None:
            changed = bugs.rerouted(bugs.pair()[0], (bugs.IDS,), **bug.rerouted)  # (rows, positions)
            print(f"{name}: {changed.sum()} of {changed.size} tokens choose other experts, at positions "
                  f"{sorted(set(changed.nonzero()[1].tolist()))}")
    if args.png:
        _draw(reports, bugs, args.png)
        print(f"wrote {args.png}")
    return 0


def _draw(reports, bugs, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    floor = 1e-9  # exact zeros drawn here (a log scale has no zero)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, name in zip(axes, ("window+1", "rope-scaling")):
        report, bug = reports[name], bugs.BUGS[name]
        for row, label, color in ((bug.named, bug.named.replace("model.layers.", "layers."), "C3"),
                                  ("", "model output (logits)", "C0")):
            found = report.positions[row]
            x = np.arange(len(found.jax))
            ax.plot(x, np.maximum(found.jax, floor), "o-", color=color, label=f"JAX: {label}")
            ax.plot(x, np.maximum(found.torch, floor), "x:", color=color, alpha=0.6, label=f"torch fp32: {label}")
            ax.axhline(found.budget, color=color, ls="--", lw=0.8, label=f"budget: {label}")
            if found.onset is not None:
                ax.axvline(found.onset, color=color, lw=0.6, alpha=0.5)
        ax.set_yscale("log")
        ax.set_ylabel("max |x - float64| at the position")
        positions = np.arange(bugs.T) if bug.position_ids is None else bug.position_ids[0]
        ax.set_xticks(np.arange(bugs.T), [str(p) for p in positions], rotation=45 if positions.max() > 99 else 0)
        ax.set_xlabel("position" + ("" if bug.position_ids is None else " id (the input's position_ids)"))
        ax.set_title(bug.what, fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("bisect: error against position (vertical lines: where JAX leaves the budget)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
