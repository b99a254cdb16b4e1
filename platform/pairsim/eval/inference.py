"""Embedding a split: one batch through a model (:func:`embed_batch`, used by the training
workers' validation too), the Ray Data stage that embeds a dataset's batches
(:func:`embedded_by`), and batch inference over a whole split (:func:`embed_with_ray_data`)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import ray
import torch
from tqdm import tqdm

from pairsim.cluster import NodeRoles
from pairsim.config import ModelConfig, RunConfig
from pairsim.data import ingest, shards, skips
from pairsim.eval.suite import SplitEmbeddings
from pairsim.log import get_logger
from pairsim.models import clip
from pairsim.models.retrieval import RetrievalModel

log = get_logger("eval")
T = TypeVar("T")


class EmbedBatches:
    """A model embedding decoded images (``pixels``) or tokenized captions (``tokens``),
    returning the ids that go with them, every embedding the model gives and the batch's
    ``carry`` columns as they came: a Ray Data actor on GPU, one per worker process in CPU tasks
    (:func:`embed_in_task`)."""

    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, use_gpu: bool, carry: tuple[str, ...] = ()):
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.model = model.to(self.device).eval()
        self.normalize = clip.PixelNormalizer(model_cfg)
        self.carry = carry

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            return embed_batch(self.model, batch, self.normalize, self.device) | {k: batch[k] for k in self.carry}


_EMBEDDER_OF_THIS_PROCESS: dict[tuple[str, tuple[str, ...]], EmbedBatches] = {}


def embed_in_task(batch: dict[str, np.ndarray], model_ref: ray.ObjectRef, model_cfg: ModelConfig,
                  carry: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Ray Data task on CPU: ``batch`` through the model ``model_ref`` names, fetched once per
    worker process (the last model fetched is the one kept)."""
    key = (model_ref.hex(), carry)
    if key not in _EMBEDDER_OF_THIS_PROCESS:
        _EMBEDDER_OF_THIS_PROCESS.clear()
        _EMBEDDER_OF_THIS_PROCESS[key] = EmbedBatches(ray.get(model_ref), model_cfg, use_gpu=False, carry=carry)
    return _EMBEDDER_OF_THIS_PROCESS[key](batch)


def embedded_by(ds: ray.data.Dataset, model: torch.nn.Module | ray.ObjectRef, cfg: RunConfig, batch_size: int | None,
                carry: tuple[str, ...] = (), label_selector: dict[str, str] | None = None) -> ray.data.Dataset:
    """``ds``'s batches of decoded images or tokenized captions embedded by ``model``
    (:class:`EmbedBatches`). With ``train.use_gpu``, by ``eval.concurrency`` actors of one GPU
    each. On CPU, by the tasks that decode (Ray Data fuses the two stages: one task per shard,
    as many at once as the decoding takes, each process holding a copy of the model), on the
    worker processes Ray keeps for tasks: those have imported torch and open_clip for the run's
    decoding already, where an actor's new process would import them anew (~12 s of CPU each).
    Each process fetches the model once, by reference: on CPU ``model`` may be an ``ObjectRef``,
    one copy shared by several datasets. With a ``label_selector`` (the training nodes) the
    embedding tasks go there and the decoding stays where the dataset's options put it: Ray
    Data fuses stages only when their placement is the same."""
    placement = {"label_selector": label_selector} if label_selector else {}
    if cfg.train.use_gpu:
        return ds.map_batches(EmbedBatches, fn_constructor_args=(model, cfg.model, True, carry), batch_size=batch_size,
                              compute=ray.data.ActorPoolStrategy(size=cfg.eval.concurrency), num_gpus=1, **placement)
    model_ref = model if isinstance(model, ray.ObjectRef) else ray.put(model)
    return ds.map_batches(embed_in_task, fn_args=(model_ref, cfg.model, carry), batch_size=batch_size,
                          num_cpus=cfg.data.cpus_per_task, **placement)


