"""A run's config from YAML files and ``--set`` overrides, layered left to right and validated."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from pairsim.config.fields import ConfigError
from pairsim.config.params import drop_replaced_params
from pairsim.config.schema import RunConfig, validate
from pairsim.config.tree import merge, set_dotted

class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: ``1e-3`` is a float (YAML 1.1 wants a dot,
    ``1.0e-3``, and reads ``1e-3`` as a string); ``.inf`` and ``.nan`` stay floats (refused by
    the config as not finite)."""


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


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` entries on a nested dict; values are parsed as YAML scalars/lists."""
    errors = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            errors.append(f"--set {item!r}: expected KEY=VALUE, e.g. loss.margin=0.3")
            continue
        try:
            set_dotted(tree, key.strip(), _yaml_load(raw) if raw.strip() else None)
        except ValueError as exc:
            errors.append(f"--set {item!r}: {exc}")
    if errors:
        raise ConfigError("invalid overrides:\n  " + "\n  ".join(errors))
    return tree


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (resolved against the working directory: "
                                                             f"{path.resolve()})" if not path.is_absolute() else ""))
    try:
        loaded = _yaml_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded or {}


def layer(tree: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay`` (a nested config tree) laid on ``tree``: sections merge key by key; where the
    overlay names another base loss, structure or teacher kind, the parameters earlier layers
    gave the one it replaces are dropped."""
    return merge(drop_replaced_params(tree, overlay, RunConfig), overlay)


def load_config(path: str | Path | list[str | Path] | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load YAML (one file, several layered left to right, or the defaults when ``path`` is
    None), apply overrides (the last layer), validate (see :func:`layer`).

    Raises :class:`ConfigError` naming every bad or unknown dotted key at once.
    """
    paths = [] if path is None else [Path(p) for p in (path if isinstance(path, list) else [path])]
    tree: dict[str, Any] = {}
    for overlay in [read_yaml(p) for p in paths] + [apply_overrides({}, overrides or [])]:
        tree = layer(tree, overlay)
    return validate(tree, " + ".join(str(p) for p in paths) or "defaults")
