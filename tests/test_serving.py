"""The encoder of a trained export on raw inputs (``pairsim.serving.encoder``) and the pyfunc model
that serves its embeddings (``pairsim.serving.pyfunc``): image decoding, the embeddings against
open_clip's own preprocessing and model, and the pyfunc's answers and refusals in-process (a
random export), its memory and work bounded by a request's limits (issue 78), ``pairsim search``'s
image queries and grid pictures decoded the same bounded way; end to end, the Encoder against the
evaluation's Ray Data embeddings and a real ``mlflow models serve`` of the registered model, both
on the trained export."""

import base64
import io
import json
import os
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, ErrorCode
from PIL import Image

from pairsim.cli import main
from pairsim.commands.search import DatasetRows
from pairsim.config import ModelConfig
from pairsim.data import shards, synth
from pairsim.errors import InputError
from pairsim.models import retrieval
from pairsim.serving import index, pyfunc
from pairsim.data.images import MAX_IMAGE_BYTES, decode_image
from pairsim.serving.encoder import Encoder


def png(size=(40, 30), colour=(200, 30, 30), mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, colour).save(out, format="PNG")
    return out.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def photo(size: tuple[int, int], fmt: str) -> bytes:
    """An encoded picture of smooth colour fields (a photograph's frequencies, no pixel-sharp edges)."""
    rng = np.random.default_rng(0)
    fields = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(size, Image.Resampling.BICUBIC)
    out = io.BytesIO()
    fields.save(out, format=fmt, quality=95)
    return out.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A 1×1 PNG whose header says ``width`` × ``height``: the pixels it claims are not there to decode."""
    raw = bytearray(png(size=(1, 1)))
    raw[16:24] = struct.pack(">II", width, height)  # IHDR's width and height
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])))  # and its checksum
    return bytes(raw)


@pytest.fixture(scope="module")
def random_export(tmp_path_factory) -> Path:
    """A randomly initialised export with cross-modal heads (its outputs are the heads')."""
    torch.manual_seed(0)
    cfg = ModelConfig(crossmodal_heads=True)
    model = retrieval.create_retrieval_model(cfg)
    weights = tmp_path_factory.mktemp("random_export") / "model.pt"
    retrieval.write_exported(retrieval.model_card(cfg, model, 0, 1, 1, {}), model.state_dict(), weights)
    return weights


@pytest.fixture(scope="module")
def served(random_export, tmp_path_factory):
    """The pyfunc model loaded as MLflow loads it (its context's artifacts: the export's folder),
    reading images under one allowed root."""
    root = tmp_path_factory.mktemp("allowed")
    model = pyfunc.EncoderModel()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(pyfunc.IMAGE_ROOTS_ENV, str(root))
        model.load_context(mlflow.pyfunc.PythonModelContext({pyfunc.EXPORT_ARTIFACT: str(random_export.parent)}, None))
    return model, root


def test_decode_image_converts_to_rgb_and_refuses_undecodable_data_and_decompression_bombs(monkeypatch):
    for mode, colour in (("RGBA", (10, 20, 30, 0)), ("L", 77), ("P", 3)):
        image = decode_image(png(mode=mode, colour=colour), "row 0", 30)
        assert (image.mode, image.size) == ("RGB", (40, 30))
    assert decode_image(png(mode="RGBA", colour=(10, 20, 30, 0)), "row 0", 30).getpixel((0, 0)) == (255, 255, 255)
    for raw in (b"", b"not an image", png()[:60]):  # empty, junk, truncated
        with pytest.raises(InputError, match="^row 7: "):
            decode_image(raw, "row 7", 30)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40 * 30 - 1)
    with pytest.raises(InputError, match=r"^row 2: a 40×30 image, more than the 1,199 pixels"):
        decode_image(png(), "row 2", 30)


