"""A dataset split's embeddings on disk, and the batch job that makes them (``pairsim embed``).

Layout::

    OUT/embeddings.json                 the manifest (:class:`EmbeddingsManifest`), rewritten after each shard
    OUT/image-part-00000.parquet        the image embeddings of input shard part-00000.parquet
    OUT/text-part-00000.parquet         its captions' embeddings
    OUT/.embed.lock                     held while a job writes (:mod:`pairsim.locks`)

One row per image and per caption (:func:`row_schema`): ``id`` (``image/<image_id>``,
``text/<image_id>/<caption_index>``), ``modality``, ``embedding`` (L2-normalised float32),
``image_id``, ``caption_index`` and ``caption`` (null for images), ``source`` (the image's
source path; null for captions).

The job (:func:`embed_split`) is Ray Data batch inference: the input shards read and decoded
(images) or tokenized (captions) by CPU tasks (:mod:`pairsim.data.ingest`'s), embedded by
:func:`pairsim.eval.inference.embedded_by` (tasks on CPU, an actor pool on GPU), one pipeline
for both modalities. Each row carries the input shard it came from; the driver
writes an output shard as soon as all of its input shard's rows are in (atomically), then the
manifest, so a killed job re-run with the same arguments redoes only the input shards not
recorded done. Images that cannot be decoded are skipped and listed in the manifest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import PurePosixPath
from typing import Annotated, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pairsim import locks, outputs, untrusted
from pairsim.config import RunConfig
from pairsim.data import shards
from pairsim.errors import InputError
from pairsim.log import get_logger
from pairsim.storage import Location, LocationLike

log = get_logger("serving")

FORMAT_VERSION = 1
MANIFEST = "embeddings.json"
LOCK = ".embed.lock"
MAX_MANIFEST_BYTES = 256 * 2**20  # a line per output shard and per skipped image: millions of images fit
MAX_DIM = 1 << 16  # an embedding's width read back: open_clip's widest are 1,024–1,280
MAX_ROWS = 1 << 40  # rows of one file read back (a trillion)
MAX_FILE_BYTES = 1 << 40  # bytes of one file read back (1 TiB); a read is also bounded by what the file holds
MAX_SOURCE_CHARS = 4096  # a path, URI or run a manifest or card says it came from
MODALITIES = ("image", "text")
Modality = Literal["image", "text"]


class EmbeddingsError(untrusted.UntrustedFileError):
    """An embeddings directory that is not what :func:`embed_split` writes, or not the one asked
    for: a manifest unreadable or of another model or data, a shard altered since it was written."""


def _plain_name(name: str) -> str:
    if not untrusted.is_plain_name(name):
        raise ValueError("not a plain file name; it could lead outside the embeddings directory")
    return name


PlainName = Annotated[str, AfterValidator(_plain_name)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Source = Annotated[str, Field(max_length=MAX_SOURCE_CHARS)]
RowCount = Annotated[int, Field(ge=0, le=MAX_ROWS)]
FileBytes = Annotated[int, Field(ge=0, le=MAX_FILE_BYTES)]
Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]


class OutputShard(BaseModel):
    """One Parquet file of embeddings: one modality of one input shard."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    file: PlainName
    modality: Modality
    input_shard: PlainName
    rows: RowCount
    bytes: FileBytes
    sha256: Sha256


