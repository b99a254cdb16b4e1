"""Image-caption sources a shard build reads: Karpathy split files, open_clip CSV lists,
img2dataset WebDataset tars and image folders with a JSONL of captions.

Each ``list_*`` function turns its input into a :class:`Listing`: one :class:`Record` per image
(where its bytes are, its captions, the split) in input order, and the :class:`Reject`\\ s found
on the way (bad lines, empty captions, duplicate ids, ids that are no safe name:
:func:`image_id_problem`). Nothing here opens an image; the shard builder
(:mod:`pairsim.data.builder`) does that in Ray Data tasks, through :meth:`ImageRef.read`.

Every file a source names is opened through :meth:`pairsim.storage.Location.open_input`: a
regular file only (a named pipe, a device or a directory is refused unread, without blocking),
each read bounded (:data:`MAX_LIST_BYTES`, :data:`MAX_SOURCE_IMAGE_BYTES`,
:data:`MAX_TEXT_MEMBER_BYTES`, :data:`MAX_SIDECAR_BYTES`).

Each format is a :class:`DataFormat` registered in :data:`pairsim.registry.DATA_FORMATS` under
the name ``--format`` / ``BuildConfig.format`` use; :func:`list_source` dispatches through it.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import tarfile
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import BinaryIO, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from pairsim import untrusted
from pairsim.errors import InputError, shown
from pairsim.registry import DATA_FORMATS
from pairsim.storage import Location

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
MAX_LIST_BYTES = 8 * 2**30  # a CSV, JSONL or Karpathy file: tens of millions of captions (CC12M's CSV is 2.5 GB)
MAX_SOURCE_IMAGE_BYTES = 256 * 2**20  # one image file or tar member: a 100-megapixel photo is ~50 MB as JPEG
MAX_TEXT_MEMBER_BYTES = 2**20  # a tar's caption .txt or img2dataset .json: a few hundred bytes as it writes them
MAX_SIDECAR_BYTES = 2**20  # img2dataset's NNNNN_stats.json: a few kB
MAX_TAR_SAMPLES = 10**6  # samples a sidecar may count in one tar (img2dataset writes 10,000 by default)
MAX_IMAGE_ID_CHARS = 1024  # an image id is a name (a path under the images root, a tar key), not a text


class SourceError(InputError):
    """An input that cannot be read at all or gives nothing to build (as opposed to a bad record,
    which is rejected)."""


class ImageTooLarge(OSError):
    """An image file or tar member of more than :data:`MAX_SOURCE_IMAGE_BYTES`, refused unread."""

    def __init__(self, path: str, size: int):
        super().__init__(errno.EFBIG, f"{size:,} bytes, more than the {MAX_SOURCE_IMAGE_BYTES:,} an image may have",
                         path)


@dataclass(frozen=True)
class ImageRef:
    """Where an image's encoded bytes are: a file, or ``size`` bytes at ``offset`` of a tar."""

    path: str
    offset: int = -1  # -1: the whole file at ``path``
    size: int = -1  # bytes, -1 when unknown (a missing file)

    def read(self) -> bytes:
        """The image's bytes, from a regular file only (:meth:`Location.open_input`: a named pipe,
        a device or a directory raises :class:`~pairsim.storage.NotARegularFile` unread, without
        blocking), at most :data:`MAX_SOURCE_IMAGE_BYTES` (:class:`ImageTooLarge` before any is
        read); other OS errors as they are (FileNotFoundError for a missing file)."""
        stream, file_size = Location.of(Path(self.path)).open_input()
        with stream:
            size = file_size if self.offset < 0 else self.size
            if size > MAX_SOURCE_IMAGE_BYTES:
                raise ImageTooLarge(self.path, size)
            stream.seek(max(self.offset, 0))
            return stream.read(size)


@dataclass
class Record:
    split: str
    image_id: str
    image: ImageRef
    captions: list[str]
    source: str  # file:line, file:images[i] or tar:member — where a person finds it


@dataclass(frozen=True)
class Reject:
    """One rejected image, caption or input record, with where it came from and why."""

    kind: Literal["image", "caption", "record"]
    source: str
    reason: str
    detail: str = ""
    image_id: str = ""

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in self.__dict__.items() if v}


