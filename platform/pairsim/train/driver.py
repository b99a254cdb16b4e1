"""The driver of a training job: plan → launch → finalize (:func:`fit`).

:func:`plan_run` checks data, model and teachers before the cluster is touched and returns what it
read; :func:`launch` starts or joins Ray, opens the MLflow run (with the datasets it reads),
builds the lazy Ray Data pipelines and runs the workers
(:func:`pairsim.train.recipe.train_loop_per_worker`); :func:`export_and_test` exports the best
checkpoint and evaluates it once on the test split. What differs for a sweep's trial is data: its
:class:`RunRole`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import os
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch
from ray.train import CheckpointConfig, DataConfig, FailureConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchTrainer

from pairsim import build, cluster, compat, dist, locks, log, signals, storage, tracking, untrusted
from pairsim.config import ConfigError, RunConfig
from pairsim.data import ingest, shards, skips
from pairsim.data.shard_reader import checksum_failure
from pairsim.eval import inference, report, suite
from pairsim.models import clip, retrieval
from pairsim.teachers.store import TeacherStore
from pairsim.train import checkpoints, engine
from pairsim.train.recipe import train_loop_per_worker
from pairsim.train.worker import InProcess, StartupClock, WorkerJob, selection_metric

logger = log.get_logger("train")


def steps_per_epoch(cfg: RunConfig, counts: shards.SplitInfo) -> int:
    """Optimizer steps in one epoch over the train split (its ``counts`` in the manifest; the last
    partial global batch is dropped)."""
    pairs = counts.captions if cfg.data.pairs_per_image == "all" else counts.images * cfg.data.pairs_per_image
    return pairs // (cfg.train.micro_batch_size * cfg.train.num_workers * cfg.train.accumulate_steps)


@dataclass
class TrainResult:
    """``metrics``: the last epoch's report; ``checkpoint_path``: the latest checkpoint (to
    resume from); ``best_checkpoint_path``: the one ``eval.select_metric`` chose, exported to
    the MLflow run and evaluated on test (``test_metrics``, empty without a test split)."""

    run_name: str
    mlflow_run_id: str
    tracking_uri: str
    metrics: dict[str, Any]
    checkpoint_path: str | None
    best_checkpoint_path: str | None = None
    test_metrics: dict[str, float] = field(default_factory=dict)


def checkpoint_uri(checkpoint: ray.train.Checkpoint) -> str:
    """Where a Ray Train checkpoint is: a local path, or a URI on object storage."""
    return storage.Location.on(checkpoint.filesystem, checkpoint.path).uri


def ray_storage(cfg: RunConfig) -> dict[str, Any]:
    """``ray.train.RunConfig``'s / ``ray.tune.RunConfig``'s storage arguments for
    ``ray.storage_path``: an absolute local path, or the path on an object store's filesystem
    (resolved here, with the endpoint the environment names, and pickled to the workers)."""
    location = storage.Location.of(cfg.ray.storage_path)
    return {"storage_path": location.path, "storage_filesystem": None if location.is_local else location.fs}


def export_and_test(cfg: RunConfig, data: shards.RunData, result: ray.train.Result, run_dir: storage.Location, run_id: str,
           tracking_uri: str, roles: cluster.NodeRoles) -> tuple[str, dict[str, float]]:
    """Export the best checkpoint in ``run_dir`` (by ``eval.select_metric`` on val,
    :func:`checkpoints.best_checkpoint`) into the MLflow run's ``model/`` and evaluate it once
    on the test split, when the data has one."""
    with tracking.RunLogger(tracking_uri, run_id) as run:  # closing it sends the buffered metrics
        registered_through = Path(result.checkpoint.path).name if result.checkpoint else ""
        with checkpoints.best_checkpoint(run_dir, selection_metric(cfg), cfg.eval.select_mode, registered_through
                                         ) as (best, checkpoint), tempfile.TemporaryDirectory() as tmp:
            best_uri = best.uri
            card = checkpoints.checkpoint_card(checkpoint)
            written = checkpoints.export_checkpoint(checkpoint, Path(tmp) / "model.pt")
            for path in written:
                run.log_artifact(path, tracking.MODEL_ARTIFACTS)
            run.set_tags({"pairsim.best_epoch": str(card.epoch), "pairsim.best_checkpoint": best_uri,
                          "pairsim.select_metric": cfg.eval.select_metric})
            logger.info("best checkpoint: epoch %s, %s = %.2f (%s); exported to the run's %s/", card.epoch,
                        selection_metric(cfg), card.val[selection_metric(cfg)], best_uri, tracking.MODEL_ARTIFACTS)
            split = cfg.data.test_split
            if not data.has(split):
                logger.info("no test split %r in %s: test evaluation skipped", split, cfg.data.split_path(split))
                return best_uri, {}
            model, _ = retrieval.load_exported(written[0])
        embeddings = inference.embed_with_ray_data(model, cfg, split, roles=roles, data=data)
        result_report = suite.evaluate_split(embeddings, retrieval.fusion_module(model, cfg.model), cfg.eval.ks)
        report.log_report(run, result_report, embeddings,
                          functools.partial(shards.read_rows, cfg.data.split_path(split), split),
                          split, int(result.metrics["step"]), title=f"{split}, best epoch {card.epoch}")
    return best_uri, result_report.metrics


def split_facts(data: shards.RunData, split: str) -> suite.DataFacts:
    """What ``split`` of the run's ``data`` holds that decides its metrics (read from the shards)."""
    return suite.DataFacts.from_columns(*shards.label_and_caption_counts(data.config.split_path(split), split,
                                                                         data.manifest(split)))


