"""Datasets safe by construction: a manifest is read as untrusted input and cannot lead a reader
outside its dataset, a re-run builds over leftovers only what it can vouch for, a build's
output is claimed before any work, and bad input is an InputError (exit 2), not a traceback."""

import json
import os
from pathlib import Path

import pytest
from PIL import Image

from pairsim.data import builder, shards, sources, synth
from pairsim.data.build_config import BuildConfig
from pairsim.errors import InputError
from pairsim.outputs import OutputRefused


@pytest.fixture
def two_datasets(tmp_path) -> tuple[Path, Path]:
    """``data`` and, beside it, ``other``: shapes datasets of 8 / 4 images."""
    for name in ("data", "other"):
        synth.generate(tmp_path / name, num_train=8, num_val=4, num_test=0, progress=False)
    return tmp_path / "data", tmp_path / "other"


def _edit_manifest(root: Path, edit) -> None:
    manifest = json.loads((root / shards.MANIFEST).read_text())
    edit(manifest)
    (root / shards.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("where", ["split", "shard"])
def test_a_manifest_naming_a_path_outside_its_dataset_is_refused_by_every_reader(where, two_datasets):
    """A split ``../other/train`` (listing the other dataset's train split, hashes and all) would
    make a run, ``evaluate``, ``inspect`` and ``verify`` read the other dataset; a shard SHA-256
    keyed by a path would name a file outside. The manifest is refused as bad input, naming the key."""
    data, other = two_datasets
    if where == "split":
        train = json.loads((other / shards.MANIFEST).read_text())["splits"]["train"]
        _edit_manifest(data, lambda m: m["splits"].update({"../other/train": train}))
        bad = "../other/train"
    else:
        _edit_manifest(data, lambda m: m["splits"]["train"]["shard_sha256"].update({"../../x.parquet": "0" * 64}))
        bad = "../../x.parquet"
    for read in (shards.read_manifest, shards.verify_dataset, shards.inspect):
        with pytest.raises(shards.ManifestError, match=r"manifest.json: not a pairsim manifest") as err:
            read(data)
        assert isinstance(err.value, InputError) and bad in str(err.value) and "not a plain" in str(err.value)


def test_a_manifest_larger_than_any_pairsim_writes_is_refused_unread(two_datasets):
    data, _ = two_datasets
    _edit_manifest(data, lambda m: m.update(padding="x" * shards.MAX_MANIFEST_BYTES))
    with pytest.raises(shards.ManifestError, match="larger than"):
        shards.read_manifest(data)


def _folder_source(root: Path, n: int, names: list[str] | None = None) -> Path:
    """``n`` PNGs and a captions JSONL naming them (and ``names``) under ``root``."""
    root.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", (24 + i, 16), (40 * i % 256, 90, 200)).save(root / f"{i:02d}.png")
    names = [f"{i:02d}.png" for i in range(n)] + (names or [])
    (root / "captions.jsonl").write_text("".join(json.dumps({"file": f, "caption": f"scene {f}"}) + "\n"
                                                 for f in names))
    return root / "captions.jsonl"


@pytest.mark.parametrize("damage", ["bytes flipped", "marker mistyped"])
def test_a_rerun_rebuilds_a_shard_that_differs_from_its_marker(damage, ray_instance, tmp_path):
    """A build killed before its manifest leaves shards and their markers; a shard changed since
    (same size, other bytes) or a marker that is not one pairsim writes is rebuilt on the re-run,
    not trusted: the dataset verifies, the shard is as built."""
    cfg = BuildConfig(format="folder", input=_folder_source(tmp_path / "src", 4), out=tmp_path / "out",
                      rows_per_shard=2)
    builder.build(cfg, progress=False)
    shard = cfg.out / "train" / shards.shard_name(0)
    built = shard.read_bytes()
    (cfg.out / shards.MANIFEST).unlink()  # as a build killed after its shards
    (cfg.out / shards.REJECTS).unlink()
    if damage == "bytes flipped":
        middle = len(built) // 2
        shard.write_bytes(built[:middle] + bytes(b ^ 0xFF for b in built[middle:middle + 64]) + built[middle + 64:])
    else:
        marker = cfg.out / builder.MARKERS / "train" / "part-00000.json"
        marker.write_text(json.dumps(json.loads(marker.read_text()) | {"images": ["two"]}))
    manifest = builder.build(cfg, progress=False)
    assert shard.read_bytes() == built
    assert shards.verify_dataset(cfg.out) == {"train": []}
    assert manifest.split("train").images == 4


@pytest.mark.parametrize("fmt", ["csv", "folder", "karpathy"])
def test_a_nul_byte_in_an_image_path_is_one_reject(fmt, tmp_path):
    """No file has a name with a NUL byte: the record is rejected ("bad path"), the others kept."""
    root = tmp_path / "src"
    root.mkdir()
    Image.new("RGB", (16, 16)).save(root / "a.png")
    names = ["a.png", "b\x00.png"]
    if fmt == "csv":
        (root / "list.csv").write_text("filepath\ttitle\n" + "".join(f"{n}\tx\n" for n in names))
        listing = sources.list_csv(root / "list.csv", root, "train")
    elif fmt == "folder":
        (root / "list.jsonl").write_text("".join(json.dumps({"file": n, "caption": "x"}) + "\n" for n in names))
        listing = sources.list_folder(root / "list.jsonl", root, "train")
    else:
        (root / "split.json").write_text(json.dumps({"images": [
            {"filename": n, "split": "train", "sentences": [{"raw": "x"}]} for n in names]}))
        listing = sources.list_karpathy(root / "split.json", root)
    assert [Path(r.image.path).name for r in listing.records] == ["a.png"]
    assert [(r.reason, r.image_id) for r in listing.rejects] == [("bad path", "b\x00.png")]


def test_a_build_counts_a_nul_byte_path_as_a_reject_and_goes_on(ray_instance, tmp_path):
    source = _folder_source(tmp_path / "src", 3, names=["bad\x00.png"])
    out = tmp_path / "out"
    manifest = builder.build(BuildConfig(format="folder", input=source, out=out, max_reject_share=0.5),
                             progress=False)
    assert manifest.split("train").images == 3 and manifest.rejected == 1
    assert json.loads((out / shards.REJECTS).read_text())["reason"] == "bad path"


def test_an_output_that_cannot_be_a_dataset_directory_is_refused_before_any_work(tmp_path):
    source = _folder_source(tmp_path / "src", 2)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(OutputRefused, match=r"--out .*/file: not a directory"):
        builder.build(BuildConfig(format="folder", input=source, out=tmp_path / "file"), progress=False)
    assert (tmp_path / "file").read_text() == "mine"
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(OutputRefused, match=r"--out .*/foreign: not empty"):
        builder.build(BuildConfig(format="folder", input=source, out=tmp_path / "foreign"), progress=False)
    assert sorted(p.name for p in (tmp_path / "foreign").iterdir()) == ["notes.txt"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_output_is_refused_before_any_work(tmp_path):
    source = _folder_source(tmp_path / "src", 2)
    (tmp_path / "locked").mkdir(mode=0o555)
    with pytest.raises(OutputRefused, match="read-only"):
        builder.build(BuildConfig(format="folder", input=source, out=tmp_path / "locked" / "out"), progress=False)


def test_bad_input_is_an_input_error_and_too_many_rejects_a_runtime_failure(ray_instance, tmp_path):
    """What the user gave (an input that is not there or gives nothing) is refused as an
    InputError (exit status 2); a build that ran and rejected too much is a BuildError (1)."""
    out = tmp_path / "out"
    with pytest.raises(sources.SourceError, match="no such file") as err:
        builder.build(BuildConfig(format="folder", input=tmp_path / "nope.jsonl", out=out), progress=False)
    assert isinstance(err.value, InputError)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InputError, match="no usable image-caption records"):
        builder.build(BuildConfig(format="folder", input=empty, out=out), progress=False)
    source = _folder_source(tmp_path / "src", 1, names=["missing.png"])
    with pytest.raises(builder.BuildError, match="rejected") as err:
        builder.build(BuildConfig(format="folder", input=source, out=out), progress=False)
    assert not isinstance(err.value, InputError)
