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
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone

from pairsim.config import ConfigError
from pairsim.log import get_logger
from pairsim.storage import Location, LocationLike

logger = get_logger("locks")

HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats: the holder's machine is gone or cut off


class NameInUse(ConfigError):
    """The name (a run's ``ray.run_name``, a build's ``--out``) is held by a live holder."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its file says."""

    user: str
    host: str
    pid: int
    started: str  # ISO 8601, UTC
    command: str
    token: str
    heartbeat: float  # time.time() of the holder's last rewrite

    @classmethod
    def me(cls) -> Holder:
        now = time.time()
        return cls(getpass.getuser(), socket.gethostname(), os.getpid(),
                   datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
                   " ".join(sys.argv)[:500], uuid.uuid4().hex, now)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            fields = json.loads(text)
            return cls(**{k: fields[k] for k in cls.__dataclass_fields__})
        except (ValueError, TypeError, KeyError):
            return None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    def describe(self) -> str:
        return f"{self.user}@{self.host} pid {self.pid} since {self.started} ({self.command})"

    def gone(self) -> str | None:
        """Why this holder is no longer holding (its process ended here, or its heartbeat
        stopped), or None when it may be alive."""
        if self.host == socket.gethostname() and not _pid_alive(self.pid):
            return f"its process {self.pid} on this host has ended"
        silent = time.time() - self.heartbeat
        if silent > STALE_AFTER_S:
            return f"its heartbeat stopped {silent:.0f} s ago"
        return None


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
                    self.holder = replace(self.holder, heartbeat=time.time())
                    self.location.write_bytes(self.holder.to_json())

    def _still_mine(self) -> bool:
        try:
            found = Holder.parse(self.location.read_text())
        except (OSError, UnicodeDecodeError):
            return False
        return found is not None and found.token == self.holder.token

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, unless another holder took it over."""
        self._stop.set()
        self._beat.join()
        with contextlib.suppress(OSError):
            if self._still_mine():
                self.location.delete()


def acquire(location: LocationLike, what: str) -> Lock:
    """Hold the lock file ``location`` for ``what`` (e.g. ``ray.run_name 'x'``), taking over one
    whose holder is gone; :class:`NameInUse` naming the holder when it is alive."""
    location = Location.of(location)
    me = Holder.me()
    for _ in range(2):
        if location.create(me.to_json()):
            return Lock(location, me)
        try:
            text = location.read_text()
        except FileNotFoundError:  # released between the two calls
            continue
        except (OSError, UnicodeDecodeError) as exc:
            raise NameInUse(f"{what}: the lock {location} cannot be read ({exc}); if no run holds it, "
                            "delete it") from None
        holder = Holder.parse(text)
        if holder is None:
            raise NameInUse(f"{what}: {location} is not a pairsim lock; if no run holds it, delete it")
        reason = holder.gone()
        if reason is None:
            raise NameInUse(f"{what} is in use by {holder.describe()}; wait for it to end, stop it, or choose "
                            f"another name (lock: {location})")
        logger.warning("%s: taking over the lock of %s: %s", what, holder.describe(), reason)
        with contextlib.suppress(OSError):
            if Holder.parse(location.read_text()) == holder:  # not a fresh lock another start just took
                location.delete()
    raise NameInUse(f"{what}: another start took the lock {location} at the same moment")


@contextlib.contextmanager
def hold(location: LocationLike, what: str) -> Iterator[Lock]:
    """:func:`acquire` for the ``with`` block, released however it ends."""
    lock = acquire(location, what)
    try:
        yield lock
    finally:
        lock.release()
