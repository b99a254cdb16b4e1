"""Where every benchmark's figures go: a results file per benchmark, JSON and Markdown.

Each benchmark builds its tables as :class:`Table` objects and hands them to :func:`publish`,
which prints them and writes ``<dir>/<name>.json`` (the tables' values, the command line, the
commit, date, machine and package versions) and ``<dir>/<name>.md`` (:func:`render` of that
JSON: what the docs include, so a documented table is the file's, never a copy). The default
directory is ``benchmarks/results/``; ``bench_all.py`` runs every benchmark into one directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as stdlib_platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / "benchmarks" / "results"
PACKAGES = ("torch", "ray", "deepspeed", "open_clip_torch", "open_clip_train", "mlflow", "pyarrow", "faiss-cpu")


@dataclass
class Table:
    """One table: a title, column names, rows of values (numbers or text; None prints "–") and
    each column's format (``".1f"``, ``","``, ``".2f"``; ``""`` for text)."""

    title: str
    columns: list[str]
    formats: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"{self.title}: a row of {len(values)} values for {len(self.columns)} columns")
        self.rows.append(list(values))


def add_results_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=DEFAULT_DIR,
                        help=f"where the JSON and Markdown results go (default {DEFAULT_DIR.relative_to(REPO)})")


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    except OSError:  # no git on this machine
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def commit() -> str:
    """The checkout's short commit, ``+dirty`` when ``platform/`` or ``benchmarks/`` differ from it
    (``benchmarks/results/`` aside: what an earlier run wrote there changes no measurement);
    ``BENCH_COMMIT`` when set (by whoever sent the tree: the GPU machine's copy of .git is stale)."""
    if named := os.environ.get("BENCH_COMMIT"):
        return named
    short = _git("rev-parse", "--short", "HEAD") or "unknown"
    return short + "+dirty" if _git("status", "--porcelain", "--untracked-files=no", "--", "platform", "benchmarks",
                                 ":!benchmarks/results") \
        else short


def environment() -> dict[str, Any]:
    """The commit (``+dirty`` when the work tree differs; ``BENCH_COMMIT`` when set), date, machine
    and package versions."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), stdlib_platform.processor()) if Path("/proc/cpuinfo").exists() \
        else stdlib_platform.processor()
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "commit": commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cores": os.cpu_count(), "cpu": cpu, "memory_gib": _memory_gib(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "python": stdlib_platform.python_version(),
        "packages": packages,
    }


def _memory_gib() -> float | None:
    try:
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return None
    return round(kib / 2**20, 1)


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and spec:
        return format(value, spec)
    return str(value)


def render(result: dict[str, Any]) -> str:
    """The Markdown of a results file's JSON: a provenance line, then each table with its notes."""
    env = result["environment"]
    machine = env["machine"]
    hardware = f"{machine['cores']} cores ({machine['cpu']}), {machine['memory_gib']} GiB"
    hardware += f", GPU {machine['gpu']}" if machine["gpu"] else ", no GPU"
    packages = ", ".join(f"{k} {v}" for k, v in env["packages"].items())
    lines = [f"*`{result['command']}` — commit `{env['commit']}`, {env['date']}, {result['seconds']:.0f} s; "
             f"{hardware}; Python {env['python']}, {packages}.*", ""]
    for table in result["tables"]:
        lines += [f"**{table['title']}**", "", render_table(table), ""]
        lines += [f"{note}" for note in table["notes"]] + ([""] if table["notes"] else [])
    return "\n".join(lines).rstrip() + "\n"


def render_table(table: dict[str, Any]) -> str:
    """One table of a results file's JSON as a Markdown table (no title, no notes)."""
    lines = ["| " + " | ".join(table["columns"]) + " |",
             "|" + "|".join("---" if not spec else "---:" for spec in table["formats"]) + "|"]
    lines += ["| " + " | ".join(_cell(v, s) for v, s in zip(row, table["formats"])) + " |" for row in table["rows"]]
    return "\n".join(lines)


def publish(name: str, tables: list[Table], directory: Path, seconds: float, on_gpu: bool = False,
            variant: str | None = None) -> dict[str, Any]:
    """Print the tables of ``benchmarks/<name>.py`` and write ``<directory>/<name>.json`` and
    ``.md`` (``<name>_<variant>.*`` for one of the script's variants, ``<name>_gpu.*`` for a run
    on a GPU, beside the CPU's); returns the JSON."""
    command = " ".join(["python", f"benchmarks/{name}.py", *sys.argv[1:]])
    name = "_".join(filter(None, [name, variant, "gpu" if on_gpu else None]))
    result = {"benchmark": name, "command": _as_rerun(command), "seconds": seconds,
              "environment": environment(), "tables": [asdict(t) for t in tables]}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    markdown = render(result)
    (directory / f"{name}.md").write_text(markdown)
    print("\n" + markdown + f"\nwritten: {directory / name}.json, .md", flush=True)
    return result


def _as_rerun(command: str) -> str:
    """The command as a reader would re-run it: where it wrote (``--results``, ``--out``, ``--work``) left out."""
    words = command.split()
    for flag in ("--results", "--out", "--work"):
        if flag in words:
            i = words.index(flag)
            del words[i:i + 2]
    return " ".join(words)
