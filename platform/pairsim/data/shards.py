"""The on-disk dataset format — Parquet shards per split plus ``manifest.json`` — read,
verified and inspected here; :mod:`pairsim.data.builder` makes it from a source.

Layout::

    DIR/manifest.json
    DIR/rejects.jsonl                          one line per rejected image, caption or record
    DIR/<split>/part-00000.parquet, part-00001.parquet, ...
    DIR/.build/<split>/part-00000.json          per-shard completion marker (resumable builds)

One row per image: ``image`` (encoded PNG/JPEG bytes, stored once), ``image_id``,
``captions`` (list<string>), ``label`` (int, -1 when unknown), ``label_name``, ``width``,
``height``, ``source``.

``DIR`` is a local directory or an object-store URI (:mod:`pairsim.storage`): every file is
read and written through its ``pyarrow.fs`` filesystem.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont, ImageOps
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from pairsim import outputs, untrusted
from pairsim.config import DataConfig
from pairsim.data.images import decode_image
from pairsim.errors import shown
from pairsim.storage import Location, LocationLike

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 2**20  # half a million shards' SHA-256s fit; a larger file is not one pairsim wrote
REJECTS = "rejects.jsonl"
MAX_REJECTS_BYTES = 1 << 30  # a line per rejected image or caption: millions of lines fit
MAX_COUNT = 10**12  # images, captions, shards, rejects or a shard's bytes: LAION-5B has 5.9·10^9 pairs
PARQUET_TAIL = 8  # a Parquet file ends in its footer's length (4 bytes, little-endian) and b"PAR1"

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]  # a count read back from a manifest or a build marker

SHARD_SCHEMA = pa.schema(
    [
        ("image", pa.binary()),
        ("image_id", pa.string()),
        ("captions", pa.list_(pa.string())),
        ("label", pa.int32()),
        ("label_name", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("source", pa.string()),
    ]
)


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def write_shard(rows: list[dict[str, Any]], path: Location) -> tuple[int, str]:
    """Write one shard atomically (:meth:`Location.write_bytes`); return its size and SHA-256."""
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=SHARD_SCHEMA), buffer, compression="zstd", row_group_size=512)
    data = buffer.getvalue().to_pybytes()
    return path.write_bytes(data), hashlib.sha256(data).hexdigest()


def write_split(rows: Iterable[dict[str, Any]], split_dir: LocationLike,
                rows_per_shard: int) -> dict[str, int]:
    """Write rows as numbered shards of at most ``rows_per_shard`` rows; return the split's counts."""
    split_dir = Location.of(split_dir)
    counts = {"images": 0, "captions": 0, "shards": 0}
    buffer: list[dict[str, Any]] = []

    def flush() -> None:
        write_shard(buffer, split_dir / shard_name(counts["shards"]))
        counts["shards"] += 1
        buffer.clear()

    for row in rows:
        buffer.append(row)
        counts["images"] += 1
        counts["captions"] += len(row["captions"])
        if len(buffer) == rows_per_shard:
            flush()
    if buffer:
        flush()
    return counts


def shard_digests(root: LocationLike, split: str, digests: dict[str, str] | None = None) -> dict[str, str]:
    """Each shard of a split (its file name) → its SHA-256, in sorted order (``digests``:
    ``split/file`` → digest already known, e.g. from the build's shard markers)."""
    digests = digests or {}
    return {path.name: digests.get(f"{split}/{path.name}") or untrusted.sha256(path)
            for path in split_dir(root, split).files(".parquet")}


def split_content_hash(split: str, shards: dict[str, str]) -> str:
    """SHA-256 over a split's shards' file names and SHA-256s (:func:`shard_digests`), in sorted order."""
    digest = hashlib.sha256()
    for name in sorted(shards):
        digest.update(f"{split}/{name}".encode())
        digest.update(shards[name].encode())
    return digest.hexdigest()


