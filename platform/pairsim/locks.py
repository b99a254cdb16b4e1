"""One writer per name: a lock file under a run's (or a shard build's) storage location, held
while the run lives, so that a second ``train`` under a live run's ``ray.run_name`` (or a second
``shards build`` into the same ``--out``) is refused in seconds instead of mixing into it.

The lock is created only if absent (:meth:`pairsim.storage.Location.create`: ``O_EXCL`` on a
local or shared filesystem, a conditional put on S3) and holds who has it (user, host, pid, start
time, command) and a heartbeat the holder rewrites every :data:`HEARTBEAT_S` seconds. A lock
whose holder is gone is taken over with a warning: on the holder's own host when its pid is no
longer alive, from anywhere when its heartbeat is older than :data:`STALE_AFTER_S`. Two starts
taking over the same stale lock at once each re-read it before removing it; between that read
and the removal (a few milliseconds) one could still remove the other's fresh lock.

A lock file is read as untrusted input (:func:`pairsim.untrusted.read_model`): anything but what
pairsim writes — too large, not JSON, a field missing or of another type, a time that is not one
(``heartbeat`` or ``started`` later than now by more than :data:`CLOCK_SKEW_S`), a symbolic link
in the lock's place (never followed, nor created through) — is not taken over but refused, naming
it (:class:`NameInUse`): a lock pairsim cannot read may belong to a live run, which a takeover
would corrupt. What it says of its holder is printed cut and escaped (:func:`pairsim.errors.shown`).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pairsim import storage
from pairsim.config import ConfigError
from pairsim.errors import InputError, shown
from pairsim.log import get_logger
from pairsim.storage import Location, LocationLike
from pairsim.untrusted import UntrustedFileError, read_model

logger = get_logger("locks")

HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats: the holder's machine is gone or cut off
MAX_LOCK_BYTES = 4096  # a lock file as pairsim writes it: a few hundred bytes
CLOCK_SKEW_S = 300.0  # how far ahead of this host's clock another holder's may run; later times are no lock's


class NameInUse(ConfigError):
    """The name (a run's ``ray.run_name``, a build's ``--out``) is held by a live holder."""


class Holder(BaseModel):
    """Who holds a lock, as its file says; every field of the type pairsim writes (strict)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    user: str
    host: str
    pid: int = Field(gt=0, lt=2**31)  # a pid_t that os.kill takes
    started: str  # ISO 8601, UTC
    command: str
    token: str
    heartbeat: float = Field(ge=0.0)  # time.time() of the holder's last rewrite

    @field_validator("heartbeat")
    @classmethod
    def _heartbeat_now_or_before(cls, heartbeat: float) -> float:
        _not_ahead(heartbeat)
        return heartbeat

    @field_validator("started")
    @classmethod
    def _started_a_time_now_or_before(cls, started: str) -> str:
        try:
            when = datetime.fromisoformat(started)
        except ValueError:
            raise ValueError("not a time in ISO 8601 (e.g. 2026-01-01T00:00:00+00:00)") from None
        if when.tzinfo is None:
            raise ValueError("a time without its time zone")
        _not_ahead(when.timestamp())
        return started

    @classmethod
    def me(cls) -> Holder:
        now = time.time()
        return cls(user=getpass.getuser(), host=socket.gethostname(), pid=os.getpid(),
                   started=datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
                   command=" ".join(sys.argv)[:500], token=uuid.uuid4().hex, heartbeat=now)

    @classmethod
    def read(cls, location: Location) -> Holder:
        """The holder the lock file at ``location`` names; :class:`~pairsim.untrusted.UntrustedFileError`
        naming it when it is a symbolic link (not followed), cannot be read or is not a lock
        pairsim writes."""
        if location.is_local and os.path.islink(location.path):
            raise UntrustedFileError(f"{location}: a symbolic link (to {shown(os.readlink(location.path))}), not a lock "
                                     "pairsim writes")
        return read_model(location, cls, MAX_LOCK_BYTES)

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    def describe(self) -> str:
        """Who holds the lock, as its file says, cut and escaped: ``user@host pid N since T (command)``."""
        return (f"{shown(self.user, 80)}@{shown(self.host, 80)} pid {self.pid} since {shown(self.started, 80)} "
                f"({shown(self.command)})")

    def gone(self) -> str | None:
        """Why this holder is no longer holding (its process ended here, or its heartbeat
        stopped), or None when it may be alive."""
        if self.host == socket.gethostname() and not _pid_alive(self.pid):
            return f"its process {self.pid} on this host has ended"
        silent = time.time() - self.heartbeat
        if silent > STALE_AFTER_S:
            return f"its heartbeat stopped {silent:.0f} s ago"
        return None


