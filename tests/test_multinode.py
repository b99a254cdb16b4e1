"""A Ray cluster of several nodes on this machine, laid out as cluster.yaml describes: a head that
trains nothing, training nodes and a data-only node, told apart by the ``pairsim-role`` node
label, each its own raylet and object store on 127.0.0.1. A run submitted with ``ray job submit``
puts its Ray Train workers (and the test split's embedding actors) on training nodes and Ray
Data's reads and decodes on the data node (read from Ray's State API); a data node lost mid-run
costs no training pair, a training node lost after it is survived from the last checkpoint."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import steps_logged_twice, unused_ports
from pairsim.data import synth

pytestmark = pytest.mark.slow  # ~6 min: six raylets, one submitted run
REPO = Path(__file__).parents[1]
RAY = Path(sys.executable).parent / "ray"
CLIENT_ENV = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": ""}  # Ray 2.60 heads take a token
NODE_PORTS = ("node-manager-port", "object-manager-port", "runtime-env-agent-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "metrics-export-port")
STORE = str(150 * 1024 ** 2)  # bytes of object store a node: three share this machine's memory


def start_node(log: Path, temp_dirs: list[str], env: dict[str, str], *flags: str) -> subprocess.Popen:
    """``ray start --block`` of one node on 127.0.0.1 with its own free ports and temporary
    directory (nodes sharing one would share its runtime_resources/, and one node's clean-up
    would delete a job's working directory under another's driver); in its own session: killing
    its group stops that node only, as a lost machine."""
    ports = unused_ports(len(NODE_PORTS))
    temp_dirs.append(tempfile.mkdtemp(prefix="pmn-"))  # short: Ray's AF_UNIX socket paths max 107 bytes
    return subprocess.Popen([str(RAY), "start", "--block", "--node-ip-address=127.0.0.1", f"--object-store-memory={STORE}",
                             f"--temp-dir={temp_dirs[-1]}", *(f"--{flag}={port}" for flag, port in zip(NODE_PORTS, ports)),
                             *flags],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


def state(address: str, kind: str) -> list[dict]:
    done = subprocess.run([str(RAY), "list", kind, "--address", address, "--format", "json", "--detail",
                           "--limit", "10000"], capture_output=True, text=True, timeout=120, env=CLIENT_ENV, check=True)
    return json.loads(done.stdout)


@dataclass
class Cluster:
    address: str  # the dashboard's: job submission and the State API
    gcs: int  # the head's port, which nodes join
    env: dict[str, str]  # of every node: the S3 endpoint and credentials, as a cloud's nodes have theirs
    logs: Path
    temp_dirs: list[str]
    nodes: dict[str, subprocess.Popen]  # by name: head, train-1 … train-3, data-1
    node_ids: dict[str, str]  # Ray's node id by name, of every node that joined (killed ones too)

    def role(self, role: str) -> set[str]:
        return {node_id for name, node_id in self.node_ids.items() if name.startswith(f"{role}-")}

    def join(self, cpus: dict[str, int], deadline: float) -> None:
        """Start the nodes ``cpus`` names (each labelled with its role, the part before the
        dash, and its name), all at once, and wait until Ray lists them alive; three tries for
        a node that did not join: a loaded machine can miss Ray's 30 s to register."""
        for attempt in range(3):
            waiting = [name for name in cpus if name not in self.node_ids]
            for name in waiting:
                self.nodes[name] = start_node(self.logs / f"{name}-{attempt}.log", self.temp_dirs, self.env,
                                              f"--address=127.0.0.1:{self.gcs}", f"--num-cpus={cpus[name]}",
                                              f"--labels=pairsim-role={name.split('-')[0]},node={name}")
            while (not set(waiting) <= self.node_ids.keys() and time.time() < deadline
                   and any(self.nodes[name].poll() is None for name in waiting if name not in self.node_ids)):
                self.node_ids |= {n["labels"]["node"]: n["node_id"] for n in state(self.address, "nodes")
                                  if n["state"] == "ALIVE" and "node" in n.get("labels", {})}
                time.sleep(1)
            if set(cpus) <= self.node_ids.keys():
                return
        missing = next(name for name in cpus if name not in self.node_ids)
        raise AssertionError((self.logs / f"{missing}-{attempt}.log").read_text()[-3000:])

    def kill(self, name: str) -> None:
        """The node's raylet, object store and workers gone at once, as a spot instance vanishes."""
        os.killpg(self.nodes[name].pid, signal.SIGKILL)