def skipped_metrics_tag(cfg: RunConfig, facts: dict[str, suite.DataFacts]) -> dict[str, str]:
    """``pairsim.skipped_metrics``: the metric groups the val (and test) split cannot give (from
    their ``facts`` by split), e.g. ``t2t,grid`` for one caption per image, each said once on the
    console; {} when none."""
    skipped: dict[str, str] = {}
    for split, held in facts.items():
        if groups := suite.skipped_groups(cfg.eval.ks, held):
            logger.info("the %s split of %s has %s: no %s metrics", split, cfg.data.split_path(split), held.describe(),
                        ", ".join(groups.values()))
        skipped |= groups
    return {"pairsim.skipped_metrics": ",".join(skipped)} if skipped else {}


MIN_SPLIT_IMAGES = 2  # a query ranks at least one candidate against another


@dataclass(frozen=True)
class RunPlan:
    """What :func:`plan_run` read and derived, handed down to the run rather than read again:
    the data's manifests, what the val split (and the test split, when the data has one) holds,
    steps per epoch and the DeepSpeed config."""

    data: shards.RunData
    facts: dict[str, suite.DataFacts]
    steps_per_epoch: int
    deepspeed_config: dict[str, Any]


def plan_run(cfg: RunConfig) -> RunPlan:
    """Everything that can be checked before the cluster is touched, and what it read. Local
    paths are checked as they are: :func:`fit` makes them absolute against the working
    directory first."""
    if not storage.is_uri(cfg.ray.storage_path) and (problem := storage.local_storage_problem(Path(cfg.ray.storage_path).resolve())):
        raise ConfigError(f"ray.storage_path: {problem}")
    if cfg.optim.impl == "deepspeed" and cluster.starts_local_instance(cfg):
        if problem := engine.deepspeed_ops_problem():  # a local instance: its workers run on this machine
            raise ConfigError(problem)
    clip.check_model_config(cfg.model)
    checkpoints.check_init_from(cfg.model)
    tracking.check_reachable(tracking.resolve_tracking_uri(cfg.tracking.tracking_uri))
    manifests: dict[str, shards.Manifest] = {}
    for split in (cfg.data.train_split, cfg.data.val_split):
        key, root = cfg.data.split_key(split), cfg.data.split_path(split)
        try:
            if str(root) not in manifests:
                manifests[str(root)] = shards.read_manifest(root)
            images = shards.verify_split(root, split, manifests[str(root)])
        except OSError as exc:  # missing or corrupt, or an object store that cannot be reached
            raise ConfigError(f"{key}: {exc}") from None
        if images < MIN_SPLIT_IMAGES:
            raise ConfigError(f"{key}: the {split} split of {cfg.data.split_path(split)} has {images} images; "
                              f"training and retrieval need at least {MIN_SPLIT_IMAGES}")
    data = shards.RunData(cfg.data, manifests)
    facts = split_facts(data, cfg.data.val_split)
    given = suite.selectable_metrics(cfg.eval.ks, facts)
    if cfg.eval.select_metric not in given:
        raise ConfigError(f"eval.select_metric: the {cfg.data.val_split} split of {cfg.data.split_path(cfg.data.val_split)} ({facts.describe()}) "
                          f"gives no {cfg.eval.select_metric!r}; it gives {', '.join(given)}")
    build.check_teachers(cfg)
    if cfg.loss.cusa and cfg.loss.cusa.teacher_features:
        TeacherStore(cfg.loss.cusa.teacher_features).check(cfg, build.build_teachers(cfg))
    if cfg.data.max_cpus is not None and cfg.data.max_cpus < cfg.data.cpus_per_task:
        raise ConfigError(f"data.max_cpus: {cfg.data.max_cpus} is less than one task's data.cpus_per_task "
                          f"({cfg.data.cpus_per_task}): ingest could never run")
    per_epoch = steps_per_epoch(cfg, data.split(cfg.data.train_split))
    if per_epoch < 1:
        raise ConfigError(
            f"train.micro_batch_size: {cfg.train.micro_batch_size} × {cfg.train.num_workers} workers × "
            f"{cfg.train.accumulate_steps} accumulated is larger than the {cfg.data.train_split} split of {cfg.data.path}")
    ds_config = engine.deepspeed_config(cfg.train, cfg.optim, per_epoch * cfg.train.epochs)
    if cfg.train.deepspeed:
        engine.check_deepspeed_config(ds_config)
    evaluated = {cfg.data.val_split: facts}
    if data.has(cfg.data.test_split) and cfg.data.test_split not in evaluated:
        evaluated[cfg.data.test_split] = split_facts(data, cfg.data.test_split)
    return RunPlan(data, evaluated, per_epoch, ds_config)