@dataclass
class Listing:
    records: list[Record] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    captions_recoded: int = 0  # captions that were not UTF-8 and were decoded as cp1252 / latin-1


def decode_text(raw: bytes) -> tuple[str, bool]:
    """Bytes → text: UTF-8 (BOM tolerated), else cp1252, else latin-1 (never fails).
    Returns (text, whether it was not UTF-8)."""
    try:
        return raw.decode("utf-8-sig"), False
    except UnicodeDecodeError:
        pass
    try:
        return raw.decode("cp1252"), True
    except UnicodeDecodeError:
        return raw.decode("latin-1"), True


def clean_caption(text: str) -> str:
    """NFC-normalised, control characters dropped, whitespace runs collapsed to one space."""
    text = unicodedata.normalize("NFC", text)
    text = "".join(c if unicodedata.category(c)[0] != "C" else " " for c in text)
    return " ".join(text.split())


def _add_captions(record: Record, raw_captions: Iterable[str | bytes], listing: Listing, where: str) -> None:
    for k, raw in enumerate(raw_captions):
        if isinstance(raw, bytes):
            raw, recoded = decode_text(raw)
            listing.captions_recoded += recoded
        if not isinstance(raw, str):
            listing.rejects.append(Reject("caption", f"{where}[{k}]", "caption is not text", repr(raw)[:80],
                                          record.image_id))
            continue
        caption = clean_caption(raw)
        if caption:
            record.captions.append(caption)
        else:
            listing.rejects.append(Reject("caption", f"{where}[{k}]", "empty caption", repr(raw)[:80],
                                          record.image_id))


def image_id_problem(image_id: str) -> str | None:
    """Why ``image_id`` cannot name an image, or None: every format's ids pass here. An id is
    1 to :data:`MAX_IMAGE_ID_CHARS` characters, each printable (no newline, CR, tab, escape,
    NUL, bidi override: it is shown as it is, :func:`pairsim.errors.shown` escapes nothing in
    it), and, read as a path (``/`` or ``\\`` separated), relative and without a ``..`` part:
    a key like ``../x`` names nothing outside, wherever an id is used as a name."""
    if not 0 < len(image_id) <= MAX_IMAGE_ID_CHARS:
        return f"{len(image_id):,} characters (1 to {MAX_IMAGE_ID_CHARS:,})"
    if not image_id.isprintable():
        return "a control or other unprintable character"
    parts = image_id.replace("\\", "/").split("/")
    if parts[0] == "" or ".." in parts:
        return "an absolute path" if parts[0] == "" else "a '..' part: it would name a place outside"
    return None


def _finish(listing: Listing) -> Listing:
    """Drop images whose id is no safe name (:func:`image_id_problem`), images left without
    captions and later records of an image id already seen."""
    seen: dict[str, str] = {}
    kept = []
    for record in listing.records:
        if problem := image_id_problem(record.image_id):
            listing.rejects.append(Reject("image", shown(record.source), "bad image id",
                                          f"{shown(record.image_id, 80)}: {problem}", shown(record.image_id)))
        elif not record.captions:
            listing.rejects.append(Reject("image", record.source, "no valid caption", image_id=record.image_id))
        elif record.image_id in seen:
            listing.rejects.append(Reject("image", record.source, "duplicate image id",
                                          f"first seen at {seen[record.image_id]}", record.image_id))
        else:
            seen[record.image_id] = record.source
            kept.append(record)
    listing.records = kept
    return listing


def _image_file(images_root: Path, name: str | Path, where: str, listing: Listing) -> ImageRef | None:
    """The image file ``name`` under ``images_root``; None, rejected, when it is no path (a NUL
    byte) or resolves outside the root — through ``..``, an absolute path or a symlink (a list
    of paths must not make the builder read and store any file on the machine)."""
    path, root = images_root / name, images_root.resolve()
    try:
        resolved = path.resolve()
    except ValueError as exc:  # "embedded null byte": no file has this name
        listing.rejects.append(Reject("image", where, "bad path", f"{str(name)[:80]!r}: {exc}", str(name)))
        return None
    if not resolved.is_relative_to(root):
        listing.rejects.append(Reject("image", where, "outside images root",
                                      f"{name} is {resolved}, not under {root}: set --images-root to a "
                                      f"directory holding the images", str(name)))
        return None
    try:
        return ImageRef(str(path), size=path.stat().st_size)
    except OSError:
        return ImageRef(str(path))  # missing: the build rejects it with the reason