def content_hash(split_hashes: dict[str, str]) -> str:
    """The dataset's hash: SHA-256 over each split's name and content hash, in sorted order."""
    digest = hashlib.sha256()
    for split in sorted(split_hashes):
        digest.update(f"{split}:{split_hashes[split]}".encode())
    return digest.hexdigest()


def footer_sha256(stream: BinaryIO, size: int) -> str:
    """The SHA-256 of a Parquet file's footer — its schema and each row group's column offsets,
    sizes and statistics — with the :data:`PARQUET_TAIL` after it, read from the end of
    ``stream`` (``size`` bytes long): what tells one shard from another, even of as many rows
    and bytes, without reading its data. ValueError when the file ends in no Parquet footer."""
    if size < 2 * PARQUET_TAIL:
        raise ValueError(f"{size} bytes, too short for Parquet")
    stream.seek(size - PARQUET_TAIL)
    tail = stream.read(PARQUET_TAIL)
    length = int.from_bytes(tail[:4], "little")
    if tail[4:] != b"PAR1" or length > size - 2 * PARQUET_TAIL:
        raise ValueError("it does not end in a Parquet footer")
    stream.seek(size - PARQUET_TAIL - length)
    return hashlib.sha256(stream.read(length) + tail).hexdigest()


def read_footer(shard: Location) -> tuple[int, str]:
    """A shard's rows and :func:`footer_sha256`, its footer alone read; :class:`ShardError` naming
    it when it is no Parquet file (:func:`pairsim.untrusted.parsing`)."""
    with untrusted.parsing(shard, "a Parquet shard", ShardError), shard.fs.open_input_file(shard.path) as f:
        return pq.read_metadata(f).num_rows, footer_sha256(f, f.size())


class ShardError(OSError):
    """A shard or manifest that is not what it should be: unreadable, or holding other rows."""


class ManifestError(ShardError, untrusted.UntrustedFileError):
    """A ``manifest.json`` that is not one pairsim wrote: unreadable, too large, not JSON, a field
    missing or mistyped, or a split or shard name that would lead outside the dataset. Bad input
    (an :class:`~pairsim.errors.InputError`), and a :class:`ShardError` for callers that catch those."""


def _plain_name(name: str) -> str:
    if not untrusted.is_plain_name(name):
        raise ValueError("not a plain file or directory name; it could lead outside the dataset")
    return name


PlainName = Annotated[str, AfterValidator(_plain_name)]  # a split's directory, a shard's file: under the root


def split_dir(root: LocationLike, split: str) -> Location:
    """``root/split``, refused (:class:`ManifestError`) unless ``split`` is one plain name."""
    return untrusted.child(root, split, f"{root}: split", ManifestError)


class SplitInfo(BaseModel):
    """One split in ``manifest.json``: its counts, content hash, each shard's SHA-256 and its
    footer's (:func:`footer_sha256`; either none in a manifest written before pairsim recorded
    them). What a builder adds (``captions_recoded``, ``duplicate_image_ids``, its ``build``
    options) rides along as extra fields."""

    model_config = ConfigDict(frozen=True, extra="allow")
    images: Count
    captions: Count
    shards: Count
    content_hash: str
    shard_sha256: dict[PlainName, str] = {}
    shard_footer_sha256: dict[PlainName, str] = {}
    rejected: Count = 0
    source: str = ""


class Manifest(BaseModel):
    """A dataset's ``manifest.json``, typed: ``manifest.split("val").images``. A generator's
    settings (``generator``) ride along as an extra field."""

    model_config = ConfigDict(frozen=True, extra="allow")
    schema_version: int = Field(ge=1, le=SCHEMA_VERSION, description="a newer pairsim's format is refused, not guessed at")
    source: str
    splits: dict[PlainName, SplitInfo]
    rejected: Count
    content_hash: str

    def split(self, name: str) -> SplitInfo:
        """The split ``name``; FileNotFoundError naming the splits there are."""
        if name not in self.splits:
            raise FileNotFoundError(f"split {name!r} not in the manifest (it has {', '.join(sorted(self.splits))})")
        return self.splits[name]

    def hash_problems(self) -> list[str]:
        """The content hashes here that are not what the manifest's own records give, each as
        ``field: why``: a split's against its shards' SHA-256s (:func:`split_content_hash`; a
        split that lists none is not checked) and the dataset's against its splits'
        (:func:`content_hash`). Only the shards' bytes tell whether the records are true
        (:func:`verify_dataset`)."""
        problems = [f"splits.{name}.content_hash: not the hash of its shard_sha256"
                    for name, info in sorted(self.splits.items())
                    if info.shard_sha256 and split_content_hash(name, info.shard_sha256) != info.content_hash]
        if content_hash({name: info.content_hash for name, info in self.splits.items()}) != self.content_hash:
            problems.append("content_hash: not the hash of its splits' content_hash")
        return problems


