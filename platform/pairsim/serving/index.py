"""A faiss index over embeddings, saved with what it was built from, and search in it.

Vectors are L2-normalised, so inner product is cosine similarity. Three kinds, chosen by the
``kind`` of an :data:`IndexSpec`: ``flat`` (exact ``IndexFlatIP``, the default), ``hnsw``
(``IndexHNSWFlat``, a graph) and ``ivfpq`` (``IndexIVFPQ``: inverted lists of product-quantised
codes, trained on a sample). Each modality gets its own faiss index: a CLIP model's image and
text embeddings lie apart (the modality gap), so a graph walk or the probed cells of one shared
index, started from a caption, would seldom reach the images a filter keeps. A search over
several modalities merges their top k by score. Rows are kept sorted by modality (stable), each
modality's a contiguous range, in the order of its index's vectors.

An index directory (:meth:`Index.save`) holds ``index.<modality>.faiss`` (faiss's own format),
``rows.parquet`` (each row's id and metadata, in index order) and ``index.json``
(:class:`IndexCard`: kind and parameters, dim, count a modality, the model's digest and where
the model and embeddings came from, each file's size and SHA-256). :func:`load_index` reads it
back as untrusted input: a ``.faiss`` file is parsed by faiss's C++ reader, so its bytes are
checked against the card's SHA-256 first and only the checked bytes are handed to faiss.

faiss is an optional dependency (``pip install "pairsim[search]"``), imported when first used.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from pairsim import locks, outputs, untrusted
from pairsim.serving.embeddings import MAX_ROWS, Dim, FileBytes, PlainName, Sha256, Source
from pairsim.config import ConfigError, Int, Section, format_errors
from pairsim.errors import InputError, shown
from pairsim.log import get_logger
from pairsim.storage import Location, LocationLike

log = get_logger("serving.index")

FORMAT_VERSION = 1
ROWS_FILE = "rows.parquet"
CARD_FILE = "index.json"
LOCK_FILE = "pairsim-index.lock"  # in the directory while an index is written into it (pairsim.locks)
MAX_CARD_BYTES = 1 << 20  # index.json as written: well under a kilobyte
ROW_COLUMNS = ("id", "modality", "image_id", "caption", "source")
ROWS_SCHEMA = pa.schema([(name, pa.string()) for name in ROW_COLUMNS])
FAISS_CLASSES = {"flat": ("IndexFlatIP",), "hnsw": ("IndexHNSWFlat",), "ivfpq": ("IndexIVFPQ", "IndexRefineFlat")}
MIN_POINTS_PER_CENTROID = 39  # faiss's k-means warns below this many training vectors a centroid
NORM_TOLERANCE = 1e-3
MAX_GRID_PICTURES = 50  # image hits a picture grid shows, best first (search -k may ask for 10,000)


class FlatSpec(Section):
    """Exact search: every vector compared (``IndexFlatIP``)."""

    kind: Literal["flat"] = "flat"


class HnswSpec(Section):
    """A navigable small-world graph (``IndexHNSWFlat``, inner product): ``m`` neighbours a node
    (faiss's M), ``ef_construction`` candidates while building, ``ef_search`` while searching."""

    kind: Literal["hnsw"]
    m: Int = Field(32, ge=2, le=256)
    ef_construction: Int = Field(40, ge=1, le=4096)
    ef_search: Int = Field(64, ge=1, le=4096)


class IvfPqSpec(Section):
    """Inverted lists of product-quantised codes (``IndexIVFPQ``, inner product): ``nlist``
    k-means cells, ``m`` sub-vectors a vector (dividing its dim) of ``nbits`` bits each, ``nprobe``
    cells visited a query. Trained on ``train_size`` vectors sampled with ``seed`` (default: all,
    at most 256 a centroid); each k-means needs 39 training vectors a centroid. With ``refine``
    r > 0 the top r·k candidates of the codes are re-scored exactly (``IndexRefineFlat``): the
    vectors are kept beside the codes, as much memory as ``flat`` and recall near it."""

    kind: Literal["ivfpq"]
    nlist: Int = Field(1024, ge=1, le=1 << 20)
    m: Int = Field(16, ge=1, le=4096)
    nbits: Int = Field(8, ge=1, le=16)
    nprobe: Int = Field(16, ge=1, le=1 << 20)
    train_size: Int | None = Field(None, ge=1)
    seed: Int = 0
    refine: Int = Field(0, ge=0, le=1024)


IndexSpec = Annotated[FlatSpec | HnswSpec | IvfPqSpec, Field(discriminator="kind")]
_SPEC = TypeAdapter(IndexSpec)


def parse_spec(values: Mapping[str, Any], source: str = "index") -> FlatSpec | HnswSpec | IvfPqSpec:
    """The :data:`IndexSpec` ``values`` give (``{"kind": "hnsw", "m": 16}``; no kind: flat);
    :class:`~pairsim.config.ConfigError` naming every bad field of ``source`` otherwise."""
    try:
        return _SPEC.validate_python({"kind": "flat", **values})
    except ValidationError as exc:
        raise ConfigError.from_validation(exc, source) from None


class FileRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    bytes: FileBytes
    sha256: Sha256


class IndexCard(BaseModel):
    """``index.json``: what an index directory holds and what it was built from."""

    model_config = ConfigDict(extra="forbid", strict=True)
    format_version: Literal[1]
    spec: IndexSpec
    dim: Dim
    modalities: dict[PlainName, Annotated[int, Field(ge=1, le=MAX_ROWS)]]
    model_digest: Sha256
    model_source: Source
    embeddings_source: Source
    files: dict[PlainName, FileRecord]

    @property
    def count(self) -> int:
        return sum(self.modalities.values())

    def file_names(self) -> list[str]:
        """The files the directory holds beside the card: a faiss index a modality, then the rows."""
        return [index_file(name) for name in self.modalities] + [ROWS_FILE]


CARD = outputs.Marker(CARD_FILE, IndexCard, MAX_CARD_BYTES)  # what makes a directory an index pairsim wrote


def index_file(modality: str) -> str:
    return f"index.{modality}.faiss"


class IndexFileError(untrusted.UntrustedFileError):
    """An index directory whose files are not what :meth:`Index.save` wrote."""


@dataclass(frozen=True)
class Hit:
    """One search result: the row's id, its cosine similarity to the query and its metadata row."""

    id: str
    score: float
    row: dict[str, Any]


def import_faiss():
    """The faiss module; :class:`InputError` saying how to install it when it is missing."""
    try:
        import faiss
    except ImportError:
        raise InputError('faiss is not installed: pip install "pairsim[search]" (or faiss-cpu, or faiss-gpu)') from None
    return faiss


class Index:
    """A faiss index a modality, the rows (sorted by modality, each modality's in its index's
    order) and the :class:`IndexCard`."""

    def __init__(self, parts: dict[str, Any], rows: pa.Table, card: IndexCard):
        self.parts, self.rows, self.card = parts, rows, card
        starts = np.cumsum([0, *card.modalities.values()])
        self.modalities = {name: range(a, b) for name, a, b in zip(card.modalities, starts, starts[1:])}

    def __len__(self) -> int:
        return self.card.count

    def search(self, queries: np.ndarray, k: int, modality: str | None = None) -> list[list[Hit]]:
        """The top ``k`` rows (of ``modality`` only, when given) for each of ``queries`` [q, dim],
        best first; ``k`` is clipped to the rows there are. An approximate index may return fewer."""
        faiss = import_faiss()
        queries = _checked_vectors(queries, "queries", self.card.dim)
        if k < 1:
            raise InputError(f"k: must be at least 1, got {k}")
        if modality is not None and modality not in self.modalities:
            raise InputError(f"modality: {modality!r} is none of the index's ({', '.join(self.modalities)})")
        scores, labels = [], []
        for name in self.modalities if modality is None else [modality]:
            rows = self.modalities[name]
            found_scores, found = self.parts[name].search(queries, min(k, len(rows)),
                                                          params=_search_parameters(faiss, self.card.spec))
            scores.append(np.where(found >= 0, found_scores, -np.inf))  # an approximate index pads with -1
            labels.append(np.where(found >= 0, found + rows.start, -1))
        scores, labels = np.concatenate(scores, axis=1), np.concatenate(labels, axis=1)
        best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        scores, labels = np.take_along_axis(scores, best, 1), np.take_along_axis(labels, best, 1)
        valid = labels >= 0
        found_rows = iter(self.rows.take(labels[valid]).to_pylist())  # one take for all queries, row by row
        return [[Hit(row["id"], float(score), row) for score, row in zip(line_scores[line_valid], found_rows)]
                for line_scores, line_valid in zip(scores, valid)]

    def save(self, out: LocationLike) -> Location:
        """Write the index into ``out`` (new, empty or an index directory: claimed before any
        write, under a lock): ``index.json`` first — it makes the directory pairsim's, and holds
        the SHA-256 of the files that follow, so a half-written directory is refused on load."""
        out = outputs.claim_directory(out, "index directory", owned_by=[CARD], ignored=[LOCK_FILE])
        faiss = import_faiss()
        buffer = io.BytesIO()
        pq.write_table(self.rows, buffer)
        contents = [faiss.serialize_index(self.parts[name]).tobytes() for name in self.modalities] + [buffer.getvalue()]
        card = self.card.model_copy(update={"files": {name: _record(data)
                                                      for name, data in zip(self.card.file_names(), contents)}})
        with locks.hold(out / LOCK_FILE, f"index directory {out}"):
            (out / CARD_FILE).write_text(card.model_dump_json(indent=2))
            for name, data in zip(card.file_names(), contents):
                (out / name).write_bytes(data)
        self.card = card
        return out


def build_index(vectors: np.ndarray, rows: pa.Table, spec: FlatSpec | HnswSpec | IvfPqSpec, model_digest: str,
                model_source: str, embeddings_source: str) -> Index:
    """An index of ``vectors`` [n, d] (float32, L2-normalised) whose row ``i`` is ``rows``' row
    ``i`` (columns :data:`ROW_COLUMNS`, ids unique), built as ``spec`` says — a faiss index a
    modality — and recording the model and embeddings it came from. Rows are reordered by
    modality (stable)."""
    faiss = import_faiss()
    vectors = _checked_vectors(vectors, "vectors")
    rows = _checked_rows(rows, len(vectors))
    if np.abs(np.linalg.norm(vectors, axis=1) - 1).max() > NORM_TOLERANCE:
        raise InputError("vectors: not L2-normalised (inner product would not be cosine similarity)")
    order = np.asarray(pc.sort_indices(rows, [("modality", "ascending")]))  # stable
    vectors, rows = vectors[order], rows.take(order)
    counts = {str(v["values"]): int(v["counts"]) for v in pc.value_counts(rows.column("modality")).to_pylist()}
    if bad := [name for name in counts if not untrusted.is_plain_name(name)]:
        raise InputError(f"rows: modality: {bad[0][:80]!r} is not a plain name (letters, digits, _ . -)")
    try:
        card = IndexCard(format_version=FORMAT_VERSION, spec=spec, dim=vectors.shape[1],
                         modalities=dict(sorted(counts.items())), model_digest=model_digest, model_source=model_source,
                         embeddings_source=embeddings_source, files={})
    except ValidationError as exc:  # a model digest that is not one
        raise InputError(format_errors(exc, "the index's card")) from None
    index = Index({}, rows, card)
    for name, part in index.modalities.items():
        started = time.perf_counter()
        index.parts[name] = _built(faiss, spec, np.ascontiguousarray(vectors[part.start:part.stop]), name)
        log.info("built the %s index of %d %s vectors (d=%d) in %.1f s", spec.kind, len(part), name, card.dim,
                 time.perf_counter() - started)
    return index


def load_index(directory: LocationLike) -> Index:
    """The index :meth:`Index.save` wrote into ``directory``, its card read as untrusted input
    and each file's size and SHA-256 checked before faiss or Parquet reads it;
    :class:`IndexFileError` naming the file otherwise."""
    faiss = import_faiss()
    directory = Location.of(directory)
    card = untrusted.read_model(directory / CARD_FILE, IndexCard, MAX_CARD_BYTES, IndexFileError)
    if sorted(card.files) != sorted(card.file_names()):
        raise IndexFileError(f"{directory / CARD_FILE}: files: lists {', '.join(sorted(card.files))}, not "
                             f"{', '.join(card.file_names())}")
    *parts, rows = (_verified_bytes(directory / name, card.files[name]) for name in card.file_names())
    with untrusted.parsing(directory / ROWS_FILE, "a Parquet file", IndexFileError):
        rows = pq.read_table(pa.BufferReader(rows))
    if not rows.schema.equals(ROWS_SCHEMA) or rows.num_rows != card.count or not np.array_equal(
            rows.column("modality").to_numpy(zero_copy_only=False),  # the card's counts, as the file's rows bound them
            np.repeat(list(card.modalities), list(card.modalities.values()))):
        raise IndexFileError(f"{directory / ROWS_FILE}: not the {card.count} rows of {', '.join(ROW_COLUMNS)} "
                             f"grouped by modality that {CARD_FILE} describes")
    index = Index({}, rows, card)
    for (name, part), data in zip(index.modalities.items(), parts):
        location = directory / index_file(name)
        with untrusted.parsing(location, "a faiss index", IndexFileError):
            index.parts[name] = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        _check_part(faiss, index.parts[name], card, len(part), location)
    return index


def _check_part(faiss, part, card: IndexCard, count: int, location: Location) -> None:
    """:class:`IndexFileError` unless the faiss index read from ``location`` is what the card
    says: its kind (:data:`FAISS_CLASSES`), inner product, the card's dim and ``count`` vectors."""
    found = type(faiss.downcast_index(part)).__name__
    if found not in FAISS_CLASSES[card.spec.kind] or part.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise IndexFileError(f"{location}: a {found} index (metric {part.metric_type}), not the {card.spec.kind} "
                             f"inner-product index {CARD_FILE} describes")
    if (part.d, part.ntotal) != (card.dim, count):
        raise IndexFileError(f"{location}: holds {part.ntotal} vectors of dim {part.d}; {CARD_FILE} says {count} of "
                             f"dim {card.dim}")


def picture_grid(hits: Sequence[Hit], images: Callable[[list[str]], Mapping[str, Any]], path: Path,
                 title: str = "") -> Path:
    """A PNG at the local ``path`` (a new file: :func:`pairsim.outputs.check_file_target`) of
    the hits' images in rank order (the first :data:`MAX_GRID_PICTURES`), each with its rank, id
    and score. ``images(image_ids)`` returns the PIL images of those ids (the dataset's shards
    are the caller's to read); hits without an ``image_id`` are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = outputs.check_file_target(path, "picture grid")
    pictured = [hit for hit in hits if hit.row.get("image_id")][:MAX_GRID_PICTURES]
    if not pictured:
        raise InputError("picture grid: none of the hits has an image_id to show")
    pictures = images(sorted({hit.row["image_id"] for hit in pictured}))
    columns = min(len(pictured), 5)
    lines = -(-len(pictured) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(2.4 * columns, 2.6 * lines), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for rank, (ax, hit) in enumerate(zip(axes.ravel(), pictured), start=1):
        ax.imshow(pictures[hit.row["image_id"]].convert("RGB"))
        ax.set_title(f"{rank}. {shown(hit.id, 24)}\n{hit.score:.3f}", fontsize=8, parse_math=False)
    fig.suptitle(shown(title, 100), parse_math=False)  # a caption's $ is text, not TeX
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    Location.of(path).write_bytes(png.getvalue())
    return path


def _built(faiss, spec: FlatSpec | HnswSpec | IvfPqSpec, vectors: np.ndarray, modality: str):
    """A faiss index of ``vectors`` (the ``modality`` rows') as ``spec`` says: trained, filled."""
    dim = vectors.shape[1]
    if isinstance(spec, FlatSpec):
        index = faiss.IndexFlatIP(dim)
    elif isinstance(spec, HnswSpec):
        index = faiss.IndexHNSWFlat(dim, spec.m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = spec.ef_construction
        index.hnsw.efSearch = spec.ef_search
    else:
        if dim % spec.m:
            raise ConfigError(f"m: the vectors' dim {dim} is not a multiple of m={spec.m} (PQ sub-vectors)")
        ivf = faiss.IndexIVFPQ(faiss.IndexFlatIP(dim), dim, spec.nlist, spec.m, spec.nbits, faiss.METRIC_INNER_PRODUCT)
        ivf.nprobe = spec.nprobe
        index = faiss.IndexRefineFlat(ivf) if spec.refine else ivf
        index.train(_training_sample(vectors, spec, modality))
    index.add(vectors)
    return index


def _search_parameters(faiss, spec: FlatSpec | HnswSpec | IvfPqSpec):
    """The spec's search-time parameters (a loaded index's own settings are not relied on)."""
    if isinstance(spec, HnswSpec):
        return faiss.SearchParametersHNSW(efSearch=spec.ef_search)
    if isinstance(spec, IvfPqSpec):
        ivf = faiss.SearchParametersIVF(nprobe=min(spec.nprobe, spec.nlist))
        return faiss.IndexRefineSearchParameters(k_factor=spec.refine, base_index_params=ivf) if spec.refine else ivf
    return None


def _training_sample(vectors: np.ndarray, spec: IvfPqSpec, modality: str) -> np.ndarray:
    """The vectors IVF-PQ is trained on; :class:`ConfigError` naming ``nlist`` or ``nbits``
    when they are fewer than its k-means need (39 a centroid)."""
    size = min(spec.train_size or 256 * max(spec.nlist, 2 ** spec.nbits), len(vectors))
    for field, centroids in (("nlist", spec.nlist), ("nbits", 2 ** spec.nbits)):
        if size < MIN_POINTS_PER_CENTROID * centroids:
            raise ConfigError(f"{field}: IVF-PQ with {field}={getattr(spec, field)} trains {centroids} centroids and "
                              f"needs at least {MIN_POINTS_PER_CENTROID} × {centroids} = "
                              f"{MIN_POINTS_PER_CENTROID * centroids:,} training vectors; the {modality} rows give {size:,} "
                              f"(lower {field}, or use flat or hnsw)")
    chosen = np.random.default_rng(spec.seed).choice(len(vectors), size, replace=False)
    return vectors[np.sort(chosen)]


def _checked_vectors(vectors: Any, what: str, dim: int | None = None) -> np.ndarray:
    """``vectors`` as a C-contiguous float32 [n, d] array of finite values (``d == dim`` when
    given); :class:`InputError` naming ``what`` otherwise."""
    array = np.asarray(vectors)
    if array.ndim != 2 or not len(array) or not array.shape[1]:
        raise InputError(f"{what}: expected a non-empty [n, d] array, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.floating):
        raise InputError(f"{what}: expected floats, got {array.dtype}")
    if dim is not None and array.shape[1] != dim:
        raise InputError(f"{what}: dim {array.shape[1]}, the index's is {dim} (embeddings of another model?)")
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(array).all():
        raise InputError(f"{what}: holds NaN or infinite values")
    return array


def _checked_rows(rows: pa.Table, count: int) -> pa.Table:
    """``rows`` as :data:`ROWS_SCHEMA` (strings; ``id`` unique and set), one a vector."""
    if missing := [c for c in ROW_COLUMNS if c not in rows.column_names]:
        raise InputError(f"rows: no column {', '.join(missing)} (needs {', '.join(ROW_COLUMNS)})")
    if rows.num_rows != count:
        raise InputError(f"rows: {rows.num_rows} rows for {count} vectors")
    rows = rows.select(list(ROW_COLUMNS))
    if wrong := [f"{f.name} ({f.type})" for f in rows.schema if not pa.types.is_string(f.type)
                 and not pa.types.is_large_string(f.type)]:
        raise InputError(f"rows: columns not of strings: {', '.join(wrong)}")
    ids = rows.column("id")
    if ids.null_count or rows.column("modality").null_count:
        raise InputError("rows: id and modality must be set on every row")
    if len(pc.unique(ids)) != count:
        raise InputError("rows: id: ids repeat; each row needs its own")
    return rows.cast(ROWS_SCHEMA)


def _record(data: bytes) -> FileRecord:
    return FileRecord(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def _verified_bytes(location: Location, record: FileRecord) -> bytes:
    """The bytes of ``location`` once they are the size and SHA-256 ``record`` holds."""
    data = location.read_bounded(record.bytes, IndexFileError, f"not the {record.bytes:,} bytes {CARD_FILE} records")
    if len(data) != record.bytes or hashlib.sha256(data).hexdigest() != record.sha256:
        raise IndexFileError(f"{location}: its content differs from the size and SHA-256 {CARD_FILE} records "
                             "(altered or cut short since it was written)")
    return data
