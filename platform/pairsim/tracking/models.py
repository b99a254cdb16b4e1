"""Exported models in and out of MLflow: a run's ``model/`` artifacts downloaded, and an export
registered in the model registry."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pairsim import storage
from pairsim.log import get_logger
from pairsim.models import retrieval
from pairsim.tracking.runs import context_tags, create_run

logger = get_logger("tracking")


MODEL_ARTIFACTS = "model"  # where a run's exported model lives among its MLflow artifacts


def download_run_model(run_id: str, tracking_uri: str, out: str | Path) -> list[Path]:
    """A training run's exported model (its best checkpoint's, logged under ``model/``) → ``out``,
    whose places are checked first (:func:`~pairsim.models.retrieval.claim_export`). A sqlite
    store that does not exist is refused, naming it, before MLflow would create an empty one
    there."""
    import mlflow.artifacts

    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix) and not Path(tracking_uri[len(prefix):].split("?", 1)[0]).is_file():
        raise FileNotFoundError(f"run {run_id}: no MLflow store at {tracking_uri} (no such file; "
                                f"--tracking-uri or MLFLOW_TRACKING_URI names the store the run is in)")
    retrieval.claim_export(out)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=MODEL_ARTIFACTS,
                                                             tracking_uri=tracking_uri, dst_path=tmp))
        except Exception as exc:  # MLflow raises several types for a missing run or artifact
            raise FileNotFoundError(f"run {run_id} in {storage.masked(tracking_uri)}: no exported model under "
                                    f"{MODEL_ARTIFACTS}/ ({exc})") from None
        if not (local / "model.pt").is_file():
            raise FileNotFoundError(f"run {run_id}: {MODEL_ARTIFACTS}/ holds no model.pt")
        return retrieval.copy_exported(local / "model.pt", out)


def register_model(weights: str | Path, name: str, tracking_uri: str, run_id: str | None = None,
                   experiment: str = "pairsim"):
    """Log the exported model with ``mlflow.pytorch.log_model`` into ``run_id`` (or a new run of
    ``experiment``, whose artifacts go where pairsim's experiments keep them, not to MLflow's
    default experiment and its ``./mlruns`` in the working directory) and register it as
    ``name`` in MLflow's model registry; returns the model version."""
    import mlflow
    import open_clip
    import torch

    model, _ = retrieval.load_exported(weights)
    run_id = run_id or create_run(tracking_uri, experiment, f"register-{name}", context_tags())
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        # pickled (a traced pt2 graph would fix the input shapes); pairsim's package travels
        # in the model (code_paths) so mlflow.pytorch.load_model works where it is not installed
        info = mlflow.pytorch.log_model(
            model, name="registered_model", registered_model_name=name, serialization_format="pickle",
            code_paths=[str(Path(retrieval.__file__).parents[1])],
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"open_clip_torch=={open_clip.__version__}"],
            extra_files=[str(p) for p in retrieval.exported_files(weights) if p.is_file()])
    return info.registered_model_version
