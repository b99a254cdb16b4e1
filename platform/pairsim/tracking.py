"""MLflow tracking: one MLflow run per training job, also across restarts, and exported models
in and out of runs and the model registry.

The driver opens the run (or finds the one tagged with the same Ray Train run name, when a
job is resumed) and logs the config and the datasets it reads; rank 0 of the workers logs
curves (asynchronously), eval metrics, per-epoch pictures, artifacts and the system metrics
of its node into it by run id. A local ``sqlite:`` store keeps its artifacts in ``mlartifacts/``
beside the database, as absolute paths, so workers in any directory write to the same place.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.data.dataset import Dataset
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.dataset_source_registry import get_registered_sources
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT
from mlflow.utils.validation import MAX_DATASET_DIGEST_SIZE

from pairsim import storage
from pairsim.config import ConfigError, RunConfig, check_tracking_uri
from pairsim.data import shards
from pairsim.log import get_logger
from pairsim.models import retrieval

logger = get_logger("tracking")
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
RUN_NAME_TAG = "pairsim.run_name"
MODEL_ARTIFACTS = "model"  # where a run's exported model lives among its MLflow artifacts
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
    client retries for minutes first), a sqlite store's directory must be writable."""
    import requests

    shown = storage.masked(uri)
    if uri.startswith(("http://", "https://")):
        try:
            requests.get(uri.rstrip("/") + "/health", timeout=timeout)
        except requests.RequestException as exc:
            raise ConfigError(f"tracking.tracking_uri: no MLflow server answers at {shown} within {timeout:g} s "
                              f"({type(exc).__name__}); start it or point tracking.tracking_uri / "
                              "MLFLOW_TRACKING_URI elsewhere") from None
    elif uri.startswith("sqlite:///"):
        directory = Path(uri.removeprefix("sqlite:///")).parent
        if not os.access(directory, os.W_OK):
            raise ConfigError(f"tracking.tracking_uri: {shown}: cannot write to {directory}")


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


def dataset_source(root: str | Path) -> DatasetSource:
    """MLflow's dataset source of a dataset directory: ``local`` by absolute path, or the one of
    its URI's scheme (``s3``, ``gs``, …). MLflow generates these classes per scheme; its registry
    holds two alike for no scheme and ``file:``, so resolving by URI warns."""
    location = storage.Location.of(root)
    kind = "local" if location.is_local else location.uri.split("://", 1)[0]
    source = next(s for s in get_registered_sources() if s._get_source_type() == kind)
    return source(location.uri)


class ShardSplit(Dataset):
    """One split of a shard dataset as an MLflow dataset: its source is the dataset directory,
    its digest the split's manifest content hash (cut to MLflow's 36 characters; the profile
    holds it whole, with the split's counts)."""

    def __init__(self, root: Path, split: str, counts: shards.SplitInfo):
        self._profile = {"split": split, "content_hash": counts.content_hash, "images": counts.images,
                         "captions": counts.captions, "shards": counts.shards}
        super().__init__(dataset_source(root), name=f"{storage.Location.of(root).name}/{split}",
                         digest=counts.content_hash[:MAX_DATASET_DIGEST_SIZE])

    def _compute_digest(self) -> str:  # the digest is always given
        raise NotImplementedError

    def to_dict(self) -> dict[str, str]:
        return super().to_dict() | {"profile": json.dumps(self.profile)}

    @property
    def profile(self) -> dict[str, Any]:
        return self._profile

    @property
    def schema(self) -> None:
        return None


def log_datasets(tracking_uri: str, run_id: str, data: shards.RunData, test: bool = True) -> None:
    """The train and val splits and, with ``test`` when the data has it, the test split as the
    run's MLflow dataset inputs, each with its context (``training``, ``validation``, ``testing``)."""
    config = data.config
    splits = {"training": config.train_split, "validation": config.val_split}
    if test and data.has(config.test_split):
        splits["testing"] = config.test_split
    MlflowClient(tracking_uri).log_inputs(run_id, [
        DatasetInput(ShardSplit(config.split_path(split), split, data.split(split))._to_mlflow_entity(),
                     [InputTag(MLFLOW_DATASET_CONTEXT, context)])
        for context, split in splits.items()])


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


def system_metrics_monitor(tracking_uri: str, run_id: str, interval_s: float) -> SystemMetricsMonitor:
    """MLflow's monitor of this node's CPU, memory, disk, network and (with ``nvidia-ml-py`` and
    a GPU) GPU use, started: ``system/…`` metrics every ``interval_s``, their steps going on
    from the run's last (a resumed run's curves continue)."""
    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True,
                                   tracking_uri=tracking_uri)
    monitor.start()
    return monitor


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
    :class:`pairsim.jobs.JobStopped` on SIGTERM), which propagates; FAILED otherwise, tagged
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


