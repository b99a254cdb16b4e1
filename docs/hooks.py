"""MkDocs hooks: the pages that are generated, so that they cannot drift from the code.

- ``index.md`` is the repository's README with its ``docs/`` links made relative to the site.
- ``<!-- generated: config-reference -->`` becomes every field of the run config, from the
  pydantic models (:mod:`pairsim.config.schema`): its dotted key, type, default, bounds and
  description, section by section, and the parameters of every registered entry
  (:func:`pairsim.registry.markdown`).
- ``<!-- generated: cli-reference -->`` becomes every ``pairsim`` command with its flags, from
  the argument parser (:func:`pairsim.cli.build_parser`).
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[1]


def on_files(files, config):
    readme = (REPO / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=re.sub(r"\]\(docs/", "](", readme)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "<!-- generated: config-reference -->" in markdown:
        markdown = markdown.replace("<!-- generated: config-reference -->", config_reference())
    if "<!-- generated: cli-reference -->" in markdown:
        markdown = markdown.replace("<!-- generated: cli-reference -->", cli_reference())
    return markdown


# --------------------------------------------------------------------------- config reference

def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (tuple, list, dict):
        inner = ", ".join("…" if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]" if inner else origin.__name__
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return {"NoneType": "null", "PosixPath": "path", "Path": "path"}.get(annotation.__name__, annotation.__name__)
    return str(annotation).replace("typing.", "")


def _bounds(field) -> str:
    shown = []
    for item in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"), ("min_length", "length ≥"),
                           ("max_length", "length ≤"), ("pattern", "matches")):
            value = getattr(item, attr, None)
            if value is not None:
                shown.append(f"{sign} `{value}`" if attr == "pattern" else f"{sign} {value}")
    return ", ".join(shown)


def _default_value(field) -> Any:
    if field.is_required():
        return PydanticUndefined
    return field.default_factory() if field.default_factory is not None else field.default


def _shown(value: Any) -> str:
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    return "`null`" if value is None else f"`{value!s}`"


def _section_of(annotation: Any) -> type[BaseModel] | None:
    for kind in (annotation, *typing.get_args(annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel) and kind.model_fields:
            return kind
    return None


def _summary(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split("\n\n")[0].split())


def _rows(model: type[BaseModel], prefix: str, defaults: BaseModel | None,
          nested: list[tuple[str, type[BaseModel], BaseModel | None]]) -> list[str]:
    """One row per key of ``model``; defaults from ``defaults`` (the instance the parent section
    builds, e.g. CUSA's τ_c starts at 0.45, not at a bare temperature's 0.05) when given."""
    rows = []
    for name, field in model.model_fields.items():
        if name.endswith("_params") or name == "params":  # a registered entry's Params, written flat
            continue
        key = f"{prefix}{name}"
        value = getattr(defaults, name) if defaults is not None else _default_value(field)
        section = _section_of(field.annotation)
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        if section is not None:
            nested.append((key, section, value if isinstance(value, BaseModel) else None))
            rows.append(f"| `{key}` | section | {_shown(value)} | | {description or _summary(section)} |")
            continue
        rows.append(f"| `{key}` | {_type_name(field.annotation)} | {_shown(value)} | {_bounds(field)} | {description} |")
    return rows


def config_reference() -> str:
    from pairsim import registry
    from pairsim.config import RunConfig

    parts = []
    queue = [(name, _section_of(field.annotation), None) for name, field in RunConfig.model_fields.items()]
    while queue:
        key, model, defaults = queue.pop(0)
        nested: list[tuple[str, type[BaseModel], BaseModel | None]] = []
        rows = _rows(model, f"{key}.", defaults, nested)
        parts.append(f"### `{key}`\n\n{_summary(model)}\n\n| key | type | default | bounds | description |\n"
                     "|---|---|---|---|---|\n" + "\n".join(rows))
        queue[:0] = nested
    return ("\n\n".join(parts) + "\n\n### Registered entries and their own keys\n\n"
            "A `loss.base`, `loss.structure` or teacher `kind` owns the keys written beside it:\n\n"
            + registry.markdown())


# --------------------------------------------------------------------------- CLI reference

def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command(name: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
    out = [f"{'#' * level} `{name}`\n", "```text", parser.format_help().rstrip(), "```\n"]
    for sub, subparser in _subcommands(parser).items():
        out += _command(f"{name} {sub}", subparser, level + 1)
    return out


def cli_reference() -> str:
    from pairsim.cli import build_parser

    return "\n".join(_command("pairsim", build_parser(), 2))
