"""A Ray cluster of several nodes on this machine, laid out as cluster.yaml describes: a head that
trains nothing, a training node and a data-only node, told apart by the ``pairsim-role`` node
label. A run submitted with ``ray job submit`` puts its Ray Train workers (and the test split's
embedding actors) on the training node and Ray Data's reads and decodes on the data node; the
test reads where each task and actor ran from Ray's State API."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import unused_ports
from pairsim.data import synth

pytestmark = pytest.mark.slow  # ~3 min: three raylets and one submitted run
REPO = Path(__file__).parents[1]
RAY = Path(sys.executable).parent / "ray"
CLIENT_ENV = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": ""}  # Ray 2.60 heads take a token
NODE_PORTS = ("node-manager-port", "object-manager-port", "runtime-env-agent-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "metrics-export-port")
STORE = str(150 * 1024 ** 2)  # bytes of object store a node: three share this machine's memory


def start_node(log: Path, temp_dirs: list[str], *flags: str) -> subprocess.Popen:
    """``ray start --block`` of one node on 127.0.0.1 with its own free ports and temporary
    directory (nodes sharing one would share its runtime_resources/, and one node's clean-up
    would delete a job's working directory under another's driver); in its own session: killing
    its group stops that node only, as a lost machine."""
    ports = unused_ports(len(NODE_PORTS))
    temp_dirs.append(tempfile.mkdtemp(prefix="pmn-"))  # short: Ray's AF_UNIX socket paths max 107 bytes
    return subprocess.Popen([str(RAY), "start", "--block", "--node-ip-address=127.0.0.1", f"--object-store-memory={STORE}",
                             f"--temp-dir={temp_dirs[-1]}", *(f"--{flag}={port}" for flag, port in zip(NODE_PORTS, ports)),
                             *flags],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=CLIENT_ENV)


def state(address: str, kind: str) -> list[dict]:
    done = subprocess.run([str(RAY), "list", kind, "--address", address, "--format", "json", "--detail",
                           "--limit", "10000"], capture_output=True, text=True, timeout=120, env=CLIENT_ENV, check=True)
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head with no CPUs (job drivers, Train's controller) and two labelled worker nodes with 2
    CPUs each; yields the dashboard address and the node ids by role."""
    logs = tmp_path_factory.mktemp("multinode")
    temp_dirs = []
    gcs, dashboard, client = unused_ports(3)
    address = f"http://127.0.0.1:{dashboard}"
    nodes = [start_node(logs / "head.log", temp_dirs, "--head", f"--port={gcs}", f"--dashboard-port={dashboard}",
                        "--dashboard-host=127.0.0.1", f"--ray-client-server-port={client}", "--num-cpus=0")]
    try:
        deadline = time.time() + 300
        while subprocess.run([str(RAY), "job", "submit", "--address", address, "--", "python", "-c", "pass"],
                             capture_output=True, env=CLIENT_ENV).returncode:
            assert time.time() < deadline and nodes[0].poll() is None, (logs / "head.log").read_text()[-3000:]
            time.sleep(2)
        roles = {}
        for role in ("train", "data"):  # one after the other: a loaded machine can miss Ray's 30 s to register
            for attempt in range(3):
                node = start_node(logs / f"{role}-{attempt}.log", temp_dirs, f"--address=127.0.0.1:{gcs}",
                                  "--num-cpus=2", f"--labels=pairsim-role={role}")
                nodes.append(node)
                while role not in roles and node.poll() is None and time.time() < deadline:
                    roles = {n["labels"]["pairsim-role"]: n["node_id"] for n in state(address, "nodes")
                             if n["state"] == "ALIVE" and "pairsim-role" in n.get("labels", {})}
                    time.sleep(1)
                if role in roles:
                    break
            assert role in roles, (logs / f"{role}-{attempt}.log").read_text()[-3000:]
        yield address, roles
    finally:
        for node in reversed(nodes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(timeout=10)
            except subprocess.TimeoutExpired:  # nothing to keep: a node's state goes with its directory
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        for temp_dir in temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_submitted_run_trains_on_training_nodes_and_reads_data_on_data_nodes(cluster, tmp_path):
    address, roles = cluster
    src = tmp_path / "src"
    for part in ("platform", "pipelines"):
        shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    synth.generate(src / "shapes", num_train=128, num_val=32, num_test=32, progress=False)
    (src / "run.yaml").write_text(yaml.safe_dump({
        "data": {"path": "shapes"}, "train": {"epochs": 1, "num_workers": 2, "micro_batch_size": 16},
        "ray": {"run_name": "placed", "storage_path": str(tmp_path / "ray_results")},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}}))
    job = subprocess.run([str(RAY), "job", "submit", "--address", address, "--working-dir", str(src), "--",
                          sys.executable, "pipelines/train.py", "--config", "platform/pairsim/configs/demo.yaml",
                          "--config", "run.yaml"], capture_output=True, text=True, timeout=900, env=CLIENT_ENV)
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]
    run, = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_runs(
        [e.experiment_id for e in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_experiments()])
    assert {"val/rsum", "test/rsum"} <= set(run.data.metrics)

    actors = state(address, "actors")
    train_workers = [a for a in actors if a["class_name"] == "RayTrainWorker"]
    embedders = [a for a in actors if "EmbedBatches" in a["class_name"]]
    assert len(train_workers) == 2 and {a["node_id"] for a in train_workers} == {roles["train"]}
    assert embedders and {a["node_id"] for a in embedders} == {roles["train"]}  # the test split's model
    tasks = [t for t in state(address, "tasks") if t["type"] == "NORMAL_TASK"]
    data_work = [t for t in tasks if "ReadParquet" in t["name"] or "_start_ingest_worker" in t["name"]]
    assert any("_start_ingest_worker" in t["name"] for t in data_work)
    assert {t["name"].split("->")[0] for t in data_work} >= {"ReadParquet"}
    assert {t["node_id"] for t in data_work} == {roles["data"]}, {
        (t["name"], t["node_id"]) for t in data_work if t["node_id"] != roles["data"]}
