"""The per-worker training loop Ray Train runs on every worker: config in, metrics out.

Build the DeepSpeed engine (:mod:`pairsim.train.engine`), resume from Ray Train's latest
checkpoint if there is one, then for each epoch: train on the global batch, evaluate on val
(rank 0 logs to MLflow), and save a checkpoint on every rank that Ray Train merges and keeps.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.train
import torch

from pairsim import dist, log
from pairsim.config import RunConfig
from pairsim.data import ingest, shards
from pairsim.eval import inference, similarity, suite
from pairsim.eval.report import log_pictures
from pairsim.models import clip, retrieval
from pairsim.teachers.encoders import MODALITIES, Teacher
from pairsim.teachers.store import teacher_sources
from pairsim.tracking import RunLogger
from pairsim.train import accumulation, checkpoints
from pairsim.train import engine as engines

logger = log.get_logger("train")
CONSOLE_METRICS = ("val/i2t_R@1", "val/t2i_R@1", "val/rsum", "val/t2t_R@1", "val/i2i_R@1", "val/grid_text2fused_R@1")


@dataclass(frozen=True)
class WorkerJob:
    """What the driver hands every worker: the validated run config and what it derived."""

    cfg: RunConfig
    deepspeed_config: dict[str, Any]
    steps_per_epoch: int
    run_id: str
    tracking_uri: str
    ledger: str  # name of the run's skipped-image ledger actor
    log_level: str
    startup: StartupClock  # started when the driver's fit began: perf/startup_s counts from it
    run_dir: str  # where the run's checkpoints are (a path or URI): resumes pick from them
    logged_params: dict[str, float]  # logged with each epoch's val metrics (a PBT trial's hyperparameters)
    reset_temperatures: bool  # every τ to its configured init once the checkpoint is loaded
    train_images: int  # in the train split (data.audit_epochs counts those trained)


class StartupClock:
    """Where a run's start-up goes: ``lap(phase)`` books the wall time since the previous lap
    to ``phase``; the driver laps its phases, hands the clock to the workers (it pickles), and
    rank 0 laps its own and logs them all at the first step as ``perf/startup/<phase>_s``
    beside their sum, ``perf/startup_s`` (``fit`` called → first step done)."""

    def __init__(self):
        self.started = self.last = time.time()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def metrics(self) -> dict[str, float]:
        return {f"perf/startup/{phase}_s": s for phase, s in self.phases.items()} | {
            "perf/startup_s": self.last - self.started}


def selection_metric(cfg: RunConfig) -> str:
    """The reported val metric that picks the best checkpoint."""
    return f"val/{cfg.eval.select_metric}"


class StepTimer:
    """One epoch's time spent waiting for data vs computing — the wait for its first batch (Ray
    Data starting the epoch's stream) kept apart — and samples/s over the logging window."""

    def __init__(self, samples_per_step: int):
        self.samples_per_step = samples_per_step
        self.wait = self.compute = 0.0
        self.first_batch_wait: float | None = None
        self.last = self.window_start = time.perf_counter()
        self.window_steps = 0

    def batch_ready(self) -> None:
        now = time.perf_counter()
        if self.first_batch_wait is None:
            self.first_batch_wait = now - self.last
        self.wait, self.last = self.wait + now - self.last, now

    def step_done(self) -> None:
        now = time.perf_counter()
        self.compute, self.last = self.compute + now - self.last, now
        self.window_steps += 1

    def window_rate(self) -> float:
        """samples/s since the last call, which starts a new window."""
        rate = self.window_steps * self.samples_per_step / (self.last - self.window_start)
        self.window_start, self.window_steps = self.last, 0
        return rate

    def metrics(self) -> dict[str, float]:
        """``perf/data_wait_share`` of the epoch's step time, the same after the first batch
        (``perf/data_wait_share_running``) and the first batch's wait in seconds."""
        first = self.first_batch_wait or 0.0
        return {"perf/data_wait_share": self.wait / max(self.wait + self.compute, 1e-9),
                "perf/data_wait_share_running": (self.wait - first) / max(self.wait - first + self.compute, 1e-9),
                "perf/first_batch_wait_s": first}


