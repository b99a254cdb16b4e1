"""Datasets safe by construction: a manifest is read as untrusted input and cannot lead a reader
outside its dataset, a re-run builds over leftovers only what it can vouch for, a build's
output is claimed before any work, and bad input is an InputError (exit 2), not a traceback."""

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pairsim import cli, untrusted
from pairsim.data import builder, shards, sources, synth
from pairsim.data.build_config import BuildConfig
from pairsim.errors import InputError
from pairsim.outputs import OutputRefused
from pairsim.storage import Location, NotARegularFile
from pairsim.untrusted import UntrustedFileError


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


# --------------------------------------------------------------------------- round two (issue 78): what a source names

def _csv_source(root: Path, names: list[str]) -> Path:
    """Three PNGs under ``root/imgs`` and ``list.csv`` naming them, then ``names`` (line 5 on)."""
    (root / "imgs").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (20 + i, 16), (60 * i, 90, 200)).save(root / "imgs" / f"{i}.png")
    rows = [f"imgs/{i}.png" for i in range(3)] + names
    (root / "list.csv").write_text("filepath\ttitle\n" + "".join(f"{name}\tscene {k}\n" for k, name in enumerate(rows)))
    return root / "list.csv"


@pytest.mark.timeout(300)
def test_a_pipe_or_directory_named_as_an_image_is_one_reject_naming_its_line(ray_instance, tmp_path):
    """A named pipe no one writes to would block the build task that opens it for ever: it and
    a directory are each one reject naming their line, the rest is built."""
    source = _csv_source(tmp_path / "src", ["imgs/pipe.png", "imgs/dir.png"])
    os.mkfifo(tmp_path / "src" / "imgs" / "pipe.png")
    (tmp_path / "src" / "imgs" / "dir.png").mkdir()
    out = tmp_path / "out"
    manifest = builder.build(BuildConfig(format="csv", input=source, out=out, max_reject_share=0.5), progress=False)
    assert manifest.split("train").images == 3
    rejects = shards.read_rejects(out)
    assert [(r["source"], r["reason"]) for r in rejects] == [("list.csv:5", "not a regular file"),
                                                             ("list.csv:6", "not a regular file")]
    assert "named pipe" in rejects[0]["detail"] and "directory" in rejects[1]["detail"]


