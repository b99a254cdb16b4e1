"""``data.val_path``: train on one dataset directory, evaluate on another's val and test splits."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pairsim import tracking
from pairsim.config import ConfigError, load_config
from pairsim.data import ingest, shards, synth
from pairsim.train import driver


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    """``mine``: train only (its val split is empty); ``other``: 20 val and 12 test images."""
    root = tmp_path_factory.mktemp("two")
    synth.generate(root / "mine", num_train=64, num_val=0, num_test=0, rows_per_shard=32, progress=False)
    synth.generate(root / "other", num_train=4, num_val=20, num_test=12, seed=1, progress=False)
    return root / "mine", root / "other"


def config(mine, *extra):
    return load_config(None, [f"data.path={mine}", "train.micro_batch_size=8", *extra])


def test_val_and_test_splits_come_from_val_path(two_datasets):
    mine, other = two_datasets
    with pytest.raises(ConfigError, match=r"data.path: .*val"):  # mine has no usable val split
        driver.plan_run(config(mine))
    cfg = config(mine, f"data.val_path={other}")
    prepared = driver.plan_run(cfg)
    assert Path(cfg.data.split_path("train")).resolve() == mine.resolve()
    assert {cfg.data.split_path(s) for s in ("val", "test")} == {cfg.data.val_path}
    from pairsim.eval import suite
    assert prepared.facts["val"] == suite.DataFacts.from_columns(*shards.label_and_caption_counts(other, "val"))
    assert set(prepared.facts) == {"val", "test"}
    assert prepared.steps_per_epoch == 64 // (8 * 2)  # train from mine
    assert prepared.data.split("val").images == 20 and prepared.data.split("train").images == 64
    with pytest.raises(ConfigError) as exc:
        driver.plan_run(config(mine, f"data.val_path={mine}"))
    assert str(exc.value).startswith("data.val_path:") and str(mine) in str(exc.value) and "'val'" in str(exc.value)


def test_a_val_split_too_small_to_rank_is_refused_before_ray_naming_it(two_datasets, tmp_path):
    mine, _ = two_datasets
    synth.generate(tmp_path / "one", num_train=4, num_val=1, num_test=0, progress=False)
    with pytest.raises(ConfigError) as exc:
        driver.plan_run(config(mine, f"data.val_path={tmp_path / 'one'}"))
    message = str(exc.value)  # the key, the split, its size and the bound
    assert message.startswith("data.val_path:") and str(tmp_path / "one") in message
    assert "1 images" in message and f"at least {driver.MIN_SPLIT_IMAGES}" in message


def test_val_path_feeds_ingest_and_the_runs_datasets(two_datasets, ray_instance, tmp_path):
    mine, other = two_datasets
    cfg = config(mine, f"data.val_path={other}")
    assert ingest.read_split(cfg, "val", ["image_id"]).count() == 20
    assert ingest.read_split(cfg, "train", ["image_id"]).count() == 64
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = tracking.create_run(uri, "val-path", "datasets", {})
    tracking.log_datasets(uri, run_id, shards.RunData.read(cfg.data))
    inputs = MlflowClient(uri).get_run(run_id).inputs.dataset_inputs
    sources = {d.tags[0].value: json.loads(d.dataset.source)["uri"] for d in inputs}
    assert sources == {"training": str(mine.resolve()), "validation": str(other.resolve()),
                       "testing": str(other.resolve())}
