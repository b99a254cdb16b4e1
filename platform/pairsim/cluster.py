"""The Ray cluster pairsim runs on: starting or joining it, and which of its nodes train and
which feed them data. Every command reaches Ray through here.

- **Starting and joining**: :func:`connect` joins an address (or ``RAY_ADDRESS``, set inside
  a ``ray job submit`` job) with pairsim shipped to its workers (:func:`join_cluster`), else
  starts a local instance, every port on loopback (:func:`start_local_instance`);
  :func:`init_ray` does so for a run, sizing the local instance for it; :func:`join` joins a
  local instance as written. What every
  worker process of a local instance runs first is :func:`address_own_cluster`.
- **Node roles**: a cluster labels its nodes by role (cluster.yaml's node types, or ``ray start
  --labels pairsim-role=train``): Ray Train's workers run on ``train`` nodes, Ray Data's read and
  decode tasks and actors on ``data`` nodes, both placed by Ray's label selectors.
  :func:`node_roles` reads the alive nodes' labels once, before a run starts;
  :func:`check_cpu_budget` refuses a run the nodes cannot hold, naming the knobs.

This module imports only the standard library, ``ray`` and :mod:`pairsim.compat` (pairsim's
config when it raises or reads one): the setup hook runs when a worker process starts, before
Ray sets ``OMP_NUM_THREADS`` for the task it will run, and a worker that imported torch there kept
torch's default thread count (all cores) instead of its CPUs' (1 per CPU): oversubscribed cores
and different float reductions (tested in ``tests/test_local_ray.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from pairsim import compat

if TYPE_CHECKING:
    from pairsim.config import NodeRolesConfig, RunConfig

PACKAGE_DIR = Path(__file__).resolve().parent  # the pairsim package the driver runs


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
LOCAL_RUNTIME_ENV = {"worker_process_setup_hook": f"{__name__}.{address_own_cluster.__name__}",
                     "env_vars": compat.ray.ONE_MACHINE_ENV}


def start_local_instance(listen_on_all_interfaces: bool = False, **init_kwargs) -> None:
    """``ray.init(**init_kwargs)`` of a new instance on this machine with
    :data:`LOCAL_RUNTIME_ENV` (merged under ``init_kwargs['runtime_env']``, its ``env_vars``
    too). Its dashboard, metrics exporters, GCS, raylet and workers listen on 127.0.0.1 only,
    unless ``listen_on_all_interfaces`` (Ray's own default: other machines reach them)."""
    runtime_env = init_kwargs.get("runtime_env", {})
    init_kwargs["runtime_env"] = LOCAL_RUNTIME_ENV | runtime_env | {
        "env_vars": LOCAL_RUNTIME_ENV["env_vars"] | runtime_env.get("env_vars", {})}
    with contextlib.nullcontext() if listen_on_all_interfaces else compat.ray.node_on_loopback():
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
    with compat.ray.node_on_loopback() if loopback else contextlib.nullcontext():
        ray.init(address=address, **init_kwargs)


def join_cluster(address: str | None, **init_kwargs) -> None:
    """``ray.init`` joining ``address`` (None: ``RAY_ADDRESS``, set inside a job), with this
    driver's pairsim package as a ``py_modules`` entry of the job's runtime environment: Ray
    uploads it once and every worker of the job (Ray Train, Ray Data, Tune) imports it from
    there, ahead of any pairsim installed on the node. Ray merges it with the runtime
    environment the job was submitted with (``--working-dir``), which must not set
    ``py_modules`` itself. A loopback address (a pairsim local instance) is joined as written
    (:func:`join`)."""
    join(address, runtime_env={"py_modules": [str(PACKAGE_DIR)]}, **init_kwargs)


IDLE_WORKERS_KEPT = 8  # beyond one per CPU: Ray counts Train's and Data's actors against the limit


def run_cpus(cfg: RunConfig) -> float:
    """The CPUs one run takes: its training workers' plus ``ray.data_cpus`` for Ray Data."""
    return cfg.train.num_workers * cfg.train.cpus_per_worker + cfg.ray.data_cpus


def starts_local_instance(cfg: RunConfig) -> bool:
    """Whether a run starts its own Ray instance on this machine: no ``ray.address`` and no
    ``RAY_ADDRESS`` (set inside a ``ray job submit`` job)."""
    return not (cfg.ray.address or os.environ.get("RAY_ADDRESS"))


def connect(address: str | None = None, listen_on_all_interfaces: bool = False, log_to_driver: bool = True,
            **local_kwargs) -> None:
    """Ray for this process, once: join ``address`` (None: ``RAY_ADDRESS``, set inside a ``ray
    job submit`` job) with pairsim shipped to its workers (:func:`join_cluster`); with neither,
    start a local instance with ``local_kwargs`` for ``ray.init``, listening on 127.0.0.1 unless
    ``listen_on_all_interfaces`` (:func:`start_local_instance`). Nothing when Ray is up."""
    if ray.is_initialized():
        return
    handler = signal.getsignal(signal.SIGTERM)  # pairsim.signals.stop_on_signals's, when a command runs
    with workers_watchdog():
        try:
            if address or os.environ.get("RAY_ADDRESS"):
                join_cluster(address, log_to_driver=log_to_driver)
            else:
                start_local_instance(listen_on_all_interfaces, log_to_driver=log_to_driver, **local_kwargs)
        except SystemExit as exc:  # ray.init's own SIGTERM handler, in place while it starts: sys.exit(SIGTERM)
            if not callable(handler) or exc.code != signal.SIGTERM:
                raise
            handler(signal.SIGTERM, None)
        finally:  # ray.init leaves its core worker's handler (a stack trace, then abort) in place of ours
            if callable(handler) and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, handler)
        ray.get(_worker_started.remote())


