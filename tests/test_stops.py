"""A command stopped while it starts (Ctrl-C, SIGTERM) or whose Ray workers never start ends in
seconds with one line and the usual code, no traceback or core dump, and nothing of the Ray
instance it started left running. Each case is a real ``pairsim train`` on its own instance."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from pairsim.cli import DEMO_CONFIG

pytestmark = pytest.mark.slow


def start_train(tmp_path, tiny_dataset, env=None) -> subprocess.Popen:
    args = [f"data.path={tiny_dataset}", "data.test_split=null", "train.micro_batch_size=16", "ray.run_name=stops",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db", f"ray.storage_path={tmp_path}/ray"]
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own instance, not the session's
    return subprocess.Popen([sys.executable, "-m", "pairsim.cli", "train", "--config", str(DEMO_CONFIG),
                             *(f"--set={a}" for a in args)], cwd=tmp_path, env=base | (env or {}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def descendants(proc: subprocess.Popen) -> set[psutil.Process]:
    try:
        return set(psutil.Process(proc.pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def left_running(processes: set[psutil.Process]) -> list[str]:
    gone, alive = psutil.wait_procs(processes, timeout=20)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        p.kill()
    return [p.name() for p in alive]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_ray_starts_ends_the_command_cleanly(tmp_path, tiny_dataset, signum):
    """The signal comes as soon as the instance's raylet runs: inside ``ray.init``, where Ray's
    own handlers are in place (a traceback and a segfault for Ctrl-C, an abort dump for SIGTERM
    before)."""
    proc = start_train(tmp_path, tiny_dataset)
    seen: set[psutil.Process] = set()
    deadline = time.time() + 120
    while not any(p.name() == "raylet" for p in seen) and time.time() < deadline and proc.poll() is None:
        seen |= descendants(proc)
        time.sleep(0.2)
    assert any(p.name() == "raylet" for p in seen), "the local instance never started"
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, out[-3000:]
    assert f"pairsim: stopped by {signal.Signals(signum).name}" in out and "Traceback" not in out, out[-3000:]
    assert "received at time" not in out  # Ray's native handler's stack dump
    assert left_running(seen) == []


def test_ray_workers_that_never_start_end_the_command_naming_why(tmp_path, tiny_dataset):
    """Every Ray worker process dies as it starts (a sitecustomize on the path that exits them):
    the start-up watchdog ends the command within its timeout plus seconds, says what to check,
    and leaves nothing running (Ray waited for them silently for ever before)."""
    broken = tmp_path / "broken-env"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(
        "import os, sys\nif any('default_worker.py' in a for a in sys.argv):\n    os._exit(1)\n")
    started = time.time()
    proc = start_train(tmp_path, tiny_dataset, {"PYTHONPATH": os.pathsep.join(filter(None, [
        str(broken), os.environ.get("PYTHONPATH")])), "PAIRSIM_WORKER_START_TIMEOUT_S": "10"})
    seen: set[psutil.Process] = set()
    while proc.poll() is None and time.time() - started < 150:
        seen |= descendants(proc)
        time.sleep(0.5)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out[-3000:]
    assert time.time() - started < 90
    assert "Ray's worker processes did not start within 10 s" in out and "raylet.out" in out, out[-3000:]
    assert "Traceback" not in out
    assert left_running(seen) == []
