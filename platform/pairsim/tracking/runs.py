"""MLflow runs: where the store is (and whether it answers), one run per training job also across
restarts (found by its Ray Train run name), a sweep's parent and child runs, and how a run ends
(FINISHED, FAILED with its error, KILLED with what stopped it)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pairsim import storage
from pairsim.config import ConfigError, RunConfig, check_tracking_uri
from pairsim.errors import shown
from pairsim.log import get_logger

logger = get_logger("tracking")


DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


RUN_NAME_TAG = "pairsim.run_name"


PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a sweep's trial runs under it


SWEEP_TAG = "pairsim.sweep_name"  # on a sweep's parent run


def resolve_tracking_uri(configured: str | None) -> str:
    """Config (or ``--tracking-uri``), else ``MLFLOW_TRACKING_URI`` (refused with credentials in it,
    as configured ones are: :func:`pairsim.config.check_tracking_uri`), else ``sqlite:///mlflow.db``;
    sqlite paths made absolute."""
    from_environment = os.environ.get("MLFLOW_TRACKING_URI")
    if not configured and from_environment:
        try:
            check_tracking_uri(from_environment)
        except ValueError as exc:
            raise ConfigError(f"MLFLOW_TRACKING_URI: {exc}") from None
    uri = configured or from_environment or DEFAULT_TRACKING_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        uri = prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


REACHABLE_TIMEOUT_S = 10.0


def check_reachable(uri: str, timeout: float = REACHABLE_TIMEOUT_S) -> None:
    """Fail fast, naming ``tracking.tracking_uri`` (masked), when the MLflow store cannot be
    reached: a tracking server must answer ``/health`` within ``timeout`` seconds (MLflow's
    client retries for minutes first), a sqlite store's directory must be writable, and a file
    already there an MLflow store (:func:`sqlite_store_problem`)."""
    import requests

    masked = storage.masked(uri)
    if uri.startswith(("http://", "https://")):
        try:
            requests.get(uri.rstrip("/") + "/health", timeout=timeout)
        except requests.RequestException as exc:
            raise ConfigError(f"tracking.tracking_uri: no MLflow server answers at {masked} within {timeout:g} s "
                              f"({type(exc).__name__}); start it or point tracking.tracking_uri / "
                              "MLFLOW_TRACKING_URI elsewhere") from None
    elif uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
        if not os.access(path.parent, os.W_OK):
            raise ConfigError(f"tracking.tracking_uri: {masked}: cannot write to {path.parent}")
        if os.path.lexists(path) and (problem := sqlite_store_problem(path)):
            raise ConfigError(f"tracking.tracking_uri: {masked}: {problem}; MLflow would create its tables in it, "
                              "so point it at an MLflow store or a new file")


MLFLOW_TABLES = {"experiments", "runs"}  # tables every MLflow SQL store has


def sqlite_store_problem(path: Path) -> str | None:
    """Why the file at ``path`` is not an SQLite store MLflow may open (None when it is one, or
    empty): not a regular file, not SQLite, or an SQLite database without MLflow's tables (a
    user's own). Read without following what the file says, and without writing to it."""
    import sqlite3

    try:
        stream, size = storage.Location.of(path).open_input()
        with stream:
            header = stream.read(16)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if size == 0:
        return None
    if header != b"SQLite format 3\x00":
        return "not an SQLite database"
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as exc:
        return f"an SQLite database that cannot be read ({shown(exc)})"
    if tables and not MLFLOW_TABLES <= tables:
        return f"an SQLite database of other tables ({shown(', '.join(sorted(tables)), 80)}), not MLflow's"
    return None


def context_tags() -> dict[str, str]:
    """The tags MLflow's fluent API gives a run (``mlflow.user``, ``mlflow.source.name`` and
    ``.type``), the git commit and branch of the pairsim source that runs (not of the entry
    point, which may be a console script outside the repository), and ``pairsim.version``.
    Computed where the job was started: a sweep passes its own to every trial."""
    from importlib.metadata import PackageNotFoundError, version

    from mlflow.tracking.context.registry import resolve_tags
    from mlflow.utils.git_utils import get_git_branch, get_git_commit
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_BRANCH, MLFLOW_GIT_COMMIT

    source = str(Path(__file__).parent)
    git = {MLFLOW_GIT_COMMIT: get_git_commit(source), MLFLOW_GIT_BRANCH: get_git_branch(source)}
    try:
        pairsim_version = version("pairsim")
    except PackageNotFoundError:  # a source tree on PYTHONPATH
        pairsim_version = "source"
    return resolve_tags() | {k: v for k, v in git.items() if v} | {"pairsim.version": pairsim_version}


