"""The on-disk dataset format: Parquet shards per split plus ``manifest.json``.

Layout::

    DIR/manifest.json
    DIR/<split>/part-00000.parquet, part-00001.parquet, ...

One row per image: ``image`` (encoded PNG/JPEG bytes, stored once), ``image_id``,
``captions`` (list<string>), ``label`` (int, -1 when unknown), ``label_name``, ``width``,
``height``, ``source``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"

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


def write_split(rows: Iterable[dict[str, Any]], split_dir: Path, rows_per_shard: int) -> dict[str, int]:
    """Write rows as numbered shards of at most ``rows_per_shard`` rows; return the split's counts."""
    split_dir.mkdir(parents=True, exist_ok=True)
    counts = {"images": 0, "captions": 0, "shards": 0}
    buffer: list[dict[str, Any]] = []

    def flush() -> None:
        table = pa.Table.from_pylist(buffer, schema=SHARD_SCHEMA)
        pq.write_table(table, split_dir / shard_name(counts["shards"]), compression="zstd")
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


def content_hash(root: Path) -> str:
    """SHA-256 over every shard's relative path and bytes, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(root.glob("*/*.parquet")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def write_manifest(root: Path, source: str, splits: dict[str, dict[str, int]], rejected: int = 0,
                   **extra: Any) -> dict[str, Any]:
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "source": source,
        "splits": splits,
        "rejected": rejected,
        "content_hash": content_hash(root),
        **extra,
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"no dataset at {root}: {path} is missing (make one with `pairsim data synth --out {root}`)"
        )
    return json.loads(path.read_text())


def split_files(root: Path, split: str) -> list[str]:
    """The shard files of one split, checked against the manifest."""
    manifest = read_manifest(root)
    if split not in manifest["splits"]:
        raise FileNotFoundError(
            f"{root}: split {split!r} not in manifest (has {sorted(manifest['splits'])})"
        )
    files = sorted(str(p) for p in (Path(root) / split).glob("*.parquet"))
    if len(files) != manifest["splits"][split]["shards"]:
        raise FileNotFoundError(
            f"{root}/{split}: manifest lists {manifest['splits'][split]['shards']} shards, found {len(files)}"
        )
    return files
