"""Object storage: locations that are local paths or URIs, against a real S3 API (moto's server
on loopback, started here): shards built into a bucket equal a local build, a killed build into
a bucket resumes, and a training run keeps its data and checkpoints in a bucket, resumes from
it, and never shows the credentials."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from conftest import S3_ENV
from pairsim import storage
from pairsim.config import ConfigError, load_config
from pairsim.data.build_config import BuildConfig
from pairsim.data import builder, shards
from pairsim.storage import Location

SECRET, KEY_ID = S3_ENV["AWS_SECRET_ACCESS_KEY"], S3_ENV["AWS_ACCESS_KEY_ID"]


@pytest.fixture
def bucket(s3_env, monkeypatch) -> str:
    """A new bucket's URI, with the endpoint and credentials in the standard environment."""
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    name = f"pairsim-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(endpoint_override=s3_env["AWS_ENDPOINT_URL"], allow_bucket_creation=True).create_dir(name)
    return f"s3://{name}"


def download(location: Location, to: Path) -> Path:
    pafs.copy_files(location.path, str(to), source_filesystem=location.fs, destination_filesystem=pafs.LocalFileSystem())
    return to


# --------------------------------------------------------------------------- locations

def test_uris_are_checked_and_masked_and_local_paths_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.parse("s3://bucket/run/") == "s3://bucket/run"
    assert storage.parse("file:///data/x") == Path("/data/x")
    assert storage.absolute("data/x") == tmp_path / "data" / "x" and storage.absolute("gs://b/x") == "gs://b/x"
    assert storage.masked("s3://AKIA:hunter2@bucket/x?region=eu&secret_key=hunter2") == \
        "s3://AKIA:***@bucket/x?region=eu&secret_key=***"
    cfg = load_config(None, ["data.path=s3://bucket/data", "ray.storage_path=runs"])
    assert cfg.data.path == "s3://bucket/data" and cfg.ray.storage_path == Path("runs")
    assert cfg.flat()["data.path"] == "s3://bucket/data"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["ray.storage_path=ftp://host/x"])
    assert err.value.keys == ("ray.storage_path",) and "'ftp'" in str(err.value)
    for uri in ("s3://AKIA:hunter2@bucket/x", "s3://bucket/x?session_token=hunter2"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"data.path={uri}"])
        assert err.value.keys == ("data.path",) and "credentials" in str(err.value)
        assert "hunter2" not in str(err.value) and storage.masked(uri) in str(err.value)
    with pytest.raises(ConfigError, match="out: .*credentials"):
        BuildConfig.from_args(format="csv", input=tmp_path, out="s3://k:hunter2@bucket/x")


def test_an_endpoint_with_credentials_in_a_uri_query_is_refused_and_masked(capsys):
    from pairsim import cli

    uri = "s3://bucket/ray?endpoint_override=http://ukey:hunter2@127.0.0.1:9000&scheme=http"
    shown = "s3://bucket/ray?endpoint_override=http://ukey:***@127.0.0.1:9000&scheme=http"
    assert storage.masked(uri) == shown
    assert storage.masked("s3://b/x?endpoint_override=hunter2@host:9000") == "s3://b/x?endpoint_override=***@host:9000"
    assert storage.check_uri("s3://b/x?endpoint_override=127.0.0.1:9000&scheme=http")  # no credentials: taken
    assert cli.main(["doctor", "--set", f"ray.storage_path={uri}"]) == 2
    out, err = capsys.readouterr()
    assert f"ray.storage_path: {shown}:" in err and "credentials" in err
    assert "hunter2" not in out + err


