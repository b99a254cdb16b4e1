"""``pairsim embed``: the embeddings directory format (round trip, tampered shards and other
models' manifests refused, one writer) and, end to end, the job against
``pairsim.eval.inference.embed_with_ray_data`` on the same export and split, with its resumption."""

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from pairsim import locks
from pairsim.config import ModelConfig, load_config
from pairsim.data import synth
from pairsim.models import retrieval
from pairsim.outputs import OutputRefused
from pairsim.serving import embeddings
from pairsim.serving.embeddings import EmbeddingsError, EmbeddingsManifest, Output


def manifest(**changes) -> EmbeddingsManifest:
    fields = dict(format_version=1, model_digest="a" * 64, model_source="model.pt", dim=4, data_path="/data",
                  split="val", split_content_hash="c" * 64, modalities=["image", "text"],
                  input_shards=["part-00000.parquet", "part-00001.parquet"])
    return EmbeddingsManifest(**fields | changes)


def rows(modality: str, vectors: np.ndarray, image_ids: list[str]) -> pa.Table:
    n = len(image_ids)
    text = modality == "text"
    return pa.table({"id": [f"{modality}/{i}" + ("/0" if text else "") for i in image_ids], "modality": [modality] * n,
                     "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()),
                                                                    vectors.shape[1]),
                     "image_id": image_ids, "caption_index": [0 if text else None] * n,
                     "caption": [f"caption of {i}" if text else None for i in image_ids],
                     "source": [None if text else f"{i}.png" for i in image_ids]},
                    schema=embeddings.row_schema(vectors.shape[1]))


@pytest.fixture
def written(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    """An embeddings directory of two input shards' images and captions, as the job writes it."""
    rng = np.random.default_rng(0)
    out = embeddings.claim_output(tmp_path / "emb")
    output = embeddings.open_output(out, manifest())
    vectors = {}
    for modality in ("image", "text"):
        for shard, ids in (("part-00000.parquet", ["a", "b"]), ("part-00001.parquet", ["c"])):
            v = embeddings.normalized(rng.normal(size=(len(ids), 4)).astype(np.float32))
            vectors.update({f"{modality}/{i}": x for i, x in zip(ids, v)})
            output.write_shard(modality, shard, rows(modality, v, ids))
    output.save(complete=True)
    return tmp_path / "emb", vectors


def test_embeddings_round_trip_by_modality(written):
    root, vectors = written
    found, table = embeddings.read_embeddings(root)
    assert found.complete and found.pending() == {"image": [], "text": []}
    assert table.num_rows == 6 and len(set(table.column("id").to_pylist())) == 6
    images_manifest, images = embeddings.read_embeddings(root, "image")
    assert images.column("modality").to_pylist() == ["image"] * 3
    got = embeddings.vectors(images)
    assert got.dtype == np.float32 and got.shape == (3, 4)
    expected = np.stack([vectors[f"image/{i}"] for i in images.column("image_id").to_pylist()])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(np.linalg.norm(embeddings.vectors(table), axis=1), 1.0, atol=1e-6)
    assert images.column("source").to_pylist() == ["a.png", "b.png", "c.png"]


def test_a_tampered_shard_and_an_unfinished_job_are_refused(written):
    root, _ = written
    shard = root / "text-part-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:-8] + b"\0" * 8)
    embeddings.read_embeddings(root, "image")  # the images' shards are intact
    with pytest.raises(EmbeddingsError, match="text-part-00001.parquet"):
        embeddings.read_embeddings(root)
    tree = json.loads((root / embeddings.MANIFEST).read_text())
    (root / embeddings.MANIFEST).write_text(json.dumps(tree | {"complete": False}))
    with pytest.raises(EmbeddingsError, match="has not finished"):
        embeddings.read_embeddings(root, "image")


def test_a_manifest_naming_a_path_outside_its_directory_is_refused(written):
    root, _ = written
    tree = json.loads((root / embeddings.MANIFEST).read_text())
    tree["shards"][0]["file"] = "../elsewhere.parquet"
    (root / embeddings.MANIFEST).write_text(json.dumps(tree))
    with pytest.raises(EmbeddingsError, match=r"shards\.0\.file"):
        embeddings.read_embeddings(root)


@pytest.mark.parametrize("field, value", [("model_digest", "b" * 64), ("split", "test"), ("data_path", "/other"),
                                          ("split_content_hash", "d" * 64)])
def test_an_output_of_another_model_or_data_is_refused(written, field, value):
    root, _ = written
    before = (root / embeddings.MANIFEST).read_bytes()
    with pytest.raises(EmbeddingsError, match=field):
        embeddings.open_output(embeddings.claim_output(root), manifest(**{field: value}))
    assert (root / embeddings.MANIFEST).read_bytes() == before


def test_the_same_model_and_data_continue_the_output_and_a_new_modality_joins_it(tmp_path):
    out = embeddings.claim_output(tmp_path / "emb")
    embeddings.open_output(out, manifest(modalities=["image"])).save(complete=True)
    joined = embeddings.open_output(out, manifest(modalities=["text"])).manifest
    assert joined.modalities == ["image", "text"] and not joined.complete
    assert joined.pending()["text"] == ["part-00000.parquet", "part-00001.parquet"]


def test_a_foreign_directory_and_a_second_writer_are_refused_before_any_work(tmp_path):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    cfg = load_config(overrides=[f"data.path={tmp_path / 'no-data'}"])
    with pytest.raises(OutputRefused, match="notes.txt"):
        embeddings.embed_split(None, cfg, "val", tmp_path / "foreign", "a" * 64, "model.pt")
    out = tmp_path / "busy"
    with locks.hold(out / embeddings.LOCK, "another embed"):
        with pytest.raises(locks.NameInUse, match="in use"):
            embeddings.embed_split(None, cfg, "val", out, "a" * 64, "model.pt")
    assert not (out / embeddings.MANIFEST).exists()


def run_embed(*argv: str) -> None:
    from pairsim.commands.embed import add_embed_parser

    parser = argparse.ArgumentParser()
    add_embed_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["embed", *argv])
    args.func(args)


