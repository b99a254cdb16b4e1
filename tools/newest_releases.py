"""Would pairsim pass with the newest releases of what it bounds? Install them and see.

pyproject.toml bounds the releases pairsim is tested with (``ray>=2.60,<2.61``, ...) and
``constraints.txt`` pins the exact versions the suite last passed with. This script:

1. makes a scratch venv (``--venv``, or a temporary one) and installs pairsim into it editable,
   from a snapshot of the commit (``git archive HEAD``; ``--worktree`` for the checkout as it is),
   with ``--no-deps``, then pyproject's requirements (dependencies and the ``dev`` extra) with
   every upper bound lifted and without the constraints: pip picks the newest release of each;
2. records, for each bounded distribution, the version ``constraints.txt`` pins, the newest
   release on the index (``pip index versions``) and the one pip picked;
3. runs the quick subset (``pytest -m "not slow"``) and the slow tests of the compatibility
   files (``tests/test_compat.py``, ``tests/test_architecture.py``, ``tests/test_doctor.py``,
   those that exist) in that venv (``--skip-tests``: versions only);
4. prints a Markdown table and writes the JSON results file (``--out``; by default
   ``docs/results/newest_releases_<commit>.json``): per bounded distribution "bound can move to
   X" when the tests passed with a release above the bound, "keep the bound: <failing tests>"
   when they did not.

All bounds are lifted together, so a failure is not attributed to one distribution: move a
bound by hand, rerun, and see. pip's own configuration (a machine's ``constraint =`` in
pip.conf, say) still applies unless ``--ignore-pip-config``; where pip picked a release below
the newest, the table says why (pip's error when asked for the newest alone).

``--freeze`` instead rewrites ``constraints.txt`` from the venv running this script (``pip
freeze``): do it in a venv that has just passed the test command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints.txt"
COMPAT_TESTS = ("tests/test_compat.py", "tests/test_architecture.py", "tests/test_doctor.py")
UPPER = {"<", "<=", "==", "~=", "==="}  # operators that cap a release from above


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """pyproject's dependencies and its ``dev`` extra, as parsed requirements."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


def bounded(reqs: list[Requirement]) -> dict[str, SpecifierSet]:
    """Each distribution with an upper bound, by normalised name: its whole specifier."""
    out: dict[str, SpecifierSet] = {}
    for req in reqs:
        if any(spec.operator in UPPER for spec in req.specifier):
            name = canonicalize_name(req.name)
            out[name] = out.get(name, SpecifierSet()) & req.specifier
    return out