@dataclass(frozen=True)
class RunRole:
    """How a run differs by what started it, as data: a standalone run (:data:`STANDALONE`) holds
    its name, and exports and tests its best checkpoint at the end; a sweep trial
    (:meth:`sweep_trial`) does neither (the sweep holds its name and its ``best.yaml`` reproduces
    the trial that wins), reports each epoch to Tune through its Ray Train ``callbacks``, is a child
    of the sweep's MLflow run (``parent_run_id``, ``tags``) and retries its worker-group start-up
    ``startup_retries`` times (a trial that cannot get its workers fails instead of holding the
    sweep). ``logged_params``: keys logged each epoch as ``hparam/<key>`` (a PBT trial's schedule);
    ``reset_temperatures`` sets every τ to its configured init after the checkpoint is loaded (a
    PBT clone whose τ init was mutated). ``report_in_process`` set: one worker trained in the
    calling process (Ray Train's local mode: a warm sweep trial, :mod:`pairsim.tune.trial`), which
    keeps its checkpoints and hands each epoch's report and checkpoint to it (:class:`InProcess`)
    instead of ``callbacks``."""

    holds_name: bool = True
    tested: bool = True
    parent_run_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    callbacks: tuple[UserCallback, ...] = ()
    startup_retries: int = -1  # Ray's default: no limit
    logged_params: tuple[str, ...] = ()
    reset_temperatures: bool = False
    report_in_process: Callable[[dict[str, Any], str], None] | None = None

    @classmethod
    def sweep_trial(cls, parent_run_id: str, tags: dict[str, str], callbacks: tuple[UserCallback, ...],
                    logged_params: tuple[str, ...] = (), reset_temperatures: bool = False,
                    report_in_process: Callable[[dict[str, Any], str], None] | None = None) -> RunRole:
        return cls(holds_name=False, tested=False, parent_run_id=parent_run_id, tags=tags, callbacks=callbacks,
                   startup_retries=STARTUP_RETRIES, logged_params=logged_params,
                   reset_temperatures=reset_temperatures, report_in_process=report_in_process)


STANDALONE = RunRole()
RUN_LOCK = "pairsim-run.lock"  # in the run's directory while it lives (pairsim.locks)
STARTUP_RETRIES = 2  # worker-group start-up attempts (60 s each) a sweep trial retries before failing