@pytest.mark.slow
def test_embed_equals_the_evaluations_embeddings_and_resumes_only_what_is_missing(ray_instance, tmp_path):
    """A random export over a val split of 3 shards (tiny_dataset's val is one shard: nothing to
    resume partly), one image of them undecodable: every other image and every caption once,
    equal to embed_with_ray_data's (≤ 1e-5), the bad image listed; a second run writes nothing;
    a run after one shard's record is removed redoes only it."""
    import pyarrow.parquet as pq
    from conftest import remanifest

    from pairsim.eval.inference import embed_with_ray_data

    data = tmp_path / "data"
    synth.generate(data, num_train=0, num_val=40, num_test=0, rows_per_shard=16, progress=False)
    last = data / "val" / "part-00002.parquet"
    shard = pq.read_table(last).to_pylist()
    shard[3]["image"] = b"not an image"
    pq.write_table(pa.Table.from_pylist(shard, schema=pq.read_schema(last)), last)
    remanifest(data)
    torch.manual_seed(0)
    model_cfg = ModelConfig(crossmodal_heads=True)
    model = retrieval.create_retrieval_model(model_cfg)
    weights = tmp_path / "export" / "model.pt"
    retrieval.write_exported(retrieval.model_card(model_cfg, model, 0, 1, 1, {}), model.state_dict(), weights)
    out = tmp_path / "emb"
    argv = ("--model", str(weights), "--data", str(data), "--split", "val", "--out", str(out), "--batch-size", "8")
    run_embed(*argv)

    found, table = embeddings.read_embeddings(out)
    assert found.model_digest == retrieval.model_digest(weights) and found.input_shards == [
        "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    loaded, card = retrieval.load_exported(weights)
    reference = embed_with_ray_data(loaded, load_config(overrides=[f"data.path={data}", "eval.batch_size=8"])
                                    .model_copy(update={"model": card.model}), "val", progress=False)
    expected = {f"image/{i}": v for i, v in zip(reference.image_ids, reference.image.numpy())}
    expected |= {f"text/{i}/{k}": v for i, k, v in zip(reference.text_image_ids, reference.caption_index,
                                                       reference.text.numpy())}
    ids = table.column("id").to_pylist()
    assert found.skipped.keys() == {shard[3]["image_id"]} and f"image/{shard[3]['image_id']}" not in ids
    assert sorted(ids) == sorted(expected) and len(ids) == 39 + 40 * 5  # every good image and every caption, once
    np.testing.assert_allclose(embeddings.vectors(table), np.stack([expected[i] for i in ids]), atol=1e-5, rtol=0)
    texts = table.filter(pa.compute.equal(table.column("modality"), "text")).to_pylist()
    assert all(r["caption"] and r["source"] is None and r["id"] == f"text/{r['image_id']}/{r['caption_index']}"
               for r in texts)

    files = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    run_embed(*argv)  # all done: nothing written
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == files

    tree = json.loads((out / embeddings.MANIFEST).read_text())
    tree["shards"] = [s for s in tree["shards"] if s["file"] != "image-part-00001.parquet"]
    (out / embeddings.MANIFEST).write_text(json.dumps(tree | {"complete": False}))
    run_embed(*argv)
    rewritten = {p.name for p in out.iterdir() if p.stat().st_mtime_ns != files.get(p.name)}
    assert rewritten == {"image-part-00001.parquet", embeddings.MANIFEST}
    _, again = embeddings.read_embeddings(out)
    assert again.sort_by("id").equals(table.sort_by("id"))
