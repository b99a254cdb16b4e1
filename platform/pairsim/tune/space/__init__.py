"""A sweep file (``tune_spaces/*.yaml``): the run config a sweep starts from, the search space
and the sweep settings, validated as a whole before Ray starts.

.. code-block:: yaml

    base:                                  # the run config every trial starts from
      config: [pairsim:demo.yaml]          # run YAMLs layered left to right (relative to this file;
                                           # pairsim: names a config shipped in the package)
      loss: {base: unified}                # inline run-config keys, laid on top
    space:                                 # dotted run-config key -> distribution
      loss.base.margin: {uniform: [0.0, 0.4]}
      loss.base.gamma: {loguniform: [10, 100]}
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
      - {loss.base.margin: {grid: [0.0, 0.1, 0.2, 0.3, 0.4]}, loss.base.gamma: {grid: [60]}}
      - {loss.base.margin: {grid: [0.2]}, loss.base.gamma: {grid: [20, 40, 60, 80, 100]}}

Every key of ``space`` must be a key the base config has (``loss.base.margin`` under ``loss.base:
infonce`` is refused), every bound must give a valid run config alone (a margin reaching 3.0 is
refused because ``loss.base.margin`` ≤ 2), and so must the corners of the space and a few random
points of it together (``temperature.init`` above a sampled ``temperature.max``); in a union,
each grid alone, its errors under ``space.<index>``.

The modules: :mod:`~pairsim.tune.space.reading` (the file read, :func:`load_sweep`),
:mod:`~pairsim.tune.space.distributions` (a key's distribution as a Tune domain),
:mod:`~pairsim.tune.space.settings` (the ``sweep:`` section, its schedulers' settings),
:mod:`~pairsim.tune.space.validated` (:class:`Sweep`) and :mod:`~pairsim.tune.space.checks`
(what is validated before Ray starts). Their public names are importable from here.
"""

from pairsim.tune.space.checks import check_settings, check_space, run_config_errors
from pairsim.tune.space.distributions import (CORNER_POINTS_CHECKED, RANDOM_POINTS_CHECKED, Distribution, Space,
                                              corner_and_random_points)
from pairsim.tune.space.reading import SHIPPED_CONFIGS, SHIPPED_PREFIX, load_sweep
from pairsim.tune.space.settings import (MAX_TRIALS, MUTABLE_KEYS, PBT_ONLY, POPULATION_SCHEDULERS, ASHASettings,
                                         PBTSettings, SweepFile, SweepSettings, TrialResources)
from pairsim.tune.space.validated import POINT_KEY, Sweep, nested

__all__ = ["ASHASettings", "CORNER_POINTS_CHECKED", "Distribution", "MAX_TRIALS", "MUTABLE_KEYS", "PBTSettings",
           "PBT_ONLY", "POINT_KEY", "POPULATION_SCHEDULERS", "RANDOM_POINTS_CHECKED", "SHIPPED_CONFIGS",
           "SHIPPED_PREFIX", "Space", "Sweep", "SweepFile", "SweepSettings", "TrialResources", "check_settings",
           "check_space", "corner_and_random_points", "load_sweep", "nested", "run_config_errors"]
