"""pairsim's local Ray instances: how they start (:func:`start_local_instance`, every port on
loopback), how a driver joins one (:func:`join`) and what every one of their worker processes
runs first (``worker_process_setup_hook``).

This module imports only the standard library and ``ray``: the hook runs when a worker process
starts, before Ray sets ``OMP_NUM_THREADS`` for the task it will run, and a worker that imported
torch here kept torch's default thread count (all cores) instead of its CPUs' (1 per CPU):
oversubscribed cores and different float reductions (tested in ``tests/test_local_ray.py``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import urllib.parse
from collections.abc import Iterator

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


@contextlib.contextmanager
def _node_on_loopback() -> Iterator[None]:
    """Within the block this machine's Ray address is 127.0.0.1: an instance started here takes
    it as its node address, and a loopback address joined is not rewritten.

    Each of Ray's servers binds to the node address — the metrics exporters (dashboard agent,
    dashboard head, autoscaler monitor) to 0.0.0.0 unless it is loopback — and ``ray.init``
    rewrites 127.0.0.1, in ``_node_ip_address`` or in the address it joins, to the machine's
    LAN address. The switch with which Ray keeps a node on loopback on macOS and Windows
    (``ray_constants.ENABLE_RAY_CLUSTER``) is turned off within the block only, so a later
    ``ray.init(address=…)`` joining another machine's cluster still finds its own address."""
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
    with contextlib.nullcontext() if listen_on_all_interfaces else _node_on_loopback():
        ray.init(**init_kwargs)


LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def answers_on_loopback_only(address: str) -> bool:
    """Whether a GCS address (``host:port``) names this machine's loopback and the LAN address
    does not answer on its port: a pairsim local instance, which ``ray.init`` would look for at
    the LAN address (a ``ray start`` head, listening on every interface, answers there)."""
    parts = urllib.parse.urlsplit(f"//{address}")
    if "://" in address or parts.hostname not in LOOPBACK_HOSTS or parts.port is None:
        return False
    try:
        socket.create_connection((ray.util.get_node_ip_address(), parts.port), timeout=2).close()
    except OSError:
        return True
    return False


def join(address: str | None, **init_kwargs) -> None:
    """``ray.init(address=address, **init_kwargs)`` joining a running instance (None:
    ``RAY_ADDRESS``). A local instance that listens on loopback only is joined as written:
    Ray would rewrite 127.0.0.1 to the LAN address, where nothing listens."""
    loopback = answers_on_loopback_only(address or os.environ.get("RAY_ADDRESS", ""))
    with _node_on_loopback() if loopback else contextlib.nullcontext():
        ray.init(address=address, **init_kwargs)
