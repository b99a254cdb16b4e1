"""Ray Data ingest: Parquet shards → decode, augment, tokenize on CPU → training workers.

The driver builds lazy datasets (``train_dataset``, ``eval_images``, ``eval_texts``); Ray Train
streams them to the workers, where :func:`equal_steps` makes every rank run the same number
of steps whatever its shard holds (an uneven count would hang the collectives).

Images that cannot be decoded are skipped, not fatal: each is recorded with its reason in the
run's :class:`~pairsim.data.skips.Skips`, which rank 0 reads for the ``data/skipped_images`` metric.

Imports stay light (no torch, open_clip or torchvision at module level, and the map callables
hold configs, not built transforms): Ray Train's dataset manager and Ray Data's split
coordinator unpickle these callables without running them, and each is a process of its own
per run, where importing open_clip cost 5–10 s of CPU at every start-up. The decode tasks
import them when they first run a batch.
"""

from __future__ import annotations

import functools
import hashlib
import io
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import ray
from PIL import Image
from pairsim.config import ModelConfig, RunConfig
from pairsim.data import shards
from pairsim.data.shard_reader import VerifiedParquetDatasource
from pairsim.data.skips import Skips
from pairsim.storage import Location, filesystem_and_paths


def open_image(raw: bytes) -> Image.Image:
    """Encoded bytes → RGB PIL image (raises on corrupt or truncated data)."""
    with Image.open(io.BytesIO(raw)) as image:
        return image.convert("RGB")


def group_ids(image_ids: Iterable[Any]) -> np.ndarray:
    """A stable int64 per image id (BLAKE2b), so pairs of one image are positives in every loss."""
    return np.array([int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8).digest(), "little", signed=True)
                     for i in image_ids], dtype=np.int64)


class DecodeImages:
    """Decode encoded images, dropping and recording (in ``skips``) bad ones."""

    def __init__(self, skips: Skips):
        self.skips = skips

    def __call__(self, batch: dict[str, np.ndarray]) -> tuple[list[Image.Image], np.ndarray]:
        """(the good images, their row indices)."""
        images, keep, skipped = [], [], {}
        for i, (raw, image_id) in enumerate(zip(batch["image"], batch["image_id"])):
            try:
                images.append(open_image(raw))
                keep.append(i)
            except Exception as exc:  # PIL raises many types for corrupt/truncated data
                skipped[str(image_id)] = f"{type(exc).__name__}: {exc}"
        if skipped:
            self.skips.add(skipped)
        return images, np.asarray(keep, dtype=np.int64)


class Pixels:
    """Images → uint8 [N, 3, H, W] by the model's train transform (with ``augment``) or, with
    ``for_eval``, its eval transform (:func:`pairsim.models.clip.image_transforms`), built on
    first use. A ``seed`` fixes the random augmentation of one call."""

    def __init__(self, model: ModelConfig, augment: bool = False, for_eval: bool = False):
        self.model, self.augment, self.for_eval = model, augment, for_eval

    @functools.cached_property
    def _transform_and_size(self):
        from pairsim.models import clip

        train, val = clip.image_transforms(self.model, augment=self.augment)
        return (val if self.for_eval else train), clip.preprocess_cfg(self.model).input_size

    def __call__(self, images: list[Image.Image], seed: int | None = None) -> np.ndarray:
        import torch

        transform, input_size = self._transform_and_size
        if not images:
            return np.zeros((0, *input_size), np.uint8)
        with torch.random.fork_rng(devices=[], enabled=seed is not None):  # torchvision draws from torch's global generator
            if seed is not None:
                torch.manual_seed(seed)
            return np.stack([transform(image) for image in images])


def tokenize(arch: str, texts: list[str]) -> np.ndarray:
    """int64 [N, context length] tokens of ``texts`` by the architecture's tokenizer."""
    from pairsim.models import clip

    return clip.tokenizer(arch)(texts).numpy()


