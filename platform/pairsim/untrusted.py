"""Reading back what pairsim wrote — manifests, model cards, checksum files, build markers, sweep
state, lock files — as untrusted input. On shared storage another user, a crashed writer or an
attacker may have changed any of it, so each file is read here: bounded in size, parsed as JSON
(never unpickled), validated into a typed model that names every wrong field, and every name in
it that becomes a path resolved under its root (:func:`child`). A file whose bytes pairsim
vouches for by a digest it recorded is checked with :func:`verify_digest` before it is used.

Which files of a run, sweep or dataset directory are as trusted as code: docs/reliability.md."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from pairsim.config import format_errors
from pairsim.errors import InputError, described, shown
from pairsim.storage import Location, LocationLike

MAX_CARD_BYTES = 1 << 20  # a card or marker as pairsim writes it: a few kB
PLAIN_NAME = r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}"  # one directory level: no '..', no hidden name, no separator


class UntrustedFileError(InputError):
    """A file read back that is not what pairsim writes: unreadable, too large, not JSON, a field
    missing or of the wrong type, a name leaving its root, or bytes that differ from their digest."""


Model = TypeVar("Model", bound=BaseModel)


def read_json(source: LocationLike, max_bytes: int, error: type[Exception] = UntrustedFileError) -> Any:
    """The JSON tree of the file at ``source``, read up to ``max_bytes``; ``error`` naming the
    file when it cannot be read, is larger, or is not UTF-8 JSON."""
    location = Location.of(source)
    data = location.read_bounded(max_bytes, error, "not a file pairsim writes")
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
    except DuplicateKey as exc:
        raise error(f"{location}: not JSON pairsim writes ({exc})") from None
    except ValueError as exc:  # not UTF-8 or not JSON
        raise error(f"{location}: not JSON ({exc})") from None
    except RecursionError:
        raise error(f"{location}: not JSON pairsim writes (nested too deeply)") from None


class DuplicateKey(ValueError):
    """A JSON object with a key twice: the second would silently replace the first."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in pairs:
        if key in tree:
            raise DuplicateKey(f"the key '{shown(key, 80)}' appears twice in one object")
        tree[key] = value
    return tree


def read_model(source: LocationLike, kind: type[Model], max_bytes: int,
               error: type[Exception] = UntrustedFileError) -> Model:
    """The file at ``source`` (:func:`read_json`) as ``kind``; ``error`` naming the file and every
    wrong field otherwise."""
    tree = read_json(source, max_bytes, error)
    try:
        return kind.model_validate(tree)
    except ValidationError as exc:
        raise error(format_errors(exc, str(Location.of(source)))) from None


def read_json_lines(source: LocationLike, row: Any, max_bytes: int,
                    error: type[Exception] = UntrustedFileError) -> list[Any]:
    """The lines of the JSON Lines file at ``source`` (:func:`read_json`'s bounds), each validated
    as ``row`` (a type pydantic knows, e.g. ``dict[str, str]``); ``error`` naming the file and
    the first wrong line otherwise."""
    location = Location.of(source)
    data = location.read_bounded(max_bytes, error, "not a file pairsim writes")
    adapter, rows, number = TypeAdapter(row), [], 1
    try:
        for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
            rows.append(adapter.validate_python(json.loads(line, object_pairs_hook=_unique_keys), strict=True))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, or not a row (ValidationError)
        raise error(f"{location}: line {number} is not what pairsim writes "
                    f"({shown(str(exc).splitlines()[0])})") from None
    return rows


@contextlib.contextmanager
def parsing(source: LocationLike, what: str, error: type[Exception] = UntrustedFileError) -> Iterator[None]:
    """The ``with`` block hands bytes read from ``source`` to a third-party parser (pyarrow,
    faiss, PIL): whatever the parser raises on bytes it cannot read becomes ``error`` naming
    the file and ``what`` it should be, in one line."""
    try:
        yield
    except (ValueError, RuntimeError, TypeError, OSError, EOFError, MemoryError) as exc:  # pyarrow's, faiss's
        if isinstance(exc, error):
            raise
        raise error(f"{source}: not {what} pairsim can read ({described(exc)})") from None


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is one plain directory or file name (:data:`PLAIN_NAME`)."""
    return isinstance(name, str) and re.fullmatch(PLAIN_NAME, name) is not None


def child(root: LocationLike, name: str, what: str, error: type[Exception] = UntrustedFileError) -> Location:
    """``root / name`` for a ``name`` read from a file (a split, a shard, a trial): ``error``
    naming ``what`` unless it is one plain name, so the path stays under ``root``."""
    if not is_plain_name(name):
        raise error(f"{what}: '{shown(name, 80)}' is not a plain file or directory name; it could lead outside "
                    f"{root}")
    return Location.of(root) / name


def sha256(source: LocationLike) -> str:
    """The SHA-256 of the file at ``source``, read in blocks."""
    stream, _ = Location.of(source).open_input()
    with stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def verify_digest(source: LocationLike, expected: str, error: type[Exception] = UntrustedFileError) -> None:
    """``error`` unless the file at ``source`` has the SHA-256 ``expected`` (recorded when pairsim
    wrote it): a file reused or loaded on the strength of that record is checked first."""
    location = Location.of(source)
    try:
        found = sha256(location)
    except OSError as exc:
        raise error(f"{location}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if found != expected:
        raise error(f"{location}: its content differs from the SHA-256 pairsim recorded when it wrote it "
                    "(altered or cut short since)")
