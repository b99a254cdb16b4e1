"""A run's datasets as MLflow dataset inputs: each split of a shard dataset, its digest the
manifest's content hash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlflow.data.dataset_source import DatasetSource
from mlflow.entities import DatasetInput, InputTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT
from mlflow.utils.validation import MAX_DATASET_DIGEST_SIZE

from pairsim import compat, storage
from pairsim.data import shards
from pairsim.log import get_logger

logger = get_logger("tracking")


def dataset_source(root: str | Path) -> DatasetSource:
    """MLflow's dataset source of a dataset directory: ``local`` by absolute path, or the one of
    its URI's scheme (``s3``, ``gs``, …). MLflow generates these classes per scheme; its registry
    holds two alike for no scheme and ``file:``, so resolving by URI warns."""
    location = storage.Location.of(root)
    kind = "local" if location.is_local else location.uri.split("://", 1)[0]
    return compat.mlflow.dataset_source_class(kind)(location.uri)


class ShardSplit(compat.mlflow.digest_given_dataset()):
    """One split of a shard dataset as an MLflow dataset: its source is the dataset directory,
    its digest the split's manifest content hash (cut to MLflow's 36 characters; the profile
    holds it whole, with the split's counts)."""

    def __init__(self, root: Path, split: str, counts: shards.SplitInfo):
        self._profile = {"split": split, "content_hash": counts.content_hash, "images": counts.images,
                         "captions": counts.captions, "shards": counts.shards}
        super().__init__(dataset_source(root), name=f"{storage.Location.of(root).name}/{split}",
                         digest=counts.content_hash[:MAX_DATASET_DIGEST_SIZE])

    def to_dict(self) -> dict[str, str]:
        return super().to_dict() | {"profile": json.dumps(self.profile)}

    @property
    def profile(self) -> dict[str, Any]:
        return self._profile

    @property
    def schema(self) -> None:
        return None


def log_datasets(tracking_uri: str, run_id: str, data: shards.RunData, test: bool = True) -> None:
    """The train and val splits and, with ``test`` when the data has it, the test split as the
    run's MLflow dataset inputs, each with its context (``training``, ``validation``, ``testing``)."""
    config = data.config
    splits = {"training": config.train_split, "validation": config.val_split}
    if test and data.has(config.test_split):
        splits["testing"] = config.test_split
    MlflowClient(tracking_uri).log_inputs(run_id, [
        DatasetInput(compat.mlflow.dataset_entity(ShardSplit(config.split_path(split), split, data.split(split))),
                     [InputTag(MLFLOW_DATASET_CONTEXT, context)])
        for context, split in splits.items()])
