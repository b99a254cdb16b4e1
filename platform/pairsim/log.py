"""pairsim's logging: one ``pairsim`` logger hierarchy (``pairsim.train``, ``pairsim.data``, …).

The level comes from ``--log-level`` on the command line, else the ``PAIRSIM_LOG_LEVEL``
environment variable, else INFO; training workers get the driver's level with their config.
Messages go to the process's real stderr: Ray Train V2 patches ``sys.stdout`` and
``sys.stderr`` in its workers and would echo every line twice.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from pairsim.config import ConfigError

ENV_VAR = "PAIRSIM_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# other libraries' warnings a user can do nothing about, each printed by every worker of every
# run: (category, message regex, why)
QUIETED_WARNINGS = [
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
     "DeepSpeed's ZeRO calls it at every step (pairsim's own gathers use all_gather_single)"),
]


def duration(seconds: float) -> str:
    """``1h05m`` or ``4m07s``: durations on progress lines."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def get_logger(name: str) -> logging.Logger:
    """The ``pairsim.<name>`` logger."""
    return logging.getLogger(f"pairsim.{name}")


def resolve_level(level: str | None = None) -> str:
    """``level``, else ``PAIRSIM_LOG_LEVEL``, else INFO; refuses names that are not levels."""
    chosen = (level or os.environ.get(ENV_VAR) or "INFO").upper()
    if chosen not in LEVELS:
        raise ConfigError(f"log level {chosen!r} is not one of {', '.join(LEVELS)} (--log-level or {ENV_VAR})")
    return chosen


def setup(level: str | None = None) -> str:
    """Give the ``pairsim`` logger one handler at ``level`` (see :func:`resolve_level`); safe
    to call again, in the driver and in every worker; silences :data:`QUIETED_WARNINGS`.
    Returns the level set."""
    chosen = resolve_level(level)
    for category, message, _ in QUIETED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    root = logging.getLogger("pairsim")
    root.setLevel(chosen)
    if not any(getattr(h, "_pairsim", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.__stderr__)
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        handler._pairsim = True
        root.addHandler(handler)
        root.propagate = False
    return chosen
