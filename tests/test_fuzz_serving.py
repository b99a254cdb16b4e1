"""Property-based fuzzing of the served encoder (issue 78): hostile requests to the pyfunc model
(:class:`~pairsim.serving.pyfunc.EncoderModel`) in process, and hostile bodies to MLflow's scoring
server app (``mlflow.pyfunc.scoring_server.init`` of the saved model, driven in process over
ASGI) — wrong columns, both or neither in a row, huge strings, base64 of garbage and of bombs,
paths with ``..``, outside the root, to a FIFO, a device, a link out, URIs of every scheme, NUL
bytes, cells that are no strings, too many rows. The invariants, for every request:

- ``predict`` returns one float32 unit-norm embedding a row, or raises ``MlflowException`` with
  ``INVALID_PARAMETER_VALUE`` — no other exception, in bounded time (hypothesis's deadline);
- the app answers 200 or 4xx, never 5xx, and never MLflow's "unexpected error" (what it makes of
  any exception of the model's other than a refusal), in bounded time;
- nothing in the scratch directory (the allowed root, what lies outside it) changes.

The budget is :mod:`test_fuzz`'s (``EXAMPLES`` a property, the app's half)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
from pathlib import Path
from unittest import mock

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from mlflow.exceptions import MlflowException
from mlflow.pyfunc import scoring_server
from PIL import Image

from pairsim.config import ModelConfig
from pairsim.models import retrieval
from pairsim.data import images
from pairsim.serving import pyfunc
from pairsim.storage import SCHEMES
from test_fuzz import EXAMPLES, fuzz, json_trees, nasty_text
from test_serving import png_claiming

ROOT, SCRATCH = "@ROOT@", "@SCRATCH@"  # stand for the allowed root and the scratch directory in a generated value


def encoded(image: Image.Image, fmt: str) -> bytes:
    """``image`` encoded as ``fmt`` (PNG, JPEG, GIF, BMP)."""
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


PICTURES = [encoded(Image.new(mode, (33, 21), colour), fmt) for mode, colour, fmt in (
    ("RGB", (200, 30, 30), "PNG"), ("RGBA", (0, 90, 0, 10), "PNG"), ("P", 7, "GIF"), ("L", 99, "JPEG"),
    ("CMYK", (10, 20, 30, 40), "JPEG"), ("I;16", 40000, "PNG"), ("1", 1, "BMP"), ("LA", (5, 200), "PNG"))]
PICTURES.append(encoded(Image.new("RGB", (1200, 900), (20, 90, 160)), "JPEG"))  # brought down as it decodes
NOT_PICTURES = [PICTURES[0][:60], png_claiming(9000, 9000), png_claiming(30000, 30000), png_claiming(0, 0), b"",
                b"GIF89a"]
GOOD_PATHS = [f"{ROOT}/red.png", f"{ROOT}/sub/blue.png", f"{ROOT}/photo.jpg", f"file://{ROOT}/red.png",
              f"{ROOT}/sub/../red.png", f"{ROOT}/sub/./blue.png", f"{ROOT}//red.png"]
BAD_PATHS = [f"{ROOT}/{name}" for name in ("pipe", "dir", "out-link.png", "loop", "claims.png", "huge.bin",
                                           "missing.png", "../outside/secret.png", ".", "red.png\x00.txt")]
BAD_PATHS += [ROOT, f"{SCRATCH}/outside/secret.png", f"file://{SCRATCH}/outside/secret.png", "red.png", "./red.png",
              "/etc/passwd", "/etc/hostname", "/dev/zero", "/dev/urandom", "/proc/self/mem", "/proc/self/environ", "/",
              "..", "~/.ssh/id_rsa", "\\\\server\\share\\x.png", "C:\\x.png"]
URIS = [f"{scheme}://{rest}" for scheme in (*SCHEMES, "S3", "file", "http", "https", "ftp", "jar", "javascript")
        for rest in ("bucket/k.png", "other-bucket/../k", "", "bucket/k?endpoint_override=127.0.0.1:1")]
URIS += ["s3://user:secret@bucket/k", "hdfs://namenode:8020/x", "data:image/png;base64,AAAA", f"s3:/{ROOT}/red.png"]
as_base64 = (lambda raw: base64.b64encode(raw).decode())
good_images = st.one_of(st.sampled_from(PICTURES).map(as_base64), st.sampled_from(GOOD_PATHS))
image_values = st.one_of(good_images, good_images, st.sampled_from(NOT_PICTURES).map(as_base64),
                         st.binary(max_size=200).map(as_base64), st.sampled_from(BAD_PATHS + URIS), nasty_text,
                         st.sampled_from(["A" * 4 * 10**5, "x" * 10**5, "=" * 8, "abc", "AAAA" * 3 + "="]))
text_values = st.one_of(nasty_text, st.sampled_from(["a red square", "x " * 50_000, "\x00", "🟥" * 100]))
json_cells = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                       st.lists(st.integers(), max_size=3),
                       st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
any_cells = st.one_of(json_cells, st.floats(), st.binary(max_size=20), image_values)
COLUMN_SETS = [["image", "text"], ["text"], ["image"], ["caption"], ["text", "text"], ["image", "image", "text"],
               ["image", "extra"], [], [0, 1]]  # besides ["text", "image"], drawn as often as all of these
KINDS = ["both", "neither", "junk"]  # what a row holds, besides one caption or one image, drawn as often as each


def cell(column, kind: str, junk) -> st.SearchStrategy:
    """A row's cell in ``column``: its caption or image where the row's ``kind`` gives one,
    ``junk`` anywhere in a junk row, else none."""
    if kind == "junk":
        return junk
    if column == "text" and kind in ("text", "both"):
        return text_values
    if column == "image" and kind in ("image", "both"):
        return image_values
    return st.none()


@st.composite
def requests(draw, junk=any_cells) -> tuple[list, list[list]]:
    """(columns, rows) of a request: a few rows of one kind each, or one too many rows."""
    columns = draw(st.one_of(st.just(["text", "image"]), st.sampled_from(COLUMN_SETS)))
    if draw(st.sampled_from([False] * 19 + [True])):
        return columns, [["a"] * len(columns)] * (pyfunc.MAX_ROWS + 1)
    kinds = draw(st.lists(st.one_of(st.just("image"), st.just("text"), st.sampled_from(KINDS)), max_size=6))
    return columns, [[draw(cell(column, kind, junk)) for column in columns] for kind in kinds]


def rooted(value, scratch: Path):
    """A generated cell or body with the scratch directory's paths for :data:`ROOT` and
    :data:`SCRATCH` (bytes as Latin-1: every other byte kept)."""
    if isinstance(value, bytes):
        return rooted(value.decode("latin-1"), scratch).encode("latin-1")
    if not isinstance(value, str):
        return value
    return value.replace(ROOT, str(scratch / "allowed")).replace(SCRATCH, str(scratch))


def frame_of(columns: list, rows: list[list], scratch: Path) -> pd.DataFrame:
    """The request's table, cells kept as they are (None, not NaN)."""
    return pd.DataFrame([[rooted(v, scratch) for v in row] for row in rows], columns=columns, dtype=object)


