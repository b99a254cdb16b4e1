"""The shard builder: a source (:mod:`pairsim.data.sources`) into the dataset format of
:mod:`pairsim.data.shards` (``pairsim shards build``).

The build runs one Ray Data task per shard (so it scales out on a cluster): read the images,
clean them (:func:`clean_image`), write the shard atomically, then its marker
(``DIR/.build/<split>/part-00000.json``). Shards are planned on the driver from the source
listing alone, so the output is the same whatever the order tasks finish in, and a re-run skips
every shard whose marker matches its plan and whose file still has the SHA-256 the marker
recorded (any other is rebuilt).
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict
from tqdm import tqdm

from pairsim import locks, outputs, untrusted
from pairsim.config import ConfigError
from pairsim.data import sources
from pairsim.data.build_config import BuildConfig
from pairsim.data.images import to_rgb
from pairsim.data.shards import (MANIFEST, MAX_MANIFEST_BYTES, REJECTS, SCHEMA_VERSION, Count, Manifest, read_manifest,
                                 read_rejects, reject_summary, shard_name, write_manifest, write_shard)
from pairsim.log import get_logger
from pairsim.registry import DATA_FORMATS
from pairsim.storage import Location, NotARegularFile

logger = get_logger("shards")


class RejectedImage(ValueError):
    """An image the build cannot store; ``reason`` is the short category in rejects.jsonl."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


UNREADABLE = ((FileNotFoundError, "missing file"), (NotARegularFile, "not a regular file"),
              (sources.ImageTooLarge, "file too large"), (OSError, "unreadable file"))  # the first that matches


def read_source_image(image: sources.ImageRef) -> bytes:
    """The image's bytes (:meth:`~pairsim.data.sources.ImageRef.read`: a regular file, bounded);
    :class:`RejectedImage` with the reason of :data:`UNREADABLE` when they cannot be read."""
    try:
        return image.read()
    except OSError as exc:
        reason = next(reason for kind, reason in UNREADABLE if isinstance(exc, kind))
        raise RejectedImage(reason, f"{image.path}: {exc.strerror or exc}") from None


def clean_image(raw: bytes, max_side: int, jpeg_quality: int) -> tuple[bytes, int, int]:
    """Encoded bytes → (JPEG/PNG bytes, width, height) of an RGB image with EXIF orientation
    applied and no side longer than ``max_side``. Bytes that need none of this are kept as
    they are; others are re-encoded (JPEG for lossy sources, PNG otherwise).

    Raises :class:`RejectedImage` for empty, corrupt, truncated or oversized data.
    """
    if not raw:
        raise RejectedImage("empty file")
    try:
        with Image.open(io.BytesIO(raw)) as opened:
            source_format, source_mode = opened.format, opened.mode
            opened.load()  # decodes everything: truncation shows here
            image = ImageOps.exif_transpose(opened)
            rotated = image.size != opened.size or opened.getexif().get(0x0112, 1) != 1
            image = to_rgb(image)
    except Image.DecompressionBombError as exc:
        raise RejectedImage("image too large", str(exc)) from None
    except UnidentifiedImageError:
        raise RejectedImage("corrupt image", "not a known image format") from None
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError… for bad data
        reason = "truncated image" if "truncated" in str(exc).lower() else "corrupt image"
        raise RejectedImage(reason, f"{type(exc).__name__}: {exc}") from None
    resized = max(image.size) > max_side
    if resized:
        image.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    if source_format in ("JPEG", "PNG") and source_mode == "RGB" and not (rotated or resized):
        return raw, image.width, image.height
    out = io.BytesIO()
    if source_format in ("JPEG", "WEBP", "MPO"):
        image.save(out, format="JPEG", quality=jpeg_quality)
    else:
        image.save(out, format="PNG")
    return out.getvalue(), image.width, image.height


# --------------------------------------------------------------------------- the build

class BuildError(RuntimeError):
    """A build that started and cannot complete: too many rejects, or shards that did not."""


BUILD_LOCK = "pairsim-build.lock"  # in the output while a build writes it (pairsim.locks)
MARKERS = ".build"
STARTED = f"{MARKERS}/build.json"  # written before any shard: the output is a build's, killed or not
MAX_MARKER_BYTES = 64 * 2**20  # a shard's rejects included
DATASET = outputs.Marker(MANIFEST, Manifest, MAX_MANIFEST_BYTES)  # a dataset: a split is added beside the others
BUILD_STARTED = outputs.Marker(STARTED, BuildConfig, MAX_MARKER_BYTES)  # a build killed before its manifest