@pytest.mark.timeout(20)
def test_every_file_a_source_names_is_opened_unblocking_regular_and_bounded(tmp_path):
    """An image path, a tar and a list file that is a named pipe, a device or a directory is
    refused unread, without blocking; an image larger than any the build stores is refused
    before a byte is read (a sparse file here: its size is all that is read)."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for path in (pipe, Path("/dev/zero"), tmp_path):
        with pytest.raises(NotARegularFile):
            sources.ImageRef(str(path)).read()
    huge = tmp_path / "huge.png"
    with huge.open("wb") as f:
        f.truncate(sources.MAX_SOURCE_IMAGE_BYTES + 1)
    with pytest.raises(sources.ImageTooLarge):
        sources.ImageRef(str(huge)).read()
    with pytest.raises(sources.ImageTooLarge):  # a tar member whose header claims more
        sources.ImageRef(str(huge), offset=0, size=sources.MAX_SOURCE_IMAGE_BYTES + 1).read()
    assert sources.ImageRef(str(huge), offset=10, size=4).read() == bytes(4)
    for fmt in ("csv", "folder", "karpathy"):
        with pytest.raises(sources.SourceError, match="named pipe"):
            sources.list_source(fmt, pipe, tmp_path, "train")
    tars = tmp_path / "tars"
    tars.mkdir()
    os.mkfifo(tars / "00000.tar")
    with pytest.raises(sources.SourceError, match=r"00000.tar: .*named pipe"):
        sources.list_webdataset(tars, "train")


def test_a_bare_cr_in_a_caption_is_part_of_it_not_a_line_end(tmp_path):
    """A CR inside a line (a caption pasted from an old Mac file) cut the caption there and made
    its rest a line of its own, naming the next image with it: the line is one record, the CR
    cleaned to a space as any control character; a CRLF still ends a line. The same in JSONL."""
    root = tmp_path / "src"
    _csv_source(root, [])
    (root / "list.csv").write_bytes(b"filepath\ttitle\r\n"
                                    b"imgs/0.png\tfirst half\rimgs/1.png is named here\r\n"
                                    b"imgs/1.png\ttwo\n"
                                    b"imgs/\r2.png\ta CR in a path\n")
    listing = sources.list_csv(root / "list.csv", root, "train")
    assert [(r.image_id, r.captions, r.source) for r in listing.records] == [
        ("imgs/0.png", ["first half imgs/1.png is named here"], "list.csv:2"), ("imgs/1.png", ["two"], "list.csv:3")]
    assert [(r.source, r.reason) for r in listing.rejects] == [("list.csv:4", "bad image id")]
    (root / "list.jsonl").write_bytes(b'{"file": "imgs/0.png",\r "caption": "x"}\n'
                                      b'{"file": "imgs/1.png", "caption": "y"}\n')
    listing = sources.list_folder(root / "list.jsonl", root, "train")
    assert [(r.image_id, r.source) for r in listing.records] == [("imgs/0.png", "list.jsonl:1"),
                                                                 ("imgs/1.png", "list.jsonl:2")]
    assert listing.rejects == []


BAD_IDS = ["../escaped", "a/../../b", "line\nbreak", "esc\x1b[2Jape", "bidi\u202eflip", "x" * 2000]


def _tar_of(root: Path, keys: list[str]) -> Path:
    root.mkdir(parents=True)
    png = io.BytesIO()
    Image.new("RGB", (16, 16)).save(png, format="PNG")
    with tarfile.open(root / "00000.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for key in keys:
            for ext, raw in (("png", png.getvalue()), ("txt", f"caption of {key[:10]}".encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
    return root


@pytest.mark.parametrize("fmt", ["webdataset", "karpathy", "csv", "folder"])
def test_an_image_id_that_is_no_safe_name_is_one_reject_in_every_format(fmt, tmp_path):
    """A tar key, a cocoid or an image path with a control character, a ``..`` part or no end
    becomes an id stored in the shards and shown by every report: each is one reject naming
    where it came from; a plain id is kept. A CSV's absolute path under the root is relative."""
    root = tmp_path / "src"
    if fmt == "webdataset":
        listing = sources.list_webdataset(_tar_of(root, ["good"] + BAD_IDS), "train")
    else:
        _csv_source(root, [])
        if fmt == "karpathy":
            entries = [{"filename": f"{i % 3}.png", "filepath": "imgs", "cocoid": image_id, "split": "train",
                        "sentences": [{"raw": "x"}]} for i, image_id in enumerate(["good"] + BAD_IDS)]
            (root / "split.json").write_text(json.dumps({"images": entries}))
            listing = sources.list_karpathy(root / "split.json", root)
        else:
            names = [f"{root}/imgs/0.png"] + [f"imgs/{bad}" for bad in BAD_IDS[2:]]  # '..' leaves the root
            if fmt == "csv":
                (root / "l.csv").write_text("filepath\ttitle\n" + "".join(f'"{n}"\tx\n' for n in names))
                listing = sources.list_csv(root / "l.csv", root, "train")
            else:
                (root / "l.jsonl").write_text("".join(json.dumps({"file": n, "caption": "x"}) + "\n" for n in names))
                listing = sources.list_folder(root / "l.jsonl", root, "train")
    assert [r.image_id for r in listing.records] == (["imgs/0.png"] if fmt in ("csv", "folder") else ["good"])
    bad = [r for r in listing.rejects if r.reason == "bad image id"]
    assert len(bad) == (len(BAD_IDS) if fmt in ("webdataset", "karpathy") else len(BAD_IDS) - 2)
    assert all(r.source.isprintable() and len(r.source) < 300 and r.image_id.isprintable() for r in bad)
    if fmt == "webdataset":  # the tar member
        assert {r.source for r in bad} >= {"00000.tar:../escaped.png", "00000.tar:line\\nbreak.png"}


@pytest.mark.parametrize("stats", ["not json", '{"successes": "many"}', '{"successes": 1000001}',
                                   '{"successes": 3, "successes": 40}', "[40]"])
