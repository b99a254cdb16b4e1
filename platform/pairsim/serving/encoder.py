"""A trained export loaded for inference on raw inputs: captions and PIL images in, L2-normalised
float32 embeddings out (:class:`Encoder`), computed as pairsim's evaluation computes them — the
export's own eval transform (:class:`pairsim.data.ingest.Pixels`), tokenizer
(:func:`pairsim.data.ingest.tokenize`) and forward pass (:func:`pairsim.eval.inference.embed_batch`)
— and encoded images decoded by pairsim's one decoder (:func:`pairsim.data.images.decode_image`),
each brought down as it is decoded, so that no image is held at full size for long, nor many at
once (:meth:`Encoder.embed_encoded`)."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from pairsim.data import ingest
from pairsim.data.images import REDUCING_GAP, decode_image
from pairsim.errors import InputError
from pairsim.eval.inference import embed_batch
from pairsim.models import clip, retrieval
from pairsim.models.retrieval import RetrievalModel
from pairsim.models.saved import ModelCard
from pairsim.storage import Location

DEFAULT_BATCH_SIZE = 64
@dataclass
class Encoder:
    """An export (:func:`pairsim.models.retrieval.load_exported`) on ``device``: ``card`` its model
    card, ``digest`` its :func:`~pairsim.models.retrieval.model_digest`, ``dim`` the width of its
    embeddings; ``pixels`` and ``normalize`` its eval transform, in two halves as the evaluation
    applies it; ``decode_side`` the shorter side a large encoded image is brought down to as it is
    decoded (:data:`REDUCING_GAP` times the transform's input side)."""

    model: RetrievalModel
    card: ModelCard
    digest: str
    device: torch.device
    pixels: ingest.Pixels = field(init=False, repr=False)
    normalize: clip.PixelNormalizer = field(init=False, repr=False)
    decode_side: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.pixels = ingest.Pixels(self.card.model, for_eval=True)
        self.normalize = clip.PixelNormalizer(self.card.model)
        self.decode_side = REDUCING_GAP * max(clip.preprocess_cfg(self.card.model).input_size[1:])

    @classmethod
    def load(cls, weights: str | Path, device: str | torch.device = "cpu") -> Encoder:
        model, card = retrieval.load_exported(weights)
        return cls(model.to(device), card, retrieval.model_digest(weights), torch.device(device))

    @property
    def dim(self) -> int:
        return clip.embed_dim(self.card.model.arch)

    def embed_texts(self, texts: Sequence[str], batch_size: int = DEFAULT_BATCH_SIZE) -> np.ndarray:
        """float32 [len(texts), dim], L2-normalised: the captions by the export's tokenizer and text tower."""
        return self._embed(list(texts), batch_size, lambda chunk: {
            "tokens": ingest.tokenize(self.card.model.arch, chunk), "image_id": np.arange(len(chunk)),
            "caption_index": np.zeros(len(chunk), np.int64)}, "text")

    def embed_images(self, images: Sequence[Image.Image], batch_size: int = DEFAULT_BATCH_SIZE) -> np.ndarray:
        """float32 [len(images), dim], L2-normalised: RGB images by the export's eval transform and image tower."""
        return self._embed_pixels(list(images), batch_size, self.pixels)

    def embed_encoded(self, images: Sequence[tuple[str, bytes]], batch_size: int = DEFAULT_BATCH_SIZE) -> np.ndarray:
        """float32 [len(images), dim], L2-normalised: encoded images, each (its name for errors, its
        bytes), decoded a batch at a time, one by one, each brought down as it is decoded
        (:func:`decode_image` to :attr:`decode_side`) and put through the eval transform at once:
        at most one image is held larger than that side, and only while it is brought down."""
        return self._embed_pixels(list(images), batch_size, lambda chunk: np.concatenate(
            [self.pixels([decode_image(raw, name, self.decode_side)]) for name, raw in chunk]))

    def _embed_pixels(self, items: list, batch_size: int, pixels_of: Callable[[list], np.ndarray]) -> np.ndarray:
        """``items`` in ``batch_size`` slices, each slice's uint8 pixels (``pixels_of``) through the image tower."""
        return self._embed(items, batch_size, lambda chunk: {
            "pixels": pixels_of(chunk), "image_id": np.arange(len(chunk)),
            "label": np.full(len(chunk), -1, np.int64)}, "image")

    def _embed(self, items: list, batch_size: int, batch_of: Callable[[list], dict[str, Any]],
               modality: str) -> np.ndarray:
        """``items`` in ``batch_size`` slices through :func:`embed_batch` (``batch_of`` a slice: the
        evaluation's batch, its row ids placeholders), each ``modality`` output L2-normalised."""
        if batch_size < 1:
            raise InputError(f"batch_size: {batch_size}, must be at least 1")
        parts = [np.zeros((0, self.dim), np.float32)]
        with torch.no_grad():
            for start in range(0, len(items), batch_size):
                out = embed_batch(self.model, batch_of(items[start:start + batch_size]), self.normalize, self.device)
                parts.append(F.normalize(torch.from_numpy(out[modality]), dim=1).numpy())
        return np.concatenate(parts)