def _not_ahead(timestamp: float) -> None:
    """ValueError unless ``timestamp`` is at most :data:`CLOCK_SKEW_S` ahead of this host's clock:
    a lock's time later than that was written by no holder (a heartbeat of 1e300 would make a lock
    that never goes stale)."""
    ahead = timestamp - time.time()
    if ahead > CLOCK_SKEW_S:
        raise ValueError(f"{ahead:.3g} s ahead of this host's clock (at most {CLOCK_SKEW_S:g} s of clock skew is taken)")


def _present(location: Location) -> bool:
    """Whether something is in the lock's place: a file, or a link (followed or not)."""
    return os.path.lexists(location.path) if location.is_local else location.is_file()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class Lock:
    """A held lock: :meth:`release` it (or leave the ``with`` block of :func:`hold`)."""

    def __init__(self, location: Location, holder: Holder):
        self.location, self.holder = location, holder
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="pairsim-lock-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                if self._still_mine():
                    self.holder = self.holder.model_copy(update={"heartbeat": time.time()})
                    self.location.write_bytes(self.holder.to_json())

    def _still_mine(self) -> bool:
        try:
            return Holder.read(self.location).token == self.holder.token
        except UntrustedFileError:
            return False

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, unless another holder took it over."""
        self._stop.set()
        self._beat.join()
        with contextlib.suppress(OSError):
            if self._still_mine():
                self.location.delete()


def acquire(location: LocationLike, what: str) -> Lock:
    """Hold the lock file ``location`` for ``what`` (e.g. ``ray.run_name 'x'``), taking over one
    whose holder is gone; :class:`NameInUse` naming the holder when it is alive, or the file when
    it is not a lock pairsim can read; :class:`~pairsim.errors.InputError` naming it when it
    cannot be created there (a read-only place)."""
    location = _unresolved(location)
    me = Holder.me()
    for _ in range(2):
        try:
            if location.create(me.to_json()):
                return Lock(location, me)
        except OSError as exc:
            raise InputError(f"{what}: the lock {location} cannot be created ({exc.strerror or exc}); "
                             "choose a place this user can write") from None
        try:
            holder = Holder.read(location)
        except UntrustedFileError as exc:
            if not _present(location):  # released between the two calls
                continue
            problem = " ".join(str(exc).split())  # one line: a field error lists each on its own; names the file
            raise NameInUse(f"{what}: not a readable pairsim lock: {problem}; if no run holds it, delete it") from None
        reason = holder.gone()
        if reason is None:
            raise NameInUse(f"{what} is in use by {holder.describe()}; wait for it to end, stop it, or choose "
                            f"another name (lock: {location})")
        logger.warning("%s: taking over the lock of %s: %s", what, holder.describe(), reason)
        with contextlib.suppress(OSError, UntrustedFileError):
            if Holder.read(location) == holder:  # not a fresh lock another start just took
                location.delete()
    raise NameInUse(f"{what}: another start took the lock {location} at the same moment")


def _unresolved(location: LocationLike) -> Location:
    """``location`` as a :class:`Location` whose last part is not resolved: a link in the lock's
    place stays a link, named by :meth:`Holder.read` (:meth:`Location.of` follows links)."""
    if isinstance(location, Location) or storage.is_uri(location):
        return Location.of(location)
    return Location.of(Path(location).parent) / Path(location).name


@contextlib.contextmanager
def hold(location: LocationLike, what: str) -> Iterator[Lock]:
    """:func:`acquire` for the ``with`` block, released however it ends."""
    lock = acquire(location, what)
    try:
        yield lock
    finally:
        lock.release()