def test_an_img2dataset_stats_sidecar_that_is_not_one_is_a_named_reject(stats, tmp_path):
    """img2dataset's ``NNNNN_stats.json`` beside a truncated tar says how many samples it lost:
    one that is not JSON, not its shape, a key twice or a count beyond any tar is one reject
    naming it, beside the truncated tar's, not a traceback or a million rejects."""
    tars = _tar_of(tmp_path / "tars", [f"{i:05d}" for i in range(4)])
    tar = tars / "00000.tar"
    with tarfile.open(tar) as whole:
        end = whole.getmembers()[6].offset  # the last sample's image
    tar.write_bytes(tar.read_bytes()[:end])  # cut between two members
    (tars / "00000_stats.json").write_text(stats)
    listing = sources.list_webdataset(tars, "train")
    assert len(listing.records) == 3
    assert sorted((r.source, r.reason) for r in listing.rejects) == [("00000.tar", "truncated tar"),
                                                                   ("00000_stats.json", "unreadable sidecar")]


# --------------------------------------------------------------------------- round two: what a dataset holds

def _record_as_they_are(root: Path, split: str) -> None:
    """The manifest's SHA-256s and content hashes rewritten to the split's shards as they are now
    (what someone who replaced a shard would also do); its footers left as they were."""
    def edit(manifest):
        info = manifest["splits"][split]
        info["shard_sha256"] = shards.shard_digests(root, split)
        info["content_hash"] = shards.split_content_hash(split, info["shard_sha256"])
        manifest["content_hash"] = shards.content_hash({s: c["content_hash"] for s, c in manifest["splits"].items()})
    _edit_manifest(root, edit)


def test_inspect_names_a_shard_swapped_for_another_of_as_many_rows(two_datasets, capsys):
    """``inspect`` checks footers and row counts, not every byte: a shard swapped for another
    valid one with as many rows (its digests recorded to match) passed as healthy. Each shard's
    footer SHA-256 in the manifest names it, exit 1, still without reading its data."""
    from test_safe_io import one_line_failure

    data, _ = two_datasets
    assert cli.main(["shards", "inspect", str(data)]) == 0
    capsys.readouterr()
    synth.generate(data.parent / "seeded", num_train=8, num_val=4, num_test=0, seed=1, progress=False)
    victim = data / "train" / shards.shard_name(0)
    victim.write_bytes((data.parent / "seeded" / "train" / shards.shard_name(0)).read_bytes())  # 8 rows for 8
    _record_as_they_are(data, "train")
    assert str(victim) in one_line_failure(capsys, cli.main(["shards", "inspect", str(data)]), 1)


@pytest.mark.parametrize("field", ["splits.train.content_hash", "content_hash"])
def test_a_content_hash_its_records_do_not_give_is_refused_on_read(field, two_datasets):
    """A content hash zeroed in the manifest was trained on and logged to MLflow as the data's
    digest: a split's must be the hash of its shards' SHA-256s, the dataset's that of its
    splits'; the manifest is refused naming the field, by a run before Ray starts too."""
    from pairsim.config import ConfigError, load_config
    from pairsim.train import driver

    data, _ = two_datasets
    _edit_manifest(data, lambda m: (m["splits"]["train"] if field.startswith("splits") else m).update(
        content_hash="0" * 64))
    with pytest.raises(shards.ManifestError) as err:
        shards.read_manifest(data)
    assert str(err.value).startswith(f"{data / shards.MANIFEST}: ") and field in str(err.value)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        driver.plan_run(load_config(None, [f"data.path={data}", "train.micro_batch_size=4"]))
    assert f"{data / shards.MANIFEST}: {field}" in shards.verify_dataset(data)["dataset"][0]  # verify lists it


