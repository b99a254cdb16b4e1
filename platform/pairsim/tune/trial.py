"""A sweep's trial: the function Ray Tune runs for each point of the space (:func:`run_trial`),
and what it needs from the sweep driver (:class:`TrialJob`).

A trial is exactly a ``pairsim train`` run: :func:`pairsim.train.driver.fit` on the trial's run
config (its own ``TorchTrainer``, DeepSpeed, Ray Data stream and MLflow run, a child of the
sweep's), called by the trial function. Each epoch's rank-0 report reaches Tune through Ray's
integration (``ray.tune.integration.ray_train.TuneReportCallback``, a Train callback), which
Tune's scheduler (ASHA) and search (Optuna) read. PBT and PB2 need more: the trial's Tune
checkpoint, which a clone continues from (:func:`adopt_clone`), while Ray's callback passes on only
the checkpoint's path. Under them the run trains in a thread of the trial function
(:func:`fit_reporting_checkpoints`): :class:`~pairsim.train.callbacks.TrialReporter` puts each
report, with its checkpoint's path, on a Ray queue, and the function reports it to Tune with the
checkpoint as the trial's Tune checkpoint (:func:`report_checkpoint`).

A warm trial (``sweep.warm``, one worker) trains in the trial function's own process instead —
Tune's trial actor, which Tune reuses for the next trial — through Ray Train's local mode
(:attr:`pairsim.train.driver.RunRole.report_in_process`): the run keeps its checkpoints itself
and hands each epoch's report to :class:`TuneReport`, which reports it to Tune from there.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from pydantic import BaseModel, ConfigDict
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from pairsim import log, tracking, untrusted
from pairsim.train import driver
from pairsim.train.callbacks import TrialReporter
from pairsim.tune import results
from pairsim.tune.space import Sweep

logger = log.get_logger("tune")
CLONE_INFO = "pairsim-trial.json"  # in a PBT trial's Tune checkpoint: whose it is, at which epoch
CLONE_INFO_MAX_BYTES = 4096
CLONED_FROM_TAG = "pairsim.pbt.cloned_from"
TRIAL_TAG = "pairsim.trial_id"
PROCESS_TAG = "pairsim.trial_process"  # a warm trial's host:pid, shared by the trials its actor ran
PROCESS_AT_START_TAG = "pairsim.trial_process_at_start"  # its resident memory (MiB) and threads as it began
TRIAL_THREAD_TIMEOUT_VAR = "TUNE_FUNCTION_THREAD_TIMEOUT_S"  # how long Tune waits for a trial to end before reuse
TRIAL_THREAD_TIMEOUT_S = 120  # a warm trial stopped mid-run ends its MLflow run, engine and process group first


class CloneInfo(BaseModel):
    """:data:`CLONE_INFO`, read back as untrusted input."""

    model_config = ConfigDict(extra="forbid")

    trial_id: str  # whose checkpoint it is
    epoch: int
    checkpoint: str  # the directory name of the run's checkpoint it holds


@dataclass(frozen=True)
class TrialJob:
    """What every trial gets from the sweep driver."""

    sweep: Sweep
    name: str
    parent_run_id: str
    runs_path: str  # absolute: where the trials' Ray Train runs (checkpoints) live
    tracking_uri: str  # resolved on the driver (a relative sqlite path made absolute)
    log_level: str
    context_tags: dict[str, str]  # the sweep driver's user, source and commit: trials run in actors


def trial_run_name(sweep_name: str, trial_id: str) -> str:
    return f"{sweep_name}-{trial_id}"


def report_checkpoint(train_checkpoint: str, trial_id: str, metrics: dict[str, Any], scratch: Path):
    """Report ``metrics`` to Tune with the run's checkpoint as the trial's Tune checkpoint (PBT
    clones from it): the checkpoint's files (hard links where they can be) under ``checkpoint/``
    beside :data:`CLONE_INFO`, which says whose it is; Tune copies it into the trial's directory."""
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        shutil.copytree(train_checkpoint, Path(tmp) / "checkpoint", copy_function=_link_or_copy)
        (Path(tmp) / CLONE_INFO).write_text(json.dumps({"trial_id": trial_id, "epoch": int(metrics["epoch"]),
                                                        "checkpoint": Path(train_checkpoint).name}))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def adopt_clone(checkpoint, trial_id: str, run_dir: Path) -> CloneInfo | None:
    """What PBT gave the trial to start from (its Tune checkpoint): None when it is the trial's
    own or there is none (the run resumes from its own directory, as any run does); else another
    trial's, which the run then continues from — the run directory is moved aside
    (``<run>.before-epoch-<e>``) and begins anew with that checkpoint. Returns its
    :data:`CLONE_INFO`."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as ckpt_dir:
        info = untrusted.read_model(Path(ckpt_dir) / CLONE_INFO, CloneInfo, CLONE_INFO_MAX_BYTES)
        if info.trial_id == trial_id:
            return None
        target = untrusted.child(run_dir, info.checkpoint, f"{ckpt_dir}/{CLONE_INFO}: checkpoint")
        if run_dir.exists():
            aside = run_dir.with_name(f"{run_dir.name}.before-epoch-{info.epoch}")
            shutil.rmtree(aside, ignore_errors=True)
            run_dir.rename(aside)
        run_dir.mkdir(parents=True)
        shutil.copytree(Path(ckpt_dir) / "checkpoint", target.path)
    return info


def run_trial(config: dict[str, Any], job: TrialJob) -> None:
    """One trial: the run config at the point of its Tune ``config``, trained by
    :func:`pairsim.train.driver.fit`, whose Train callback reports each epoch to Tune (under PBT
    with the checkpoint: :func:`fit_reporting_checkpoints`). A PBT trial handed another trial's
    checkpoint continues from it (:func:`adopt_clone`) in the same MLflow run, which records
    ``pairsim.pbt.cloned_from`` and a ``pairsim.pbt.clone.<epoch>`` tag per clone."""
    log.setup(job.log_level)
    trial_id = tune.get_context().get_trial_id()
    run_name = trial_run_name(job.name, trial_id)
    point = job.sweep.point_of(config)
    cfg = job.sweep.trial_config(point)
    data_cap = min(cfg.data.max_cpus or math.inf, cfg.ray.data_cpus)  # the trial's share of the CPUs
    cfg = cfg.model_copy(update={
        "ray": cfg.ray.model_copy(update={"run_name": run_name, "storage_path": Path(job.runs_path)}),
        "data": cfg.data.model_copy(update={"max_cpus": data_cap}),
        "tracking": cfg.tracking.model_copy(update={"tracking_uri": job.tracking_uri})})
    tags = job.context_tags | {TRIAL_TAG: trial_id, "pairsim.sweep": job.name, "pairsim.sampled": json.dumps(point)}
    pbt = job.sweep.settings.pbt
    clone = pbt and adopt_clone(tune.get_checkpoint(), trial_id, Path(job.runs_path) / run_name)
    if clone:
        tags |= {CLONED_FROM_TAG: clone.trial_id,
                 f"{results.CLONE_TAG_PREFIX}{clone.epoch}": json.dumps({"from": clone.trial_id, "point": point})}
        logger.info("trial %s continues from trial %s at epoch %d with %s", trial_id, clone.trial_id, clone.epoch,
                    point)

    scratch = Path(job.runs_path) / ".tune-reports"

    def trial(reporter=None, report_in_process=None) -> driver.RunRole:
        return driver.RunRole.sweep_trial(
            job.parent_run_id, tags, (reporter,) if reporter else (), tuple(pbt.mutations) if pbt else (),
            reset_temperatures=bool(clone) and any(k.endswith(".init") for k in pbt.mutations),
            report_in_process=report_in_process)

    try:
        if job.sweep.settings.warm:
            os.environ.setdefault(TRIAL_THREAD_TIMEOUT_VAR, str(TRIAL_THREAD_TIMEOUT_S))
            tags |= {PROCESS_TAG: f"{socket.gethostname()}:{os.getpid()}", PROCESS_AT_START_TAG: json.dumps({
                "rss_mib": round(psutil.Process().memory_info().rss / 2**20), "threads": threading.active_count()})}
            driver.fit(cfg, trial(report_in_process=TuneReport(trial_id, str(scratch) if pbt else None)))
        elif pbt:
            fit_reporting_checkpoints(cfg, trial, trial_id, scratch)
        else:
            driver.fit(cfg, trial(TuneReportCallback()))
    except SystemExit:  # Tune paused or stopped the trial at a report (PBT): not a failure
        raise
    except BaseException as exc:
        run_id = tracking.find_run(tracking.resolve_tracking_uri(cfg.tracking.tracking_uri), run_name)
        if run_id:
            tracking.set_run_status(tracking.resolve_tracking_uri(cfg.tracking.tracking_uri), run_id, "FAILED",
                                    {results.STATUS_TAG: "failed", tracking.ERROR_TAG: tracking.error_text(exc)})
        raise


@dataclass(frozen=True)
class TuneReport:
    """A warm trial's epoch reports, made to Tune from the trial's own process (the run trains
    in it: :attr:`pairsim.train.driver.RunRole.report_in_process`); under PBT and PB2
    (``scratch`` set) with the epoch's checkpoint as the trial's Tune checkpoint
    (:func:`report_checkpoint`). Tune stops or pauses the trial by raising ``SystemExit`` here."""

    trial_id: str
    scratch: str | None

    def __call__(self, metrics: dict[str, Any], checkpoint: str) -> None:
        if self.scratch:
            report_checkpoint(checkpoint, self.trial_id, metrics, Path(self.scratch))
        else:
            tune.report(metrics)


def fit_reporting_checkpoints(cfg, trial, trial_id: str, scratch: Path) -> None:
    """A PBT or PB2 trial's run: :func:`pairsim.train.driver.fit` on ``cfg`` and ``trial(reporter)``
    in a thread, while this one reports each epoch to Tune with its checkpoint as the trial's Tune
    checkpoint (:func:`report_checkpoint`), which a clone continues from. Ray's TuneReportCallback
    passes on only the checkpoint's path; :class:`~pairsim.train.callbacks.TrialReporter` hands
    both to this thread over a Ray queue. Raises what the run raised."""
    from ray.util.queue import Queue

    reports = Queue(maxsize=1, actor_options={"num_cpus": 0})
    outcome: dict[str, BaseException] = {}

    def train() -> None:
        try:
            driver.fit(cfg, trial(TrialReporter(reports)))
        except BaseException as exc:  # raised again in the trial's thread
            outcome["error"] = exc
        finally:
            reports.put(None)

    threading.Thread(target=train, name=f"pairsim-fit-{trial_id}", daemon=True).start()
    while (item := reports.get()) is not None:
        metrics, checkpoint = item
        if checkpoint:
            report_checkpoint(checkpoint, trial_id, metrics, scratch)
        else:
            tune.report(metrics)
    if "error" in outcome:
        raise outcome["error"]


class TrialName:
    """Tune's trial names and directories: ``<sweep>-<trial id>``, unique within the storage."""

    def __init__(self, sweep_name: str):
        self.sweep_name = sweep_name

    def __call__(self, trial) -> str:
        return trial_run_name(self.sweep_name, trial.trial_id)
