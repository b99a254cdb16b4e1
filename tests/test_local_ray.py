"""pairsim's own local Ray instance beside another one on the same machine (a test suite and a
demo, two sweeps): a Train run whose owner dies (a sweep trial stopped early by ASHA) must give
its workers' placement group back, or the next trial waits forever for CPUs that nobody uses.

Ray Train V2 frees it from a detached ``PlacementGroupCleaner`` that asks the State API whether
the controller is alive; in a worker that API finds its cluster from ``RAY_ADDRESS`` or by
scanning the machine's GCS processes, and with two of them it raised "Found multiple active Ray
instances" in the cleaner's thread, which died, leaking the group."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

OTHER_INSTANCE = "import ray, sys, time; ray.init(num_cpus=1, include_dashboard=False); print('ready', flush=True); time.sleep(600)"

ORPHANED_RUN = textwrap.dedent("""
    import pathlib, sys, time
    import ray
    import ray.train
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from pairsim.config import load_config
    from pairsim.cluster import init_ray

    storage, started = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])

    def loop(config):
        pathlib.Path(config["started"]).write_text("1")
        time.sleep(600)

    @ray.remote(num_cpus=0)
    class Owner:  # what a Tune trial is to its TorchTrainer
        def run(self):
            TorchTrainer(loop, train_loop_config={"started": str(started)},
                         scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                         run_config=ray.train.RunConfig(name="orphan", storage_path=str(storage))).fit()

    def worker_groups():
        return {pg: info["state"] for pg, info in ray.util.placement_group_table().items()
                if sum(b.get("CPU", 0) for b in info["bundles"].values()) == 2}

    init_ray(load_config(None, ["train.num_workers=2", "train.cpus_per_worker=1", "ray.data_cpus=1"]))
    owner = Owner.remote()
    owner.run.remote()
    deadline = time.time() + 180
    while not started.exists():
        assert time.time() < deadline, "the workers never started"
        time.sleep(0.5)
    time.sleep(3)  # the worker group is registered with the cleaner right after it starts
    [group] = worker_groups()
    ray.kill(owner)
    deadline = time.time() + 60
    while worker_groups()[group] != "REMOVED":
        if time.time() > deadline:
            print("LEAKED", worker_groups(), ray.available_resources().get("CPU"), flush=True)
            sys.exit(1)
        time.sleep(1)
    print("FREED", ray.available_resources().get("CPU"), flush=True)
""")


def test_an_orphaned_run_frees_its_workers_beside_another_local_instance(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", OTHER_INSTANCE], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "ready"
        script = tmp_path / "orphan.py"
        script.write_text(ORPHANED_RUN)
        run = subprocess.run([sys.executable, str(script), str(tmp_path / "ray"), str(tmp_path / "started")],
                             capture_output=True, text=True, timeout=420)
        assert run.returncode == 0 and "FREED" in run.stdout, run.stdout[-3000:] + run.stderr[-5000:]
    finally:
        other.kill()
        other.wait()


def test_the_setup_hook_leaves_torch_the_threads_ray_gives_a_task(ray_instance):
    """The hook runs in every worker of the instance before its first task; had it imported
    torch, torch would keep all the cores' threads instead of the task's one CPU."""
    import ray

    @ray.remote(num_cpus=1)
    def threads():
        import os

        import torch

        return torch.get_num_threads(), os.environ.get("RAY_ADDRESS")

    assert ray.get(threads.remote()) == (1, ray.get_runtime_context().gcs_address)


def test_a_local_instances_workers_get_its_environment_beside_the_callers(ray_instance, s3_env):
    """The instance's own variables (no preemption watcher on one machine) reach every worker,
    merged with those the caller's runtime environment sets (here the tests' S3 credentials)."""
    import ray

    from pairsim import compat

    @ray.remote(num_cpus=0)
    def environment(names):
        import os

        return {name: os.environ.get(name) for name in names}

    expected = compat.ray.ONE_MACHINE_ENV | {"AWS_ENDPOINT_URL": s3_env["AWS_ENDPOINT_URL"]}
    assert ray.get(environment.remote(list(expected))) == expected


LISTENERS = textwrap.dedent("""
    import json, os, subprocess, sys
    import psutil, ray
    from test_local_ray import JOIN
    from pairsim.config import load_config
    from pairsim.cluster import init_ray

    init_ray(load_config(None, ["train.num_workers=1", "ray.data_cpus=1", *sys.argv[1:]]))
    assert ray.get([ray.remote(lambda: 1).remote() for _ in range(2)]) == [1, 1]  # worker processes up
    ray.data.range(4).map(lambda row: row).take_all()
    listening = set()
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:  # the instance it started
        try:
            listening |= {(c.laddr.ip, c.laddr.port, proc.name()) for c in proc.net_connections("inet")
                          if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            pass
    joined = subprocess.run([sys.executable, "-c", JOIN], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address})
    assert joined.returncode == 0 and joined.stdout.strip() == "joined", joined.stderr[-3000:]
    print(json.dumps(sorted(listening)))
""")
JOIN = "import ray; from pairsim import cluster; cluster.join_cluster(None); print(ray.get(ray.remote(lambda: 'joined').remote()))"
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@pytest.mark.parametrize("all_interfaces", [False, True])
def test_a_local_instance_listens_on_loopback_unless_asked(tmp_path, all_interfaces):
    """Every listening socket of the processes a local instance starts (GCS, raylet, dashboard
    and its agents with their metrics exporters, workers): on loopback; on every interface with
    ``ray.listen_on_all_interfaces``, as Ray does by default. Either way a second driver joins it
    at the address it gives (``RAY_ADDRESS``), as a sweep's or a test's subprocess does."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", LISTENERS, f"ray.listen_on_all_interfaces={all_interfaces}"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    listening = json.loads(run.stdout.strip().splitlines()[-1])
    assert {name for _, _, name in listening} >= {"gcs_server", "raylet"} and len(listening) >= 6, listening
    exposed = [entry for entry in listening if entry[0] not in LOOPBACK]
    assert bool(exposed) == all_interfaces, exposed
