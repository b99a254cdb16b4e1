"""The training recipe's instrumentation (:mod:`pairsim.train.recipe`): what is timed, counted
and logged around its steps, none of which changes what trains.

:class:`Hooks` is called at fixed points of an epoch: it laps the start-up clock up to the
first step, times data wait against compute (:class:`StepTimer`), audits the pairs an epoch
trains (``data.audit_epochs``), averages and logs the train metrics every
``train.log_every_n_steps`` steps and, on rank 0, logs each epoch's validation, costs and
pictures to MLflow (pictures drawn by a background thread, :class:`EpochPictures`) with a line
on the console.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pairsim import dist, log
from pairsim.data import ingest, shards
from pairsim.eval import similarity, suite
from pairsim.eval.report import log_pictures
from pairsim.tracking import RunLogger
from pairsim.train.worker import WorkerJob, selection_metric

logger = log.get_logger("train")
CONSOLE_METRICS = ("val/i2t_R@1", "val/t2i_R@1", "val/rsum", "val/t2t_R@1", "val/i2i_R@1", "val/grid_text2fused_R@1")


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


class Hooks:
    """One worker's instrumentation. Every rank calls every hook, in step (the logged train
    metrics are averaged over ranks, a collective); rank 0 alone has the MLflow run (``run``)
    and logs. Epoch numbers are 0-based as the recipe counts them."""

    def __init__(self, job: WorkerJob, rank: int, world: int):
        cfg = self.cfg = job.cfg
        self.job, self.clock = job, job.startup
        self.run = (RunLogger(job.tracking_uri, job.run_id, cfg.tracking.system_metrics_interval_s,
                              tolerate_outage=True, continues_run=True) if rank == 0 else None)
        self.pictures = EpochPictures() if self.run else None
        self.samples_per_step = cfg.train.micro_batch_size * world * cfg.train.accumulate_steps
        self.stepped = False  # this attempt's first step is done

    def epoch_started(self) -> None:
        self.started = time.perf_counter()
        self.timer = StepTimer(self.samples_per_step)
        self.audit = ingest.EpochAudit(self.job.train_images) if self.cfg.data.audit_epochs else None

    def batch_ready(self, group: list[dict[str, torch.Tensor]]) -> None:
        """A step's micro-batches came from Ray Data."""
        self.timer.batch_ready()
        if self.audit:
            for batch in group:
                self.audit.record(batch)
        if not self.stepped:
            self.clock.lap("first_batch")

    def step_done(self, engine, out: dict[str, torch.Tensor], step: int, epoch: int, epoch_step: int) -> None:
        """Optimizer step ``step`` (``epoch_step`` of ``epoch``) gave the objective's ``out``:
        start-up metrics after the first, train metrics every ``train.log_every_n_steps``."""
        cfg, run = self.cfg, self.run
        self.timer.step_done()
        if not self.stepped:
            self.stepped = True
            self.clock.lap("first_step")
            if run:
                run.log_metrics(self.clock.metrics(), step)
        if step % cfg.train.log_every_n_steps:
            return
        logged = dist.mean_over_ranks({k: v for k, v in out.items() if k != "loss"} | {"train/loss": out["loss"]})
        rate = self.timer.window_rate()
        if run:
            lr = engine.get_lr()[0]
            per_epoch = self.job.steps_per_epoch
            run.log_metrics(logged | {"train/lr": lr, "train/samples_per_s": rate,
                                      "train/epoch": epoch + epoch_step / max(per_epoch, 1)}, step)
            total = per_epoch * cfg.train.epochs
            logger.info("epoch %d/%d step %d/%d loss %.4f lr %.2e %.0f samples/s, %s", epoch + 1, cfg.train.epochs,
                        step, total, logged["train/loss"], lr, rate, progress_eta(total - step, self.samples_per_step, rate))

    def epoch_trained(self, epoch: int, step: int, device: torch.device) -> None:
        """The epoch's steps are done: its audit gathered (a collective) and logged, its
        training time taken."""
        audited = self.audit.metrics() if self.audit else None
        if audited is not None and self.run:
            self.run.log_metrics(audited, step)
            (logger.warning if audited["data/epoch_pairs_repeated"] else logger.info)(
                "epoch %d trained %d pairs, %d of them more than once; %d train images unseen (under a "
                "micro-batch a rank is what drop_last leaves)", epoch + 1, audited["data/epoch_pairs"],
                audited["data/epoch_pairs_repeated"], audited["data/epoch_images_unseen"])
        self.train_s = epoch_seconds(self.started, device)

    def skipped_images(self) -> int:
        """Rank 0: how many images the run's data pipelines skipped as unreadable so far (its
        :class:`~pairsim.data.skips.Skips`), listed in the run's ``data/skipped_images.json``."""
        skipped = self.job.skips.recorded()
        if skipped:
            self.run.log_dict(skipped, "data/skipped_images.json")
            logger.warning("skipped %d unreadable images so far, e.g. %s; all are listed in the run's "
                           "data/skipped_images.json", len(skipped), next(iter(skipped.items())))
        return len(skipped)

    def validated(self, report: suite.EvalReport, embeddings: suite.SplitEmbeddings, metrics: dict[str, float],
                  step: int, epoch: int, device: torch.device) -> None:
        """Rank 0, after ``epoch``'s validation gave ``report`` over ``embeddings``: its
        ``metrics`` logged, with the epoch's step timings, costs and ``job.logged_params``, and
        flushed to MLflow (before the checkpoint); a line on the console; and, by the pictures'
        thread, the positive vs hardest-negative similarities
        (:func:`pairsim.eval.similarity.log_similarities`), the modality-grid heatmap and a
        retrieval gallery (:func:`pairsim.eval.report.log_pictures`), the last two once per
        epoch across attempts."""
        cfg, run = self.cfg, self.run
        embeddings = embeddings.to("cpu")  # the pictures and similarity histograms are drawn on the host
        pictured = run.logged_before(selection_metric(cfg), step)  # by an attempt lost after its validation
        run.log_metrics(metrics, step)

        def draw() -> None:
            similarity.log_similarities(run, embeddings, step, epoch + 1)
            if not pictured:
                rows = functools.partial(shards.read_rows, cfg.data.split_path(cfg.data.val_split), cfg.data.val_split)
                log_pictures(run, report, embeddings, rows, "val", step, title=f"val, epoch {epoch + 1}")

        self.pictures.submit(draw)
        val_s = epoch_seconds(self.started, device) - self.train_s
        run.log_metrics(self.timer.metrics() | epoch_costs(self.train_s, val_s, device) | self.job.logged_params, step)
        run.flush()  # the epoch's queued metrics are in MLflow before its checkpoint
        shown = dict.fromkeys([*CONSOLE_METRICS, selection_metric(cfg), "data/skipped_images"])
        logger.info("epoch %d %s  (every metric in MLflow)", epoch + 1, "  ".join(
            f"{k.removeprefix('val/')}={metrics[k]:.2f}" for k in shown if k in metrics))

    def close(self) -> None:
        """The last pictures, then what is buffered, to MLflow (or its spill file); also after a failure."""
        if self.run:
            try:
                self.pictures.close()
            finally:
                self.run.close()