def _id_under(images_root: Path, name: str) -> str:
    """The id of the image file ``name``: its path under ``images_root``, ``/``-separated
    (``./a/../b.jpg`` is ``b.jpg``; an absolute path under the root is relative to it)."""
    return PurePath(os.path.relpath(images_root / name, images_root)).as_posix()


def _read_bytes(path: Path) -> bytes:
    """A list file's bytes (:meth:`Location.read_bounded`: a regular file, at most :data:`MAX_LIST_BYTES`)."""
    return Location.of(path).read_bounded(MAX_LIST_BYTES, SourceError, "split the list into several builds")


def _open_input(path: Path) -> BinaryIO:
    """A source file opened for reading (:meth:`Location.open_input`: a regular file only);
    :class:`SourceError` naming it otherwise."""
    try:
        return Location.of(path).open_input()[0]
    except OSError as exc:
        raise SourceError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def list_karpathy(path: Path, images_root: Path) -> Listing:
    """``dataset_coco.json`` / ``dataset_flickr30k.json``: ``images[]`` with ``filepath`` (COCO
    only), ``filename``, ``split`` (``restval`` counts as train) and ``sentences[].raw``.
    The image id is ``cocoid`` where present, else the file name without extension."""
    text, _ = decode_text(_read_bytes(path))
    try:
        entries = json.loads(text)["images"]
    except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as exc:
        problem = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise SourceError(f"{path}: not a Karpathy split file (expected {{'images': [...]}}): {problem}") from None
    listing = Listing()
    for i, entry in enumerate(entries):
        where = f"{path.name}:images[{i}]"
        try:
            name = Path(entry.get("filepath") or "") / entry["filename"]
            split = "train" if entry["split"] == "restval" else str(entry["split"])
            image_id = str(entry["cocoid"]) if "cocoid" in entry else Path(entry["filename"]).stem
            sentences = [s["raw"] for s in entry["sentences"]]
        except (KeyError, TypeError, AttributeError) as exc:
            listing.rejects.append(Reject("record", where, "malformed entry", f"missing or bad field {exc}"))
            continue
        if (image := _image_file(images_root, name, where, listing)) is None:
            continue
        record = Record(split, image_id, image, [], where)
        _add_captions(record, sentences, listing, f"{where}.sentences")
        listing.records.append(record)
    return _finish(listing)


def _decoded_lines(raw: bytes, listing: Listing) -> Iterator[str]:
    """``raw``'s lines, each decoded on its own (:func:`decode_text`). A line ends at LF (a
    CRLF's CR goes with it): a CR elsewhere is a character of the line, not a line end
    (``bytes.splitlines`` would cut a caption there and make its rest a line of its own)."""
    for line in io.BytesIO(raw):
        text, recoded = decode_text(line)
        listing.captions_recoded += recoded
        yield text


CR_STAND_IN = "\ud800"  # a bare CR as the csv module is handed it: a lone surrogate, which no decoded text holds


def _csv_lines(lines: Iterable[str]) -> Iterator[str]:
    """``lines`` for the csv module, each CR that does not end its line as :data:`CR_STAND_IN`
    (:func:`_csv_rows` gives it back): the csv module ends a record at any CR outside quotes,
    so a caption's stray CR would cut it and shift the rest of the line into a record of its own."""
    for line in lines:
        text = line.removesuffix("\n").removesuffix("\r")
        yield text.replace("\r", CR_STAND_IN) + line[len(text):]