LAYOUT = {"train-1": 1, "train-2": 1, "train-3": 1, "data-1": 2}  # CPUs by node: 2 workers, and one to spare
TRAIN_IMAGES = 816  # 25 steps an epoch of 2 workers × 16, and 16 images that drop_last leaves unseen


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_env):
    """A head with no CPUs (job drivers, Train's controller), three training nodes of 1 CPU and a
    data node of 2, labelled by role (and by name, to find a node's process)."""
    logs = tmp_path_factory.mktemp("multinode")
    gcs, dashboard, client = unused_ports(3)
    cluster = Cluster(f"http://127.0.0.1:{dashboard}", gcs, CLIENT_ENV | s3_env, logs, [], {}, {})
    cluster.nodes["head"] = start_node(logs / "head.log", cluster.temp_dirs, cluster.env, "--head", f"--port={gcs}",
                                       f"--dashboard-port={dashboard}", "--dashboard-host=127.0.0.1",
                                       f"--ray-client-server-port={client}", "--num-cpus=0")
    try:
        deadline = time.time() + 420
        while subprocess.run([str(RAY), "job", "submit", "--address", cluster.address, "--", "python", "-c", "pass"],
                             capture_output=True, env=CLIENT_ENV).returncode:
            assert time.time() < deadline and cluster.nodes["head"].poll() is None, (logs / "head.log").read_text()[-3000:]
            time.sleep(2)
        cluster.join(LAYOUT, deadline)
        yield cluster
    finally:  # SIGKILL: nothing to keep, a node's state goes with its directory (SIGTERM took ~30 s)
        for node in reversed(cluster.nodes.values()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        for temp_dir in cluster.temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)


def job_source(tmp_path: Path, num_train: int, **run: dict) -> Path:
    """The repository's code, a dataset and ``run.yaml`` (the demo config's overrides) to submit."""
    src = tmp_path / "src"
    for part in ("platform", "pipelines"):
        shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    synth.generate(src / "shapes", num_train=num_train, num_val=32, num_test=32, progress=False)
    (src / "run.yaml").write_text(yaml.safe_dump({
        "data": {"path": "shapes"} | run.get("data", {}), "train": {"num_workers": 2, "micro_batch_size": 16} | run.get("train", {}),
        "ray": {"storage_path": str(tmp_path / "ray_results")} | run.get("ray", {}),
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}}))
    return src


def submit_command(cluster: Cluster, src: Path) -> list[str]:
    return [str(RAY), "job", "submit", "--address", cluster.address, "--working-dir", str(src), "--", sys.executable,
            "pipelines/train.py", "--config", "platform/pairsim/configs/demo.yaml", "--config", "run.yaml"]


def the_run(tmp_path: Path):
    """The one MLflow run of the job (a second would be a lost attempt)."""
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run, = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return client, run


