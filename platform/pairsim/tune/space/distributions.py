"""A search space's distributions: each swept key's Ray Tune domain (``uniform``, ``loguniform``,
``quniform``, ``randint``, ``choice``, ``grid``), its values as sampled, its corners, PBT's
perturbed values clipped back into it, and the points of a space validated before a sweep."""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal

import numpy as np
from pydantic import model_validator

from pairsim.config import Section

RANDOM_POINTS_CHECKED = 16
CORNER_POINTS_CHECKED = 256


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


def corner_and_random_points(space: Space) -> list[dict[str, Any]]:
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
