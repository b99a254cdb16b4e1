"""End-to-end: real Ray Train workers, DeepSpeed engines, Ray Data ingest and an MLflow store."""

import math
from pathlib import Path

import mlflow
import open_clip
import pytest
import ray
import ray.train
import torch
from mlflow.tracking import MlflowClient
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

from conftest import STEPS_PER_EPOCH, e2e_overrides as overrides, step_images
from pairsim.models import clip, retrieval
from pairsim.train import checkpoints, driver, engine
from pairsim.cli import DEMO_CONFIG, main, objective_config
from pairsim.config import ConfigError, RunConfig, load_config
from pairsim.build import build_objective
from pairsim.tracking import metric_key
from pairsim.tracking.models import PYTORCH_MODEL

pytestmark = pytest.mark.slow


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
    assert params["loss.base.name"] == "unified" and params["loss.base.margin"] == "0.1" and params["loss.base.gamma"] == "20.0"
    assert params["data.path"] == str(tiny_dataset)
    for key in ["train/loss", "train/lr", "train/samples_per_s", "val/i2t_R1", "val/i2t_R5", "val/i2t_R10",
                "val/t2i_R1", "val/t2i_R5", "val/t2i_R10", "val/rsum", "val/i2t_mAPR", "val/t2i_R-P",
                "val/t2i_median_rank", "val/i2i_R1", "val/t2t_mAPR", "val/grid_text2fused_R1",
                "val/grid_fused2image_R5", "data/skipped_images", "test/rsum", "test/i2i_R-P", "test/grid_text2text_R1",
                "val/sim/positive_mean", "val/sim/hardest_negative_mean", "val/sim/gap"]:
        assert key in run.data.metrics, key
    assert run.data.metrics["data/skipped_images"] == 0
    # where the start-up went, phase by phase, adding up to it
    phases = {k: v for k, v in run.data.metrics.items() if k.startswith("perf/startup/")}
    assert set(phases) == {f"perf/startup/{p}_s" for p in ("checks", "ray", "mlflow", "datasets", "worker_group", "engine",
                                                            "restore", "worker_mlflow", "first_batch", "first_step")}
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) == pytest.approx(run.data.metrics["perf/startup_s"], abs=1e-3)
    # eval metrics once per epoch, at the epoch's last step
    rsum = history(client, first.mlflow_run_id, "val/rsum")
    assert [s for s, _ in rsum] == [STEPS_PER_EPOCH * epoch for epoch in (1, 2, 3, 4)]
    # and the positive vs hardest-negative similarities with them, a histogram per epoch
    for key in ("val/sim/positive_mean", "val/sim/hardest_negative_mean", "val/sim/gap"):
        assert [s for s, _ in history(client, first.mlflow_run_id, key)] == [s for s, _ in rsum], key
    gaps = dict(history(client, first.mlflow_run_id, "val/sim/gap"))
    positives = dict(history(client, first.mlflow_run_id, "val/sim/positive_mean"))
    negatives = dict(history(client, first.mlflow_run_id, "val/sim/hardest_negative_mean"))
    assert all(-1 <= negatives[s] <= 1 and gaps[s] == pytest.approx(positives[s] - negatives[s]) for s in gaps)
    # the best checkpoint is the best val epoch's (by RSUM), test evaluated with it at the end of each attempt
    best_epoch = max(range(4), key=lambda e: (rsum[e][1], e)) + 1
    assert int(run.data.tags["pairsim.best_epoch"]) == best_epoch
    assert len(history(client, first.mlflow_run_id, "test/rsum")) == 2
    artifacts = {a.path for a in client.list_artifacts(first.mlflow_run_id)}
    assert {"config.yaml", "config-attempt2.yaml", "deepspeed_config.json", "model", "eval", "similarity"} <= artifacts
    assert {a.path for a in client.list_artifacts(first.mlflow_run_id, "similarity")} == {
        f"similarity/epoch_{epoch:03d}.png" for epoch in (1, 2, 3, 4)}
    assert {a.path for a in client.list_artifacts(first.mlflow_run_id, "eval")} == {
        "eval/test.json", "eval/test_modality_grid.png", "eval/test_gallery.png"}
    assert load_config(artifact_file(client, first.mlflow_run_id, "config.yaml")).train.epochs == 3
    # each epoch's gallery and modality grid as step images; the datasets read, once over both attempts
    assert step_images(client, first.mlflow_run_id) == {
        (key, STEPS_PER_EPOCH * epoch) for key in ("val/gallery", "val/modality_grid") for epoch in (1, 2, 3, 4)}
    assert sorted((i.tags[0].value, i.dataset.name) for i in run.inputs.dataset_inputs) == [
        ("testing", f"{tiny_dataset.name}/test"), ("training", f"{tiny_dataset.name}/train"),
        ("validation", f"{tiny_dataset.name}/val")]
    # rank 0's system metrics, the resumed attempt's steps going on from the first's
    steps = [m.step for m in client.get_metric_history(first.mlflow_run_id, "system/cpu_utilization_percentage")]
    assert len(steps) >= 2 and sorted(steps) == list(range(len(steps))), steps


