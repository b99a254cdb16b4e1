"""The two kinds of failure a ``pairsim`` command reports in one line (:func:`pairsim.cli.main`):
:class:`InputError` — what the user gave cannot be used, refused with exit status 2 — and the
runtime failures of work that started (exit status 1), each module's own class. Anything else
is a bug and keeps its traceback."""

from __future__ import annotations


class InputError(ValueError):
    """A flag, config, file, directory or name the user gave that pairsim refuses; the message
    names it and says what is wrong. Exit status 2."""
