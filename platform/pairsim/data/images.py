"""pairsim's one decoder of encoded images that come from a user: a served request's row, a
search query, a shard's picture in a grid or contact sheet. Bytes are read bounded from a regular
file (:func:`read_image`), opened header first (a decompression bomb refused before it is
decoded: :func:`opened_image`), brought down as they are decoded when far larger than what they
are shown or embedded at (:func:`decode_image`), and converted to RGB as the shard builder
converts them (:func:`to_rgb`). Failures are :class:`~pairsim.errors.InputError`\ s naming the
row or file."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator

import numpy as np
from PIL import Image, ImageOps

from pairsim.errors import InputError, shown
from pairsim.storage import Location

MAX_IMAGE_BYTES = 32 * 2**20  # bytes of one image read from a path (a served request's row, a search's --image)
# How much larger than what it is resampled to next an image is kept when it is box-averaged
# first (PIL's ``reducing_gap``; at 3, its documentation says, indistinguishable from resampling
# the full image in most cases): a large image is decoded and brought down to this many times the
# model's input side, which the eval transform then resamples
REDUCING_GAP = 3
RESAMPLED_MODES = ("L", "LA", "RGB", "RGBA")  # resampled to what to_rgb makes of them after (alpha premultiplied)


def read_image(location: Location, row: str) -> bytes:
    """The encoded bytes of the image file at ``location``: a regular file of at most
    :data:`MAX_IMAGE_BYTES` (:meth:`~pairsim.storage.Location.read_bounded`: a named pipe or a
    device refused unread); :class:`InputError` naming ``row`` otherwise."""
    try:
        return location.read_bounded(MAX_IMAGE_BYTES, InputError, "too large for an image")
    except InputError as exc:
        raise InputError(f"{row}: image {exc}") from None


@contextlib.contextmanager
def opened_image(raw: bytes, row: str) -> Iterator[Image.Image]:
    """Encoded image bytes opened by PIL for the ``with`` block (its header read, nothing decoded;
    not closed after: its file is ``raw`` in memory, and the block may return the image).
    :class:`InputError` naming ``row`` for data PIL cannot open or, in the block, decode, and for
    images of more than PIL's ``Image.MAX_IMAGE_PIXELS`` pixels (decompression bombs), refused
    from their header."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below instead
            image = Image.open(io.BytesIO(raw))
        width, height = image.size
        if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
            raise InputError(f"{row}: a {width}×{height} image, more than the "
                             f"{Image.MAX_IMAGE_PIXELS:,} pixels allowed (PIL's MAX_IMAGE_PIXELS)")
        yield image
    except InputError:
        raise
    except Image.DecompressionBombError as exc:
        raise InputError(f"{row}: image too large ({exc})") from None
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError… for bad data
        raise InputError(f"{row}: not a decodable image ({type(exc).__name__}: {shown(exc)})") from None


def image_size(raw: bytes, row: str) -> tuple[int, int]:
    """(width, height) of encoded image bytes, read from their header alone (:func:`opened_image`)."""
    with opened_image(raw, row) as image:
        return image.size


def shrink(image: Image.Image, side: int) -> None:
    """Bring ``image`` down in place to a shorter side of ``side`` when its shorter side is at
    least twice that (PIL's ``thumbnail`` with :data:`REDUCING_GAP`: a JPEG not yet loaded is
    decoded at 1/2, 1/4 or 1/8 of its size by ``draft`` where that leaves :data:`REDUCING_GAP`
    times ``side``, then box-averaged and resampled bicubic, its geometry kept); else leave it."""
    width, height = image.size
    shorter = min(width, height)
    if shorter >= 2 * side:
        image.thumbnail((max(side, round(width * side / shorter)), max(side, round(height * side / shorter))),
                        Image.Resampling.BICUBIC, reducing_gap=REDUCING_GAP)


def decode_image(raw: bytes, row: str, side: int) -> Image.Image:
    """Encoded image bytes → an RGB PIL image (EXIF orientation applied, other modes converted
    as the shard builder converts them, :func:`pairsim.data.builder.to_rgb`), brought down to a
    shorter side of ``side`` as it is decoded when it is at least twice that (:func:`shrink`: a
    JPEG many times larger decoded at a fraction of its size; an image of a mode not in
    :data:`RESAMPLED_MODES` converted first), else as it is. :class:`InputError` naming ``row``
    as :func:`opened_image` raises it, for bombs before they are decoded."""
    with opened_image(raw, row) as image:
        if image.mode in RESAMPLED_MODES:
            shrink(image, side)
        image.load()  # decodes everything: truncation shows here
        ImageOps.exif_transpose(image, in_place=True)
        image = to_rgb(image)
        shrink(image, side)  # one of another mode, now converted
        return image


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode → 8-bit RGB: alpha composited on white, 16/32-bit and float scaled to 0–255,
    palette, grayscale and CMYK converted."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        values = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or values.max(initial=0) > 255 else 255.0
        image = Image.fromarray(np.clip(values * (255.0 / top), 0, 255).round().astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")