def test_saved_weights_load_back_into_open_clip(zero2_runs):
    _, resumed, client = zero2_runs
    weights = artifact_file(client, resumed.mlflow_run_id, "model/model.pt")
    model, _, preprocess = open_clip.create_model_and_transforms("pairsim-tiny", pretrained=str(weights))
    # the exported weights are the best DeepSpeed checkpoint's (the engine wraps model.clip)
    module = torch.load(Path(resumed.best_checkpoint_path) / "deepspeed" / "mp_rank_00_model_states.pt",
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


@pytest.fixture(scope="module")
def zero3_run(ray_instance, tiny_dataset, tmp_path_factory, mlflow_server):
    """ZeRO-3 partitions the parameters (export must gather them), the loss's learnable
    temperatures and the CUSA heads included; bf16 casts the model; the run goes to a real
    tracking server, with artifacts uploaded over HTTP. Each step accumulates 2 micro-batches of
    8 (the gradient cache: the loss sees the same global batch of 32 as the other runs) with
    gradient checkpointing."""
    cfg = load_config([DEMO_CONFIG, objective_config("cusa_unified")], overrides(
        tiny_dataset, tmp_path_factory.mktemp("zero3"), "train.epochs=1", "train.zero_stage=3",
        "train.precision=bf16", "loss.base=infonce", "model.crossmodal_heads=true", "train.micro_batch_size=8",
        "train.accumulate_steps=2", "train.grad_checkpointing=true", "data.test_split=null",
        f"tracking.tracking_uri={mlflow_server}"))  # the test split's embedding is zero2_runs's to check
    return cfg, driver.fit(cfg)


def test_zero3_bf16_run_logs_to_an_mlflow_server_and_exports(zero3_run, mlflow_server, tmp_path):
    _, result = zero3_run
    assert result.tracking_uri == mlflow_server
    client = MlflowClient(mlflow_server)
    losses = [v for _, v in history(client, result.mlflow_run_id, "train/loss")]
    assert len(losses) == STEPS_PER_EPOCH // 2 and all(math.isfinite(v) for v in losses)
    for key, (low, high) in {"temperature/base": (0.01, 0.1), "temperature/cross": (0.1, 1.0),
                             "temperature/image": (0.1, 1.0), "temperature/text": (0.1, 1.0)}.items():
        values = [v for _, v in history(client, result.mlflow_run_id, key)]
        assert len(values) == len(losses) and all(low <= v <= high for v in values), (key, values)
    heads = torch.load(mlflow.artifacts.download_artifacts(
        run_id=result.mlflow_run_id, tracking_uri=mlflow_server, artifact_path="model/model.heads.pt",
        dst_path=str(tmp_path)))
    assert {k.split(".")[0] for k in heads} == {"cross_heads", "unimodal_heads"}
    assert all(v.numel() > 0 and torch.isfinite(v).all() for v in heads.values())  # gathered from ZeRO-3
    weights = mlflow.artifacts.download_artifacts(run_id=result.mlflow_run_id, tracking_uri=mlflow_server,
                                                  artifact_path="model/model.pt", dst_path=str(tmp_path))
    model, _, _ = open_clip.create_model_and_transforms("pairsim-tiny", pretrained=weights)
    # ZeRO-3 partitions the model states themselves, one file per rank
    assert sorted(p.name for p in (Path(result.checkpoint_path) / "deepspeed").glob("*model_states.pt")) == [
        f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in (0, 1)]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.state_dict()["token_embedding.weight"].abs().sum() > 0  # gathered, not empty shards
    # the registry round trip on the team layout (runs in PostgreSQL, artifacts in S3 behind the server)
    assert main(["export", "--run-id", result.mlflow_run_id, "--tracking-uri", mlflow_server,
                 "--out", str(tmp_path / "registered" / "model.pt"), "--register", "pairsim-zero3"]) == 0
    mlflow.set_tracking_uri(mlflow_server)
    registered = mlflow.pytorch.load_model(f"runs:/{result.mlflow_run_id}/{PYTORCH_MODEL}").eval()
    exported, _ = retrieval.load_exported(tmp_path / "registered" / "model.pt")  # towers and heads
    pixels, tokens = fixed_inputs(load_config(DEMO_CONFIG))
    with torch.no_grad():
        for inputs in ({"image": pixels}, {"text": tokens}):
            got, want = registered(**inputs), exported(**inputs)
            assert set(got) == set(want)
            for key in want:
                torch.testing.assert_close(got[key], want[key])


def engine_embeddings(config):
    """Ray Train worker: the checkpoint loaded back into a DeepSpeed engine the way a resumed run
    loads it (same world size and ZeRO stage), embedding fixed inputs; rank 0 returns them."""
    import deepspeed

    cfg = RunConfig.model_validate(config["cfg"])
    ctx = ray.train.get_context()
    card = checkpoints.checkpoint_card(config["checkpoint"])
    model = retrieval.create_retrieval_model(cfg.model, fused=card.fused, unimodal_heads=card.unimodal_heads)
    module = engine.TrainingModule(model, build_objective(cfg.loss, ctx.get_world_rank(), ctx.get_world_size()))
    ds_engine, *_ = deepspeed.initialize(model=module, model_parameters=engine.parameter_groups(module, 0.1),
                                         config=engine.deepspeed_config(cfg.train, cfg.optim, 10))
    ds_engine.load_checkpoint(config["checkpoint"], tag=checkpoints.CHECKPOINT_TAG)
    ds_engine.eval()
    dtype = engine.DTYPES[cfg.train.precision]
    with torch.no_grad():
        out = ds_engine(image=config["pixels"].to(dtype), text=config["tokens"])
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=cfg.train.zero_stage == 3):
        weights = {k: v.float().numpy().copy() for k, v in module.model.state_dict().items()}
    return {k: v.float().numpy() for k, v in out.items()}, weights


