"""Registries: the named implementations of each extension point, keyed by the name config and
the command line use.

One :class:`Registry` per extension point, each living with its concept — base losses and
similarity structures (:mod:`pairsim.losses.modules`), fusions (:mod:`pairsim.models.fusion`),
teachers (:mod:`pairsim.teachers.encoders`), data formats (:mod:`pairsim.data.sources`) and
retrieval metrics (:mod:`pairsim.eval.suite`). Validation, CLI choices, the README tables and
the MLflow param names are read from them, never repeated.

A registry is created in this module, which imports nothing of pairsim, so that the config
(the bottom layer) can validate against it; each one names the module that registers its
built-in entries, imported on the first lookup — the way ``importlib.metadata`` entry points
load plugins. Code outside the package registers its own entries the same way::

    from pairsim.registry import BASE_LOSSES

    @BASE_LOSSES.register("my_loss")
    class MyLoss(BaseLoss): ...
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
        """The config keys the entry owns (its ``Params``, with their defaults, or a data format's
        ``options``), or ``—``."""
        entry = self[name]
        fields = getattr(getattr(entry, "Params", None), "model_fields", {})
        shown = [f"`{key}`" + ("" if f.is_required() or f.default_factory else f" = {f.default!r}")
                 for key, f in fields.items()] + [f"`{key}`" for key in getattr(entry, "options", {})]
        return ", ".join(shown) or "—"


class MetricFamilies(Registry):
    """The registry of the evaluation suite's metric families (each a
    :class:`pairsim.eval.suite.MetricFamily`), which also lists what they report together."""

    def reported(self, ks: tuple[int, ...] | list[int], facts: Any = None) -> dict[str, str | None]:
        """Every metric the registered families report for ``ks`` on data with ``facts`` (a
        :class:`pairsim.eval.suite.DataFacts`; None: on some data), in registration order, each
        with its mode: ``max``, ``min`` or None for a count no checkpoint is selected by."""
        return {name: mode for _, family in self.items() for name, mode in family().names(tuple(ks), facts).items()}


BASE_LOSSES: Registry = Registry("loss.base", "pairsim.losses.modules")
STRUCTURES: Registry = Registry("loss.structure", "pairsim.losses.modules")
FUSIONS: Registry = Registry("model.fusion", "pairsim.models.fusion")
TEACHERS: Registry = Registry("loss.cusa.*_teacher.kind", "pairsim.teachers.encoders")
DATA_FORMATS: Registry = Registry("--format", "pairsim.data.sources")
METRICS: MetricFamilies = MetricFamilies("eval.select_metric", "pairsim.eval.suite")

ALL = {"Base losses": BASE_LOSSES, "Similarity structures": STRUCTURES, "Fusions": FUSIONS, "Teachers": TEACHERS,
       "Data formats": DATA_FORMATS, "Metric families": METRICS}


def markdown() -> str:
    """Every registry as a Markdown table (name, what it is): the README's extension-point tables."""
    parts = []
    for title, registry in ALL.items():
        rows = "\n".join(f"| `{name}` | {registry.describe(name)} | {registry.parameters(name)} |"
                         for name in registry.names())
        parts.append(f"**{title}** (`{registry.field}`)\n\n| name | what it is | its own keys |\n|---|---|---|\n{rows}")
    return "\n\n".join(parts)

