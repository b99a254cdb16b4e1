"""The building blocks of every config model: strict numbers, locations, tracking URIs, the
section base, registered names and the error every bad config raises."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Strict, ValidationError
from pydantic_core import PydanticCustomError

from pairsim import storage
from pairsim.errors import InputError, shown

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


TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc")
"""The MLflow tracking stores pairsim accepts (a driver after ``+``, as in ``postgresql+psycopg``,
is the store's own choice). Not ``file:``: MLflow ≥ 3.13 refuses a file store, and its artifacts
would land wherever the URI points."""


def check_tracking_uri(uri: str) -> str:
    """``uri`` when it names a tracking store MLflow serves (:data:`TRACKING_SCHEMES`, at most
    2,048 characters) and carries no credentials; else ValueError (with the URI masked) naming
    what is wrong: a tracking URI is logged, stored and printed."""
    scheme = uri.split(":", 1)[0].lower() if "://" in uri or uri.startswith("databricks") else ""
    if len(uri) > 2048:
        raise ValueError(f"a tracking URI of {len(uri):,} characters (at most 2,048)")
    if scheme.split("+", 1)[0] not in TRACKING_SCHEMES:
        raise ValueError(f"{storage.masked(uri)[:200]}: not an MLflow tracking store; use one of "
                         f"{', '.join(s + '://' for s in TRACKING_SCHEMES)} (sqlite:///mlflow.db is the default)")
    if storage.has_credentials(uri):
        raise ValueError(f"{storage.masked(uri)}: credentials do not belong in the URI (it is logged, stored "
                         "and printed); set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
                         "MLFLOW_TRACKING_TOKEN")
    return uri


LEADING_KEY = re.compile(r"^\s*([A-Za-z_][\w@-]*(?:\.[\w@-]+)*)(?::| =) ", re.M)  # "  model.arch: ..."


def leading_keys(lines: str) -> tuple[str, ...]:
    """The config key each of ``lines`` starts with (``model.arch: unknown ...`` → ``model.arch``)."""
    return tuple(LEADING_KEY.findall(lines))


class ConfigError(InputError):
    """A run configuration that cannot be used; the message lists every problem, ``keys`` the dotted
    config keys it names: by default the one its first line starts with (``model.arch: unknown
    ...``), else those given (a list of problems, a problem of several keys)."""

    def __init__(self, message: str, keys: Iterable[str] | None = None) -> None:
        super().__init__(message)
        named = leading_keys(message.partition("\n")[0]) if keys is None else keys
        self.keys: tuple[str, ...] = tuple(dict.fromkeys(named))  # pickled with the instance's __dict__

    @classmethod
    def from_validation(cls, err: ValidationError, source: str) -> ConfigError:
        """``err`` (pydantic's) as one ConfigError: :func:`format_errors`' message, :func:`error_keys`' keys."""
        return cls(format_errors(err, source), error_keys(err))


class KeyedValueError(ValueError):
    """A validator's ValueError naming ``keys`` of its model (:func:`error_keys` puts them under its location)."""

    def __init__(self, message: str, *keys: str) -> None:
        super().__init__(message)
        self.keys = keys


class Section(BaseModel):
    """The base of every config section, and of the parameters of every part (base losses,
    structures, teachers): unknown keys refused, strict finite numbers."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def registered(family: Any) -> AfterValidator:
    """A name of ``family`` (a :class:`pairsim.config.components.Family`); others are refused
    naming the registered ones."""
    def check(name: str) -> str:
        if name not in family.names():
            raise PydanticCustomError("unregistered", "not a registered name (registered: {names})",
                                      {"names": ", ".join(family.names())})
        return name
    return AfterValidator(check)


MAX_ERRORS_SHOWN = 20  # a file that is no config (a password file, a log) is not echoed line by line
EXCERPT = 200  # characters of a key or value shown in an error


def error_keys(err: ValidationError) -> tuple[str, ...]:
    """The dotted keys ``err``'s errors are about: each one's location, or under it the keys a
    :class:`KeyedValueError` names."""
    keys = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        named = getattr(e.get("ctx", {}).get("error"), "keys", None)
        keys += [".".join(loc + (key,)) for key in named] if named else [".".join(loc)] if loc else []
    return tuple(keys)


def format_errors(err: ValidationError, source: str) -> str:
    """``err`` as one message: a line per problem, each with its dotted key and the value given
    (URIs masked), headed by how many there are and ``source``."""
    lines = []
    for e in err.errors():
        path = shown(".".join(str(p) for p in e["loc"]), EXCERPT) or "<root>"  # keys as the file wrote them
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key")
        else:
            got = e.get("input")
            given = repr(storage.masked(got) if storage.is_uri(got) else got)
            given = given if len(given) <= EXCERPT else given[:EXCERPT] + f"… ({len(given):,} characters)"
            lines.append(f"{path}: {e['msg']} (got {given})")
    return error_list(lines, source)


def error_list(lines: list[str], source: str) -> str:
    """Problems as one message headed by their count and ``source``, the first
    :data:`MAX_ERRORS_SHOWN` of them listed, a line each."""
    more = [f"… and {len(lines) - MAX_ERRORS_SHOWN} more"] if len(lines) > MAX_ERRORS_SHOWN else []
    return f"{len(lines)} error(s) in {source}:\n  " + "\n  ".join(lines[:MAX_ERRORS_SHOWN] + more)