def caption_picks(draws: np.ndarray, counts: np.ndarray, pairs: int | str) -> list[np.ndarray]:
    """Caption indices per image: all of them (``pairs == "all"``), or ``pairs`` distinct ones
    (with repeats only when an image has fewer), drawn from a generator seeded by the image's
    uniform ``draw`` — so the picks depend on the seed and epoch, not on how rows were batched."""
    if pairs == "all":
        return [np.arange(n) for n in counts]
    return [np.random.default_rng(int(u * 2**53)).choice(n, size=pairs, replace=n < pairs)
            for u, n in zip(draws, counts)]


class TrainPreprocess:
    """Training pairs: ``data.pairs_per_image`` captions per image (see :func:`caption_picks`),
    each with its own augmentation of the image, tokenized; ``group_ids`` from the image id and
    ``pair_slot``, the pair's place among its image's (with the group id, a key of the pair
    that :class:`EpochAudit` counts).
    With CUSA, the teachers' inputs (live: ``teacher_image.*``, ``teacher_text.*``) or their
    extracted embeddings (``teacher_image``, ``teacher_text`` from a
    :class:`~pairsim.teachers.store.TeacherStore`) ride along.

    Randomness comes from the batch's ``draw`` column (Ray Data's seeded ``random()``, new each
    epoch): the caption picks per image, and the augmentation from a generator seeded by the
    batch's draws.
    """

    def __init__(self, cfg: RunConfig, skips: Skips, teachers: dict | None = None, store=None):
        self.decode = DecodeImages(skips)
        self.pixels = Pixels(cfg.model, augment=cfg.data.augment)
        self.arch, self.pairs = cfg.model.arch, cfg.data.pairs_per_image
        self.teachers, self.store = teachers or {}, store

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images, keep = self.decode(batch)
        picks = caption_picks(batch["draw"][keep], np.array([len(c) for c in batch["captions"][keep]]), self.pairs)
        image_of_pair = np.repeat(np.arange(len(keep)), [len(p) for p in picks]).astype(np.int64)
        caption_index = np.concatenate(picks).astype(np.int64) if picks else np.zeros(0, np.int64)
        captions = [str(batch["captions"][keep[i]][k]) for i, k in zip(image_of_pair, caption_index)]
        seed = int(batch["draw"][0] * 2**53) if len(batch["draw"]) else 0
        out = {"pixels": self.pixels([images[i] for i in image_of_pair], seed),
               "tokens": tokenize(self.arch, captions),
               "group_ids": group_ids(batch["image_id"][keep])[image_of_pair],
               "caption_index": caption_index,
               "pair_slot": np.concatenate([np.arange(len(p)) for p in picks]).astype(np.int64) if picks
               else np.zeros(0, np.int64)}
        if "image" in self.teachers and images:
            prepared = self.teachers["image"].prepare(images)
            out |= {f"teacher_image.{k}": v[image_of_pair] for k, v in prepared.items()}
        if "text" in self.teachers and captions:
            out |= {f"teacher_text.{k}": v for k, v in self.teachers["text"].prepare(captions).items()}
        if self.store is not None:
            rows = keep[image_of_pair]
            out["teacher_image"], out["teacher_text"] = self.store.lookup(
                batch["path"][rows], batch["image_id"][rows], caption_index)
        return out


class EvalImages:
    def __init__(self, cfg: RunConfig, skips: Skips):
        self.decode = DecodeImages(skips)
        self.pixels = Pixels(cfg.model, for_eval=True)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images, keep = self.decode(batch)
        return {"image_id": batch["image_id"][keep], "label": batch["label"][keep].astype(np.int64),
                "pixels": self.pixels(images)}


class EvalTexts:
    """Every caption of every image as its own row (with its index among the image's
    captions), tokenized."""

    def __init__(self, arch: str):
        self.arch = arch

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = [str(i) for i, caps in zip(batch["image_id"], batch["captions"]) for _ in caps]
        index = [k for caps in batch["captions"] for k in range(len(caps))]
        texts = [str(c) for caps in batch["captions"] for c in caps]
        return {"image_id": np.asarray(ids), "caption_index": np.asarray(index, dtype=np.int64),
                "tokens": tokenize(self.arch, texts)}


