"""Rank 0's logging into a run by id (:class:`RunLogger`): curves queued and sent by a thread,
buffered through an MLflow outage (spilled to disk beyond a bound), no step logged twice across
attempts, artifacts and step images, and the system metrics of its node."""

from __future__ import annotations

import collections
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.tracking import MlflowClient

from pairsim import compat
from pairsim.log import get_logger

logger = get_logger("tracking")


def metric_key(name: str) -> str:
    """MLflow keys allow no '@': ``val/i2t_R@1`` is logged as ``val/i2t_R1``."""
    return name.replace("@", "")


def system_metrics_monitor(tracking_uri: str, run_id: str, interval_s: float) -> SystemMetricsMonitor:
    """MLflow's monitor of this node's CPU, memory, disk, network and (with ``nvidia-ml-py`` and
    a GPU) GPU use, started: ``system/…`` metrics every ``interval_s``, their steps going on
    from the run's last (a resumed run's curves continue)."""
    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True,
                                   tracking_uri=tracking_uri)
    monitor.start()
    return monitor


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
            compat.mlflow.fail_fast_http()
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
        """Stop the system-metrics monitor, send what is buffered (up to ``close_timeout``,
        retrying each second: the run's end waits on it, not the outage's backoff) and stop the
        sender; what could not be sent stays in :attr:`spill_file`, named in a warning."""
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        deadline = time.monotonic() + self.close_timeout
        while not self._drained.is_set() and (left := deadline - time.monotonic()) > 0:
            self._wake.set()
            self._drained.wait(min(left, 1.0))
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
