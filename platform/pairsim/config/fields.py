"""The building blocks of every config model: strict numbers, locations, the section base,
registered names and the error every bad config raises."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Strict, ValidationError
from pydantic_core import PydanticCustomError

from pairsim import storage
from pairsim.errors import InputError
from pairsim.registry import Registry

# Numbers and flags are taken as written: no bool for a number, no string for either, no float
# for an int (an int for a float is fine: ``lr: 1``); floats must be finite (``allow_inf_nan``).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]


def _path_or_uri(value: Any) -> Any:
    try:
        return storage.parse(value) if isinstance(value, (str, Path)) else value
    except ValueError as exc:
        raise PydanticCustomError("location", "{problem}", {"problem": str(exc)}) from None


PathOrUri = Annotated[Path | str, BeforeValidator(_path_or_uri)]
"""A local path (a ``Path``) or an object-store URI such as ``s3://bucket/key`` (a ``str``, see
:mod:`pairsim.storage`): the scheme is checked and credentials in it are refused."""


class ConfigError(InputError):
    """A run configuration that cannot be used; the message lists every problem."""


class Section(BaseModel):
    """The base of every config section, and of the ``Params`` of registered entries (base
    losses, structures, teachers): unknown keys refused, strict finite numbers."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def registered(registry: Registry) -> AfterValidator:
    """A name of ``registry``; others are refused naming the registered ones."""
    def check(name: str) -> str:
        if name not in registry:
            raise PydanticCustomError("unregistered", "not a registered name (registered: {names})",
                                      {"names": ", ".join(registry.names())})
        return name
    return AfterValidator(check)


MAX_ERRORS_SHOWN = 20  # a file that is no config (a password file, a log) is not echoed line by line
EXCERPT = 200  # characters of a key or value shown in an error


def format_errors(err: ValidationError, source: str) -> str:
    """``err`` as one message: a line per problem, each with its dotted key and the value given
    (URIs masked), headed by how many there are and ``source``."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])[:EXCERPT] or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key")
        else:
            got = e.get("input")
            shown = repr(storage.masked(got) if storage.is_uri(got) else got)
            shown = shown if len(shown) <= EXCERPT else shown[:EXCERPT] + f"… ({len(shown):,} characters)"
            lines.append(f"{path}: {e['msg']} (got {shown})")
    return error_list(lines, source)


def error_list(lines: list[str], source: str) -> str:
    """Problems as one message headed by their count and ``source``, the first
    :data:`MAX_ERRORS_SHOWN` of them listed, a line each."""
    more = [f"… and {len(lines) - MAX_ERRORS_SHOWN} more"] if len(lines) > MAX_ERRORS_SHOWN else []
    return f"{len(lines)} error(s) in {source}:\n  " + "\n  ".join(lines[:MAX_ERRORS_SHOWN] + more)
