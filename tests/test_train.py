"""End-to-end: real Ray Train workers, DeepSpeed engines, Ray Data ingest and an MLflow store."""

import math
from pathlib import Path

import mlflow
import open_clip
import pytest
import torch
from mlflow.tracking import MlflowClient

from pairsim import train
from pairsim.cli import DEMO_CONFIG, objective_config
from pairsim.config import load_config

pytestmark = pytest.mark.slow
STEPS_PER_EPOCH = 256 * 2 // (16 * 2)  # 2 captions per image per epoch


def overrides(dataset, work, *extra):
    return [f"data.path={dataset}", "data.pairs_per_image=2", "train.micro_batch_size=16", "train.log_every_n_steps=2",
            "optim.warmup_steps=4", "optim.lr=1e-3", "optim.min_lr_ratio=0.5", "eval.batch_size=64",
            f"tracking.tracking_uri=sqlite:///{work}/mlflow.db", f"ray.storage_path={work}/ray", *extra]


@pytest.fixture(scope="module")
def zero2_runs(ray_instance, tiny_dataset, tmp_path_factory):
    """3 epochs of the demo config (2 workers, ZeRO-2), then the same run resumed for a 4th."""
    work = tmp_path_factory.mktemp("zero2")
    first = train.fit(load_config(DEMO_CONFIG, overrides(tiny_dataset, work, "ray.run_name=e2e", "train.epochs=3")))
    resumed = train.fit(load_config(DEMO_CONFIG, overrides(tiny_dataset, work, "ray.run_name=e2e", "train.epochs=4")))
    return first, resumed, MlflowClient(first.tracking_uri)


def history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def artifact_file(client, run_id, path) -> Path:
    return Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://")) / path


def test_loss_goes_down_below_what_constant_embeddings_score(zero2_runs):
    """Over both attempts (a resume that lost the weights would send the loss back up). A model
    whose embeddings are all alike scores (2/γ)·log(1 + (B−1)·e^{γm}): learning means going below."""
    first, _, client = zero2_runs
    losses = [v for _, v in history(client, first.mlflow_run_id, "train/loss")]
    assert len(losses) == 2 * STEPS_PER_EPOCH
    gamma, margin, batch = 20.0, 0.1, 32  # the demo config's loss, 2 workers × 16
    collapsed = 2 / gamma * math.log1p((batch - 1) * math.exp(gamma * margin))
    start, end = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert end < collapsed - 0.02 and end < start - 0.03, (collapsed, losses)


