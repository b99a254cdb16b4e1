"""How a pairsim job stops: ``ray job stop`` (SIGTERM to the driver) turned into an exception
that unwinds the run, which then ends KILLED in MLflow. (Joining the cluster with pairsim
shipped to its workers is :func:`pairsim.cluster.join_cluster`.)

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
    """The driver got SIGTERM (``ray job stop``, a scheduler's stop, ``kill``). A
    ``KeyboardInterrupt``, so ``except Exception`` handlers let it through."""


class _Handler:
    """SIGTERM's handler: it raises :class:`JobStopped` and remembers that it did."""

    def __init__(self):
        self.stopped: JobStopped | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.stopped = JobStopped(f"stopped by {signal.Signals(signum).name}")
        raise self.stopped


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`JobStopped` in the main thread. Ray checks for
    signals while it waits (``trainer.fit()`` waits in ``ray.get``) and raises a plain
    ``KeyboardInterrupt`` instead, which leaves the block as the ``JobStopped`` it was.

    Enter it after ``ray.init``: Ray's core worker installs a SIGTERM handler of its own (it
    logs a stack trace and dies), which this one replaces; afterwards the previous Python
    handler is back, or the default one. ``ray job stop`` SIGKILLs the driver
    ``RAY_JOB_STOP_WAIT_TIME_S`` (3 by default, set on the head) after SIGTERM: the run's ending
    must fit in that grace. Outside the main thread (where Python allows no handler) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _Handler()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except KeyboardInterrupt as exc:
        if handler.stopped is None or exc is handler.stopped:
            raise
        raise handler.stopped from exc
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: not Python's
