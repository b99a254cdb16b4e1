"""The checks of a sweep before Ray starts: its settings against each other and the space, and
every space key, bound, sampled value and a few points of each space as run configs."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from pairsim.config import ConfigError, layer, validate
from pairsim.tune.space.distributions import RANDOM_POINTS_CHECKED, Distribution, corner_and_random_points
from pairsim.tune.space.settings import MUTABLE_KEYS
from pairsim.tune.space.validated import Sweep, nested


def run_config_errors(tree: dict[str, Any]) -> str | None:
    try:
        validate(tree, "the point")
    except ConfigError as exc:
        return str(exc).split(":\n", 1)[-1].replace("\n", "").replace("Value error, ", "")
    return None


def _why_not_a_key(tree: dict[str, Any], key: str, dist: Distribution) -> str:
    """Why ``key`` is not in the base config: a section the base leaves unset, or what
    validation says of it (a parameter of another loss, an unknown key)."""
    node: Any = tree
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, dict) and part in node and node[part] is None:
            return f"{'.'.join(parts[:depth + 1])} is not set there; set it under base to sweep its keys"
        node = node.get(part) if isinstance(node, dict) else None
    return (run_config_errors(layer(tree, nested({key: dist.corners()[0]}))) or "unknown key").strip()


def check_settings(sweep: Sweep, listed: bool, keys: list[str], errors: list[str]) -> None:
    """The settings against each other and the space: modes, scheduler and search, PBT's
    mutations (added to the space when not in it: their first value drawn from them), warm
    trials' one worker, ASHA."""
    settings, spaces = sweep.settings, sweep.spaces
    if settings.mode is not None:
        given = [settings.mode] if isinstance(settings.mode, str) else settings.mode
        if len(given) != len(sweep.objectives) and not errors:
            errors.append(f"sweep.mode: {len(given)} mode(s) for {len(sweep.objectives)} metric(s)")
        for given_mode, (metric, mode) in zip(given, sweep.objectives):
            if mode is not None and given_mode != mode:  # None: not a metric (said under sweep.metric)
                errors.append(f"sweep.mode: {given_mode!r}, but {metric} is ranked {mode!r}")
    if sweep.multi_objective and settings.scheduler != "fifo":
        errors.append(f"sweep.scheduler: {settings.scheduler} ranks trials by one metric; a sweep over several "
                      "(sweep.metric is a list) runs with fifo (the default for one)")
    named = [(key if label == "space" else f"{label}.{key}", dist) for label, space in sweep.labelled()
             for key, dist in space.items()]
    if listed and settings.search != "grid":
        errors.append(f"sweep.search: the space is a list of grids, run as their union by search: grid only "
                      f"(not {settings.search})")
    elif settings.search == "grid" and any(dist.kind != "grid" for _, dist in named):
        errors.append("sweep.search: grid needs every space key to be a grid; not: "
                      + ", ".join(name for name, dist in named if dist.kind != "grid"))
    elif settings.search == "optuna" and any(dist.kind == "grid" for _, dist in named):
        errors.append(f"sweep.search: optuna samples; it takes no grid "
                      f"({', '.join(name for name, dist in named if dist.kind == 'grid')}): use choice")
    pbt = settings.pbt
    mutations = pbt.mutations if pbt else {}
    if pbt and listed:
        errors.append(f"sweep.scheduler: {settings.scheduler} mutates each trial's own point; a list of grids runs "
                      "with fifo or asha")
    if pbt and settings.search == "optuna":
        errors.append("sweep.search: optuna proposes points from finished trials, which PBT's cloned trials are not "
                      f"(Ray Tune refuses the pair): use random or grid with scheduler {settings.scheduler}")
    if pbt and pbt.perturbation_interval >= sweep.epochs:
        errors.append(f"sweep.pbt.perturbation_interval: {pbt.perturbation_interval} epochs, but a trial runs "
                      f"{sweep.epochs}: no trial would ever be perturbed")
    for key, dist in mutations.items():
        if settings.scheduler == "pb2" and dist.kind in ("choice", "grid"):
            errors.append(f"sweep.pbt.mutations.{key}: {dist.kind} is not a range; PB2 proposes values inside "
                          "[low, high] (write uniform, loguniform, quniform or randint; choice works with pbt)")
        elif dist.kind == "grid":
            errors.append(f"sweep.pbt.mutations.{key}: grid is not a mutation; write choice (PBT steps to a "
                          "neighbouring value or draws one)")
        if not any(re.fullmatch(pattern, key) for pattern in MUTABLE_KEYS):
            errors.append(f"sweep.pbt.mutations.{key}: cannot change mid-run (a clone continues from another "
                          "trial's checkpoint, which fixes it); PBT may change optim.lr, loss.base.margin, loss.base.gamma, "
                          "loss.cusa.alpha/beta/teacher_temperature and a temperature's init/min/max")
        if not listed and key not in spaces[0]:
            spaces[0][key] = dist  # its first value drawn from the mutation's distribution
    if settings.warm and (sweep.base.train.num_workers != 1 or "train.num_workers" in keys):
        errors.append(f"sweep.warm: a warm trial trains one worker in its Tune trial actor; the trials here have "
                      f"{'a swept' if 'train.num_workers' in keys else sweep.base.train.num_workers} "
                      "train.num_workers (set sweep.resources.num_workers: 1, or warm: false)")
    if settings.asha and settings.asha.max_t is None and "train.epochs" in keys:
        errors.append("sweep.asha.max_t: needed when train.epochs is swept (ASHA's longest trial, in epochs)")
    if settings.asha and settings.asha.grace_period > sweep.epochs:
        errors.append(f"sweep.asha.grace_period: {settings.asha.grace_period} epochs is more than the "
                      f"{sweep.epochs} a trial runs")