def test_encoder_equals_open_clips_own_preprocessing_and_model(random_export):
    """Independently: open_clip's eval preprocess (PIL → normalised float tensor in one) and
    tokenizer, the model's heads on the normalised tower outputs, then L2 normalisation; in
    batches of 1 and of 3."""
    import open_clip

    encoder = Encoder.load(random_export)
    card = encoder.card
    clip_model, _, preprocess = open_clip.create_model_and_transforms(card.model.arch, pretrained=str(random_export))
    heads = torch.load(random_export.with_suffix(".heads.pt"), weights_only=True)
    images = [Image.new("RGB", (50 + 9 * i, 41), (40 * i, 255 - 30 * i, 90)) for i in range(5)]
    texts = ["a red circle", "two blue squares on grey", "", "a green triangle", "x " * 200]

    def head(features: torch.Tensor, modality: str) -> torch.Tensor:
        x = torch.nn.functional.layer_norm(torch.nn.functional.normalize(features, dim=-1), (features.shape[1],),
                                           heads[f"cross_heads.{modality}.0.weight"], heads[f"cross_heads.{modality}.0.bias"])
        x = x @ heads[f"cross_heads.{modality}.1.weight"].T + heads[f"cross_heads.{modality}.1.bias"]
        return torch.nn.functional.normalize(x, dim=-1).numpy()

    with torch.no_grad():
        expected_images = head(clip_model.eval().encode_image(torch.stack([preprocess(i) for i in images])), "image")
        expected_texts = head(clip_model.encode_text(open_clip.get_tokenizer(card.model.arch)(texts)), "text")
    for batch_size in (1, 3):
        found = encoder.embed_images(images, batch_size=batch_size)
        assert found.dtype == np.float32 and found.shape == (5, encoder.dim)
        np.testing.assert_allclose(found, expected_images, atol=1e-5, rtol=0)
        np.testing.assert_allclose(encoder.embed_texts(texts, batch_size=batch_size), expected_texts, atol=1e-5, rtol=0)
    assert encoder.digest == retrieval.model_digest(random_export) and encoder.embed_texts([]).shape == (0, encoder.dim)


def test_pyfunc_answers_row_for_row_from_base64_paths_and_uris_under_its_roots(served):
    model, root = served
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "blue.png").write_bytes(png(colour=(0, 0, 220)))
    red, blue = png(), png(colour=(0, 0, 220))
    request = pd.DataFrame({"text": ["a red square", None, None, "a blue square"],
                            "image": [None, b64(red), (root / "sub" / "blue.png").as_uri(), None]})
    answer = model.predict(None, request)
    assert answer["modality"].tolist() == ["text", "image", "image", "text"]
    vectors = np.stack(answer["embedding"])
    encoder = model.encoder
    expected = np.concatenate([encoder.embed_texts(["a red square"]),
                               encoder.embed_images([Image.open(io.BytesIO(red)), Image.open(io.BytesIO(blue))]),
                               encoder.embed_texts(["a blue square"])])
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, expected, atol=1e-6, rtol=0)  # batched otherwise: rounding differs
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-6)
    path_answer = model.predict(None, pd.DataFrame({"image": [str(root / "sub" / "blue.png")]}))
    np.testing.assert_allclose(path_answer["embedding"][0], expected[2], atol=1e-6, rtol=0)
    assert model.predict(None, pd.DataFrame({"text": pd.Series([], dtype=object)})).shape == (0, 2)


