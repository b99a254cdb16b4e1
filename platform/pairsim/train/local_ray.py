"""What every worker process of pairsim's local Ray instances runs first
(``worker_process_setup_hook``).

This module imports only ``os`` and ``ray``: the hook runs when a worker process starts, before
Ray sets ``OMP_NUM_THREADS`` for the task it will run, and a worker that imported torch here
kept torch's default thread count (all cores) instead of its CPUs' (1 per CPU): oversubscribed
cores and different float reductions (tested in ``tests/test_local_ray.py``).
"""

from __future__ import annotations

import os

import ray


def address_own_cluster() -> None:
    """Every worker of a local instance sets ``RAY_ADDRESS`` to its own cluster's GCS.

    The State API, which Train V2's ``PlacementGroupCleaner`` asks whether a run's controller is
    still alive, otherwise finds its cluster by scanning the machine's GCS processes: with a
    second local instance on the machine (a test suite beside a demo, two sweeps) it raised
    "Found multiple active Ray instances" in the cleaner's thread, and the workers' placement
    group of a trial stopped by ASHA was never freed, so the next trial waited for its CPUs
    forever. A ``ray start`` cluster names itself in ``/tmp/ray/ray_current_cluster`` and a
    submitted job has ``RAY_ADDRESS``: they need nothing."""
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


# the runtime environment of pairsim's local instances (the tests' own instance uses it too)
LOCAL_RUNTIME_ENV = {"worker_process_setup_hook": f"{__name__}.{address_own_cluster.__name__}"}