def test_a_shard_digest_listed_twice_is_refused(two_datasets, capsys):
    """``{"part-00000.parquet": <other>, "part-00000.parquet": <real>}``: JSON keeps the second
    silently, so ``verify`` passed the real one while a reader of the first trusts another."""
    from test_safe_io import one_line_failure

    data, _ = two_datasets
    path = data / shards.MANIFEST
    text = json.dumps(json.loads(path.read_text()))
    name = shards.shard_name(0)
    real = f'"{name}": "{shards.read_manifest(data).split("train").shard_sha256[name]}"'
    path.write_text(text.replace(real, f'"{name}": "{"0" * 64}", {real}', 1))
    with pytest.raises(shards.ManifestError, match=f"'{name}' appears twice"):
        shards.read_manifest(data)
    assert name in one_line_failure(capsys, cli.main(["shards", "verify", str(data)]), 2)


@pytest.mark.parametrize("where", ["manifest", "marker"])
def test_a_count_beyond_any_dataset_is_refused_where_it_is_read_back(where, two_datasets, tmp_path):
    data, _ = two_datasets
    if where == "manifest":
        for count in (-1, 10**15):  # a count of a thousand LAION-5Bs
            _edit_manifest(data, lambda m: m["splits"]["val"].update(images=count))
            with pytest.raises(shards.ManifestError, match=r"splits\.val\.images"):
                shards.read_manifest(data)
    else:
        marker = tmp_path / "part-00000.json"
        marker.write_text(json.dumps({"fingerprint": "f", "images": 1, "captions": 10**15, "rejects": [],
                                      "bytes": 10, "sha256": "0" * 64}))
        with pytest.raises(UntrustedFileError, match="captions"):
            untrusted.read_model(marker, builder.ShardMarker, builder.MAX_MARKER_BYTES)


def _garble_pages(shard: Path, keep_footer: bool) -> None:
    """The shard's bytes replaced by random ones of the same length, all of them or all but its
    Parquet footer (a valid footer over data pages that do not parse)."""
    raw = shard.read_bytes()
    kept = int.from_bytes(raw[-8:-4], "little") + 8 if keep_footer else 0
    shard.write_bytes(np.random.default_rng(0).bytes(len(raw) - kept) + raw[len(raw) - kept:])


@pytest.mark.parametrize("keep_footer", [False, True])
def test_a_shard_that_does_not_parse_is_one_line_naming_it(keep_footer, two_datasets, capsys):
    """Random bytes in a shard whose SHA-256s the manifest was made to record: every reader ends
    in one line naming the shard, not a pyarrow traceback."""
    from test_safe_io import one_line_failure

    data, _ = two_datasets
    victim = data / "train" / shards.shard_name(0)
    _garble_pages(victim, keep_footer)
    _record_as_they_are(data, "train")
    with pytest.raises(shards.ShardError, match=f"^{victim}: not a Parquet shard"):
        shards.read_table([Location.of(victim)])
    with pytest.raises(shards.ShardError, match=f"^{victim}: "):
        shards.label_and_caption_counts(data, "train")
    if not keep_footer:  # a valid footer passes inspect's and verify's checks, which read no data page
        assert str(victim) in one_line_failure(capsys, cli.main(["shards", "inspect", str(data)]), 1)
        assert cli.main(["shards", "verify", str(data)]) == 1
        assert any(line.strip().startswith(f"{victim}: not a Parquet shard")
                   for line in capsys.readouterr().out.splitlines())


def test_inspect_prints_ids_captions_and_reject_reasons_cut_and_escaped(tmp_path, capsys):
    """A shard or rejects.jsonl from anyone: what ``inspect`` prints of them adds no line, moves
    no cursor and stays short, whatever an id, a caption or a reason holds."""
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    rows = [{"image": png.getvalue(), "image_id": f"id\x1b[2J{i}\n", "captions": ["two\nlines\x1b[31m", "y" * 10**5],
             "label": -1, "label_name": None, "width": 8, "height": 8, "source": "s"} for i in range(4)]
    counts = shards.write_split(rows, tmp_path / "train", rows_per_shard=4)
    (tmp_path / shards.REJECTS).write_text(json.dumps({"kind": "image", "reason": "bad\x1b[2J" + "z" * 10**5}) + "\n")
    shards.write_manifest(tmp_path, "hand-made\x1b[2J", {"train": counts}, rejected=1)
    assert cli.main(["shards", "inspect", str(tmp_path), "--samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "id\\x1b[2J0\\n" in out and "two\\nlines" in out
    assert max(map(len, out.splitlines())) < 1000
