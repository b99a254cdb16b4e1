"""The training recipe: what every Ray Train worker runs, top to bottom.

:meth:`Recipe.setup` builds the objective and the DeepSpeed engine around it
(:mod:`pairsim.train.engine`), asks for the worker's data and restores Ray Train's latest
checkpoint of the run; then, for each epoch, :meth:`Recipe.train_epoch` trains on the global
batch, :meth:`Recipe.validate` evaluates on val (rank 0 reports) and :meth:`Recipe.save`
checkpoints on every rank, which Ray Train merges and keeps; :meth:`Recipe.cleanup` sends what
rank 0 still holds to MLflow. What is timed, counted and logged around these steps is
:class:`pairsim.train.hooks.Hooks`.
"""

from __future__ import annotations

import pickle

import ray.train
import torch

from pairsim import dist, log, storage
from pairsim.build import build_objective, teacher_sources
from pairsim.data import ingest
from pairsim.eval import suite
from pairsim.models import clip, retrieval
from pairsim.train import accumulation, checkpoints
from pairsim.train import engine as engines
from pairsim.train.hooks import Hooks
from pairsim.train.worker import WorkerJob, embed_split, selection_metric, teacher_embeddings, val_inputs

logger = log.get_logger("train")


def train_loop_per_worker(loop_config: dict[str, bytes]) -> None:
    """Ray Train's entry point on each worker: the driver's :class:`WorkerJob` (pickled by
    :func:`pairsim.train.driver.fit`) run as a :class:`Recipe`."""
    Recipe(pickle.loads(loop_config["job"])).run()


