"""Distributed training: Ray Train ``TorchTrainer`` workers running a DeepSpeed engine.

Driver (:func:`fit`): check data and model, start or join Ray, open the MLflow run, build the
lazy Ray Data pipelines and launch the workers. Worker (:func:`train_loop_per_worker`): config
in, metrics out — build the model and DeepSpeed engine, resume from the Ray Train checkpoint
if there is one, then for each epoch train on the global batch, evaluate on val, and save a
DeepSpeed checkpoint on every rank that Ray Train merges and keeps.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointConfig, DataConfig, FailureConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from pairsim import data, evaluate, export, models, shards, teachers, tracking
from pairsim.config import ConfigError, RunConfig
from pairsim.losses import Objective, build_objective



class TrainingModule(torch.nn.Module):
    """What the DeepSpeed engine wraps: the retrieval model and the objective, whose learnable
    temperatures train (and are partitioned by ZeRO) with the model.

    ``forward(image, text)`` returns the model's embeddings; given the batch's ``group_ids``
    (and teacher embeddings for CUSA) it returns the objective's loss terms instead.
    """

    def __init__(self, model: models.RetrievalModel, objective: Objective):
        super().__init__()
        self.model, self.objective = model, objective

    def forward(self, image=None, text=None, **batch) -> dict[str, torch.Tensor]:
        features = self.model(image=image, text=text)
        return self.objective(**features, **batch) if batch else features


def steps_per_epoch(cfg: RunConfig) -> int:
    """Global steps in one epoch over the train split (the last partial global batch is dropped)."""
    counts = shards.read_manifest(cfg.data.path)["splits"][cfg.data.train_split]
    pairs = counts["captions"] if cfg.data.pairs_per_image == "all" else counts["images"] * cfg.data.pairs_per_image
    return pairs // (cfg.train.micro_batch_size * cfg.train.num_workers)


def deepspeed_config(cfg: RunConfig, total_steps: int) -> dict[str, Any]:
    """The DeepSpeed config of a run: ZeRO stage, precision, clipping, AdamW, warm-up + cosine LR.

    Gradient accumulation stays 1: a contrastive loss over accumulated micro-batches is not the
    loss over the larger batch (its negatives differ).
    """
    o = cfg.optim
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": cfg.train.zero_stage},
        "bf16": {"enabled": cfg.train.precision == "bf16"},
        "fp16": {"enabled": cfg.train.precision == "fp16"},
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW on CPU; DeepSpeed's fused Adam on GPU
            "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                       "torch_adam": not cfg.train.use_gpu},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": max(total_steps, 1), "warmup_num_steps": o.warmup_steps,
                       "warmup_type": "linear", "warmup_min_ratio": 0.0, "cos_min_ratio": o.min_lr_ratio},
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on gains, biases, embeddings of position/class and other 1-D params (as open_clip)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exclude = param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
        (no_decay if exclude else decay).append(param)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def say(message: str) -> None:
    """One line on the job's console (Ray Train V2's print patch would echo ``print`` twice)."""
    print(f"[pairsim] {message}", file=sys.__stdout__, flush=True)


def _mean_over_ranks(values: dict[str, torch.Tensor]) -> dict[str, float]:
    stacked = torch.stack([v.detach().float().reshape(()) for v in values.values()])
    if dist.is_initialized():
        dist.all_reduce(stacked)
        stacked /= dist.get_world_size()
    return dict(zip(values, stacked.tolist()))


def teacher_embeddings(batch: dict[str, torch.Tensor], live: dict[str, teachers.Teacher],
                       device) -> dict[str, torch.Tensor]:
    """``teacher_image`` / ``teacher_text`` of a batch: extracted ones as they come, live ones
    embedded here from the teacher inputs the pipeline prepared."""
    out = {}
    for modality in teachers.MODALITIES:
        key = f"teacher_{modality}"
        if key in batch:
            out[key] = batch[key].to(device)
        elif modality in live:
            inputs = {k.split(".", 1)[1]: v for k, v in batch.items() if k.startswith(key + ".")}
            out[key] = live[modality].embed(inputs, device)
    return out


def embed_split(engine, cfg: RunConfig, dtype: torch.dtype) -> evaluate.SplitEmbeddings:
    """The val split's image and caption embeddings (uni-modal ones too, when the model has
    heads for them), computed on every rank.

    Every rank runs the same forwards over the whole split, which keeps ZeRO-3's parameter
    gathering in step; rank 0 uses the result.
    """
    normalize = models.PixelNormalizer(cfg.model)
    engine.eval()
    with torch.no_grad():
        batches = [evaluate.embed_batch(engine, batch, normalize, engine.device, dtype)
                   for name in ("val_images", "val_texts")
                   for batch in ray.train.get_dataset_shard(name).iter_batches(
                       batch_size=cfg.eval.batch_size, batch_format="numpy")
                   if len(batch["image_id"])]  # a batch whose images were all unreadable is empty
    engine.train()
    return evaluate.SplitEmbeddings.from_batches(batches)


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


def restore(engine) -> tuple[int, int]:
    """(first epoch to run, global step) from Ray Train's latest checkpoint, or (0, 0)."""
    checkpoint = ray.train.get_checkpoint()
    if not checkpoint:
        return 0, 0
    with checkpoint.as_directory() as ckpt_dir:
        _, client_state = engine.load_checkpoint(ckpt_dir, tag=export.CHECKPOINT_TAG)
        dist.barrier()
    if engine.global_steps != client_state["global_step"]:
        raise RuntimeError(f"checkpoint is inconsistent: DeepSpeed step {engine.global_steps}, "
                           f"pairsim step {client_state['global_step']}")
    return client_state["epoch"] + 1, client_state["global_step"]


