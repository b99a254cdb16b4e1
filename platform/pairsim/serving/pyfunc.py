"""The export as an ``mlflow.pyfunc`` model that serves embeddings (:class:`EncoderModel`): what
``mlflow models serve`` answers ``POST /invocations`` with.

A request is a DataFrame with a ``text`` column and/or an ``image`` column, each row holding
exactly one of them: a caption, or an image as base64 of its encoded bytes or as a path or URI
under one of the directories :data:`IMAGE_ROOTS_ENV` lists on the serving host (a value of
base64's alphabet only is read as base64 when it decodes: a file name's ``.`` is not in that
alphabet, and a ``file://`` URI never is; a value is compared with the roots as text before
anything is opened). The answer is a DataFrame with ``modality`` ("text" or "image") and
``embedding`` (float32, L2-normalised), row for row, computed by
:class:`~pairsim.serving.encoder.Encoder`, the images decoded and embedded a batch at a time. A
bad request — no such column, a row with both or neither, an image that is not one, a path
outside the roots, more than :data:`MAX_ROWS` rows, :data:`MAX_REQUEST_BYTES` bytes,
:data:`MAX_REQUEST_IMAGE_BYTES` bytes of encoded images or :data:`MAX_REQUEST_PIXELS` pixels —
raises ``MlflowException`` with ``INVALID_PARAMETER_VALUE``, which the scoring server answers
with HTTP 400 and the message.

MLflow loads the model from code (``pyfunc_model.py``, :data:`MODEL_CODE`): nothing is pickled;
the export's files are the model's artifacts (:data:`EXPORT_ARTIFACT`).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import re
from pathlib import Path, PurePosixPath

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types.schema import Array, ColSpec, Schema
from PIL import Image

from pairsim.errors import InputError, shown
from pairsim.data.images import image_size, read_image
from pairsim.serving.encoder import Encoder
from pairsim.storage import Location, absolute, is_uri

IMAGE_ROOTS_ENV = "PAIRSIM_SERVE_IMAGE_ROOTS"  # comma-separated directories or URIs images may be read from
DEVICE_ENV = "PAIRSIM_SERVE_DEVICE"  # where the model runs: default cuda when there is one, else cpu
MAX_ROWS = 1024  # rows of one request
MAX_REQUEST_BYTES = 64 * 2**20  # UTF-8 bytes of one request's texts and images together
MAX_REQUEST_IMAGE_BYTES = 64 * 2**20  # encoded bytes of a request's images held at once: base64's decoded, files' read
# Pixels of one request's images together, as their headers give them, checked before any is
# decoded: 1,024 one-megapixel images, about 10 s of decoding PNG on one core (one image's
# own bound is PIL's MAX_IMAGE_PIXELS)
MAX_REQUEST_PIXELS = 2**30
EXPORT_ARTIFACT = "export"  # the artifact holding the export's model.pt, model.heads.pt, model.json
MODEL_CODE = Path(__file__).with_name("pyfunc_model.py")
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")

SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "text", required=False), ColSpec("string", "image", required=False)]),
    outputs=Schema([ColSpec("string", "modality"), ColSpec(Array("float"), "embedding")]))


def input_example() -> pd.DataFrame:
    """A caption and a base64 PNG: one row of each kind."""
    png = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(png, format="PNG")
    return pd.DataFrame({"text": ["a red square", None], "image": [None, base64.b64encode(png.getvalue()).decode()]})


def image_roots(value: str | None) -> list[Location]:
    """The directories or URIs of :data:`IMAGE_ROOTS_ENV`'s ``value`` (comma-separated); local
    ones resolved, links included. :class:`InputError` naming a value that is neither."""
    roots = []
    for root in filter(None, (part.strip() for part in (value or "").split(","))):
        try:
            roots.append(Location.of(root))
        except (ValueError, OSError) as exc:
            raise InputError(f"{IMAGE_ROOTS_ENV}: {root!r}: {exc}") from None
    return roots


def scheme_and_path(value: str | Path) -> tuple[str, PurePosixPath]:
    """A location as text: its URI scheme, lower case ("" for a local path), and its path (a
    URI's bucket or host its first part)."""
    if is_uri(value):
        scheme, _, rest = value.partition("://")
        return scheme.lower(), PurePosixPath(rest)
    return "", PurePosixPath(value)


def location_under(value: str, roots: list[Location]) -> Location | None:
    """The path or URI ``value`` on the filesystem of the one of ``roots`` it lies under (the
    root itself or below it, no ``..``), else None: compared as text — scheme and path, a local
    path resolved, links included — so that no filesystem is built and no store reached for a
    value under none of them. ValueError or OSError for a value that is no path or URI pairsim
    opens (:func:`pairsim.storage.absolute`)."""
    scheme, path = scheme_and_path(absolute(value))
    if ".." in path.parts:
        return None
    for root in roots:
        root_scheme, root_path = scheme_and_path(root.uri)
        if scheme == root_scheme and path.is_relative_to(root_path):
            return root / str(path.relative_to(root_path))
    return None


def image_bytes(value: str, row: str, roots: list[Location]) -> bytes:
    """An ``image`` value's encoded bytes: decoded from base64, or else read
    (:func:`~pairsim.serving.encoder.read_image`) from a path or URI under one of ``roots``
    (:func:`location_under`); :class:`InputError` naming ``row`` otherwise."""
    problem = "not base64"
    if _BASE64.fullmatch(value):
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            problem = f"not valid base64 ({exc})"
    quoted = f"'{shown(value)}'"
    if not roots:
        raise InputError(f"{row}: image {quoted} is {problem}, and the server reads no image paths "
                         f"({IMAGE_ROOTS_ENV} is not set)")
    try:
        location = location_under(value, roots)
    except (ValueError, OSError, RuntimeError) as exc:  # RuntimeError: a loop of links, as Path.resolve says it
        raise InputError(f"{row}: image {quoted} is {problem}, nor a path ({shown(exc)})") from None
    if location is None:
        raise InputError(f"{row}: image {quoted} is {problem}, nor a path under the directories "
                         f"{IMAGE_ROOTS_ENV} allows ({', '.join(map(str, roots))})")
    return read_image(location, row)


def is_given(value: object) -> bool:
    """Whether a cell holds a value (not None, NaN or pandas' NA)."""
    return not (value is None or value is pd.NA or isinstance(value, float) and math.isnan(value))


def check_total(total: int, limit: int, what: str, row: int) -> None:
    """:class:`InputError` when a request's running ``total`` of ``what`` has passed ``limit`` at ``row``."""
    if total > limit:
        raise InputError(f"the request: more than the {limit:,} {what} allowed (reached at row {row})")


def request_rows(frame: pd.DataFrame) -> dict[str, dict[int, str]]:
    """The captions and image values of a request, each by its row: "text" and "image" to {row:
    value}; :class:`InputError` naming the first problem (see the module's docstring)."""
    if not isinstance(frame, pd.DataFrame):
        raise InputError(f"the request: a {type(frame).__name__}, not a table with a 'text' or 'image' column")
    if not {"text", "image"} & set(frame.columns):
        found = f" (its columns: {shown(', '.join(map(str, frame.columns)))})" if len(frame.columns) else ""
        raise InputError(f"the request has no 'text' or 'image' column{found}")
    if twice := sorted({"text", "image"} & set(frame.columns[frame.columns.duplicated()])):
        raise InputError(f"the request has the column {twice[0]!r} more than once")
    if len(frame) > MAX_ROWS:
        raise InputError(f"the request has {len(frame):,} rows, more than the {MAX_ROWS:,} allowed")
    cells = {name: frame[name].tolist() if name in frame.columns else [None] * len(frame) for name in ("text", "image")}
    rows: dict[str, dict[int, str]] = {"text": {}, "image": {}}
    size = 0
    for i, (text, image) in enumerate(zip(cells["text"], cells["image"])):
        given = [(name, value) for name, value in (("text", text), ("image", image)) if is_given(value)]
        if len(given) != 1:
            raise InputError(f"row {i}: has {'both text and image' if given else 'neither text nor image'}; "
                             "give exactly one")
        (name, value), = given
        if not isinstance(value, str):
            raise InputError(f"row {i}: {name} is not a string but a {type(value).__name__}")
        size += len(value.encode())
        check_total(size, MAX_REQUEST_BYTES, "bytes of text and images", i)
        rows[name][i] = value
    return rows


def request_images(values: dict[int, str], roots: list[Location]) -> dict[int, bytes]:
    """The encoded bytes of a request's images by row (:func:`image_bytes`), at most
    :data:`MAX_REQUEST_IMAGE_BYTES` together, whose pixels — read from each one's header, nothing
    decoded — are at most :data:`MAX_REQUEST_PIXELS` together; :class:`InputError` naming the
    first problem."""
    images, held, pixels = {}, 0, 0
    for i, value in values.items():
        raw = images[i] = image_bytes(value, f"row {i}", roots)
        held += len(raw)
        check_total(held, MAX_REQUEST_IMAGE_BYTES, "bytes of encoded images", i)
        width, height = image_size(raw, f"row {i}")
        pixels += width * height
        check_total(pixels, MAX_REQUEST_PIXELS, "pixels of images", i)
    return images


def embed_rows(encoder: Encoder, frame: pd.DataFrame, roots: list[Location]) -> pd.DataFrame:
    """The answer to a request (see the module's docstring). Every row is checked and every image
    read and measured before any is decoded or embedded (:class:`InputError` naming the first
    problem); then the images are decoded and embedded a batch at a time
    (:meth:`~pairsim.serving.encoder.Encoder.embed_encoded`), so that the memory a request takes
    is bounded by its limits, not by its rows: an image whose data ends early is refused when
    its batch decodes it."""
    rows = request_rows(frame)
    images = request_images(rows["image"], roots)
    embeddings = np.zeros((len(frame), encoder.dim), np.float32)
    embeddings[list(rows["text"])] = encoder.embed_texts(list(rows["text"].values()))
    embeddings[list(images)] = encoder.embed_encoded([(f"row {i}", raw) for i, raw in images.items()])
    return pd.DataFrame({"modality": ["image" if i in images else "text" for i in range(len(frame))],
                         "embedding": list(embeddings)})


class EncoderModel(mlflow.pyfunc.PythonModel):
    """The pyfunc model: the export of the :data:`EXPORT_ARTIFACT` artifact as an
    :class:`~pairsim.serving.encoder.Encoder` on :data:`DEVICE_ENV`'s device, answering
    requests with :func:`embed_rows`, images read only under :data:`IMAGE_ROOTS_ENV`'s roots."""

    def load_context(self, context) -> None:
        device = os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
        self.encoder = Encoder.load(Path(context.artifacts[EXPORT_ARTIFACT]) / "model.pt", device)
        self.roots = image_roots(os.environ.get(IMAGE_ROOTS_ENV))

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        try:
            return embed_rows(self.encoder, model_input, self.roots)
        except InputError as exc:
            raise MlflowException(str(exc), error_code=INVALID_PARAMETER_VALUE) from None
