"""Data formats by name (``--format``), and every extension point's table (``pairsim registry``).

The parts a run is assembled from — base losses, structures, teachers, fusions — are data in
:mod:`pairsim.config.components` and built by :mod:`pairsim.build`; metric families are listed in
:mod:`pairsim.metric_families`. Data formats are the :class:`Registry` here, filled by
:mod:`pairsim.data.sources` on the first lookup.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one extension point.

    Args:
        field: the config key or CLI flag that names an entry (``loss.base``), used in errors.
        provider: the module whose import registers the built-in entries.
    """

    def __init__(self, field: str, provider: str):
        self.field, self.provider = field, provider
        self._entries: dict[str, T] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object as ``name``."""
        def add(entry: T) -> T:
            if name in self._entries and self._entries[name] is not entry:
                raise ValueError(f"{self.field}: {name!r} is already registered ({self._entries[name]!r})")
            self._entries[name] = entry
            return entry
        return add

    def _load(self) -> dict[str, T]:
        if not self._loaded:
            self._loaded = True
            importlib.import_module(self.provider)
        return self._entries

    def __getitem__(self, name: str) -> T:
        entries = self._load()
        if name not in entries:
            raise KeyError(f"{self.field}: unknown {name!r} (registered: {', '.join(entries)})")
        return entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._load()

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._load()))

    def names(self) -> list[str]:
        return list(self._load())

    def items(self) -> list[tuple[str, T]]:
        return list(self._load().items())

    def describe(self, name: str) -> str:
        """The first paragraph of the entry's docstring, on one line."""
        doc = (getattr(self[name], "__doc__", None) or "").strip()
        return " ".join(doc.split("\n\n")[0].split())

    def parameters(self, name: str) -> str:
        """The options the entry owns (a data format's ``options``), or ``—``."""
        return ", ".join(f"`{key}`" for key in getattr(self[name], "options", {})) or "—"


DATA_FORMATS: Registry = Registry("--format", "pairsim.data.sources")


def _table(title: str, key: str, rows: list[tuple[str, str, str]]) -> str:
    lines = "\n".join(f"| `{name}` | {what} | {keys} |" for name, what, keys in rows)
    return f"**{title}** (`{key}`)\n\n| name | what it is | its own keys |\n|---|---|---|\n{lines}"


def markdown() -> str:
    """Every extension point's built-in entries as Markdown tables (name, what it is, its own
    keys): ``pairsim registry`` and the docs' tables."""
    from pairsim.config.components import FAMILIES
    from pairsim import metric_families

    tables = [_table(title, family.key, [(name, family.describe(name), family.parameters(name))
                                         for name in family.builtins]) for title, family in FAMILIES.items()]
    tables.append(_table("Data formats", DATA_FORMATS.field, [(name, DATA_FORMATS.describe(name),
                                                               DATA_FORMATS.parameters(name)) for name in DATA_FORMATS]))
    tables.append(_table("Metric families", "eval.select_metric",
                         [(name, " ".join((type(f).__doc__ or "").strip().split("\n\n")[0].split()), "—")
                          for name, f in metric_families.FAMILIES.items()]))
    return "\n\n".join(tables)
