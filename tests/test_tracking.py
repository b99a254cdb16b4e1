"""The MLflow run a job opens carries the tags MLflow's own API would give it, and the pairsim
source's commit."""

import getpass
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pairsim import tracking
from pairsim.config import load_config

SOURCE = Path(tracking.__file__).parent


def test_a_run_carries_user_source_commit_and_version(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [f"tracking.tracking_uri={uri}"])
    run_id = tracking.open_run(cfg, "tagged", cfg.to_yaml(), {}, tags={"mine": "1"})
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["mlflow.user"] == getpass.getuser() and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.name"] and tags["mine"] == "1" and tags[tracking.RUN_NAME_TAG] == "tagged"
    try:
        version = metadata.version("pairsim")
    except metadata.PackageNotFoundError:
        version = "source"
    assert tags["pairsim.version"] == version
    head = subprocess.run(["git", "-C", str(SOURCE), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        pytest.skip("pairsim does not run from a git checkout here")
    assert tags["mlflow.source.git.commit"] == head.stdout.strip()