def epoch_seconds(started: float, device: torch.device) -> float:
    """Seconds since ``started`` once the work queued on ``device`` is done (one sync an epoch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def epoch_costs(train_s: float, val_s: float, device: torch.device) -> dict[str, float]:
    """An epoch's ``perf/train_epoch_s``, ``perf/val_s`` and their ratio ``perf/val_share`` (the
    per-epoch validation against the training it follows) and, on a GPU, the peak memory
    allocated so far (``perf/gpu_peak_memory_gib``, torch's allocator)."""
    costs = {"perf/train_epoch_s": train_s, "perf/val_s": val_s, "perf/val_share": val_s / max(train_s, 1e-9)}
    if device.type == "cuda":
        costs["perf/gpu_peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return costs


def progress_eta(steps_left: int, samples_per_step: int, samples_per_s: float) -> str:
    """The training steps' ETA at the current rate (validation comes on top)."""
    if samples_per_s <= 0:
        return "ETA unknown"
    return f"ETA {log.duration(steps_left * samples_per_step / samples_per_s)} of training (+ validation)"


def teacher_embeddings(batch: dict[str, torch.Tensor], live: dict[str, Teacher],
                       device) -> dict[str, torch.Tensor]:
    """``teacher_image`` / ``teacher_text`` of a batch: extracted ones as they come, live ones
    embedded here from the teacher inputs the pipeline prepared."""
    out = {}
    for modality in MODALITIES:
        key = f"teacher_{modality}"
        if key in batch:
            out[key] = batch[key].to(device)
        elif modality in live:
            inputs = {k.split(".", 1)[1]: v for k, v in batch.items() if k.startswith(key + ".")}
            out[key] = live[modality].embed(inputs, device)
    return out


class ValInputs:
    """The val split's model inputs — decoded pixels, tokens and their ids, batch by batch — as
    Ray Data gives them (:func:`pairsim.data.ingest.eval_images` / ``eval_texts``), and, once a
    whole pass has fitted ``budget_bytes``, as kept on ``device`` from it: the split does not
    change between epochs, so later validations embed the kept batches instead of reading and
    decoding it again. A pass over the budget stops keeping for good."""

    MODEL_INPUTS = ("pixels", "tokens")

    def __init__(self, read: Callable[[], Iterable[dict[str, np.ndarray]]], budget_bytes: float,
                 device: torch.device):
        self.read, self.budget, self.device = read, budget_bytes, device
        self.kept: list[dict[str, np.ndarray | torch.Tensor]] | None = None
        self.keeping = budget_bytes > 0

    def __iter__(self) -> Iterator[dict[str, np.ndarray | torch.Tensor]]:
        if self.kept is not None:
            yield from self.kept
            return
        kept: list[dict[str, np.ndarray | torch.Tensor]] | None = [] if self.keeping else None
        size = 0
        for batch in self.read():
            if kept is not None:
                size += sum(batch[k].nbytes for k in self.MODEL_INPUTS if k in batch)
                if size > self.budget:  # the split is larger than the budget: read it every epoch
                    kept, self.keeping = None, False
                else:
                    batch = self._on_device(batch)
                    kept.append(batch)
            yield batch
        if kept is not None:
            self.kept = kept

    def _on_device(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray | torch.Tensor]:
        return {k: torch.from_numpy(np.require(v, requirements="W")).to(self.device) if k in self.MODEL_INPUTS else v
                for k, v in batch.items()}


def val_inputs(cfg: RunConfig, device: torch.device) -> ValInputs:
    """This worker's :class:`ValInputs` of the val split: its images' batches, then its captions'."""
    def read():
        for name in ("val_images", "val_texts"):
            for batch in ray.train.get_dataset_shard(name).iter_batches(batch_size=cfg.eval.batch_size,
                                                                        batch_format="numpy"):
                if len(batch["image_id"]):  # a batch whose images were all unreadable is empty
                    yield batch

    return ValInputs(read, cfg.eval.val_cache_gib * 2**30, device)


def embed_split(engine, cfg: RunConfig, dtype: torch.dtype, inputs: ValInputs) -> suite.SplitEmbeddings:
    """The val split's image and caption embeddings (uni-modal ones too, when the model has
    heads for them), computed on every rank from ``inputs`` and left on its device (the GPU's,
    where the evaluation then runs).

    Every rank runs the same forwards over the whole split, which keeps ZeRO-3's parameter
    gathering in step; rank 0 uses the result.
    """
    normalize = clip.PixelNormalizer(cfg.model)
    engine.eval()
    with torch.no_grad():
        batches = [inference.embed_batch(engine, batch, normalize, engine.device, dtype, to_host=False)
                   for batch in inputs]
    engine.train()
    return suite.SplitEmbeddings.from_batches(batches)


class EpochPictures:
    """Rank 0's per-epoch pictures drawn and logged by one background thread, so the next epoch
    trains while matplotlib draws (host work the GPU waited for); an epoch's drawing error is
    raised at the next ``submit`` or at ``close``, which waits for the last epoch's pictures."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pairsim-pictures")
        self._pending: Future | None = None

    def submit(self, draw: Callable[[], None]) -> None:
        self.wait()
        self._pending = self._executor.submit(draw)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)


def validate(engine, cfg: RunConfig, dtype: torch.dtype, inputs: ValInputs, ledger, run: RunLogger | None,
             pictures: EpochPictures | None, step: int, epoch: int) -> dict[str, float]:
    """The val split's evaluation suite (:func:`pairsim.eval.suite.evaluate_split`) and the
    skipped-image count, logged on rank 0 ({} on other ranks) and returned; also logged, not
    returned, by ``pictures``' thread: the positive vs hardest-negative similarities of (1-based)
    ``epoch`` (:func:`pairsim.eval.similarity.log_similarities`), the modality-grid heatmap and a
    retrieval gallery (:func:`pairsim.eval.report.log_pictures`)."""
    embeddings = embed_split(engine, cfg, dtype, inputs)
    if run is None:
        return {}
    report = suite.evaluate_split(embeddings, retrieval.fusion_module(engine.module.model, cfg.model), cfg.eval.ks)
    embeddings = embeddings.to("cpu")  # the pictures and similarity histograms are drawn on the host
    metrics = {f"val/{k}": v for k, v in report.metrics.items()}
    if selection_metric(cfg) not in metrics:
        raise ValueError(f"eval.select_metric: the val split gives no {cfg.eval.select_metric!r} "
                         f"(it gives {', '.join(report.metrics)})")
    skipped = ray.get(ledger.get.remote())
    metrics["data/skipped_images"] = len(skipped)
    if skipped:
        run.log_dict(skipped, "data/skipped_images.json")
        logger.warning("skipped %d unreadable images so far, e.g. %s; all are listed in the run's "
                       "data/skipped_images.json", len(skipped), next(iter(skipped.items())))
    pictured = run.logged_before(selection_metric(cfg), step)  # by an attempt lost after its validation
    run.log_metrics(metrics, step)

    def draw() -> None:
        similarity.log_similarities(run, embeddings, step, epoch)
        if not pictured:
            rows = functools.partial(shards.read_rows, cfg.data.split_path(cfg.data.val_split), cfg.data.val_split)
            log_pictures(run, report, embeddings, rows, "val", step, title=f"val, epoch {epoch}")

    pictures.submit(draw)
    return metrics


def train_loop_per_worker(loop_config: dict[str, bytes]) -> None:
    job: WorkerJob = pickle.loads(loop_config["job"])  # pickled by the driver: see driver.fit
    cfg = job.cfg
    log.setup(job.log_level)
    rank, world = dist.rank(), dist.world_size()
    clock = job.startup
    clock.lap("worker_group")  # the driver's TorchTrainer.fit → this loop: controller, workers, process group
    # asked for first: Ray Data starts the split's coordinator (a new process) while the engine builds
    train_shard = ray.train.get_dataset_shard("train")

    engine = engines.create_engine(cfg, job.deepspeed_config)
    clock.lap("engine")
    dtype = engines.DTYPES[cfg.train.precision]
    live_teachers, _ = teacher_sources(cfg)  # extracted features come with the batch
    start_epoch, step = checkpoints.restore(engine, job.run_dir)
    if step and job.reset_temperatures:
        engines.clamp_temperatures(engine, to_init=True)
    clock.lap("restore")
    if rank == 0 and step:
        logger.info("resumed from checkpoint: epoch %d, step %d%s", start_epoch + 1, step,
                    "; temperatures set to their init" if job.reset_temperatures else "")

    run = (RunLogger(job.tracking_uri, job.run_id, cfg.tracking.system_metrics_interval_s, tolerate_outage=True,
                     continues_run=True) if rank == 0 else None)
    ledger = ray.get_actor(job.ledger)
    normalize = clip.PixelNormalizer(cfg.model)
    pictures = EpochPictures() if run else None
    val = val_inputs(cfg, engine.device)
    clock.lap("worker_mlflow")

    try:
        for epoch in range(start_epoch, cfg.train.epochs):
            epoch_started = time.perf_counter()
            # copied to the engine's device in Ray Data's prefetch thread, from page-locked memory on a GPU
            batches = train_shard.iter_torch_batches(
                batch_size=cfg.train.micro_batch_size, drop_last=True, prefetch_batches=cfg.data.prefetch_batches,
                device=engine.device, pin_memory=cfg.train.use_gpu and cfg.data.pin_memory,
                local_shuffle_buffer_size=cfg.data.shuffle_buffer or None,
                local_shuffle_seed=ingest.local_shuffle_seed(cfg.data.seed, epoch, rank))
            timer = StepTimer(cfg.train.micro_batch_size * world * cfg.train.accumulate_steps)
            audit = ingest.EpochAudit(job.train_images) if cfg.data.audit_epochs else None
            micro_batches = accumulation.groups(ingest.equal_steps(batches), cfg.train.accumulate_steps)
            for epoch_step, group in enumerate(micro_batches, start=1):
                timer.batch_ready()
                if audit:
                    for batch in group:
                        audit.record(batch)
                first_of_attempt = epoch_step == 1 and epoch == start_epoch
                if first_of_attempt:
                    clock.lap("first_batch")
                try:
                    out = accumulation.train_step(engine, [
                        {"image": normalize(batch["pixels"], dtype), "text": batch["tokens"],
                         "group_ids": batch["group_ids"], **teacher_embeddings(batch, live_teachers, engine.device)}
                        for batch in group],
                        cache_features=cfg.train.accumulate_mode == "cache_features")
                except FloatingPointError as exc:
                    raise FloatingPointError(f"epoch {epoch + 1} step {step + 1}: {exc}") from None
                loss = out["loss"]
                engines.clamp_temperatures(engine)
                step += 1
                timer.step_done()
                if run and first_of_attempt:
                    clock.lap("first_step")
                    run.log_metrics(clock.metrics(), step)
                if step % cfg.train.log_every_n_steps == 0:
                    logged = dist.mean_over_ranks({k: v for k, v in out.items() if k != "loss"} | {"train/loss": loss})
                    rate = timer.window_rate()
                    if run:
                        lr = engine.get_lr()[0]
                        progress = epoch + epoch_step / max(job.steps_per_epoch, 1)
                        run.log_metrics(logged | {"train/lr": lr, "train/samples_per_s": rate, "train/epoch": progress},
                                        step)
                        total = job.steps_per_epoch * cfg.train.epochs
                        logger.info("epoch %d/%d step %d/%d loss %.4f lr %.2e %.0f samples/s, %s", epoch + 1,
                                    cfg.train.epochs, step, total, logged["train/loss"], lr, rate,
                                    progress_eta(total - step, timer.samples_per_step, rate))

            if audit:
                audited = audit.metrics()
                if run:
                    run.log_metrics(audited, step)
                    (logger.warning if audited["data/epoch_pairs_repeated"] else logger.info)(
                        "epoch %d trained %d pairs, %d of them more than once; %d train images unseen (under a "
                        "micro-batch a rank is what drop_last leaves)", epoch + 1, audited["data/epoch_pairs"],
                        audited["data/epoch_pairs_repeated"], audited["data/epoch_images_unseen"])
            train_s = epoch_seconds(epoch_started, engine.device)
            metrics = validate(engine, cfg, dtype, val, ledger, run, pictures, step, epoch + 1)
            val_s = epoch_seconds(epoch_started, engine.device) - train_s
            card = None
            if run:
                run.log_metrics(timer.metrics() | epoch_costs(train_s, val_s, engine.device) | job.logged_params, step)
                run.flush()  # the epoch's queued metrics are in MLflow before its checkpoint
                shown = dict.fromkeys([*CONSOLE_METRICS, selection_metric(cfg), "data/skipped_images"])
                logger.info("epoch %d %s  (every metric in MLflow)", epoch + 1, "  ".join(
                    f"{k.removeprefix('val/')}={metrics[k]:.2f}" for k in shown if k in metrics))
                card = retrieval.model_card(cfg.model, engine.module.model, zero_stage=cfg.train.zero_stage,
                                            epoch=epoch + 1, step=step, val=metrics)
            checkpoints.save_checkpoint(engine, epoch, step, card, metrics)
    finally:
        if run:  # the last pictures, then what is buffered, go to MLflow (or its spill file), also when a step failed
            try:
                pictures.close()
            finally:
                run.close()
