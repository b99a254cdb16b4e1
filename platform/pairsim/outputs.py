"""Where pairsim writes. Every command that writes files checks its output here before any work:
a directory it writes into is new, empty, or one pairsim owns (it holds a file pairsim wrote
there: a manifest, a marker); a file it writes is absent or one pairsim wrote (the caller says
how it knows). A foreign file at a target path, a non-empty foreign directory, a device, a
directory where a file goes and a read-only place are refused naming the path — nothing is
replaced that pairsim does not own. The files themselves are written atomically
(:meth:`pairsim.storage.Location.write_bytes`: temp file + rename), under the run's or build's
lock (:mod:`pairsim.locks`)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

import pyarrow.fs as pafs

from pairsim.errors import InputError
from pairsim.storage import Location, LocationLike, local_storage_problem


class OutputRefused(InputError):
    """An output path this command will not write to; the message names it and says why."""


def claim_directory(out: LocationLike, what: str, owned_by: Iterable[str], ignored: Iterable[str] = ()) -> Location:
    """``out`` as a directory this command may write into (returned): absent, empty (but for
    ``ignored`` files, e.g. a lock), or holding one of the ``owned_by`` files — pairsim's own (a
    manifest, a marker). :class:`OutputRefused` naming ``what`` otherwise."""
    location = Location.of(out)
    owned_by, ignored = tuple(owned_by), tuple(ignored)
    kind = location.info().type
    if kind == pafs.FileType.NotFound:
        _check_writable(location, what)
        return location
    if kind != pafs.FileType.Directory:
        raise OutputRefused(f"{what} {location}: not a directory ({_kind(location)}); choose a new or empty directory")
    if any((location / name).is_file() for name in owned_by):
        _check_writable(location, what)
        return location
    if foreign := [f for f in location.files(recursive=True) if f.name not in ignored]:
        raise OutputRefused(f"{what} {location}: not empty, and not an output of this command (no "
                            f"{' or '.join(owned_by)}; {len(foreign)} files, e.g. {foreign[0]}): writing there could "
                            "replace or delete them; choose a new or empty directory")
    _check_writable(location, what)
    return location


def check_file_target(path: Path, what: str, owned: bool = False) -> Path:
    """``path`` as a local file this command may write (returned): absent, or — when ``owned``
    (the caller knows pairsim wrote it) — a regular file to replace. :class:`OutputRefused`
    naming ``what`` for a directory, a device, a pipe or socket, a link, a foreign file or a
    place that cannot be written."""
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise OutputRefused(f"{what} {path}: cannot be looked at ({exc.strerror})") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise OutputRefused(f"{what} {path}: {_mode_kind(mode)}, not a file pairsim can write; give a file path")
    if mode is not None and not owned:
        raise OutputRefused(f"{what} {path}: a file pairsim did not write is there; choose another path or move it")
    if problem := local_storage_problem(path.absolute() if mode is None else path.absolute().parent):
        raise OutputRefused(f"{what} {problem}")
    if mode is not None and not os.access(path, os.W_OK):
        raise OutputRefused(f"{what} {path}: read-only")
    return path


def _check_writable(location: Location, what: str) -> None:
    if location.is_local and (problem := local_storage_problem(Path(location.path))):
        raise OutputRefused(f"{what} {problem}")


def _kind(location: Location) -> str:
    if location.is_local:
        try:
            return _mode_kind(os.lstat(location.path).st_mode)
        except OSError:
            pass
    return "a file"


def _mode_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a file")):
        if test(mode):
            return name
    return "not a regular file"
