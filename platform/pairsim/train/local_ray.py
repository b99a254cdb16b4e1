"""pairsim's local Ray instances: how they start (:func:`start_local_instance`, every port on
loopback) and what every one of their worker processes runs first (``worker_process_setup_hook``).

This module imports only the standard library and ``ray``: the hook runs when a worker process
starts, before Ray sets ``OMP_NUM_THREADS`` for the task it will run, and a worker that imported
torch here kept torch's default thread count (all cores) instead of its CPUs' (1 per CPU):
oversubscribed cores and different float reductions (tested in ``tests/test_local_ray.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

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


@contextmanager
def _node_on_loopback() -> Iterator[None]:
    """Within the block a Ray instance started here takes 127.0.0.1 as its node address.

    Each of Ray's servers binds to the node address — the metrics exporters (dashboard agent,
    dashboard head, autoscaler monitor) to 0.0.0.0 unless it is loopback — and ``ray.init``
    rewrites an explicit ``_node_ip_address="127.0.0.1"`` to the machine's LAN address. The
    switch with which Ray keeps a node on loopback on macOS and Windows
    (``ray_constants.ENABLE_RAY_CLUSTER``) is turned off for the start only, so a later
    ``ray.init(address=…)`` joining a cluster still finds its own address."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def start_local_instance(listen_on_all_interfaces: bool = False, **init_kwargs) -> None:
    """``ray.init(**init_kwargs)`` of a new instance on this machine with
    :data:`LOCAL_RUNTIME_ENV` (merged under ``init_kwargs['runtime_env']``). Its dashboard,
    metrics exporters, GCS, raylet and workers listen on 127.0.0.1 only, unless
    ``listen_on_all_interfaces`` (Ray's own default: other machines reach them)."""
    init_kwargs["runtime_env"] = LOCAL_RUNTIME_ENV | init_kwargs.get("runtime_env", {})
    if listen_on_all_interfaces:
        ray.init(**init_kwargs)
        return
    with _node_on_loopback():
        ray.init(**init_kwargs)
