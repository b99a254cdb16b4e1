"""Argument types and flags the commands share: paths, locations (a path or an object-store URI),
bounded integers, an MLflow tracking URI, ``--set`` overrides."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from pairsim import storage
from pairsim.config import check_tracking_uri
from pairsim.errors import shown
from pairsim.untrusted import is_plain_name


def path_arg(value: str) -> Path:
    """A local path argument: not empty (it would mean this directory) and without a NUL byte."""
    if not value.strip() or "\x00" in value:
        raise argparse.ArgumentTypeError(f"not a usable path: {value[:80]!r}")
    return Path(value)


def name_arg(value: str) -> str:
    """A name argument (a split, an MLflow run id or registered model): one plain name
    (:data:`pairsim.untrusted.PLAIN_NAME`: letters, digits, ``_ . -``, at most 200), checked
    before any work, as a name read from a file is."""
    if not is_plain_name(value):
        raise argparse.ArgumentTypeError(f"not a plain name (letters, digits, _ . -; at most 200): {shown(value, 80)!r}")
    return value


def location_arg(value: str) -> str | Path:
    """An argument that is a local path (:func:`path_arg`) or an object-store URI
    (:func:`pairsim.storage.parse`)."""
    path_arg(value)
    try:
        return storage.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer argument of at least ``minimum`` (and at most ``maximum``): argparse refuses
    another, naming the flag."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {value[:80]!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {number}")
        if maximum is not None and number > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,}, got {number:,}")
        return number

    return parse


def tracking_uri_arg(value: str) -> str:
    """``--tracking-uri``: refused with credentials in it (:func:`pairsim.config.check_tracking_uri`)."""
    try:
        return check_tracking_uri(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_overrides(parser: argparse.ArgumentParser,
                  help: str = "dotted override, e.g. --set loss.base.margin=0.3 (repeatable)") -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)
