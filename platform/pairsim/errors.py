"""The two kinds of failure a ``pairsim`` command reports in one line (:func:`pairsim.cli.main`):
:class:`InputError` — what the user gave cannot be used, refused with exit status 2 — and the
runtime failures of work that started (exit status 1), each module's own class. Anything else
is a bug and keeps its traceback."""

from __future__ import annotations


class InputError(ValueError):
    """A flag, config, file, directory or name the user gave that pairsim refuses; the message
    names it and says what is wrong. Exit status 2."""


MAX_SHOWN = 200  # characters of a value from a user's file that a message or a listing shows


def shown(value: object, limit: int = MAX_SHOWN) -> str:
    """``value`` as pairsim prints text it did not write (a caption, an id, a line of a file, a
    lock's holder): cut to ``limit`` characters (then "… (N more)") and every character that is
    not printable escaped (``\\n``, ``\\x1b``), so no input can add a line, move the cursor or
    fill the terminal."""
    text = str(value)
    cut = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[:limit])
    return cut + (f"… ({len(text) - limit:,} more)" if len(text) > limit else "")


def described(exc: BaseException) -> str:
    """A third-party exception as one line of a pairsim message: its type and the first line of
    its text, :func:`shown` (an SQL statement, a C++ trace or a file's bytes stay out)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {shown(text.splitlines()[0])}" if text else type(exc).__name__
