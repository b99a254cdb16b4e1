"""A trained export loaded for inference on raw inputs: captions and PIL images in, L2-normalised
float32 embeddings out (:class:`Encoder`), computed as pairsim's evaluation computes them — the
export's own eval transform (:class:`pairsim.data.ingest.Pixels`), tokenizer
(:func:`pairsim.data.ingest.tokenize`) and forward pass (:func:`pairsim.eval.inference.embed_batch`)
— and encoded image bytes decoded with the checks a user's bytes need (:func:`decode_image`)."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from pairsim.data import ingest
from pairsim.data.builder import to_rgb
from pairsim.errors import InputError
from pairsim.eval.inference import embed_batch
from pairsim.models import clip, retrieval
from pairsim.models.retrieval import RetrievalModel
from pairsim.models.saved import ModelCard

DEFAULT_BATCH_SIZE = 64


def decode_image(raw: bytes, row: str) -> Image.Image:
    """Encoded image bytes → an RGB PIL image (EXIF orientation applied, other modes converted
    as the shard builder converts them, :func:`pairsim.data.builder.to_rgb`). :class:`InputError`
    naming ``row`` for data PIL cannot decode and for images of more than PIL's
    ``Image.MAX_IMAGE_PIXELS`` pixels (decompression bombs), refused before they are decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below instead
            opened = Image.open(io.BytesIO(raw))
        with opened:
            width, height = opened.size
            if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
                raise InputError(f"{row}: a {width}×{height} image, more than the "
                                 f"{Image.MAX_IMAGE_PIXELS:,} pixels allowed (PIL's MAX_IMAGE_PIXELS)")
            opened.load()  # decodes everything: truncation shows here
            return to_rgb(ImageOps.exif_transpose(opened))
    except InputError:
        raise
    except Image.DecompressionBombError as exc:
        raise InputError(f"{row}: image too large ({exc})") from None
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError… for bad data
        raise InputError(f"{row}: not a decodable image ({type(exc).__name__}: {str(exc)[:200]})") from None


@dataclass
class Encoder:
    """An export (:func:`pairsim.models.retrieval.load_exported`) on ``device``: ``card`` its model
    card, ``digest`` its :func:`~pairsim.models.retrieval.model_digest`, ``dim`` the width of its
    embeddings; ``pixels`` and ``normalize`` its eval transform, in two halves as the evaluation
    applies it."""

    model: RetrievalModel
    card: ModelCard
    digest: str
    device: torch.device
    pixels: ingest.Pixels = field(init=False, repr=False)
    normalize: clip.PixelNormalizer = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.pixels = ingest.Pixels(self.card.model, for_eval=True)
        self.normalize = clip.PixelNormalizer(self.card.model)

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
        return self._embed(list(images), batch_size, lambda chunk: {
            "pixels": self.pixels(chunk), "image_id": np.arange(len(chunk)),
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
