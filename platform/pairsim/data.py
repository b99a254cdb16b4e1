"""Ray Data ingest: Parquet shards → decode, augment, tokenize on CPU → training workers.

The driver builds lazy datasets (``train_dataset``, ``eval_images``, ``eval_texts``); Ray Train
streams them to the workers, where :func:`equal_steps` makes every rank run the same number
of steps whatever its shard holds (an uneven count would hang the collectives).

Images that cannot be decoded are skipped, not fatal: each is recorded with its reason in a
:class:`SkipLedger` actor that rank 0 reads for the ``data/skipped_images`` metric.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from PIL import Image

from pairsim import models, shards
from pairsim.config import RunConfig


@ray.remote(num_cpus=0)
class SkipLedger:
    """Images that could not be decoded, by image id, with the reason."""

    def __init__(self) -> None:
        self.skipped: dict[str, str] = {}

    def add(self, items: dict[str, str]) -> None:
        self.skipped.update(items)

    def get(self) -> dict[str, str]:
        return dict(self.skipped)


def skip_ledger(name: str):
    """Create (or get) the run's ledger; the driver owns it, Data tasks look it up by name."""
    return SkipLedger.options(name=name, get_if_exists=True).remote()


def open_image(raw: bytes) -> Image.Image:
    """Encoded bytes → RGB PIL image (raises on corrupt or truncated data)."""
    with Image.open(io.BytesIO(raw)) as image:
        return image.convert("RGB")


def group_ids(image_ids: Iterable[Any]) -> np.ndarray:
    """A stable int64 per image id (BLAKE2b), so pairs of one image are positives in every loss."""
    return np.array([int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8).digest(), "little", signed=True)
                     for i in image_ids], dtype=np.int64)


class DecodeImages:
    """Decode encoded images, dropping and recording (in the run's :class:`SkipLedger`) bad ones."""

    def __init__(self, ledger_name: str):
        self.ledger_name = ledger_name

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
            ray.get(ray.get_actor(self.ledger_name).add.remote(skipped))
        return images, np.asarray(keep, dtype=np.int64)


def _pixels(transform, images: list[Image.Image], input_size: tuple[int, int, int]) -> np.ndarray:
    if not images:
        return np.zeros((0, *input_size), np.float32)
    return np.stack([transform(image).numpy() for image in images])


class TrainPreprocess:
    """Training pairs: ``pairs_per_image`` captions drawn per image (distinct while there are
    enough), each with its own augmentation of the image, tokenized; ``group_ids`` from the
    image id. With CUSA, the teachers' inputs (live: ``teacher_image.*``, ``teacher_text.*``)
    or their extracted embeddings (``teacher_image``, ``teacher_text`` from a
    :class:`~pairsim.teachers.TeacherStore`) ride along.

    The generator is made per call: Ray ships a pickled copy of this object to every task, so a
    generator made once would replay the same draws in every batch and epoch.
    """

    def __init__(self, cfg: RunConfig, ledger_name: str, teachers: dict | None = None, store=None):
        self.decode = DecodeImages(ledger_name)
        self.transform = models.image_transforms(cfg.model, augment=cfg.data.augment)[0]
        self.input_size = models.preprocess_cfg(cfg.model).input_size
        self.arch, self.pairs = cfg.model.arch, cfg.data.pairs_per_image
        self.teachers, self.store = teachers or {}, store

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images, keep = self.decode(batch)
        rng = np.random.default_rng()
        picks = [rng.choice(len(caps), size=self.pairs, replace=len(caps) < self.pairs)
                 for caps in batch["captions"][keep]]
        image_of_pair = np.repeat(np.arange(len(keep)), self.pairs)
        caption_index = np.concatenate(picks).astype(np.int64) if picks else np.zeros(0, np.int64)
        captions = [str(batch["captions"][keep[i]][k]) for i, k in zip(image_of_pair, caption_index)]
        out = {"pixels": _pixels(self.transform, [images[i] for i in image_of_pair], self.input_size),
               "tokens": models.tokenizer(self.arch)(captions).numpy(),
               "group_ids": group_ids(batch["image_id"][keep])[image_of_pair],
               "caption_index": caption_index}
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
    def __init__(self, cfg: RunConfig, ledger_name: str):
        self.decode = DecodeImages(ledger_name)
        self.transform = models.image_transforms(cfg.model, augment=False)[1]
        self.input_size = models.preprocess_cfg(cfg.model).input_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images, keep = self.decode(batch)
        return {"image_id": batch["image_id"][keep], "pixels": _pixels(self.transform, images, self.input_size)}


class EvalTexts:
    """Every caption of every image as its own row, tokenized."""

    def __init__(self, arch: str):
        self.arch = arch

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = [str(i) for i, caps in zip(batch["image_id"], batch["captions"]) for _ in caps]
        texts = [str(c) for caps in batch["captions"] for c in caps]
        return {"image_id": np.asarray(ids), "tokens": models.tokenizer(self.arch)(texts).numpy()}


def _read(cfg: RunConfig, split: str, columns: list[str], shuffle_files: bool = False,
          include_paths: bool = False) -> ray.data.Dataset:
    files = shards.split_files(cfg.data.path, split)
    return ray.data.read_parquet(files, columns=columns, shuffle="files" if shuffle_files else None,
                                 include_paths=include_paths)


def train_dataset(cfg: RunConfig, ledger_name: str) -> ray.data.Dataset:
    """Training pairs (see :class:`TrainPreprocess`), teacher inputs or features included for CUSA."""
    from pairsim import teachers

    cusa = cfg.loss.cusa
    store = teachers.TeacherStore(cusa.teacher_features) if cusa and cusa.teacher_features else None
    live = teachers.build_teachers(cfg) if cusa and store is None else {}
    ds = _read(cfg, cfg.data.train_split, ["image", "image_id", "captions"], shuffle_files=True,
               include_paths=store is not None)
    return ds.map_batches(TrainPreprocess(cfg, ledger_name, live, store),
                          batch_size=cfg.train.micro_batch_size, batch_format="numpy")


def eval_images(cfg: RunConfig, split: str, ledger_name: str) -> ray.data.Dataset:
    ds = _read(cfg, split, ["image", "image_id"])
    return ds.map_batches(EvalImages(cfg, ledger_name), batch_size=cfg.eval.batch_size, batch_format="numpy")


def eval_texts(cfg: RunConfig, split: str) -> ray.data.Dataset:
    ds = _read(cfg, split, ["image_id", "captions"])
    return ds.map_batches(EvalTexts(cfg.model.arch), batch_size=cfg.eval.batch_size, batch_format="numpy")


def equal_steps(batches: Iterable[Any], device: torch.device | str = "cpu") -> Iterator[Any]:
    """Yield batches for as long as *every* rank still has one.

    One all-reduce(MIN) of a flag per step: when any rank's shard runs dry, all ranks stop
    together, so the collectives in the step never wait for a rank that has left the loop.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield from batches
        return
    iterator = iter(batches)
    while True:
        batch = next(iterator, None)
        flag = torch.tensor([batch is not None], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            return
        yield batch