def write_manifest(root: LocationLike, source: str, splits: dict[str, dict[str, Any]],
                   rejected: int | None = None, digests: dict[str, str] | None = None, **extra: Any) -> Manifest:
    """``manifest.json`` over ``splits`` (name → images, captions, shards, and optionally
    content_hash, rejected, source, build); a split's missing content hash is computed from
    its files; ``rejected`` (default: the splits' sum) is the lines of ``rejects.jsonl``.
    Written atomically: a reader sees the old manifest or the new one."""
    root = Location.of(root)
    splits = {name: {"rejected": 0, "source": source} | counts for name, counts in splits.items()}
    for name, counts in splits.items():
        if not counts.get("content_hash"):  # a split written now (one carried over from a previous build keeps its own)
            counts["shard_sha256"] = shard_digests(root, name, digests)
            counts["shard_footer_sha256"] = {shard.name: read_footer(shard)[1]
                                             for shard in split_dir(root, name).files(".parquet")}
            counts["content_hash"] = split_content_hash(name, counts["shard_sha256"])
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "source": ", ".join(sorted({c["source"] for c in splits.values()})) or source,
        "splits": splits,
        "rejected": sum(c["rejected"] for c in splits.values()) if rejected is None else rejected,
        "content_hash": content_hash({name: counts["content_hash"] for name, counts in splits.items()}),
        **extra,
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return Manifest.model_validate(manifest)


def read_manifest(root: LocationLike, check_hashes: bool = True) -> Manifest:
    """``root``'s manifest, read as untrusted input (:mod:`pairsim.untrusted`: at most
    :data:`MAX_MANIFEST_BYTES`, every split and shard a plain name, every count at most
    :data:`MAX_COUNT`) and, with ``check_hashes``, its content hashes those its records give
    (:meth:`Manifest.hash_problems`: a hash edited or zeroed is not trained on, nor logged as the
    dataset's digest); FileNotFoundError when there is none, :class:`ManifestError` naming the
    file and the field when it is not one. ``shards verify`` reads it without ``check_hashes``:
    it checks the hashes against the shards themselves, and names each that differs."""
    path = Location.of(root) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"no dataset at {root}: {path} is missing (make one with `pairsim shards build … --out {root}`, "
            f"or the shapes data with `pairsim data synth --out {root}`)"
        )
    tree = untrusted.read_json(path, MAX_MANIFEST_BYTES, ManifestError)
    try:
        manifest = Manifest.model_validate(tree)
    except ValidationError as exc:
        problems = (f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in exc.errors())
        raise ManifestError(f"{path}: not a pairsim manifest ({'; '.join(problems)}); rebuild the dataset") from None
    if check_hashes and (problems := manifest.hash_problems()):
        raise ManifestError(f"{path}: {'; '.join(problems)} (edited by hand?); `pairsim shards verify {root}` checks "
                            f"them against the shards; rebuild the dataset")
    return manifest