class InSlices:
    """Run ``fn`` on ``size``-row slices of a whole block, yielding each result.

    Mapped with ``batch_size=None`` (Ray Data will not fuse a read with a ``map_batches``
    that asks for a batch size), so the read and this map become one task per shard —
    both CPUs decode instead of one reading and one decoding. Ray Data's output buffer
    gathers the slices' results into blocks of up to ``target_max_block_size`` (128 MiB),
    so a shard's rows leave the task together when it is done: blocks of a micro-batch
    would let an epoch's first batch out sooner and slow the stream (``bench_ingest``).
    """

    def __init__(self, fn, size: int):
        self.fn, self.size = fn, size

    def __call__(self, block: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        rows = len(next(iter(block.values())))
        for start in range(0, rows, self.size):
            yield self.fn({k: v[start:start + self.size] for k, v in block.items()})


def map_shards(ds: ray.data.Dataset, fn, rows: int, cfg: RunConfig) -> ray.data.Dataset:
    """``fn`` over ``rows``-row slices of each shard (see :class:`InSlices`), fused with the
    read into one Ray Data operator, one task per shard on ``data.cpus_per_task`` CPUs.

    The per-operator resource reservation is turned off: with a single operator it only
    holds CPUs back (on 2 CPUs it ran one decode task at a time, 0.6× a DataLoader).
    """
    ds = ds.map_batches(InSlices(fn, rows), batch_size=None, batch_format="numpy", num_cpus=cfg.data.cpus_per_task)
    ds.context.op_resource_reservation_enabled = False
    return ds


def read_split(cfg: RunConfig, split: str, columns: list[str], shuffle_seed: int | None | bool = False,
               include_paths: bool = False, data: shards.RunData | None = None,
               skips: Skips | None = None, files: list[Location] | None = None) -> ray.data.Dataset:
    """A split's shards (or only ``files`` of them), only ``columns`` parsed; file order shuffled
    each epoch (seeded) unless ``shuffle_seed`` is False. The shards are checked against the
    manifest ``data`` holds (a run's, read once by the driver), else against the one read from the
    split's dataset directory: their
    number before the read, each one's SHA-256 as it is read (``data.shard_checks``, see
    :mod:`pairsim.data.shard_reader`; shards left out are recorded in ``skips``).

    One read task per shard (a small split is not packed into one block that one CPU decodes,
    as Ray 2.60's V2 Parquet datasource does, ray-project/ray#63817), so Ray Data fuses the read
    with the ``map_batches`` that follow into one task per shard, with no hop through the
    object store between them.
    """
    manifest = data.manifest(split) if data else shards.read_manifest(cfg.data.split_path(split))
    fs, files = filesystem_and_paths(files or shards.split_shards(cfg.data.split_path(split), split, manifest))
    source = VerifiedParquetDatasource(files, filesystem=fs, digests=manifest.split(split).shard_sha256,
                                       columns=columns, checks=cfg.data.shard_checks, skips=skips,
                                       include_paths=include_paths,
                                       shuffle=None if shuffle_seed is False else ray.data.FileShuffleConfig(seed=shuffle_seed))
    return ray.data.read_datasource(source, override_num_blocks=len(files))


def train_dataset(cfg: RunConfig, skips: Skips, teachers: dict | None = None,
                  store=None, data: shards.RunData | None = None) -> ray.data.Dataset:
    """Training pairs (see :class:`TrainPreprocess`), with CUSA's live ``teachers``' inputs or
    the extracted features of a ``store`` (:class:`~pairsim.teachers.store.TeacherStore`): file
    order shuffled and a uniform ``draw`` per image, both seeded by ``data.seed`` and new each
    epoch."""
    from ray.data.expressions import random

    ds = read_split(cfg, cfg.data.train_split, ["image", "image_id", "captions"], shuffle_seed=cfg.data.seed,
                    include_paths=store is not None, data=data, skips=skips)
    ds = ds.with_column("draw", random(seed=cfg.data.seed, reseed_after_execution=True))
    return map_shards(ds, TrainPreprocess(cfg, skips, teachers, store), cfg.train.micro_batch_size, cfg)


def execution_options(cfg: RunConfig, data_nodes: dict[str, str] | None = None,
                      ordered: bool = False) -> ray.data.ExecutionOptions:
    """Ray Data options of a run's streams: their tasks and actors on ``data_nodes`` (a label
    selector, :mod:`pairsim.cluster`; None: any node), the CPU cap (``data.max_cpus``) and,
    when ``ordered`` (the train stream) and seeded, rows in their deterministic order."""
    return ray.data.ExecutionOptions(
        preserve_order=ordered and cfg.data.seed is not None, label_selector=data_nodes,
        resource_limits=ray.data.ExecutionResources(cpu=cfg.data.max_cpus) if cfg.data.max_cpus else None)


def eval_images(cfg: RunConfig, split: str, skips: Skips, data: shards.RunData | None = None) -> ray.data.Dataset:
    return map_shards(read_split(cfg, split, ["image", "image_id", "label"], data=data, skips=skips),
                      EvalImages(cfg, skips), cfg.eval.batch_size, cfg)


def eval_texts(cfg: RunConfig, split: str, skips: Skips, data: shards.RunData | None = None) -> ray.data.Dataset:
    return map_shards(read_split(cfg, split, ["image_id", "captions"], data=data, skips=skips),
                      EvalTexts(cfg.model.arch), cfg.eval.batch_size, cfg)


def local_shuffle_seed(seed: int | None, epoch: int, rank: int) -> int | None:
    """The worker's local-shuffle seed: distinct per epoch and rank, None when unseeded."""
    return None if seed is None else int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


def equal_steps(batches: Iterable[Any]) -> Iterator[Any]:
    """Yield batches for as long as *every* rank still has one.

    One all-reduce(MIN) of a flag per step (:func:`pairsim.dist.all_true`, on the backend's
    device): when any rank's shard runs dry, all ranks stop together, so the collectives in
    the step never wait for a rank that has left the loop.
    """
    from pairsim import dist  # torch: run in the training workers only

    if not dist.is_distributed():
        yield from batches
        return
    iterator = iter(batches)
    while True:
        batch = next(iterator, None)
        if not dist.all_true(batch is not None):
            return
        yield batch


class EpochAudit:
    """Which pairs one epoch trained on, over all ranks (``data.audit_epochs``): a Ray Data task
    retried after a lost node must neither drop its rows nor deliver them twice.

    ``record`` each micro-batch's pair keys (group id, pair slot); ``metrics`` at the epoch's end
    (a collective: every rank calls it, and every rank trained the same number of rows, see
    :func:`equal_steps`) all-gathers them, 16 bytes a pair, and gives

    - ``data/epoch_pairs``: pairs trained, over the ranks;
    - ``data/epoch_pairs_repeated``: of them, trained more than once in the epoch (0 unless rows
      were delivered twice);
    - ``data/epoch_images_unseen``: train images none of whose pairs was trained: the rows
      ``drop_last`` leaves (under a micro-batch per rank), unreadable images, and rows lost.
    """

    def __init__(self, train_images: int):
        self.train_images = train_images
        self.keys: list = []

    def record(self, batch: dict) -> None:
        import torch

        self.keys.append(torch.stack([batch["group_ids"], batch["pair_slot"]], dim=1).cpu())

    def metrics(self) -> dict[str, float]:
        import torch

        from pairsim import dist

        keys = dist.all_gather(torch.cat(self.keys) if self.keys else torch.zeros((0, 2), dtype=torch.int64))
        self.keys = []
        pairs = torch.unique(keys, dim=0)
        return {"data/epoch_pairs": float(len(keys)), "data/epoch_pairs_repeated": float(len(keys) - len(pairs)),
                "data/epoch_images_unseen": float(self.train_images - len(torch.unique(pairs[:, 0])))}