def test_a_submitted_run_is_placed_by_role_and_survives_a_data_node_then_a_training_node_lost(cluster, tmp_path,
                                                                                              s3_env, monkeypatch):
    """One submitted run (each costs minutes), checkpoints in S3, two nodes lost:

    - the data node killed in epoch 1 and a new one joining (as an autoscaler replaces a spot
      instance): the rest of the reads (epoch 1's validation, epoch 2, the test split) run on the
      new node; every epoch trains each pair at most once and leaves unseen only what drop_last
      leaves (the epoch audit, counted over both ranks);
    - a training node killed (its raylet, object store and workers) in epoch 2: Ray Train
      restarts the worker group on the training nodes left, from epoch 1's checkpoint in S3.

    Its Ray Train workers and the test split's embedding actors run on training nodes, Ray Data's
    reads on the data nodes; one MLflow run, no metric step twice."""
    import pyarrow.fs as pafs

    from pairsim.train import checkpoints

    for name, value in s3_env.items():  # the bucket, as pairsim's storage reads it here
        monkeypatch.setenv(name, value)
    s3 = pafs.S3FileSystem(endpoint_override=s3_env["AWS_ENDPOINT_URL"], allow_bucket_creation=True,
                           access_key=s3_env["AWS_ACCESS_KEY_ID"], secret_key=s3_env["AWS_SECRET_ACCESS_KEY"],
                           region=s3_env["AWS_DEFAULT_REGION"])
    s3.create_dir("pairsim-multinode")
    src = job_source(tmp_path, TRAIN_IMAGES, train={"epochs": 2, "log_every_n_steps": 4}, data={"audit_epochs": True},
                     ray={"run_name": "survivor", "max_failures": 2, "storage_path": "s3://pairsim-multinode/ray"})
    job = subprocess.Popen(submit_command(cluster, src), stdout=open(tmp_path / "job.log", "w"), stderr=subprocess.STDOUT,
                           env=CLIENT_ENV)

    def wait_for_line(line: str) -> None:
        deadline = time.time() + 600
        while line not in (tmp_path / "job.log").read_text():
            assert job.poll() is None and time.time() < deadline, (tmp_path / "job.log").read_text()[-4000:]
            time.sleep(0.5)

    steps = TRAIN_IMAGES // (16 * 2)  # 25 an epoch
    wait_for_line("epoch 1/2 step 12/")
    cluster.kill("data-1")
    cluster.join({"data-2": LAYOUT["data-1"]}, time.time() + 300)
    # An epoch-2 step is a collective of both ranks, each past its report of epoch 1's checkpoint.
    wait_for_line(f"epoch 2/2 step {steps + 3}/")
    before = {a["actor_id"]: a for a in state(cluster.address, "actors") if a["class_name"] == "RayTrainWorker"}
    assert len(before) == 2 and {a["node_id"] for a in before.values()} <= cluster.role("train")
    lost = next(name for name, node_id in cluster.node_ids.items()
                if node_id in {a["node_id"] for a in before.values() if a["state"] == "ALIVE"})
    cluster.kill(lost)
    assert job.wait(timeout=900) == 0, (tmp_path / "job.log").read_text()[-4000:]
    assert "resumed from checkpoint: epoch 2" in (tmp_path / "job.log").read_text()

    client, run = the_run(tmp_path)
    assert run.info.status == "FINISHED" and steps_logged_twice(client, run.info.run_id) == {}
    history = {key: [m.value for m in client.get_metric_history(run.info.run_id, f"data/epoch_{key}")]
               for key in ("pairs", "pairs_repeated", "images_unseen")}
    assert history == {"pairs": [steps * 32] * 2, "pairs_repeated": [0, 0],
                       "images_unseen": [TRAIN_IMAGES - steps * 32] * 2}
    assert len(client.get_metric_history(run.info.run_id, "val/rsum")) == 2 and "test/rsum" in run.data.metrics
    kept = checkpoints.inventory("s3://pairsim-multinode/ray/survivor")  # newest first, each verified
    assert [(card.epoch, problems) for _, card, problems in kept] == [(2, []), (1, [])]

    restarted = [a for a in state(cluster.address, "actors")
                 if a["class_name"] == "RayTrainWorker" and a["actor_id"] not in before]
    assert len(restarted) == 2 and {a["node_id"] for a in restarted} <= cluster.role("train") - {cluster.node_ids[lost]}
    embedders = [t for t in state(cluster.address, "tasks") if "embed_in_task" in t["name"]]  # the test split's
    assert embedders and {t["node_id"] for t in embedders} <= cluster.role("train")  # model, on CPU in tasks
    data_work = [t for t in state(cluster.address, "tasks") if t["type"] == "NORMAL_TASK" and "ReadVerifiedParquet" in t["name"]]
    assert data_work and {t["node_id"] for t in data_work} <= cluster.role("data"), {
        (t["name"], t["node_id"]) for t in data_work if t["node_id"] not in cluster.role("data")}
    assert any("Project" in t["name"] for t in data_work if t["node_id"] == cluster.node_ids["data-2"])  # train reads
