"""The tested versions hold together: ``constraints.txt`` pins every distribution pyproject names,
each inside pyproject's range; the README's commands install with it; the bounds on the
distributions whose internals pairsim touches are the ones ``pairsim.compat`` says were tested;
and ``tools/newest_releases.py`` lifts exactly those bounds. No network, no install."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("newest_releases", REPO / "tools" / "newest_releases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = load_tool()


def test_constraints_pin_every_distribution_pyproject_names_inside_its_range():
    pins = tool.read_constraints(REPO / "constraints.txt")
    reqs = tool.requirements(REPO / "pyproject.toml")
    assert len(reqs) > 25
    missing = [r.name for r in reqs if canonicalize_name(r.name) not in pins]
    outside = [(str(r), pins[canonicalize_name(r.name)]) for r in reqs if canonicalize_name(r.name) in pins
               and not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)]
    assert missing == [] and outside == []


def test_constraints_are_exact_pins_without_pairsim_itself():
    lines = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert len(lines) > 100
    assert [line for line in lines if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", line)] == []
    names = [canonicalize_name(line.split("==")[0]) for line in lines]
    assert "pairsim" not in names and "pip" not in names and len(names) == len(set(names))
    assert "setuptools" in names  # plain `pip freeze` leaves it out; a dependency needs it at run time


def test_the_readme_commands_install_with_the_constraints():
    readme = (REPO / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv")]
    assert len(commands) == 2
    assert "pip install -c constraints.txt -e . && pairsim demo" in commands[0]
    assert 'pip install -c constraints.txt -e ".[dev]" && pytest' in commands[1]
    after_marker = readme.split("<!-- test-command -->", 1)[1].lstrip().splitlines()
    assert after_marker[0].startswith("```") and after_marker[1] == commands[1]  # what .ci/run reads


# The distributions whose private internals pairsim touches, bounded to the minor tested; the
# same ranges as pairsim.compat's TESTED.
INTERNALS = {"ray": ">=2.60,<2.61", "deepspeed": ">=0.19,<0.20", "mlflow": ">=3.13,<3.18"}


def test_pyproject_bounds_the_distributions_whose_internals_pairsim_touches():
    bounds = tool.bounded(tool.requirements(REPO / "pyproject.toml"))
    for name, spec in INTERNALS.items():
        assert bounds[name] == SpecifierSet(spec), name
    assert {"torch", "torchvision", "open-clip-torch"} <= set(bounds)


def test_each_compat_tested_range_is_pyprojects_bound():
    compat = pytest.importorskip("pairsim.compat")
    ranges = getattr(compat, "TESTED_RANGES", None)
    if ranges is None:
        ranges = [importlib.import_module(f"pairsim.compat.{name}").TESTED for name in INTERNALS]
    ranges = list(ranges.values()) if isinstance(ranges, dict) else list(ranges)
    bounds = tool.bounded(tool.requirements(REPO / "pyproject.toml"))
    tested = {canonicalize_name(Requirement(r).name): Requirement(r).specifier for r in ranges}
    assert set(INTERNALS) <= set(tested)
    assert {name: str(spec) for name, spec in tested.items() if bounds.get(name) != spec} == {}


def test_the_tool_lifts_upper_bounds_and_keeps_the_rest():
    assert tool.lifted(Requirement("ray[train,default]>=2.60,<2.61")) == "ray[default,train]>=2.60"
    assert tool.lifted(Requirement("mlflow>=3.13,<3.18")) == "mlflow>=3.13"
    assert tool.lifted(Requirement("torch~=2.14.0")) == "torch"
    assert tool.lifted(Requirement("pyarrow>=16")) == "pyarrow>=16"


def test_the_tools_verdicts():
    spec = SpecifierSet(">=3.13,<3.18")
    row = {"pinned": "3.17.2", "newest": "3.18.0", "picked": "3.18.0"}
    passed = [{"failing": [], "passed_all": True, "exit_code": 0}]
    failed = [{"failing": ["tests.test_x::test_y"], "passed_all": False, "exit_code": 1}]
    assert tool.verdict(row, spec, passed) == "bound can move to 3.18.0"
    assert tool.verdict(row, spec, failed) == "keep the bound: tests.test_x::test_y"
    assert "not tested" in tool.verdict(row, spec, [])
    same = {"pinned": "3.17.2", "newest": "3.17.2", "picked": "3.17.2"}
    assert tool.verdict(same, spec, passed) == "no release past the bound"
    held = {"pinned": "3.17.2", "newest": "3.18.0", "picked": "3.17.2", "why_not_newest": "No matching distribution"}
    assert tool.verdict(held, spec, passed)== ("untested: 3.18.0 is past the bound, but pip "
                                                     "installed 3.17.2 (No matching distribution)")