class EmbeddingsManifest(BaseModel):
    """``embeddings.json``: which model embedded which data, and the output shards written so far."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    format_version: int = Field(ge=1, le=FORMAT_VERSION, description="a newer pairsim's format is refused")
    model_digest: Sha256 = Field(description="pairsim.models.retrieval.model_digest of the export")
    model_source: Source = Field(description="where the model came from: an export's path, a run, a checkpoint")
    dim: Dim
    data_path: Source
    split: PlainName
    split_content_hash: Sha256 = Field(description="the split's content hash in the data's manifest.json")
    modalities: list[Modality]
    input_shards: list[PlainName] = Field(description="the split's shards, each to be embedded")
    shards: list[OutputShard] = []
    skipped: dict[str, str] = Field({}, description="image id → why it could not be decoded")
    complete: bool = False

    def done(self, modality: str) -> set[str]:
        """The input shards whose ``modality`` embeddings are written."""
        return {s.input_shard for s in self.shards if s.modality == modality}

    def pending(self) -> dict[str, list[str]]:
        """Per modality asked for, the input shards not yet embedded."""
        return {m: [s for s in self.input_shards if s not in self.done(m)] for m in self.modalities}


def row_schema(dim: int) -> pa.Schema:
    return pa.schema([("id", pa.string()), ("modality", pa.string()), ("embedding", pa.list_(pa.float32(), dim)),
                      ("image_id", pa.string()), ("caption_index", pa.int32()), ("caption", pa.string()),
                      ("source", pa.string())])


def output_file(modality: str, input_shard: str) -> str:
    return f"{modality}-{PurePosixPath(input_shard).stem}.parquet"


def read_manifest(root: LocationLike) -> EmbeddingsManifest:
    """``root``'s ``embeddings.json``, read as untrusted input; :class:`EmbeddingsError` naming
    the file and every wrong field, FileNotFoundError when there is none."""
    path = Location.of(root) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no embeddings at {root}: {path} is missing (make them with `pairsim embed`)")
    return untrusted.read_model(path, EmbeddingsManifest, MAX_MANIFEST_BYTES, EmbeddingsError)


def read_embeddings(root: LocationLike, modality: str | None = None) -> tuple[EmbeddingsManifest, pa.Table]:
    """The manifest and rows (of one ``modality``, or both) of a complete embeddings directory,
    each shard checked against the SHA-256, row count and schema the manifest records;
    :class:`EmbeddingsError` naming the file otherwise, or when the job that wrote it has not
    finished."""
    manifest = read_manifest(root)
    if modality is not None and modality not in manifest.modalities:
        raise InputError(f"{root}: holds no {modality} embeddings (it has {', '.join(manifest.modalities)})")
    if not manifest.complete:
        raise EmbeddingsError(f"{root}: the embedding job has not finished ({sum(map(len, manifest.pending().values()))} "
                              "input shards to go); re-run `pairsim embed` with the same arguments to finish it")
    schema = row_schema(manifest.dim)
    tables = [_read_shard(untrusted.child(root, shard.file, f"{root}: shard", EmbeddingsError), shard, schema)
              for shard in manifest.shards if modality in (None, shard.modality)]
    return manifest, pa.concat_tables(tables) if tables else schema.empty_table()


def _read_shard(location: Location, shard: OutputShard, schema: pa.Schema) -> pa.Table:
    data = location.read_bounded(shard.bytes, EmbeddingsError, "not the size pairsim recorded when it wrote it")
    if hashlib.sha256(data).hexdigest() != shard.sha256:
        raise EmbeddingsError(f"{location}: its content differs from the SHA-256 pairsim recorded when it wrote it "
                              "(altered or cut short since); re-run `pairsim embed` after removing it and its record")
    with untrusted.parsing(location, "a Parquet file", EmbeddingsError):
        table = pq.read_table(pa.BufferReader(data))
    if not table.schema.equals(schema) or table.num_rows != shard.rows:
        raise EmbeddingsError(f"{location}: not the {shard.rows} rows of {schema} the manifest records")
    return table


def vectors(table: pa.Table) -> np.ndarray:
    """The ``embedding`` column as a float32 [rows, dim] array: a read-only view of a single
    chunk's buffer, else one copy of the chunks."""
    column = table.column("embedding")
    parts = [chunk.flatten().to_numpy(zero_copy_only=False).reshape(-1, column.type.list_size)
             for chunk in column.chunks]
    return parts[0] if len(parts) == 1 else np.concatenate(parts or [np.zeros((0, column.type.list_size), np.float32)])