def validate(engine, cfg: RunConfig, dtype: torch.dtype, ledger, logger, step: int) -> dict[str, float]:
    """The val split's evaluation suite (:func:`pairsim.evaluate.evaluate_split`) and the
    skipped-image count, logged on rank 0 ({} on other ranks)."""
    embeddings = embed_split(engine, cfg, dtype)
    if logger is None:
        return {}
    report = evaluate.evaluate_split(embeddings, models.fusion_module(engine.module.model, cfg.model), cfg.eval.ks)
    metrics = {f"val/{k}": v for k, v in report.metrics.items()}
    if selection_metric(cfg) not in metrics:
        raise ValueError(f"eval.select_metric: the val split gives no {cfg.eval.select_metric!r} "
                         f"(it gives {', '.join(report.metrics)})")
    skipped = ray.get(ledger.get.remote())
    metrics["data/skipped_images"] = len(skipped)
    if skipped:
        logger.log_dict(skipped, "data/skipped_images.json")
        say(f"skipped {len(skipped)} unreadable images so far, e.g. {next(iter(skipped.items()))}; "
            "all are listed in the run's data/skipped_images.json")
    logger.log_metrics(metrics, step)
    return metrics


CONSOLE_METRICS = ("val/i2t_R@1", "val/t2i_R@1", "val/rsum", "val/t2t_R@1", "val/i2i_R@1", "val/grid_text2fused_R@1")


