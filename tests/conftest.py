from pathlib import Path

import pytest

from pairsim import synth


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """256 train / 48 val shapes scenes at 64 px, in uneven shards (100, 100, 56 rows)."""
    root = tmp_path_factory.mktemp("shapes")
    synth.generate(root, num_train=256, num_val=48, num_test=0, rows_per_shard=100, progress=False)
    return root


@pytest.fixture(scope="session")
def ray_instance():
    """One local Ray instance for the session's end-to-end tests (2 workers + 2 CPUs for Data).

    Ray workers get this directory on their path, so training functions defined in test
    modules unpickle there."""
    import ray

    ray.init(num_cpus=4, runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}})
    yield ray
    ray.shutdown()
