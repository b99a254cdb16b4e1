"""A run's config from YAML files and ``--set`` overrides, layered left to right and validated."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from pairsim import storage
from pairsim.config.fields import ConfigError
from pairsim.config.components import drop_replaced_parts, upgrade
from pairsim.config.schema import RunConfig, validate
from pairsim.config.tree import merge, set_dotted
from pairsim.errors import shown

MAX_CONFIG_BYTES = 1 << 20  # a config or sweep file: what ray job submit hands a shared cluster's head
MAX_DEPTH = 64  # nested sections and lists


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded for files users hand in, with YAML 1.2's floats.

    - **No aliases** (``*name``): a config writes its values out; an alias bomb (nine levels of
      nine aliases) would otherwise expand to billions of nodes after validation.
    - **No duplicate keys**: a second ``train:`` would silently replace the first whole section;
      both lines are named.
    - **At most** :data:`MAX_DEPTH` nested levels (a RecursionError traceback otherwise).
    - Floats as YAML 1.2 reads them: ``1e-3`` is a float (YAML 1.1 wants a dot and reads ``1e-3``
      as a string); ``.inf`` and ``.nan`` stay floats (refused by the config as not finite).
    """

    _depth = 0  # of the node being composed

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"an alias (*{event.anchor}) is not accepted in a config: "
                                                          "write the value out", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool):
                continue  # an unhashable key: the constructor names it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key '{shown(key, 80)}' appears twice (lines {seen[key]} and "
                                f"{key_node.start_mark.line + 1}): the second would replace the first", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader)


def yaml_value(raw: str) -> Any:
    """A value written on a command line or in a cell (``--set KEY=VALUE``'s, a results.csv
    point's) as YAML with a config file's loader and bounds (no alias, no tag, YAML 1.2's floats);
    an empty one is None. ``yaml.YAMLError`` (:func:`yaml_problem` says where and what) when it
    is not."""
    return _yaml_load(raw) if raw.strip() else None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """Where and what ``exc`` (PyYAML's) says is wrong — ``line 3, column 7: mapping values are
    not allowed here`` — without the excerpt of the text PyYAML adds: a file given as a config
    may be anything (a password file), so none of its lines is echoed, and what PyYAML quotes
    of it in the problem (a tag, a key) is cut and escaped (:func:`pairsim.errors.shown`)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        return where + "; ".join(shown(part) for part in (exc.context, exc.problem) if part)
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not take (a control character)
        return f"character {exc.position + 1}: {shown(str(exc).splitlines()[0])}"  # its code, not the character
    return shown(" ".join(str(exc).split()))


def apply_overrides(tree: dict[str, Any], overrides: list[str], model: type[BaseModel] | None = None,
                    flag: str = "--set") -> dict[str, Any]:
    r"""Set ``a.b.c=value`` entries on a nested dict; values are parsed as YAML scalars/lists
    (:func:`yaml_value`). With ``model`` (:class:`RunConfig`) each is
    :func:`~pairsim.config.components.upgrade`\ d and merged, so ``loss.base=infonce`` and
    ``loss.base.temperature.init=0.07`` name a part and set its key in either order. Every flag
    that takes ``KEY=VALUE`` pairs (``--set``, ``pairsim index --param``) is read here; errors
    name ``flag``."""
    errors, keys = [], []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            errors.append(f"{flag} '{shown(item)}': expected KEY=VALUE, e.g. loss.base.margin=0.3")
            continue
        try:
            value = yaml_value(raw)
            if model is None:
                set_dotted(tree, key.strip(), value)
            else:  # one layer: a part named and its keys set merge, whatever their order
                one: dict[str, Any] = {}
                set_dotted(one, key.strip(), value)
                tree = merge(upgrade(tree, model), upgrade(one, model))
        except yaml.YAMLError as exc:
            errors.append(f"{flag} '{shown(item)}': not valid YAML: {yaml_problem(exc)}")
            keys.append(key.strip()[:200])
        except ValueError as exc:
            errors.append(f"{flag} '{shown(item)}': {exc}")
            keys.append(key.strip()[:200])
    if errors:
        raise ConfigError("invalid overrides:\n  " + "\n  ".join(errors), keys)
    return tree


def read_yaml(path: Path, max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """A config or sweep file's mapping, read within bounds (at most ``max_bytes``, UTF-8, the
    loader's limits); every problem a :class:`ConfigError` naming the file."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (resolved against the working directory: "
                                                             f"{path.resolve()})" if not path.is_absolute() else ""))
    data = storage.Location.of(path).read_bounded(max_bytes, ConfigError, "too big for a config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {exc.start})") from None
    try:
        loaded = _yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded or {}


def layer(tree: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    r"""``overlay`` (a nested config tree) laid on ``tree`` (both :func:`~pairsim.config.components.upgrade`\ d):
    sections merge key by key; a part the overlay names anew (``loss.base: infonce`` over
    ``unified``) replaces the earlier one's whole subsection."""
    overlay = upgrade(overlay, RunConfig)
    return merge(drop_replaced_parts(upgrade(tree, RunConfig), overlay, RunConfig), overlay)


def load_config(path: str | Path | list[str | Path] | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load YAML (one file, several layered left to right, or the defaults when ``path`` is
    None), apply overrides (the last layer), validate (see :func:`layer`).

    Raises :class:`ConfigError` naming every bad or unknown dotted key at once.
    """
    paths = [] if path is None else [Path(p) for p in (path if isinstance(path, list) else [path])]
    tree: dict[str, Any] = {}
    for overlay in [read_yaml(p) for p in paths] + [apply_overrides({}, overrides or [], RunConfig)]:
        tree = layer(tree, overlay)
    return validate(tree, " + ".join(str(p) for p in paths) or "defaults")
