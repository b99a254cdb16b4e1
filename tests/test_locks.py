"""One writer per name (issue 31, item 1): a run, a sweep and a shard build hold a lock under
their storage location while they live; a second one on the same name is refused in seconds,
before Ray starts, naming the holder; a lock whose holder is gone is taken over."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from conftest import new_experiment
from pairsim import cli, locks
from pairsim.config import ConfigError, load_config
from pairsim.data import builder
from pairsim.data.build_config import BuildConfig
from pairsim.errors import InputError
from pairsim.storage import Location
from pairsim.train import driver


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def lock_file(path: Location, **fields) -> None:
    """A lock as another holder wrote it: ``fields`` over a live-looking holder elsewhere."""
    holder = locks.Holder(user="someone", host="elsewhere", pid=4242, started="2026-01-01T00:00:00+00:00",
                          command="pairsim train", token="t0k3n", heartbeat=time.time())
    path.write_bytes(json.dumps(holder.model_dump() | fields).encode())


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path) -> Location:
    if request.param == "local":
        return Location.of(tmp_path / "runs")
    s3_env = request.getfixturevalue("s3_env")
    monkeypatch = request.getfixturevalue("monkeypatch")
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    bucket = f"locks-{time.time_ns()}"
    pafs.S3FileSystem(endpoint_override=s3_env["AWS_ENDPOINT_URL"], allow_bucket_creation=True).create_dir(bucket)
    return Location.of(f"s3://{bucket}/runs")


def test_a_second_holder_is_refused_naming_the_first_until_it_releases(where):
    path = where / "run-a" / "pairsim-run.lock"
    first = locks.acquire(path, "ray.run_name 'run-a'")
    with pytest.raises(locks.NameInUse) as refused:
        locks.acquire(path, "ray.run_name 'run-a'")
    message = str(refused.value)  # the name, the holder's host and pid, the lock
    assert message.startswith("ray.run_name 'run-a'") and f"@{socket.gethostname()} pid {os.getpid()} " in message
    assert str(path) in message
    assert json.loads(path.read_text())["pid"] == os.getpid()
    first.release()
    assert not path.is_file()
    locks.acquire(path, "ray.run_name 'run-a'").release()


def test_a_lock_whose_holder_is_gone_is_taken_over_with_a_warning(where, caplog):
    here = where / "here.lock"
    lock_file(here, host=socket.gethostname(), pid=dead_pid())
    with caplog.at_level("WARNING", logger="pairsim.locks"):
        locks.acquire(here, "a").release()
    assert "taking over the lock of someone@" in caplog.text and "has ended" in caplog.text

    silent = where / "silent.lock"
    lock_file(silent, heartbeat=time.time() - locks.STALE_AFTER_S - 60)
    locks.acquire(silent, "b").release()
    assert "heartbeat stopped" in caplog.text

    alive_elsewhere = where / "elsewhere.lock"  # another host, heartbeat fresh: may be running
    lock_file(alive_elsewhere)
    with pytest.raises(locks.NameInUse, match="in use by someone@elsewhere pid 4242"):
        locks.acquire(alive_elsewhere, "c")
    assert json.loads(alive_elsewhere.read_text())["token"] == "t0k3n"


def test_the_holder_keeps_its_heartbeat_and_never_removes_a_lock_taken_from_it(tmp_path, monkeypatch):
    monkeypatch.setattr(locks, "HEARTBEAT_S", 0.05)
    path = Location.of(tmp_path / "x.lock")
    lock = locks.acquire(path, "x")
    first = json.loads(path.read_text())["heartbeat"]
    time.sleep(0.5)
    assert json.loads(path.read_text())["heartbeat"] > first
    lock_file(path)  # taken over by another holder (e.g. after a long pause of this one)
    lock.release()
    assert json.loads(path.read_text())["token"] == "t0k3n"


def test_something_else_in_the_locks_place_is_named_not_overwritten(tmp_path):
    path = tmp_path / "y.lock"
    path.write_text("my notes")
    with pytest.raises(locks.NameInUse) as refused:
        locks.acquire(Location.of(path), "y")
    message = str(refused.value)
    assert message.startswith("y:") and f"{path}: not JSON" in message and "delete it" in message  # the remedy
    assert path.read_text() == "my notes"


@pytest.mark.parametrize("fields, problem", [
    ({"pid": "abc"}, "pid: Input should be a valid integer"),
    ({"pid": 1.5}, "pid: Input should be a valid integer"),
    ({"pid": 2**70}, "pid: Input should be less than"),
    ({"pid": -1}, "pid: Input should be greater than 0"),
    ({"heartbeat": "x"}, "heartbeat: Input should be a valid number"),
    ({"heartbeat": float("nan")}, "heartbeat: Input should be a finite number"),
    ({"token": None}, "token: Input should be a valid string"),
    ({"heartbeat": 1e300}, "heartbeat: Value error, 1e+300 s ahead of this host's clock"),  # never stale
    ({"heartbeat": time.time() + 1e6}, "heartbeat: Value error, "),  # how far ahead: by when the test runs
    ({"heartbeat": -1.0}, "heartbeat: Input should be greater than or equal to 0"),
    ({"started": "2999-01-01T00:00:00+00:00"}, "e+10 s ahead of this host's clock"),
    ({"started": "\x1b[2J yesterday"}, "started: Value error, not a time in ISO 8601"),
    ({"started": "2026-01-01T00:00:00"}, "started: Value error, a time without its time zone"),
])
def test_a_lock_with_a_field_of_another_type_is_refused_in_one_line_naming_it(tmp_path, fields, problem):
    """On this host, so that the pid would be checked; a wrong type, or a time later than a
    clock's skew allows, is never used: refused rather than taken for stale, as the lock may be a
    live run's (on a host whose clock is far ahead)."""
    path = Location.of(tmp_path / "z.lock")
    lock_file(path, host=socket.gethostname(), **fields)
    written = path.read_bytes()
    with pytest.raises(locks.NameInUse) as refused:
        locks.acquire(path, "z")
    assert str(refused.value).startswith("z:") and f"1 error(s) in {path}" in str(refused.value)
    assert problem in str(refused.value) and "\n" not in str(refused.value)
    assert path.read_bytes() == written


