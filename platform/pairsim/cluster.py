"""The Ray cluster a run places its work on: which nodes train and which feed them data.

A cluster labels its nodes by role (cluster.yaml's node types, or ``ray start --labels
pairsim-role=train``): Ray Train's workers run on ``train`` nodes, Ray Data's read and decode
tasks and actors on ``data`` nodes, both placed by Ray's label selectors. :func:`node_roles`
reads the alive nodes' labels once, before a run starts; :func:`check_cpu_budget` refuses a
run the nodes cannot hold, naming the knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from pairsim.config import ConfigError, NodeRolesConfig, RunConfig


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
        seen = sorted({f"{roles.label}={n['Labels'][roles.label]}" for n in alive if roles.label in n.get("Labels", {})})
        raise ConfigError(f"ray.node_roles: no alive node with CPUs is labelled {' or '.join(missing)} (labelled: "
                          f"{', '.join(seen) or 'none'}); label them (ray start --labels …, cluster.yaml's node types), "
                          "name your labels in ray.node_roles, or set ray.node_roles.placement=off")
    return NodeRoles({roles.label: roles.train}, {roles.label: roles.data}, found[roles.train], found[roles.data])


def check_cpu_budget(cfg: RunConfig, roles: NodeRoles) -> None:
    """Refuse a run whose training workers do not fit their nodes, or would leave Ray Data no
    CPU for one task (it would wait forever for data), naming the knobs that fix it."""
    train_cpus = cfg.train.num_workers * cfg.train.cpus_per_worker
    need = f"train.num_workers × train.cpus_per_worker = {train_cpus:g}"
    if roles.shared:
        if roles.train_cpus - train_cpus < cfg.data.cpus_per_task:
            raise ConfigError(
                f"{need} of the cluster's {roles.train_cpus:g} CPUs leaves {roles.train_cpus - train_cpus:g} for Ray "
                f"Data, less than one task's data.cpus_per_task ({cfg.data.cpus_per_task:g}); lower them, add CPU "
                "nodes, or give a local instance more with ray.data_cpus")
        return
    if roles.train_cpus < train_cpus:
        raise ConfigError(f"{need}, more than the {roles.train_cpus:g} CPUs of the nodes labelled "
                          f"{_selector(roles.train)}; lower them or add training nodes")
    if roles.data_cpus < cfg.data.cpus_per_task:
        raise ConfigError(f"data.cpus_per_task = {cfg.data.cpus_per_task:g}, more than the {roles.data_cpus:g} CPUs "
                          f"of the nodes labelled {_selector(roles.data)}; lower it or add data nodes")


def _selector(selector: dict[str, str] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (selector or {}).items())
