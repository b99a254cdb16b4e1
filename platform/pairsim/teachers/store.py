"""Teacher features extracted ahead of training: :func:`extract` runs the teachers' prepare +
embed as Ray Data batch inference over the shards and writes, per shard, each image's
embedding and each caption's (keyed by image id and caption index); the train pipeline looks
them up beside the batch (:class:`TeacherStore`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pydantic import BaseModel, ConfigDict

from pairsim import outputs, untrusted
from pairsim.config import ConfigError, RunConfig
from pairsim.data import ingest, shards
from pairsim.log import get_logger
from pairsim.storage import Location
from pairsim.teachers.encoders import Teacher

log = get_logger("teachers")
STORE_MANIFEST = "teacher_manifest.json"
STARTED = ".pairsim-teacher-store"  # written before the first feature file: the directory is an extraction's
MAX_STORE_MANIFEST_BYTES = 64 << 20  # its skipped_images list one line an unreadable image


class StoreManifest(BaseModel):
    """``teacher_manifest.json``: what the features were extracted from, read back typed."""

    model_config = ConfigDict(extra="forbid", strict=True)
    data_path: str = ""
    data_content_hash: str
    splits: list[str]
    teachers: dict[str, dict[str, Any]]
    skipped_images: dict[str, str] = {}


class ExtractionStarted(BaseModel):
    """:data:`STARTED`, written before the first feature file: the directory is an extraction's."""

    model_config = ConfigDict(extra="forbid", strict=True)
    command: Literal["extract-teacher"] = "extract-teacher"


class StoreError(ConfigError):
    """``loss.cusa.teacher_features`` whose manifest is not what :func:`extract` writes."""


def claim_output(out: Path) -> Path:
    """``out`` as :func:`extract`'s output (returned): new, empty, or an extraction's
    (:class:`pairsim.outputs.OutputRefused` otherwise), created."""
    outputs.claim_directory(out, "--out", owned_by=[outputs.Marker(STORE_MANIFEST, StoreManifest, MAX_STORE_MANIFEST_BYTES),
                                                 outputs.Marker(STARTED, ExtractionStarted)])
    Path(out).mkdir(parents=True, exist_ok=True)
    return Path(out)


def _store_file(store: Path, shard_path: str) -> Path:
    shard = Path(shard_path)
    return Path(store) / shard.parent.name / shard.name


class TeacherStore:
    """Teacher embeddings extracted by :func:`extract`: per data shard ``<split>/<shard>``, rows
    of ``image_id``, ``image`` [d_img] and ``captions`` [n_captions, d_txt]."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def manifest(self) -> StoreManifest:
        path = self.root / STORE_MANIFEST
        if not path.is_file():
            raise ConfigError(f"loss.cusa.teacher_features: no {STORE_MANIFEST} in {self.root} "
                              "(make it with pipelines/extract_teacher.py)")
        return untrusted.read_model(path, StoreManifest, MAX_STORE_MANIFEST_BYTES, StoreError)

    def check(self, cfg: RunConfig, teachers: dict[str, Teacher]) -> None:
        """The features fit ``cfg``'s data and were made by ``teachers`` (the run's, by modality)."""
        manifest = self.manifest()
        data_hash = shards.read_manifest(cfg.data.path).content_hash
        if manifest.data_content_hash != data_hash:
            raise ConfigError(f"loss.cusa.teacher_features: {self.root} was extracted from other data than "
                              f"{cfg.data.path} (content hash {manifest.data_content_hash[:12]} vs {data_hash[:12]})")
        missing = [s for s in (cfg.data.train_split,) if s not in manifest.splits]
        if missing:
            raise ConfigError(f"loss.cusa.teacher_features: {self.root} has no features for split(s) {missing}")
        for m, teacher in teachers.items():
            if teacher.identity() != manifest.teachers.get(m):
                raise ConfigError(f"loss.cusa.{m}_teacher: {teacher.identity()} differs from the teacher the "
                                  f"features in {self.root} came from: {manifest.teachers.get(m)}")

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _load(path: Path) -> tuple[dict[str, int], np.ndarray, list[np.ndarray]]:
        table = pq.read_table(path)
        index = {image_id: i for i, image_id in enumerate(table.column("image_id").to_pylist())}
        image = np.stack(table.column("image").to_numpy(zero_copy_only=False)).astype(np.float32)
        captions = [np.stack(c).astype(np.float32) for c in table.column("captions").to_numpy(zero_copy_only=False)]
        return index, image, captions

    def lookup(self, shard_paths: Sequence[str], image_ids: Sequence[str],
               caption_index: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(image embeddings [B, d_img], caption embeddings [B, d_txt]) of rows from those shards."""
        images, texts = [], []
        for shard, image_id, k in zip(shard_paths, image_ids, caption_index):
            index, image, captions = self._load(_store_file(self.root, shard))
            if str(image_id) not in index:
                raise KeyError(f"teacher features {self.root}: no row for image {image_id!r} of {shard} "
                               "(extracted before this image was added? re-run pipelines/extract_teacher.py)")
            row = index[str(image_id)]
            images.append(image[row])
            texts.append(captions[row][int(k)])
        return np.stack(images), np.stack(texts)