def list_csv(path: Path, images_root: Path, split: str, image_key: str = "filepath",
             caption_key: str = "title", separator: str = "\t") -> Listing:
    """open_clip's CSV: a header row, then one caption per line; lines naming the same image
    path are one image with several captions. Each line is decoded on its own (a stray
    non-UTF-8 line does not spoil the file); a CR inside a line is part of it (:func:`_csv_lines`)."""
    listing = Listing()
    reader = csv.reader(_csv_lines(_decoded_lines(_read_bytes(path), listing)), delimiter=separator)
    header = next(reader, None)
    if header is None or image_key not in header or caption_key not in header:
        raise SourceError(f"{path}: header {shown(header)} lacks the image column {image_key!r} and/or the caption "
                          f"column {caption_key!r} (set them with --csv-image-key / --csv-caption-key, the "
                          f"separator with --csv-separator; now {separator!r})")
    image_col, caption_col = header.index(image_key), header.index(caption_key)
    by_path: dict[str, Record | None] = {}
    for row in _csv_rows(reader, path, listing):
        where = f"{path.name}:{reader.line_num}"
        if len(row) != len(header):
            listing.rejects.append(Reject("record", where, "malformed line",
                                          f"{len(row)} fields, header has {len(header)}"))
            continue
        if record := _record_of(by_path, row[image_col], split, images_root, where, listing):
            _add_captions(record, [row[caption_col]], listing, where)
    return _finish(listing)


def _csv_rows(reader, path: Path, listing: Listing) -> Iterator[list[str]]:
    """The reader's rows, each bare CR given back (:func:`_csv_lines`: a control character, cleaned
    to a space in a caption, refused in an image id); a line it cannot parse (a field over the
    csv module's limit, 128 KiB: a runaway caption) is a counted reject, not the end of the build."""
    while True:
        try:
            yield [value.replace(CR_STAND_IN, "\r") for value in next(reader)]
        except StopIteration:
            return
        except csv.Error as exc:
            listing.rejects.append(Reject("record", f"{path.name}:{reader.line_num}", "malformed line", str(exc)))


def _record_of(records: dict[str, Record | None], name: str, split: str, images_root: Path, where: str,
               listing: Listing) -> Record | None:
    """The record of the image file ``name`` (lines naming one file are one image: one id,
    :func:`_id_under`), made and listed on first sight; None for a file outside the root
    (rejected once)."""
    image_id = _id_under(images_root, name)
    if image_id not in records:
        image = _image_file(images_root, name, where, listing)
        records[image_id] = Record(split, image_id, image, [], where) if image else None
        if image:
            listing.records.append(records[image_id])
    return records[image_id]


def list_folder(path: Path, images_root: Path, split: str) -> Listing:
    """A JSONL of ``{"file", "caption"}`` or ``{"file", "captions"}`` beside (or naming files
    under ``images_root``); lines naming the same file are one image."""
    listing = Listing()
    by_file: dict[str, Record | None] = {}
    for number, line in enumerate(_decoded_lines(_read_bytes(path), listing), start=1):
        where = f"{path.name}:{number}"
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            name = entry["file"]
            captions = entry["captions"] if "captions" in entry else [entry["caption"]]
            if not isinstance(name, str) or not isinstance(captions, list):
                raise TypeError("'file' must be a string and 'captions' a list")
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as exc:
            problem = "nested too deeply" if isinstance(exc, RecursionError) else exc
            listing.rejects.append(Reject("record", where, "malformed line", f"{type(exc).__name__}: {problem}"))
            continue
        if record := _record_of(by_file, name, split, images_root, where, listing):
            _add_captions(record, captions, listing, where)
    return _finish(listing)


def tar_files(path: Path) -> list[Path]:
    """One ``.tar`` or a directory of them (sorted)."""
    files = sorted(path.glob("*.tar")) if path.is_dir() else [path]
    if not files:
        raise SourceError(f"{path}: no .tar files")
    return files


def _split_key(name: str) -> tuple[str, str]:
    """WebDataset naming: the key is everything before the first dot of the base name."""
    head, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


