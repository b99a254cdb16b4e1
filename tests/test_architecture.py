"""The package's structure: every module imports on its own, no import cycle between pairsim's
modules (function-level imports included), and no module reaches into another's private names."""

import ast
import graphlib
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

PACKAGE_ROOT = Path(__file__).parents[1] / "platform" / "pairsim"
MODULES = sorted(
    ".".join(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
    for path in PACKAGE_ROOT.rglob("*.py"))


# What pairsim's modules import from outside: loaded once, before the forks (most import torch:
# ~4 s an interpreter, 59 modules). Every child still imports its pairsim module as the first
# of pairsim's, which is what an import cycle or a name missing at import time depends on.
THIRD_PARTY = ("numpy", "torch", "torchvision", "open_clip", "deepspeed", "ray", "ray.train", "ray.data", "ray.tune",
               "mlflow", "pyarrow", "pydantic", "yaml")
FORK_IMPORTS = f"""
import importlib, os, sys, traceback
for name in {THIRD_PARTY!r}:
    importlib.import_module(name)
for module in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
        except BaseException:
            print(f"=== {{module}}\\n{{traceback.format_exc()}}", flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(f"--- {{module}} {{os.waitstatus_to_exitcode(status)}}", flush=True)
"""


@pytest.fixture(scope="module")
def fresh_imports() -> tuple[dict[str, int], str]:
    """({module: exit code of a fresh child importing it}, the output): one interpreter loads the
    third-party stack, then forks a child per module."""
    done = subprocess.run([sys.executable, "-c", FORK_IMPORTS, *MODULES], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = {line.split()[1]: int(line.split()[2]) for line in done.stdout.splitlines() if line.startswith("--- ")}
    return codes, done.stdout


@pytest.mark.slow  # ~30 s in all: the third-party stack once, then a fork a module
@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports_first_in_a_fresh_interpreter(module, fresh_imports):
    codes, output = fresh_imports
    assert codes[module] == 0, output[output.index(f"=== {module}"):][:3000] if f"=== {module}" in output else output[-3000:]


def test_what_the_train_controller_unpickles_leaves_out_torch_open_clip_and_deepspeed():
    """The Train controller unpickles a run's callbacks and Ray Data pipelines before it asks for
    workers (the worker job goes pickled, see driver.fit): importing the deep-learning stack there
    would hold back every run's workers by the seconds it takes."""
    code = ("import pickle, sys; from pairsim.train.callbacks import TrialReporter; import pairsim.data.ingest; "
            "pickle.loads(pickle.dumps(TrialReporter(None))); "
            "print(sorted(m for m in ('torch', 'open_clip', 'deepspeed') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split()[-1] == "[]", done.stdout


def test_importing_pairsim_quiets_only_the_raylets_worker_count_warning_and_keeps_a_users_choice():
    code = ("import pairsim, ray; from ray._private import ray_logging; print(ray_logging.stderr_deduplicator.skip_re"
            ".search('(raylet) WARNING: 12 PYTHON worker processes have been started on node: ab12 with address: "
            "127.0.0.1, which is 6x the maximum expected startup concurrency (2).') is not None, "
            "ray_logging.stderr_deduplicator.skip_re.search('(raylet) WARNING: worker killed: out of memory') is None)")
    unset = {k: v for k, v in os.environ.items() if k != "RAY_DEDUP_LOGS_SKIP_REGEX"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=unset)
    assert done.stdout.split() == ["True", "True"], done.stdout
    mine = subprocess.run([sys.executable, "-c", "import pairsim, os; print(os.environ['RAY_DEDUP_LOGS_SKIP_REGEX'])"],
                          capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "RAY_DEDUP_LOGS_SKIP_REGEX": "mine"})
    assert mine.stdout.strip() == "mine"


def test_no_import_cycles():
    graph = grimp.build_graph("pairsim", exclude_type_checking_imports=True)
    cycles = {frozenset([a, b]) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
              if graph.find_shortest_chain(importer=b, imported=a)}
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_no_import_cycles_between_pairsims_packages():
    """Between packages either (pairsim.data, pairsim.train, pairsim.cluster, ...): starting Ray
    sits below the data, training and evaluation that use it, and none of them reaches back up."""
    graph = grimp.build_graph("pairsim", exclude_type_checking_imports=True)
    package = lambda module: ".".join(module.split(".")[:2])  # noqa: E731
    imports = {}
    for module in graph.modules:
        imports.setdefault(package(module), set()).update(
            package(m) for m in graph.find_modules_directly_imported_by(module) if package(m) != package(module))
    graphlib.TopologicalSorter(imports).prepare()  # raises CycleError naming a cycle
    assert "pairsim.cluster" not in set().union(*(imports[p] for p in ("pairsim.config", "pairsim.storage")))


def test_no_module_imports_another_modules_private_names():
    offences = []
    for path in PACKAGE_ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pairsim"):
                offences += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                             if a.name.startswith("_")]
    assert not offences, offences


EXTENDING = Path(__file__).parents[1] / "docs" / "extending.md"  # where the registries are documented


def test_docs_extension_tables_are_the_registries():
    """The docs' extension-point tables equal what ``pairsim registry`` prints (in a fresh
    process, so nothing a test registered shows up)."""
    text = EXTENDING.read_text()
    copy = text.split("<!-- registry-tables -->\n", 1)[1].split("\n<!-- /registry-tables -->", 1)[0]
    done = subprocess.run([sys.executable, "-m", "pairsim.cli", "registry"], capture_output=True, text=True,
                          timeout=300, check=True)
    assert copy.strip() == done.stdout.strip(), \
        "docs/extending.md's tables are stale: paste `pairsim registry` between the markers"


def test_docs_metric_example_registers_a_family_the_suite_computes():
    text = EXTENDING.read_text()
    start = text.index("```python\nfrom pairsim.eval.metrics import blocked_retrieval_metrics") + len("```python\n")
    example = text[start:text.index("```", start)]
    check = example + """
import numpy as np, torch
from pairsim.config import load_config
from pairsim.eval.suite import SplitEmbeddings, evaluate_split
from pairsim.models.fusion import NormalizedSumFusion
g = torch.Generator().manual_seed(0)
image = torch.nn.functional.normalize(torch.randn(12, 8, generator=g), dim=-1)
text = torch.nn.functional.normalize(image.repeat_interleave(3, 0) + 0.3 * torch.randn(36, 8, generator=g), dim=-1)
ids = np.array([str(i) for i in range(12)])
emb = SplitEmbeddings(image, ids, np.arange(12) % 3, text, ids.repeat(3), np.tile(np.arange(3), 12))
metrics = evaluate_split(emb, NormalizedSumFusion(), (1, 5)).metrics
assert {"f2t_R@1", "f2t_R@5", "f2t_mAP@R", "f2t_median_rank"} <= set(metrics), sorted(metrics)
assert load_config(None, ["eval.select_metric=f2t_median_rank"]).eval.select_mode == "min"
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
