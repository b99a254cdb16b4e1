"""Exported models in and out of MLflow: a run's ``model/`` artifacts downloaded, an export logged
as the pyfunc encoder that serves embeddings, and registered in the model registry."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pairsim import storage
from pairsim.errors import described
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
                                    f"{MODEL_ARTIFACTS}/ ({described(exc)})") from None
        if not (local / "model.pt").is_file():
            raise FileNotFoundError(f"run {run_id}: {MODEL_ARTIFACTS}/ holds no model.pt")
        return retrieval.copy_exported(local / "model.pt", out)


ENCODER_MODEL = "encoder"  # the pyfunc encoder's name among a run's logged models
PYTORCH_MODEL = "pytorch_model"  # the mlflow.pytorch model's


def model_code_and_requirements() -> dict[str, list[str]]:
    """``log_model`` arguments of both flavours: pairsim's package travels in the model
    (``code_paths``), so it loads where pairsim is not installed, and torch and open_clip are
    pinned to the versions here."""
    import open_clip
    import torch

    return {"code_paths": [str(Path(retrieval.__file__).parents[1])],
            "pip_requirements": [f"torch=={torch.__version__.split('+')[0]}", f"open_clip_torch=={open_clip.__version__}"]}


def log_encoder_model(weights: str | Path, run_id: str, tracking_uri: str, registered_model_name: str | None = None):
    """Log the export ``weights`` into ``run_id`` as the pyfunc encoder that serves embeddings
    (:mod:`pairsim.serving.pyfunc`: loaded from code, the export's files its artifacts, with
    signature and input example, tagged with the model's digest), registered as
    ``registered_model_name`` when given; returns MLflow's ``ModelInfo``."""
    import mlflow

    from pairsim.serving import pyfunc

    digest = retrieval.model_digest(weights)
    mlflow.set_tracking_uri(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp, mlflow.start_run(run_id=run_id):
        export = Path(tmp) / pyfunc.EXPORT_ARTIFACT
        retrieval.copy_exported(weights, export / "model.pt")  # under the names the model loads
        return mlflow.pyfunc.log_model(
            name=ENCODER_MODEL, python_model=str(pyfunc.MODEL_CODE), artifacts={pyfunc.EXPORT_ARTIFACT: str(export)},
            signature=pyfunc.SIGNATURE, input_example=pyfunc.input_example(), registered_model_name=registered_model_name,
            metadata={"pairsim.model_digest": digest}, **model_code_and_requirements())


def register_model(weights: str | Path, name: str, tracking_uri: str, run_id: str | None = None,
                   experiment: str = "pairsim"):
    """Log the exported model into ``run_id`` (or a new run of ``experiment``, whose artifacts
    go where pairsim's experiments keep them, not to MLflow's default experiment and its
    ``./mlruns`` in the working directory) twice — as the pyfunc encoder (:func:`log_encoder_model`),
    registered as ``name`` in MLflow's model registry, and with ``mlflow.pytorch.log_model`` as
    :data:`PYTORCH_MODEL` (unregistered; ``mlflow.pytorch.load_model`` gives the
    :class:`~pairsim.models.retrieval.RetrievalModel` back) — and returns the registered version."""
    import mlflow

    model, _ = retrieval.load_exported(weights)
    run_id = run_id or create_run(tracking_uri, experiment, f"register-{name}", context_tags())
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        # pickled (a traced pt2 graph would fix the input shapes)
        mlflow.pytorch.log_model(model, name=PYTORCH_MODEL, serialization_format="pickle",
                                 extra_files=[str(p) for p in retrieval.exported_files(weights) if p.is_file()],
                                 **model_code_and_requirements())
    return log_encoder_model(weights, run_id, tracking_uri, registered_model_name=name).registered_model_version
