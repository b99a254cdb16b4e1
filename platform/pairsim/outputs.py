"""Where pairsim writes. Every command that writes files checks its output here before any work:
a directory it writes into is new, empty, or one pairsim owns: it holds the command's
:class:`Marker` (a manifest, a card) and that file parses as the command's typed card — its name
alone proves nothing; a file it writes is absent or one pairsim wrote (the caller says
how it knows). A foreign file at a target path, a non-empty foreign directory, a device, a
directory where a file goes and a read-only place are refused naming the path — nothing is
replaced that pairsim does not own. The files themselves are written atomically
(:meth:`pairsim.storage.Location.write_bytes`: temp file + rename), under the run's or build's
lock (:mod:`pairsim.locks`)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
from pydantic import BaseModel

from pairsim import storage, untrusted
from pairsim.errors import InputError, shown
from pairsim.storage import Location, LocationLike, file_kind, local_storage_problem


class OutputRefused(InputError):
    """An output path this command will not write to; the message names it and says why."""


@dataclass(frozen=True)
class Marker:
    """A file a command writes into its output directory before anything else, which makes the
    directory its own: ``name``, read back as ``card`` (a typed model, at most ``max_bytes``)
    through :mod:`pairsim.untrusted`. A file of that name that does not parse as ``card`` — a
    user's own ``index.json``, say — proves nothing."""

    name: str
    card: type[BaseModel]
    max_bytes: int = untrusted.MAX_CARD_BYTES

    def read(self, directory: LocationLike, error: type[Exception] = untrusted.UntrustedFileError) -> BaseModel:
        """The marker in ``directory``, parsed; ``error`` naming the file when it is no card
        of this command's (a link, unreadable, not JSON, a field wrong)."""
        location = Location.of(directory) / self.name
        if location.is_local and os.path.islink(location.path):
            raise error(f"{location}: a symbolic link, not a file pairsim writes")
        return untrusted.read_model(location, self.card, self.max_bytes, error)


def claim_directory(out: LocationLike, what: str, owned_by: Iterable[Marker], ignored: Iterable[str] = ()) -> Location:
    """``out`` as a directory this command may write into (returned): absent, empty (but for
    ``ignored`` files, e.g. a lock), or holding one of the ``owned_by`` markers, each read back
    as its card. :class:`OutputRefused` naming ``what`` otherwise: a link, a file, a foreign
    directory, a marker's name on a file that is not its card."""
    if isinstance(out, Path | str) and not storage.is_uri(out) and os.path.islink(out):  # Location.of resolves links
        raise OutputRefused(f"{what} {out}: a symbolic link; give the directory it leads to "
                            f"({os.path.realpath(out)}) if that is meant")
    location = Location.of(out)
    owned_by, ignored = tuple(owned_by), tuple(ignored)
    kind = location.info().type
    if kind == pafs.FileType.NotFound:
        _check_writable(location, what)
        return location
    if kind != pafs.FileType.Directory:
        raise OutputRefused(f"{what} {location}: not a directory ({_kind(location)}); choose a new or empty directory")
    for marker in owned_by:
        if (location / marker.name).info().type == pafs.FileType.NotFound:
            continue
        try:
            marker.read(location)
        except untrusted.UntrustedFileError as exc:
            raise OutputRefused(f"{what} {location}: its {marker.name} is not one pairsim wrote "
                                f"({shown(' '.join(str(exc).split()), 300)}); writing there could replace a user's "
                                "files; choose a new or empty directory") from None
        _check_writable(location, what)
        return location
    if foreign := [f for f in location.files(recursive=True) if f.name not in ignored]:
        raise OutputRefused(f"{what} {location}: not empty, and not an output of this command (no "
                            f"{' or '.join(m.name for m in owned_by)}; {len(foreign)} files, e.g. {foreign[0]}): "
                            "writing there could replace or delete them; choose a new or empty directory")
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
        raise OutputRefused(f"{what} {path}: {file_kind(mode)}, not a file pairsim can write; give a file path")
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
            return file_kind(os.lstat(location.path).st_mode)
        except OSError:
            pass
    return "a file"
