"""Where data and checkpoints live: a local path or an object-store URI (``s3://bucket/key``,
``gs://…``, any scheme ``pyarrow.fs`` opens), behind one small :class:`Location`.

URIs are opened with :meth:`pyarrow.fs.FileSystem.from_uri`, so S3 reads its endpoint and
credentials from the usual environment (``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``). Credentials written
into a URI or the endpoint are refused (:func:`check_uri`): they would end up in configs, MLflow
params and logs (and pyarrow's S3 takes none from an endpoint).
A :class:`Location` pickles with its filesystem's endpoint and options but not with credentials
resolved from the environment, so Ray tasks and workers reach the same store.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import BinaryIO
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pyarrow.fs as pafs

SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")  # pyarrow.fs's own filesystems
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SECRET_PARAM = re.compile(r"secret|token|password|passwd|credential|signature|key", re.IGNORECASE)
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # where pyarrow's S3 finds its endpoint
_FS_SCHEME = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs", "abfs": "abfs"}  # pyarrow type_name -> URI scheme


class NotARegularFile(OSError):
    """A path that names a named pipe, a device, a socket or a directory where a file is read."""

    def __init__(self, path: str, kind: str):
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", path)


def file_kind(mode: int) -> str:
    """What ``st_mode`` says a path is: "a directory", "a named pipe", "a file", …"""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a file")):
        if test(mode):
            return name
    return "not a regular file"


def is_uri(value: str | Path) -> bool:
    return isinstance(value, str) and _URI.match(value) is not None


def masked(uri: str) -> str:
    """``uri`` with a password in its user info (``user:***@``, ``***@`` for a lone token), the
    values of secret-looking query parameters and the user info of endpoints in query values
    (``endpoint_override=http://user:***@host``) replaced by ``***``, for messages; ``uri`` itself
    when it carries none."""
    if not has_credentials(uri):
        return uri
    parts = urllib.parse.urlsplit(uri)
    query = "&".join(f"{k}={'***' if _SECRET_PARAM.search(k) else _masked_endpoint(v)}"
                     for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return urllib.parse.urlunsplit(parts._replace(netloc=_masked_user_info(parts.netloc), query=query))


def _masked_user_info(authority: str) -> str:
    """``user:***@host`` for ``user:password@host``, ``***@host`` for ``token@host``."""
    if "@" not in authority:
        return authority
    user, host = authority.rsplit("@", 1)
    return f"{user.split(':', 1)[0]}:***@{host}" if ":" in user else f"***@{host}"


def _masked_endpoint(value: str) -> str:
    """A query value with the user info of the endpoint it may name (``[scheme://]user:password@host``) masked."""
    scheme, sep, rest = value.rpartition("://")
    authority, slash, tail = rest.partition("/")
    return scheme + sep + _masked_user_info(authority) + slash + tail


def check_uri(uri: str) -> str:
    """``uri`` when its scheme is one pyarrow.fs opens and neither it nor, for ``s3://``, the
    endpoint the environment names carries credentials; else ValueError naming the problem
    (with the URI or endpoint masked)."""
    match = _URI.match(uri)
    if match is None or not uri[match.end():].strip("/"):
        raise ValueError(f"{masked(uri)}: names no bucket or path after its scheme (e.g. s3://bucket/data)")
    scheme = match.group(1).lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{masked(uri)}: unsupported scheme {scheme!r} (a local path or one of "
                         f"{', '.join(s + '://' for s in SCHEMES)})")
    if has_credentials(uri):
        raise ValueError(f"{masked(uri)}: credentials do not belong in the URI; set them in the environment "
                         "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, …)")
    for name in ENDPOINT_VARS if scheme == "s3" else ():
        if has_credentials(endpoint := os.environ.get(name, "")):
            raise ValueError(f"{name}={masked(endpoint)}: credentials do not belong in the endpoint; set them in "
                             "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    return uri


def has_credentials(uri: str) -> bool:
    """Whether ``uri`` carries user info (``user:password@``), secret-looking query parameters or
    an endpoint with user info in a query value (``endpoint_override=user:password@host``)."""
    parts = urllib.parse.urlsplit(uri)
    return "@" in parts.netloc or any(_SECRET_PARAM.search(k) or "@" in v
                                      for k, v in urllib.parse.parse_qsl(parts.query))


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    return next(p for p in (path, *path.parents) if p.exists())


def local_storage_problem(path: Path) -> str | None:
    """Why checkpoints cannot go to the absolute ``path`` (it cannot be created or written), or None."""
    existing = nearest_existing(path)
    if existing.is_dir() and os.access(existing, os.W_OK):
        return None
    return f"{path}: cannot be created or written ({existing} is {'a file' if existing.is_file() else 'read-only'})"


def parse(value: str | Path) -> str | Path:
    """A config value: a checked URI (str, kept as written) or a local path (Path); ``file://``
    URIs become local paths."""
    if isinstance(value, str) and value.startswith("file://"):
        return Path(urllib.parse.urlsplit(value).path)
    return check_uri(value).rstrip("/") if is_uri(value) else Path(value)


def absolute(value: str | Path) -> str | Path:
    """A URI as it is; a local path made absolute against this directory."""
    value = parse(value)
    return value if isinstance(value, str) else value.resolve()


@dataclass(frozen=True)
class Location:
    """A file or directory on a ``pyarrow.fs`` filesystem: ``path`` is the filesystem's own path
    (absolute for the local one, ``bucket/key`` for S3); ``uri`` is how it is shown."""

    fs: pafs.FileSystem
    path: str
    uri: str

    @classmethod
    def of(cls, value: str | Path | Location) -> Location:
        if isinstance(value, Location):
            return value
        value = absolute(value)
        if isinstance(value, Path):
            return cls(pafs.LocalFileSystem(), str(value), str(value))
        fs, path = pafs.FileSystem.from_uri(value)
        return cls(fs, path, value)

    @classmethod
    def on(cls, fs: pafs.FileSystem, path: str) -> Location:
        """``path`` on ``fs`` (e.g. a Ray Train checkpoint's), its URI rebuilt from the filesystem's type."""
        scheme = _FS_SCHEME.get(fs.type_name)
        return cls(fs, path, f"{scheme}://{path}" if scheme else path)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def parent(self) -> Location:
        return Location(self.fs, str(PurePosixPath(self.path).parent), self.uri.rsplit("/", 1)[0])

    def __truediv__(self, part: str) -> Location:
        return Location(self.fs, f"{self.path.rstrip('/')}/{part}", f"{self.uri.rstrip('/')}/{part}")

    def __str__(self) -> str:
        return self.uri

    def info(self) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path)

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def size(self) -> int | None:
        return self.info().size

    def files(self, suffix: str = "", recursive: bool = False) -> list[Location]:
        """The files in this directory whose names end in ``suffix``, sorted; [] when it is absent."""
        found = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True, recursive=recursive))
        return [Location(self.fs, i.path, f"{self.uri.rstrip('/')}/{i.path[len(self.path.rstrip('/')) + 1:]}")
                for i in sorted(found, key=lambda i: i.path)
                if i.type == pafs.FileType.File and i.base_name.endswith(suffix)]

    def open_input(self) -> tuple[BinaryIO, int | None]:
        """This file opened for reading, and its size (None where a store does not say): a regular file only. A named pipe, a
        device, a socket or a directory is refused (:class:`NotARegularFile`) without blocking
        on it: a local path is opened non-blocking and checked on the open descriptor."""
        if not self.is_local:
            info = self.info()
            if info.type != pafs.FileType.File:
                raise FileNotFoundError(errno.ENOENT, "not found", self.uri) if info.type == pafs.FileType.NotFound \
                    else NotARegularFile(self.uri, "a directory")
            return self.fs.open_input_stream(self.path), info.size
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mode, size = (st := os.fstat(fd)).st_mode, st.st_size
            if not stat.S_ISREG(mode):
                raise NotARegularFile(self.path, file_kind(mode))
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb"), size
        except BaseException:
            os.close(fd)
            raise

    def read_bytes(self) -> bytes:
        stream, _ = self.open_input()
        with stream:
            return stream.read()

    def read_bounded(self, max_bytes: int, error: type[Exception], too_big: str) -> bytes:
        """The file's bytes, at most ``max_bytes`` read and never more than it holds (a user's
        file may be anything; ``max_bytes`` may be a size read from another file): ``error``
        naming it when it is no regular file, cannot be read, or is larger ("larger than N
        bytes, ``too_big``")."""
        try:
            stream, size = self.open_input()
            with stream:
                if size is not None and size > max_bytes:
                    raise error(f"{self}: larger than {max_bytes:,} bytes, {too_big}")
                data = stream.read((max_bytes if size is None else size) + 1)  # +1: grown since, or larger
        except OSError as exc:
            raise error(f"{self}: cannot be read ({exc.strerror or exc})") from None
        if len(data) > max_bytes:
            raise error(f"{self}: larger than {max_bytes:,} bytes, {too_big}")
        return data

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def write_bytes(self, data: bytes) -> int:
        """Write atomically, a reader sees the old file or the new one: locally under a temporary
        name, then renamed; an object store publishes an object only once it is whole."""
        if self.is_local:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{self.path}.{uuid.uuid4().hex[:8]}.tmp"
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, self.path)
        else:
            with self.fs.open_output_stream(self.path) as f:
                f.write(data)
        return len(data)

    def write_text(self, text: str) -> int:
        return self.write_bytes(text.encode("utf-8"))

    def create(self, data: bytes) -> bool:
        """Write this file only if it does not exist; False when it does. Atomic on a local or
        shared filesystem (``O_CREAT | O_EXCL``) and on S3 (a conditional put, ``If-None-Match:
        *``). Other object stores have no conditional write through ``pyarrow.fs``: there the
        file is written after a check and read back, a window of about one round trip in which
        two writers can both see their own data."""
        if self.is_local:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        if self.fs.type_name == "s3":
            return self._s3_put_if_absent(data)
        if self.is_file():
            return False
        self.write_bytes(data)
        return self.read_bytes() == data

    def _s3_put_if_absent(self, data: bytes) -> bool:
        import boto3
        from botocore.exceptions import ClientError

        options = self.fs.__reduce__()[1][0]  # what the filesystem pickles with: endpoint, scheme, region
        endpoint = options["endpoint_override"]
        if endpoint and "://" not in endpoint:
            endpoint = f"{options['scheme']}://{endpoint}"
        bucket, key = self.path.split("/", 1)
        client = boto3.client("s3", endpoint_url=endpoint or None, region_name=options["region"] or None)
        try:
            client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        return True

    def delete(self) -> None:
        """Remove this file; nothing when it is not there."""
        if self.is_file():
            self.fs.delete_file(self.path)

    @contextlib.contextmanager
    def local_copy(self) -> Iterator[Path]:
        """This file or directory as a local path: itself when local, else downloaded to a
        temporary directory for the ``with`` block."""
        if self.is_local:
            yield Path(self.path)
            return
        if self.info().type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{self.uri}: not found")
        with tempfile.TemporaryDirectory(prefix="pairsim-") as tmp:
            local = Path(tmp) / self.name
            pafs.copy_files(self.path, str(local), source_filesystem=self.fs,
                            destination_filesystem=pafs.LocalFileSystem())
            yield local


LocationLike = str | Path | Location  # what functions that take a location accept


def filesystem_and_paths(locations: list[Location]) -> tuple[pafs.FileSystem, list[str]]:
    """One filesystem and its paths for readers that take both (``pyarrow.parquet``, Ray Data)."""
    return locations[0].fs, [loc.path for loc in locations]