def selection_metric(cfg: RunConfig) -> str:
    """The reported val metric that picks the best checkpoint."""
    return f"val/{cfg.eval.select_metric}"


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    import deepspeed  # imported in the worker only (ray #50406)

    cfg = RunConfig.model_validate(loop_config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(cfg.train.seed)

    module = TrainingModule(models.create_retrieval_model(cfg.model, fused=cfg.loss.structure == "gcl",
                                                          unimodal_heads=cfg.loss.cusa is not None),
                            build_objective(cfg.loss, rank, world))
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=parameter_groups(module, cfg.optim.weight_decay),
        config=loop_config["deepspeed_config"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.precision]
    live_teachers = teachers.build_teachers(cfg) if cfg.loss.cusa and not cfg.loss.cusa.teacher_features else {}
    start_epoch, step = restore(engine)
    if rank == 0 and step:
        say(f"resumed from checkpoint: epoch {start_epoch + 1}, step {step}")

    logger = tracking.RunLogger(loop_config["tracking_uri"], loop_config["run_id"]) if rank == 0 else None
    ledger = ray.get_actor(loop_config["ledger"])
    train_shard = ray.train.get_dataset_shard("train")
    per_epoch = loop_config["steps_per_epoch"]
    normalize = models.PixelNormalizer(cfg.model)

    for epoch in range(start_epoch, cfg.train.epochs):
        batches = train_shard.iter_torch_batches(
            batch_size=cfg.train.micro_batch_size, drop_last=True, prefetch_batches=cfg.data.prefetch_batches,
            local_shuffle_buffer_size=cfg.data.shuffle_buffer or None,
            local_shuffle_seed=data.local_shuffle_seed(cfg.data.seed, epoch, rank))
        timer = StepTimer(cfg.train.micro_batch_size * world)
        for epoch_step, batch in enumerate(data.equal_steps(batches), start=1):
            timer.batch_ready()
            try:
                out = engine(image=normalize(batch["pixels"].to(engine.device), dtype),
                             text=batch["tokens"].to(engine.device), group_ids=batch["group_ids"].to(engine.device),
                             **teacher_embeddings(batch, live_teachers, engine.device))
            except FloatingPointError as exc:
                raise FloatingPointError(f"epoch {epoch + 1} step {step + 1}: {exc}") from None
            loss = out["loss"]
            engine.backward(loss)
            engine.step()
            step += 1
            timer.step_done()
            if step % cfg.train.log_every_n_steps == 0:
                logged = _mean_over_ranks({k: v for k, v in out.items() if k != "loss"} | {"train/loss": loss})
                rate = timer.window_rate()
                if logger:
                    lr = engine.get_lr()[0]
                    logger.log_metrics(logged | {"train/lr": lr, "train/samples_per_s": rate,
                                                 "train/epoch": epoch + epoch_step / max(per_epoch, 1)}, step)
                    say(f"epoch {epoch + 1}/{cfg.train.epochs} step {step} "
                        f"loss {logged['train/loss']:.4f} lr {lr:.2e} {rate:.0f} samples/s")

        metrics = validate(engine, cfg, dtype, ledger, logger, step)
        if logger:
            logger.log_metrics(timer.metrics(), step)
            shown = dict.fromkeys([*CONSOLE_METRICS, selection_metric(cfg), "data/skipped_images"])
            say(f"epoch {epoch + 1} " + "  ".join(f"{k.removeprefix('val/')}={metrics[k]:.2f}"
                                                  for k in shown if k in metrics) + "  (every metric in MLflow)")
        with tempfile.TemporaryDirectory() as ckpt_dir:
            engine.save_checkpoint(ckpt_dir, tag=export.CHECKPOINT_TAG,
                                   client_state={"epoch": epoch, "global_step": step})
            if rank == 0:
                card = models.model_card(cfg.model, module.model, zero_stage=cfg.train.zero_stage, epoch=epoch + 1,
                                         step=step, val=metrics)
                (Path(ckpt_dir) / export.CARD_FILE).write_text(json.dumps(card, indent=2))
            dist.barrier()
            ray.train.report({"epoch": epoch + 1, "step": step, **metrics},
                             checkpoint=Checkpoint.from_directory(ckpt_dir))


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


def finish(cfg: RunConfig, result: ray.train.Result, run_id: str, tracking_uri: str) -> tuple[str, dict[str, float]]:
    """Export the best checkpoint (by ``eval.select_metric`` on val) into the MLflow run's
    ``model/`` and evaluate it once on the test split, when the data has one."""
    best = result.get_best_checkpoint(selection_metric(cfg), cfg.eval.select_mode)
    logger = tracking.RunLogger(tracking_uri, run_id)
    with best.as_directory() as checkpoint, tempfile.TemporaryDirectory() as tmp:
        card = export.checkpoint_card(checkpoint)
        written = export.export_checkpoint(checkpoint, Path(tmp) / "model.pt")
        for path in written:
            logger.log_artifact(path, export.MODEL_ARTIFACTS)
        logger.set_tags({"pairsim.best_epoch": str(card["epoch"]), "pairsim.best_checkpoint": best.path,
                         "pairsim.select_metric": cfg.eval.select_metric})
        say(f"best checkpoint: epoch {card['epoch']}, {selection_metric(cfg)} = "
            f"{card['val'][selection_metric(cfg)]:.2f} ({best.path}); exported to the run's {export.MODEL_ARTIFACTS}/")
        split = cfg.data.test_split
        if split is None or split not in shards.read_manifest(cfg.data.path)["splits"]:
            say(f"no test split {split!r} in {cfg.data.path}: test evaluation skipped")
            return best.path, {}
        model, _ = models.load_exported(written[0])
    embeddings = evaluate.embed_with_ray_data(model, cfg, split)
    report = evaluate.evaluate_split(embeddings, models.fusion_module(model, cfg.model), cfg.eval.ks)
    evaluate.log_report(logger, report, embeddings, functools.partial(shards.read_rows, cfg.data.path, split),
                        split, int(result.metrics["step"]), title=f"{split}, best epoch {card['epoch']}")
    return best.path, report.metrics


def check_ready(cfg: RunConfig) -> None:
    """Everything that can be checked before the cluster is touched."""
    models.check_model_config(cfg.model)
    try:
        for split in (cfg.data.train_split, cfg.data.val_split):
            shards.split_files(cfg.data.path, split)
    except FileNotFoundError as exc:
        raise ConfigError(f"data.path: {exc}") from None
    teachers.check_teachers(cfg)
    if cfg.data.max_cpus is not None and cfg.data.max_cpus < cfg.data.cpus_per_task:
        raise ConfigError(f"data.max_cpus: {cfg.data.max_cpus} is less than one task's data.cpus_per_task "
                          f"({cfg.data.cpus_per_task}): ingest could never run")
    if steps_per_epoch(cfg) < 1:
        raise ConfigError(
            f"train.micro_batch_size: {cfg.train.micro_batch_size} × {cfg.train.num_workers} workers is larger "
            f"than the {cfg.data.train_split} split of {cfg.data.path}")


IDLE_WORKERS_KEPT = 8  # beyond one per CPU: Ray counts Train's and Data's actors against the limit


def init_ray(cfg: RunConfig) -> None:
    """Join ``ray.address`` (or ``RAY_ADDRESS``, set inside a ``ray job submit`` job), else start
    a local instance sized workers × CPUs + ``ray.data_cpus``.

    Train workers' CPUs are taken out of Ray Data's budget; the extra ``data_cpus`` are what
    keeps ingest running beside them (logical CPUs: they may exceed the cores). The local
    instance keeps more idle worker processes than Ray's default (one per CPU, actors
    included): otherwise the decode workers, which import torch and open_clip (~6 s), are
    killed while the model is validated and every epoch starts cold (~9 s before its first
    batch; 1.7 s with them kept). ``cluster.yaml`` does the same with
    ``RAY_num_workers_soft_limit``."""
    if ray.is_initialized():
        return
    if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=cfg.ray.address)  # None: Ray reads RAY_ADDRESS
    else:
        cpus = math.ceil(cfg.train.num_workers * cfg.train.cpus_per_worker + cfg.ray.data_cpus)
        ray.init(num_cpus=cpus, _system_config={"num_workers_soft_limit": cpus + IDLE_WORKERS_KEPT})
    ray.data.DataContext.get_current().enable_progress_bars = False


