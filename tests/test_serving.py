"""The encoder of a trained export on raw inputs (``pairsim.serving.encoder``) and the pyfunc model
that serves its embeddings (``pairsim.serving.pyfunc``): image decoding, the embeddings against
open_clip's own preprocessing and model, and the pyfunc's answers and refusals in-process (a
random export); end to end, the Encoder against the evaluation's Ray Data embeddings and a real
``mlflow models serve`` of the registered model, both on the trained export."""

import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, ErrorCode
from PIL import Image

from pairsim.config import ModelConfig
from pairsim.errors import InputError
from pairsim.models import retrieval
from pairsim.serving import pyfunc
from pairsim.serving.encoder import Encoder, decode_image


def png(size=(40, 30), colour=(200, 30, 30), mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, colour).save(out, format="PNG")
    return out.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


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
        image = decode_image(png(mode=mode, colour=colour), "row 0")
        assert (image.mode, image.size) == ("RGB", (40, 30))
    assert decode_image(png(mode="RGBA", colour=(10, 20, 30, 0)), "row 0").getpixel((0, 0)) == (255, 255, 255)
    for raw in (b"", b"not an image", png()[:60]):  # empty, junk, truncated
        with pytest.raises(InputError, match="^row 7: "):
            decode_image(raw, "row 7")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40 * 30 - 1)
    with pytest.raises(InputError, match=r"^row 2: a 40×30 image, more than the 1,199 pixels"):
        decode_image(png(), "row 2")


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
                               encoder.embed_images([decode_image(red, "red"), decode_image(blue, "blue")]),
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
    images = {i: decode_image(raw, i) for i, raw in zip(table["image_id"], table["image"])}
    captions = dict(zip(table["image_id"], table["captions"]))
    np.testing.assert_allclose(encoder.embed_images([images[i] for i in reference.image_ids], batch_size=7),
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
    others on average; bad requests answered 400 with the problem, the server still up after."""
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
        data = [[c, None] for c in captions] + [[None, b64(raw)] for raw in images] + [[None, str(allowed / "first.png")]]
        status, answer = post(f"{base}/invocations", {"dataframe_split": {"columns": ["text", "image"], "data": data}})
        assert status == 200, answer
        rows = answer["predictions"]
        assert [r["modality"] for r in rows] == ["text"] * 8 + ["image"] * 9
        served = np.array([r["embedding"] for r in rows], dtype=np.float32)
        encoder = Encoder.load(trained_export)
        texts, pictures = encoder.embed_texts(captions), encoder.embed_images([decode_image(r, "val") for r in images])
        np.testing.assert_allclose(served, np.concatenate([texts, pictures, pictures[:1]]), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1, atol=1e-5)
        similarity = served[:8] @ served[8:16].T
        assert np.diag(similarity).mean() > similarity[~np.eye(8, dtype=bool)].mean()

        bad = {"no column": ({"columns": ["caption"], "data": [["a red circle"]]}, "'text' or 'image'"),
               "undecodable": ({"columns": ["image"], "data": [[b64(b"not an image at all")]]}, "not a decodable image"),
               "disallowed path": ({"columns": ["image"], "data": [["/etc/hostname"]]}, "nor a path under"),
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
