"""The MLflow run a job opens carries the tags MLflow's own API would give it, and the pairsim
source's commit; the datasets it reads."""

import getpass
import json
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pairsim import tracking
from pairsim.config import load_config
from pairsim.data import shards

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


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One sqlite store for the module's tests (creating one takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


def new_run(uri: str) -> tuple[MlflowClient, str]:
    client = MlflowClient(uri)
    return client, client.create_run("0").info.run_id


def test_datasets_are_logged_with_the_manifests_content_hashes(store, tiny_dataset):
    client, run_id = new_run(store)
    tracking.log_datasets(store, run_id, load_config(None, [f"data.path={tiny_dataset}"]).data)
    splits = shards.read_manifest(tiny_dataset)["splits"]
    logged = {i.tags[0].value: i.dataset for i in client.get_run(run_id).inputs.dataset_inputs}
    assert set(logged) == {"training", "validation", "testing"}
    for context, split in (("training", "train"), ("validation", "val"), ("testing", "test")):
        dataset = logged[context]
        assert dataset.name == f"{tiny_dataset.name}/{split}"
        assert splits[split]["content_hash"].startswith(dataset.digest) and len(dataset.digest) == 36
        assert json.loads(dataset.source) == {"uri": str(tiny_dataset.resolve())}
        assert json.loads(dataset.profile) == {"split": split, "content_hash": splits[split]["content_hash"]} | {
            k: splits[split][k] for k in ("images", "captions", "shards")}


@pytest.mark.parametrize("test_split, test", [("held", True), ("test", False)])
def test_a_test_split_that_is_missing_or_unused_is_not_logged(store, tiny_dataset, test_split, test):
    client, run_id = new_run(store)
    data = load_config(None, [f"data.path={tiny_dataset}", f"data.test_split={test_split}"]).data
    tracking.log_datasets(store, run_id, data, test=test)
    assert {i.tags[0].value for i in client.get_run(run_id).inputs.dataset_inputs} == {"training", "validation"}
