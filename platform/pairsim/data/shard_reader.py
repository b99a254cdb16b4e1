"""Shards read by Ray Data and checked as they are opened: each file's SHA-256 against the one
its manifest records, computed over the bytes the read task parses (no pre-pass over the
dataset, no second read).

``data.shard_checks`` says what a mismatch does: ``error`` (the default) fails the read naming
the shard, both digests and ``pairsim shards verify``; ``skip`` leaves the shard out, listing
each of its image ids (or the shard, when it does not parse) among the run's skipped records
(:mod:`pairsim.data.skips`); ``off`` reads it unchecked. A manifest written before pairsim
recorded per-shard digests gives nothing to check against: its shards are read as they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq
from ray.data.datasource import FileBasedDatasource

from pairsim import untrusted
from pairsim.data.shards import ShardError
from pairsim.data.skips import Skips


class ShardChecksumError(ShardError):
    """A shard whose bytes are not those its manifest's SHA-256 names."""


def mismatch_message(path: str, actual: str, expected: str) -> str:
    dataset = str(PurePosixPath(path).parent.parent)
    return (f"{path}: its SHA-256 is {actual[:16]}…, the manifest's is {expected[:16]}…: the shard changed "
            f"after it was built (corrupted, truncated or replaced). `pairsim shards verify {dataset}` checks every "
            f"shard; rebuild the split, or set data.shard_checks=skip to leave such shards out (listed in the run's "
            f"data/skipped_images.json)")


class VerifiedParquetDatasource(FileBasedDatasource):
    """Parquet shards, each read whole, hashed, checked against ``digests`` (file name →
    SHA-256; a name not there is not checked) and parsed from the same bytes, ``columns`` only:
    one block per file. Bytes that do not parse are a :class:`ShardError` naming the shard
    (:func:`pairsim.untrusted.parsing`), not pyarrow's traceback."""

    _FILE_EXTENSIONS = ["parquet"]

    def __init__(self, paths: list[str], *, digests: dict[str, str], columns: list[str], checks: str,
                 skips: Skips | None, **kwargs):
        super().__init__(paths, **kwargs)
        self._digests = digests if checks != "off" else {}
        self._columns = columns
        self._checks = checks
        self._skips = skips

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        data = f.readall()
        expected = self._digests.get(PurePosixPath(path).name)
        if expected is not None and (actual := hashlib.sha256(data).hexdigest()) != expected:
            if self._checks == "error":
                raise ShardChecksumError(mismatch_message(path, actual, expected))
            self._record_skipped(data, path, actual, expected)
            return
        with untrusted.parsing(path, "a Parquet shard", ShardError):
            table = pq.read_table(pa.BufferReader(data), columns=self._columns)
        yield table

    def _record_skipped(self, data: bytes, path: str, actual: str, expected: str) -> None:
        reason = f"in {path}, left out: its SHA-256 {actual[:16]}… is not the manifest's {expected[:16]}…"
        try:
            ids = [str(i) for i in pq.read_table(pa.BufferReader(data), columns=["image_id"])["image_id"].to_pylist()]
        except Exception:  # too damaged to list its rows: the shard stands for them
            ids = [f"shard {path}"]
        if self._skips is not None:
            self._skips.add(dict.fromkeys(ids, reason))


def checksum_failure(error: BaseException) -> ShardError | None:
    """The shard failure behind ``error`` (a Ray task's, or a worker group's, whose
    ``worker_failures`` hold each rank's) — a :class:`ShardChecksumError`, or a
    :class:`ShardError` for a shard that does not parse — as a plain one of its class to
    report in a line; None if none is."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, ShardError):  # its first line: Ray Data appends its retry advice to the message
            cause = getattr(exc, "cause", None) or exc
            return type(cause)(str(cause.args[0]).split("\n", 1)[0])
        pending += [getattr(exc, "cause", None), exc.__cause__, exc.__context__,
                    *getattr(exc, "worker_failures", {}).values()]
    return None