def test_pyfunc_refuses_bad_requests_naming_the_row_or_limit(served, tmp_path):
    model, root = served
    outside = tmp_path / "outside.png"
    outside.write_bytes(png())
    (root / "link.png").unlink(missing_ok=True)
    (root / "link.png").symlink_to(outside)
    bad = {
        "no column": (pd.DataFrame({"caption": ["a red square"]}), "no 'text' or 'image' column"),
        "both": (pd.DataFrame({"text": ["a", "b"], "image": [None, b64(png())]}), "row 1: has both"),
        "neither": (pd.DataFrame({"text": ["a", None], "image": [None, None]}), "row 1: has neither"),
        "not a string": (pd.DataFrame({"text": [3]}), "row 0: text is not a string"),
        "undecodable": (pd.DataFrame({"image": [b64(b"hello, not an image")]}), "row 0: not a decodable image"),
        "bad base64": (pd.DataFrame({"image": ["abc"]}), "row 0: image 'abc' is not valid base64"),
        "outside the roots": (pd.DataFrame({"image": [str(outside)]}), "nor a path under"),
        "a link out of the roots": (pd.DataFrame({"image": [str(root / "link.png")]}), "nor a path under"),
        "dot-dot": (pd.DataFrame({"image": [f"{root}/../{outside.parent.name}/outside.png"]}), "nor a path under"),
        "missing file": (pd.DataFrame({"image": [str(root / "missing.png")]}), "row 0: image .* cannot be read"),
        "too many rows": (pd.DataFrame({"text": ["a"] * (pyfunc.MAX_ROWS + 1)}), f"{pyfunc.MAX_ROWS + 1:,} rows"),
    }
    for what, (request, message) in bad.items():
        with pytest.raises(MlflowException, match=message) as refused:
            model.predict(None, request)
        assert refused.value.error_code == ErrorCode.Name(INVALID_PARAMETER_VALUE), what
        assert refused.value.get_http_status_code() == 400, what


def test_pyfunc_refuses_a_request_over_its_byte_limit_and_paths_without_roots(served, monkeypatch):
    model, _ = served
    monkeypatch.setattr(pyfunc, "MAX_REQUEST_BYTES", 10)
    with pytest.raises(MlflowException, match="10 bytes .* row 2"):
        model.predict(None, pd.DataFrame({"text": ["abcd", "efgh", "ijkl"]}))
    with pytest.raises(InputError, match="is not set"):
        pyfunc.image_bytes("/etc/hostname", "row 0", [])


def test_decode_image_brings_a_large_image_down_as_it_decodes_and_leaves_a_smaller_one_as_it_is(random_export):
    """A picture at least twice the encoder's decode side is brought down to it (a JPEG through
    PIL's draft), and the eval transform's pixels of it are those of the full image within a
    level on average; one smaller is decoded whole, pixel for pixel."""
    encoder = Encoder.load(random_export)
    side = encoder.decode_side
    for fmt in ("PNG", "JPEG"):
        raw = photo((2400, 1800), fmt)
        full = Image.open(io.BytesIO(raw)).convert("RGB")
        brought_down = decode_image(raw, "row 0", side)
        assert min(brought_down.size) == side and brought_down.mode == "RGB", fmt
        difference = np.abs(encoder.pixels([brought_down]).astype(int) - encoder.pixels([full]).astype(int))
        assert difference.mean() < 1 and difference.max() <= 8, (fmt, difference.mean(), difference.max())
        assert (encoder.embed_images([brought_down]) @ encoder.embed_images([full]).T).item() > 0.999, fmt
        smaller = photo((2 * side - 1, 3 * side), fmt)
        assert np.array_equal(np.asarray(decode_image(smaller, "row 0", side)),
                              np.asarray(Image.open(io.BytesIO(smaller)).convert("RGB"))), fmt


PEAK_GROWTH = """
import json, resource, sys
import mlflow.pyfunc, pandas as pd
from pairsim.serving import pyfunc

model = pyfunc.EncoderModel()
model.load_context(mlflow.pyfunc.PythonModelContext({pyfunc.EXPORT_ARTIFACT: sys.argv[1]}, None))
model.predict(None, pd.DataFrame({"image": [sys.argv[3]]}))  # a small one first: transform built, tower run
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
answer = model.predict(None, pd.DataFrame({"image": [sys.argv[2]] * 8}))
growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(json.dumps({"rows": len(answer), "growth": growth}))
"""


