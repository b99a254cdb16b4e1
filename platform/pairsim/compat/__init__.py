"""pairsim's one boundary with third-party internals: every use of Ray's, DeepSpeed's, MLflow's
or torch's private modules, private names and ops, internal files and internal environment
variables is in :mod:`pairsim.compat.ray`, :mod:`pairsim.compat.deepspeed`,
:mod:`pairsim.compat.mlflow` or :mod:`pairsim.compat.torch` (``tests/test_architecture.py``
fails on one elsewhere). Each states the versions it was tested on (``TESTED``);
:func:`version_report` compares them with what is installed, and ``pairsim doctor`` prints it.

Importing this package imports none of the four: ``import pairsim`` stays light.
"""

from __future__ import annotations

from importlib import metadata
from typing import NamedTuple

from pairsim.compat import deepspeed, mlflow, ray, torch

TESTED_RANGES = (ray.TESTED, deepspeed.TESTED, mlflow.TESTED, torch.TESTED)
"""The versions each shim was tested on, as PEP 440 requirements (``ray>=2.60,<2.61``)."""


class VersionCheck(NamedTuple):
    name: str
    installed: str | None  # None: not installed
    tested: str  # the requirement string
    within: bool


def version_report() -> list[VersionCheck]:
    """For each of :data:`TESTED_RANGES`: the distribution, its installed version and whether
    that is within the tested range (pre-releases included)."""
    from packaging.requirements import Requirement  # ray's and mlflow's dependency, not pairsim's own

    checks = []
    for tested in TESTED_RANGES:
        requirement = Requirement(tested)
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            installed = None
        within = installed is not None and requirement.specifier.contains(installed, prereleases=True)
        checks.append(VersionCheck(requirement.name, installed, tested, within))
    return checks