WORKER_START_TIMEOUT_S = 90.0  # PAIRSIM_WORKER_START_TIMEOUT_S overrides it


@ray.remote(num_cpus=0, max_retries=0)
def _worker_started() -> bool:
    return True


class WorkersNotStarting(RuntimeError):
    """Ray did not start, or its worker processes did not, in time (:func:`workers_watchdog`)."""


# The watchdog process: after TIMEOUT seconds without being killed it says why on the command's
# stderr and kills the Ray processes the command started (the blocked ray.init then fails, or
# Ray's core worker exits the process), then the command itself if it is still there 15 s later.
_WATCHDOG = """
import os, sys, time, psutil
parent, timeout, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(timeout)
print(message, file=sys.stderr, flush=True)
try:
    owner = psutil.Process(parent)
    for child in owner.children(recursive=True):
        if child.pid != os.getpid():
            child.kill()
    if not psutil.wait_procs([owner], timeout=15)[0]:
        owner.kill()
except psutil.NoSuchProcess:
    pass
"""


@contextlib.contextmanager
def workers_watchdog(timeout_s: float | None = None) -> Iterator[None]:
    """Ray started or joined, and a task that needs no resources run, within ``timeout_s``; or
    the likely causes and Ray's logs to read on stderr, and the command ends (exit 1). Without it a command
    whose Ray worker processes cannot start (the object store cannot be mapped, a broken Python
    environment on the nodes) waits in silence until killed: Ray retries them for ever, and
    ``ray.init`` blocks in native code holding the GIL, so no thread or signal handler of this
    process can act. A small watchdog process does: it kills the Ray processes this command
    started, which makes ``ray.init`` fail, and the command itself if it is still stuck 15 s on."""
    timeout_s = float(os.environ.get("PAIRSIM_WORKER_START_TIMEOUT_S", WORKER_START_TIMEOUT_S)) \
        if timeout_s is None else timeout_s
    message = (f"Ray's worker processes did not start within {timeout_s:.0f} s (a task needing no resources never "
               f"ran). Likely causes: the object store cannot be mapped (/dev/shm too small or not writable), a "
               f"worker's Python environment fails at start (a broken package, sitecustomize or PYTHONPATH), or the "
               f"machine is out of memory or processes. Read Ray's logs: raylet.out and worker-*.err in "
               f"/tmp/ray/session_latest/logs (or the session directory of the instance it joined)")
    started = time.monotonic()
    watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(timeout_s), f"pairsim: {message}"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        yield
    except Exception:
        if time.monotonic() - started < timeout_s:
            raise
        raise WorkersNotStarting("Ray was stopped by the start-up watchdog (the reason is above)") from None
    finally:
        watchdog.kill()
        watchdog.wait()


