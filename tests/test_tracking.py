"""The MLflow run a job opens carries the tags MLflow's own API would give it, and the pairsim
source's commit; its datasets, queued metrics and system metrics."""

import getpass
import json
import subprocess
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from conftest import new_experiment
from pairsim import tracking
from pairsim.config import load_config
from pairsim.data import shards

SOURCE = Path(tracking.__file__).parent


def test_a_run_carries_user_source_commit_and_version(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [f"tracking.tracking_uri={uri}"])
    run_id = tracking.open_run(cfg, "tagged", cfg.to_yaml(), {}, tags={"mine": "1"})
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["mlflow.user"] == getpass.getuser() and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.name"] and tags["mine"] == "1" and tags[tracking.RUN_NAME_TAG] == "tagged"
    try:
        version = metadata.version("pairsim")
    except metadata.PackageNotFoundError:
        version = "source"
    assert tags["pairsim.version"] == version
    head = subprocess.run(["git", "-C", str(SOURCE), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        pytest.skip("pairsim does not run from a git checkout here")
    assert tags["mlflow.source.git.commit"] == head.stdout.strip()


def test_experiments_are_tagged_and_linked_in_the_training_runs_workspace_of_mlflows_ui(tmp_path):
    """The kind tag on new and older experiments; the printed link opens the run in the UI's
    "Model training" workspace (checked by hand in headless Chromium on MLflow 3.17.2: without
    ?workflowType=machine_learning the UI opens the GenAI overview, tag or not)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    older = new_experiment(uri, "made-untagged")  # as a pairsim before the tag made it
    for experiment in ("made-untagged", "new"):
        cfg = load_config(None, [f"tracking.tracking_uri={uri}", f"tracking.experiment={experiment}"])
        run_id = tracking.open_run(cfg, f"run-in-{experiment}", cfg.to_yaml(), {})
        tags = client.get_experiment_by_name(experiment).tags
        assert tags["mlflow.experimentKind"] == "custom_model_development", experiment
        experiment_id = client.get_experiment_by_name(experiment).experiment_id
        assert tracking.ui_url(uri, run_id) == (f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}"
                                                "?workflowType=machine_learning")
    assert client.get_experiment_by_name("made-untagged").experiment_id == older


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One sqlite store for the module's tests (creating one takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


def new_run(uri: str) -> tuple[MlflowClient, str]:
    client = MlflowClient(uri)
    return client, client.create_run(new_experiment(uri)).info.run_id


def test_datasets_are_logged_with_the_manifests_content_hashes(store, tiny_dataset):
    client, run_id = new_run(store)
    tracking.log_datasets(store, run_id, shards.RunData.read(load_config(None, [f"data.path={tiny_dataset}"]).data))
    splits = shards.read_manifest(tiny_dataset).splits
    logged = {i.tags[0].value: i.dataset for i in client.get_run(run_id).inputs.dataset_inputs}
    assert set(logged) == {"training", "validation", "testing"}
    for context, split in (("training", "train"), ("validation", "val"), ("testing", "test")):
        dataset = logged[context]
        assert dataset.name == f"{tiny_dataset.name}/{split}"
        assert splits[split].content_hash.startswith(dataset.digest) and len(dataset.digest) == 36
        assert json.loads(dataset.source) == {"uri": str(tiny_dataset.resolve())}
        assert json.loads(dataset.profile) == {"split": split, "content_hash": splits[split].content_hash} | {
            k: getattr(splits[split], k) for k in ("images", "captions", "shards")}


@pytest.mark.parametrize("test_split, test", [("held", True), ("test", False)])
def test_a_test_split_that_is_missing_or_unused_is_not_logged(store, tiny_dataset, test_split, test):
    client, run_id = new_run(store)
    data = load_config(None, [f"data.path={tiny_dataset}", f"data.test_split={test_split}"]).data
    tracking.log_datasets(store, run_id, shards.RunData.read(data), test=test)
    assert {i.tags[0].value for i in client.get_run(run_id).inputs.dataset_inputs} == {"training", "validation"}


def test_metrics_are_queued_and_all_there_in_order_after_a_flush(store):
    client, run_id = new_run(store)
    run = tracking.RunLogger(store, run_id)
    for step in range(1, 51):
        run.log_metrics({"train/loss": 1 / step, "val/i2t_R@1": step}, step)
    run.flush()
    history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(s, 1 / s) for s in range(1, 51)]
    assert [m.timestamp for m in history] == sorted(m.timestamp for m in history)  # stamped when logged
    assert len(client.get_metric_history(run_id, "val/i2t_R1")) == 50


@pytest.mark.parametrize("continues_run", [True, False])
def test_an_attempt_that_continues_a_run_logs_no_step_twice(store, continues_run):
    """A lost attempt logged train/loss to step 6 and val at step 4; the attempt resumed from
    step 3's checkpoint logs steps 4–8 and val at 4 and 8: each step once, the first attempt's
    points kept (without ``continues_run`` steps 4–6 and val's 4 are there twice)."""
    client, run_id = new_run(store)
    with tracking.RunLogger(store, run_id, close_timeout=30) as lost:
        for step in range(1, 7):
            lost.log_metrics({"train/loss": 1.0}, step)
        lost.log_metrics({"val/i2t_R@1": 10.0}, 4)
    with tracking.RunLogger(store, run_id, close_timeout=30, continues_run=continues_run) as resumed:
        assert resumed.logged_before("val/i2t_R@1", 4) == continues_run and not resumed.logged_before("val/i2t_R@1", 8)
        for step in range(4, 9):
            resumed.log_metrics({"train/loss": 2.0} | ({"val/i2t_R@1": 20.0} if step in (4, 8) else {}), step)
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    val = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "val/i2t_R1"))
    if continues_run:
        assert loss == [(s, 1.0) for s in range(1, 7)] + [(7, 2.0), (8, 2.0)]
        assert val == [(4, 10.0), (8, 20.0)]
    else:
        assert len(loss) == 11 and len(val) == 3


def test_a_failed_metric_write_raises_at_the_flush(store):
    client, run_id = new_run(store)
    run = tracking.RunLogger(store, run_id)
    client.delete_run(run_id)
    run.log_metrics({"train/loss": 1.0}, 1)  # queued: no round trip here
    with pytest.raises(MlflowException, match="active"):
        run.flush()


def test_system_metrics_are_sampled_until_close(store):
    client, run_id = new_run(store)
    run = tracking.RunLogger(store, run_id, system_metrics_interval_s=0.2)
    time.sleep(1.5)
    run.close()
    metrics = client.get_run(run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(metrics)
    steps = [m.step for m in client.get_metric_history(run_id, "system/cpu_utilization_percentage")]
    assert steps == list(range(len(steps))) and len(steps) >= 2
    time.sleep(0.5)  # closed: no more samples
    assert len(client.get_metric_history(run_id, "system/cpu_utilization_percentage")) == len(steps)


def test_credentials_in_a_tracking_uri_are_refused_and_masked(monkeypatch):
    from pairsim import storage
    from pairsim.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["tracking.tracking_uri=https://alice:s3cr3t@mlflow.example:5000"])
    assert err.value.keys == ("tracking.tracking_uri",)
    assert "s3cr3t" not in str(err.value) and "MLFLOW_TRACKING_PASSWORD" in str(err.value)
    with pytest.raises(ConfigError, match=r"token=\*\*\*") as err:
        load_config(None, ["tracking.tracking_uri=https://mlflow.example/?token=abc123"])
    assert "abc123" not in str(err.value)
    assert storage.masked("https://alice:s3cr3t@host/x") == "https://alice:***@host/x"
    assert storage.masked("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"  # nothing to hide: as written


def test_credentials_in_a_tracking_uri_from_the_environment_or_command_line_are_refused_and_masked(
        tmp_path, monkeypatch, capfd):
    from conftest import unused_port
    from pairsim import cli
    from pairsim.config import ConfigError

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # should MLflow be asked, it answers at once
    uri = f"http://alice:uri-token-91c4@127.0.0.1:{unused_port()}"  # nothing listens
    shown = uri.replace("uri-token-91c4", "***")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(ConfigError) as err:
        tracking.resolve_tracking_uri(None)
    assert str(err.value).startswith(f"MLFLOW_TRACKING_URI: {shown}:") and "credentials" in str(err.value)
    assert "MLFLOW_TRACKING_PASSWORD" in str(err.value)
    export = ["export", "--run-id", "0" * 32, "--out", str(tmp_path / "model.pt")]
    assert cli.main(export) == 2
    console = "".join(capfd.readouterr())
    assert f"MLFLOW_TRACKING_URI: {shown}:" in console and "uri-token-91c4" not in console
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(SystemExit):
        cli.main([*export, "--tracking-uri", uri])
    console = "".join(capfd.readouterr())
    assert f"--tracking-uri: {shown}:" in console and "uri-token-91c4" not in console


def test_an_unreachable_tracking_server_is_named_in_seconds_not_minutes(tmp_path):
    import socket
    import time

    from conftest import unused_port
    from pairsim.config import ConfigError

    port = unused_port()
    with pytest.raises(ConfigError) as err:
        tracking.check_reachable(f"http://127.0.0.1:{port}")  # nothing listens
    assert str(err.value).startswith("tracking.tracking_uri:") and f"http://127.0.0.1:{port}" in str(err.value)
    assert "ConnectionError" in str(err.value)  # what requests said
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        started = time.monotonic()
        with pytest.raises(ConfigError) as err:
            tracking.check_reachable(f"http://u:secret@127.0.0.1:{silent.getsockname()[1]}", timeout=1)
        assert "1 s" in str(err.value) and ("ReadTimeout" in str(err.value) or "ConnectTimeout" in str(err.value))
        assert "secret" not in str(err.value)
        assert time.monotonic() - started < 5
    with pytest.raises(ConfigError, match="cannot write to /nonexistent"):
        tracking.check_reachable("sqlite:////nonexistent/dir/mlflow.db")
    tracking.check_reachable(f"sqlite:///{tmp_path}/mlflow.db")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    # extended: a training run loses a server on SQLite in the test command (tests/faults, the MLflow outage)
    pytest.param("sqlite", marks=pytest.mark.extended), "postgres+s3"])
