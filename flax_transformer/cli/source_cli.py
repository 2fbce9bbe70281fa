"""``flax-transformer verify --checkpoint CONVERTED --source ORIGINAL [--pair MODULE:FACTORY] [--bisect]``.

Is this conversion right? CONVERTED (made by any tool) checked against ORIGINAL, each read by its
own reader (``verification.source_check``): the report, and exit 1 when the logits or the tensors
differ, naming the tensors; ``--json OUT`` writes the report as JSON.
"""

from __future__ import annotations

import time

from flax_transformer.cli.bisect_cli import load_model

# what `verify --checkpoint PATH` says when PATH has no certificate: its table does not cover the conversion
NO_CERTIFICATE = ("no certificate found and no --source: this checks that the checkpoint loads and that the "
                  "frameworks agree on it, not that the conversion is right; give --source ORIGINAL")


def run(args, start: float | None = None) -> int:
    from flax_transformer.interop import files
    from flax_transformer.verification import source_check

    start = time.perf_counter() if start is None else start
    if args.json:
        files.check_target(args.json, kind="file", overwrite=args.overwrite)  # before any computation
    report = source_check.check(args.checkpoint, args.source, load=load_model, pair=args.pair, seed=args.seed,
                                bisect=args.bisect, use_jit=not args.no_jit)
    print(f"{report}\n({time.perf_counter() - start:.1f} s)")
    if args.json:
        report.to_json(args.json, overwrite=args.overwrite)
        print(f"wrote {args.json}")
    return 0 if report.passed else 1