class ShardMarker(BaseModel):
    """A shard's completion marker (``DIR/.build/<split>/part-00000.json``): the fingerprint of
    the plan it was built from, its counts and rejects, and its file's size and SHA-256."""

    model_config = ConfigDict(frozen=True)
    fingerprint: str
    images: Count
    captions: Count
    rejects: list[dict[str, str]]
    bytes: Count
    sha256: str


def plan_shards(records: list[sources.Record], cfg: BuildConfig) -> list[dict[str, Any]]:
    """Group each split's records, in input order, into shards of ``rows_per_shard`` images or
    about ``shard_mb`` MB of source image bytes. Each plan carries a fingerprint of its records
    and the options that shape its bytes, which its completion marker must match."""
    by_split: dict[str, list[sources.Record]] = collections.defaultdict(list)
    for record in records:
        by_split[record.split].append(record)
    options = {"schema_version": SCHEMA_VERSION, "max_side": cfg.max_side, "jpeg_quality": cfg.jpeg_quality}
    plans = []
    for split in sorted(by_split):
        groups: list[list[sources.Record]] = [[]]
        size = 0
        for record in by_split[split]:
            full = (len(groups[-1]) >= cfg.rows_per_shard if cfg.rows_per_shard
                    else size >= cfg.shard_mb * 2**20)
            if full and groups[-1]:
                groups.append([])
                size = 0
            groups[-1].append(record)
            size += max(record.image.size, 0)
        for index, group in enumerate(groups):
            body = json.dumps({"records": [asdict(r) for r in group], "options": options}, sort_keys=True)
            plans.append({"split": split, "index": index, "plan": body,
                          "fingerprint": hashlib.sha256(body.encode()).hexdigest()})
    return plans


def _marker_path(out: Location, split: str, index: int) -> Location:
    return out / MARKERS / split / shard_name(index).replace(".parquet", ".json")


def _read_marker(out: Location, plan: dict[str, Any], check_shard: bool = True) -> ShardMarker | None:
    """The shard's marker if it was built from this very plan and (``check_shard``) its file
    still has the SHA-256 the marker recorded; None otherwise: the shard is to be built. A
    garbled marker, or a shard altered or gone since its marker, is warned about."""
    path = _marker_path(out, plan["split"], plan["index"])
    if not path.is_file():
        return None
    try:
        marker = untrusted.read_model(path, ShardMarker, MAX_MARKER_BYTES)
        if marker.fingerprint != plan["fingerprint"]:
            return None
        if check_shard:
            untrusted.verify_digest(out / plan["split"] / shard_name(plan["index"]), marker.sha256)
    except untrusted.UntrustedFileError as exc:
        logger.warning("%s; rebuilding the shard", exc)
        return None
    return marker


class BuildShard:
    """Ray Data task: read, clean and write one planned shard, then its marker."""

    def __init__(self, out: Location, max_side: int, jpeg_quality: int):
        self.out, self.max_side, self.jpeg_quality = out, max_side, jpeg_quality

    def __call__(self, plan: dict[str, Any]) -> dict[str, Any]:
        body = json.loads(plan["plan"])
        rows, rejects = [], []
        for r in body["records"]:
            record = sources.Record(**{**r, "image": sources.ImageRef(**r["image"])})
            try:
                image, width, height = clean_image(read_source_image(record.image), self.max_side, self.jpeg_quality)
            except RejectedImage as exc:
                rejects.append(sources.Reject("image", record.source, exc.reason, exc.detail, record.image_id).to_json())
                continue
            rows.append({"image": image, "image_id": record.image_id, "captions": record.captions, "label": -1,
                         "label_name": None, "width": width, "height": height, "source": record.source})
        size, sha256 = write_shard(rows, self.out / plan["split"] / shard_name(plan["index"]))
        marker = ShardMarker(fingerprint=plan["fingerprint"], images=len(rows),
                             captions=sum(len(r["captions"]) for r in rows), rejects=rejects, bytes=size, sha256=sha256)
        _marker_path(self.out, plan["split"], plan["index"]).write_text(marker.model_dump_json())
        return {"split": plan["split"], "index": plan["index"], "images": len(rows), "rejected": len(rejects)}


def _remove_leftovers(out: Location, plans: list[dict[str, Any]], splits: list[str]) -> None:
    """Temporary files of killed tasks, and shards of ``splits`` an earlier, larger build of
    them left behind; other splits' files are not touched."""
    planned = {(p["split"], shard_name(p["index"])) for p in plans}
    for path in [*out.files(".tmp"), *(out / MARKERS).files(".tmp")] + [
            p for split in splits for p in (*(out / split).files(".tmp"), *(out / MARKERS / split).files(".tmp"))]:
        path.delete()
    for split in splits:
        for path in (out / split).files(".parquet"):
            if (split, path.name) not in planned and path.name.startswith("part-"):
                path.delete()
                _marker_path(out, split, int(path.name.removesuffix(".parquet").split("-")[1])).delete()