class Output:
    """An embeddings directory being written: the manifest as written last, and the writes."""

    def __init__(self, root: Location, manifest: EmbeddingsManifest):
        self.root, self.manifest = root, manifest

    def save(self, **changes) -> None:
        self.manifest = self.manifest.model_copy(update=changes)
        (self.root / MANIFEST).write_text(self.manifest.model_dump_json(indent=1) + "\n")

    def write_shard(self, modality: str, input_shard: str, table: pa.Table) -> None:
        """One output shard written atomically, then recorded in the manifest."""
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, compression="zstd")
        data = buffer.getvalue().to_pybytes()
        name = output_file(modality, input_shard)
        (self.root / name).write_bytes(data)
        shard = OutputShard(file=name, modality=modality, input_shard=input_shard, rows=table.num_rows,
                            bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        self.save(shards=[s for s in self.manifest.shards if s.file != name] + [shard])


def claim_output(out: LocationLike) -> Location:
    """``out`` as an embeddings directory to write (new, empty, or an embedding job's);
    :class:`~pairsim.outputs.OutputRefused` otherwise."""
    return outputs.claim_directory(out, "--out", owned_by=[outputs.Marker(MANIFEST, EmbeddingsManifest, MAX_MANIFEST_BYTES)],
                                   ignored=[LOCK])


def open_output(root: Location, wanted: EmbeddingsManifest) -> Output:
    """The output at ``root`` for ``wanted`` (a fresh manifest): the one there when it holds
    embeddings of the same model, data and split (its modalities joined by ``wanted``'s), else
    ``wanted`` written as the start of a new one. :class:`EmbeddingsError` naming what differs."""
    if not (root / MANIFEST).is_file():
        output = Output(root, wanted)
        output.save()
        return output
    found = read_manifest(root)
    for field in ("model_digest", "dim", "data_path", "split", "split_content_hash", "input_shards"):
        if getattr(found, field) != getattr(wanted, field):
            raise EmbeddingsError(f"--out {root}: holds embeddings whose {field} is {str(getattr(found, field))[:80]!r}, "
                                  f"not {str(getattr(wanted, field))[:80]!r} as asked (another model or data); "
                                  "choose another --out")
    output = Output(root, found)
    modalities = [m for m in MODALITIES if m in found.modalities or m in wanted.modalities]
    if modalities != found.modalities:
        output.save(modalities=modalities, complete=False)
    return output


class FromShard:
    """``fn`` (``ingest.EvalImages`` or ``ingest.EvalTexts``) with each row it returns
    tagged with its input shard's file name (``input_shard``): every call of
    :func:`~pairsim.data.ingest.map_shards` is a slice of one shard, read with its ``path``."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        paths = np.unique(batch["path"])
        if len(paths) != 1:
            raise ValueError(f"a slice of rows from {len(paths)} shards, where map_shards gives one")
        out = self.fn(batch)
        return out | {"input_shard": np.full(len(out["image_id"]), PurePosixPath(str(paths[0])).name)}


def pipeline(model, cfg: RunConfig, split: str, manifest: shards.Manifest, pending: dict[str, list[Location]],
             skips):
    """One Ray Data dataset over the pending shards of both modalities: images decoded and
    captions tokenized (``ingest.EvalImages``, ``ingest.EvalTexts``) by CPU tasks, both embedded
    as :func:`pairsim.eval.inference.embedded_by` says. Each block holds one modality's rows with
    their ``input_shard``; what cannot be read is recorded in ``skips``
    (:class:`pairsim.data.skips.Skips`)."""
    from pairsim.data import ingest
    from pairsim.eval.inference import embedded_by

    readers = {"image": (["image", "image_id", "label"], ingest.EvalImages(cfg, skips)),
               "text": (["image_id", "captions"], ingest.EvalTexts(cfg.model.arch))}
    data = shards.RunData(cfg.data, {str(cfg.data.split_path(split)): manifest})  # the shards checked against it
    parts = [ingest.map_shards(ingest.read_split(cfg, split, readers[m][0], include_paths=True, data=data,
                                                 skips=skips, files=files),
                               FromShard(readers[m][1]), cfg.eval.batch_size, cfg)
             for m, files in pending.items() if files]
    ds = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    return embedded_by(ds, model, cfg, batch_size=None, carry=("input_shard",))


class ShardRows:
    """The rows of one input shard that make one output shard: their ids, captions and sources
    (read on the driver, image bytes left out), and the embeddings collected for them, matched
    by key (an image's id; a caption's image id and index)."""

    def __init__(self, location: Location, modality: str):
        table = shards.read_table([location], columns=["image_id", "captions", "source"])
        image_ids = [str(i) for i in table.column("image_id").to_pylist()]
        if len(set(image_ids)) != len(image_ids):
            raise InputError(f"{location}: image ids repeat within the shard; rebuild the dataset "
                             "(`pairsim shards build` rejects duplicates)")
        self.modality = modality
        if modality == "image":
            self.columns = {"id": [f"image/{i}" for i in image_ids], "image_id": image_ids,
                            "caption_index": [None] * len(image_ids), "caption": [None] * len(image_ids),
                            "source": table.column("source").to_pylist()}
            self.keys = image_ids
        else:
            captions = [(i, k, str(c)) for i, caps in zip(image_ids, table.column("captions").to_pylist())
                        for k, c in enumerate(caps or [])]
            self.columns = {"id": [f"text/{i}/{k}" for i, k, _ in captions], "image_id": [i for i, _, _ in captions],
                            "caption_index": [k for _, k, _ in captions], "caption": [c for _, _, c in captions],
                            "source": [None] * len(captions)}
            self.keys = [(i, k) for i, k, _ in captions]
        self.received: list[tuple[list, np.ndarray]] = []
        self.count = 0

    def add(self, keys: list, embeddings: np.ndarray) -> None:
        self.received.append((keys, embeddings))
        self.count += len(keys)

    @property
    def whole(self) -> bool:
        return self.count == len(self.keys)

    def table(self, dim: int) -> pa.Table:
        """The output shard: the rows received, in the input shard's order, L2-normalised."""
        where = {key: i for i, key in enumerate(self.keys)}
        found = np.asarray([where[k] for part, _ in self.received for k in part], dtype=np.int64)
        order = np.argsort(found, kind="stable")
        embeddings = np.concatenate([v for _, v in self.received]) if self.received else np.zeros((0, dim))
        embeddings = normalized(embeddings[order].astype(np.float32))
        schema, rows = row_schema(dim), found[order]
        columns = {name: pa.array([values[r] for r in rows], schema.field(name).type)
                   for name, values in self.columns.items()}
        columns["modality"] = pa.array([self.modality] * len(rows), pa.string())
        columns["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1), pa.float32()), dim)
        return pa.table({name: columns[name] for name in schema.names}, schema=schema)


def normalized(embeddings: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (as ``torch.nn.functional.normalize``: norms below 1e-12 clamped)."""
    return embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)


def embed_split(model, cfg: RunConfig, split: str, out: LocationLike, model_digest: str, model_source: str,
                modalities: Iterable[str] = MODALITIES, progress: bool = True) -> EmbeddingsManifest:
    """Embed ``split`` of ``cfg.data``'s dataset with ``model`` (``model_digest``'s, from
    ``model_source``) into ``out`` (:func:`claim_output`'s), under its lock: the input shards
    the manifest there does not record done, per modality (:func:`pipeline`, Ray started by
    :func:`pairsim.cluster.init_ray` when there is work). Returns the final manifest."""
    from pairsim.models import clip

    root = claim_output(out)
    with locks.hold(root / LOCK, f"--out {root}"):
        data_root = cfg.data.split_path(split)
        data = shards.read_manifest(data_root)
        files = {f.name: f for f in shards.split_shards(data_root, split, data)}
        wanted = EmbeddingsManifest(
            format_version=FORMAT_VERSION, model_digest=model_digest, model_source=model_source,
            dim=clip.embed_dim(cfg.model.arch), data_path=str(Location.of(data_root)), split=split,
            split_content_hash=data.split(split).content_hash,
            modalities=[m for m in MODALITIES if m in set(modalities)], input_shards=sorted(files))
        output = open_output(root, wanted)
        pending = {m: [files[name] for name in names] for m, names in output.manifest.pending().items()}
        if any(pending.values()):
            run_pipeline(output, model, cfg, split, data, pending, progress)
        if not output.manifest.complete:
            output.save(complete=True)
        return output.manifest


def run_pipeline(output: Output, model, cfg: RunConfig, split: str, data: shards.Manifest,
                 pending: dict[str, list[Location]], progress: bool) -> None:
    """Run :func:`pipeline` over ``pending``, writing each output shard once its rows are in;
    the shards still open when the stream ends (an image of theirs was skipped) are written last,
    after the skipped images are recorded."""
    from tqdm import tqdm

    from pairsim.cluster import init_ray
    from pairsim.data import skips

    init_ray(cfg)
    open_shards = {(m, f.name): ShardRows(f, m) for m, files in pending.items() for f in files}
    embed_skips = skips.new_scope("embed")
    dim = output.manifest.dim
    try:
        with tqdm(total=sum(len(s.keys) for s in open_shards.values()), desc=f"embedding {split}", unit="item",
                  disable=not progress) as bar:
            for block in pipeline(model, cfg, split, data, pending, embed_skips).iter_batches(batch_size=None,
                                                                                              batch_format="numpy"):
                modality = "image" if "image_ids" in block else "text"
                keys = ([str(i) for i in block["image_ids"]] if modality == "image" else
                        [(str(i), int(k)) for i, k in zip(block["text_image_ids"], block["caption_index"])])
                for name in np.unique(block["input_shard"]):
                    rows = np.flatnonzero(block["input_shard"] == name)
                    shard = open_shards[(modality, str(name))]
                    shard.add([keys[r] for r in rows], block[modality][rows])
                    if shard.whole:
                        output.write_shard(modality, str(name), open_shards.pop((modality, str(name))).table(dim))
                bar.update(len(keys))
        skipped = embed_skips.recorded()
    finally:
        embed_skips.drop()
    if skipped:
        log.warning("%s: skipped %d unreadable images, e.g. %s; all are listed under skipped in %s", split,
                    len(skipped), next(iter(skipped.items())), output.root / MANIFEST)
        output.save(skipped=output.manifest.skipped | skipped)
    for (modality, name), shard in open_shards.items():
        output.write_shard(modality, name, shard.table(dim))
