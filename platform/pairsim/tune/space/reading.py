"""Reading a sweep file (:func:`load_sweep`): the file with its ``--set`` overrides, its space
and sections, the base run config, then the checks (:mod:`pairsim.tune.space.checks`), every
problem reported at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pairsim.config import (ConfigError, RunConfig, Section, absolute_paths, apply_overrides, layer, read_yaml,
                            validate)
from pairsim.config.components import upgrade_key
from pairsim.config.fields import error_list, leading_keys
from pairsim.tune.space.checks import check_settings, check_space, run_config_errors
from pairsim.tune.space.distributions import Distribution, Space
from pairsim.tune.space.settings import SweepFile, SweepSettings
from pairsim.tune.space.validated import Sweep, nested

SHIPPED_CONFIGS = Path(__file__).parents[2] / "configs"
SHIPPED_PREFIX = "pairsim:"


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> Sweep:
    """Read and validate a sweep file; ``overrides`` (``--set``) starting with ``sweep.`` or
    ``space.`` apply to the sweep file, the others to its base run config.

    The steps: the file with its own overrides (:func:`_read_sweep_file`), its space and sections
    (:func:`_read_sections`), the base run config (:func:`_base_config`), then the settings
    (:func:`check_settings`), the number of trials (``sweep.max_trials``, counted, not listed)
    and every space key and point (:func:`check_space`) against it. Raises :class:`ConfigError`
    with every problem at once (:func:`~pairsim.config.fields.error_list`), each with its path in the
    file.
    """
    path = Path(path)
    errors: list[str] = []
    raw, base_sets = _read_sweep_file(path, overrides or [], errors)
    listed = isinstance(raw["space"], list)
    spaces, file = _read_sections(raw, errors)
    keys = list(dict.fromkeys(key for space in spaces for key in space))
    tree, base = _base_config(path, file, base_sets, keys, errors)
    sweep = Sweep(str(path), tree, base, tuple(spaces), file.sweep)
    check_settings(sweep, listed, keys, errors)
    trials, most = sweep.trials_at_most(), sweep.settings.max_trials
    if trials > most:  # checked before any point is listed or validated
        errors.append(f"space: {'up to ' if sweep.union else ''}{trials:,} trials (num_samples × grid points), "
                      f"more than sweep.max_trials ({most:,}); to run that many, raise sweep.max_trials in the sweep "
                      "section or with --set sweep.max_trials=N")
    else:
        check_space(sweep, errors)
    if errors:
        raise _problems(path, errors)
    return sweep


def _problems(path: Path, errors: list[str]) -> ConfigError:
    """``errors`` as one :class:`ConfigError` (:func:`pairsim.config.fields.error_list`)."""
    return ConfigError(error_list(errors, str(path)), leading_keys("\n".join(errors)))  # all, not only those shown


def _read_sweep_file(path: Path, overrides: list[str], errors: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The sweep file as read, with the ``sweep.``/``space.`` overrides applied; the overrides left
    for the base run config."""
    raw = read_yaml(path)
    for section in ("space", "sweep"):  # written with no value: empty
        if raw.get(section) is None:
            raw[section] = {}
    sweep_sets = [o for o in overrides if o.split("=", 1)[0].strip().split(".")[0] in ("sweep", "space")]
    base_sets = [o for o in overrides if o not in sweep_sets]
    for item in sweep_sets:  # space.loss.base.margin={uniform: [0, 0.3]}: the key after space. is one dotted key
        key, _, value = item.partition("=")
        if key.strip().startswith("space."):
            why = _set_space(raw, key.strip()[len("space."):], apply_overrides({}, [f"v={value}"])["v"])
            errors += [why] if why else []
        else:
            apply_overrides(raw, [item])
    return raw, base_sets


def _set_space(raw: dict[str, Any], key: str, spec: Any) -> str | None:
    """``--set space.KEY=SPEC`` on the file as read (a list of grids: ``space.<i>.KEY``); why
    not, or None."""
    space = raw["space"]
    if isinstance(space, list):
        index, _, grid_key = key.partition(".")
        if not (index.isdigit() and int(index) < len(space) and isinstance(space[int(index)], dict) and grid_key):
            return (f"--set space.{key}: the space is a list of {len(space)} grid(s); set a key of grid i "
                    f"(0 to {len(space) - 1}) with space.<i>.<key>=...")
        space, key = space[int(index)], grid_key
    if isinstance(space, dict):  # another value is named below
        space[key] = spec
    return None


def _read_spaces(raw: Any) -> tuple[list[Space], list[str]]:
    """The space as written — one mapping, or a list of them (a union of grids) — and its
    problems, each named by its path (``space.<i>.<key>`` in a union)."""
    listed = isinstance(raw, list)
    grids = (raw if listed else [raw]) or [{}]
    spaces: list[Space] = []
    errors: list[str] = []
    for i, grid in enumerate(grids):
        label = f"space.{i}" if len(grids) > 1 else "space"
        if not isinstance(grid, dict) or not grid:
            example = "{grid: [0.1, 0.2]}" if listed else "{uniform: [0.0, 0.4]}"
            errors.append(f"{label}: needs at least one key, e.g. loss.base.margin: {example}")
        space: Space = {}
        for key, spec in _upgraded_keys(grid, label, errors).items() if isinstance(grid, dict) else []:
            try:
                space[key] = Distribution.model_validate(spec)
            except ValidationError as exc:
                errors += [f"{label}.{key}: {_message(e)}" for e in exc.errors()]
        spaces.append(space)
    return spaces, errors