def init_ray(cfg: RunConfig, concurrent_runs: int = 1, log_to_driver: bool = True) -> None:
    """Ray for a run (:func:`connect` to ``ray.address``): a local instance is sized for
    ``concurrent_runs`` runs of ``run_cpus(cfg)`` each.

    Train workers' CPUs are taken out of Ray Data's budget; the extra ``data_cpus`` are what
    keeps ingest running beside them (logical CPUs: they may exceed the cores). The local
    instance keeps more idle worker processes than Ray's default (one per CPU, actors
    included): otherwise the decode workers, which import torch and open_clip (~6 s), are
    killed while the model is validated and every epoch starts cold (~9 s before its first
    batch; 1.7 s with them kept). ``cluster.yaml`` does the same with
    ``RAY_num_workers_soft_limit``."""
    ray.data.DataContext.get_current().enable_progress_bars = False
    cpus = math.ceil(run_cpus(cfg) * concurrent_runs)
    connect(cfg.ray.address, cfg.ray.listen_on_all_interfaces, log_to_driver, num_cpus=cpus,
            **compat.ray.worker_soft_limit(cpus + IDLE_WORKERS_KEPT))


@dataclass(frozen=True)
class NodeRoles:
    """Where a run's work goes: label selectors (None: any node) and the CPUs of the nodes each
    selects. Without roles both sides share the same nodes (``shared``)."""

    train: dict[str, str] | None
    data: dict[str, str] | None
    train_cpus: float
    data_cpus: float

    @property
    def shared(self) -> bool:
        return self.train is None


def node_roles(roles: NodeRolesConfig, nodes: list[dict] | None = None) -> NodeRoles:
    """The placement ``roles`` asks for on the alive ``nodes`` (``ray.nodes()`` by default)."""
    alive = [n for n in (ray.nodes() if nodes is None else nodes) if n["Alive"]]

    def cpus(value: str | None) -> float:
        return sum(n["Resources"].get("CPU", 0.0) for n in alive
                   if value is None or n.get("Labels", {}).get(roles.label) == value)

    labelled = any(roles.label in n.get("Labels", {}) for n in alive)
    if roles.placement == "off" or (roles.placement == "auto" and not labelled):
        return NodeRoles(None, None, cpus(None), cpus(None))
    found = {value: cpus(value) for value in (roles.train, roles.data)}
    missing = [f"{roles.label}={value}" for value, count in found.items() if not count]
    if missing:
        from pairsim.config import ConfigError

        seen = sorted({f"{roles.label}={n['Labels'][roles.label]}" for n in alive if roles.label in n.get("Labels", {})})
        raise ConfigError(f"ray.node_roles: no alive node with CPUs is labelled {' or '.join(missing)} (labelled: "
                          f"{', '.join(seen) or 'none'}); label them (ray start --labels …, cluster.yaml's node types), "
                          "name your labels in ray.node_roles, or set ray.node_roles.placement=off")
    return NodeRoles({roles.label: roles.train}, {roles.label: roles.data}, found[roles.train], found[roles.data])


def check_cpu_budget(cfg: RunConfig, roles: NodeRoles) -> None:
    """Refuse a run whose training workers do not fit their nodes, or would leave Ray Data no
    CPU for one task (it would wait forever for data), naming the knobs that fix it."""
    from pairsim.config import ConfigError

    train_cpus = cfg.train.num_workers * cfg.train.cpus_per_worker
    need = f"train.num_workers × train.cpus_per_worker = {train_cpus:g}"
    if roles.shared:
        if roles.train_cpus - train_cpus < cfg.data.cpus_per_task:
            raise ConfigError(
                f"{need} of the cluster's {roles.train_cpus:g} CPUs leaves {roles.train_cpus - train_cpus:g} for Ray "
                f"Data, less than one task's data.cpus_per_task ({cfg.data.cpus_per_task:g}); lower them, add CPU "
                "nodes, or give a local instance more with ray.data_cpus",
                ("train.num_workers", "train.cpus_per_worker", "data.cpus_per_task"))
        return
    if roles.train_cpus < train_cpus:
        raise ConfigError(f"{need}, more than the {roles.train_cpus:g} CPUs of the nodes labelled "
                          f"{_selector(roles.train)}; lower them or add training nodes",
                          ("train.num_workers", "train.cpus_per_worker"))
    if roles.data_cpus < cfg.data.cpus_per_task:
        raise ConfigError(f"data.cpus_per_task = {cfg.data.cpus_per_task:g}, more than the {roles.data_cpus:g} CPUs "
                          f"of the nodes labelled {_selector(roles.data)}; lower it or add data nodes")


def _selector(selector: dict[str, str] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (selector or {}).items())
