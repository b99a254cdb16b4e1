"""What pairsim uses of MLflow beyond its public API: the HTTP retry settings of its REST client
(:func:`fail_fast_http`) and its dataset classes' private hooks (:func:`dataset_source_class`,
:func:`dataset_entity`, :func:`digest_given_dataset`).

Imports no ``mlflow`` at module level.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.data.dataset import Dataset
    from mlflow.data.dataset_source import DatasetSource
    from mlflow.entities import Dataset as DatasetEntity

TESTED = "mlflow>=3.13,<3.18"


def fail_fast_http() -> None:
    """MLflow's REST calls in this process make one attempt of at most 10 s instead of retrying
    for minutes (values the user set are kept)."""
    for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"), ("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")):
        os.environ.setdefault(name, value)


def dataset_source_class(source_type: str) -> type[DatasetSource]:
    """MLflow's registered dataset source class of ``source_type`` (``local``, ``s3``, …)."""
    from mlflow.data.dataset_source_registry import get_registered_sources

    return next(s for s in get_registered_sources() if s._get_source_type() == source_type)


def dataset_entity(dataset: Dataset) -> DatasetEntity:
    """The ``mlflow.entities.Dataset`` that ``MlflowClient.log_inputs`` takes for ``dataset``."""
    return dataset._to_mlflow_entity()


@functools.cache
def digest_given_dataset() -> type[Dataset]:
    """MLflow's ``Dataset`` base class for datasets whose digest is always given: the abstract
    hook it calls otherwise (``_compute_digest``) refuses."""
    from mlflow.data.dataset import Dataset

    class DigestGivenDataset(Dataset):
        def _compute_digest(self) -> str:
            raise NotImplementedError("a DigestGivenDataset is given its digest")

    return DigestGivenDataset