def embed_batch(model, batch: dict[str, np.ndarray], normalize: clip.PixelNormalizer, device,
                dtype: torch.dtype = torch.float32, to_host: bool = True) -> dict[str, np.ndarray | torch.Tensor]:
    """One batch of ``ingest.eval_images`` (``pixels``) or ``ingest.eval_texts`` (``tokens``) through
    ``model`` (a RetrievalModel or the engine wrapping one): the ids that go with the rows and
    every embedding the model gives (float32 arrays; with ``to_host=False`` float32 tensors left
    on ``device``, no wait for the GPU), named as :class:`SplitEmbeddings` fields. Arrays Ray Data
    hands over read-only (views of Arrow buffers) are copied: torch warns on each otherwise."""
    def tensor(array: np.ndarray | torch.Tensor) -> torch.Tensor:
        if isinstance(array, torch.Tensor):  # kept on the device from an earlier epoch (worker.ValInputs)
            return array.to(device)
        return torch.from_numpy(np.require(array, requirements="W")).to(device, non_blocking=True)

    if "pixels" in batch:
        fields = {"image_ids": batch["image_id"], "labels": batch["label"]}
        out = model(image=normalize(tensor(batch["pixels"]), dtype))
    else:
        fields = {"text_image_ids": batch["image_id"], "caption_index": batch["caption_index"]}
        out = model(text=tensor(batch["tokens"]))
    return fields | {k: v.float().cpu().numpy() if to_host else v.float() for k, v in out.items()}


def embed_with_ray_data(model: RetrievalModel, cfg: RunConfig, split: str, progress: bool = True,
                        roles: NodeRoles | None = None, data: shards.RunData | None = None) -> SplitEmbeddings:
    """A split's embeddings by Ray Data batch inference: the shards decoded and tokenized by
    CPU tasks (on the data nodes of ``roles``), embedded as :func:`embedded_by` says (on the
    training nodes), collected on the driver (with a progress bar over the split's images and
    captions). The manifests are ``data``'s (a run's, read once by the driver), else read here.
    Without ``roles``, anywhere.

    The images and the captions are two Ray Data executions, run at once: on GPU each starts
    actors of its own, fresh processes that import open_clip before their first batch, so the
    second start overlaps the first rather than following it."""
    split_skips = skips.new_scope(f"eval-{split}")
    data = data or shards.RunData.read(cfg.data)
    counts = data.split(split)
    shared = model if cfg.train.use_gpu else ray.put(model)  # on CPU one copy, one fetch a process, for both

    def embedded(ds: ray.data.Dataset, bar: tqdm) -> list[dict[str, np.ndarray]]:
        ds = embedded_by(ds, shared, cfg, cfg.eval.batch_size, label_selector=roles and roles.train)
        ds.context.execution_options.label_selector = roles and roles.data
        batches = []
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            batches.append(batch)
            bar.update(len(batch["image_ids"] if "image_ids" in batch else batch["text_image_ids"]))
        return batches

    try:
        with tqdm(total=counts.images + counts.captions, desc=f"embedding {split}", unit="item",
                  disable=not progress) as bar:
            texts = in_daemon_thread(embedded, ingest.eval_texts(cfg, split, split_skips, data), bar)
            batches = embedded(ingest.eval_images(cfg, split, split_skips, data), bar) + texts.result()
        skipped = split_skips.recorded()
    finally:
        split_skips.drop()
    if skipped:
        log.warning("%s: skipped %d unreadable images, e.g. %s", split, len(skipped), next(iter(skipped.items())))
    return SplitEmbeddings.from_batches(batches)


def in_daemon_thread(fn: Callable[..., T], *args) -> concurrent.futures.Future[T]:
    """``fn(*args)`` in a daemon thread: one that a driver stopped by Ctrl-C does not wait for
    at exit (a ``ThreadPoolExecutor``'s threads are joined then)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001  (handed to whoever waits on the result)
            future.set_exception(error)

    threading.Thread(target=run, name=f"pairsim-{getattr(fn, '__name__', 'task')}", daemon=True).start()
    return future
