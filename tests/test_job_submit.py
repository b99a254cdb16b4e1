"""`ray job submit` of the training pipeline to a real Ray head on loopback."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import unused_ports

pytestmark = pytest.mark.slow
REPO = Path(__file__).parents[1]
# Ray 2.60 heads require a token (made in ~/.ray/auth_token if missing); clients send it in token mode
CLIENT_ENV = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": ""}


@pytest.fixture
def ray_head(tmp_path):
    """`ray start --head --block` on 127.0.0.1; stopping that process stops this head only."""
    # every port with a fixed default gets a free one: another Ray instance (the suite's own) may
    # hold the defaults, e.g. the dashboard agent's 52365
    flags = ("port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "ray-client-server-port", "runtime-env-agent-port", "metrics-export-port")
    ports = dict(zip(flags, unused_ports(len(flags))))  # distinct: Ray refuses one port for two components
    temp_dir = tempfile.mkdtemp(prefix="pairsim-ray-")  # short: Ray's AF_UNIX socket paths max 107 bytes
    ray_bin = Path(sys.executable).parent / "ray"
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
         "--num-cpus=4", f"--temp-dir={temp_dir}", *(f"--{flag}={port}" for flag, port in ports.items())],
        stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{ports['dashboard-port']}"
    deadline = time.time() + 120
    # ready when the job agent runs a trivial job
    while subprocess.run([str(ray_bin), "job", "submit", "--address", address, "--", "python", "-c", "pass"],
                         capture_output=True, env=CLIENT_ENV).returncode:
        if head.poll() is not None or time.time() > deadline:
            head.kill()
            raise RuntimeError((tmp_path / "head.log").read_text()[-3000:])
        time.sleep(2)
    yield ray_bin, address
    head.terminate()
    head.wait(timeout=60)
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_submitted_train_job_joins_the_cluster_and_logs_its_run(ray_head, tiny_dataset, tmp_path):
    ray_bin, address = ray_head
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    # the demo config with the default `ray` section: inside a job the pipeline must join the
    # cluster it was submitted to rather than start its own
    job = subprocess.run(
        [str(ray_bin), "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
         sys.executable, "pipelines/train.py", "--config", "platform/pairsim/configs/demo.yaml",
         "--set", f"data.path={tiny_dataset}", "--set", "train.epochs=1", "--set", "train.micro_batch_size=16",
         "--set", f"tracking.tracking_uri={uri}", "--set", f"ray.storage_path={tmp_path / 'ray_results'}",
         "--set", "ray.run_name=submitted"],
        capture_output=True, text=True, timeout=600, env=CLIENT_ENV)
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]
    assert "image→text" in job.stdout  # the results table
    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("pairsim").experiment_id])[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "submitted"
    assert "val/rsum" in run.data.metrics and "test/rsum" in run.data.metrics  # test embedded by the cluster
    assert (tmp_path / "ray_results" / "submitted").is_dir()