def test_mlflow_run_holds_params_metrics_and_artifacts(zero2_runs, tiny_dataset):
    first, resumed, client = zero2_runs
    run = client.get_run(first.mlflow_run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["train.zero_stage"] == "2" and params["train.num_workers"] == "2"
    assert params["loss.base"] == "unified" and params["loss.margin"] == "0.1" and params["loss.gamma"] == "20.0"
    assert params["data.path"] == str(tiny_dataset)
    for key in ["train/loss", "train/lr", "train/samples_per_s", "val/i2t_R1", "val/i2t_R5", "val/i2t_R10",
                "val/t2i_R1", "val/t2i_R5", "val/t2i_R10", "val/rsum", "data/skipped_images"]:
        assert key in run.data.metrics, key
    assert run.data.metrics["data/skipped_images"] == 0
    # eval metrics once per epoch, at the epoch's last step
    assert [s for s, _ in history(client, first.mlflow_run_id, "val/rsum")] == [
        STEPS_PER_EPOCH * epoch for epoch in (1, 2, 3, 4)]
    artifacts = {a.path for a in client.list_artifacts(first.mlflow_run_id)}
    assert {"config.yaml", "config-attempt2.yaml", "deepspeed_config.json", "model"} <= artifacts
    assert load_config(artifact_file(client, first.mlflow_run_id, "config.yaml")).train.epochs == 3


def test_saved_weights_load_back_into_open_clip(zero2_runs):
    _, resumed, client = zero2_runs
    weights = artifact_file(client, resumed.mlflow_run_id, "model/open_clip_weights.pt")
    model, _, preprocess = open_clip.create_model_and_transforms("pairsim-tiny", pretrained=str(weights))
    # the exported weights are the final DeepSpeed checkpoint's (the engine wraps model.clip)
    module = torch.load(Path(resumed.checkpoint_path) / "deepspeed" / "mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)["module"]
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, module["model.clip." + name].reshape(tensor.shape), msg=name)


def test_resumed_run_continues_at_the_next_step_with_its_optimizer_state(zero2_runs):
    first, resumed, client = zero2_runs
    assert resumed.mlflow_run_id == first.mlflow_run_id  # one MLflow run across restarts
    tags = client.get_run(first.mlflow_run_id).data.tags
    assert tags["pairsim.attempts"] == "2" and tags["pairsim.changed_on_attempt2"] == "train.epochs"
    assert first.metrics["step"] == 3 * STEPS_PER_EPOCH and resumed.metrics["step"] == 4 * STEPS_PER_EPOCH
    steps = [s for s, _ in history(client, first.mlflow_run_id, "train/loss")]
    assert steps == list(range(2, 4 * STEPS_PER_EPOCH + 1, 2))  # no step repeated or skipped
    ckpt = Path(resumed.checkpoint_path) / "deepspeed"
    states = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert states["global_steps"] == 4 * STEPS_PER_EPOCH
    assert states["lr_scheduler"]["last_batch_iteration"] == 4 * STEPS_PER_EPOCH - 1
    for rank in range(2):
        optim = torch.load(ckpt / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", map_location="cpu",
                           weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"]
        # a fresh optimizer would have counted only the 4 steps since the restart
        assert {int(s["step"]) for s in optim.values()} == {4 * STEPS_PER_EPOCH}


def test_zero3_bf16_run_logs_to_an_mlflow_server_and_exports(ray_instance, tiny_dataset, tmp_path, mlflow_server):
    """ZeRO-3 partitions the parameters (export must gather them), the loss's learnable
    temperatures and the CUSA heads included; bf16 casts the model; the run goes to a real
    tracking server, with artifacts uploaded over HTTP."""
    result = train.fit(load_config([DEMO_CONFIG, objective_config("cusa_unified")], overrides(
        tiny_dataset, tmp_path, "train.epochs=1", "train.zero_stage=3", "train.precision=bf16",
        "loss.base=infonce", "model.crossmodal_heads=true",
        f"tracking.tracking_uri={mlflow_server}")))
    assert result.tracking_uri == mlflow_server
    client = MlflowClient(mlflow_server)
    losses = [v for _, v in history(client, result.mlflow_run_id, "train/loss")]
    assert len(losses) == STEPS_PER_EPOCH // 2 and all(math.isfinite(v) for v in losses)
    for key, (low, high) in {"temperature/base": (0.01, 0.1), "temperature/cross": (0.1, 1.0),
                             "temperature/image": (0.1, 1.0), "temperature/text": (0.1, 1.0)}.items():
        values = [v for _, v in history(client, result.mlflow_run_id, key)]
        assert len(values) == len(losses) and all(low <= v <= high for v in values), (key, values)
    heads = torch.load(mlflow.artifacts.download_artifacts(
        run_id=result.mlflow_run_id, tracking_uri=mlflow_server, artifact_path="model/pairsim_heads.pt",
        dst_path=str(tmp_path)))
    assert {k.split(".")[1] for k in heads} == {"cross_heads", "unimodal_heads"}
    assert all(v.numel() > 0 and torch.isfinite(v).all() for v in heads.values())  # gathered from ZeRO-3
    weights = mlflow.artifacts.download_artifacts(run_id=result.mlflow_run_id, tracking_uri=mlflow_server,
                                                  artifact_path="model/open_clip_weights.pt", dst_path=str(tmp_path))
    model, _, _ = open_clip.create_model_and_transforms("pairsim-tiny", pretrained=weights)
    # ZeRO-3 partitions the model states themselves, one file per rank
    assert sorted(p.name for p in (Path(result.checkpoint_path) / "deepspeed").glob("*model_states.pt")) == [
        f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in (0, 1)]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.state_dict()["token_embedding.weight"].abs().sum() > 0  # gathered, not empty shards