def fixed_inputs(cfg):
    g = torch.Generator().manual_seed(0)
    pixels = clip.PixelNormalizer(cfg.model)(torch.randint(0, 256, (6, 3, 64, 64), generator=g))
    tokens = clip.tokenizer(cfg.model.arch)(["a red circle", "two blue squares", "a green cross left of a star",
                                               "a tiny violet triangle", "three shapes", "an orange disc"])
    return pixels, tokens


def assert_export_gives_the_checkpoints_embeddings(cfg, checkpoint, tmp_path, atol, dtype=torch.float32):
    """The exported weights, cast to the engine's ``dtype``, are the engine's, and the exported
    model embeds as the engine does (up to ``atol``: the engine computes in ``dtype``)."""
    written = checkpoints.export_checkpoint(checkpoint, tmp_path / "model.pt")
    model, card = retrieval.load_exported(written[0])
    pixels, tokens = fixed_inputs(cfg)
    reference = TorchTrainer(
        engine_embeddings, train_loop_config={"cfg": cfg.model_dump(mode="json"), "checkpoint": str(checkpoint),
                                              "pixels": pixels, "tokens": tokens},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path / "ray"))).fit().return_value
    reference, engine_weights = reference
    weights = model.state_dict()
    assert weights.keys() == engine_weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value.to(dtype).float(), torch.from_numpy(engine_weights[key]), atol=0, rtol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")
    with torch.no_grad():
        exported = model(image=pixels, text=tokens)
    assert set(exported) == set(reference)
    for key, value in exported.items():
        torch.testing.assert_close(value.float(), torch.from_numpy(reference[key].copy()), atol=atol, rtol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")
    return written, card


def test_export_of_a_zero2_checkpoint_gives_the_engines_embeddings(zero2_runs, tiny_dataset, tmp_path):
    _, resumed, _ = zero2_runs
    cfg = load_config(DEMO_CONFIG, overrides(tiny_dataset, tmp_path))
    written, card = assert_export_gives_the_checkpoints_embeddings(cfg, resumed.best_checkpoint_path, tmp_path,
                                                                   atol=1e-5)
    assert [p.name for p in written] == ["model.pt", "model.json"]  # the demo model has no extra heads
    assert card.zero_stage == 2 and not card.fused


def test_export_of_a_zero3_bf16_checkpoint_gives_the_engines_embeddings(zero3_run, tmp_path):
    cfg, result = zero3_run
    # the engine computes in bf16 from bf16 copies of the fp32 weights that are exported
    written, card = assert_export_gives_the_checkpoints_embeddings(cfg, result.best_checkpoint_path, tmp_path,
                                                                   atol=0.03, dtype=torch.bfloat16)
    assert [p.name for p in written] == ["model.pt", "model.heads.pt", "model.json"]
    assert card.zero_stage == 3 and card.unimodal_heads and not card.fused  # CUSA, not GCL


def test_evaluate_cli_reproduces_the_run_and_logs_into_it(zero2_runs, tiny_dataset, capsys):
    """The standalone evaluation (Ray Data batch inference of the exported model) of the best
    checkpoint on val gives the val metrics the engine computed in training, and on test the
    run's own test metrics; both are logged into the run the checkpoint belongs to."""
    _, resumed, client = zero2_runs
    card = checkpoints.checkpoint_card(resumed.best_checkpoint_path)
    args = ["evaluate", "--checkpoint", resumed.best_checkpoint_path, "--data", str(tiny_dataset),
            "--tracking-uri", resumed.tracking_uri, "--set", "eval.batch_size=64"]
    assert main(args + ["--split", "val"]) == 0
    out, err = capsys.readouterr()
    assert "image→image" in out and "modality grid" in out
    assert "embedding val: 100%" in err and "288/288" in err  # the progress bar: 48 images + 240 captions
    for key, value in card.val.items():
        if key.startswith("val/") and not key.endswith("median_rank"):
            # the engine's value in training and the standalone one, logged at the same step
            in_training, standalone = [v for step, v in history(client, resumed.mlflow_run_id, metric_key(key))
                                  if step == card.step]
            # another summation order may flip a near-tie: at most one of the 48 images' ranks
            assert in_training == value and standalone == pytest.approx(value, abs=100 / 48 + 1e-9), key
    assert main(args + ["--split", "test"]) == 0
    test_rsum = [v for _, v in history(client, resumed.mlflow_run_id, "test/rsum")]
    # both attempts' end-of-run evaluations and this one; the last attempt's best checkpoint is this one
    assert len(test_rsum) == 3 and sum(v == pytest.approx(resumed.test_metrics["rsum"]) for v in test_rsum) >= 2


def test_export_cli_registers_a_model_that_loads_with_mlflow(zero2_runs, tmp_path):
    """``export --register``: the registered version is the pyfunc encoder (normalised
    embeddings of captions); the same run holds the ``mlflow.pytorch`` model too (raw outputs)."""
    import pandas as pd

    _, resumed, client = zero2_runs
    out = tmp_path / "exported" / "model.pt"
    assert main(["export", "--run-id", resumed.mlflow_run_id, "--tracking-uri", resumed.tracking_uri,
                 "--out", str(out), "--register", "pairsim-test"]) == 0
    model, _, _ = open_clip.create_model_and_transforms("pairsim-tiny", pretrained=str(out))
    assert client.get_model_version("pairsim-test", "1").run_id == resumed.mlflow_run_id
    mlflow.set_tracking_uri(resumed.tracking_uri)
    logged = mlflow.pytorch.load_model(f"runs:/{resumed.mlflow_run_id}/{PYTORCH_MODEL}")
    pixels, tokens = fixed_inputs(load_config(DEMO_CONFIG))
    with torch.no_grad():
        torch.testing.assert_close(logged(image=pixels)["image"], model.encode_image(pixels))  # un-normalised
        torch.testing.assert_close(logged(text=tokens)["text"], model.encode_text(tokens))
        expected = torch.nn.functional.normalize(model.encode_text(tokens[:2]), dim=-1).numpy()
    served = mlflow.pyfunc.load_model("models:/pairsim-test/1").predict(
        pd.DataFrame({"text": ["a red circle", "two blue squares"]}))
    assert served["modality"].tolist() == ["text", "text"]
    torch.testing.assert_close(torch.stack([torch.from_numpy(v) for v in served["embedding"]]), torch.from_numpy(expected),
                               atol=1e-5, rtol=0)


def test_one_caption_data_from_csv_and_webdataset_trains_and_names_the_metrics_it_cannot_give(
        ray_instance, tmp_path):
    """Most real datasets (open_clip CSVs, img2dataset tars) have one caption per image: train and
    a held-out val share from a CSV, test from a WebDataset tar, in one dataset directory; a run
    trains, evaluates every split and lists the text→text and grid metrics as skipped."""
    import io
    import tarfile

    import numpy as np
    from PIL import Image

    from pairsim.data.build_config import BuildConfig
    from pairsim.data import builder

    rng = np.random.default_rng(0)
    (tmp_path / "imgs").mkdir()
    captions = {}
    for i in range(72):
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        Image.new("RGB", (48, 40), colour).save(tmp_path / "imgs" / f"{i:03d}.png")
        captions[f"{i:03d}.png"] = f"a flat picture in colour {colour[0]} {colour[1]} {colour[2]}"
    names = sorted(captions)
    csv = tmp_path / "pairs.csv"
    csv.write_text("filepath\ttitle\n" + "".join(f"imgs/{n}\t{captions[n]}\n" for n in names[:60]))
    with tarfile.open(tmp_path / "test.tar", "w") as tar:
        for n in names[60:]:
            for suffix, raw in (("png", (tmp_path / "imgs" / n).read_bytes()), ("txt", captions[n].encode())):
                info = tarfile.TarInfo(f"{n[:3]}.{suffix}")
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
    data = tmp_path / "data"
    builder.build(BuildConfig(format="csv", input=csv, out=data, val_share=0.2), progress=False)
    built = builder.build(BuildConfig(format="webdataset", input=tmp_path / "test.tar", out=data, split="test"),
                         progress=False)
    assert {s: c.images == c.captions for s, c in built.splits.items()} == {
        "train": True, "val": True, "test": True}

    result = driver.fit(load_config(DEMO_CONFIG, overrides(data, tmp_path, "data.pairs_per_image=all",
                                                           "train.micro_batch_size=8", "train.epochs=1",
                                                           "ray.run_name=one-caption")))
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert set(run.data.tags["pairsim.skipped_metrics"].split(",")) >= {"t2t", "grid"}
    assert {"val/i2t_R1", "val/t2i_R1", "test/rsum"} <= run.data.metrics.keys()
    assert not any(k.startswith(("val/t2t", "val/grid", "test/t2t")) for k in run.data.metrics)


def test_a_run_from_init_from_starts_where_its_source_ended(zero2_runs, tiny_dataset, tmp_path):
    """``model.init_from`` = the zero2 run's export (its MLflow model/ artifacts): one epoch at a
    vanishing learning rate evaluates exactly as the source's best checkpoint did on the same
    val split; a randomly started run does not come near. A checkpoint directory and its export
    are the same starting weights."""
    _, resumed, client = zero2_runs
    weights = artifact_file(client, resumed.mlflow_run_id, "model/model.pt")
    card = checkpoints.checkpoint_card(resumed.best_checkpoint_path)
    result = driver.fit(load_config(DEMO_CONFIG, overrides(
        tiny_dataset, tmp_path, f"model.init_from={weights}", "train.epochs=1", "optim.lr=1e-12",
        "optim.weight_decay=0.0", "data.test_split=null")))
    for key in ("val/rsum", "val/i2t_R@1", "val/t2i_R@1", "val/i2i_mAP@R"):
        assert result.metrics[key] == pytest.approx(card.val[key], abs=1e-6), key
    assert card.val["val/rsum"] > 150  # chance is ~40 on this val split: the source did learn

    _, from_checkpoint = checkpoints.initial_state(resumed.best_checkpoint_path)
    _, from_export = checkpoints.initial_state(weights)
    assert from_checkpoint.keys() == from_export.keys()
    for key, value in from_export.items():
        torch.testing.assert_close(from_checkpoint[key], value, rtol=0, atol=0, msg=key)
