import io
import json

import pyarrow.parquet as pq
import pytest
from PIL import Image

from pairsim.data import shards, synth


def test_same_seed_gives_the_same_bytes(tmp_path):
    a = synth.generate(tmp_path / "a", num_train=60, num_val=10, num_test=10, rows_per_shard=25, progress=False)
    b = synth.generate(tmp_path / "b", num_train=60, num_val=10, num_test=10, rows_per_shard=25, progress=False)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.parquet"))
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.parquet"))
    assert files_a == files_b and len(files_a) == 5
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
    assert a["content_hash"] == b["content_hash"]
    c = synth.generate(tmp_path / "c", num_train=60, num_val=10, num_test=10, rows_per_shard=25, seed=1,
                       progress=False)
    assert c["content_hash"] != a["content_hash"]


def test_schema_and_counts_match_the_manifest(tmp_path):
    synth.generate(tmp_path, num_train=30, num_val=7, num_test=5, rows_per_shard=8, image_size=48, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["schema_version"] == shards.SCHEMA_VERSION
    assert {k: manifest["splits"]["train"][k] for k in ("images", "captions", "shards")} == \
        {"images": 30, "captions": 150, "shards": 4}
    assert all(c["content_hash"] == shards.split_content_hash(tmp_path, s) for s, c in manifest["splits"].items())
    assert manifest["content_hash"] == shards.content_hash(manifest["splits"])
    for split, counts in manifest["splits"].items():
        files = shards.split_files(tmp_path, split)
        assert len(files) == counts["shards"]
        table = pq.read_table(files)
        assert table.schema.equals(shards.SHARD_SCHEMA)
        assert table.num_rows == counts["images"]
        rows = table.to_pylist()
        assert sum(len(r["captions"]) for r in rows) == counts["captions"]
        assert len({r["image_id"] for r in rows}) == counts["images"]
        for row in rows:
            assert len(set(row["captions"])) == 5, row["captions"]
            assert 0 <= row["label"] < len(synth.LABELS)
            assert synth.LABELS[row["label"]] == row["label_name"]
            image = Image.open(io.BytesIO(row["image"]))
            assert image.size == (48, 48) and image.mode == "RGB"


def test_captions_name_the_first_objects_colour_and_relation_words():
    """Captions are about the scene: every caption names the label's colour (or a synonym)."""
    for index in range(40):
        record = synth.make_record(0, "train", index, 64)
        colour = record["label_name"].split()[0]
        words = synth.COLOURS[colour][1]
        for caption in record["captions"]:
            assert any(w in caption for w in words), (record["label_name"], caption)


def test_ensure_generates_once_and_then_keeps_what_is_there(tmp_path):
    out = synth.ensure(tmp_path / "shapes", num_train=8, num_val=4, num_test=0, progress=False)
    manifest = out / "manifest.json"
    first = manifest.stat().st_mtime_ns
    assert shards.read_manifest(out)["splits"]["train"]["images"] == 8
    synth.ensure(out, num_train=99, num_val=4, num_test=0, progress=False)  # other sizes: left alone
    assert manifest.stat().st_mtime_ns == first and shards.read_manifest(out)["splits"]["train"]["images"] == 8


def test_object_labels_name_every_object_and_nothing_else(tmp_path):
    plain = synth.generate(tmp_path / "plain", num_train=30, num_val=0, num_test=0, progress=False)
    labels = synth.generate(tmp_path / "labels", num_train=30, num_val=0, num_test=0, progress=False,
                            captions="object_labels")
    assert labels["generator"]["captions"] == "object_labels" and "captions" not in plain["generator"]
    scene_rows = shards.read_table(shards.split_shards(tmp_path / "plain", "train")).to_pylist()
    label_rows = shards.read_table(shards.split_shards(tmp_path / "labels", "train")).to_pylist()
    for scene, labelled in zip(scene_rows, label_rows):
        assert scene["image"] == labelled["image"] and scene["label"] == labelled["label"]  # the same scenes
        (text,) = labelled["captions"]
        pairs = text.split(", ")
        assert pairs == sorted(set(pairs)) and scene["label_name"] in pairs
        assert all(colour in synth.COLOURS and shape in synth.SHAPES for colour, shape in (p.split() for p in pairs))
    with pytest.raises(ValueError, match="captions must be one of"):
        synth.generate(tmp_path / "bad", num_train=1, num_val=0, num_test=0, progress=False, captions="poems")
