"""How long the README's two commands take, measured as a user runs them, and recorded where the docs quote it.

    python bench/verify_time.py            # runs `flax-transformer verify`, records it in bench/timings.json
    python bench/verify_time.py --tests    # runs the default test run (`python -m pytest parity_tests -q -n 2`)
    python bench/verify_time.py --show     # the recorded figures, as README.md states them

Each command runs in a subprocess, as typed, from the repository root; its wall time, its CPU time
(user + system of every process it started) and its counts are recorded with the machine's cores
and the load average when it started, because on shared cores the wall time stretches with the
load while the CPU time barely moves. ``verify`` also gives each family's rows and seconds, read
from the line per family it writes to stderr when stderr is not a terminal. README.md quotes
``stated(record)`` word for word, and ``parity_tests/project/test_doc_figures.py`` checks that it
still does: re-run this script after a change that moves the figures, then paste ``--show``'s line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "bench" / "timings.json"
COMMANDS = {  # what README.md's two commands run, after the set-up
    "verify": ["flax-transformer", "verify"],
    "tests": [sys.executable, "-m", "pytest", "parity_tests", "-q", "-n", "2"],
}
FAMILY_LINE = re.compile(r"^verify: (?P<family>\w+): (?P<rows>\d+) rows, (?P<passed>\d+) passed \((?P<s>[\d.]+) s\)$")


def stated(name: str, record: dict) -> str:
    """The sentence README.md states for a record (the test checks it is there, word for word)."""
    where = f"{record['cores']} cores, load average {record['load']:.1f} at its start"
    if name == "verify":
        return (f"{record['rows']} rows, {record['passed']} passed in {record['wall_s']:.0f} s "
                f"({record['cpu_s']:.0f} CPU s; {where})")
    return (f"{record['passed']} passed, {record['failed']} failed in {record['wall_s']:.0f} s "
            f"({record['cpu_s'] / 60:.1f} CPU minutes; {where})")


def measure(name: str) -> dict:
    """Run the command, as typed, and return its record."""
    command = COMMANDS[name]
    load, before = os.getloadavg()[0], resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    record = {"command": " ".join(["python" if c == sys.executable else c for c in command]),
              "date": time.strftime("%Y-%m-%d"), "exit": done.returncode, "wall_s": round(wall, 1),
              "cpu_s": round(cpu, 1), "cores": os.cpu_count(), "load": round(load, 2)}
    if name == "verify":
        counts = re.search(r"^(\d+) passed, (\d+) failed", done.stdout, re.M)
        if counts is None:
            raise SystemExit(f"`{record['command']}` printed no count (exit {done.returncode}):\n{done.stderr[-2000:]}")
        passed, failed = map(int, counts.groups())
        families = {}  # a family's rows may come in more than one run (the table's order): summed
        for match in filter(None, map(FAMILY_LINE.match, done.stderr.splitlines())):
            figures = families.setdefault(match["family"], {"rows": 0, "s": 0.0})
            figures["rows"], figures["s"] = figures["rows"] + int(match["rows"]), round(figures["s"] + float(match["s"]), 1)
        record |= {"rows": passed + failed, "passed": passed, "failed": failed, "families": families}
    else:
        last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}
        if "passed" not in counts:
            raise SystemExit(f"`{record['command']}` printed no count (exit {done.returncode}): {last!r}")
        record |= {"passed": counts["passed"], "failed": counts.get("failed", 0) + counts.get("error", 0)
                   + counts.get("errors", 0), "skipped": counts.get("skipped", 0)}
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", action="store_true", help="measure the default test run instead of verify")
    parser.add_argument("--show", action="store_true", help="print the recorded figures, measure nothing")
    args = parser.parse_args(argv)
    records = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    if not args.show:
        name = "tests" if args.tests else "verify"
        records[name] = measure(name)
        RECORD.write_text(json.dumps(records, indent=1) + "\n")
        for family, figures in records[name].get("families", {}).items():
            print(f"  {family:<8} {figures['rows']:>4} rows {figures['s']:>7.1f} s")
    for name, record in records.items():
        print(f"{record['command']}: {stated(name, record)}")


if __name__ == "__main__":
    main()
