"""What pairsim uses of Ray beyond its public API: the loopback switch of ``ray._private``
(:func:`node_on_loopback`), ``ray.init``'s private ``_system_config`` (:func:`worker_soft_limit`),
the log-deduplication variable read when ``ray`` is imported (:func:`quiet_worker_count_warning`),
Ray Train's record of a run's checkpoints (:data:`TRAIN_RECORD`, read as untrusted input:
:func:`train_record_checkpoints`), the ``SystemExit`` of Ray
Train's Ctrl-C handler (:func:`ctrl_c_in_fit`) and the switch of Ray Train's preemption watcher
(:data:`ONE_MACHINE_ENV`).

Imports no ``ray`` at module level: ``import pairsim`` calls :func:`quiet_worker_count_warning`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pairsim.signals import JobStopped

if TYPE_CHECKING:
    from pydantic import BaseModel

    from pairsim.storage import Location

TESTED = "ray>=2.60,<2.61"

TRAIN_RECORD = "checkpoint_manager_snapshot.json"
"""Ray Train's record of a run's checkpoints, in the run directory (Train V2's
``CHECKPOINT_MANAGER_SNAPSHOT_FILENAME``)."""
TRAIN_RECORD_MAX_BYTES = 64 * 2**20  # of TRAIN_RECORD: each kept checkpoint's name and its reported metrics

ONE_MACHINE_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
"""Environment variables of a local instance's workers: no preemption watcher (Train V2's
``ENABLE_PREEMPTION_WATCHER_ENV_VAR``), an actor each worker group starts to poll Ray for nodes
being drained, which an instance on one machine never has: ~3.5 s of CPU a run to start it."""


def quiet_worker_count_warning() -> None:
    """Drop the raylet's "N PYTHON worker processes have been started on node …" warning from
    this driver's console (it stays in the raylet's log), unless the user set
    ``RAY_DEDUP_LOGS_SKIP_REGEX``: Ray reads that variable when ``ray`` is first imported.

    Each Train controller, training worker and Ray Data actor is a Ray worker process of its own,
    so a run (and more so a sweep) starts more of them than the machine has cores, and the
    raylet warns again each time the count grows."""
    os.environ.setdefault("RAY_DEDUP_LOGS_SKIP_REGEX", r"PYTHON worker processes have been started on node")


@contextlib.contextmanager
def node_on_loopback() -> Iterator[None]:
    """Within the block this machine's Ray address is 127.0.0.1: an instance started here takes
    it as its node address, and a loopback address joined is not rewritten.

    Each of Ray's servers binds to the node address — the metrics exporters (dashboard agent,
    dashboard head, autoscaler monitor) to 0.0.0.0 unless it is loopback — and ``ray.init``
    rewrites 127.0.0.1, in ``_node_ip_address`` or in the address it joins, to the machine's
    LAN address. The switch with which Ray keeps a node on loopback on macOS and Windows
    (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``) is turned off within the block only, so
    a later ``ray.init(address=…)`` joining another machine's cluster still finds its own address."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def worker_soft_limit(limit: int) -> dict[str, Any]:
    """``ray.init`` keyword arguments for a local instance that keeps up to ``limit`` idle worker
    processes (Ray's default: one per CPU); ``ray start`` takes ``RAY_num_workers_soft_limit``."""
    return {"_system_config": {"num_workers_soft_limit": limit}}


@functools.cache
def train_record_model() -> type[BaseModel]:
    """What pairsim reads of :data:`TRAIN_RECORD` (Train V2's ``_CheckpointManagerState``), as a
    typed model: the checkpoints it ranks (``checkpoint_results``, each a ``checkpoint_dir_name``
    that is one plain name); Ray Train's other fields are left to it. Built on first use:
    ``import pairsim`` imports no pydantic."""
    from pydantic import BaseModel, ConfigDict, Field

    from pairsim.untrusted import PLAIN_NAME

    class RecordedCheckpoint(BaseModel):
        model_config = ConfigDict(extra="allow")

        checkpoint_dir_name: str = Field(pattern=f"^{PLAIN_NAME}$")

    class TrainRecord(BaseModel):
        model_config = ConfigDict(extra="allow")

        checkpoint_results: list[RecordedCheckpoint]

    return TrainRecord


def train_record_checkpoints(run: Location) -> list[str]:
    """The checkpoint directory names Ray Train's record of ``run`` (a run directory) lists;
    none without a record. :class:`~pairsim.untrusted.UntrustedFileError` naming the file when
    it is not one Ray Train writes (:func:`train_record_model`): not a regular file, not JSON,
    over :data:`TRAIN_RECORD_MAX_BYTES`, a field missing or of another type, a name that is not
    one plain directory name."""
    import pyarrow.fs

    from pairsim import untrusted

    record = run / TRAIN_RECORD
    if record.info().type == pyarrow.fs.FileType.NotFound:
        return []
    read = untrusted.read_model(record, train_record_model(), TRAIN_RECORD_MAX_BYTES)
    return [result.checkpoint_dir_name for result in read.checkpoint_results]


def set_aside_train_record(run: Location) -> Location:
    """Rename Ray Train's record of ``run`` ``<name>.stale-<time>``, where Ray Train no longer
    reads it (it then starts a new one); the renamed file."""
    aside = run / f"{TRAIN_RECORD}.stale-{time.strftime('%Y%m%d-%H%M%S')}"
    run.fs.move((run / TRAIN_RECORD).path, aside.path)
    return aside


@contextlib.contextmanager
def ctrl_c_in_fit() -> Iterator[None]:
    """Around ``TorchTrainer.fit()`` in the main thread: Ray Train's Ctrl-C leaves the block as
    :class:`~pairsim.signals.JobStopped` (SIGINT) instead of ``SystemExit``.

    Train V2's ``fit`` installs a SIGINT handler of its own (``_register_sigint_handler``): it
    asks the Train controller to abort, which ends the controller's process, and the handler,
    finding it gone, calls ``sys.exit(0)`` (at once on a third Ctrl-C): a ``SystemExit`` that
    would end the command as a success."""
    try:
        yield
    except SystemExit as exc:
        raise JobStopped.by(signal.SIGINT) from exc
