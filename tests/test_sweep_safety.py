"""A sweep's directory and sweep file as untrusted input (issue 51, issue 78): ``--resume``
unpickles only Tune state whose digests pairsim recorded, that record vouched for by the sweep's
MLflow parent run (outside the directory), ``pairsim-sweep.json`` is read bounded and typed, and
a sweep too large to run is refused before its points are listed or Ray starts.

Fast tests lay out a sweep's directory as a driver leaves it and resume it with
:func:`pairsim.tune.sweep.run_sweep` (the refusals come before Ray starts); the slow one runs
a one-trial sweep, resumes it, and resumes it again with its ``tuner.pkl`` replaced."""

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pairsim import cluster, tracking, untrusted
from pairsim.errors import InputError
from pairsim.storage import Location
from pairsim.tune.space import MAX_TRIALS, load_sweep
from pairsim.tune.sweep import (STATE_FILE, STATE_MAX_BYTES, TUNE_STATE_TAG, SweepState, UnvouchedTuneState,
                                read_state, record_tune_state, run_sweep, tune_state_files, write_state)
from pairsim.untrusted import UntrustedFileError

DEMO = {"config": ["pairsim:demo.yaml"]}


class RunsCode:
    """Unpickled, it runs a shell command: it touches ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def write_sweep_file(tmp_path: Path, space, sweep: dict, base=None, name: str = "sweep.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"base": DEMO if base is None else base, "space": space, "sweep": sweep}))
    return path


@pytest.fixture(scope="module")
def tracking_store(tmp_path_factory) -> str:
    """The MLflow store of this file's sweeps (a real one: it holds each sweep's record of Tune's
    state), outside every sweep directory."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture
def stopped_sweep(tiny_dataset, tmp_path, monkeypatch, tracking_store):
    """A sweep as its driver left it when it stopped: Tune's state files in ``<storage>/stopped``,
    their digests in :data:`STATE_FILE` and its digest on the sweep's MLflow parent run. Returns
    (sweep, its directory). Starting Ray fails the test: every refusal must come before it."""
    monkeypatch.setattr(cluster, "init_ray", lambda *a, **k: pytest.fail("Ray was started before the refusal"))
    base = DEMO | {"data": {"path": str(tiny_dataset), "test_split": None},
                   "ray": {"storage_path": str(tmp_path / "ray")}, "tracking": {"tracking_uri": tracking_store}}
    sweep = load_sweep(write_sweep_file(tmp_path, {"loss.base.margin": {"grid": [0.1, 0.2]}},
                                        {"search": "grid", "num_samples": 1}, base=base))
    exp_dir = tmp_path / "ray" / "stopped"
    (exp_dir / "stopped-00000").mkdir(parents=True)
    (exp_dir / "tuner.pkl").write_bytes(pickle.dumps({"what": "Tune's tuner state"}))
    (exp_dir / "experiment_state-2026-01-01_00-00-00.json").write_text('{"trial_data": []}')
    (exp_dir / "stopped-00000" / "error.pkl").write_bytes(pickle.dumps(RuntimeError("a trial's error")))
    parent_run_id, _ = tracking.open_sweep_run(tracking_store, "pairsim", "stopped", {}, {})
    record_tune_state(exp_dir, SweepState(digest=sweep.digest(), parent_run_id=parent_run_id, source=sweep.source),
                      tracking_store)
    return sweep, exp_dir


def refusal(sweep, name: str) -> Exception:
    with pytest.raises(InputError) as err:  # before Ray starts (stopped_sweep)
        run_sweep(sweep, name, resume=True)
    return err.value


# 1. Tune's pickled state ----------------------------------------------------------------------


def test_every_tune_state_file_is_recorded_and_pairsims_own_file_is_not(stopped_sweep):
    _, exp_dir = stopped_sweep
    recorded = read_state(exp_dir).tune_state
    assert sorted(recorded) == ["experiment_state-2026-01-01_00-00-00.json", "stopped-00000/error.pkl", "tuner.pkl"]
    assert sorted(recorded) == sorted(tune_state_files(exp_dir)) and STATE_FILE not in recorded


@pytest.mark.parametrize("file", ["tuner.pkl", "stopped-00000/error.pkl", "experiment_state-2026-01-01_00-00-00.json"])
def test_resume_refuses_a_replaced_tune_state_file_and_runs_none_of_its_code(stopped_sweep, tmp_path, file):
    sweep, exp_dir = stopped_sweep
    marker = tmp_path / "code-ran"
    (exp_dir / file).write_bytes(pickle.dumps(RunsCode(marker)))
    error = refusal(sweep, "stopped")
    assert isinstance(error, UnvouchedTuneState) and str(exp_dir / file) in str(error)
    assert "run any code" in str(error) and "--name" in str(error)
    assert not marker.exists()


