"""Dotted keys over nested config trees (plain dicts): ``a.b.c`` read, set, flattened, merged."""

from __future__ import annotations

from typing import Any

MISSING = object()
"""What :func:`get_dotted` returns for a key the tree does not have."""


def get_dotted(tree: Any, key: str) -> Any:
    """``tree[a][b][c]`` for ``key`` ``a.b.c``, or :data:`MISSING`."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return MISSING
        tree = tree[part]
    return tree


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``tree`` as one level of dotted keys: ``{"a": {"b": 1}}`` → ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """``tree[a][b][c] = value`` for ``key`` ``a.b.c``, making sections on the way; raises
    ValueError naming the prefix that is a value, not a section."""
    parts = key.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay`` on ``base``: sections merge key by key, other values replace."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
