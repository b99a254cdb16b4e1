"""Signals that stop a pairsim command or job: SIGTERM (``ray job stop``, a scheduler's stop,
``kill``) and, for the command line, SIGINT (Ctrl-C), turned into :class:`JobStopped`, which
unwinds the run, which then ends KILLED in MLflow. (Joining the cluster with pairsim shipped to
its workers is :func:`pairsim.cluster.join_cluster`.)

This module imports only the standard library: the command line imports it before it knows the
command.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class JobStopped(KeyboardInterrupt):
    """The driver got SIGTERM (``ray job stop``, a scheduler's stop, ``kill``) or, under
    ``stop_on_signals(sigint=True)``, SIGINT (Ctrl-C). A ``KeyboardInterrupt``, so ``except
    Exception`` handlers let it through; ``signum`` is the signal (the CLI exits 128 + it)."""

    def __init__(self, message: str = "stopped by SIGTERM", signum: int = signal.SIGTERM):
        super().__init__(message)
        self.signum = signum

    @classmethod
    def by(cls, signum: int) -> JobStopped:
        return cls(f"stopped by {signal.Signals(signum).name}", signum)


class _Handler:
    """The signals' handler: it raises :class:`JobStopped` and remembers that it did."""

    def __init__(self):
        self.stopped: JobStopped | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.stopped = JobStopped.by(signum)
        raise self.stopped


@contextmanager
def stop_on_signals(sigint: bool = False) -> Iterator[None]:
    """Within the block SIGTERM (and SIGINT if ``sigint``) raises :class:`JobStopped` in the main
    thread. Ray checks for signals while it waits (``trainer.fit()`` waits in ``ray.get``) and
    may raise a plain ``KeyboardInterrupt`` instead, which leaves the block as the ``JobStopped``
    it was (a SIGINT's when none was seen: Python's own Ctrl-C).

    Ray's core worker installs a SIGTERM handler of its own at ``ray.init`` (it logs a stack
    trace and aborts); :func:`pairsim.cluster.connect` puts this one back right after.
    Afterwards the previous Python handlers are back, or the defaults. ``ray job stop`` SIGKILLs
    the driver ``RAY_JOB_STOP_WAIT_TIME_S`` (3 by default, set on the head) after SIGTERM: the
    run's ending must fit in that grace. Outside the main thread (where Python allows no
    handler) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _Handler()
    signums = (signal.SIGTERM, signal.SIGINT) if sigint else (signal.SIGTERM,)
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    except KeyboardInterrupt as exc:
        if exc is handler.stopped:
            raise
        if handler.stopped is not None:
            raise handler.stopped from exc
        if isinstance(exc, JobStopped):  # an inner block's
            raise
        raise JobStopped.by(signal.SIGINT) from exc
    finally:
        for signum, before in previous.items():
            signal.signal(signum, signal.SIG_DFL if before is None else before)  # None: not Python's