def lifted(req: Requirement) -> str:
    """The requirement with its upper bounds removed (``ray[data]>=2.60,<2.61`` -> ``ray[data]>=2.60``)."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    specs = ",".join(str(s) for s in req.specifier if s.operator not in UPPER)
    marker = f"; {req.marker}" if req.marker else ""
    return f"{req.name}{extras}{specs}{marker}"


def read_constraints(path: Path = CONSTRAINTS) -> dict[str, str]:
    """``constraints.txt`` as {normalised name: pinned version}."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name.split("[")[0])] = version.split(";")[0].strip()
    return pins


def freeze(path: Path = CONSTRAINTS) -> None:
    """Rewrite ``constraints.txt`` from this interpreter's venv: ``pip freeze`` less pairsim and pip
    itself (setuptools stays: a dependency needs it at run time, and plain ``pip freeze`` omits it)."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    pins = sorted((line for line in frozen if "==" in line and not line.startswith("-e") and " @ " not in line
                   and canonicalize_name(line.split("==")[0]) not in ("pairsim", "pip")),
                  key=lambda line: canonicalize_name(line.split("==")[0]))
    short = _git("rev-parse", "--short", "HEAD") or "unknown"
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    header = [
        "# The exact version of every distribution in the venv the test suite last passed in",
        f"# (linux x86_64, CPython {sys.version_info.major}.{sys.version_info.minor}): the README's commands install with",
        '# `pip install -c constraints.txt -e ".[dev]"`, so a new machine gets what was tested.',
        "# pyproject.toml's ranges say what pairsim accepts; this file says what was tested.",
        f"# Last known to pass the suite: commit {short}, {date}.",
        "# Regenerate it, in a venv that has just passed the test command: python tools/newest_releases.py --freeze",
        "# (tools/newest_releases.py also tries the newest releases past pyproject's bounds; docs/reliability.md).",
    ]
    path.write_text("\n".join(header + pins) + "\n")
    print(f"written: {path} ({len(pins)} pins, commit {short})")


def newest_release(python: Path, name: str, env: dict[str, str]) -> str | None:
    """The newest final release of ``name`` on the index (``pip index versions``), or None."""
    done = subprocess.run([str(python), "-m", "pip", "index", "versions", name], capture_output=True, text=True,
                          env=env)
    match = re.search(r"^Available versions: (.*)$", done.stdout, re.M)
    if not match:
        return None
    versions = []
    for text in match.group(1).split(","):
        try:
            version = Version(text.strip())
        except InvalidVersion:
            continue
        if not version.is_prerelease and not version.local:
            versions.append(version)
    return str(max(versions)) if versions else None


def why_not(python: Path, name: str, version: str, env: dict[str, str]) -> str:
    """Why pip did not pick ``name==version``: the last error of a dry-run install of it."""
    done = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--quiet", f"{name}=={version}"],
                          capture_output=True, text=True, env=env)
    errors = [line.removeprefix("ERROR: ") for line in done.stderr.splitlines() if line.startswith("ERROR:")]
    if done.returncode == 0:
        return "pip installs it alone: another requirement held it back"
    return errors[-1] if errors else f"pip exit {done.returncode}"


def run(cmd: list[str], env: dict[str, str], cwd: Path = REPO) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, cwd=cwd, check=True)


def pytest(python: Path, src: Path, args: list[str], junit: Path, env: dict[str, str]) -> dict:
    """One pytest run in the scratch venv: exit code, counts and the failing test ids (from JUnit XML)."""
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    print("+ " + " ".join(cmd), flush=True)
    started = time.perf_counter()
    code = subprocess.run(cmd, cwd=src, env=env).returncode
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            counts[{"failure": "failed", "error": "errors"}.get(outcome, outcome)] += 1
            if outcome in ("failure", "error"):
                failing.append(f"{case.get('classname')}::{case.get('name')}")
    return {"args": args, "exit_code": code, "seconds": round(time.perf_counter() - started), **counts,
            "failing": failing, "passed_all": code in (0, 5) and not failing}


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"*`{result['command']}` — commit `{env['commit']}`, {env['date']}, {result['seconds']:.0f} s; "
             f"Python {env['python']}.*", "",
             "| distribution | pyproject | constraints.txt | newest release | pip picked | verdict |",
             "|---|---|---|---|---|---|"]
    for row in result["packages"]:
        lines.append(f"| {row['name']} | `{row['specifier']}` | {row['pinned'] or '–'} | {row['newest'] or '–'} | "
                     f"{row['picked'] or '–'} | {row['verdict']} |")
    lines.append("")
    for test in result["tests"]:
        lines.append(f"- `pytest {shlex.join(test['args'])}`: {test['passed']} passed, {test['failed']} failed, "
                     f"{test['errors']} errors, {test['skipped']} skipped in {test['seconds']} s"
                     + (f"; failing: {', '.join(test['failing'])}" if test["failing"] else ""))
    if not result["tests"]:
        lines.append("- tests not run (`--skip-tests`)")
    return "\n".join(lines) + "\n"


def verdict(row: dict, spec: SpecifierSet, tests: list[dict]) -> str:
    """What the run says of one bound: move it, keep it, or nothing past it to try."""
    picked, newest, pinned = row["picked"], row["newest"], row["pinned"]
    if picked is None:
        return "not installed"
    if spec.contains(picked, prereleases=True):
        if newest and not spec.contains(newest, prereleases=True):
            return f"untested: {newest} is past the bound, but pip installed {picked} ({row.get('why_not_newest')})"
        newer = [v for v in (newest, picked) if v and pinned and Version(v) > Version(pinned)]
        return "no release past the bound" + (f"; constraints.txt could move from {pinned} to {newer[0]}" if newer
                                               else "")
    held = f" (not the newest, {newest}: {row.get('why_not_newest')})" if newest and \
        Version(picked) < Version(newest) else ""
    if not tests:
        return f"{picked} is past the bound: not tested (--skip-tests){held}"
    failing = [t for test in tests for t in test["failing"]] or \
        [f"pytest exit {test['exit_code']}" for test in tests if not test["passed_all"]]
    if failing:
        shown = ", ".join(failing[:8]) + (f" and {len(failing) - 8} more" if len(failing) > 8 else "")
        return f"keep the bound: {shown}{held}"
    return f"bound can move to {picked}{held}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, help="the scratch venv (made if missing; default: a temporary one, removed)")
    parser.add_argument("--out", type=Path, help="the JSON results file (default docs/results/newest_releases_<commit>.json)")
    parser.add_argument("--skip-tests", action="store_true", help="install and compare versions only")
    parser.add_argument("--worktree", action="store_true",
                        help="test the checkout as it is, not a snapshot of its HEAD commit")
    parser.add_argument("--ignore-pip-config", action="store_true",
                        help="install without pip's configuration files (PIP_CONFIG_FILE=/dev/null): a machine's "
                             "pip.conf constraint would otherwise hold releases back")
    parser.add_argument("--freeze", action="store_true",
                        help="rewrite constraints.txt from the venv running this script, and stop")
    args = parser.parse_args()
    if args.freeze:
        freeze()
        return

    started = time.perf_counter()
    short = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", "platform", "tests", "pyproject.toml"))
    commit = short + ("+dirty" if args.worktree and dirty else "")
    out = args.out or REPO / "docs" / "results" / f"newest_releases_{short}.json"
    temporary = args.venv is None
    venv = args.venv or Path(tempfile.mkdtemp(prefix="pairsim-newest-")) / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PIP_CONSTRAINT")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if args.ignore_pip_config:
        env["PIP_CONFIG_FILE"] = os.devnull
    python = venv / "bin" / "python"

    reqs = requirements()
    bounds = bounded(reqs)
    pins = read_constraints()
    try:
        if not python.exists():
            run([sys.executable, "-m", "venv", str(venv)], env)
        src = REPO
        if not args.worktree and short != "unknown":
            src = venv.parent / f"{venv.name}-src"
            shutil.rmtree(src, ignore_errors=True)
            src.mkdir(parents=True)
            archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        run([str(python), "-m", "pip", "install", "--no-deps", "-e", str(src)], env)
        run([str(python), "-m", "pip", "install", *(lifted(r) for r in reqs)], env)
        installed = {canonicalize_name(d["name"]): d["version"] for d in json.loads(subprocess.run(
            [str(python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True, env=env,
            check=True).stdout)}

        tests: list[dict] = []
        if not args.skip_tests:
            junit = Path(tempfile.mkdtemp(prefix="pairsim-newest-junit-"))
            tests.append(pytest(python, src, ["-m", "not slow"], junit / "quick.xml", env))
            compat = [path for path in COMPAT_TESTS if (src / path).exists()]
            if compat:
                tests.append(pytest(python, src, ["-m", "slow", *compat], junit / "compat.xml", env))

        rows = []
        for name, spec in sorted(bounds.items()):
            row = {"name": name, "specifier": str(spec), "pinned": pins.get(name),
                   "newest": newest_release(python, name, env), "picked": installed.get(name)}
            if row["picked"] and row["newest"] and Version(row["picked"]) < Version(row["newest"]):
                row["why_not_newest"] = why_not(python, name, row["newest"], env)
            row["verdict"] = verdict(row, spec, tests)
            rows.append(row)
    finally:
        if temporary:
            shutil.rmtree(venv.parent, ignore_errors=True)

    command = " ".join(["python", "tools/newest_releases.py", *sys.argv[1:]])
    result = {
        "benchmark": "newest_releases",
        "command": command,
        "seconds": round(time.perf_counter() - started),
        "environment": {"commit": commit, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                        "machine": {"cores": os.cpu_count()}, "python": sys.version.split()[0],
                        "packages": {row["name"]: row["picked"] for row in rows}},
        "packages": rows,
        "tests": tests,
        "all_installed": installed,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n" + markdown(result) + f"\nwritten: {out}", flush=True)


if __name__ == "__main__":
    main()