def check_space(sweep: Sweep, errors: list[str]) -> None:
    """Every space key (and PBT mutation) is a key of the base config whose bounds, values and
    sampled values give valid run configs; then (when they all do) a few points of each space."""
    tree, spaces = sweep.base_tree, sweep.spaces
    mutations = sweep.settings.pbt.mutations if sweep.settings.pbt else {}
    flat = sweep.base.flat()
    bad_keys = set()
    for label, space in [*sweep.labelled(), ("sweep.pbt.mutations", mutations)]:
        for key, dist in space.items():
            if label == "sweep.pbt.mutations" and spaces[0].get(key) is dist:  # checked as a space key
                continue
            where = f"{label}.{key}"
            if key not in flat:
                errors.append(f"{where}: not a key of the base config ({_why_not_a_key(tree, key, dist)})")
                bad_keys.add(where)
                continue
            rng = np.random.default_rng(0)
            bounds = zip(("low", "high") if dist.kind not in ("choice", "grid") else ["value"] * len(dist.args),
                         dist.corners())
            for name, value in bounds:
                why = run_config_errors(layer(tree, nested({key: value})))
                if why:
                    errors.append(f"{where}: {name} {value!r} gives an invalid run config: {why.strip()}")
                    bad_keys.add(where)
            for value in [] if where in bad_keys else [dist.sample(rng) for _ in range(RANDOM_POINTS_CHECKED)]:
                why = run_config_errors(layer(tree, nested({key: value})))
                if why:  # e.g. uniform over an integer key
                    errors.append(f"{where}: sampled {value!r} gives an invalid run config: {why.strip()}")
                    bad_keys.add(where)
                    break
    if not bad_keys:
        seen = set()
        points = ((label, point) for label, space in sweep.labelled() for point in corner_and_random_points(space))
        for label, point in points:
            why = run_config_errors(layer(tree, nested(point)))
            if why and why not in seen:
                seen.add(why)
                errors.append(f"{label}: the point {point} gives an invalid run config: {why.strip()}")
                if len(seen) == 3:
                    break
