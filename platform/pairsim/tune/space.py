"""A sweep file (``tune_spaces/*.yaml``): the run config a sweep starts from, the search space
and the sweep settings, validated as a whole before Ray starts.

.. code-block:: yaml

    base:                                  # the run config every trial starts from
      config: [pairsim:demo.yaml]          # run YAMLs layered left to right (relative to this file;
                                           # pairsim: names a config shipped in the package)
      loss: {base: unified}                # inline run-config keys, laid on top
    space:                                 # dotted run-config key -> distribution
      loss.margin: {uniform: [0.0, 0.4]}
      loss.gamma: {loguniform: [10, 100]}
    sweep:
      num_samples: 8
      search: optuna                       # random | grid | optuna (TPE)
      scheduler: asha                      # fifo | asha
      asha: {grace_period: 1, reduction_factor: 2}

``space`` may also be a list of grids, run as their union (as scikit-learn's ``ParameterGrid``
takes a list of dicts) under ``search: grid``: each grid crosses its own keys only, a key a grid
leaves out keeps the base's value, and a point two grids share runs once:

.. code-block:: yaml

    space:                                 # 9 trials: m at γ = 60, and γ at m = 0.2
      - {loss.margin: {grid: [0.0, 0.1, 0.2, 0.3, 0.4]}, loss.gamma: {grid: [60]}}
      - {loss.margin: {grid: [0.2]}, loss.gamma: {grid: [20, 40, 60, 80, 100]}}

Every key of ``space`` must be a key the base config has (``loss.margin`` under ``loss.base:
infonce`` is refused), every bound must give a valid run config alone (a margin reaching 3.0 is
refused because ``loss.margin`` ≤ 2), and so must the corners of the space and a few random
points of it together (``temperature.init`` above a sampled ``temperature.max``); in a union,
each grid alone, its errors under ``space.<index>``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationError, model_validator

from pairsim.config import (Bool, ConfigError, Float, Int, RunConfig, Section, absolute_paths, apply_overrides,
                            flatten, layer, read_yaml, set_dotted, validate)
from pairsim.config.fields import error_list
from pairsim.registry import METRICS

SHIPPED_CONFIGS = Path(__file__).parents[1] / "configs"
SHIPPED_PREFIX = "pairsim:"
RANDOM_POINTS_CHECKED = 16
CORNER_POINTS_CHECKED = 256
MAX_TRIALS = 10_000  # a sweep's trials unless sweep.max_trials says more: Tune holds every one on the driver
POINT_KEY = "point"  # a union's Tune config: {POINT_KEY: the trial's whole point}


class Distribution(Section):
    """One key's distribution, written ``{kind: arguments}`` as in Ray Tune:

    ``uniform: [low, high]``, ``loguniform: [low, high]`` (0 < low), ``quniform: [low, high, q]``
    (multiples of q), ``randint: [low, high]`` (integers, high excluded), ``choice: [v, ...]``
    (sampled), ``grid: [v, ...]`` (every value, crossed with the other grid keys)."""

    kind: Literal["uniform", "loguniform", "quniform", "randint", "choice", "grid"]
    args: list[Any]

    @model_validator(mode="before")
    @classmethod
    def _from_mapping(cls, data: Any) -> Any:
        if isinstance(data, dict) and "kind" not in data:
            if len(data) != 1:
                raise ValueError("write one distribution, e.g. {uniform: [0.0, 0.4]} or {choice: [16, 32]}")
            (kind, args), = data.items()
            return {"kind": kind, "args": args}
        return data

    @model_validator(mode="after")
    def _arguments(self) -> Distribution:
        args, kind = self.args, self.kind
        if kind in ("choice", "grid"):
            if not args:
                raise ValueError(f"{kind} needs at least one value")
            return self
        want = 3 if kind == "quniform" else 2
        if len(args) != want or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
            raise ValueError(f"{kind} needs [{'low, high, q' if want == 3 else 'low, high'}] as numbers, got {args}")
        if not all(math.isfinite(a) for a in args):
            raise ValueError(f"{kind} bounds must be finite, got {args}")
        if kind == "randint" and not all(isinstance(a, int) for a in args):
            raise ValueError(f"randint needs integer bounds, got {args}")
        if not args[0] < args[1]:
            raise ValueError(f"{kind} needs low < high, got low={args[0]}, high={args[1]}")
        if kind == "loguniform" and args[0] <= 0:
            raise ValueError(f"loguniform needs 0 < low, got {args[0]}")
        if kind == "quniform":
            if args[2] <= 0:
                raise ValueError(f"quniform needs q > 0, got {args[2]}")
            if any(abs(round(a / args[2]) * args[2] - a) > 1e-9 * max(1.0, abs(a)) for a in args[:2]):
                raise ValueError(f"quniform needs bounds that are multiples of q, got {args}")  # as Ray Tune does
        return self

    def domain(self):
        """The Ray Tune search-space object."""
        from ray import tune

        if self.kind == "grid":
            return tune.grid_search(list(self.args))
        return getattr(tune, self.kind)(*(self.args if self.kind != "choice" else [list(self.args)]))

    def _quantize(self, value: float) -> float:
        q = self.args[2]
        return float(np.round(value / q) * q)

    def clip(self, value: Any) -> Any:
        """``value`` (PBT's perturbed value) inside the distribution: a bound it passed, quantized
        for ``quniform``, an integer for ``randint``; ``choice`` values as they are."""
        if self.kind in ("choice", "grid"):
            return value
        low, high = self.corners()
        value = min(max(value, low), high)
        return self._quantize(value) if self.kind == "quniform" else int(round(value)) if self.kind == "randint" else value

    def corners(self) -> list[Any]:
        """What is validated before the sweep: both bounds (as sampled: ``randint``'s high − 1,
        ``quniform``'s bounds rounded to q), every value of ``choice`` and ``grid``."""
        if self.kind in ("choice", "grid"):
            return list(self.args)
        low, high = self.args[:2]
        if self.kind == "randint":
            return [low, high - 1]
        if self.kind == "quniform":
            return [self._quantize(low), self._quantize(high)]
        return [low, high]

    def sample(self, rng: np.random.Generator) -> Any:
        if self.kind in ("choice", "grid"):
            return self.args[int(rng.integers(len(self.args)))]
        low, high = self.args[:2]
        if self.kind == "randint":
            return int(rng.integers(low, high))
        if self.kind == "loguniform":
            return float(math.exp(rng.uniform(math.log(low), math.log(high))))
        value = float(rng.uniform(low, high))
        return self._quantize(value) if self.kind == "quniform" else value

    def describe(self) -> str:
        return f"{self.kind}{self.args}"


Space = dict[str, Distribution]  # dotted run-config key -> distribution


class ASHASettings(Section):
    """Asynchronous successive halving (Li et al., MLSys 2020) over epochs: at epochs
    grace_period·rfᵏ a trial goes on only if its metric is in the top 1/rf of what trials
    reported there."""

    grace_period: Int = Field(1, ge=1, description="epochs every trial runs before it can be stopped")
    reduction_factor: Float = Field(2.0, gt=1.0, description="rf: the share 1/rf of trials kept at each rung")
    max_t: Int | None = Field(None, ge=1, description="epochs of the longest trial (default: the base's train.epochs)")


MUTABLE_KEYS = (r"optim\.lr", r"loss\.(margin|gamma)", r"loss\.cusa\.(alpha|beta|teacher_temperature)",
                r"loss(\.cusa\.(cross|image|text)_temperature|\.temperature)\.(init|min|max)")
"""Run-config keys (regular expressions) PBT may change mid-run: what a checkpoint does not fix.
The loss's parameters are read from the config each step; the learning rate's schedule restarts
from its new peak (DeepSpeed's scheduler keeps its step, not its base rate); a temperature's
bounds clamp it from the next step, and a changed ``init`` sets it (see :class:`PBTSettings`)."""


POPULATION_SCHEDULERS = ["pbt", "pb2"]  # the schedulers that clone one trial's checkpoint into another
PBT_ONLY = {"resample_probability", "perturbation_factors", "burn_in"}  # settings Ray's PB2 does not take


class PBTSettings(Section):
    """Population Based Training (Jaderberg et al., 2017, arXiv 1711.09846), Ray Tune's
    ``PopulationBasedTraining`` over epochs: every ``perturbation_interval`` epochs a trial in the
    bottom ``quantile_fraction`` of the population (by the sweep's metric) continues from the
    checkpoint of one in the top fraction, with that trial's hyperparameters *explored*: each
    mutated key is resampled from its distribution with ``resample_probability``, else
    multiplied by one of ``perturbation_factors``, then kept inside its distribution's bounds.

    A population that does not fit the cluster at once takes turns: a trial pauses at each
    interval while others run, and resumes from its checkpoint (each resume costs a run's
    start-up). ``synch`` (the default) compares the population when every trial has reached the
    interval — what a population taking turns does anyway, and deterministic; ``synch: false``
    is Ray's asynchronous PBT, which compares a trial with the others' last reports (its first
    round exploits nothing: no trial has yet been saved as a top one).

    A trial that clones another with a mutated ``init`` of a temperature starts from the new τ;
    everything else of the clone's state (weights, optimizer moments, step) is the donor's.

    Under ``scheduler: pb2`` (Population Based Bandits, Parker-Holder et al., NeurIPS 2020, arXiv
    2002.02518; Ray Tune's ``PB2``) the exploit is the same and the explore is a bandit's: a
    Gaussian process fitted to every trial's change of the metric per epoch, against its epoch,
    its metric before and its hyperparameters, proposes the point of the mutations' [low, high]
    box with the highest upper confidence bound (GP-UCB; the box searched on a linear scale,
    a loguniform's too). The mutations must be ranges (uniform, loguniform, quniform, randint);
    ``resample_probability``, ``perturbation_factors`` and ``burn_in`` are PBT's alone. PB2
    records each trial at each comparison and learns from a trial's change between two records
    with the same values: at the first comparison there is none, and a clone takes the donor's
    values (kept inside the bounds)."""

    perturbation_interval: Int = Field(1, ge=1, description="epochs between a trial's exploit/explore decisions")
    mutations: dict[str, Distribution] = Field(
        description="key -> distribution, as in space; a key not in space also starts there (its first value drawn "
                    "from this distribution); only keys a checkpoint does not fix (tune.space.MUTABLE_KEYS)")
    quantile_fraction: Float = Field(0.25, gt=0.0, le=0.5,
                                     description="share of the population at the top and at the bottom")
    resample_probability: Float = Field(0.25, ge=0.0, le=1.0,
                                        description="chance a mutated key is drawn anew rather than perturbed")
    perturbation_factors: tuple[Float, Float] = Field((1.2, 0.8), description="what a perturbed value is multiplied by")
    burn_in: Int = Field(0, ge=0, description="epochs before a trial is first compared")
    synch: Bool = Field(True, description="compare the whole population at each interval (false: Ray's asynchronous PBT)")

    @model_validator(mode="after")
    def _mutations(self) -> PBTSettings:
        if not self.mutations:
            raise ValueError("mutations: needs at least one key, e.g. optim.lr: {loguniform: [1.0e-4, 1.0e-3]}")
        return self


class TrialResources(Section):
    """What one trial reserves; each field left out keeps the base config's value."""

    num_workers: Int | None = Field(None, ge=1, description="train.num_workers")
    cpus_per_worker: Float | None = Field(None, gt=0.0, description="train.cpus_per_worker")
    gpus_per_worker: Float | None = Field(
        None, ge=0.0, description="train.gpus_per_worker; 0 trains on CPU, a fraction lets trials share a GPU")
    data_cpus: Float | None = Field(None, gt=0.0, description="ray.data_cpus: the trial's cap on Ray Data's CPUs")

    def overrides(self) -> dict[str, Any]:
        """The run-config keys these settings stand for."""
        out = {"train.num_workers": self.num_workers, "train.cpus_per_worker": self.cpus_per_worker,
               "ray.data_cpus": self.data_cpus}
        if self.gpus_per_worker is not None:
            out["train.use_gpu"] = self.gpus_per_worker > 0
            if self.gpus_per_worker > 0:
                out["train.gpus_per_worker"] = self.gpus_per_worker
        return {k: v for k, v in out.items() if v is not None}


class SweepSettings(Section):
    """How the space is searched and trials are scheduled."""

    metric: str | list[str] | None = Field(
        None, description="the val metric trials are ranked by (it also picks each trial's best checkpoint); default: "
                          "the base's eval.select_metric. A list searches several at once (multi-objective: the first "
                          "picks checkpoints and best.yaml, the sweep reports their Pareto front)")
    mode: Literal["max", "min"] | list[Literal["max", "min"]] | None = Field(
        None, description="default: each metric's own (min for median ranks)")
    num_samples: Int = Field(8, ge=1, description="trials drawn (random, optuna); repeats of the grid (grid)")
    search: Literal["random", "grid", "optuna"] = Field(
        "random", description="random: Tune's variant generator; grid: every combination of the grid values; "
                              "optuna: TPE (ray.tune.search.optuna.OptunaSearch)")
    scheduler: Literal["fifo", "asha", "pbt", "pb2"] = Field(
        "asha", description="fifo: every trial runs all its epochs; asha: ASHA stops the weak early; pbt: Population "
                            "Based Training; pb2: its bandit variant (new values from a GP-UCB over the mutations' "
                            "bounds, Parker-Holder et al., 2020)")
    asha: ASHASettings | None = Field(None, description="ASHA's rungs (scheduler asha only)")
    pbt: PBTSettings | None = Field(None, description="Population Based Training (scheduler pbt or pb2)")
    max_concurrent_trials: Int | None = Field(
        None, ge=1, description="default: as many as the cluster's CPUs and GPUs hold (1 on a local instance)")
    resources: TrialResources = TrialResources()
    seed: Int | None = Field(0, description="seeds the search (random and optuna); null: unseeded")
    verbose_trials: Bool = Field(False, description="show the trials' own logs (training progress) on the console")
    max_trials: Int = Field(
        MAX_TRIALS, ge=1, description="the most trials the sweep may start (num_samples × its grid points); a larger "
                                      "sweep is refused before Ray starts. Raise it for a sweep that large: Tune "
                                      "keeps every trial on the driver")

    @property
    def metrics(self) -> list[str] | None:
        """The metric names as the evaluation reports them (a ``val/`` prefix dropped), or None."""
        if self.metric is None:
            return None
        return [m.removeprefix("val/") for m in ([self.metric] if isinstance(self.metric, str) else self.metric)]

    @model_validator(mode="after")
    def _scheduler_options(self) -> SweepSettings:
        if isinstance(self.metric, list) and len(self.metric) > 1 and "scheduler" not in self.model_fields_set:
            self.scheduler = "fifo"  # ASHA and PBT rank by one metric
        if isinstance(self.metric, list) and not self.metric:
            raise ValueError("metric: an empty list; name one metric or several, e.g. [rsum, i2i_mAP@R]")
        for name, schedulers in (("asha", ["asha"]), ("pbt", POPULATION_SCHEDULERS)):
            if self.scheduler not in schedulers and getattr(self, name) is not None:
                raise ValueError(f"{name}: only for scheduler {' or '.join(schedulers)}, not {self.scheduler}")
        if self.scheduler == "asha" and self.asha is None:
            self.asha = ASHASettings()
        if self.scheduler in POPULATION_SCHEDULERS and self.pbt is None:
            raise ValueError(f"pbt: scheduler {self.scheduler} needs its settings, at least pbt.mutations (the keys it "
                             "may change)")
        if self.scheduler == "pb2" and (pbt_only := sorted(PBT_ONLY & self.pbt.model_fields_set)):
            raise ValueError(f"pbt.{pbt_only[0]}: PBT's alone; PB2 draws a clone's values from its bandit, within "
                             "the mutations' bounds, and compares trials from their first report")
        return self


class SweepFile(Section):
    base: dict[str, Any] = Field(default_factory=dict, description="config: run YAML(s), plus inline run-config keys")
    space: dict[str, Distribution] | list[dict[str, Distribution]] = Field(
        default_factory=dict, description="dotted key -> distribution; or a list of such grids, run as their union")
    sweep: SweepSettings = SweepSettings()


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


def nested(point: dict[str, Any]) -> dict[str, Any]:
    """``{"loss.margin": 0.2}`` → ``{"loss": {"margin": 0.2}}``."""
    tree: dict[str, Any] = {}
    for key, value in point.items():
        set_dotted(tree, key, value)
    return tree


def _without_bad_fields(model: type[Section], data: dict[str, Any], exc: ValidationError) -> Section:
    """``data`` validated without the fields ``exc`` faults (their defaults instead), so the
    checks that read the other fields still run; the defaults if that fails too."""
    bad = {e["loc"][0] for e in exc.errors() if e["loc"]}
    try:
        return model.model_validate({k: v for k, v in data.items() if k not in bad})
    except ValidationError:
        return model()


def _message(error: dict[str, Any]) -> str:
    return "unknown key" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")


def _errors_of(tree: dict[str, Any]) -> str | None:
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
    return (_errors_of(layer(tree, nested({key: dist.corners()[0]}))) or "unknown key").strip()


def _hash_of(value: Any) -> Any:
    """A hash equal values share (60 and 60.0 too); of an unhashable value (a list), its type's name."""
    try:
        return hash(value)
    except TypeError:
        return type(value).__name__


def _points_to_check(space: Space) -> list[dict[str, Any]]:
    """The corners of ``space`` (all of them up to 256, else the all-low / all-high ones) and 16
    seeded random points."""
    keys = list(space)
    corners = [space[k].corners() for k in keys]
    if math.prod(map(len, corners)) <= CORNER_POINTS_CHECKED:
        points = [dict(zip(keys, values)) for values in itertools.product(*corners)]
    else:
        points = [dict(zip(keys, (c[0] for c in corners))), dict(zip(keys, (c[-1] for c in corners)))]
    rng = np.random.default_rng(0)
    return points + [{k: space[k].sample(rng) for k in keys} for _ in range(RANDOM_POINTS_CHECKED)]


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
        modes = METRICS.reported(self.base.eval.ks)
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
        """What is validated of each space (each grid of a union): :func:`_points_to_check`."""
        return [point for space in self.spaces for point in _points_to_check(space)]

    def params(self) -> dict[str, Any]:
        """The sweep as MLflow params of its parent run."""
        out = {f"{label}.{k}": d.describe() for label, space in self.labelled() for k, d in space.items()}
        out |= {f"sweep.{k}": v for k, v in flatten(self.settings.model_dump(mode="json")).items()}
        return out | {"sweep.metric": ",".join(m for m, _ in self.objectives),
                      "sweep.mode": ",".join(m for _, m in self.objectives), "base.sha256": self.digest()[:16]}


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
            errors.append(f"{label}: needs at least one key, e.g. loss.margin: {example}")
        space: Space = {}
        for key, spec in grid.items() if isinstance(grid, dict) else []:
            try:
                space[key] = Distribution.model_validate(spec)
            except ValidationError as exc:
                errors += [f"{label}.{key}: {_message(e)}" for e in exc.errors()]
        spaces.append(space)
    return spaces, errors


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> Sweep:
    """Read and validate a sweep file; ``overrides`` (``--set``) starting with ``sweep.`` or
    ``space.`` apply to the sweep file, the others to its base run config.

    The steps: the file with its own overrides (:func:`_read_sweep_file`), its space and sections
    (:func:`_read_sections`), the base run config (:func:`_base_config`), then the settings
    (:func:`_check_settings`), the number of trials (``sweep.max_trials``, counted, not listed)
    and every space key and point (:func:`_check_space`) against it. Raises :class:`ConfigError`
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
    _check_settings(sweep, listed, keys, errors)
    trials, most = sweep.trials_at_most(), sweep.settings.max_trials
    if trials > most:  # checked before any point is listed or validated
        errors.append(f"space: {'up to ' if sweep.union else ''}{trials:,} trials (num_samples × grid points), "
                      f"more than sweep.max_trials ({most:,}); to run that many, raise sweep.max_trials in the sweep "
                      "section or with --set sweep.max_trials=N")
    else:
        _check_space(sweep, errors)
    if errors:
        raise _problems(path, errors)
    return sweep


def _problems(path: Path, errors: list[str]) -> ConfigError:
    """``errors`` as one :class:`ConfigError` (:func:`pairsim.config.fields.error_list`)."""
    return ConfigError(error_list(errors, str(path)))


def _read_sweep_file(path: Path, overrides: list[str], errors: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The sweep file as read, with the ``sweep.``/``space.`` overrides applied; the overrides left
    for the base run config."""
    raw = read_yaml(path)
    for section in ("space", "sweep"):  # written with no value: empty
        if raw.get(section) is None:
            raw[section] = {}
    sweep_sets = [o for o in overrides if o.split("=", 1)[0].strip().split(".")[0] in ("sweep", "space")]
    base_sets = [o for o in overrides if o not in sweep_sets]
    for item in sweep_sets:  # space.loss.margin={uniform: [0, 0.3]}: the key after space. is one dotted key
        key, _, value = item.partition("=")
        if key.strip().startswith("space."):
            why = _set_space(raw, key.strip()[len("space."):], apply_overrides({}, [f"v={value}"])["v"])
            errors += [why] if why else []
        else:
            apply_overrides(raw, [item])
    return raw, base_sets


def _read_sections(raw: dict[str, Any], errors: list[str]) -> tuple[list[Space], SweepFile]:
    """The spaces and the file's sections, each validated alone (all their errors at once; a bad
    field left out so the rest can still be checked)."""
    spaces, space_errors = _read_spaces(raw["space"])
    errors += space_errors
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
    tree = layer(tree, apply_overrides({}, base_sets))
    tree = layer(tree, nested(file.sweep.resources.overrides()))
    metrics = file.sweep.metrics or []
    for i, metric in enumerate(metrics):  # each must be a metric a checkpoint could be selected by
        eval_tree = layer(tree, {"eval": {"select_metric": metric}})
        why = _errors_of(eval_tree) if _errors_of(tree) is None else None
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


def _check_settings(sweep: Sweep, listed: bool, keys: list[str], errors: list[str]) -> None:
    """The settings against each other and the space: modes, scheduler and search, PBT's
    mutations (added to the space when not in it: their first value drawn from them), ASHA."""
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
                          "trial's checkpoint, which fixes it); PBT may change optim.lr, loss.margin, loss.gamma, "
                          "loss.cusa.alpha/beta/teacher_temperature and a temperature's init/min/max")
        if not listed and key not in spaces[0]:
            spaces[0][key] = dist  # its first value drawn from the mutation's distribution
    if settings.asha and settings.asha.max_t is None and "train.epochs" in keys:
        errors.append("sweep.asha.max_t: needed when train.epochs is swept (ASHA's longest trial, in epochs)")
    if settings.asha and settings.asha.grace_period > sweep.epochs:
        errors.append(f"sweep.asha.grace_period: {settings.asha.grace_period} epochs is more than the "
                      f"{sweep.epochs} a trial runs")



def _check_space(sweep: Sweep, errors: list[str]) -> None:
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
                why = _errors_of(layer(tree, nested({key: value})))
                if why:
                    errors.append(f"{where}: {name} {value!r} gives an invalid run config: {why.strip()}")
                    bad_keys.add(where)
            for value in [] if where in bad_keys else [dist.sample(rng) for _ in range(RANDOM_POINTS_CHECKED)]:
                why = _errors_of(layer(tree, nested({key: value})))
                if why:  # e.g. uniform over an integer key
                    errors.append(f"{where}: sampled {value!r} gives an invalid run config: {why.strip()}")
                    bad_keys.add(where)
                    break
    if not bad_keys:
        seen = set()
        points = ((label, point) for label, space in sweep.labelled() for point in _points_to_check(space))
        for label, point in points:
            why = _errors_of(layer(tree, nested(point)))
            if why and why not in seen:
                seen.add(why)
                errors.append(f"{label}: the point {point} gives an invalid run config: {why.strip()}")
                if len(seen) == 3:
                    break
