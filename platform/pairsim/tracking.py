"""MLflow tracking: one MLflow run per training job, also across restarts, and exported models
in and out of runs and the model registry.

The driver opens the run (or finds the one tagged with the same Ray Train run name, when a
job is resumed) and logs the config; rank 0 of the workers logs curves, eval metrics and
artifacts into it by run id. A local ``sqlite:`` store keeps its artifacts in ``mlartifacts/``
beside the database, as absolute paths, so workers in any directory write to the same place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from pairsim.config import RunConfig
from pairsim.log import get_logger
from pairsim.models import retrieval

logger = get_logger("tracking")
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
RUN_NAME_TAG = "pairsim.run_name"
MODEL_ARTIFACTS = "model"  # where a run's exported model lives among its MLflow artifacts
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a sweep's trial runs under it
SWEEP_TAG = "pairsim.sweep_name"  # on a sweep's parent run


def resolve_tracking_uri(configured: str | None) -> str:
    """Config, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``; sqlite paths made absolute."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        uri = prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


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


def metric_key(name: str) -> str:
    """MLflow keys allow no '@': ``val/i2t_R@1`` is logged as ``val/i2t_R1``."""
    return name.replace("@", "")


def _artifact_location(uri: str) -> str | None:
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return None


def _experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(
        name, artifact_location=_artifact_location(uri))


def find_run(tracking_uri: str, run_name: str) -> str | None:
    """The id of the training run of Ray Train run ``run_name``, in any experiment, or None."""
    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(experiments, filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1)
    return found[0].info.run_id if found else None


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
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1)
    tags = context_tags() | {RUN_NAME_TAG: run_name} | (tags or {}) | ({PARENT_TAG: parent_run_id} if parent_run_id else {})
    if found:
        run = found[0]
        client.update_run(run.info.run_id, status="RUNNING")
        attempt = int(run.data.tags.get("pairsim.attempts", "1")) + 1
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


def set_run_status(tracking_uri: str, run_id: str, status: str, tags: dict[str, str] | None = None) -> None:
    """End ``run_id`` as ``status`` (FINISHED, FAILED or KILLED), with ``tags``."""
    client = MlflowClient(tracking_uri)
    if tags:
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    client.set_terminated(run_id, status)


STOPPED_TAG = "pairsim.stopped_by"  # on a run ended KILLED: what stopped it


@dataclass
class Outcome:
    """What the block of :func:`ending_run` sets when its work succeeded."""

    succeeded: bool = False


@contextmanager
def ending_run(tracking_uri: str, run_id: str) -> Iterator[Outcome]:
    """Ends ``run_id`` when the block exits: FINISHED if it set ``succeeded``; KILLED, tagged
    ``pairsim.stopped_by``, when a ``KeyboardInterrupt`` stopped it (Ctrl-C, or
    :class:`pairsim.jobs.JobStopped` on SIGTERM), which propagates; FAILED otherwise."""
    outcome, status, tags = Outcome(), "FAILED", {}
    try:
        yield outcome
        if outcome.succeeded:
            status = "FINISHED"
    except KeyboardInterrupt as exc:
        status, tags = "KILLED", {STOPPED_TAG: str(exc) or "KeyboardInterrupt"}
        raise
    finally:
        set_run_status(tracking_uri, run_id, status, tags)


class RunLogger:
    """What rank 0 uses to write into the job's run."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.client, self.run_id = MlflowClient(tracking_uri), run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(metric_key(k), float(v), now, step) for k, v in metrics.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)


def download_run_model(run_id: str, tracking_uri: str, out: str | Path) -> list[Path]:
    """A training run's exported model (its best checkpoint's, logged under ``model/``) → ``out``."""
    import mlflow.artifacts

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=MODEL_ARTIFACTS,
                                                             tracking_uri=tracking_uri, dst_path=tmp))
        except Exception as exc:  # MLflow raises several types for a missing run or artifact
            raise FileNotFoundError(f"run {run_id} in {tracking_uri}: no exported model under "
                                    f"{MODEL_ARTIFACTS}/ ({exc})") from None
        written = []
        for source, target in zip(retrieval.exported_files(local / "model.pt"), retrieval.exported_files(out)):
            if source.is_file():
                shutil.copyfile(source, target)
                written.append(target)
    if not written:
        raise FileNotFoundError(f"run {run_id}: {MODEL_ARTIFACTS}/ holds no model.pt")
    return written


def register_model(weights: str | Path, name: str, tracking_uri: str, run_id: str | None = None):
    """Log the exported model with ``mlflow.pytorch.log_model`` into ``run_id`` (or a new run)
    and register it as ``name`` in MLflow's model registry; returns the model version."""
    import mlflow
    import open_clip
    import torch

    model, _ = retrieval.load_exported(weights)
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        # pickled (a traced pt2 graph would fix the input shapes); pairsim's package travels
        # in the model (code_paths) so mlflow.pytorch.load_model works where it is not installed
        info = mlflow.pytorch.log_model(
            model, name="registered_model", registered_model_name=name, serialization_format="pickle",
            code_paths=[str(Path(retrieval.__file__).parents[1])],
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"open_clip_torch=={open_clip.__version__}"],
            extra_files=[str(p) for p in retrieval.exported_files(weights) if p.is_file()])
    return info.registered_model_version