@pytest.mark.parametrize("variable", storage.ENDPOINT_VARS)
def test_an_s3_endpoint_with_credentials_in_the_environment_is_refused_and_masked(bucket, variable, monkeypatch,
                                                                                  capsys):
    from pairsim import cli

    endpoint = os.environ["AWS_ENDPOINT_URL"].replace("://", f"://{KEY_ID}:endpoint-secret-7d1e@")
    monkeypatch.setenv(variable, endpoint)
    shown = endpoint.replace("endpoint-secret-7d1e", "***")
    with pytest.raises(ValueError) as err:
        Location.of(f"{bucket}/data")
    assert str(err.value).startswith(f"{variable}={shown}: credentials do not belong in the endpoint")
    assert cli.main(["doctor", "--set", f"ray.storage_path={bucket}/ray"]) == 2
    out, err = capsys.readouterr()
    assert f"ray.storage_path: {variable}={shown}:" in err and "credentials" in err
    assert "endpoint-secret-7d1e" not in out + err


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_location_writes_reads_lists_and_copies_locally(where, tmp_path, request):
    root = Location.of(tmp_path / "root" if where == "local" else request.getfixturevalue("bucket") + "/root")
    (root / "b.json").write_text('{"x": 1}')
    (root / "a.json").write_bytes(b"{}")
    (root / "sub" / "c.txt").write_text("é")
    assert [f.name for f in root.files(".json")] == ["a.json", "b.json"]
    assert [f.uri for f in root.files(recursive=True)] == [f"{root}/a.json", f"{root}/b.json", f"{root}/sub/c.txt"]
    assert json.loads((root / "b.json").read_text()) == {"x": 1} and (root / "sub" / "c.txt").read_text() == "é"
    assert (root / "a.json").is_file() and (root / "a.json").size() == 2 and not (root / "zzz").is_file()
    assert (root / "sub" / "c.txt").parent.name == "sub" and (root / "nothere").files() == []
    (root / "a.json").delete()
    (root / "a.json").delete()  # nothing to remove: no error
    assert [f.name for f in root.files()] == ["b.json"]
    if where == "local":
        assert not list((tmp_path / "root").rglob("*.tmp"))
    with root.local_copy() as local:
        assert (local / "sub" / "c.txt").read_text() == "é"


def test_doctor_writes_a_probe_to_object_storage_and_names_one_it_cannot_reach(bucket):
    from pairsim import doctor

    [ok] = doctor.storage(load_config(None, [f"ray.storage_path={bucket}/ray"]))
    assert ok.detail == f"{bucket}/ray: reachable and writable (s3)" and not ok.blocking
    assert not Location.of(f"{bucket}/ray").files(recursive=True)  # the probe is removed
    [missing] = doctor.storage(load_config(None, ["ray.storage_path=s3://no-such-bucket-pairsim/ray"]))
    assert missing.blocking and missing.detail.startswith("s3://no-such-bucket-pairsim/ray: cannot be written")
    assert SECRET not in missing.detail


def test_sweeps_keep_uris_as_written_and_refuse_object_storage_for_their_state(tmp_path, monkeypatch):
    from pairsim.cli import DEMO_SWEEP
    from pairsim.tune.space import load_sweep
    from pairsim.tune.sweep import run_sweep

    monkeypatch.chdir(tmp_path)
    sweep = load_sweep(DEMO_SWEEP, ["data.path=s3://bucket/data", "ray.storage_path=runs"])
    trial = sweep.trial_config(sweep.points_to_check()[0])
    assert trial.data.path == "s3://bucket/data" and trial.ray.storage_path == tmp_path / "runs"
    sweep = load_sweep(DEMO_SWEEP, ["ray.storage_path=s3://bucket/runs"])
    with pytest.raises(ConfigError) as err:
        run_sweep(sweep, "s")
    assert err.value.keys == ("ray.storage_path",) and "s3://bucket/runs" in str(err.value)


SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def test_a_run_on_data_in_a_bucket_logs_no_secret_of_the_environment(bucket, tiny_dataset, tmp_path, monkeypatch,
                                                                     capfd):
    """Params, tags, config.yaml, the DeepSpeed config, dataset inputs and the console of a run
    opened on S3 data hold none of the secrets the environment gives S3 and MLflow."""
    from mlflow.tracking import MlflowClient

    from pairsim import log, tracking
    from pairsim.train import engine

    log.setup()  # pairsim's log lines on the console, as the command line has them
    markers = {name: f"{name.lower()}-marker-{uuid.uuid4().hex[:8]}" for name in SECRET_VARIABLES}
    for name, marker in markers.items():
        monkeypatch.setenv(name, marker)
    data = Location.of(f"{bucket}/shapes")
    pafs.copy_files(str(tiny_dataset), data.path, destination_filesystem=data.fs)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [f"data.path={data}", f"tracking.tracking_uri={uri}"])
    run_id = tracking.open_run(cfg, "secrets", cfg.to_yaml(), engine.deepspeed_config(cfg.train, cfg.optim, 10))
    tracking.log_datasets(uri, run_id, shards.RunData.read(cfg.data))
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    datasets = [i.dataset for i in run.inputs.dataset_inputs]
    assert {json.loads(d.source)["uri"] for d in datasets} == {str(data)}  # the data was read from the bucket
    logged = [json.dumps([run.data.params, run.data.tags]), *(repr(d) for d in datasets), *capfd.readouterr()]
    logged += [Path(client.download_artifacts(run_id, name, str(tmp_path))).read_text()
               for name in ("config.yaml", "deepspeed_config.json")]
    assert not [(name, text) for text in logged for name, marker in markers.items() if marker in text]


# --------------------------------------------------------------------------- shards

def _folder_source(src: Path, images: int) -> Path:
    from PIL import Image

    src.mkdir()
    lines = []
    for i in range(images):
        Image.new("RGB", (32 + i, 24), (i * 7 % 256, 80, 160)).save(src / f"{i:03d}.png")
        lines.append(json.dumps({"file": f"{i:03d}.png", "captions": [f"scene {i}", f"picture {i}"]}))
    lines.append(json.dumps({"file": "missing.png", "captions": ["gone"]}))
    (src / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return src / "captions.jsonl"


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and (p.suffix in (".parquet", ".jsonl") or p.name == shards.MANIFEST)}


@pytest.mark.slow  # a Ray instance: order-dependent beside tests that want none
def test_shards_built_into_a_bucket_equal_a_local_build(ray_instance, bucket, tmp_path):
    source = _folder_source(tmp_path / "src", 12)
    options = dict(format="folder", input=source, rows_per_shard=5, val_share=0.25, max_reject_share=0.5)
    local = builder.build(BuildConfig(out=tmp_path / "local", **options), progress=False)
    remote = builder.build(BuildConfig(out=f"{bucket}/data", **options), progress=False)
    assert remote == local and remote.rejected == 1
    assert _tree(download(Location.of(f"{bucket}/data"), tmp_path / "copy")) == _tree(tmp_path / "local")
    assert shards.split_files(f"{bucket}/data", "train")[0].startswith(f"{bucket}/data/train/part-")
    assert shards.read_rows(f"{bucket}/data", "val", ["003", "001", "002", "000"]) == \
        shards.read_rows(tmp_path / "local", "val", ["003", "001", "002", "000"])
    report = shards.inspect(f"{bucket}/data", samples=2, sheet=tmp_path / "sheet.png")
    assert f"{bucket}/data: folder:captions.jsonl" in report and (tmp_path / "sheet.png").is_file()


@pytest.mark.slow
def test_a_build_into_a_bucket_killed_midway_resumes_to_the_same_output(ray_instance, bucket, tmp_path, capfd):
    """One image per shard, 60 shards: a build into the bucket killed (its own process and Ray
    instance), the same command again, compared with a local build (both on the session's
    instance); no credential in any line they print."""
    from pairsim import cli

    source = _folder_source(tmp_path / "src", 60)
    out = Location.of(f"{bucket}/killed")
    markers = out / builder.MARKERS / "train"

    def command(target):
        return ["shards", "build", "--format", "folder", "--input", str(source), "--out", str(target),
                "--rows-per-shard", "1", "--max-reject-share", "0.5"]

    assert cli.main(command(tmp_path / "whole")) == 0
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "pairsim.cli", *command(out)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while len(markers.files(".json")) < 5:
        assert proc.poll() is None and time.time() < deadline, "the build ended before it could be killed"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray instance it started
    proc.wait()
    done_at_kill = len(markers.files(".json"))
    assert done_at_kill < 60 and not (out / shards.MANIFEST).is_file()

    capfd.readouterr()
    assert cli.main(command(out)) == 0
    printed = "".join(capfd.readouterr())
    assert f"wrote {out}: train 60 images" in printed and SECRET not in printed
    assert _tree(download(out, tmp_path / "copy")) == _tree(tmp_path / "whole")
    assert not out.files(".tmp", recursive=True)