@pytest.mark.parametrize("content, problem", [
    (b"[1, 2]", "Input should be a valid dictionary"),
    (b"{" + b" " * locks.MAX_LOCK_BYTES + b"}", f"larger than {locks.MAX_LOCK_BYTES:,} bytes"),
    (b"\xff\xfe", "not JSON"),
])
def test_a_lock_of_another_shape_or_size_is_refused_in_one_line(tmp_path, content, problem):
    path = tmp_path / "w.lock"
    path.write_bytes(content)
    with pytest.raises(locks.NameInUse, match=problem) as refused:
        locks.acquire(Location.of(path), "w")
    assert "\n" not in str(refused.value) and path.read_bytes() == content


@pytest.mark.parametrize("given_as", ["location", "path"])
def test_a_link_in_the_locks_place_is_named_not_followed_nor_created_through(tmp_path, given_as):
    """A dangling link, and a link to someone's file: each refused naming the link and where it
    leads; nothing is created at, written to or removed from its target, and the link stays."""
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "theirs.json").write_bytes(b"their file")
    for name, target in (("dangling.lock", tmp_path / "nowhere"), ("theirs.lock", tmp_path / "theirs.json")):
        (runs / name).symlink_to(target)
        lock = Location.of(runs) / name if given_as == "location" else runs / name
        with pytest.raises(locks.NameInUse) as refused:
            locks.acquire(lock, "ray.run_name 'r'")
        message = str(refused.value)
        assert message.startswith("ray.run_name 'r':") and f"{runs / name}: a symbolic link (to {target})" in message
        assert "\n" not in message and (runs / name).is_symlink()
    assert not (tmp_path / "nowhere").exists() and (tmp_path / "theirs.json").read_bytes() == b"their file"


def test_a_holders_words_are_printed_cut_and_escaped(tmp_path, caplog):
    """What a lock says of its holder is text another user wrote: no escape sequence or line of
    it reaches the terminal, and no more than a cut of it."""
    live, gone = Location.of(tmp_path / "live.lock"), Location.of(tmp_path / "gone.lock")
    words = {"user": "\x1b[2J\x1b[31mroot", "host": "elsewhere\npairsim: all good", "command": "x" * 3000}
    lock_file(live, **words)
    lock_file(gone, **words, heartbeat=time.time() - locks.STALE_AFTER_S - 60)
    with pytest.raises(locks.NameInUse) as refused:
        locks.acquire(live, "r")
    with caplog.at_level("WARNING", logger="pairsim.locks"):
        locks.acquire(gone, "s").release()
    for shown in (str(refused.value), caplog.text.strip()):
        assert "\x1b" not in shown and "\n" not in shown and len(shown) < 1000, shown
        assert "\\x1b[2J\\x1b[31mroot@elsewhere\\npairsim: all good" in shown and "(2,800 more)" in shown