def check_cpu_budget(cfg: RunConfig) -> None:
    """Refuse a run whose training workers would leave Ray Data no CPU for one task (it would
    wait forever for data), naming the knobs that fix it."""
    total = ray.cluster_resources().get("CPU", 0.0)
    train_cpus = cfg.train.num_workers * cfg.train.cpus_per_worker
    if total - train_cpus < cfg.data.cpus_per_task:
        raise ConfigError(
            f"train.num_workers × train.cpus_per_worker = {train_cpus:g} of the cluster's {total:g} CPUs leaves "
            f"{total - train_cpus:g} for Ray Data, less than one task's data.cpus_per_task ({cfg.data.cpus_per_task:g}); "
            "lower them, add CPU nodes, or give a local instance more with ray.data_cpus")


def fit(cfg: RunConfig) -> TrainResult:
    check_ready(cfg)
    run_name = cfg.ray.run_name or datetime.now().strftime("pairsim-%Y%m%d-%H%M%S")
    per_epoch = steps_per_epoch(cfg)
    ds_config = deepspeed_config(cfg, per_epoch * cfg.train.epochs)
    tracking_uri = tracking.resolve_tracking_uri(cfg.tracking.tracking_uri)
    init_ray(cfg)
    check_cpu_budget(cfg)
    data.start_ingest_workers(cfg, cfg.train.num_workers * cfg.train.cpus_per_worker)
    run_id = tracking.open_run(cfg, run_name, cfg.to_yaml(), ds_config)

    ledger_name = f"pairsim-skips-{run_name}"
    ledger = data.skip_ledger(ledger_name)
    datasets = {
        "train": data.train_dataset(cfg, ledger_name),
        "val_images": data.eval_images(cfg, cfg.data.val_split, ledger_name),
        "val_texts": data.eval_texts(cfg, cfg.data.val_split),
    }
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.model_dump(mode="json"), "deepspeed_config": ds_config,
                           "steps_per_epoch": per_epoch, "run_id": run_id, "tracking_uri": tracking_uri,
                           "ledger": ledger_name},
        scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                     resources_per_worker={"CPU": cfg.train.cpus_per_worker}),
        run_config=ray.train.RunConfig(
            name=run_name, storage_path=str(Path(cfg.ray.storage_path).resolve()),
            checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute=selection_metric(cfg),
                                               checkpoint_score_order=cfg.eval.select_mode),
            failure_config=FailureConfig(max_failures=cfg.ray.max_failures)),
        datasets=datasets,
        dataset_config=DataConfig(datasets_to_split=["train"],
                                  execution_options={"train": data.train_execution_options(cfg)}),
    )
    succeeded = False
    try:
        result = trainer.fit()
        best_path, test_metrics = finish(cfg, result, run_id, tracking_uri)
        succeeded = True
    finally:
        tracking.close_run(cfg.tracking.tracking_uri, run_id, succeeded)
        ray.kill(ledger)
    return TrainResult(run_name, run_id, tracking_uri, dict(result.metrics or {}),
                       result.checkpoint.path if result.checkpoint else None, best_path, test_metrics)
