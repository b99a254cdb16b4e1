"""MLflow tracking: one MLflow run per training job, also across restarts, and exported models
in and out of runs and the model registry.

The driver opens the run (or finds the one tagged with the same Ray Train run name, when a
job is resumed) and logs the config and the datasets it reads; rank 0 of the workers logs
curves (asynchronously), eval metrics, per-epoch pictures, artifacts and the system metrics
of its node into it by run id. A local ``sqlite:`` store keeps its artifacts in ``mlartifacts/``
beside the database, as absolute paths, so workers in any directory write to the same place.

The parts: :mod:`~pairsim.tracking.runs` (stores, runs and how they end),
:mod:`~pairsim.tracking.run_logger` (rank 0's :class:`RunLogger`),
:mod:`~pairsim.tracking.datasets` (dataset inputs), :mod:`~pairsim.tracking.models` (exported
models and the registry); their public names are importable from here.
"""

from pairsim.tracking.datasets import ShardSplit, dataset_source, log_datasets
from pairsim.tracking.models import MODEL_ARTIFACTS, download_run_model, register_model
from pairsim.tracking.run_logger import (TRANSIENT_ERROR_CODES, RunLogger, is_transient, last_logged_steps, metric_key,
                                         system_metrics_monitor)
from pairsim.tracking.runs import (DEFAULT_TRACKING_URI, ERROR_TAG, EXPERIMENT_KIND, LOCAL_UI, PARENT_TAG,
                                   REACHABLE_TIMEOUT_S, RUN_NAME_TAG, STOPPED_TAG, SWEEP_TAG, Outcome, check_reachable,
                                   child_runs, context_tags, create_run, ending_run, error_text, find_run, open_run,
                                   open_sweep_run, previous_attempt, resolve_tracking_uri, run_tags, set_run_status,
                                   tag_run, ui_url)

__all__ = ["DEFAULT_TRACKING_URI", "ERROR_TAG", "EXPERIMENT_KIND", "LOCAL_UI", "MODEL_ARTIFACTS", "PARENT_TAG",
           "REACHABLE_TIMEOUT_S", "RUN_NAME_TAG", "STOPPED_TAG", "SWEEP_TAG", "TRANSIENT_ERROR_CODES", "Outcome",
           "RunLogger", "ShardSplit", "check_reachable", "child_runs", "context_tags", "create_run", "dataset_source",
           "download_run_model", "ending_run", "error_text", "find_run", "is_transient", "last_logged_steps",
           "log_datasets", "metric_key", "open_run", "open_sweep_run", "previous_attempt", "register_model", "resolve_tracking_uri",
           "run_tags", "set_run_status", "tag_run", "system_metrics_monitor", "ui_url"]