def test_a_run_or_sweep_directory_that_is_a_link_is_refused_and_nothing_goes_through_it(tiny_dataset, tmp_path,
                                                                                        capsys, monkeypatch):
    """``<ray.storage_path>/<ray.run_name>`` (train) and ``<ray.storage_path>/<--name>`` (tune) that
    is a symbolic link: refused before Ray, exit 2, naming the link and where it leads; nothing is
    written where it leads."""
    from pairsim import cluster
    from pairsim.config import ConfigError
    from pairsim.tune import sweep as sweeps
    from pairsim.tune.space import load_sweep

    monkeypatch.setattr(cluster, "init_ray", lambda *a, **k: pytest.fail("Ray was started before the refusal"))
    run, elsewhere = run_yaml(tiny_dataset, tmp_path), tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "runs").mkdir()
    for name in ("same", "linked-sweep"):
        (tmp_path / "runs" / name).symlink_to(elsewhere)
    with pytest.raises(ConfigError) as refused:
        driver.fit(load_config(run))
    assert str(refused.value).startswith("ray.run_name:") and f"runs/same is a symbolic link (to {elsewhere})" in \
        str(refused.value)
    assert cli.main(["train", "--config", str(run)]) == 2
    assert "ray.run_name:" in capsys.readouterr().err
    space = tmp_path / "space.yaml"
    space.write_text(f"base: {{config: [{run}]}}\nspace: {{loss.base.margin: {{uniform: [0.1, 0.3]}}}}\n"
                     "sweep: {num_samples: 1}\n")
    with pytest.raises(ConfigError) as refused:
        sweeps.run_sweep(load_sweep(space), "linked-sweep")
    assert str(refused.value).startswith("--name:") and f"runs/linked-sweep is a symbolic link (to {elsewhere})" in \
        str(refused.value)
    assert cli.main(["tune", "--space", str(space), "--name", "linked-sweep"]) == 2
    assert list(elsewhere.iterdir()) == []


def test_a_lock_in_a_place_that_cannot_be_written_is_refused_naming_it(tmp_path):
    (tmp_path / "a-file").write_text("")
    under_a_file = Location.of(tmp_path / "a-file" / "run" / "pairsim-run.lock")
    with pytest.raises(InputError) as refused:
        locks.acquire(under_a_file, "ray.run_name 'r'")
    assert str(refused.value).startswith("ray.run_name 'r':") and str(under_a_file) in str(refused.value)
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if os.access(read_only, os.W_OK):
        pytest.skip("this user writes into read-only directories (root)")
    with pytest.raises(InputError) as refused:
        locks.acquire(read_only / "run" / "pairsim-run.lock", "ray.run_name 'r'")
    assert f"{read_only}/run/pairsim-run.lock" in str(refused.value) and "Permission denied" in str(refused.value)


def run_yaml(tiny_dataset, tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"data: {{path: {tiny_dataset}, test_split: null}}\ntrain: {{micro_batch_size: 16, epochs: 1}}\n"
                    f"ray: {{storage_path: {tmp_path / 'runs'}, run_name: same}}\n"
                    f"tracking: {{tracking_uri: 'sqlite:///{tmp_path}/mlflow.db'}}\n")
    return path


def test_a_run_sweep_or_build_on_a_held_name_is_refused_before_ray_starts(tiny_dataset, tmp_path, capsys):
    """Refused before anything is started or written: no MLflow run, no sweep state, no shard."""
    from pairsim import tracking

    storage, run = tmp_path / "runs", run_yaml(tiny_dataset, tmp_path)
    with locks.hold(Location.of(storage) / "same" / driver.RUN_LOCK, "another run"):
        started = time.monotonic()
        with pytest.raises(locks.NameInUse) as refused:
            driver.fit(load_config(run))
        assert str(refused.value).startswith("ray.run_name 'same'") and f" pid {os.getpid()} " in str(refused.value)
        assert cli.main(["train", "--config", str(run)]) == 2
        assert time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert err.startswith("pairsim: ray.run_name 'same'") and f" pid {os.getpid()} " in err
    assert cli.main(["train", "--config", str(run), "--resume"]) == 2  # nothing to resume: refused, lock let go
    err = capsys.readouterr().err
    assert "--resume:" in err and "'same'" in err and "'pairsim'" in err  # the flag, the run, the experiment
    assert not (storage / "same" / driver.RUN_LOCK).exists()
    assert tracking.previous_attempt(f"sqlite:///{tmp_path}/mlflow.db", "pairsim", "same") is None

    from pairsim.tune import sweep as sweeps
    from pairsim.tune.space import load_sweep

    space = tmp_path / "space.yaml"
    space.write_text(f"base: {{config: [{run}]}}\nspace: {{loss.base.margin: {{uniform: [0.1, 0.3]}}}}\n"
                     "sweep: {num_samples: 1}\n")
    sweep = load_sweep(space)
    with locks.hold(Location.of(storage) / "busy" / sweeps.SWEEP_LOCK, "another sweep"):
        with pytest.raises(locks.NameInUse, match=r"sweep 'busy' is in use by"):
            sweeps.run_sweep(sweep, "busy")
    assert sorted(p.name for p in (storage / "busy").iterdir()) == []  # no sweep state beside the lock

    out, csv = tmp_path / "built", tmp_path / "pairs.csv"
    csv.write_text("filepath\ttitle\n")  # refused before the source is read
    with locks.hold(Location.of(out) / builder.BUILD_LOCK, "another build"):
        with pytest.raises(locks.NameInUse, match=rf"--out {out} is in use by"):
            builder.build(BuildConfig(format="csv", input=csv, out=out), progress=False)
    assert [p.name for p in out.iterdir()] == []


