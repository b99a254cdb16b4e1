"""The shard builder: each source format, built from small generated inputs holding every kind of
bad record, gives the right shards, manifest and rejects; builds are deterministic and resume
after a kill; ``inspect`` reports and draws a contact sheet."""

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pairsim.data import builder, shards, sources
from pairsim.config import ConfigError
from pairsim.data.build_config import BuildConfig

NON_ASCII = "un café ☕ à Zürich, 東京の夜"
CP1252 = "naïve résumé"  # written as cp1252 bytes where the format allows raw bytes
MAX_SIDE = 64


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _gradient(w, h):
    x = np.linspace(0, 255, w, dtype=np.uint8)[None, :, None]
    y = np.linspace(0, 255, h, dtype=np.uint8)[:, None, None]
    return Image.fromarray(np.concatenate(np.broadcast_arrays(x, y, 255 - x), axis=2).astype(np.uint8), "RGB")


def messy_images() -> dict[str, tuple[bytes, tuple[int, int] | str]]:
    """name → (bytes, expected stored (width, height) or the reject reason)."""
    rotated = _gradient(40, 20)
    exif = rotated.getexif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    alpha = Image.new("RGBA", (30, 30), (255, 0, 0, 255))
    alpha.paste((0, 0, 0, 0), (0, 0, 15, 30))  # left half fully transparent
    deep = Image.fromarray(np.arange(24 * 24, dtype=np.uint16).reshape(24, 24) * 100)
    good_jpeg = _encode(_gradient(48, 32), "JPEG")
    return {
        "rgb.jpg": (good_jpeg, (48, 32)),
        "rgb.png": (_encode(_gradient(30, 40), "PNG"), (30, 40)),
        "rotated.jpg": (_encode(rotated, "JPEG", exif=exif), (20, 40)),
        "gray.png": (_encode(_gradient(32, 32).convert("L"), "PNG"), (32, 32)),
        "palette.png": (_encode(_gradient(32, 24).convert("P"), "PNG"), (32, 24)),
        "cmyk.jpg": (_encode(_gradient(24, 24).convert("CMYK"), "JPEG"), (24, 24)),
        "deep.png": (_encode(deep, "PNG"), (24, 24)),
        "alpha.png": (_encode(alpha, "PNG"), (30, 30)),
        "big.jpg": (_encode(_gradient(256, 128), "JPEG"), (MAX_SIDE, MAX_SIDE // 2)),
        "photo.webp": (_encode(_gradient(36, 36), "WEBP"), (36, 36)),
        "corrupt.jpg": (b"\xff\xd8 certainly not a jpeg" * 10, "corrupt image"),
        "truncated.jpg": (good_jpeg[: len(good_jpeg) // 2], "truncated image"),
        "empty.png": (b"", "empty file"),
    }


GOOD = [n for n, (_, want) in messy_images().items() if isinstance(want, tuple)]
BAD = {n: want for n, (_, want) in messy_images().items() if isinstance(want, str)}


def _captions(name: str) -> list[str]:
    return [f"a picture called {name}", f"{NON_ASCII} ({name})"]


def write_images(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, (raw, _) in messy_images().items():
        (root / name).write_bytes(raw)


def make_karpathy(tmp: Path) -> tuple[Path, Path]:
    write_images(tmp / "images" / "val2014")
    names = list(messy_images()) + ["missing.jpg"]
    entries = [{"filepath": "val2014", "filename": n, "cocoid": i, "split": ["train", "restval", "val"][i % 3],
                "sentences": [{"raw": c} for c in _captions(n)] + [{"raw": "   "}]}
               for i, n in enumerate(names)]
    entries.append({"filepath": "val2014", "filename": "rgb.png", "cocoid": 0, "split": "train",
                    "sentences": [{"raw": "a second entry with an id already used"}]})
    entries.append({"filepath": "val2014", "cocoid": 99, "split": "train", "sentences": []})  # no filename
    path = tmp / "dataset_coco.json"
    path.write_text(json.dumps({"images": entries, "dataset": "coco"}))
    return path, tmp / "images"


def make_csv(tmp: Path) -> tuple[Path, Path]:
    write_images(tmp / "imgs")
    lines = ["filepath\ttitle\n".encode()]
    for n in list(messy_images()) + ["missing.jpg"]:
        lines += [f"imgs/{n}\t{c}\n".encode() for c in _captions(n)]
    lines += ["./imgs/rgb.jpg\t\n".encode(),  # an empty caption of an image already listed
              b"imgs/gray.png\t" + CP1252.encode("cp1252") + b"\n",
              "imgs/rgb.png\tthree\tfields\n".encode()]
    path = tmp / "train.csv"
    path.write_bytes(b"".join(lines))
    return path, tmp


def make_folder(tmp: Path) -> tuple[Path, Path]:
    write_images(tmp / "photos")
    lines = [json.dumps({"file": n, "captions": _captions(n) + [""]}, ensure_ascii=False).encode()
             for n in list(messy_images()) + ["missing.jpg"]]
    lines += [json.dumps({"file": "gray.png", "caption": "one more for gray"}).encode(),
              b'{"file": "rgb.png", "caption": ' + json.dumps(CP1252).encode() + b"}",
              b"{not json"]
    path = tmp / "photos" / "captions.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, None


def _add(tar: tarfile.TarFile, name: str, raw: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(raw)
    tar.addfile(info, io.BytesIO(raw))


def make_webdataset(tmp: Path) -> tuple[Path, Path]:
    tars = tmp / "tars"
    tars.mkdir(parents=True)
    items = list(messy_images().items())
    for part, chunk in enumerate((items[:7], items[7:])):
        with tarfile.open(tars / f"{part:05d}.tar", "w") as tar:
            for name, (raw, _) in chunk:
                key = name.replace(".", "_")
                _add(tar, f"{key}.{name.rsplit('.', 1)[1]}", raw)
                _add(tar, f"{key}.txt", f"{_captions(name)[1]}".encode())
                _add(tar, f"{key}.json", json.dumps({"key": key, "url": f"http://x/{name}"}).encode())
            if part == 1:
                _add(tar, "rgb_jpg.jpg", items[0][1][0])  # the key of a sample in the first tar
                _add(tar, "rgb_jpg.txt", b"the same key again")
                _add(tar, "latin.png", items[1][1][0])
                _add(tar, "latin.txt", CP1252.encode("cp1252"))
                _add(tar, "onlyjson.png", items[1][1][0])
                _add(tar, "onlyjson.json", json.dumps({"caption": "caption from the json"}).encode())
                _add(tar, "noimage.txt", b"a caption without its image")
                _add(tar, "blank.png", items[1][1][0])
                _add(tar, "blank.txt", b" \t ")
    return tars, None


FORMATS = {"karpathy": make_karpathy, "csv": make_csv, "folder": make_folder, "webdataset": make_webdataset}


def _build(fmt: str, tmp: Path, **options):
    source, images_root = FORMATS[fmt](tmp / "src")
    cfg = BuildConfig(format=fmt, input=source, images_root=images_root, out=tmp / "out", max_side=MAX_SIDE,
                      **({"max_reject_share": 0.5} | options))
    return cfg, builder.build(cfg, progress=False)


def _rows(root: Path, split: str) -> list[dict]:
    return pq.read_table(shards.split_files(root, split)).to_pylist()


def _name(row, fmt) -> str:
    """The messy_images name a stored row came from."""
    source = row["source"]
    if fmt == "webdataset":
        return source.split(":")[1].rsplit(".", 1)[0].replace("_", ".")
    return row["image_id"].rsplit("/", 1)[-1] if fmt != "karpathy" else list(messy_images())[int(row["image_id"])]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_keeps_good_records_and_rejects_bad_ones_with_reasons(fmt, ray_instance, tmp_path):
    cfg, manifest = _build(fmt, tmp_path)
    out = cfg.out
    rows = [row for split in manifest.splits for row in _rows(out, split)]
    # manifest counts are the shards' own
    for split, counts in manifest.splits.items():
        split_rows = _rows(out, split)
        assert counts.images == len(split_rows)
        assert counts.captions == sum(len(r["captions"]) for r in split_rows)
        assert counts.shards == len(shards.split_files(out, split))
        assert counts.content_hash == shards.split_content_hash(split, shards.shard_digests(out, split))  # the files', not the markers'
        assert counts.source == f"{fmt}:{cfg.input.name}"
    assert manifest.content_hash == shards.content_hash({s: c.content_hash for s, c in manifest.splits.items()})
    assert shards.read_manifest(out) == manifest  # what was written reads back the same
    if fmt == "karpathy":  # restval is train; val kept apart
        assert sorted(manifest.splits) == ["train", "val"]

    expected = {n: want for n, (_, want) in messy_images().items()}
    stored = {_name(row, fmt): row for row in rows}
    extra = {"latin", "onlyjson"} if fmt == "webdataset" else set()
    assert set(stored) == set(GOOD) | extra
    for name, row in stored.items():
        with Image.open(io.BytesIO(row["image"])) as image:
            assert image.format in ("JPEG", "PNG") and image.mode == "RGB", name
            assert image.size == (row["width"], row["height"])
            if name in expected:
                assert image.size == expected[name], name
            if name == "alpha.png":  # transparent half composited on white, opaque half red
                assert image.getpixel((2, 15)) == (255, 255, 255) and image.getpixel((25, 15)) == (255, 0, 0)
            if name == "deep.png":  # 16-bit values scaled, not clipped to white
                assert 0 < np.asarray(image).mean() < 250
    assert stored["rgb.jpg"]["image"] == messy_images()["rgb.jpg"][0]  # clean JPEGs are stored untouched
    for name in GOOD:
        assert f"{NON_ASCII} ({name})" in stored[name]["captions"]
        assert all(c.strip() == c and c for c in stored[name]["captions"])

    rejects = [json.loads(line) for line in (out / shards.REJECTS).read_text(encoding="utf-8").splitlines()]
    assert manifest.rejected == len(rejects)
    assert all(r["source"] and r["reason"] and set(r["split"].split(",")) <= set(manifest.splits) for r in rejects)
    image_reasons = {r["reason"] for r in rejects if r["kind"] == "image"}
    assert set(BAD.values()) <= image_reasons
    if fmt != "webdataset":
        assert "missing file" in image_reasons
        assert any(r["kind"] == "record" and r["reason"] in ("malformed line", "malformed entry") for r in rejects)
    assert any(r["kind"] == "caption" and r["reason"] == "empty caption" for r in rejects)
    if fmt in ("karpathy", "webdataset"):
        dups = [r for r in rejects if r["reason"] == "duplicate image id"]
        assert len(dups) == 1 and "first seen at" in dups[0]["detail"]
        assert sum(c.duplicate_image_ids for c in manifest.splits.values()) == 1
    if fmt == "csv":
        assert CP1252 in stored["gray.png"]["captions"] and manifest.split("train").captions_recoded == 1
    if fmt == "folder":
        assert CP1252 in stored["rgb.png"]["captions"] and "one more for gray" in stored["gray.png"]["captions"]
    if fmt == "webdataset":
        assert stored["latin"]["captions"] == [CP1252] and manifest.split("train").captions_recoded == 1
        assert stored["onlyjson"]["captions"] == ["caption from the json"]
        assert {"no image file", "no valid caption"} <= image_reasons


def test_too_many_rejects_fail_the_build_naming_the_reasons(ray_instance, tmp_path):
    with pytest.raises(builder.BuildError) as err:
        _build("csv", tmp_path, max_reject_share=0.05)
    assert "corrupt image" in str(err.value)  # the reason
    assert "max_reject_share" in str(err.value) and "rejects.jsonl" in str(err.value)
    assert (tmp_path / "out" / shards.REJECTS).is_file()
    assert not (tmp_path / "out" / shards.MANIFEST).exists()  # nothing to train on by mistake


def test_bad_options_and_unreadable_inputs_are_named(tmp_path):
    with pytest.raises(ConfigError, match="max_reject_share"):
        BuildConfig.from_args(format="csv", input=tmp_path, out=tmp_path, max_reject_share=2)
    with pytest.raises(ConfigError, match="format"):
        BuildConfig.from_args(format="tsv", input=tmp_path, out=tmp_path)
    (tmp_path / "list.csv").write_text("path,text\na.jpg,hello\n")
    with pytest.raises(sources.SourceError, match="lacks the image column 'filepath'"):
        builder.build(BuildConfig(format="csv", input=tmp_path / "list.csv", out=tmp_path / "o"), progress=False)
    with pytest.raises(sources.SourceError, match="no such file"):
        builder.build(BuildConfig(format="folder", input=tmp_path / "nope.jsonl", out=tmp_path / "o"), progress=False)
    (tmp_path / "x.tar").write_bytes(b"\x1f\x8b compressed")
    with pytest.raises(sources.SourceError, match="not an uncompressed tar"):
        builder.build(BuildConfig(format="webdataset", input=tmp_path / "x.tar", out=tmp_path / "o"), progress=False)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix in (".parquet", ".jsonl") or p.name == shards.MANIFEST}


@pytest.mark.slow
def test_a_killed_build_resumes_to_the_same_output(ray_instance, tmp_path, capsys):
    """One image per shard, 120 shards: kill a build (its own process and Ray instance) once some
    shards are done, run the same command again, and compare with an uninterrupted build byte for
    byte (both on the session's instance)."""
    from pairsim import cli

    src = tmp_path / "src"
    src.mkdir()
    lines = []
    for i in range(120):
        _gradient(64 + i, 48).save(src / f"{i:03d}.png")
        lines.append(json.dumps({"file": f"{i:03d}.png", "captions": [f"scene {i}", f"picture {i}"]}))
    (src / "captions.jsonl").write_text("\n".join(lines) + "\n")

    def command(out):
        return ["shards", "build", "--format", "folder", "--input", str(src / "captions.jsonl"), "--out", str(out),
                "--rows-per-shard", "1"]

    assert cli.main(command(tmp_path / "whole")) == 0
    killed = tmp_path / "killed"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "pairsim.cli", *command(killed)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while len(list(killed.glob(f"{builder.MARKERS}/train/*.json"))) < 10:
        assert proc.poll() is None and time.time() < deadline, "the build ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray instance it started
    proc.wait()
    done_at_kill = len(list(killed.glob(f"{builder.MARKERS}/train/*.json")))
    assert done_at_kill < 120 and not (killed / shards.MANIFEST).exists()

    capsys.readouterr()
    assert cli.main(command(killed)) == 0
    assert "120 shards" in capsys.readouterr().out
    assert _tree(killed) == _tree(tmp_path / "whole")
    assert not list(killed.rglob("*.tmp"))


def test_inspect_reports_counts_and_draws_a_contact_sheet(ray_instance, tmp_path):
    cfg, manifest = _build("folder", tmp_path)
    report = shards.inspect(cfg.out, samples=3, sheet=tmp_path / "sheet.png")
    assert f"{manifest.split('train').images:>9,} images" in report
    assert "captions: list<element: string>" in report or "captions: list<item: string>" in report
    assert "mostly" in report and "corrupt image" in report
    assert report.count("a picture called") == 3
    with Image.open(tmp_path / "sheet.png") as sheet:
        assert sheet.mode == "RGB" and sheet.width > 4 * 192
        # tiles are drawn: the sheet is not blank
        assert np.asarray(sheet).std() > 10


# --------------------------------------------------------------------------- several splits, one directory

def _csv(path: Path, images: dict[str, list[str]]) -> Path:
    path.write_text("filepath\ttitle\n" + "".join(f"imgs/{n}\t{c}\n" for n, caps in images.items() for c in caps))
    return path


def _gradients(root: Path, n: int) -> dict[str, list[str]]:
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        _gradient(40 + i, 32).save(root / "imgs" / f"{i:03d}.png")
    return {f"{i:03d}.png": [f"scene {i}"] for i in range(n)}  # one caption per image, as most CSVs


def test_train_and_val_from_two_csvs_share_a_directory_and_leave_each_other_alone(ray_instance, tmp_path):
    images = _gradients(tmp_path, 12)
    names = sorted(images)
    train_csv = _csv(tmp_path / "train.csv", {n: images[n] for n in names[:8]} | {"missing.png": ["gone"]})
    val_csv = _csv(tmp_path / "val.csv", {n: images[n] for n in names[8:]})
    out = tmp_path / "out"

    def build(csv_path, split, **options):
        return builder.build(BuildConfig(format="csv", input=csv_path, out=out, split=split,
                                        **({"max_reject_share": 0.5} | options)), progress=False)

    first = build(train_csv, "train")
    train_files = _tree(out / "train")
    both = build(val_csv, "val")
    assert sorted(both.splits) == ["train", "val"] and both.split("train") == first.split("train")
    assert _tree(out / "train") == train_files  # not rebuilt, not removed
    assert both.split("val").images == 4 and both.split("val").source == "csv:val.csv"
    assert both.content_hash == shards.content_hash({s: c.content_hash for s, c in both.splits.items()}) \
        != first.content_hash
    rejects = [json.loads(line) for line in (out / shards.REJECTS).read_text().splitlines()]
    assert [(r["split"], r["reason"]) for r in rejects] == [("train", "missing file")]  # train's kept
    assert both.rejected == 1

    again = build(_csv(tmp_path / "val2.csv", {n: images[n] for n in names[8:10]}), "val")  # replaces val only
    assert again.split("val").images == 2 and len(shards.split_files(out, "val")) == 1
    assert again.split("train") == first.split("train") and _tree(out / "train") == train_files

    with pytest.raises(builder.BuildError, match="rejected"):  # a failed val build: train stays usable
        build(_csv(tmp_path / "bad.csv", {"nope.png": ["x"], names[9]: ["y"]}), "val", max_reject_share=0.1)
    assert sorted(shards.read_manifest(out).splits) == ["train"]
    assert len(shards.split_files(out, "train")) == first.split("train").shards


def test_a_held_out_share_is_seeded_and_keeps_an_images_captions_together(ray_instance, tmp_path):
    images = _gradients(tmp_path, 40)
    for name in list(images)[::3]:
        images[name] = images[name] + [f"another caption of {name}"]
    csv_path = _csv(tmp_path / "all.csv", images)

    def build(out, seed):
        manifest = builder.build(BuildConfig(format="csv", input=csv_path, out=out, val_share=0.25, val_seed=seed),
                                progress=False)
        return manifest, {split: {r["image_id"]: r["captions"] for r in _rows(out, split)} for split in manifest.splits}

    manifest, rows = build(tmp_path / "a", 0)
    assert sorted(manifest.splits) == ["train", "val"]
    assert not rows["train"].keys() & rows["val"].keys()
    assert {**rows["train"], **rows["val"]} == {f"imgs/{n}": caps for n, caps in images.items()}
    assert 3 <= len(rows["val"]) <= 18  # 10 expected of 40
    assert build(tmp_path / "b", 0)[1] == rows  # the same draw again
    assert build(tmp_path / "c", 1)[1]["val"].keys() != rows["val"].keys()
    with pytest.raises(ConfigError, match=r"^--val-share: .*train, val"):  # the splits the input gives
        builder.build(BuildConfig(format="karpathy", input=make_karpathy(tmp_path / "k")[0],
                                 images_root=tmp_path / "k" / "images", out=tmp_path / "k-out", val_share=0.1,
                                 max_reject_share=0.5), progress=False)


@pytest.mark.parametrize("split", ["../../escaped", "..", ".build", "a/b", "/abs"])
def test_a_split_name_cannot_leave_the_output(split, ray_instance, tmp_path):
    path, images_root = make_karpathy(tmp_path / "src")
    entries = json.loads(path.read_text())
    entries["images"][0]["split"] = split
    path.write_text(json.dumps(entries))
    out = tmp_path / "deep" / "out"
    manifest = builder.build(BuildConfig(format="karpathy", input=path, images_root=images_root, out=out,
                                        max_reject_share=0.5), progress=False)
    assert split not in manifest.splits
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["out"] and not (tmp_path / "escaped").exists()
    rejects = [json.loads(line) for line in (out / shards.REJECTS).read_text().splitlines()]
    assert any(r["reason"] == "bad split name" and repr(split) in r["detail"] for r in rejects)
    with pytest.raises(ConfigError, match="split"):
        BuildConfig.from_args(format="csv", input=path, out=out, split=split)


# --------------------------------------------------------------------------- honest accounting of tars

def _img2dataset_tar(tmp: Path, n: int, sidecar: str | None) -> Path:
    """``00000.tar`` with ``n`` samples as img2dataset writes them, and its sidecar."""
    images = _gradients(tmp, n)
    tars = tmp / "tars"
    tars.mkdir()
    with tarfile.open(tars / "00000.tar", "w") as tar:
        for i, name in enumerate(sorted(images)):
            key = f"{i:09d}"
            _add(tar, f"{key}.png", (tmp / "imgs" / name).read_bytes())
            _add(tar, f"{key}.txt", images[name][0].encode())
    if sidecar == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"key": [f"{i:09d}" for i in range(n)] + ["x"], "status": ["success"] * n + ["failed"]}),
                       tars / "00000.parquet")
    elif sidecar == "stats":
        (tars / "00000_stats.json").write_text(json.dumps({"count": n + 1, "successes": n, "failed_to_download": 1}))
    return tars


@pytest.mark.parametrize("sidecar", ["parquet", "stats", None])
@pytest.mark.parametrize("cut", ["between_members", "inside_a_member"])
def test_a_truncated_tar_counts_the_samples_it_lost(sidecar, cut, tmp_path):
    from pairsim.data.sources import list_webdataset

    tars = _img2dataset_tar(tmp_path, 40, sidecar)
    tar_path = tars / "00000.tar"
    with tarfile.open(tar_path) as tar:
        member = tar.getmembers()[30]  # the image of sample 15
    end = member.offset if cut == "between_members" else member.offset_data + 100
    tar_path.write_bytes(tar_path.read_bytes()[:end])
    listing = list_webdataset(tars, "train")
    kept = len(listing.records)
    assert kept == 15
    lost = [r for r in listing.rejects if r.source == "00000.tar"]
    if sidecar is None:
        assert [(r.kind, r.reason) for r in lost] == [("record", "truncated tar")]
        seen = kept + (cut == "inside_a_member")  # sample 15's image header was read, its caption lost
        assert "unknown" in lost[0].detail and f"after {seen} samples" in lost[0].detail
    else:
        # every sample the sidecar lists that the tar lost (sample 15, cut inside its image, has no caption left)
        assert len(lost) + kept + (cut == "inside_a_member") == 40
        assert all(r.reason == "lost from the tar" for r in lost)
        if sidecar == "parquet":
            assert {r.image_id for r in lost}.isdisjoint(r.image_id for r in listing.records)


def test_a_key_twice_in_one_tar_is_rejected_not_replaced(tmp_path):
    from pairsim.data.sources import list_webdataset

    tars = tmp_path / "tars"
    tars.mkdir()
    raw = _encode(_gradient(20, 20), "PNG")
    with tarfile.open(tars / "a.tar", "w") as tar:
        _add(tar, "k.png", raw)
        _add(tar, "k.txt", b"the first caption")
        _add(tar, "k.txt", b"a second caption under the same key")
    listing = list_webdataset(tars, "train")
    assert [r.captions for r in listing.records] == [["the first caption"]]
    assert [(r.reason, r.source) for r in listing.rejects] == [("duplicate member", "a.tar:k.txt")]


# --------------------------------------------------------------------------- image paths stay inside their root

@pytest.mark.parametrize("fmt", ["csv", "folder", "karpathy"])
def test_image_paths_cannot_leave_the_images_root(fmt, tmp_path):
    """``..``, an absolute path and a symlink out each name a readable image outside the root:
    each is rejected (the builder would otherwise read and store any file), the good one kept.
    (Two spellings of one file are one image, rejected once: the absolute path names another.)"""
    root = tmp_path / "dataset"
    _gradients(root, 1)
    for name in ("secret.png", "other.png"):
        _gradient(30, 30).save(tmp_path / name)
    (root / "imgs" / "link.png").symlink_to(tmp_path / "secret.png")
    names = ["imgs/000.png", "../secret.png", str(tmp_path / "other.png"), "imgs/link.png"]
    if fmt == "csv":
        (root / "list.csv").write_text("filepath\ttitle\n" + "".join(f"{n}\tx\n" for n in names))
        listing = sources.list_csv(root / "list.csv", root, "train")
    elif fmt == "folder":
        (root / "list.jsonl").write_text("".join(json.dumps({"file": n, "caption": "x"}) + "\n" for n in names))
        listing = sources.list_folder(root / "list.jsonl", root, "train")
    else:
        entries = [{"filepath": str(Path(n).parent), "filename": Path(n).name, "split": "train",
                    "sentences": [{"raw": "x"}]} for n in names]
        (root / "split.json").write_text(json.dumps({"images": entries}))
        listing = sources.list_karpathy(root / "split.json", root)
    assert [r.image.path for r in listing.records] == [str(root / "imgs" / "000.png")]
    outside = [r for r in listing.rejects if r.reason == "outside images root"]
    assert len(outside) == 3 and all("--images-root" in r.detail for r in outside)
    if fmt == "csv":  # a root that holds the files: absolute paths and the link are fine
        (root / "abs.csv").write_text(f"filepath\ttitle\n{tmp_path / 'secret.png'}\tx\n{root}/imgs/link.png\tx\n")
        assert len(sources.list_csv(root / "abs.csv", tmp_path, "train").records) == 2


def test_a_truncated_or_foreign_shard_is_named_before_training(tmp_path):
    """The pre-launch check reads every shard's footer: a cut shard, or one holding other rows,
    fails there, naming the file, instead of deep inside a worker."""
    from pairsim.config import load_config
    from pairsim.data import synth
    from pairsim.train import driver

    synth.generate(tmp_path / "d", num_train=40, num_val=8, num_test=0, rows_per_shard=10, progress=False)
    cfg = load_config(None, [f"data.path={tmp_path / 'd'}", "train.micro_batch_size=4"])
    driver.plan_run(cfg)
    train = sorted((tmp_path / "d" / "train").glob("*.parquet"))
    whole = train[1].read_bytes()
    train[1].write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigError) as err:
        driver.plan_run(cfg)
    assert str(err.value).startswith(f"data.path: {train[1]}:") and "Parquet" in str(err.value)
    train[1].write_bytes(next((tmp_path / "d" / "val").glob("*.parquet")).read_bytes())  # 8 rows where 10 were
    with pytest.raises(ConfigError) as err:
        driver.plan_run(cfg)
    message = str(err.value)  # the split, the count found and the count listed
    assert message.startswith(f"data.path: {tmp_path / 'd' / 'train'}:") and "38 images" in message and "40" in message


@pytest.mark.parametrize("damage", ["not json", "a field missing", "a count that is text"])
def test_a_damaged_manifest_is_named_before_training(damage, tmp_path):
    """A manifest that is not JSON, or lacks or mistypes a field, fails the pre-launch check
    naming the file and the field, not as a KeyError somewhere later."""
    from pairsim.config import load_config
    from pairsim.data import synth
    from pairsim.train import driver

    synth.generate(tmp_path / "d", num_train=12, num_val=4, num_test=0, progress=False)
    path = tmp_path / "d" / shards.MANIFEST
    manifest = json.loads(path.read_text())
    if damage == "not json":
        path.write_text(path.read_text()[:40])
        field = "not JSON"
    elif damage == "a field missing":
        del manifest["splits"]["train"]["images"]
        path.write_text(json.dumps(manifest))
        field = "splits.train.images"
    else:
        manifest["splits"]["val"]["shards"] = "one"
        path.write_text(json.dumps(manifest))
        field = "splits.val.shards"
    cfg = load_config(None, [f"data.path={tmp_path / 'd'}", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError) as err:
        driver.plan_run(cfg)
    assert str(err.value).startswith(f"data.path: {path}:") and field in str(err.value)  # the file, the field