def list_webdataset(path: Path, split: str) -> Listing:
    """img2dataset tars: ``key.jpg|png|webp`` + ``key.txt`` (+ optional ``key.json``, whose
    ``caption`` stands in when the .txt is missing). Uncompressed tars only (img2dataset's
    output): images are read later by offset. A second member with a key and extension already
    seen in the tar is rejected (``duplicate member``), not silently used. A truncated tar keeps
    the members before the break; its lost samples are counted from img2dataset's sidecar
    beside it (:func:`_lost_samples`). The key is the image id (:func:`image_id_problem`)."""
    listing = Listing()
    for tar_path in tar_files(path):
        samples: dict[str, dict[str, tarfile.TarInfo]] = {}
        truncated: str | None = None
        try:
            with _open_input(tar_path) as stream, tarfile.open(fileobj=stream, mode="r:") as tar:
                while True:
                    try:
                        member = tar.next()
                    except (tarfile.ReadError, EOFError) as exc:
                        truncated = str(exc)
                        break
                    if member is None:
                        if not _ends_with_end_marker(stream, tar.offset):  # cut between two members
                            truncated = "no end-of-archive blocks"
                        break
                    if member.isfile():
                        key, ext = _split_key(member.name)
                        if ext in samples.get(key, {}):
                            listing.rejects.append(Reject("record", f"{tar_path.name}:{member.name}",
                                                          "duplicate member", "the tar's first one is kept", key))
                            continue
                        samples.setdefault(key, {})[ext] = member
                texts = {key: _member_text(tar, files.get("txt"), tar_path, listing) for key, files in samples.items()}
                metas = {key: _member_text(tar, files.get("json"), tar_path, listing) for key, files in samples.items()}
        except tarfile.ReadError as exc:
            raise SourceError(f"{tar_path}: not an uncompressed tar ({exc}); img2dataset writes plain .tar "
                              "files — decompress others first") from None
        listing.rejects.extend(_lost_samples(tar_path, set(samples), truncated))
        for key, files in samples.items():
            image = next((files[e.lstrip(".")] for e in IMAGE_EXTENSIONS if e.lstrip(".") in files), None)
            where = f"{tar_path.name}:{key}"
            if image is None:
                listing.rejects.append(Reject("image", where, "no image file",
                                              f"members: {sorted(files)}", key))
                continue
            record = Record(split, key, ImageRef(str(tar_path), image.offset_data, image.size),
                            [], f"{tar_path.name}:{image.name}")
            caption = texts[key]
            if caption is None and metas[key] is not None:
                caption = _json_caption(metas[key])
            if caption is None:
                listing.rejects.append(Reject("image", where, "no caption", "neither .txt nor json caption", key))
                continue
            _add_captions(record, [caption], listing, where)
            listing.records.append(record)
    return _finish(listing)


def _ends_with_end_marker(tar: BinaryIO, offset: int) -> bool:
    """Whether the tar has the two zero blocks that end an archive at ``offset``, where its
    members end: a tar cut between two members reads as complete otherwise."""
    tar.seek(offset)
    return tar.read(2 * tarfile.BLOCKSIZE) == bytes(2 * tarfile.BLOCKSIZE)


class Img2datasetStats(BaseModel):
    """The part of img2dataset's ``NNNNN_stats.json`` a build reads: how many samples it wrote."""

    model_config = ConfigDict(extra="allow")
    successes: int = Field(0, ge=0, le=MAX_TAR_SAMPLES)


def _lost_samples(tar_path: Path, read: set[str], truncated: str | None) -> list[Reject]:
    """The samples a tar lost (``truncated``: why it is known to be cut, or None): one reject per
    key that img2dataset's per-tar sidecar (``NNNNN.parquet`` with ``key`` and ``status``, or
    ``NNNNN_stats.json`` with ``successes``) lists but the tar does not hold; for a truncated tar
    without a sidecar, one reject saying how many followed is unknown."""
    where = tar_path.name
    detail = f"truncated tar after {len(read)} samples ({truncated})" if truncated else "not in the tar"
    meta, stats = tar_path.with_suffix(".parquet"), tar_path.with_name(f"{tar_path.stem}_stats.json")
    if meta.is_file() and (listed := _successful_keys(meta)) is not None:
        return [Reject("image", where, "lost from the tar", f"{detail}; listed in {meta.name}", key)
                for key in listed if key not in read]
    problems = []
    if stats.is_file():
        try:
            lost = max(untrusted.read_model(stats, Img2datasetStats, MAX_SIDECAR_BYTES, SourceError).successes
                       - len(read), 0)
            return [Reject("image", where, "lost from the tar", f"{detail}; {i + 1} of {lost} by {stats.name}")
                    for i in range(lost)]
        except SourceError as exc:
            problems.append(Reject("record", stats.name, "unreadable sidecar", shown(exc)))
    if truncated:
        problems.append(Reject("record", where, "truncated tar", f"{detail}; how many followed is unknown (no "
                                                                 f"readable img2dataset {meta.name} or {stats.name} "
                                                                 f"beside it)"))
    return problems


