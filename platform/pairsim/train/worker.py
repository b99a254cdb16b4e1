"""What a training worker is handed and reads, besides its loop (:mod:`pairsim.train.recipe`).

:class:`WorkerJob` is what the driver hands every worker (pickled), with the
:class:`StartupClock` the run's start-up is timed on; :func:`teacher_embeddings` completes a
train batch with its teachers' embeddings; :class:`ValInputs` is the val split's model inputs,
kept on the device between epochs when they fit, and :func:`embed_split` embeds them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.train
import torch

from pairsim.config import RunConfig
from pairsim.data.skips import Skips
from pairsim.eval import inference, suite
from pairsim.models import clip
from pairsim.teachers.encoders import MODALITIES, Teacher
from pairsim.train.checkpoints import Keeping


@dataclass(frozen=True)
class InProcess:
    """How a run trained in the calling process (Ray Train's local mode: a warm sweep trial)
    keeps and reports its checkpoints, which Ray Train then neither keeps nor hands to callbacks:
    each is kept in the run directory by ``keeping`` and passed with its epoch's report to
    ``report(metrics, checkpoint_uri)``."""

    report: Callable[[dict[str, Any], str], None]
    keeping: Keeping


@dataclass(frozen=True)
class WorkerJob:
    """What the driver hands every worker: the validated run config and what it derived."""

    cfg: RunConfig
    deepspeed_config: dict[str, Any]
    steps_per_epoch: int
    run_id: str
    tracking_uri: str
    skips: Skips  # where the run's data pipelines record what they could not read
    log_level: str
    startup: StartupClock  # started when the driver's fit began: perf/startup_s counts from it
    run_dir: str  # where the run's checkpoints are (a path or URI): resumes pick from them
    logged_params: dict[str, float]  # logged with each epoch's val metrics (a PBT trial's hyperparameters)
    reset_temperatures: bool  # every τ to its configured init once the checkpoint is loaded
    train_images: int  # in the train split (data.audit_epochs counts those trained)
    in_process: InProcess | None = None  # trained in the calling process (local mode)


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
