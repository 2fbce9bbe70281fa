"""``flax-transformer verify --train-steps K [--through-torch-state]``: training runs in torch and in JAX.

Each family's full model trains K steps in both frameworks from the same weights on the same
batches, with Adam and with AdamW; the loss curves are printed side by side, then a count of the
runs that passed and failed, as the table's last line counts its rows.
"""

from __future__ import annotations

import time


def run(args, start: float) -> int:
    """``verify --train-steps K``: K optimizer steps in torch and in JAX, losses side by side. With
    ``--through-torch-state``: K steps, a torch training checkpoint, K steps in the other framework,
    against 2K uninterrupted, both ways."""
    from flax_transformer.training import parity
    from flax_transformer.verification import reports

    if args.through_torch_state:
        from flax_transformer.training.torch_state import continuity

        def results(family, optimizer):
            return continuity.continuity(family, steps=args.train_steps, optimizer=optimizer, seed=args.seed)

        show, rule = continuity.format_continuity, "1e-05 on losses and relative on parameters, 1e-04 relative on " \
                                                   "Adam moments"
    else:
        def results(family, optimizer):
            return [parity.trajectory(family, steps=args.train_steps, optimizer=optimizer, seed=args.seed)]

        show, rule = parity.format_trajectory, f"tolerance {reports.TOLERANCE:g} on losses and relative on parameters"
    failed = runs = 0
    for family in args.family or parity.MODELS:
        for optimizer in ("adam", "adamw"):
            for result in results(family, optimizer):
                failed, runs = failed + (not result.passed), runs + 1
                print(show(result))
                print(f"  -> {'pass' if result.passed else 'FAIL'} (largest loss difference {result.loss_err:.1e})\n")
    print(f"{runs - failed} passed, {failed} failed ({rule}, {time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0