def hold_out(records: list[sources.Record], share: float, seed: int, split: str = "val") -> list[sources.Record]:
    """Move a seeded ``share`` of the images, with all their captions, to ``split``: an image
    goes when SHA-256(seed:image id) falls in the lowest ``share`` of the range, so the choice
    is the same in any input order and on any re-run."""
    def drawn(image_id: str) -> bool:
        return int.from_bytes(hashlib.sha256(f"{seed}:{image_id}".encode()).digest()[:8]) < share * 2**64

    return [replace(r, split=split) if drawn(r.image_id) else r for r in records]


def _other_splits(out: Location, built: list[str]) -> dict[str, dict[str, Any]]:
    """The splits of an existing dataset at ``out`` that this build leaves alone. The manifest
    is rewritten to list only them while the build runs (removed when there are none), so an
    interrupted build never leaves a manifest naming half-built shards."""
    try:
        manifest = read_manifest(out)
    except FileNotFoundError:
        return {}
    if manifest.schema_version != SCHEMA_VERSION:
        raise outputs.OutputRefused(f"--out {out}: its manifest has schema version {manifest.schema_version}, "
                                    f"this pairsim writes {SCHEMA_VERSION}; build into a new directory")
    others = {name: counts.model_dump() for name, counts in manifest.splits.items() if name not in built}
    if others:
        write_manifest(out, manifest.source, others)
    else:
        (out / MANIFEST).delete()
    return others


def _write_rejects(out: Location, rejects: list[dict[str, str]], built: list[str]) -> int:
    """``rejects.jsonl``: this build's rejects, each with its split, after the earlier builds'
    rejects of the other splits; returns its number of lines."""
    kept = [old for old in (read_rejects(out) if (out / REJECTS).is_file() else [])
            if old.get("split") and not set(old["split"].split(",")) & set(built)]
    lines = [json.dumps(reject, ensure_ascii=False, sort_keys=True) for reject in kept + rejects]
    (out / REJECTS).write_text("".join(line + "\n" for line in lines))
    return len(lines)


def build(cfg: BuildConfig, progress: bool = True) -> Manifest:
    """Build the splits of ``cfg.input`` into ``cfg.out``; returns the manifest.

    Other splits already in ``cfg.out`` (built earlier from another source, e.g. a val CSV
    after a train CSV) are kept as they are, files, manifest entries and rejects alike.
    ``cfg.val_share`` holds out a seeded share of the images as split ``val``. Raises
    :class:`BuildError` when more than ``max_reject_share`` of the images (or captions) is
    rejected — after writing ``rejects.jsonl``, and without listing the built splits in the
    manifest, so they cannot be trained on by mistake.

    ``cfg.out`` is a new or empty directory, a pairsim dataset (a split is added beside the
    others) or a build's killed before its manifest (resumed from its markers); anything else is
    refused before any work (:class:`pairsim.outputs.OutputRefused`), as is an input that gives
    nothing to build (:class:`pairsim.data.sources.SourceError`). The build holds ``cfg.out``
    while it writes (:data:`BUILD_LOCK`): a second build into it is refused
    (:class:`pairsim.locks.NameInUse`).
    """
    out = outputs.claim_directory(cfg.out, "--out", owned_by=(DATASET, BUILD_STARTED), ignored=(REJECTS, BUILD_LOCK))
    with locks.hold(out / BUILD_LOCK, f"--out {cfg.out}"):
        return _build(cfg, out, progress)