@dataclass(frozen=True)
class RunData:
    """The datasets one run reads, each manifest read once (before Ray starts) and handed down:
    ``data.path``'s and, when it is set, ``data.val_path``'s (the evaluated splits')."""

    config: DataConfig
    manifests: dict[str, Manifest]  # by dataset directory, as configured

    @classmethod
    def read(cls, config: DataConfig) -> RunData:
        roots = dict.fromkeys(str(config.split_path(s)) for s in (config.train_split, config.val_split))
        return cls(config, {root: read_manifest(root) for root in roots})

    def manifest(self, split: str) -> Manifest:
        """The manifest of the dataset directory that holds ``split``."""
        return self.manifests[str(self.config.split_path(split))]

    def has(self, split: str | None) -> bool:
        return split is not None and split in self.manifest(split).splits

    def split(self, split: str) -> SplitInfo:
        return self.manifest(split).split(split)


def split_shards(root: LocationLike, split: str, manifest: Manifest | None = None) -> list[Location]:
    """The shard files of one split, checked against its ``manifest`` (read from ``root`` when
    not given): FileNotFoundError for a split it does not list, :class:`ShardError` when the
    split's directory holds another number of shards than it lists."""
    root = Location.of(root)
    manifest = manifest or read_manifest(root)
    if split not in manifest.splits:
        raise FileNotFoundError(f"{root}: split {split!r} not in manifest (has {sorted(manifest.splits)})")
    files = split_dir(root, split).files(".parquet")
    if len(files) != manifest.splits[split].shards:
        raise ShardError(f"{root}/{split}: manifest lists {manifest.splits[split].shards} shards, "
                         f"found {len(files)}")
    return files


def verify_split(root: LocationLike, split: str, manifest: Manifest, footers: bool = False) -> int:
    """Read every shard's Parquet footer (:func:`read_footer`) and check that together they hold
    the images the ``manifest`` (``root``'s) lists: a truncated or foreign shard is named here,
    before training, not 55 s into it inside a worker. With ``footers`` (``shards inspect``),
    also that each footer is the one the manifest records, where it records them: a shard
    swapped for another valid one, of as many rows and bytes, is named without reading its
    data. A run leaves that to the SHA-256 checks of its reads, which ``data.shard_checks``
    governs. Returns the split's images."""
    files = split_shards(root, split, manifest)  # names the dataset when the split is not in it
    info = manifest.split(split)
    found = [(shard, *read_footer(shard)) for shard in files]
    rows = sum(shard_rows for _, shard_rows, _ in found)
    if rows != info.images:
        raise ShardError(f"{Location.of(root)}/{split}: the shards hold {rows} images, the manifest lists "
                         f"{info.images}; rebuild the {split} split")
    recorded = info.shard_footer_sha256 if footers else {}
    swapped = [shard for shard, _, footer in found if recorded and recorded.get(shard.name) != footer]
    if swapped:
        more = f", as are {len(swapped) - 1} more of the split's" if len(swapped) > 1 else ""
        raise ShardError(f"{swapped[0]}: its Parquet footer is not the one the manifest records{more} (swapped for "
                         f"another shard or rewritten); rebuild the {split} split")
    return rows


def verify_dataset(root: LocationLike) -> dict[str, list[str]]:
    """Every split of ``root``'s dataset read in full (``pairsim shards verify``): its shards as
    the manifest lists them (:func:`verify_split`), each shard's SHA-256 against the manifest's
    (named when it differs; a manifest without them is checked by the split's content hash),
    and the manifest's content hashes against its records (:meth:`Manifest.hash_problems`,
    under ``dataset``). The problems by split, [] for one that verifies."""
    root = Location.of(root)
    manifest = read_manifest(root, check_hashes=False)
    found: dict[str, list[str]] = {}
    for split, info in sorted(manifest.splits.items()):
        try:
            verify_split(root, split, manifest)
        except (ShardError, FileNotFoundError) as exc:
            found[split] = [str(exc)]
            continue
        digests = shard_digests(root, split)
        problems = [f"{root}/{split}/{name}: content differs from its SHA-256 in the manifest (altered or replaced)"
                    for name, expected in sorted(info.shard_sha256.items()) if digests.get(name) != expected]
        problems += [f"{root}/{split}/{name}: not in the manifest" for name in sorted(set(digests) - set(info.shard_sha256))
                     if info.shard_sha256]
        if not problems and split_content_hash(split, digests) != info.content_hash:
            problems.append(f"{root}/{split}: its shards differ from the manifest's content hash (altered, replaced "
                            f"or renamed{'' if info.shard_sha256 else '; this manifest lists no per-shard SHA-256'})")
        found[split] = [f"{p}; rebuild the {split} split" for p in problems]
    if problems := manifest.hash_problems():
        found["dataset"] = [f"{root / MANIFEST}: {problem} (edited by hand?)" for problem in problems]
    return found


