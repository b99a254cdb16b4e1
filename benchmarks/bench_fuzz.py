"""The fuzz suite at a long budget: the properties of ``tests/test_fuzz*.py`` (the CLI and the
readers; the served model), each with ``--examples`` generated inputs from a fresh random seed
(the test command runs them with 40, derandomized), and what they found.

    python benchmarks/bench_fuzz.py --examples 1000

Writes ``fuzz_junit.xml`` under ``--out`` and the table of properties — examples, seconds,
outcome with the falsifying example's first line — to ``<results>/bench_fuzz.{json,md}``.
Exit status 1 when a property failed.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import results

TESTS = sorted((results.REPO / "tests").glob("test_fuzz*.py"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1000, help="generated inputs a property (default 1000)")
    parser.add_argument("--seed", type=int, help="hypothesis's seed (default: a random one, printed)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/fuzz"), help="where the JUnit report goes")
    results.add_results_argument(parser)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    args.out.mkdir(parents=True, exist_ok=True)
    report = (args.out / "fuzz_junit.xml").resolve()
    env = os.environ | {"PAIRSIM_FUZZ_EXAMPLES": str(args.examples), "PAIRSIM_FUZZ_SEED": str(seed)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", *map(str, TESTS), "-p", "no:cacheprovider", "-q",
                           f"--hypothesis-seed={seed}", f"--junitxml={report}", "-o", "addopts="],
                          cwd=results.REPO, env=env)
    table = results.Table(f"Fuzzing, {args.examples} generated inputs a property (seed {seed})",
                          ["property", "seconds", "outcome"], ["", ".1f", ""])
    for case in ElementTree.parse(report).iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        outcome = "held" if failure is None else "FAILED: " + (failure.get("message") or "").splitlines()[0][:160]
        table.add(case.get("name").removeprefix("test_").replace("_", " "), float(case.get("time")), outcome)
    table.notes.append("Each property's invariants: its file's docstring (tests/test_fuzz*.py); what earlier runs "
                       "found: docs/reliability.md.")
    results.publish("bench_fuzz", [table], args.results, time.perf_counter() - started)
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