def run_directory(storage_path: storage.LocationLike, name: str, what: str) -> storage.Location:
    """``<storage_path>/<name>``, where the run or sweep ``name`` (given by ``what``: ``ray.run_name``,
    ``--name``) keeps its checkpoints, state and lock: :class:`ConfigError` unless ``name`` is one
    plain name (:func:`pairsim.untrusted.child`) and, on a local path, the place is no symbolic
    link — a run writes into a directory of its own under ``ray.storage_path``, never through a
    link to somewhere else."""
    directory = untrusted.child(storage.Location.of(storage_path), name, what, ConfigError)
    if directory.is_local and os.path.islink(directory.path):
        raise ConfigError(f"{what}: {directory} is a symbolic link (to {os.path.realpath(directory.path)}); a run or "
                          "sweep writes only into a directory of its own under ray.storage_path: choose another name, "
                          "or remove the link")
    return directory


def fit(cfg: RunConfig, role: RunRole = STANDALONE, resume: bool = False) -> TrainResult:
    """Plan, launch and finalize one run; its MLflow run ends FINISHED, FAILED, or KILLED when a
    ``KeyboardInterrupt`` (Ctrl-C, or SIGTERM from ``ray job stop`` under
    :func:`pairsim.signals.stop_on_signals`) stops it, leaving the last epoch's checkpoint to resume from.

    A standalone run holds its name while it lives (:data:`RUN_LOCK` in its directory): a second
    run under a live run's ``ray.run_name`` is refused after the checks, before Ray starts
    (:class:`pairsim.locks.NameInUse`). A stopped or failed run's name resumes it; a finished
    run's only with ``resume`` (:func:`check_resume`)."""
    clock = StartupClock()
    cfg = cfg.with_absolute_paths()
    plan = plan_run(cfg)
    run_name = cfg.ray.run_name or datetime.now().strftime("pairsim-%Y%m%d-%H%M%S")
    run_dir = run_directory(cfg.ray.storage_path, run_name, "ray.run_name")
    with locks.hold(run_dir / RUN_LOCK, f"ray.run_name {run_name!r}") if role.holds_name else contextlib.nullcontext():
        if role.holds_name:
            check_resume(cfg, run_name, resume)
        return launch(cfg, plan, run_dir, clock, role)


@contextlib.contextmanager
def trained_here(cfg: RunConfig):
    """Around a run trained in the calling process: its process group (one rank: NCCL on a GPU,
    else gloo), and the engine's memory handed back after, for the next run in the process (the
    C heap's free pages too, where glibc's ``malloc_trim`` is there to ask)."""
    try:
        with dist.single_process_group("nccl" if cfg.train.use_gpu else "gloo"):
            yield
    finally:
        gc.collect()
        if cfg.train.use_gpu:
            torch.cuda.empty_cache()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def check_resume(cfg: RunConfig, run_name: str, resume: bool) -> None:
    """Whether ``run_name`` may start: a new name always; the name of a stopped, failed or
    crashed run resumes it (Ray Train restores its last checkpoint); a finished run's only when
    ``resume`` is asked for (``--resume``), which needs a run to continue. ConfigError otherwise,
    spelling out the choice."""
    uri = tracking.resolve_tracking_uri(cfg.tracking.tracking_uri)
    previous = tracking.previous_attempt(uri, cfg.tracking.experiment, run_name)
    where = f"experiment {cfg.tracking.experiment!r} of {storage.masked(uri)}"
    if previous is None:
        if resume:
            raise ConfigError(f"--resume: no run {run_name!r} in {where} to resume")
        return
    status = previous.info.status
    if status == "FINISHED" and not resume:
        ended = datetime.fromtimestamp(previous.info.end_time / 1000).isoformat(sep=" ", timespec="seconds")
        raise ConfigError(f"ray.run_name: {run_name!r} is a finished run (MLflow run {previous.info.run_id} in "
                          f"{where}, ended {ended}); to continue it (e.g. with more train.epochs) add --resume; "
                          "for a new run choose another ray.run_name")
    logger.info("resuming run %s (MLflow run %s, its last attempt %s)", run_name, previous.info.run_id,
                {"FINISHED": "finished", "RUNNING": "ended without a word (killed?)"}.get(status, status.lower()))


