"""The ``flax-transformer`` command.

    flax-transformer verify     port every module of every family torch <-> Flax and
                                print the max abs error per module (exit 1 on failure)
"""

from __future__ import annotations

import argparse
import sys
import time


def _verify(args) -> int:
    import jax

    # fp32 parity needs full-precision matmuls (TPU/GPU default to bf16 passes)
    jax.config.update("jax_default_matmul_precision", "highest")
    from . import verify

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    start = time.perf_counter()
    rows = []
    progress = tqdm(desc="verifying", unit="check", leave=False, disable=not sys.stderr.isatty()) if tqdm else None
    for row in verify.run(seed=args.seed, use_jit=not args.no_jit):
        rows.append(row)
        if progress is not None:
            progress.update()
    if progress is not None:
        progress.close()
    print(verify.format_table(rows))
    failed = [r for r in rows if not r.passed]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed "
          f"(tolerance {verify.TOLERANCE:g}, {time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flax-transformer", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("verify", help="torch vs Flax parity table for every module of every family")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-jit", action="store_true", help="run the Flax side eagerly instead of under jit")
    p.set_defaults(func=_verify)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