class Recipe:
    """One worker's share of a run: config in, checkpoints and (rank 0) MLflow metrics out."""

    def __init__(self, job: WorkerJob):
        self.job, self.cfg = job, job.cfg
        log.setup(job.log_level)
        self.rank, self.world = dist.rank(), dist.world_size()

    def run(self) -> None:
        """Set up, then train, validate and save each epoch left; clean up also after a failure."""
        self.setup()
        try:
            for epoch in range(self.start_epoch, self.cfg.train.epochs):
                self.train_epoch(epoch)
                metrics = self.validate(epoch)
                self.save(epoch, metrics)
        finally:
            self.cleanup()

    def setup(self) -> None:
        """The engine over the objective, the live teachers, the train shard and val inputs, and
        the epoch and step to start from (the latest checkpoint's, or 0)."""
        job, cfg, clock = self.job, self.cfg, self.job.startup
        clock.lap("worker_group")  # the driver's TorchTrainer.fit → here: controller, workers, process group
        # asked for first: Ray Data starts the split's coordinator (a new process) while the engine builds
        self.train_shard = ray.train.get_dataset_shard("train")

        objective = build_objective(cfg.loss, self.rank, self.world)
        self.engine = engines.create_engine(cfg, job.deepspeed_config, objective)
        clock.lap("engine")
        self.dtype = engines.DTYPES[cfg.train.precision]
        self.live_teachers, _ = teacher_sources(cfg)  # extracted features come with the batch
        self.start_epoch, self.step = checkpoints.restore(self.engine, job.run_dir, job.in_process is not None)
        if self.step and job.reset_temperatures:
            engines.clamp_temperatures(self.engine, to_init=True)
        clock.lap("restore")
        if self.rank == 0 and self.step:
            logger.info("resumed from checkpoint: epoch %d, step %d%s", self.start_epoch + 1, self.step,
                        "; temperatures set to their init" if job.reset_temperatures else "")

        self.hooks = Hooks(job, self.rank, self.world)  # opens the MLflow run on rank 0
        self.normalize = clip.PixelNormalizer(cfg.model)
        self.val = val_inputs(cfg, self.engine.device)
        clock.lap("worker_mlflow")

    def train_epoch(self, epoch: int) -> None:
        """One pass over this worker's shard of the train split (reshuffled each epoch), one
        optimizer step per ``train.accumulate_steps`` micro-batches."""
        cfg, device = self.cfg, self.engine.device
        self.hooks.epoch_started()
        # copied to the engine's device in Ray Data's prefetch thread, from page-locked memory on a GPU
        batches = self.train_shard.iter_torch_batches(
            batch_size=cfg.train.micro_batch_size, drop_last=True, prefetch_batches=cfg.data.prefetch_batches,
            device=device, pin_memory=cfg.train.use_gpu and cfg.data.pin_memory,
            local_shuffle_buffer_size=cfg.data.shuffle_buffer or None,
            local_shuffle_seed=ingest.local_shuffle_seed(cfg.data.seed, epoch, self.rank))
        steps = accumulation.groups(ingest.equal_steps(batches), cfg.train.accumulate_steps)
        for epoch_step, group in enumerate(steps, start=1):
            self.hooks.batch_ready(group)
            out = self.train_step(group, epoch)
            self.step += 1
            self.hooks.step_done(self.engine, out, self.step, epoch, epoch_step)
        self.hooks.epoch_trained(epoch, self.step, device)

    def train_step(self, group: list[dict[str, torch.Tensor]], epoch: int) -> dict[str, torch.Tensor]:
        """One optimizer step over ``group``'s micro-batches (:func:`accumulation.train_step`),
        then every temperature clamped into its range; returns the objective's outputs."""
        inputs = [{"image": self.normalize(batch["pixels"], self.dtype), "text": batch["tokens"],
                   "group_ids": batch["group_ids"], **teacher_embeddings(batch, self.live_teachers, self.engine.device)}
                  for batch in group]
        try:
            out = accumulation.train_step(self.engine, inputs,
                                          cache_features=self.cfg.train.accumulate_mode == "cache_features")
        except FloatingPointError as exc:
            raise FloatingPointError(f"epoch {epoch + 1} step {self.step + 1}: {exc}") from None
        engines.clamp_temperatures(self.engine)
        return out

    def validate(self, epoch: int) -> dict[str, float]:
        """The val split's evaluation suite (:func:`pairsim.eval.suite.evaluate_split`) and the
        skipped-image count, reported by rank 0 and returned there ({} on other ranks). Every
        rank embeds the whole split (which keeps ZeRO-3's parameter gathering in step)."""
        cfg = self.cfg
        embeddings = embed_split(self.engine, cfg, self.dtype, self.val)
        if self.rank != 0:
            return {}
        report = suite.evaluate_split(embeddings, retrieval.fusion_module(self.engine.module.model, cfg.model),
                                      cfg.eval.ks)
        metrics = {f"val/{k}": v for k, v in report.metrics.items()}
        if selection_metric(cfg) not in metrics:
            raise ValueError(f"eval.select_metric: the val split gives no {cfg.eval.select_metric!r} "
                             f"(it gives {', '.join(report.metrics)})")
        metrics["data/skipped_images"] = self.hooks.skipped_images()
        self.hooks.validated(report, embeddings, metrics, self.step, epoch, self.engine.device)
        return metrics

    def save(self, epoch: int, metrics: dict[str, float]) -> None:
        """The epoch's checkpoint, saved by every rank (:func:`checkpoints.save_checkpoint`), with
        rank 0's model card and val ``metrics`` (which Ray Train ranks checkpoints by); a run
        trained in the calling process keeps it itself and reports it (``job.in_process``)."""
        card = None
        if self.rank == 0:
            card = retrieval.model_card(self.cfg.model, self.engine.module.model, zero_stage=self.cfg.train.zero_stage,
                                        epoch=epoch + 1, step=self.step, val=metrics)
        report, in_process = {"epoch": epoch + 1, "step": self.step, **metrics}, self.job.in_process
        kept = checkpoints.save_checkpoint(
            self.engine, epoch, self.step, card, report,
            keep_in=in_process and (storage.Location.of(self.job.run_dir), in_process.keeping))
        if in_process:
            in_process.report(report, kept)

    def cleanup(self) -> None:
        """Rank 0's last pictures and buffered metrics to MLflow; also after a failed step. A
        run trained in the calling process also ends what would outlive it there: the engine
        (``destroy``: its optimizer's hooks, and Python's automatic GC, which DeepSpeed turns off
        while an engine lives) and the process group, DeepSpeed's cached groups with it."""
        try:
            self.hooks.close()
        finally:
            if self.job.in_process:
                self.engine.destroy()
                engines.release_process_group()
