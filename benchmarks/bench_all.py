"""Every benchmark in one command: each figure the docs show, regenerated with its provenance.

    python benchmarks/bench_all.py                         # the documented sizes → benchmarks/results/
    python benchmarks/bench_all.py --quick                 # tiny sizes, minutes → bench_out/results-quick/
    python benchmarks/bench_all.py --only losses eval      # some of them

``bench_demo`` (the demo as shipped, ~9 min: the figures the README and the Quick start show)
runs at the documented sizes only, and so do the research figures, last (~2 h together):
``reproduce.py`` (the papers' table), ``unified_figure5.py`` (Figure 5 from its base),
``cusa_tradeoff.py`` (CUSA's α, β trade-off from the same base) and ``reproduce.py --setting
scratch`` (the table from a random model, ``reproduce_scratch``).

Runs each benchmark script in its own process, one after another (never two at once: they
time the machine), with the arguments of the chosen profile, each writing
``<results>/<benchmark>.json`` and ``.md`` (see ``results.py``); then ``bench_all.json`` and
``.md``: what ran, for how long, and whether it finished (with ``--only``, the other rows are
kept from the run before). The docs include the Markdown files
of ``benchmarks/results/`` as they are. Exit status 1 when any benchmark failed; the end of
each failed one's output is printed again last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import results

HERE = Path(__file__).resolve().parent

# benchmark → (arguments of the documented run, arguments of the quick run; None: not in it)
PROFILES: dict[str, tuple[list[str], list[str] | None]] = {
    "losses": (["--repeats", "11"], ["--sizes", "128", "--repeats", "2"]),  # 11: one noisy pass moves no median
    "eval": (["--sizes", "1000", "3000", "10000", "100000", "--dim", "512", "--dense-max", "3000", "--faiss",
              "--regimes", "trained", "untrained"],
             ["--sizes", "500", "--dim", "64", "--dense-max", "500", "--faiss", "--regimes", "trained", "untrained"]),
    "ingest": ([], ["--images", "256", "--repeats", "1", "--epochs", "1", "--train-images", "256", "--val-images", "64",
                "--log-every", "1"]),
    # documented: 3 runs of each tool (single runs move by about the margin to the target); quick: 20 steps, two
    # 5-step windows after the warm-up
    "train": (["--repeats", "3"], ["--images", "1280", "--synthetic"]),
    "embed": (["--images", "8192"], ["--images", "512", "--repeats", "1"]),
    "index": (["--threads", "1"], ["--quick", "--threads", "1"]),
    "startup": ([], ["--runs", "1"]),
    "tune": (["--trials", "4", "--epochs", "2", "--num-train", "500", "--num-val", "100"],
             ["--trials", "1", "--epochs", "1", "--num-train", "128", "--num-val", "32"]),
    # the fuzz suite at a long budget; not at quick sizes: the test command runs the same properties at 40 examples
    "fuzz": (["--examples", "1000"], None),
    "demo": ([], None),  # the demo as shipped (~9 min); not at quick sizes: its figures are the shipped config's
    # the research figures (~2 h together on the Xeon): the reproduction table (pretrain, image teacher, 7 objectives ×
    # 3 seeds), then the Unified paper's Figure 5 as a sweep (9 trials) and CUSA's trade-off as a multi-objective sweep
    # (16 trials) from the same base, then the from-scratch table
    "reproduce": ([], None),
    "figure5": ([], None),
    "tradeoff": ([], None),
    # the reproduction table's other setting: the presets on a randomly initialised model (~25 min)
    "scratch": (["--setting", "scratch"], None),
}
# benchmarks/<script>.py where not bench_<name>
SCRIPTS = {"reproduce": "reproduce", "figure5": "unified_figure5", "tradeoff": "cusa_tradeoff", "scratch": "reproduce"}
RESULTS_NAMES = {"scratch": "reproduce_scratch"}  # <results name>.json/.md where not the script's name
# the sweeps fine-tune the reproduction's base on its corpus, and the settings are folders side by side: one work folder
WORK = {"figure5": "reproduce", "tradeoff": "reproduce", "scratch": "reproduce"}


def script(name: str) -> str:
    return SCRIPTS.get(name, f"bench_{name}")


def results_name(name: str) -> str:
    return RESULTS_NAMES.get(name, script(name))


def run_showing(command: list[str], tail_bytes: int = 6000) -> tuple[int, str]:
    """Run `command`, passing its output (stderr included) through as it comes; (exit code, its output's end)."""
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail = b""
    while chunk := process.stdout.read1(65536):
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        tail = (tail + chunk)[-tail_bytes:]
    return process.wait(), tail.decode(errors="replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks every script end to end in minutes")
    parser.add_argument("--only", nargs="+", choices=list(PROFILES), metavar="NAME",
                        help=f"some of: {', '.join(PROFILES)}")
    parser.add_argument("--results", type=Path, help="default benchmarks/results/ (bench_out/results-quick/ with --quick)")
    parser.add_argument("--work", type=Path, default=Path("bench_out"), help="the benchmarks' data and runs")
    args = parser.parse_args()
    directory = (args.results or (Path("bench_out/results-quick") if args.quick else results.DEFAULT_DIR)).resolve()
    profile = "quick" if args.quick else "documented"
    table = results.Table(f"bench_all ({profile} sizes): each benchmark in its own process, one after another",
                          ["benchmark", "arguments", "wall s", "finished"], ["", "", ".0f", ""])
    started = time.perf_counter()
    failures: list[str] = []
    for name in args.only or PROFILES:
        extra = PROFILES[name][1 if args.quick else 0]
        if extra is None:
            continue
        command = [sys.executable, str(HERE / f"{script(name)}.py"), *extra, "--results", str(directory)]
        if name not in ("losses", "eval"):  # the others write data and runs
            command += ["--out", str((args.work / ("quick" if args.quick else "") / WORK.get(name, name)).resolve())]
        print(f"\n=== {script(name)} {' '.join(extra)}", flush=True)
        began = time.perf_counter()
        returncode, tail = run_showing(command)
        table.add(results_name(name), " ".join(extra) or "(defaults)", time.perf_counter() - began,
                  "yes" if returncode == 0 else f"no (exit {returncode})")
        if returncode:
            failures.append(f"=== {script(name)} failed (exit {returncode}); the end of its output:\n{tail}")
    ran = {row[0] for row in table.rows}
    previous = directory / "bench_all.json"
    if args.only and previous.is_file():  # the rows of the benchmarks not run this time stay as they were
        kept = [row for row in json.loads(previous.read_text())["tables"][0]["rows"] if row[0] not in ran]
        table.rows = sorted(kept + table.rows, key=lambda row: [results_name(n) for n in PROFILES].index(row[0]))
        table.notes.append(f"This run: {', '.join(sorted(ran))}; the other rows are from the run before.")
    results.publish("bench_all", [table], directory, time.perf_counter() - started)
    print("\n\n".join(failures), file=sys.stderr)  # last, where a reader of the end of the log finds them
    return 0 if all(row[-1] == "yes" for row in table.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