def _upgraded_keys(written: dict[Any, Any], label: str, errors: list[str]) -> dict[str, Any]:
    """``written`` (a space, or PBT's mutations: run-config key → distribution) with keys of an
    earlier release in today's form (``loss.margin`` → ``loss.base.margin``, a FutureWarning naming
    the new key: :func:`~pairsim.config.components.upgrade_key`); a key written both ways is an
    error under ``label``, the second left out (it would replace the first)."""
    upgraded: dict[str, Any] = {}
    written_as: dict[str, str] = {}
    for key, spec in written.items():
        new = upgrade_key(str(key), RunConfig)
        if new in upgraded:
            errors.append(f"{label}.{new}: written twice ({written_as[new]} and {key}); keep one")
            continue
        upgraded[new], written_as[new] = spec, str(key)
    return upgraded


def _read_sections(raw: dict[str, Any], errors: list[str]) -> tuple[list[Space], SweepFile]:
    """The spaces and the file's sections, each validated alone (all their errors at once; a bad
    field left out so the rest can still be checked)."""
    spaces, space_errors = _read_spaces(raw["space"])
    errors += space_errors
    pbt = raw["sweep"].get("pbt") if isinstance(raw["sweep"], dict) else None
    if isinstance(pbt, dict) and isinstance(pbt.get("mutations"), dict):  # its keys as the space's
        mutations = _upgraded_keys(pbt["mutations"], "sweep.pbt.mutations", errors)
        raw = raw | {"sweep": raw["sweep"] | {"pbt": pbt | {"mutations": mutations}}}
    sections = {"space": {}}
    for name, model in (("base", None), ("sweep", SweepSettings)):
        try:
            sections[name] = model.model_validate(raw.get(name) or {}) if model else raw.get(name) or {}
            SweepFile.model_validate({name: sections[name]})
        except ValidationError as exc:
            errors += [f"{'.'.join(map(str, (name, *e['loc'][1 if model is None else 0:])))}: {_message(e)}"
                       for e in exc.errors()]
            sections[name] = _without_bad_fields(model, raw.get(name) or {}, exc) if model else {}
    errors += [f"{key}: unknown key (a sweep file has base, space, sweep)" for key in raw if key not in sections]
    return spaces, SweepFile.model_validate(sections)


def _message(error: dict[str, Any]) -> str:
    return "unknown key" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")


def _without_bad_fields(model: type[Section], data: dict[str, Any], exc: ValidationError) -> Section:
    """``data`` validated without the fields ``exc`` faults (their defaults instead), so the
    checks that read the other fields still run; the defaults if that fails too."""
    bad = {e["loc"][0] for e in exc.errors() if e["loc"]}
    try:
        return model.model_validate({k: v for k, v in data.items() if k not in bad})
    except ValidationError:
        return model()


def _base_config(path: Path, file: SweepFile, base_sets: list[str], keys: list[str],
                 errors: list[str]) -> tuple[dict[str, Any], RunConfig]:
    """The base run config, as a tree with absolute paths (trials layer their point on it) and
    validated: its config files, its own keys, the overrides, the resources, the (first) metric,
    and ASHA's longest trial as its epochs unless they are swept. Raises at once when it is not
    valid: nothing else can be checked against it."""
    base_raw = dict(file.base)
    tree: dict[str, Any] = {}
    try:
        for config in _config_paths(base_raw.pop("config", []), path.parent):
            tree = layer(tree, read_yaml(config))
    except ConfigError as exc:
        errors.append(f"base.config: {exc}")
    tree = layer(tree, base_raw)
    tree = layer(tree, apply_overrides({}, base_sets, RunConfig))
    tree = layer(tree, nested(file.sweep.resources.overrides()))
    metrics = file.sweep.metrics or []
    for i, metric in enumerate(metrics):  # each must be a metric a checkpoint could be selected by
        eval_tree = layer(tree, {"eval": {"select_metric": metric}})
        why = run_config_errors(eval_tree) if run_config_errors(tree) is None else None
        if why:
            errors.append(f"sweep.metric{'' if isinstance(file.sweep.metric, str) else f'.{i}'}: "
                          f"{why.strip().removeprefix('eval: ')}")
        elif i == 0:
            tree = eval_tree
    if len(set(metrics)) < len(metrics):
        errors.append(f"sweep.metric: {metrics} names a metric twice")
    if file.sweep.asha and file.sweep.asha.max_t and "train.epochs" not in keys:
        tree = layer(tree, {"train": {"epochs": file.sweep.asha.max_t}})  # trials as long as ASHA lets them run
    try:
        base = validate(tree, f"{path} base")
    except ConfigError as exc:
        raise _problems(path, [*errors, f"base: {exc}"]) from None
    tree = absolute_paths(base.model_dump(mode="json"))  # trials layer their point on the whole config
    base = validate(tree, f"{path} base")
    return tree, base


def _config_paths(value: Any, relative_to: Path) -> list[Path]:
    paths = value if isinstance(value, list) else [value]
    out = []
    for item in paths:
        if not isinstance(item, str):
            raise ConfigError(f"expected a path or a list of paths, got {item!r}")
        if item.startswith(SHIPPED_PREFIX):
            out.append(SHIPPED_CONFIGS / item[len(SHIPPED_PREFIX):])
        else:
            path = Path(item)
            out.append(path if path.is_absolute() else relative_to / path)
    return out
