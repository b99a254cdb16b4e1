"""Checkpoints out of training, models out of pairsim.

A pairsim checkpoint is a Ray Train checkpoint directory holding a DeepSpeed checkpoint (tag
``deepspeed``, files from every rank) and the model card (``pairsim_model.json``, written by
rank 0) that rebuilds the model. :func:`export_checkpoint` consolidates it — ZeRO-1/2/3
partitions merged into fp32 weights with DeepSpeed's ``zero_to_fp32`` — and writes
``model.pt`` (open_clip weights: ``open_clip.create_model_and_transforms(arch,
pretrained="model.pt")``), ``model.heads.pt`` (pairsim's extra heads) and ``model.json``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from pairsim import models

CHECKPOINT_TAG = "deepspeed"
CARD_FILE = "pairsim_model.json"
MODEL_ARTIFACTS = "model"  # where a run's exported model lives among its MLflow artifacts
MODEL_PREFIX = "model."  # the RetrievalModel inside the engine's TrainingModule


def checkpoint_card(checkpoint: str | Path) -> dict:
    card_file = Path(checkpoint) / CARD_FILE
    if not card_file.is_file():
        raise FileNotFoundError(f"{checkpoint}: not a pairsim checkpoint (no {CARD_FILE})")
    return json.loads(card_file.read_text())


def checkpoint_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The fp32 weights of a checkpoint's RetrievalModel (the objective's temperatures left out).

    With ZeRO (stage ≥ 1) they come from the optimizer's fp32 partitions of every rank, merged
    by DeepSpeed's ``zero_to_fp32`` (the only complete copy under ZeRO-3, and the unrounded
    one under bf16); without, from the engine's module states.
    """
    ds_dir = Path(checkpoint) / CHECKPOINT_TAG
    if not ds_dir.is_dir():
        raise FileNotFoundError(f"{checkpoint}: no DeepSpeed checkpoint ({CHECKPOINT_TAG}/)")
    if checkpoint_card(checkpoint)["zero_stage"] >= 1:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=CHECKPOINT_TAG)
    else:
        state = torch.load(ds_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    return {k[len(MODEL_PREFIX):]: v.float() for k, v in state.items() if k.startswith(MODEL_PREFIX)}


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> list[Path]:
    """Consolidate ``checkpoint`` and write ``out`` (open_clip weights) with its side files."""
    card = checkpoint_card(checkpoint)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return models.write_exported(card, checkpoint_state_dict(checkpoint), out)


def download_run_model(run_id: str, tracking_uri: str, out: str | Path) -> list[Path]:
    """A training run's exported model (its best checkpoint's, logged under ``model/``) → ``out``."""
    import mlflow.artifacts

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=MODEL_ARTIFACTS,
                                                             tracking_uri=tracking_uri, dst_path=tmp))
        except Exception as exc:  # MLflow raises several types for a missing run or artifact
            raise FileNotFoundError(f"run {run_id} in {tracking_uri}: no exported model under "
                                    f"{MODEL_ARTIFACTS}/ ({exc})") from None
        written = []
        for source, target in zip(models.exported_files(local / "model.pt"), models.exported_files(out)):
            if source.is_file():
                shutil.copyfile(source, target)
                written.append(target)
    if not written:
        raise FileNotFoundError(f"run {run_id}: {MODEL_ARTIFACTS}/ holds no model.pt")
    return written


def register_model(weights: str | Path, name: str, tracking_uri: str, run_id: str | None = None):
    """Log the exported model with ``mlflow.pytorch.log_model`` into ``run_id`` (or a new run)
    and register it as ``name`` in MLflow's model registry; returns the model version."""
    import mlflow

    import open_clip

    model, _ = models.load_exported(weights)
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        # pickled (a traced pt2 graph would fix the input shapes); pairsim's package travels
        # in the model (code_paths) so mlflow.pytorch.load_model works where it is not installed
        info = mlflow.pytorch.log_model(
            model, name="registered_model", registered_model_name=name, serialization_format="pickle",
            code_paths=[str(Path(models.__file__).parent)],
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"open_clip_torch=={open_clip.__version__}"],
            extra_files=[str(p) for p in models.exported_files(weights) if p.is_file()])
    return info.registered_model_version