@pytest.mark.timeout(300)
def test_a_request_naming_one_large_image_in_8_rows_holds_about_one_decoded_at_a_time(random_export, tmp_path):
    """Issue 78: 8 rows naming one PNG were all decoded at full size before any was embedded
    (1.3 → 3.8 GB for a 9000×9000 one). The peak memory (RSS, in a process of its own) a request
    of 8 rows naming a 4000×4000 PNG adds stays under 3 of its decoded images, not 8."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    Image.new("RGB", (4000, 4000), (200, 30, 30)).save(allowed / "large.png")
    (allowed / "small.png").write_bytes(png())
    decoded = 4000 * 4000 * 3
    out = subprocess.run([sys.executable, "-c", PEAK_GROWTH, str(random_export.parent), str(allowed / "large.png"),
                          str(allowed / "small.png")], capture_output=True, text=True, timeout=240,
                         env=os.environ | {pyfunc.IMAGE_ROOTS_ENV: str(allowed), pyfunc.DEVICE_ENV: "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.splitlines()[-1])
    assert measured["rows"] == 8 and measured["growth"] < 3 * decoded, measured


def test_pyfunc_refuses_a_request_over_its_pixel_budget_before_decoding_any_image(served):
    """Headers that claim 9000×9000 (81 M pixels, under PIL's bound for one image) in 14 rows sum
    past MAX_REQUEST_PIXELS at row 13: refused naming the limit and the row, before row 0 — whose
    pixels are not there — is decoded."""
    model, _ = served
    claimed = 9000 * 9000
    assert 13 * claimed <= pyfunc.MAX_REQUEST_PIXELS < 14 * claimed
    with pytest.raises(MlflowException, match=f"{pyfunc.MAX_REQUEST_PIXELS:,} pixels .*row 13") as refused:
        model.predict(None, pd.DataFrame({"image": [b64(png_claiming(9000, 9000))] * 14}))
    assert refused.value.get_http_status_code() == 400
    with pytest.raises(MlflowException, match="row 0: not a decodable image"):  # under it: decoded, and refused
        model.predict(None, pd.DataFrame({"image": [b64(png_claiming(9000, 9000))] * 13}))


def test_pyfunc_refuses_paths_beyond_the_bytes_a_request_may_hold(served, monkeypatch):
    """The files a request's rows name are held until its images are measured: at most
    MAX_REQUEST_IMAGE_BYTES of them (1,024 rows of 32 MiB files were 32 GiB)."""
    model, root = served
    (root / "held.png").write_bytes(png())
    monkeypatch.setattr(pyfunc, "MAX_REQUEST_IMAGE_BYTES", 2 * len(png()))
    with pytest.raises(MlflowException, match=f"{2 * len(png()):,} bytes of encoded images .*row 2") as refused:
        model.predict(None, pd.DataFrame({"image": [str(root / "held.png")] * 3}))
    assert refused.value.get_http_status_code() == 400


@pytest.mark.timeout(60)
def test_pyfunc_refuses_a_named_pipe_under_its_roots_at_once(served):
    """Issue 78: a row naming a FIFO under an allowed root blocked the request for ever (and the
    server then ignored SIGTERM); it is refused unread, HTTP 400."""
    model, root = served
    pipe = root / "pipe.png"
    os.mkfifo(pipe)
    start = time.monotonic()
    with pytest.raises(MlflowException, match="row 0: image .*named pipe") as refused:
        model.predict(None, pd.DataFrame({"image": [str(pipe)]}))
    assert refused.value.get_http_status_code() == 400 and time.monotonic() - start < 5


@pytest.mark.timeout(120)
def test_pyfunc_compares_uris_with_its_roots_as_text_before_any_filesystem_is_built(served, monkeypatch):
    """Issue 78: with local roots, an ``hdfs://`` row loaded a JVM and an ``s3://`` row looked its
    bucket up before the root check. Every filesystem a URI builds goes through
    ``pyarrow.fs.FileSystem.from_uri``, counted here: none is built, each row refused at once."""
    model, _ = served
    built, from_uri = [], pafs.FileSystem.from_uri

    class Counted(pafs.FileSystem):
        @staticmethod
        def from_uri(uri):
            built.append(uri)
            return from_uri(uri)

    monkeypatch.setattr(pafs, "FileSystem", Counted)
    for value in ("hdfs://x/y", "s3://other-bucket/k", "gs://bucket/k.png", "abfss://container/k.png"):
        start = time.monotonic()
        with pytest.raises(MlflowException, match="row 0: .* nor a path under the directories") as refused:
            model.predict(None, pd.DataFrame({"image": [value]}))
        assert refused.value.get_http_status_code() == 400 and time.monotonic() - start < 5, value
    assert built == []


@pytest.fixture
def search_index(random_export, tmp_path) -> Path:
    """A flat index of 4 vectors built with ``random_export``'s digest, its dataset gone."""
    vectors = np.eye(4, Encoder.load(random_export).dim, dtype=np.float32)
    rows = pa.table({"id": [f"image/{i}" for i in range(4)], "modality": ["image"] * 4,
                     "image_id": [str(i) for i in range(4)], "caption": pa.nulls(4, pa.string()),
                     "source": pa.nulls(4, pa.string())})
    index.build_index(vectors, rows, index.parse_spec({}), retrieval.model_digest(random_export), str(random_export),
                      str(tmp_path / "gone")).save(tmp_path / "idx")
    return tmp_path / "idx"


@pytest.mark.timeout(120)
def test_search_reads_image_queries_bounded_refusing_a_named_pipe_and_a_huge_file_unread(
        search_index, random_export, tmp_path, capsys):
    """Issue 78: ``pairsim search --image`` read the whole file (a FIFO hung it, 10 GB were read);
    now as the server reads: a regular file of at most MAX_IMAGE_BYTES, decoded brought down."""
    os.mkfifo(tmp_path / "pipe.png")
    with open(tmp_path / "huge.png", "wb") as huge:
        huge.truncate(MAX_IMAGE_BYTES + 1)  # sparse: nothing to read unless it is read
    (tmp_path / "photo.jpg").write_bytes(photo((2400, 1800), "JPEG"))
    search = ["--debug", "search", "--index", str(search_index), "--model", str(random_export), "-k", "2"]
    for name, problem in (("pipe.png", "named pipe"), ("huge.png", f"larger than {MAX_IMAGE_BYTES:,} bytes")):
        start = time.monotonic()
        with pytest.raises(InputError, match=f"^--image: image {tmp_path / name}: .*{problem}"):
            main([*search, "--image", str(tmp_path / name)])
        assert time.monotonic() - start < 30, name
    capsys.readouterr()
    assert main([*search, "--image", str(tmp_path / "photo.jpg")]) == 0
    assert "top 2 of 4" in capsys.readouterr().out


def test_grid_pictures_are_decoded_brought_down_to_a_tile(tmp_path):
    """The pictures of ``search --grid`` were decoded at full size: now each is brought down to
    about the grid's tile (240 pixels) as it is decoded, and only those asked for."""
    synth.generate(tmp_path / "data", num_train=0, num_val=3, num_test=0, image_size=1024, progress=False)
    image_ids = [row["image_id"] for row in shards.sample_rows(tmp_path / "data", "val", 3)]
    pictures = DatasetRows(str(tmp_path / "data"), "val").images(image_ids[:2])
    assert list(pictures) == image_ids[:2]
    assert all(p.size == (DatasetRows.PICTURE_SIDE, DatasetRows.PICTURE_SIDE) and p.mode == "RGB"
               for p in pictures.values())


def val_pairs(dataset: Path, n: int) -> tuple[list[bytes], list[str]]:
    """The first ``n`` val images (encoded bytes) of a shard dataset and each one's first caption."""
    table = pq.read_table(sorted((dataset / "val").glob("*.parquet"))[0], columns=["image", "captions"]).slice(0, n)
    return table.column("image").to_pylist(), [c[0] for c in table.column("captions").to_pylist()]


@pytest.mark.slow
def test_encoder_equals_the_evaluations_ray_data_embeddings(trained_export, tiny_dataset):
    from pairsim.config import load_config
    from pairsim.eval.inference import embed_with_ray_data

    encoder = Encoder.load(trained_export)
    cfg = load_config(overrides=[f"data.path={tiny_dataset}", "eval.batch_size=16"]).model_copy(
        update={"model": encoder.card.model})
    reference = embed_with_ray_data(encoder.model, cfg, "val", progress=False)
    table = pq.read_table(tiny_dataset / "val", columns=["image", "image_id", "captions"]).to_pydict()
    images = dict(zip(table["image_id"], table["image"]))
    captions = dict(zip(table["image_id"], table["captions"]))
    np.testing.assert_allclose(encoder.embed_encoded([(i, images[i]) for i in reference.image_ids], batch_size=7),
                               reference.image.numpy(), atol=1e-5, rtol=0)
    texts = [captions[i][k] for i, k in zip(reference.text_image_ids, reference.caption_index)]
    np.testing.assert_allclose(encoder.embed_texts(texts, batch_size=7), reference.text.numpy(), atol=1e-5, rtol=0)
    assert len(reference.image_ids) == 48 and len(texts) > 48


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.slow
def test_registered_encoder_serves_embeddings_equal_to_the_encoders_over_http(trained_export, tiny_dataset, tmp_path):
    """``mlflow models serve`` of the registered pyfunc in a fresh sqlite store: val captions and
    base64 images answered as the Encoder embeds them, a caption nearer its own image than the
    others on average; bad requests answered 400 with the problem (a FIFO under the root at
    once), the server still up after, and gone within a minute of SIGTERM."""
    from conftest import unused_port

    from pairsim import tracking
    from pairsim.tracking.models import log_encoder_model

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.create_run(uri, "pairsim", "serve-test", {})
    info = log_encoder_model(trained_export, run_id, uri, registered_model_name="encoder-test")
    assert info.registered_model_version == 1 and info.metadata["pairsim.model_digest"] == retrieval.model_digest(
        trained_export)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    port = unused_port()
    env = os.environ | {"MLFLOW_TRACKING_URI": uri, pyfunc.IMAGE_ROOTS_ENV: str(allowed), pyfunc.DEVICE_ENV: "cpu"}
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/encoder-test/1",
                               "--env-manager", "local", "-p", str(port), "-h", "127.0.0.1"],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"{base}/ping", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(1)

        images, captions = val_pairs(tiny_dataset, 8)
        (allowed / "first.png").write_bytes(images[0])
        os.mkfifo(allowed / "pipe.png")
        data = [[c, None] for c in captions] + [[None, b64(raw)] for raw in images] + [[None, str(allowed / "first.png")]]
        status, answer = post(f"{base}/invocations", {"dataframe_split": {"columns": ["text", "image"], "data": data}})
        assert status == 200, answer
        rows = answer["predictions"]
        assert [r["modality"] for r in rows] == ["text"] * 8 + ["image"] * 9
        served = np.array([r["embedding"] for r in rows], dtype=np.float32)
        encoder = Encoder.load(trained_export)
        texts = encoder.embed_texts(captions)
        pictures = encoder.embed_images([Image.open(io.BytesIO(raw)) for raw in images])
        np.testing.assert_allclose(served, np.concatenate([texts, pictures, pictures[:1]]), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1, atol=1e-5)
        similarity = served[:8] @ served[8:16].T
        assert np.diag(similarity).mean() > similarity[~np.eye(8, dtype=bool)].mean()

        bad = {"no column": ({"columns": ["caption"], "data": [["a red circle"]]}, "'text' or 'image'"),
               "undecodable": ({"columns": ["image"], "data": [[b64(b"not an image at all")]]}, "not a decodable image"),
               "disallowed path": ({"columns": ["image"], "data": [["/etc/hostname"]]}, "nor a path under"),
               "named pipe": ({"columns": ["image"], "data": [[str(allowed / "pipe.png")]]}, "named pipe"),
               "too many rows": ({"columns": ["text"], "data": [["a"]] * (pyfunc.MAX_ROWS + 1)}, "rows, more than")}
        for what, (split, problem) in bad.items():
            status, answer = post(f"{base}/invocations", {"dataframe_split": split})
            assert status == 400 and answer["error_code"] == "INVALID_PARAMETER_VALUE", (what, status, answer)
            assert problem in answer["message"], (what, answer["message"][-500:])
        assert urllib.request.urlopen(f"{base}/ping", timeout=5).status == 200
        status, _ = post(f"{base}/invocations", {"dataframe_records": [{"text": "a red circle"}]})
        assert status == 200
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