def split_files(root: LocationLike, split: str) -> list[str]:
    """:func:`split_shards` as local paths or URIs, for readers that open them themselves."""
    return [str(shard) for shard in split_shards(root, split)]


def read_table(files: list[Location], **options: Any) -> pa.Table:
    """Shards read with ``pyarrow.parquet.read_table`` through their filesystem, one by one: a
    shard whose bytes do not parse is a :class:`ShardError` naming it
    (:func:`pairsim.untrusted.parsing`), not pyarrow's traceback."""
    tables = []
    for shard in files:
        with untrusted.parsing(shard, "a Parquet shard", ShardError):
            tables.append(pq.read_table(shard.path, filesystem=shard.fs, **options))
    return pa.concat_tables(tables)


def label_and_caption_counts(root: LocationLike, split: str,
                             manifest: Manifest | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each image's class label and number of captions in one split (two small columns read),
    its shards checked against ``manifest`` (read from ``root`` when not given)."""
    table = read_table(split_shards(root, split, manifest), columns=["label", "captions"])
    return (table.column("label").to_numpy(zero_copy_only=False),
            pc.list_value_length(table.column("captions")).fill_null(0).to_numpy(zero_copy_only=False))


def read_rejects(root: LocationLike) -> list[dict[str, str]]:
    """``rejects.jsonl``'s lines (read back untrusted: each a JSON object of strings)."""
    return untrusted.read_json_lines(Location.of(root) / REJECTS, dict[str, str], MAX_REJECTS_BYTES)


def reject_summary(rejects: list[dict[str, str]], top: int = 5) -> str:
    """The ``top`` most common (kind, reason) of ``rejects`` (rejects.jsonl's lines), counted,
    each as :func:`pairsim.errors.shown` shows text read from a file."""
    counts = collections.Counter((r["kind"], r["reason"]) for r in rejects)
    return ", ".join(f"{n} × {shown(kind, 40)}: {shown(reason, 80)}" for (kind, reason), n in counts.most_common(top))


# --------------------------------------------------------------------------- inspect

def sample_rows(root: LocationLike, split: str, n: int) -> list[dict[str, Any]]:
    """``n`` rows spread evenly over the split's first shard."""
    table = read_table(split_shards(root, split)[:1])
    step = max(table.num_rows // max(n, 1), 1)
    return table.take(list(range(0, table.num_rows, step))[:n]).to_pylist()


def read_rows(root: LocationLike, split: str, image_ids: list[str],
              columns: tuple[str, ...] = ("image_id", "image", "captions")) -> dict[str, dict[str, Any]]:
    """The rows of ``image_ids`` in a split (Parquet's row-group statistics skip the rest)."""
    table = read_table(split_shards(root, split), columns=list(columns),
                       filters=[("image_id", "in", [str(i) for i in image_ids])])
    return {row["image_id"]: row for row in table.to_pylist()}


def contact_sheet(rows: list[dict[str, Any]], path: Path, columns: int = 4, tile: int = 192,
                  caption_lines: int = 4) -> Path:
    """A PNG grid of the rows' images, each above its id and first captions (shown cut and
    escaped); each image decoded by the one decoder (:func:`pairsim.data.images.decode_image`,
    brought down to the tile as it is decoded), one that does not decode refused naming it."""
    from matplotlib import font_manager  # matplotlib comes with mlflow; its DejaVu Sans covers accents

    font = ImageFont.truetype(font_manager.findfont("DejaVu Sans"), 11)
    line_h, text_h = 15, 15 * (caption_lines + 1)
    grid_rows = -(-len(rows) // columns)
    sheet = Image.new("RGB", (columns * (tile + 8) + 8, grid_rows * (tile + text_h + 12) + 8), "white")
    draw = ImageDraw.Draw(sheet)
    chars = tile // 6
    for i, row in enumerate(rows):
        x = 8 + (i % columns) * (tile + 8)
        y = 8 + (i // columns) * (tile + text_h + 12)
        thumb = ImageOps.contain(decode_image(row["image"], f"--sheet: image {shown(row['image_id'], 80)}", tile),
                                 (tile, tile))
        sheet.paste(thumb, (x + (tile - thumb.width) // 2, y + (tile - thumb.height) // 2))
        lines = [f"{shown(row['image_id'], chars)}  {row['width']}×{row['height']}"]
        for caption in map(shown, row["captions"] or []):
            lines += [caption[k:k + chars] for k in range(0, len(caption), chars)]
        for k, line in enumerate(lines[:caption_lines + 1]):
            draw.text((x, y + tile + 4 + k * line_h), line, fill="black" if k else "gray", font=font)
    png = io.BytesIO()
    sheet.save(png, format="PNG")
    Location.of(path).write_bytes(png.getvalue())
    return path


def sample_line(row: dict[str, Any], captions: int = 2) -> str:
    """One row as ``inspect`` prints it: id, size, bytes and its first ``captions``, each cut and
    escaped (:func:`pairsim.errors.shown`: a caption or id prints no line, escape or megabyte)."""
    texts = row["captions"] or []
    shown_captions = " | ".join(shown(caption, 100) for caption in texts[:captions])
    return (f"  {shown(row['image_id'], 80)} {row['width']}×{row['height']} {len(row['image'] or b''):,} B  "
            f"{shown_captions}{' …' if len(texts) > captions else ''}")


def inspect(root: LocationLike, samples: int = 4, sheet: Path | None = None, sheet_images: int = 12) -> str:
    """A readable report — counts, schema, sample rows, top reject reasons, everything read from
    the data shown cut and escaped (:func:`pairsim.errors.shown`) — of a dataset whose every
    shard is first checked against its manifest (there, whole, with the rows it lists and the
    footer it records: :func:`verify_split`, footers only, so a dataset of any size is inspected
    in seconds; ``shards verify`` reads every byte), and a contact sheet PNG of the first split
    written to ``sheet`` when given (a new file: :func:`pairsim.outputs.check_file_target`;
    nothing is written into the dataset)."""
    if sheet:
        outputs.check_file_target(sheet, "--sheet")
    root = Location.of(root)
    manifest = read_manifest(root)
    for split in sorted(manifest.splits):
        verify_split(root, split, manifest, footers=True)
    lines = [f"{root}: {shown(manifest.source)} (schema v{manifest.schema_version}), "
             f"content hash {shown(manifest.content_hash[:12])}"]
    for split, c in sorted(manifest.splits.items()):
        lines.append(f"  {split:<8} {c.images:>9,} images {c.captions:>10,} captions {c.shards:>5} shards")
    lines.append(f"  rejected: {manifest.rejected}")
    rejects_file = root / REJECTS
    if manifest.rejected and rejects_file.is_file():
        rejects = read_rejects(root)
        lines.append(f"  mostly {reject_summary(rejects)} (see {rejects_file})")
    first = sorted(manifest.splits)[0]
    schema = read_table(split_shards(root, first)[:1]).schema
    lines += ["", "schema:", *(f"{shown(field.name, 80)}: {shown(field.type, 80)}" for field in schema)]
    lines += ["", f"sample of {first}:"]
    lines += [sample_line(row) for row in sample_rows(root, first, samples)]
    drawn = contact_sheet(sample_rows(root, first, sheet_images), Path(sheet)) if sheet else "--sheet PATH draws one"
    lines += ["", f"contact sheet: {drawn}"]
    return "\n".join(lines)
