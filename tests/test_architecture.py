"""The package's structure: every module imports on its own, no import cycle between pairsim's
modules (function-level imports included), no module reaches into another's private names, and
third-party internals are used in pairsim.compat only."""

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


COMPAT = PACKAGE_ROOT / "compat"  # pairsim.compat: the one place allowed third-party internals
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # public despite the underscore
THIRD_PARTY_INTERNALS = {  # names of third-party internals that carry no underscore
    "checkpoint_manager_snapshot.json",  # Ray Train's record of a run's checkpoints
    "RAY_DEDUP_LOGS_SKIP_REGEX", "ENABLE_RAY_CLUSTER", "num_workers_soft_limit",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "fp32_groups_flat", "fp32_groups", "fp16_groups", "get_hp_fragment",  # DeepSpeed optimizers' master weights
    "deepspeed.runtime.zero.muon.muon_optimizer",
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def names_pairsim_defines(trees: list[ast.Module]) -> set[str]:
    """The private names pairsim's own code defines: functions, classes, their parameters,
    variables, attributes it assigns and import aliases."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return {name for name in names if is_private(name)}


def third_party_private_uses(tree: ast.Module, pairsims: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each use in ``tree`` of a third-party module's private module or name: an
    import of one, an attribute, ``getattr`` name or keyword argument that is private and not
    one of ``pairsims`` (nor namedtuple's), a name or string of :data:`THIRD_PARTY_INTERNALS`."""
    def third_party(module: str) -> bool:
        return module.split(".")[0] not in {"pairsim", *sys.stdlib_module_names}

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if third_party(a.name) and any(map(is_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and not node.level and third_party(node.module):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if any(map(is_private, [*node.module.split("."), a.name])) or a.name in THIRD_PARTY_INTERNALS]
        elif isinstance(node, ast.Attribute):
            if node.attr in THIRD_PARTY_INTERNALS or (is_private(node.attr)
                                                      and node.attr not in pairsims | NAMEDTUPLE_API):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.keyword) and node.arg and is_private(node.arg) and node.arg not in pairsims:
            found.append((node.lineno, f"{node.arg}="))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in THIRD_PARTY_INTERNALS:
                found.append((node.lineno, repr(node.value)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and is_private(node.args[1].value) and node.args[1].value not in pairsims):
            found.append((node.lineno, f"{node.func.id}(…, {node.args[1].value!r})"))
    return found


def test_third_party_internals_are_used_in_pairsim_compat_only():
    """A private module or name of Ray, DeepSpeed, MLflow (any third-party package), or one of
    their internal files or environment variables, is used through :mod:`pairsim.compat` only:
    where a new version breaks pairsim is then one package, tested against known versions."""
    modules = {path: ast.parse(path.read_text()) for path in PACKAGE_ROOT.rglob("*.py")
               if not path.is_relative_to(COMPAT)}
    pairsims = names_pairsim_defines(list(modules.values()))
    offences = [f"{path.relative_to(PACKAGE_ROOT.parent)}:{line}: {what}"
                for path, tree in sorted(modules.items()) for line, what in third_party_private_uses(tree, pairsims)]
    assert not offences, "third-party internals outside pairsim/compat/:\n" + "\n".join(offences)


def test_the_internals_check_finds_each_kind_of_use():
    source = """
from ray._private import ray_constants
import ray.train._internal.session
from mlflow.data import _helper
ray_constants.ENABLE_RAY_CLUSTER = False
param._hp_mapping.get_hp_fragment()
getattr(param, "_hp_mapping", None)
ray.init(_system_config={})
os.environ.setdefault("RAY_DEDUP_LOGS_SKIP_REGEX", ".")
self._mine, parts._replace(path="")
"""
    found = third_party_private_uses(ast.parse(source), {"_mine"})
    assert sorted(line for line, _ in found) == [2, 3, 4, 5, 6, 6, 7, 8, 9], found