# ---------------------------------------------------------------- the model, its scratch, its app

@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """The allowed root (``allowed``: pictures, a FIFO, a directory, a link out, a loop of links,
    a header that claims 81 M pixels, a sparse file over MAX_IMAGE_BYTES) and what lies outside it."""
    root = tmp_path_factory.mktemp("fuzz-serving")
    allowed = root / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "dir").mkdir()
    (root / "outside").mkdir()
    (root / "outside" / "secret.png").write_bytes(PICTURES[0])
    (allowed / "red.png").write_bytes(PICTURES[0])
    (allowed / "sub" / "blue.png").write_bytes(PICTURES[1])
    (allowed / "photo.jpg").write_bytes(PICTURES[-1])
    (allowed / "claims.png").write_bytes(png_claiming(9000, 9000))
    os.mkfifo(allowed / "pipe")
    (allowed / "out-link.png").symlink_to(root / "outside" / "secret.png")
    (allowed / "loop").symlink_to(allowed / "loop")
    with open(allowed / "huge.bin", "wb") as huge:
        huge.truncate(images.MAX_IMAGE_BYTES + 1)
    return root


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A randomly initialised pairsim-tiny export's folder."""
    torch.manual_seed(0)
    cfg = ModelConfig()
    model = retrieval.create_retrieval_model(cfg)
    weights = tmp_path_factory.mktemp("fuzz-export") / "model.pt"
    retrieval.write_exported(retrieval.model_card(cfg, model, 0, 1, 1, {}), model.state_dict(), weights)
    return weights.parent


@pytest.fixture(scope="module")
def model(export, scratch) -> pyfunc.EncoderModel:
    """The pyfunc model as MLflow loads it, reading images under ``scratch/allowed``."""
    served = pyfunc.EncoderModel()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(pyfunc.IMAGE_ROOTS_ENV, str(scratch / "allowed"))
        served.load_context(mlflow.pyfunc.PythonModelContext({pyfunc.EXPORT_ARTIFACT: str(export)}, None))
    return served