# --------------------------------------------------------------------------- training

@pytest.mark.slow
def test_a_run_on_object_storage_checkpoints_there_and_resumes_from_it(ray_instance, tiny_dataset, bucket,
                                                                       tmp_path, capfd):
    """Data and checkpoints in the bucket; a second run of the same name continues at the next
    step from the checkpoint there. The credentials are in no param, artifact or console line."""
    from mlflow.tracking import MlflowClient

    from pairsim.cli import DEMO_CONFIG, main
    from pairsim.train import driver

    data = Location.of(f"{bucket}/data")
    pafs.copy_files(str(tiny_dataset), data.path, destination_filesystem=data.fs)
    def config(epochs: int, test_split: str | None = "test"):
        return load_config(DEMO_CONFIG, [
            f"data.path={data}", f"ray.storage_path={bucket}/ray", "ray.run_name=on-s3", f"train.epochs={epochs}",
            "train.num_workers=1", "train.micro_batch_size=32", "train.log_every_n_steps=4", "optim.warmup_steps=4",
            "eval.batch_size=64", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            f"data.test_split={test_split or 'null'}"])

    steps_per_epoch = driver.plan_run(config(1)).steps_per_epoch

    first = driver.fit(config(1, test_split=None))  # the bucket's test split is embedded once, at the resumed run's end
    resumed = driver.fit(config(2), resume=True)
    assert resumed.test_metrics["rsum"] > 0
    assert first.metrics["step"] == steps_per_epoch and resumed.metrics["step"] == 2 * steps_per_epoch
    assert resumed.mlflow_run_id == first.mlflow_run_id
    assert resumed.checkpoint_path.startswith(f"{bucket}/ray/on-s3/checkpoint_")
    checkpoints = {f.parent.name for f in Location.of(f"{bucket}/ray/on-s3").files(recursive=True)
                   if f.parent.name == "deepspeed"}
    assert checkpoints  # DeepSpeed's files are in the bucket
    assert not Location.of(f"{bucket}/ray/on-s3/{driver.RUN_LOCK}").is_file()  # held while it ran, then released
    with Location.of(resumed.checkpoint_path).local_copy() as ckpt:
        import torch

        states = torch.load(ckpt / "deepspeed" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        assert states["global_steps"] == 2 * steps_per_epoch  # continued, not restarted

    exported = tmp_path / "export" / "model.pt"  # the best checkpoint, by its URI
    assert main(["export", "--checkpoint", resumed.best_checkpoint_path, "--tracking-uri", first.tracking_uri,
                 "--out", str(exported)]) == 0
    assert exported.is_file()

    client = MlflowClient(first.tracking_uri)
    mlflow_run = client.get_run(first.mlflow_run_id)
    assert mlflow_run.data.params["data.path"] == str(data)
    sources = {json.loads(d.dataset.source)["uri"] for d in mlflow_run.inputs.dataset_inputs}
    assert sources == {str(data)} and {d.dataset.source_type for d in mlflow_run.inputs.dataset_inputs} == {"s3"}
    assert mlflow_run.data.tags["pairsim.best_checkpoint"].startswith(f"{bucket}/ray/on-s3/checkpoint_")
    artifacts = Path(mlflow_run.info.artifact_uri.removeprefix("file://"))
    logged = [json.dumps(mlflow_run.data.params), json.dumps(mlflow_run.data.tags)] + [
        p.read_text(errors="replace") for p in artifacts.rglob("*") if p.suffix in (".yaml", ".json")]
    console = capfd.readouterr()
    for text in logged + [console.out, console.err]:
        assert SECRET not in text and KEY_ID not in text
    assert not Path("ray_results").exists() or "on-s3" not in os.listdir("ray_results")