def _artifact_location(uri: str) -> str | None:
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return None


# The experiment's kind in MLflow 3 (the UI's experiment-kind selector shows it). It does not
# choose what the UI opens: MLflow 3.17's UI opens every experiment in its "GenAI" workspace
# (an overview of traces) unless the URL says ?workflowType=machine_learning (ui_url).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default


def ui_url(tracking_uri: str, run_id: str) -> str:
    """The run's page in the MLflow UI, in its "Model training" workspace (runs, charts and
    artifacts) rather than the GenAI one MLflow 3 opens by default: on the tracking server of an
    http(s) URI, else on a local ``mlflow ui``."""
    experiment = MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
    server = tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else LOCAL_UI
    return f"{server}/#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning"


def _experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    """The experiment named ``name`` (created, or tagged if an older pairsim made it untagged)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return client.create_experiment(name, artifact_location=_artifact_location(uri), tags=EXPERIMENT_KIND)
    for key, value in EXPERIMENT_KIND.items():
        if key not in experiment.tags:
            client.set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def find_run(tracking_uri: str, run_name: str) -> str | None:
    """The id of the training run of Ray Train run ``run_name``, in any experiment, or None."""
    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(experiments, filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1)
    return found[0].info.run_id if found else None


def previous_attempt(tracking_uri: str, experiment: str, run_name: str):
    """The MLflow run (an ``mlflow.entities.Run``) an earlier attempt of Ray Train run
    ``run_name`` made in ``experiment``, or None."""
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    runs = found and client.search_runs([found.experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'",
                                        max_results=1)
    return runs[0] if runs else None


def create_run(tracking_uri: str, experiment: str, run_name: str, tags: dict[str, str]) -> str:
    """A new, finished run (for an evaluation that belongs to no training run)."""
    client = MlflowClient(tracking_uri)
    run = client.create_run(_experiment_id(client, experiment, tracking_uri), run_name=run_name, tags=tags)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def open_run(cfg: RunConfig, run_name: str, config_yaml: str, deepspeed_config: dict[str, Any],
             parent_run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
    """Create the job's MLflow run, or reopen the one a previous attempt of ``run_name`` made.

    Logs the flattened config as params and the resolved config and DeepSpeed config as
    artifacts. On resume, params the earlier attempt logged keep their values (MLflow forbids
    changing them); the new config file is stored beside the first. A sweep trial's run is a
    child of ``parent_run_id`` (MLflow's ``mlflow.parentRunId`` tag) and carries ``tags``.
    """
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    client = MlflowClient(uri)
    experiment_id = _experiment_id(client, cfg.tracking.experiment, uri)
    run = previous_attempt(uri, cfg.tracking.experiment, run_name)
    tags = context_tags() | {RUN_NAME_TAG: run_name} | (tags or {}) | ({PARENT_TAG: parent_run_id} if parent_run_id else {})
    if run is not None:
        client.update_run(run.info.run_id, status="RUNNING")
        attempt = int(run.data.tags.get("pairsim.attempts", "1")) + 1
        for ended_by in (ERROR_TAG, STOPPED_TAG):  # how the last attempt ended: kept under its number
            if ended_by in run.data.tags:
                client.set_tag(run.info.run_id, f"{ended_by}.attempt{attempt - 1}", run.data.tags[ended_by])
                client.delete_tag(run.info.run_id, ended_by)
        flat = {k: _param(k, v).value for k, v in cfg.flat().items()}
        new_params = {k: v for k, v in flat.items() if k not in run.data.params}
        changed = sorted(k for k, v in flat.items() if k in run.data.params and run.data.params[k] != v)
        if changed:
            client.set_tag(run.info.run_id, f"pairsim.changed_on_attempt{attempt}", ",".join(changed))
            logger.warning("resuming %s with changed settings (params keep their first values, "
                           "config-attempt%d.yaml has the new ones): %s", run_name, attempt,
                           ", ".join(f"{k}: {run.data.params[k]} -> {flat[k]}" for k in changed))
    else:
        run = client.create_run(experiment_id, run_name=run_name, tags=tags)
        attempt, new_params = 1, cfg.flat()
    run_id = run.info.run_id
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in (tags | {"pairsim.attempts": str(attempt)}).items()])
    client.log_batch(run_id, params=[_param(k, v) for k, v in new_params.items()])
    with tempfile.TemporaryDirectory() as tmp:
        name = "config.yaml" if attempt == 1 else f"config-attempt{attempt}.yaml"
        (Path(tmp) / name).write_text(config_yaml)
        (Path(tmp) / "deepspeed_config.json").write_text(json.dumps(deepspeed_config, indent=2))
        client.log_artifacts(run_id, tmp)
    return run_id


def _param(key: str, value: Any) -> Param:
    return Param(key, "None" if value is None else str(value))


def open_sweep_run(tracking_uri: str, experiment: str, sweep_name: str, params: dict[str, Any],
                   tags: dict[str, str]) -> tuple[str, bool]:
    """The parent run of sweep ``sweep_name``: found by its tag when the sweep is resumed (and
    set RUNNING again), else created with ``params`` and ``tags``. Returns (run id, resumed)."""
    client = MlflowClient(tracking_uri)
    experiment_id = _experiment_id(client, experiment, tracking_uri)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = '{sweep_name}'", max_results=1)
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return found[0].info.run_id, True
    run = client.create_run(experiment_id, run_name=sweep_name, tags=context_tags() | {SWEEP_TAG: sweep_name} | tags)
    client.log_batch(run.info.run_id, params=[_param(k, v) for k, v in params.items()])
    return run.info.run_id, False


def child_runs(tracking_uri: str, parent_run_id: str) -> list:
    """The runs nested under ``parent_run_id`` (a sweep's trials), oldest first."""
    client = MlflowClient(tracking_uri)
    parent = client.get_run(parent_run_id)
    return client.search_runs([parent.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
                              order_by=["attributes.start_time ASC"], max_results=10_000)


def run_tags(tracking_uri: str, run_id: str) -> dict[str, str] | None:
    """The tags of run ``run_id``; None when the store holds no such run."""
    try:
        return MlflowClient(tracking_uri).get_run(run_id).data.tags
    except MlflowException:
        return None


def tag_run(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    """Set ``tags`` on run ``run_id``, in one request."""
    MlflowClient(tracking_uri).log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def set_run_status(tracking_uri: str, run_id: str, status: str, tags: dict[str, str] | None = None) -> None:
    """End ``run_id`` as ``status`` (FINISHED, FAILED or KILLED), with ``tags``."""
    if tags:
        tag_run(tracking_uri, run_id, tags)
    MlflowClient(tracking_uri).set_terminated(run_id, status)


STOPPED_TAG = "pairsim.stopped_by"  # on a run ended KILLED: what stopped it


ERROR_TAG = "pairsim.error"  # on a run ended FAILED: the exception


@dataclass
class Outcome:
    """What the block of :func:`ending_run` sets when its work succeeded."""

    succeeded: bool = False


@contextmanager
def ending_run(tracking_uri: str, run_id: str) -> Iterator[Outcome]:
    """Ends ``run_id`` when the block exits: FINISHED if it set ``succeeded``; KILLED, tagged
    ``pairsim.stopped_by``, when a ``KeyboardInterrupt`` stopped it (Ctrl-C, or
    :class:`pairsim.signals.JobStopped` on SIGTERM) or Tune's ``SystemExit`` (a warm sweep
    trial stopped or paused), which propagates; FAILED otherwise, tagged
    ``pairsim.error`` with the exception. Child runs still RUNNING (a sweep's trials) end with
    a KILLED or FAILED parent, as KILLED: none of them goes on without it."""
    outcome, status, tags = Outcome(), "FAILED", {}
    try:
        yield outcome
        if outcome.succeeded:
            status = "FINISHED"
    except KeyboardInterrupt as exc:
        status, tags = "KILLED", {STOPPED_TAG: str(exc) or "KeyboardInterrupt"}
        raise
    except SystemExit:  # a warm sweep trial that Tune's scheduler stops or pauses at a report
        status, tags = "KILLED", {STOPPED_TAG: "its sweep's scheduler"}
        raise
    except Exception as exc:
        tags = {ERROR_TAG: error_text(exc)}
        raise
    finally:
        if status != "FINISHED":
            for child in child_runs(tracking_uri, run_id):
                if child.info.status == "RUNNING":
                    set_run_status(tracking_uri, child.info.run_id, "KILLED",
                                   {STOPPED_TAG: f"its parent run ended {status}"})
        set_run_status(tracking_uri, run_id, status, tags)


def error_text(exc: BaseException) -> str:
    """``pairsim.error``'s value: the exception's type and message (MLflow keeps 5000 characters of a tag)."""
    return f"{type(exc).__name__}: {exc}"[:5000]
