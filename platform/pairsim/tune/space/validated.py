"""A validated sweep (:class:`Sweep`): its base run config, space and settings, and what the
driver and trials read of it — each trial's run config, a union's grid points, Tune's
``param_space``, the objectives, the digest a resume must match, the parent run's params."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

from pairsim.config import RunConfig, flatten, layer, set_dotted, validate
from pairsim import metric_families
from pairsim.tune.space.distributions import Space, corner_and_random_points
from pairsim.tune.space.settings import SweepSettings

POINT_KEY = "point"  # a union's Tune config: {POINT_KEY: the trial's whole point}


def nested(point: dict[str, Any]) -> dict[str, Any]:
    """``{"loss.base.margin": 0.2}`` → ``{"loss": {"base": {"margin": 0.2}}}``."""
    tree: dict[str, Any] = {}
    for key, value in point.items():
        set_dotted(tree, key, value)
    return tree


def _hash_of(value: Any) -> Any:
    """A hash equal values share (60 and 60.0 too); of an unhashable value (a list), its type's name."""
    try:
        return hash(value)
    except TypeError:
        return type(value).__name__


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: the base run config (as a tree and validated), the space — one, or the
    grids of a union — and the settings."""

    source: str
    base_tree: dict[str, Any]
    base: RunConfig
    spaces: tuple[Space, ...]  # one space; or a union's grids, every distribution a grid
    settings: SweepSettings

    @property
    def union(self) -> bool:
        """Whether the space is a union of grids (its trials: :meth:`grid_points`)."""
        return len(self.spaces) > 1

    @property
    def keys(self) -> list[str]:
        """The swept keys in the order written (of a union: of all its grids)."""
        return list(dict.fromkeys(key for space in self.spaces for key in space))

    def labelled(self) -> list[tuple[str, Space]]:
        """Each space with the path errors and params name it by: ``space``, or ``space.<i>``
        for grid i of a union."""
        return [("space", self.spaces[0])] if not self.union else [
            (f"space.{i}", space) for i, space in enumerate(self.spaces)]

    @property
    def metric(self) -> str:
        """The reported metric trials are ranked by, e.g. ``val/rsum`` (the first objective)."""
        return f"val/{self.base.eval.select_metric}"

    @property
    def mode(self) -> str:
        return self.base.eval.select_mode

    @property
    def objectives(self) -> list[tuple[str, str]]:
        """(reported metric, mode) of each objective: :attr:`metric` first, then the others of a
        multi-objective ``sweep.metric`` list."""
        modes = metric_families.metric_names(self.base.eval.ks)
        return [(self.metric, self.mode)] + [(f"val/{m}", modes.get(m)) for m in (self.settings.metrics or [])[1:]]

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    @property
    def epochs(self) -> int:
        """The longest a trial runs."""
        return self.settings.asha.max_t if self.settings.asha and self.settings.asha.max_t else self.base.train.epochs

    def trial_config(self, point: dict[str, Any]) -> RunConfig:
        """The run config of the trial at ``point`` (dotted key → sampled value)."""
        return validate(layer(self.base_tree, nested(point)), f"{self.source} at {point}")

    def grid_points(self) -> list[dict[str, Any]]:
        """A union's trials: each grid's values crossed, every point completed with the base's
        value of each key its grid leaves out, a point of several grids once, in the order written."""
        flat = self.base.flat()
        points: list[dict[str, Any]] = []
        alike: dict[tuple, list[dict[str, Any]]] = {}  # the points so far by their values' hashes
        for space in self.spaces:
            for values in itertools.product(*(dist.args for dist in space.values())):
                point = {key: flat[key] for key in self.keys} | dict(zip(space, values))
                same_hash = alike.setdefault(tuple(map(_hash_of, point.values())), [])
                if point not in same_hash:  # == on the values: 60 and 60.0 are one point
                    same_hash.append(point)
                    points.append(point)
        return points

    def trials_at_most(self) -> int:
        """The trials the sweep starts, counted without listing its points: ``num_samples`` × its
        grid points (a union's grids summed, so a point two grids share counts twice)."""
        return self.settings.num_samples * sum(math.prod(len(dist.args) for dist in space.values()
                                                         if dist.kind == "grid") for space in self.spaces)

    def param_space(self) -> dict[str, Any]:
        """Tune's ``param_space``: each key's domain; of a union, one grid over its whole points
        (Tune's grid keys cross: the grids' keys would run the points of no grid)."""
        if self.union:
            from ray import tune

            return {POINT_KEY: tune.grid_search(self.grid_points())}
        return {key: dist.domain() for key, dist in self.spaces[0].items()}

    def point_of(self, config: dict[str, Any]) -> dict[str, Any]:
        """The point (dotted key → value) of a trial's Tune config."""
        return dict(config[POINT_KEY]) if self.union else {key: config.get(key) for key in self.keys}

    def explore(self, config: dict[str, Any]) -> dict[str, Any]:
        """PBT's explored config (Ray Tune's ``custom_explore_fn``) with each mutated key clipped
        into its distribution (a perturbation multiplies, and may leave it): inside the space,
        whose corners were checked, so a valid run config."""
        return config | {key: dist.clip(config[key]) for key, dist in self.settings.pbt.mutations.items()}

    def digest(self) -> str:
        """sha256 of the base config, the space and the settings: a resumed sweep must match it."""
        spaces = [{k: d.model_dump() for k, d in space.items()} for space in self.spaces]
        text = json.dumps({"base": self.base.model_dump(mode="json"),
                           "space": spaces if self.union else spaces[0],
                           "sweep": self.settings.model_dump(mode="json", exclude={
                               "max_concurrent_trials", "verbose_trials", "max_trials"})},
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def points_to_check(self) -> list[dict[str, Any]]:
        """What is validated of each space (each grid of a union): its corners and random points
        (:func:`~pairsim.tune.space.distributions.corner_and_random_points`)."""
        return [point for space in self.spaces for point in corner_and_random_points(space)]

    def params(self) -> dict[str, Any]:
        """The sweep as MLflow params of its parent run."""
        out = {f"{label}.{k}": d.describe() for label, space in self.labelled() for k, d in space.items()}
        out |= {f"sweep.{k}": v for k, v in flatten(self.settings.model_dump(mode="json")).items()}
        return out | {"sweep.metric": ",".join(m for m, _ in self.objectives),
                      "sweep.mode": ",".join(m for _, m in self.objectives), "base.sha256": self.digest()[:16]}