@pytest.mark.parametrize("file", ["searcher-state-2099-01-01_00-00-00.pkl", "stopped-00001/error.pkl",
                                  "basic-variant-state-2099-01-01_00-00-00.json"])
def test_resume_refuses_a_tune_state_file_pairsim_has_no_record_of(stopped_sweep, file):
    """A state file added since (Tune restores the newest searcher state it finds), or one written
    after the last record (a driver killed outright between two records)."""
    sweep, exp_dir = stopped_sweep
    (exp_dir / file).parent.mkdir(exist_ok=True)
    (exp_dir / file).write_bytes(pickle.dumps({"what": "unrecorded"}))
    error = refusal(sweep, "stopped")
    assert isinstance(error, UnvouchedTuneState) and str(exp_dir / file) in str(error)
    assert "recorded no SHA-256" in str(error)


def test_a_running_sweep_records_its_state_so_a_killed_driver_resumes_from_the_last_record(stopped_sweep, monkeypatch,
                                                                                           tracking_store):
    """The driver's recorder (a Tune callback): state Tune writes while the sweep runs is recorded
    within RECORD_EVERY_S; what it wrote after the last record is refused."""
    from pairsim.tune import sweep as sweep_module

    sweep, exp_dir = stopped_sweep
    recorder = sweep_module.TuneStateRecorder(exp_dir, read_state(exp_dir), tracking_store)
    (exp_dir / "tuner.pkl").write_bytes(pickle.dumps({"what": "Tune's state, a step later"}))
    recorder.on_step_end(iteration=1, trials=[])
    sweep_module.verify_tune_state(exp_dir, read_state(exp_dir).tune_state)  # killed now: resumes
    (exp_dir / "tuner.pkl").write_bytes(pickle.dumps({"what": "written after the last record"}))
    recorder.on_step_end(iteration=2, trials=[])  # within RECORD_EVERY_S of the last record: not recorded
    error = refusal(sweep, "stopped")
    assert isinstance(error, UnvouchedTuneState) and "tuner.pkl" in str(error)
    monkeypatch.setattr(sweep_module, "RECORD_EVERY_S", 0.0)
    recorder.on_step_end(iteration=3, trials=[])
    sweep_module.verify_tune_state(exp_dir, read_state(exp_dir).tune_state)


def test_a_sweep_killed_before_its_first_record_is_refused_and_its_files_kept(stopped_sweep, tracking_store):
    sweep, exp_dir = stopped_sweep
    write_state(exp_dir, read_state(exp_dir).model_copy(update={"tune_state": {}}), tracking_store)  # as _run at start
    before = sorted(p.relative_to(exp_dir) for p in exp_dir.rglob("*"))
    error = refusal(sweep, "stopped")
    assert isinstance(error, UnvouchedTuneState) and "recorded no SHA-256" in str(error)
    assert sorted(p.relative_to(exp_dir) for p in exp_dir.rglob("*")) == before