def launch(cfg: RunConfig, plan: RunPlan, run_dir: storage.Location, clock: StartupClock, role: RunRole) -> TrainResult:
    """Start or join Ray, open the MLflow run, build the Ray Data pipelines and run the workers'
    :class:`~pairsim.train.recipe.Recipe` under a ``TorchTrainer`` in ``run_dir``
    (:func:`run_directory`, its name the run's); then :func:`export_and_test` when the run is
    ``role.tested``."""
    run_name = run_dir.name
    clock.lap("checks")
    per_epoch, ds_config = plan.steps_per_epoch, plan.deepspeed_config
    tracking_uri = tracking.resolve_tracking_uri(cfg.tracking.tracking_uri)
    cluster.init_ray(cfg)
    roles = cluster.node_roles(cfg.ray.node_roles)
    cluster.check_cpu_budget(cfg, roles)
    clock.lap("ray")
    run_id = tracking.open_run(cfg, run_name, cfg.to_yaml(), ds_config, parent_run_id=role.parent_run_id,
                               tags=skipped_metrics_tag(cfg, plan.facts) | role.tags)
    tracking.log_datasets(tracking_uri, run_id, plan.data, test=role.tested)
    clock.lap("mlflow")

    run_skips = skips.new_scope(run_name)
    datasets = {
        "train": ingest.train_dataset(cfg, run_skips, *build.teacher_sources(cfg), data=plan.data),
        "val_images": ingest.eval_images(cfg, cfg.data.val_split, run_skips, plan.data),
        "val_texts": ingest.eval_texts(cfg, cfg.data.val_split, run_skips, plan.data),
    }
    data_config = DataConfig(datasets_to_split=["train"], execution_options={
        name: ingest.execution_options(cfg, roles.data, ordered=name == "train") for name in datasets})
    keeping = checkpoints.Keeping(selection_metric(cfg), cfg.eval.select_mode, cfg.ray.checkpoints_kept)
    in_process = role.report_in_process and InProcess(role.report_in_process, keeping)
    if in_process:  # Ray Train's local mode hands the loop each dataset as given: split here, for one worker
        datasets = data_config.configure(datasets, world_size=1, worker_handles=None, worker_node_ids=None)[0]
    worker_resources = {"CPU": cfg.train.cpus_per_worker} | ({"GPU": cfg.train.gpus_per_worker}
                                                             if cfg.train.use_gpu else {})
    checkpoints.set_aside_stale_snapshot(run_dir)
    if in_process:  # where Ray Train would have made it
        run_dir.fs.create_dir(run_dir.path, recursive=True)
    clock.lap("datasets")
    # The job goes pickled: the Train controller unpickles train_loop_config before it asks for
    # workers, and a WorkerJob would make it import torch, open_clip and DeepSpeed first.
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"job": pickle.dumps(WorkerJob(cfg, ds_config, per_epoch, run_id, tracking_uri, run_skips,
                                            log_level=logging.getLevelName(logger.getEffectiveLevel()),
                                            startup=clock, run_dir=run_dir.uri,
                                            logged_params={f"hparam/{key}": float(cfg.flat()[key])
                                                           for key in role.logged_params},
                                            reset_temperatures=role.reset_temperatures,
                                            train_images=plan.data.split(cfg.data.train_split).images,
                                            in_process=in_process))},
        scaling_config=ScalingConfig(num_workers=0 if in_process else cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                     resources_per_worker=worker_resources, label_selector=roles.train),
        run_config=ray.train.RunConfig(
            name=run_name, **ray_storage(cfg),
            checkpoint_config=CheckpointConfig(num_to_keep=keeping.num_to_keep, checkpoint_score_attribute=keeping.metric,
                                               checkpoint_score_order=keeping.mode),
            failure_config=FailureConfig(max_failures=cfg.ray.max_failures,
                                         controller_failure_limit=role.startup_retries),
            callbacks=list(role.callbacks)),
        datasets=datasets,
        dataset_config=data_config,
    )
    best_path, test_metrics = None, {}
    with tracking.ending_run(tracking_uri, run_id) as outcome, signals.stop_on_signals():
        try:
            try:
                with trained_here(cfg) if in_process else compat.ray.ctrl_c_in_fit():
                    result = trainer.fit()
            except ray.train.TrainingFailedError as exc:  # a shard that fails its check is reported as itself
                if (bad_shard := checksum_failure(exc)) is not None:
                    raise bad_shard from None
                raise
            if role.tested:
                best_path, test_metrics = export_and_test(cfg, plan.data, result, run_dir, run_id, tracking_uri, roles)
            outcome.succeeded = True
        finally:
            run_skips.drop()
    return TrainResult(run_name, run_id, tracking_uri, dict(result.metrics or {}),
                       result.checkpoint and checkpoint_uri(result.checkpoint), best_path, test_metrics)