class _EmbedShardRows:
    """Ray Data actor: decode, prepare and embed one batch of shard rows with both teachers."""

    def __init__(self, teachers: dict[str, Teacher]):
        self.teachers = teachers

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """Embeddings of every row whose image decodes; the others come back empty, with ``error``."""
        images, errors = [], []
        for raw in batch["image"]:
            try:
                images.append(ingest.open_image(raw))
                errors.append("")
            except Exception as exc:  # PIL raises many types for corrupt/truncated data
                errors.append(f"{type(exc).__name__}: {exc}")
        good = [i for i, e in enumerate(errors) if not e]
        captions = [[str(c) for c in batch["captions"][i]] for i in good]
        flat = [c for caps in captions for c in caps]
        image_emb = self.teachers["image"].embed(self.teachers["image"].prepare(images)).numpy() if images else None
        text_emb = self.teachers["text"].embed(self.teachers["text"].prepare(flat)).numpy() if flat else None
        bounds = np.cumsum([0] + [len(c) for c in captions])
        image_col = [np.zeros(0, np.float32)] * len(errors)
        caption_col = [np.zeros((0, 0), np.float32)] * len(errors)
        for j, i in enumerate(good):
            image_col[i], caption_col[i] = image_emb[j], text_emb[bounds[j]:bounds[j + 1]]
        return {"path": batch["path"], "image_id": batch["image_id"], "error": np.asarray(errors),
                "image": image_col, "captions": caption_col}


def extract(cfg: RunConfig, teachers: dict[str, Teacher], out: Path, splits: Sequence[str], batch_size: int = 64,
            concurrency: int = 1, progress: bool = True) -> Path:
    """Embed every image and caption of ``splits`` with ``teachers``, the run's (Ray Data batch
    inference on ``concurrency`` actors) and write a :class:`TeacherStore` at ``out``
    (:func:`claim_output`'s)."""
    import ray
    from tqdm import tqdm

    cusa = cfg.loss.cusa
    if cusa is None or cusa.image_teacher is None or cusa.text_teacher is None:
        raise ConfigError("loss.cusa: extraction needs loss.cusa with an image_teacher and a text_teacher")
    out = claim_output(out)
    manifest = shards.read_manifest(cfg.data.path)
    (out / STARTED).write_text(ExtractionStarted().model_dump_json())
    skipped: dict[str, str] = {}
    for split in splits:
        rows = ingest.read_split(cfg, split, ["image", "image_id", "captions"], include_paths=True)
        embedded = rows.map_batches(_EmbedShardRows, fn_constructor_args=(teachers,), batch_size=batch_size,
                                    compute=ray.data.ActorPoolStrategy(size=concurrency), batch_format="numpy")
        by_shard: dict[str, list[dict[str, Any]]] = {}
        with tqdm(total=manifest.split(split).images, desc=f"teacher features {split}", unit="img",
                  disable=not progress) as bar:
            for batch in embedded.iter_batches(batch_size=batch_size, batch_format="numpy"):
                for path, image_id, error, image, caps in zip(batch["path"], batch["image_id"], batch["error"],
                                                              batch["image"], batch["captions"]):
                    if error:  # training skips these rows too: its decoder fails on the same bytes
                        skipped[str(image_id)] = str(error)
                        continue
                    by_shard.setdefault(path, []).append(
                        {"image_id": str(image_id), "image": np.asarray(image, np.float32).tolist(),
                         "captions": np.stack(list(caps)).astype(np.float32).tolist()})
                bar.update(len(batch["image_id"]))
        for path, shard_rows in by_shard.items():
            buffer = pa.BufferOutputStream()
            pq.write_table(pa.Table.from_pylist(shard_rows), buffer)
            Location.of(_store_file(out, path)).write_bytes(buffer.getvalue().to_pybytes())
    previous = TeacherStore(out).manifest().splits if (out / STORE_MANIFEST).is_file() else []
    Location.of(out / STORE_MANIFEST).write_text(json.dumps({
        "data_path": str(cfg.data.path), "data_content_hash": manifest.content_hash,
        "splits": sorted(set(previous) | set(splits)),
        "teachers": {m: t.identity() for m, t in teachers.items()},
        "skipped_images": skipped,
    }, indent=2, sort_keys=True) + "\n")
    if skipped:
        log.warning("skipped %d unreadable images, e.g. %s; all are listed under skipped_images in %s",
                    len(skipped), next(iter(skipped.items())), out / STORE_MANIFEST)
    return out