TRANSIENT_ERROR_CODES = {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "RESOURCE_EXHAUSTED", "REQUEST_LIMIT_EXCEEDED"}


def is_transient(exc: Exception) -> bool:
    """Whether an MLflow call failed because the server is unreachable or overloaded (worth a
    retry), rather than refused what it was sent (a deleted run, a bad value)."""
    import requests

    if isinstance(exc, (requests.RequestException, OSError)):
        return True
    return isinstance(exc, MlflowException) and exc.error_code in TRANSIENT_ERROR_CODES


def last_logged_steps(client: MlflowClient, run_id: str) -> dict[str, int]:
    """The last step each metric of ``run_id`` is logged at (MLflow's system metrics left out:
    their monitor goes on from its own last step)."""
    keys = [k for k in client.get_run(run_id).data.metrics if not k.startswith("system/")]
    return {key: max(m.step for m in client.get_metric_history(run_id, key)) for key in keys}


class RunLogger:
    """What rank 0 (and the driver) use to write into the job's run.

    Metrics are buffered and sent by a background thread, so the training step never waits
    for MLflow. While the server cannot be reached they stay buffered — in memory up to
    ``MAX_BUFFERED``, the oldest spilled to a local JSONL file beyond — and go out, oldest
    first, once it answers again (MLflow stores an identical re-sent metric once). A refused
    write (a deleted run) raises at the next :meth:`log_metrics` or :meth:`flush`.

    :meth:`flush` waits up to ``timeout`` seconds for the buffer to drain (not at all during an
    outage); :meth:`close` waits up to ``close_timeout`` and then leaves what is still unsent in
    the spill file, named in a warning. With ``tolerate_outage`` (the training loop) pictures,
    artifacts and tags that cannot reach MLflow are skipped with a warning instead of stopping
    training, and MLflow's own HTTP retries are cut to one short attempt (this process only),
    so an outage costs seconds, not minutes per call. With ``system_metrics_interval_s`` > 0
    it runs :func:`system_metrics_monitor` until :meth:`close` (a ``with`` block closes it).

    With ``continues_run`` (a training attempt: the run may hold an earlier attempt's curves) a
    metric is not sent at a step the run already has it at: an attempt resumed from a checkpoint
    retrains the steps the lost attempt had logged after it, and MLflow would otherwise hold
    those steps twice (the first attempt's points are kept; :func:`last_logged_steps`).
    """

    MAX_BUFFERED = 200_000
    BATCH = 1000  # MLflow's limit of metrics per log_batch
    RETRY_S = (1, 2, 5, 10, 30)  # waits between attempts while the server is away

    def __init__(self, tracking_uri: str, run_id: str, system_metrics_interval_s: float = 0.0,
                 tolerate_outage: bool = False, spill_dir: str | Path | None = None, close_timeout: float = 120.0,
                 continues_run: bool = False):
        if tolerate_outage:
            for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"), ("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")):
                os.environ.setdefault(name, value)
        self.client, self.run_id, self.tolerate_outage = MlflowClient(tracking_uri), run_id, tolerate_outage
        self._logged_through: dict[str, int] = {}
        if continues_run:
            self._call("the steps already logged (a resumed attempt may log some again)",
                       lambda: self._logged_through.update(last_logged_steps(self.client, run_id)))
        self.close_timeout = close_timeout
        self.spill_file = Path(spill_dir or tempfile.gettempdir()) / f"pairsim-unsent-{run_id}.jsonl"
        self._buffer: collections.deque[Metric] = collections.deque()
        self._lock = threading.Lock()
        self._wake, self._drained, self._stop = threading.Event(), threading.Event(), threading.Event()
        self._drained.set()
        self._refused: Exception | None = None
        self._outage: Exception | None = None
        self._sender = threading.Thread(target=self._send_loop, name=f"mlflow-{run_id[:8]}", daemon=True)
        self._sender.start()
        self._monitor = (system_metrics_monitor(tracking_uri, run_id, system_metrics_interval_s)
                         if system_metrics_interval_s > 0 else None)

    # ------------------------------------------------------------------ metrics

    def logged_before(self, key: str, step: int) -> bool:
        """Whether the run had metric ``key`` at ``step`` (or later) when this logger started
        (always False without ``continues_run``)."""
        return step <= self._logged_through.get(metric_key(key), -1)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._raise_refused()
        now = int(time.time() * 1000)
        with self._lock:
            self._buffer.extend(Metric(metric_key(k), float(v), now, step) for k, v in metrics.items()
                                if not self.logged_before(k, step))
            if len(self._buffer) > self.MAX_BUFFERED:
                self._spill([self._buffer.popleft() for _ in range(len(self._buffer) // 2)])
            self._drained.clear()
        self._wake.set()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every metric logged so far is in MLflow, up to ``timeout`` seconds (no wait
        while the server is away); True when they are. Raises a refused write."""
        self._wake.set()
        drained = self._drained.is_set() or (self._outage is None and self._drained.wait(timeout))
        self._raise_refused()
        return drained

    def close(self) -> None:
        """Stop the system-metrics monitor, send what is buffered (up to ``close_timeout``) and
        stop the sender; what could not be sent stays in :attr:`spill_file`, named in a warning."""
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        self._wake.set()
        self._drained.wait(self.close_timeout)
        self._stop.set()
        self._wake.set()
        self._sender.join(timeout=30)
        with self._lock:
            unsent = list(self._buffer)
            self._buffer.clear()
            if unsent:
                self._spill(unsent)
        if self.spill_file.exists():
            logger.warning("MLflow could not be reached: %s metrics of run %s are not in it; they are kept in %s "
                           "(one JSON metric per line)", sum(1 for _ in self.spill_file.open()), self.run_id,
                           self.spill_file)
        self._raise_refused()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _spill(self, metrics: list[Metric]) -> None:
        with self.spill_file.open("a") as f:
            f.writelines(json.dumps([m.key, m.value, m.timestamp, m.step]) + "\n" for m in metrics)

    def _next_batch(self) -> tuple[list[Metric], bool]:
        """Up to ``BATCH`` metrics to send, oldest first (spilled ones before buffered ones), and
        whether they come from the spill file."""
        with self._lock:
            if self.spill_file.exists():
                return [Metric(*json.loads(line)) for line in self.spill_file.read_text().splitlines()], True
            if not self._buffer:
                self._drained.set()  # under the lock: log_metrics clears it under the lock too
            return [self._buffer[i] for i in range(min(self.BATCH, len(self._buffer)))], False

    def _send_loop(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            batch, spilled = self._next_batch()
            if not batch:
                self._wake.wait(timeout=5.0)
                self._wake.clear()
                continue
            try:
                for start in range(0, len(batch), self.BATCH):
                    self.client.log_batch(self.run_id, metrics=batch[start:start + self.BATCH])
            except Exception as exc:  # noqa: BLE001 - classified below, never lost
                if not is_transient(exc):
                    self._refused = exc
                    self._drained.set()
                    return
                if self._outage is None:
                    logger.warning("MLflow cannot be reached (%s: %s); training goes on, metrics are buffered "
                                   "and sent when it answers", type(exc).__name__, str(exc).splitlines()[0][:200])
                self._outage = exc
                self._wake.wait(timeout=self.RETRY_S[min(attempt, len(self.RETRY_S) - 1)])
                self._wake.clear()
                attempt += 1
                continue
            with self._lock:
                if spilled:
                    self.spill_file.unlink()
                else:
                    for _ in batch:
                        self._buffer.popleft()
            if self._outage is not None:
                logger.warning("MLflow answers again: buffered metrics sent")
                self._outage, attempt = None, 0

    def _raise_refused(self) -> None:
        if self._refused is not None:
            raise self._refused

    # ------------------------------------------------------------------ everything else

    def _call(self, what: str, call: Callable[[], Any]) -> None:
        """``call()``; with ``tolerate_outage`` an unreachable server skips it with a warning."""
        try:
            call()
        except Exception as exc:
            if not (self.tolerate_outage and is_transient(exc)):
                raise
            logger.warning("MLflow cannot be reached: %s not logged (%s)", what, type(exc).__name__)

    def log_image(self, path: str | Path, key: str, step: int) -> None:
        """A PNG as MLflow's step image ``key`` (the UI shows each key's images with a step slider)."""
        import mlflow

        self._call(f"image {key} at step {step}", lambda: self.client.log_image(
            self.run_id, mlflow.Image(str(path)), key=key, step=step, synchronous=True))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._call(f"artifact {Path(path).name}", lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self._call(f"tag {key}", lambda: self.client.set_tag(self.run_id, key, value))

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self._call(f"artifact {artifact_file}", lambda: self.client.log_dict(self.run_id, data, artifact_file))


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
            raise FileNotFoundError(f"run {run_id} in {storage.masked(tracking_uri)}: no exported model under "
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