def test_a_finished_runs_name_continues_it_only_with_resume(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pairsim import tracking
    from pairsim.config import ConfigError

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(None, [f"tracking.tracking_uri={uri}"])
    driver.check_resume(cfg, "new", resume=False)
    with pytest.raises(ConfigError) as refused:
        driver.check_resume(cfg, "new", resume=True)
    message = str(refused.value)
    assert message.startswith("--resume:") and "'new'" in message and "'pairsim'" in message and uri in message
    client = MlflowClient(uri)
    experiment = new_experiment(uri, "pairsim")
    run_ids = {}
    for name, status in (("done", "FINISHED"), ("stopped", "KILLED"), ("crashed", "FAILED")):
        run = client.create_run(experiment, tags={tracking.RUN_NAME_TAG: name})
        client.set_terminated(run.info.run_id, status)
        run_ids[name] = run.info.run_id
    with pytest.raises(ConfigError) as refused:
        driver.check_resume(cfg, "done", resume=False)
    message = str(refused.value)  # the key, the run and where it is, the two ways on
    assert message.startswith("ray.run_name: 'done'") and run_ids["done"] in message and "'pairsim'" in message
    assert "--resume" in message and "another ray.run_name" in message
    driver.check_resume(cfg, "done", resume=True)
    driver.check_resume(cfg, "stopped", resume=False)  # a stopped or failed run's name resumes it
    driver.check_resume(cfg, "crashed", resume=False)
    tracking_only = load_config(None, [f"tracking.tracking_uri={uri}", "tracking.experiment=other"])
    driver.check_resume(tracking_only, "done", resume=False)  # names are per experiment


@pytest.mark.slow
def test_two_trains_under_one_name_the_second_is_refused_in_seconds_and_the_first_finishes(tiny_dataset, tmp_path):
    """The case of the issue, as a user meets it: two ``pairsim train`` processes at once."""
    storage = tmp_path / "runs"
    args = [sys.executable, "-m", "pairsim.cli", "train", "--config", str(run_yaml(tiny_dataset, tmp_path))]
    env = os.environ | {"RAY_ADDRESS": ""}
    first = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lock = storage / "same" / driver.RUN_LOCK
    deadline = time.monotonic() + 120
    while not lock.is_file() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert lock.is_file(), first.communicate()[0][-3000:]
    started = time.monotonic()
    second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    refused_in = time.monotonic() - started
    assert second.returncode == 2, second.stderr[-3000:]
    assert "ray.run_name 'same' is in use by" in second.stderr and f"pid {first.pid} " in second.stderr
    assert refused_in < 45  # the checks and the Python start-up; Ray is never started
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out[-3000:]
    assert not lock.exists()


def test_a_run_or_sweep_into_a_users_sqlite_database_is_refused_before_ray_and_leaves_it_as_it_was(
        tiny_dataset, tmp_path, capsys):
    """MLflow would create its tables in any SQLite file ``tracking.tracking_uri`` names."""
    import sqlite3

    from pairsim.tune import sweep as sweeps
    from pairsim.tune.space import load_sweep

    app = tmp_path / "app.db"
    with sqlite3.connect(app) as db:
        db.execute("CREATE TABLE users (name TEXT)")
    before = app.read_bytes()
    run = run_yaml(tiny_dataset, tmp_path)
    uri = f"tracking.tracking_uri=sqlite:///{app}"
    assert cli.main(["train", "--config", str(run), "--set", uri]) == 2
    assert "users" in capsys.readouterr().err
    space = tmp_path / "space.yaml"
    space.write_text(f"base: {{config: [{run}]}}\nspace: {{loss.base.margin: {{uniform: [0.1, 0.3]}}}}\n"
                     "sweep: {num_samples: 1}\n")
    with pytest.raises(ConfigError, match="users"):
        sweeps.run_sweep(load_sweep(space, [uri]), "into-a-users-db")
    assert app.read_bytes() == before and not (tmp_path / "runs").exists()  # nothing written, no lock taken
