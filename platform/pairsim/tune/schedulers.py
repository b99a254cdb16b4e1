"""Ray Tune's trial schedulers for a sweep's ``scheduler``: FIFO, ASHA, and the population
schedulers PBT and PB2, which clone one trial's checkpoint into another.

Imported by the sweep's driver alone: PB2 brings scikit-learn, which a trial need not import."""

from __future__ import annotations

import random
import warnings

import numpy as np
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining, TrialScheduler
from ray.tune.schedulers.pb2 import PB2

from pairsim.tune.space import Sweep


class LastEpochKept:
    """A population scheduler less the exploit at a trial's last epoch (a clone would have
    nothing left to train: the trial ends as it is)."""

    def __init__(self, epochs: int, **kwargs):
        super().__init__(**kwargs)
        self.epochs = epochs

    def on_trial_result(self, tune_controller, trial, result):
        if result.get("epoch", 0) >= self.epochs:
            return TrialScheduler.CONTINUE
        return super().on_trial_result(tune_controller, trial, result)


class Population(LastEpochKept, PopulationBasedTraining):
    """Ray Tune's PBT, less the exploit at a trial's last epoch."""


class BanditPopulation(LastEpochKept, PB2):
    """Ray Tune's PB2, less the exploit at a trial's last epoch."""


def scheduler_of(sweep: Sweep):
    """Ray Tune's trial scheduler for ``sweep.scheduler``: FIFO, ASHA over epochs, or PBT or PB2
    over epochs (the explored values kept valid by :meth:`Sweep.explore`; Python's ``random``,
    which PBT draws from, and numpy's, which PB2's bandit draws from, seeded with ``sweep.seed``)."""
    settings = sweep.settings
    if settings.asha:
        return ASHAScheduler(time_attr="epoch", max_t=sweep.epochs, grace_period=settings.asha.grace_period,
                             reduction_factor=settings.asha.reduction_factor)
    if settings.pbt:
        pbt = settings.pbt
        if settings.seed is not None:
            random.seed(settings.seed)
            np.random.seed(settings.seed)
        # Tune's hint for trainables that can reset in place; a pairsim trial's run cannot (its thread)
        warnings.filterwarnings("ignore", message="Consider boosting PBT performance by enabling `reuse_actors`")
        common = {"time_attr": "epoch", "perturbation_interval": pbt.perturbation_interval,
                  "quantile_fraction": pbt.quantile_fraction, "custom_explore_fn": sweep.explore, "synch": pbt.synch}
        if settings.scheduler == "pb2":
            return BanditPopulation(sweep.epochs, **common,
                                    hyperparam_bounds={key: dist.corners() for key, dist in pbt.mutations.items()})
        return Population(
            sweep.epochs, burn_in_period=pbt.burn_in, resample_probability=pbt.resample_probability,
            hyperparam_mutations={key: list(dist.args) if dist.kind == "choice" else dist.domain()
                                  for key, dist in pbt.mutations.items()},
            perturbation_factors=pbt.perturbation_factors, **common)
    return FIFOScheduler()
