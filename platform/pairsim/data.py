"""Ray Data ingest: Parquet shards → decode, augment, tokenize on CPU → training workers.

The driver builds lazy datasets (``train_dataset``, ``eval_images``, ``eval_texts``); Ray Train
streams them to the workers, where :func:`equal_steps` makes every rank run the same number
of steps whatever its shard holds (an uneven count would hang the collectives).

Images that cannot be decoded are skipped, not fatal: each is recorded with its reason in a
:class:`SkipLedger` actor that rank 0 reads for the ``data/skipped_images`` metric.
"""

from __future__ import annotations

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


class DecodeImages:
    """Decode encoded images to the model's input tensor ([3, H, W] float32), dropping bad ones."""

    def __init__(self, transform, input_size: tuple[int, int, int], ledger_name: str):
        self.transform, self.input_size, self.ledger_name = transform, input_size, ledger_name

    def __call__(self, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(pixels of the good rows, indices of the good rows)."""
        pixels, keep, skipped = [], [], {}
        for i, (raw, image_id) in enumerate(zip(batch["image"], batch["image_id"])):
            try:
                with Image.open(io.BytesIO(raw)) as image:
                    pixels.append(self.transform(image.convert("RGB")).numpy())
                keep.append(i)
            except Exception as exc:  # PIL raises many types for corrupt/truncated data
                skipped[str(image_id)] = f"{type(exc).__name__}: {exc}"
        if skipped:
            ray.get(ray.get_actor(self.ledger_name).add.remote(skipped))
        if not pixels:
            return np.zeros((0, *self.input_size), np.float32), np.zeros(0, np.int64)
        return np.stack(pixels), np.asarray(keep, dtype=np.int64)


class TrainPreprocess:
    """One training pair per image: augmented pixels and one caption drawn at random, tokenized.

    The generator is made per call: Ray ships a pickled copy of this object to every task, so a
    generator made once would replay the same draws in every batch and epoch.
    """

    def __init__(self, decode: DecodeImages, arch: str):
        self.decode, self.arch = decode, arch

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels, keep = self.decode(batch)
        rng = np.random.default_rng()
        captions = [str(caps[rng.integers(len(caps))]) for caps in batch["captions"][keep]]
        return {"pixels": pixels, "tokens": models.tokenizer(self.arch)(captions).numpy()}


class EvalImages:
    def __init__(self, decode: DecodeImages):
        self.decode = decode

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels, keep = self.decode(batch)
        return {"image_id": batch["image_id"][keep], "pixels": pixels}


class EvalTexts:
    """Every caption of every image as its own row, tokenized."""

    def __init__(self, arch: str):
        self.arch = arch

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = [str(i) for i, caps in zip(batch["image_id"], batch["captions"]) for _ in caps]
        texts = [str(c) for caps in batch["captions"] for c in caps]
        return {"image_id": np.asarray(ids), "tokens": models.tokenizer(self.arch)(texts).numpy()}


def _read(cfg: RunConfig, split: str, columns: list[str], shuffle_files: bool = False) -> ray.data.Dataset:
    files = shards.split_files(cfg.data.path, split)
    return ray.data.read_parquet(files, columns=columns, shuffle="files" if shuffle_files else None)


def _decoder(cfg: RunConfig, train: bool, ledger_name: str) -> DecodeImages:
    train_tf, eval_tf = models.image_transforms(cfg.model, augment=cfg.data.augment)
    input_size = models.preprocess_cfg(cfg.model).input_size
    return DecodeImages(train_tf if train else eval_tf, input_size, ledger_name)


def train_dataset(cfg: RunConfig, ledger_name: str) -> ray.data.Dataset:
    ds = _read(cfg, cfg.data.train_split, ["image", "image_id", "captions"], shuffle_files=True)
    return ds.map_batches(TrainPreprocess(_decoder(cfg, True, ledger_name), cfg.model.arch),
                          batch_size=cfg.train.micro_batch_size, batch_format="numpy")


def eval_images(cfg: RunConfig, split: str, ledger_name: str) -> ray.data.Dataset:
    ds = _read(cfg, split, ["image", "image_id"])
    return ds.map_batches(EvalImages(_decoder(cfg, False, ledger_name)), batch_size=cfg.eval.batch_size,
                          batch_format="numpy")


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
