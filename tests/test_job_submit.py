"""`ray job submit` of the training pipeline to a real Ray head on loopback whose Python cannot
import pairsim: the job ships it (its working directory holds the repository's `platform/` and
`pipelines/`; the driver passes the pairsim package on to the workers as `py_modules`)."""

import contextlib
import json
import os
import re
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

# ~8 min (a fresh head, two cold job starts): -m extended. In the CI suite, a `pairsim tune` driver
# joins a running instance through RAY_ADDRESS as a submitted job does (pairsim.cluster.join_cluster,
# test_local_ray); shipping pairsim to a head without it is checked here only.
pytestmark = [pytest.mark.slow, pytest.mark.extended]
REPO = Path(__file__).parents[1]
# Ray 2.60 heads require a token (made in ~/.ray/auth_token if missing); clients send it in token mode
CLIENT_ENV = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": ""}
STOP_WAIT_S = 30  # the head's RAY_JOB_STOP_WAIT_TIME_S, as cluster.yaml sets it


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
    # This venv has pairsim installed (editable, a .pth entry at the end of sys.path): a package
    # named pairsim on the head's PYTHONPATH, ahead of it, fails every import of pairsim by the
    # head's processes (job drivers, workers) that nothing shipped with the job shadows.
    blocker = tmp_path / "no-pairsim" / "pairsim"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("pairsim is not installed on this cluster")\n')
    head_env = {**os.environ, "PYTHONPATH": str(blocker.parent), "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S)}
    address = f"http://127.0.0.1:{ports['dashboard-port']}"
    for _ in range(3):  # a loaded machine can miss Ray's fixed 30 s for the raylet to register
        head = subprocess.Popen(
            [str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
             "--num-cpus=4", f"--temp-dir={temp_dir}", *(f"--{flag}={port}" for flag, port in ports.items())],
            stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True, env=head_env)
        deadline = time.time() + 120
        # ready when the job agent runs a trivial job
        while head.poll() is None and subprocess.run(
                [str(ray_bin), "job", "submit", "--address", address, "--", "python", "-c", "pass"],
                capture_output=True, env=CLIENT_ENV).returncode:
            if time.time() > deadline:
                head.kill()
                raise RuntimeError((tmp_path / "head.log").read_text()[-3000:])
            time.sleep(2)
        if head.poll() is None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # what that attempt left running (it had its own session)
    else:
        raise RuntimeError((tmp_path / "head.log").read_text()[-3000:])
    yield ray_bin, address
    head.terminate()
    head.wait(timeout=60)
    shutil.rmtree(temp_dir, ignore_errors=True)


def job_source(tmp_path: Path) -> Path:
    """What a user submits as the working directory: the repository's code, a run config and a
    dataset beside them, all named by relative paths. Epochs of 2,400 scenes (~40 s here) leave
    `ray job stop` time to land inside the second."""
    src = tmp_path / "src"
    for part in ("platform", "pipelines"):
        shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    synth.generate(src / "shapes", num_train=2400, num_val=48, num_test=32, progress=False)
    (src / "run.yaml").write_text(yaml.safe_dump({
        "data": {"path": "shapes"}, "train": {"epochs": 2, "micro_batch_size": 16},
        "ray": {"run_name": "submitted", "storage_path": str(tmp_path / "ray_results")},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}}))
    return src


def submit(ray_bin: Path, address: str, src: Path, cwd: Path, *args: str, job_id: str | None = None,
           wait: bool = True):
    """``ray job submit --working-dir src`` of the training pipeline with ``args``, run from ``cwd``."""
    return subprocess.run(
        [str(ray_bin), "job", "submit", "--address", address, "--working-dir", str(src),
         *(["--submission-id", job_id] if job_id else []), *([] if wait else ["--no-wait"]), "--", sys.executable, "pipelines/train.py", "--config", "platform/pairsim/configs/demo.yaml",
         "--config", "run.yaml", *args],
        capture_output=True, text=True, timeout=900, env=CLIENT_ENV, cwd=cwd)


def wait_for(condition, what: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def test_a_submitted_job_ships_pairsim_resolves_its_paths_stops_killed_and_resumes(ray_head, tmp_path):
    """From another directory: a job on a head without pairsim runs with what it ships; a
    relative path that points nowhere is refused naming where it resolved; ``ray job stop``
    after the first checkpoint ends the MLflow run KILLED with the checkpoint kept; the same job
    submitted again resumes from it and finishes the run."""
    ray_bin, address = ray_head
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bare = subprocess.run([str(ray_bin), "job", "submit", "--address", address, "--", sys.executable, "-c",
                           "import pairsim"], capture_output=True, text=True, env=CLIENT_ENV, cwd=elsewhere)
    assert bare.returncode != 0 and "pairsim is not installed on this cluster" in bare.stdout + bare.stderr

    src = job_source(tmp_path)
    refused = submit(ray_bin, address, src, elsewhere, "--set", "data.path=nowhere")
    assert refused.returncode != 0
    assert re.search(r"config error: data\.path: no dataset at /\S+/_ray_pkg_\w+/nowhere", refused.stdout), \
        refused.stdout[-3000:]

    started = submit(ray_bin, address, src, elsewhere, job_id="first", wait=False)
    assert started.returncode == 0, started.stderr[-2000:]
    run_dir = tmp_path / "ray_results" / "submitted"

    def ray_job(command: str) -> str:  # `ray job <command> first`'s output
        done = subprocess.run([str(ray_bin), "job", command, "--address", address, "first"], capture_output=True,
                              text=True, env=CLIENT_ENV, timeout=300)
        return done.stdout + done.stderr

    def checkpointed() -> bool:  # Ray Train lists a reported checkpoint in its snapshot
        if (run_dir / "checkpoint_manager_snapshot.json").is_file():
            return True
        if int(time.time()) % 20 == 0:  # now and then (each `ray job status` takes a core for a second)
            assert "RUNNING" in (status := ray_job("status")), status + ray_job("logs")[-4000:]
        return False

    wait_for(checkpointed, "the first epoch's checkpoint")
    stop_started = time.time()
    stopped = ray_job("stop")  # it waits until the job has ended
    stop_took = time.time() - stop_started
    first_logs = ray_job("logs")[-6000:]
    assert "was stopped" in stopped, stopped + first_logs
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("pairsim").experiment_id])
    assert run.info.status == "KILLED", first_logs
    assert run.data.tags["pairsim.stopped_by"] == "stopped by SIGTERM"
    assert "pairsim: stopped by SIGTERM" in first_logs  # the driver's own last words
    assert stop_took < STOP_WAIT_S, f"the driver outlived its grace ({stop_took:.0f} s): SIGKILLed\n{first_logs}"
    assert json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    assert list(run_dir.glob("checkpoint_*"))

    resumed = submit(ray_bin, address, src, elsewhere, job_id="again")
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    assert re.search(r"resumed from checkpoint: epoch 2", resumed.stdout), resumed.stdout[-4000:]
    assert "image→text" in resumed.stdout  # the results table
    [run] = client.search_runs([client.get_experiment_by_name("pairsim").experiment_id])  # the same run
    assert run.info.status == "FINISHED" and run.info.run_name == "submitted"
    assert run.data.tags["pairsim.attempts"] == "2"
    assert "val/rsum" in run.data.metrics and "test/rsum" in run.data.metrics  # test embedded by the cluster
