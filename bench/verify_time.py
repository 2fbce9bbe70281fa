"""What each family costs ``flax-transformer verify``: its rows' wall and CPU seconds, in one process.

    python bench/verify_time.py [--seed 0]

The families run in the table's order in one process, as the command runs them, so a family's
time is what it adds to the whole table: programs and array shapes compiled for an earlier
family are not compiled again. On a machine that other jobs share, wall time stretches with the
load; the shares of the total are steadier than the seconds.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="verify's --seed (default 0)")
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # as flax-transformer verify
    from flax_transformer.verification import verify

    families = list(dict.fromkeys(spec.family for spec in verify.specs()))
    results = []
    for family in families:
        wall, cpu = time.perf_counter(), time.process_time()
        rows = list(verify.run(seed=args.seed, families=(family,)))
        results.append((family, len(rows), sum(r.passed for r in rows),
                        time.perf_counter() - wall, time.process_time() - cpu))
    total_wall = sum(r[3] for r in results)
    print(f"{'family':<8} {'rows':>5} {'passed':>6} {'wall s':>8} {'cpu s':>8} {'share':>6}")
    for family, n, passed, wall, cpu in results:
        print(f"{family:<8} {n:>5} {passed:>6} {wall:>8.1f} {cpu:>8.1f} {wall / total_wall:>6.1%}")
    print(f"{'total':<8} {sum(r[1] for r in results):>5} {sum(r[2] for r in results):>6} {total_wall:>8.1f} "
          f"{sum(r[4] for r in results):>8.1f}")


if __name__ == "__main__":
    main()
