"""What a run needs as a Ray job, short of a cluster (``test_job_submit.py`` has the cluster):
SIGTERM unwinds the command, the MLflow run ends KILLED, and local paths in the config resolve
against the working directory and are refused before Ray starts when they point nowhere."""

import os
import signal
from contextlib import nullcontext

import pytest
from mlflow.tracking import MlflowClient

from conftest import new_experiment
from pairsim import cli, tracking
from pairsim.config import ConfigError, load_config
from pairsim.signals import JobStopped, stop_on_signals
from pairsim.train import driver


def test_sigterm_raises_job_stopped_inside_the_block_only():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(JobStopped, match="stopped by SIGTERM"), stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # the handler runs before this returns
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_keyboard_interrupt_ray_raises_for_a_sigterm_leaves_as_job_stopped():
    with pytest.raises(JobStopped, match="stopped by SIGTERM") as stopped, stop_on_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pause()
        except JobStopped:
            raise KeyboardInterrupt from None  # what ray.get raises when the handler raised in its signal check
    assert type(stopped.value.__cause__) is KeyboardInterrupt


def test_sigint_raises_job_stopped_when_asked_and_a_plain_keyboard_interrupt_leaves_as_one():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(JobStopped, match="stopped by SIGINT") as stopped, stop_on_signals(sigint=True):
        os.kill(os.getpid(), signal.SIGINT)
        signal.pause()
    assert stopped.value.signum == signal.SIGINT and signal.getsignal(signal.SIGINT) is before
    with pytest.raises(JobStopped, match="stopped by SIGINT"), stop_on_signals():
        raise KeyboardInterrupt  # Python's own Ctrl-C, or Ray's for one


def test_a_command_stopped_by_sigterm_exits_143_and_leaves_its_callers_processes(monkeypatch, capsys):
    """What ran before :func:`cli.main` (a test session's servers, a program's children) is not
    the command's to stop."""
    import subprocess

    def stopped(*args):
        raise JobStopped("stopped by SIGTERM")

    callers = subprocess.Popen(["sleep", "60"])
    monkeypatch.setattr(cli, "_demo", stopped)
    try:
        assert cli.main(["demo"]) == 128 + signal.SIGTERM
        assert "pairsim: stopped by SIGTERM" in capsys.readouterr().err
        with pytest.raises(subprocess.TimeoutExpired):  # still running: a kill would end this wait at once
            callers.wait(timeout=2)
    finally:
        callers.kill()


@pytest.mark.slow
def test_a_command_stopped_in_a_program_connected_to_ray_leaves_that_connection(ray_instance, monkeypatch):
    """A command run in-process by a program already connected to Ray (the test session's
    instance here) ends; the instance is not the command's, and keeps working."""
    def stopped(*args):
        raise JobStopped.by(signal.SIGINT)

    monkeypatch.setattr(cli, "_demo", stopped)
    assert cli.main(["demo"]) == 128 + signal.SIGINT
    assert ray_instance.is_initialized() and ray_instance.get(ray_instance.remote(lambda: 7).remote()) == 7


@pytest.mark.parametrize("outcome, status", [("succeeds", "FINISHED"), ("fails", "FAILED"), ("stopped", "KILLED")])
def test_ending_run_sets_the_status_of_how_the_block_ended(tmp_path, outcome, status):
    """A sweep's parent run with a trial still running and one finished: the running trial
    ends KILLED with a parent stopped or failed (it cannot go on), the finished one keeps its status."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = new_experiment(uri, "e")
    run_id = client.create_run(experiment).info.run_id
    running, finished = (client.create_run(experiment, tags={tracking.PARENT_TAG: run_id}).info.run_id
                         for _ in range(2))
    client.set_terminated(finished, "FINISHED")
    raised = {"fails": RuntimeError("boom"), "stopped": JobStopped("stopped by SIGTERM")}.get(outcome)
    with pytest.raises(type(raised)) if raised else nullcontext(), tracking.ending_run(uri, run_id) as result:
        if raised:
            raise raised
        result.succeeded = True
    run = client.get_run(run_id)
    assert run.info.status == status
    assert run.data.tags.get(tracking.STOPPED_TAG) == ("stopped by SIGTERM" if outcome == "stopped" else None)
    assert run.data.tags.get(tracking.ERROR_TAG) == ("RuntimeError: boom" if outcome == "fails" else None)
    assert client.get_run(running).info.status == ("RUNNING" if outcome == "succeeds" else "KILLED")
    assert client.get_run(finished).info.status == "FINISHED"


def test_local_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.pt").write_bytes(b"")
    cfg = load_config(None, ["data.path=shapes", "ray.storage_path=s3://bucket/runs", "model.pretrained=weights.pt"]
                      ).with_absolute_paths()
    assert cfg.data.path == tmp_path / "shapes"
    assert cfg.model.pretrained == str(tmp_path / "weights.pt")
    assert load_config(None, ["model.pretrained=openai"]).with_absolute_paths().model.pretrained == "openai"  # a tag
    assert load_config().with_absolute_paths().ray.storage_path == tmp_path / "ray_results"  # the default too


def test_paths_that_point_nowhere_are_refused_naming_the_key_and_where_they_resolved(tmp_path, monkeypatch,
                                                                                     tiny_dataset):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError) as exc:
        load_config("run.yaml")
    assert "run.yaml" in str(exc.value) and str(tmp_path / "run.yaml") in str(exc.value)  # as given, as resolved
    refusals = {  # the key, and the facts its refusal names: where the path resolved, what is in the way
        "data.path=nowhere": ("data.path", [str(tmp_path / "nowhere")]),
        "ray.storage_path=afile/runs": ("ray.storage_path", [str(tmp_path / "afile/runs"), f"({tmp_path / 'afile'} is a file)"]),
        "model.pretrained=w/model.pt": ("model.pretrained", ["'w/model.pt'", str(tmp_path / "w/model.pt")]),
    }
    for override, (key, facts) in refusals.items():
        cfg = load_config(None, [f"data.path={tiny_dataset}", override]).with_absolute_paths()
        with pytest.raises(ConfigError) as exc:
            driver.plan_run(cfg)
        assert str(exc.value).startswith(f"{key}:") and all(fact in str(exc.value) for fact in facts), str(exc.value)