@pytest.fixture(scope="module")
def app(export, scratch, tmp_path_factory):
    """MLflow's scoring server app (what ``mlflow models serve`` runs) of the model saved from
    code as pairsim logs it, loaded with the same root; the serving flag it sets undone after."""
    saved = tmp_path_factory.mktemp("fuzz-saved") / "encoder"
    mlflow.pyfunc.save_model(saved, python_model=str(pyfunc.MODEL_CODE), signature=pyfunc.SIGNATURE,
                             input_example=pyfunc.input_example(), artifacts={pyfunc.EXPORT_ARTIFACT: str(export)},
                             pip_requirements=["pairsim"])
    with mock.patch.dict(os.environ, {pyfunc.IMAGE_ROOTS_ENV: str(scratch / "allowed")}):  # all restored after:
        yield scoring_server.init(mlflow.pyfunc.load_model(str(saved)))  # init sets MLflow's serving flag


def post(app, body: bytes, content_type: str) -> tuple[int, bytes]:
    """``POST /invocations`` to the ASGI ``app`` in process, the client connected until it is
    answered: the status and body."""
    sent, request = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if request:
            return request.pop()
        await asyncio.Event().wait()  # no more body, no disconnect

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/invocations", "raw_path": b"/invocations", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 5001)}
    asyncio.run(app(scope, receive, send))
    status = next(message["status"] for message in sent if message["type"] == "http.response.start")
    return status, b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")


def state(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root`` with its mode, size and modification time (links, FIFOs and
    sparse files not followed or read)."""
    return {str(path): ((info := path.lstat()).st_mode, info.st_size, info.st_mtime_ns)
            for path in sorted(root.rglob("*"))}


# ---------------------------------------------------------------- the properties

@fuzz
@given(request=requests())
@example(request=(["text", "text"], [["a", "b"]]))  # found by this test: an AttributeError (a column twice)
@example(request=(["image"], [[f"{ROOT}/pipe"]]))  # a FIFO under the root: refused unread
@example(request=(["image"], [[f"{ROOT}/loop"]]))  # a loop of links: a RuntimeError out of Path.resolve before
@example(request=(["image"], [["hdfs://namenode:8020/x"], ["s3://other-bucket/k"]]))  # no filesystem built
@example(request=(["image"], [[f"{ROOT}/photo.jpg"]] * 6))
def test_any_request_to_the_model_is_answered_row_for_row_or_refused_as_invalid(model, scratch, request):
    before = state(scratch)
    frame = frame_of(*request, scratch)
    try:
        answer = model.predict(None, frame)
    except MlflowException as exc:
        assert exc.error_code == "INVALID_PARAMETER_VALUE" and exc.get_http_status_code() == 400, exc.message
        event("refused")
    else:
        event("answered")
        assert list(answer.columns) == ["modality", "embedding"] and len(answer) == len(frame)
        for vector in answer["embedding"]:
            assert vector.dtype == np.float32 and vector.shape == (model.encoder.dim,)
            assert abs(float(np.linalg.norm(vector)) - 1) < 1e-4
    assert state(scratch) == before


FORMATS = ["dataframe_split", "dataframe_records", "inputs", "instances"]
CONTENT_TYPES = ["application/json"] * 6 + ["application/json; charset=utf-8", "text/csv",
                                            "application/json; charset=latin-1", "text/plain", "application/json; x=1"]


@st.composite
def bodies(draw) -> tuple[bytes, str]:
    """(body, content type) of an ``/invocations`` request: a table of :func:`requests` in one
    of MLflow's JSON formats, or any JSON, or any bytes."""
    kind = draw(st.sampled_from([*FORMATS * 3, "json", "bytes"]))
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    if kind == "bytes":
        return draw(st.binary(max_size=300)), content_type
    if kind == "json":
        return json.dumps(draw(json_trees)).encode(), content_type
    columns, rows = draw(requests(junk=json_cells))
    columns = [str(c) for c in columns]
    records = [dict(zip(columns, row)) for row in rows]
    payload = {"dataframe_split": {"columns": columns, "data": rows}, "dataframe_records": records,
               "inputs": {c: [row[i] for row in rows] for i, c in enumerate(columns)}, "instances": records}[kind]
    return json.dumps({kind: payload}).encode(), content_type


@settings(parent=fuzz, max_examples=max(EXAMPLES // 2, 10))
@given(request=bodies())
@example(request=(json.dumps({"dataframe_split": {"columns": ["image"], "data": [[f"{ROOT}/pipe"]]}}).encode(),
                  "application/json"))
@example(request=(json.dumps({"dataframe_split": {"columns": ["text", "text"], "data": [["a", "b"]]}}).encode(),
                  "application/json"))
def test_any_body_to_the_scoring_server_is_answered_200_or_4xx(app, scratch, request):
    before = state(scratch)
    body, content_type = request
    status, answer = post(app, rooted(body, scratch), content_type)
    assert status == 200 or 400 <= status < 500, (status, answer[-2000:])
    event(f"HTTP {status}")
    if status != 200 and answer.startswith(b"{"):
        assert b"Encountered an unexpected error" not in answer, answer[-3000:]
    assert state(scratch) == before