def test_resume_refuses_through_the_cli_with_exit_status_2(stopped_sweep, tmp_path):
    sweep, exp_dir = stopped_sweep
    marker = tmp_path / "code-ran"
    (exp_dir / "tuner.pkl").write_bytes(pickle.dumps(RunsCode(marker)))
    done = subprocess.run([sys.executable, "-m", "pairsim.cli", "tune", "--space", sweep.source, "--resume", "stopped"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "tuner.pkl" in done.stderr
    assert not marker.exists()


def forge_state(exp_dir: Path, **fields) -> None:
    """What someone who can write the sweep directory, and not the MLflow store, can do: rewrite
    :data:`STATE_FILE` to vouch for the Tune state files as they are now (and ``fields``)."""
    state = read_state(exp_dir).model_copy(update={
        "tune_state": {name: untrusted.sha256(path) for name, path in tune_state_files(exp_dir).items()}} | fields)
    Location.of(exp_dir / STATE_FILE).write_text(state.model_dump_json())


def test_resume_refuses_a_tune_state_and_its_record_rewritten_together_and_runs_none_of_its_code(
        stopped_sweep, tmp_path, tracking_store):
    """``tuner.pkl`` replaced by a pickle that runs a command and ``pairsim-sweep.json`` rewritten
    to match it (the limit issue 51 left): the record differs from the digest on the sweep's
    MLflow run, the resume is refused naming the record, and the command never runs."""
    from mlflow.tracking import MlflowClient

    sweep, exp_dir = stopped_sweep
    marker = tmp_path / "code-ran"
    (exp_dir / "tuner.pkl").write_bytes(pickle.dumps(RunsCode(marker)))
    forge_state(exp_dir)
    error = refusal(sweep, "stopped")
    assert isinstance(error, UnvouchedTuneState) and str(exp_dir / STATE_FILE) in str(error)
    assert "differs from the one the sweep's MLflow run" in str(error) and "--name" in str(error)
    assert not marker.exists()

    parent = read_state(exp_dir).parent_run_id  # a sweep of an earlier pairsim: no record on its run
    MlflowClient(tracking_store).delete_tag(parent, TUNE_STATE_TAG)
    error = refusal(sweep, "stopped")
    assert isinstance(error, UnvouchedTuneState) and f"no copy in the sweep's MLflow run {parent}" in str(error)
    other, _ = tracking.open_sweep_run(tracking_store, "pairsim", "another-sweep", {}, {})
    forge_state(exp_dir, parent_run_id=other)  # pointed at a run the forger could tag: another sweep's
    error = refusal(sweep, "stopped")
    assert isinstance(error, UnvouchedTuneState) and f"parent run {other} is not sweep 'stopped'" in str(error)
    forge_state(exp_dir, parent_run_id="f" * 32)  # at no run
    error = refusal(sweep, "stopped")
    assert isinstance(error, UnvouchedTuneState) and f"parent run {'f' * 32} is not in" in str(error)
    assert not marker.exists()


# 2. pairsim-sweep.json ------------------------------------------------------------------------


@pytest.mark.parametrize("content", [
    b"not json {",
    b'{"digest": 1, "parent_run_id": [], "source": null, "tune_state": {"tuner.pkl": "not a digest"}}',
    b'{"digest": "d", "parent_run_id": "p", "source": "s", "more": 1}',
    b"[]",
    b"\xff\xfe",
    b"[" * 100_000,
], ids=["not-json", "wrong-types", "unknown-key", "not-an-object", "not-utf8", "nested"])
def test_a_garbled_state_file_is_one_input_error(stopped_sweep, content):
    sweep, exp_dir = stopped_sweep
    (exp_dir / STATE_FILE).write_bytes(content)
    error = refusal(sweep, "stopped")
    assert isinstance(error, UntrustedFileError) and str(exp_dir / STATE_FILE) in str(error)


def test_a_huge_state_file_is_refused_unread(stopped_sweep):
    sweep, exp_dir = stopped_sweep
    with open(exp_dir / STATE_FILE, "wb") as f:
        f.truncate(STATE_MAX_BYTES + 1)
    error = refusal(sweep, "stopped")
    assert isinstance(error, UntrustedFileError) and f"{STATE_MAX_BYTES:,} bytes" in str(error)


# 3. the size of a sweep -----------------------------------------------------------------------


def load_error(path: Path, overrides=None) -> str:
    with pytest.raises(InputError) as err:
        load_sweep(path, overrides)
    return str(err.value)


TEN_KEYS = ["loss.base.margin", "loss.base.gamma", "optim.lr", "optim.weight_decay", "optim.warmup_steps", "data.seed",
            "train.seed", "train.micro_batch_size", "train.log_every_n_steps", "eval.batch_size"]


def test_a_grid_of_more_points_than_max_trials_is_refused_before_they_are_listed(tmp_path):
    """4¹⁰ points: refused at once (listing them, Tune would hold a million trials on the driver)."""
    space = {key: {"grid": [1, 2, 3, 4]} for key in TEN_KEYS}  # counted, not checked: margins of 3 and 4 too
    path = write_sweep_file(tmp_path, space, {"search": "grid", "num_samples": 1})
    start = time.monotonic()
    message = load_error(path)
    assert time.monotonic() - start < 30
    assert message.startswith("1 error(s)") and "1,048,576 trials" in message and "sweep.max_trials" in message


def test_a_union_of_large_grids_and_many_samples_are_refused(tmp_path):
    grids = [{"loss.base.margin": {"grid": [0.1 + i / 1000 for i in range(100)]},
              "loss.base.gamma": {"grid": [g + i for i in range(100)]}} for g in range(10, 110)]
    union = write_sweep_file(tmp_path, grids, {"search": "grid", "num_samples": 1}, name="union.yaml")
    assert "up to 1,000,000 trials" in load_error(union)
    samples = write_sweep_file(tmp_path, {"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"num_samples": MAX_TRIALS + 1},
                               name="samples.yaml")
    assert f"{MAX_TRIALS + 1:,} trials" in load_error(samples)


def test_max_trials_raises_the_cap_and_leaves_the_digest(tmp_path):
    path = write_sweep_file(tmp_path, {"loss.base.margin": {"grid": [0.1, 0.2, 0.3]}, "loss.base.gamma": {"grid": [20, 40, 60]}},
                            {"search": "grid", "num_samples": 1})
    assert "9 trials" in load_error(path, ["sweep.max_trials=8"])
    assert load_sweep(path, ["sweep.max_trials=9"]).digest() == load_sweep(path).digest()


def test_a_union_of_many_invalid_points_lists_at_most_max_errors_shown(tmp_path):
    from pairsim.config.fields import MAX_ERRORS_SHOWN

    grids = [{"loss.base.gamma": {"grid": [-1.0 - i]}} for i in range(300)]
    message = load_error(write_sweep_file(tmp_path, grids, {"search": "grid", "scheduler": "fifo"}))
    lines = message.splitlines()
    assert lines[0].startswith("300 error(s)")
    assert len(lines) == 1 + MAX_ERRORS_SHOWN + 1 and lines[-1].strip() == f"… and {300 - MAX_ERRORS_SHOWN} more"


# 4. a real sweep ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_finished_sweep_resumes_and_refuses_once_its_tuner_pkl_is_replaced(ray_instance, tiny_dataset, tmp_path):
    """One trial of one epoch (warm: trained in its trial actor); its driver records Tune's state
    as it ends, and its digest on the sweep's MLflow run; ``--resume`` of it restores Tune (nothing
    left to run); with ``tuner.pkl`` replaced by a pickle that runs code, ``--resume`` is refused
    naming it, and with ``pairsim-sweep.json`` rewritten to match, naming that; the code does not run."""
    from mlflow.tracking import MlflowClient
    from test_tune import write_sweep

    from pairsim.tune.sweep import state_digest

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = write_sweep(tmp_path / "real.yaml", tiny_dataset, tmp_path / "ray", uri,
                       {"loss.base.margin": {"grid": [0.1]}},
                       {"search": "grid", "num_samples": 1, "scheduler": "fifo", "max_concurrent_trials": 1,
                        "warm": True})
    sweep = load_sweep(path, ["train.epochs=1"])
    assert [row.status for row in run_sweep(sweep, "real").rows] == ["finished"]
    exp_dir = tmp_path / "ray" / "real"
    recorded = read_state(exp_dir).tune_state
    assert "tuner.pkl" in recorded and any(name.startswith("experiment_state-") for name in recorded)
    assert sorted(recorded) == sorted(tune_state_files(exp_dir))
    parent = MlflowClient(uri).get_run(read_state(exp_dir).parent_run_id)
    assert parent.data.tags[TUNE_STATE_TAG] == state_digest(recorded)
    assert [row.status for row in run_sweep(sweep, "real", resume=True).rows] == ["finished"]
    marker = tmp_path / "code-ran"
    (exp_dir / "tuner.pkl").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(UnvouchedTuneState, match="tuner.pkl"):
        run_sweep(sweep, "real", resume=True)
    forge_state(exp_dir)
    with pytest.raises(UnvouchedTuneState, match=STATE_FILE):
        run_sweep(sweep, "real", resume=True)
    assert not marker.exists()


def test_a_trials_error_file_is_read_from_its_end_bounded(tmp_path):
    from pairsim.tune import results

    error = tmp_path / "error.txt"
    error.write_bytes(b"x" * 50_000_000 + b"\n\xff\xfe garbage\nRuntimeError: " + b"y" * 5000 + b"\n\n")
    last = results.trial_error(str(error))
    assert last.startswith("RuntimeError: yyy") and len(last) == 1000
    assert results.trial_error(str(tmp_path / "none.txt")) == ""


@pytest.mark.parametrize("name", ["../outside", "/etc", "a/b", ".hidden", "", "linked"])
def test_a_sweep_name_cannot_leave_the_storage_path(stopped_sweep, name):
    """Nor can a link at ``<storage>/<name>`` take it elsewhere; an empty name is no name."""
    sweep, exp_dir = stopped_sweep
    outside = exp_dir.parent.parent / "outside"
    outside.mkdir()
    (exp_dir.parent / "linked").symlink_to(outside)
    with pytest.raises(InputError, match="--name"):
        run_sweep(sweep, name, resume=False)
    assert sorted(p.name for p in exp_dir.parent.parent.iterdir()) == ["outside", "ray", "sweep.yaml"]
    assert list(outside.iterdir()) == []
