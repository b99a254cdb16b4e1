"""Node roles read from node labels (pairsim.cluster): which nodes train, which feed data, and the
refusals before a run starts. The nodes are ``ray.nodes()`` records as Ray 2.60 writes them; the
multi-node placement itself runs on a real cluster in tests/test_multinode.py."""

import pytest

from pairsim import cluster
from pairsim.config import ConfigError, NodeRolesConfig, RunConfig, validate


def node(cpus: float, alive: bool = True, **labels: str) -> dict:
    return {"Alive": alive, "Resources": {"CPU": cpus} if cpus else {}, "Labels": {"ray.io/node-id": "x", **labels}}


HEAD = node(0)
TRAIN, DATA = node(4, **{"pairsim-role": "train"}), node(8, **{"pairsim-role": "data"})


def test_one_unlabelled_machine_shares_its_cpus():
    roles = cluster.node_roles(NodeRolesConfig(), [node(4)])
    assert roles == cluster.NodeRoles(None, None, 4, 4) and roles.shared


def test_labelled_nodes_place_training_and_data_apart_counting_alive_nodes_only():
    roles = cluster.node_roles(NodeRolesConfig(), [HEAD, TRAIN, DATA, node(16, alive=False, **{"pairsim-role": "data"})])
    assert roles == cluster.NodeRoles({"pairsim-role": "train"}, {"pairsim-role": "data"}, 4, 8)
    assert not roles.shared


def test_a_users_own_labels_and_placement_off():
    mine = NodeRolesConfig(label="tier", train="gpu", data="cpu")
    roles = cluster.node_roles(mine, [node(2, tier="gpu"), node(6, tier="cpu")])
    assert (roles.train, roles.data, roles.train_cpus, roles.data_cpus) == ({"tier": "gpu"}, {"tier": "cpu"}, 2, 6)
    assert cluster.node_roles(NodeRolesConfig(placement="off"), [TRAIN, DATA]) == cluster.NodeRoles(None, None, 12, 12)


@pytest.mark.parametrize(("placement", "nodes", "missing"), [
    ("auto", [HEAD, TRAIN], "pairsim-role=data"),  # a labelled cluster lacking a role is a mistake
    ("required", [node(4)], "pairsim-role=train or pairsim-role=data"),
    ("auto", [HEAD, node(0, **{"pairsim-role": "train"}), DATA], "pairsim-role=train"),  # no CPU there
])
def test_a_role_with_no_node_is_refused_naming_the_label(placement, nodes, missing):
    with pytest.raises(ConfigError) as exc:
        cluster.node_roles(NodeRolesConfig(placement=placement), nodes)
    message = str(exc.value)  # the key, the labels no node has, the way out
    assert message.startswith("ray.node_roles:") and f"labelled {missing} " in message and "placement=off" in message


def test_the_cpu_budget_of_nodes_by_role():
    roles = cluster.node_roles(NodeRolesConfig(), [HEAD, TRAIN, DATA])
    cfg = RunConfig.model_validate({"train": {"num_workers": 4, "cpus_per_worker": 1}, "data": {"cpus_per_task": 8}})
    cluster.check_cpu_budget(cfg, roles)  # 4 training CPUs on the train node, 8 on the data node: both fit
    with pytest.raises(ConfigError) as exc:
        cluster.check_cpu_budget(cfg.model_copy(update={"train": cfg.train.model_copy(update={"num_workers": 5})}), roles)
    message = str(exc.value)  # the need, the CPUs there are, the role
    assert "train.cpus_per_worker = 5" in message and "4 CPUs" in message and "pairsim-role=train" in message
    with pytest.raises(ConfigError) as exc:
        cluster.check_cpu_budget(cfg.model_copy(update={"data": cfg.data.model_copy(update={"cpus_per_task": 9})}), roles)
    message = str(exc.value)
    assert "data.cpus_per_task = 9" in message and "8 CPUs" in message and "pairsim-role=data" in message


@pytest.mark.parametrize("bad", [{"label": "-x"}, {"train": "a b"}, {"data": "x" * 64}, {"placement": "always"}])
def test_label_names_ray_would_refuse_are_refused_in_the_config(bad):
    with pytest.raises(ConfigError, match=f"ray.node_roles.{next(iter(bad))}"):
        validate({"ray": {"node_roles": bad}}, "a test")