def test_training_logging_survives_an_mlflow_outage(tmp_path, caplog, request, layout, monkeypatch):
    """The server dies mid-run: logging returns at once, pictures are skipped with a warning,
    metrics wait in the buffer; the run ends while it is away and it comes back: every metric is
    there exactly once, sent within seconds, not when the sender's backoff (30 s here) runs out. A
    later logger of the run loses the server at its end: what is unsent stays in the spill file,
    named. On a server with its runs in SQLite and artifacts on its disk, and on one as teams run
    it (PostgreSQL, S3)."""
    from conftest import start_mlflow_server, unused_port

    port = unused_port()
    uri = f"http://127.0.0.1:{port}"
    store = request.getfixturevalue("team_mlflow")(tmp_path) if layout == "postgres+s3" else {}
    server = start_mlflow_server(tmp_path, port, **store)
    client, run_id = new_run(uri)
    monkeypatch.setattr(tracking.RunLogger, "RETRY_S", (30,))  # as it is after a few failed attempts
    run = tracking.RunLogger(uri, run_id, tolerate_outage=True, spill_dir=tmp_path, close_timeout=60)
    for step in range(1, 11):
        run.log_metrics({"train/loss": 1 / step}, step)
    assert run.flush(timeout=60)
    server.terminate()
    server.wait(timeout=30)

    started = time.monotonic()
    for step in range(11, 31):
        run.log_metrics({"train/loss": 1 / step}, step)  # the training step: never waits
    assert time.monotonic() - started < 1
    picture = tmp_path / "p.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n")
    run.log_artifact(picture, "val")  # one short attempt, then a warning
    time.sleep(3)
    assert not run.flush(timeout=60)  # no wait during the outage
    assert time.monotonic() - started < 60
    assert "MLflow cannot be reached" in caplog.text and "artifact p.png not logged" in caplog.text

    closing = threading.Thread(target=run.close)  # the run's end, waiting for its metrics
    closing.start()
    server = start_mlflow_server(tmp_path, port, **store)  # same store: the run is still there
    back = time.monotonic()
    closing.join(timeout=60)
    assert time.monotonic() - back < 5  # the sender's next retry was 30 s away
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 31))  # each step once
    assert not run.spill_file.exists()

    last = tracking.RunLogger(uri, run_id, tolerate_outage=True, spill_dir=tmp_path, close_timeout=5)
    server.terminate()
    server.wait(timeout=30)
    for step in range(31, 36):
        last.log_metrics({"train/loss": 1 / step}, step)
    last.close()
    spilled = [json.loads(line) for line in last.spill_file.read_text().splitlines()]
    assert [m[3] for m in spilled] == list(range(31, 36)) and str(last.spill_file) in caplog.text