def _successful_keys(meta: Path) -> list[str] | None:
    """The keys img2dataset's per-tar ``NNNNN.parquet`` lists with status ``success``; None when
    it is not one (no string columns ``key`` and ``status``, or not Parquet)."""
    try:
        with _open_input(meta) as stream:
            table = pq.read_table(stream, columns=["key", "status"])
    except (OSError, ValueError):  # SourceError and pyarrow's ArrowInvalid are ValueErrors
        return None
    if not all(pa.types.is_string(table.schema.field(name).type) for name in ("key", "status")):
        return None
    return [key for key, status in zip(table["key"].to_pylist(), table["status"].to_pylist()) if status == "success"]


def _member_text(tar: tarfile.TarFile, member: tarfile.TarInfo | None, tar_path: Path,
                 listing: Listing) -> bytes | None:
    """The bytes of a sample's text member (its caption ``.txt``, img2dataset's ``.json``), None
    when it has none or, rejected, when the member holds more than :data:`MAX_TEXT_MEMBER_BYTES`."""
    if member is None:
        return None
    if member.size > MAX_TEXT_MEMBER_BYTES:
        listing.rejects.append(Reject("caption", shown(f"{tar_path.name}:{member.name}"), "caption file too large",
                                      f"{member.size:,} bytes, more than {MAX_TEXT_MEMBER_BYTES:,}"))
        return None
    with tar.extractfile(member) as f:
        return f.read()


def _json_caption(raw: bytes) -> str | None:
    try:
        caption = json.loads(decode_text(raw)[0]).get("caption")
    except (json.JSONDecodeError, AttributeError, RecursionError):
        return None
    return caption if isinstance(caption, str) else None


@dataclass(frozen=True)
class DataFormat:
    """A source format: ``lister(path, images_root, split, **options)`` → :class:`Listing`.

    ``options``: the ``BuildConfig`` fields that belong to this format → the lister's keyword
    (another format refuses them when set); ``description``: one line for help and docs.
    """

    lister: Callable[..., Listing]
    description: str
    options: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "__doc__", self.description)  # what the registry's tables show

    def list(self, path: Path, images_root: Path, split: str, **options: str) -> Listing:
        return self.lister(path, images_root, split, **options)


DATA_FORMATS.register("karpathy")(DataFormat(
    lambda path, root, split: list_karpathy(path, root),
    "Karpathy split file (dataset_coco.json / dataset_flickr30k.json); splits from the file"))
DATA_FORMATS.register("csv")(DataFormat(
    list_csv, "open_clip CSV, a header then one caption per line",
    {"csv_image_key": "image_key", "csv_caption_key": "caption_key", "csv_separator": "separator"}))
DATA_FORMATS.register("webdataset")(DataFormat(
    lambda path, root, split: list_webdataset(path, split),
    "img2dataset WebDataset, a .tar or a directory of .tar files"))
DATA_FORMATS.register("folder")(DataFormat(
    list_folder, "image folder with a JSONL of {file, caption(s)}"))


def list_source(fmt: str, path: Path, images_root: Path | None, split: str, **options: str) -> Listing:
    """Dispatch on ``fmt`` (a name registered in :data:`pairsim.registry.DATA_FORMATS`);
    ``options``: the format's own lister keywords (e.g. csv's ``image_key``)."""
    if fmt not in DATA_FORMATS:
        raise SourceError(f"--format {fmt!r}: expected one of {', '.join(DATA_FORMATS.names())}")
    path = Path(path)
    if not path.exists():
        raise SourceError(f"--input {path}: no such file or directory")
    root = Path(images_root) if images_root is not None else (path if path.is_dir() else path.parent)
    return DATA_FORMATS[fmt].list(path, root, split, **options)
