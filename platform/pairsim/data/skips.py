"""The records that could not be read (undecodable images, shards left out by their checks),
each with its reason, as Ray Data's tasks find them.

One :class:`SkipLedger` actor per driver process, on the driver's node, holds them by scope: a
run, or one evaluation or embedding. A run's rank 0 reads its scope for the
``data/skipped_images`` metric; an evaluation or ``pairsim embed`` lists its scope at the end.
One actor serves every run of a process (the test suite's many, a reused Tune trial actor's),
where an actor per run cost each run a process start (~3.5 s of CPU)."""

from __future__ import annotations

import dataclasses
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0)
class SkipLedger:
    """What could not be read, by scope, then by image id (or ``shard …``), with the reason."""

    def __init__(self) -> None:
        self.skipped: dict[str, dict[str, str]] = {}

    def add(self, scope: str, items: dict[str, str]) -> None:
        self.skipped.setdefault(scope, {}).update(items)

    def get(self, scope: str) -> dict[str, str]:
        return dict(self.skipped.get(scope, {}))

    def drop(self, scope: str) -> None:
        self.skipped.pop(scope, None)


@dataclasses.dataclass(frozen=True)
class Skips:
    """One scope of a :class:`SkipLedger` (see :func:`new_scope`): what Ray Data's tasks and a
    run's workers get, to find the actor by its name."""

    ledger: str
    scope: str

    def add(self, items: dict[str, str]) -> None:
        ray.get(ray.get_actor(self.ledger).add.remote(self.scope, items))

    def recorded(self) -> dict[str, str]:
        return ray.get(ray.get_actor(self.ledger).get.remote(self.scope))

    def drop(self) -> None:
        """Forget the scope (its owner is done with it)."""
        ray.get_actor(self.ledger).drop.remote(self.scope)


# this process's ledger, by its connection to Ray (node and worker): its creator holds the
# handle (an actor nobody holds is ended)
_LEDGER_OF_THIS_PROCESS: dict[tuple[str, str], ray.actor.ActorHandle] = {}


def new_scope(what: str) -> Skips:
    """A new scope, named after ``what`` (a run's name, ``embed``), in this process's ledger:
    created on first use, on this node (on another node it would take the run down with it
    when that node is lost). A new connection to Ray gets a new one: a driver's worker id is
    its job's, which a second local instance started in the same process numbers alike, so
    the node's id tells them apart."""
    context = ray.get_runtime_context()
    node, worker = context.get_node_id(), context.get_worker_id()
    name = f"pairsim-skips-{worker}"  # one per process of the job
    if (node, worker) not in _LEDGER_OF_THIS_PROCESS:
        _LEDGER_OF_THIS_PROCESS.clear()
        here = NodeAffinitySchedulingStrategy(node, soft=False)
        _LEDGER_OF_THIS_PROCESS[node, worker] = SkipLedger.options(name=name, scheduling_strategy=here).remote()
    return Skips(name, f"{what}-{uuid.uuid4().hex[:8]}")
