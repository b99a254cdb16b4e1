"""``cluster.yaml`` is a Ray autoscaler config: valid against Ray's schema before and after Ray
fills in its AWS defaults (no cloud call), with GPU training nodes, CPU-only data nodes, and
pairsim's dependencies installed on the nodes but not pairsim (jobs ship it), node types
labelled with the roles ``ray.node_roles`` places by."""

import re
import shlex
import tomllib
from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pairsim.config import NodeRolesConfig

REPO = Path(__file__).parents[1]
CONFIG = yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_cluster_yaml_is_a_valid_ray_autoscaler_config():
    validate_config(CONFIG)
    prepared = prepare_config(CONFIG)
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    types = prepared["available_node_types"]
    assert prepared["head_node_type"] in types
    assert sum(t["max_workers"] for name, t in types.items() if name != prepared["head_node_type"]) \
        <= prepared["max_workers"]


def test_training_nodes_have_gpus_and_data_nodes_none():
    types = CONFIG["available_node_types"]
    assert types["gpu_worker"]["resources"]["GPU"] >= 1
    assert types["data_worker"]["resources"]["GPU"] == 0 and types["data_worker"]["resources"]["CPU"] >= 1


def test_node_types_carry_the_role_labels_pairsim_places_by_default():
    roles = NodeRolesConfig()
    types = CONFIG["available_node_types"]
    assert types["gpu_worker"]["labels"] == {roles.label: roles.train}
    assert types["data_worker"]["labels"] == {roles.label: roles.data}
    assert roles.label not in types[CONFIG["head_node_type"]].get("labels", {})  # the head runs neither


def test_nodes_get_pairsims_dependencies_and_not_pairsim():
    installed = [arg for command in CONFIG["setup_commands"] for arg in shlex.split(command)[3:]]  # pip install -q …
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(installed) == sorted(dependencies)
    every_command = " ".join(str(c) for key, c in CONFIG.items() if key.endswith("commands"))
    assert "pairsim" not in every_command
    assert not CONFIG["file_mounts"]  # nothing synced by hand: jobs bring their working directory


def test_the_head_gives_a_stopped_driver_time_to_end_its_run():
    assert "RAY_JOB_STOP_WAIT_TIME_S=" in " ".join(CONFIG["head_start_ray_commands"])


def test_the_head_runs_mlflow_as_a_team_does_and_every_node_logs_to_it():
    """The head's ``mlflow server`` is "MLflow for a team"'s, as the tests' server runs: store and
    artifact destination in variables MLflow's CLI reads, artifacts proxied, flags it parses, the
    PostgreSQL driver installed; each node starts Ray with MLFLOW_TRACKING_URI at its port."""
    from mlflow.cli import server

    head = CONFIG["head_start_ray_commands"]
    command, = [c for c in head if "mlflow server" in c and "pkill" not in c]
    assert set(re.findall(r"\b(MLFLOW_\w+)=", command)) == {"MLFLOW_BACKEND_STORE_URI", "MLFLOW_ARTIFACTS_DESTINATION"}
    assert {"MLFLOW_BACKEND_STORE_URI", "MLFLOW_ARTIFACTS_DESTINATION"} <= {p.envvar for p in server.params}
    args = shlex.split(command.split("nohup mlflow server", 1)[1].split(">", 1)[0])
    assert "--serve-artifacts" in args and server.make_context("server", list(args)).params["serve_artifacts"]
    port = args[args.index("--port") + 1]
    for start in (head[-1], CONFIG["worker_start_ray_commands"][-1]):
        assert re.search(rf"export MLFLOW_TRACKING_URI=http://[^;]+:{port};", start)
        assert start.index("MLFLOW_TRACKING_URI") < start.index("ray start")
    assert "psycopg[binary]" in " ".join(CONFIG["head_setup_commands"])


RAYJOB = yaml.safe_load((REPO / "docs" / "kuberay" / "rayjob.yaml").read_text())


def test_the_kuberay_rayjob_submits_the_documented_entry_point_with_pairsims_dependencies():
    import ray
    from pairsim.cli import build_parser

    entry = shlex.split(RAYJOB["spec"]["entrypoint"])
    assert entry[:2] == ["python", "pipelines/train.py"] and (REPO / entry[1]).is_file()
    args = build_parser().parse_args(["train", *entry[2:]])  # the flags pipelines/train.py hands pairsim train
    assert args.config == [Path("run.yaml")] and all("=" in o for o in args.overrides)
    assert "python pipelines/train.py --config run.yaml" in (REPO / "docs" / "clusters.md").read_text()  # the documented one
    runtime_env = yaml.safe_load(RAYJOB["spec"]["runtimeEnvYAML"])
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(runtime_env["pip"]) == sorted(dependencies) and "py_modules" not in runtime_env
    assert set(runtime_env) == {"working_dir", "pip"}  # the driver adds pairsim as py_modules itself
    assert RAYJOB["spec"]["rayClusterSpec"]["rayVersion"] == ray.__version__


def test_the_kuberay_cluster_has_cluster_yamls_roles():
    roles, spec = NodeRolesConfig(), RAYJOB["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert groups["gpu-worker"]["labels"] == {roles.label: roles.train}
    assert groups["data-worker"]["labels"] == {roles.label: roles.data}
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    head_env = {e["name"]: e["value"] for e in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert "RAY_JOB_STOP_WAIT_TIME_S" in head_env
