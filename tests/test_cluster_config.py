from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).parents[1] / "cluster.yaml"


def test_cluster_yaml_is_a_valid_ray_cluster_config():
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    validate_config(config)
    prepared = prepare_config(config)
    validate_config(prepared)
    assert prepared["provider"]["type"] == "local"
    assert any("pip install" in c and "pairsim" in c for c in prepared["setup_commands"])