def _build(cfg: BuildConfig, out: Location, progress: bool) -> Manifest:
    import ray

    from pairsim import cluster

    options = {keyword: getattr(cfg, name) for name, keyword in DATA_FORMATS[cfg.format].options.items()}
    listing = sources.list_source(cfg.format, cfg.input, cfg.images_root, cfg.split, **options)
    if not listing.records:
        raise sources.SourceError(f"{cfg.input}: no usable image-caption records "
                                  f"({reject_summary([r.to_json() for r in listing.rejects]) or 'the input is empty'})")
    records = []
    for record in listing.records:  # a split name becomes a directory: it must stay one, inside the output
        if untrusted.is_plain_name(record.split):
            records.append(record)
        else:
            listing.rejects.append(sources.Reject("record", record.source, "bad split name",
                                                  f"{record.split!r} is not a plain directory name", record.image_id))
    if not records:
        raise sources.SourceError(f"{cfg.input}: no record with a usable split name "
                                  f"({reject_summary([r.to_json() for r in listing.rejects])})")
    if cfg.val_share:
        listed = sorted({r.split for r in records})
        if listed != [cfg.split] or cfg.split == "val":
            raise ConfigError(f"--val-share: {cfg.input} already gives the splits {', '.join(listed)}; a share is "
                              "held out of a source that gives one split, not val")
        records = hold_out(records, cfg.val_share, cfg.val_seed)
        if not any(r.split == "val" for r in records) or all(r.split == "val" for r in records):
            raise ConfigError(f"--val-share {cfg.val_share}: of {len(records)} images none would stay in "
                              f"{'val' if all(r.split == 'val' for r in records) else cfg.split}; change the share")
    built = sorted({r.split for r in records})
    (out / STARTED).write_text(cfg.model_dump_json(exclude_defaults=True) + "\n")  # as BUILD_STARTED reads it
    others = _other_splits(out, built)
    plans = plan_shards(records, cfg)
    _remove_leftovers(out, plans, built)
    reused = {i: marker for i, plan in enumerate(plans) if (marker := _read_marker(out, plan))}
    pending = [plan for i, plan in enumerate(plans) if i not in reused]

    bar = tqdm(total=len(plans), initial=len(plans) - len(pending), desc=f"shards {out.name}", unit="shard",
               disable=not progress)
    if pending:
        cluster.connect()  # a job's cluster, the one the CLI joined, or a local instance
        ray.data.DataContext.get_current().enable_progress_bars = False
        tasks = ray.data.from_items(pending, override_num_blocks=len(pending)).map(
            BuildShard(out, cfg.max_side, cfg.jpeg_quality), num_cpus=1)
        for row in tasks.iter_rows():
            bar.update()
            bar.set_postfix_str(f"{row['split']} part {row['index']}: {row['images']} images, "
                                f"{row['rejected']} rejected")
    bar.close()

    markers = [(plan, reused.get(i) or _read_marker(out, plan, check_shard=False)) for i, plan in enumerate(plans)]
    incomplete = [shard_name(p["index"]) for p, m in markers if m is None]
    if incomplete:
        raise BuildError(f"{len(incomplete)} shards did not complete (e.g. {incomplete[0]}); re-run to resume")
    split_of = {r.image_id: r.split for r in records}
    unknown = cfg.split if cfg.format != "karpathy" else ",".join(built)  # a record too broken to have a split
    rejects = [r.to_json() | {"split": split_of.get(r.image_id, unknown)} for r in listing.rejects] + [
        r | {"split": p["split"]} for p, m in markers for r in m.rejects]
    rejected = _write_rejects(out, rejects, built)

    splits: dict[str, dict[str, Any]] = {}
    for plan, marker in markers:
        counts = splits.setdefault(plan["split"], {"images": 0, "captions": 0, "shards": 0})
        counts["images"] += marker.images
        counts["captions"] += marker.captions
        counts["shards"] += 1
    kept_images = sum(c["images"] for c in splits.values())
    kept_captions = sum(c["captions"] for c in splits.values())
    bad_images = sum(r["kind"] != "caption" for r in rejects)
    bad_captions = len(rejects) - bad_images
    shares = {"images": bad_images / max(kept_images + bad_images, 1),
              "captions": bad_captions / max(kept_captions + bad_captions, 1)}
    worst = max(shares, key=shares.get)
    if shares[worst] > cfg.max_reject_share:
        raise BuildError(
            f"{shares[worst]:.1%} of the {worst} were rejected (limit max_reject_share={cfg.max_reject_share:.0%}); "
            f"mostly {reject_summary(rejects)}. Every reject is listed with its source in {out / REJECTS}")
    source = f"{cfg.format}:{Path(cfg.input).name}"
    build_options = cfg.model_dump(mode="json", exclude={"out"})
    for name, counts in splits.items():
        counts |= {"source": source, "build": build_options,  # captions_recoded: of the source
                   "rejected": sum(name in r["split"].split(",") for r in rejects),
                   "captions_recoded": listing.captions_recoded,
                   "duplicate_image_ids": sum(r.get("reason") == "duplicate image id" and r["split"] == name
                                              for r in rejects)}
    return write_manifest(out, source, others | splits, rejected=rejected,
                          digests={f"{p['split']}/{shard_name(p['index'])}": m.sha256 for p, m in markers})