@pytest.mark.slow
def test_a_team_mlflow_server_keeps_runs_in_postgresql_and_proxies_artifacts_to_s3(tmp_path, team_mlflow, s3_env):
    """The layout of "MLflow for a team": what pairsim logs through the server lands in the
    PostgreSQL database (the run's row and its metrics) and the S3 bucket (the picture), and a
    model version registered there reads back."""
    import boto3
    import psycopg

    from conftest import start_mlflow_server, unused_port

    port, store = unused_port(), team_mlflow(tmp_path)
    server = start_mlflow_server(tmp_path, port, **store)
    try:
        uri = f"http://127.0.0.1:{port}"
        client, run_id = new_run(uri)
        picture = tmp_path / "retrieval.png"
        picture.write_bytes(b"\x89PNG\r\n\x1a\n" + b"pairsim" * 100)
        with tracking.RunLogger(uri, run_id) as run:
            run.log_metrics({"val/rsum": 123.5}, 7)
            run.log_artifact(picture, "val")
        client.create_registered_model("pairsim-team")
        version = client.create_model_version("pairsim-team", f"runs:/{run_id}/val", run_id=run_id)

        with psycopg.connect(store["backend_store_uri"].replace("postgresql+psycopg://", "postgresql://")) as db:
            assert db.execute("SELECT value, step FROM metrics WHERE run_uuid = %s AND key = %s",
                              (run_id, "val/rsum")).fetchall() == [(123.5, 7)]
            assert db.execute("SELECT name FROM registered_models").fetchall() == [("pairsim-team",)]
        bucket, prefix = store["artifacts"].removeprefix("s3://").split("/", 1)
        s3 = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], region_name=s3_env["AWS_DEFAULT_REGION"],
                          aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"])
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
        stored, = [k for k in keys if k.endswith(f"{run_id}/artifacts/val/retrieval.png")]
        assert s3.get_object(Bucket=bucket, Key=stored)["Body"].read() == picture.read_bytes()
        assert client.get_run(run_id).info.artifact_uri.startswith("mlflow-artifacts:")  # proxied: clients need no S3
        assert client.get_model_version("pairsim-team", version.version).run_id == run_id
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_registering_an_export_without_a_run_writes_beside_the_store_not_into_the_working_directory(
        tmp_path, monkeypatch):
    """``pairsim export --register`` from a checkpoint (no run): a new run of pairsim's experiment
    holds the model, its artifacts beside the sqlite store; MLflow's default experiment would have
    put them in ``./mlruns`` of whatever directory the command ran in."""
    from pairsim.config import ModelConfig
    from pairsim.models import retrieval

    weights = tmp_path / "export" / "model.pt"
    model = retrieval.create_retrieval_model(ModelConfig())
    retrieval.write_exported(retrieval.model_card(ModelConfig(), model, zero_stage=0, epoch=1, step=10, val={}),
                             model.state_dict(), weights)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    assert int(tracking.register_model(weights, "no-run", uri)) == 1 and list(work.iterdir()) == []
    client = MlflowClient(uri)
    run = client.get_run(client.get_model_version("no-run", "1").run_id)
    assert client.get_experiment(run.info.experiment_id).name == "pairsim"
    assert run.info.artifact_uri.startswith((tmp_path / "store" / "mlartifacts").as_uri())
