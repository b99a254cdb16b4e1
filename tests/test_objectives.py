"""End-to-end: every shipped objective preset trains under Ray Train + DeepSpeed, logs its terms
and temperatures and lowers its loss;
CUSA's teachers from disk (pipelines/extract_teacher.py) give the same loss as live teachers."""

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import NO_SKIPS
from pairsim.data import ingest
from pairsim import build
from pairsim.teachers import store
from pairsim.train import driver, worker
from pairsim.cli import DEMO_CONFIG, objective_config, shipped_objectives
from pairsim.config import load_config
from pairsim.build import build_objective
from pairsim.tracking import metric_key

pytestmark = pytest.mark.slow


def run_config(dataset, work, objective, *extra):
    return load_config([DEMO_CONFIG, objective_config(objective)], [
        f"data.path={dataset}", "train.micro_batch_size=16", "train.epochs=3", "train.log_every_n_steps=1",
        "optim.warmup_steps=4", "optim.lr=1e-3", "optim.min_lr_ratio=0.5", "eval.batch_size=64",
        f"tracking.tracking_uri=sqlite:///{work}/mlflow.db", f"ray.storage_path={work}/ray",
        "data.test_split=null", *extra])  # test evaluation is covered in test_train


# Each run: all 5 captions of every image, one epoch of 40 steps, batches holding pairs of one
# image. At lr 1e-9, cusa_unified's 10-step loss mean moved by 0.1 % over such a run; shorter
# 16-step runs moved ≤ 1.1 % for the non-CUSA presets (cusa_paper's drift at 40 steps was not
# measured). At lr 1e-3 the loss drops by 2.5 % (cusa_paper, whose soft-label terms outweigh its
# base 256:1) to 60 % (gcl_*): a 2 % drop is taken as learning, not noise.
STEPS = 256 * 5 // 32
DROP = 0.98
# In the CI suite: the presets with the most moving parts (CUSA's teachers and temperatures, GCL's
# fused embeddings through the Unified loss). The other six run with -m extended: their losses
# are limits of or parts of these (InfoNCE is cusa_paper's base, Triplet-HN and the Unified loss
# are gcl_unified's base at other m and γ, gcl_infonce is gcl_unified's structure, cusa_unified is
# cusa_paper's CUSA terms over gcl_unified's base; sigmoid is checked against open_clip's SigLipLoss
# and on 2 ranks in test_losses), and the demo config's Unified loss trains end to end in test_train.
IN_CI = {"cusa_paper", "gcl_unified"}


@pytest.mark.parametrize("objective", [o if o in IN_CI else pytest.param(o, marks=pytest.mark.extended)
                                       for o in shipped_objectives()])
def test_each_shipped_objective_trains_end_to_end_and_lowers_its_loss(objective, ray_instance, tiny_dataset, tmp_path):
    cfg = run_config(tiny_dataset, tmp_path, objective, "data.pairs_per_image=5", "train.epochs=1")
    result = driver.fit(cfg)
    client = MlflowClient(result.tracking_uri)
    logged = set(client.get_run(result.mlflow_run_id).data.metrics)
    history = {key: [m.value for m in sorted(client.get_metric_history(result.mlflow_run_id, key), key=lambda m: m.step)]
               for key in logged if key == "train/loss" or key.startswith(("loss/", "temperature/"))}
    losses = history["train/loss"]
    assert len(losses) == STEPS
    start, end = np.mean(losses[:10]), np.mean(losses[-10:])
    assert end < DROP * start, (objective, losses)
    cusa = cfg.loss.cusa
    terms = {"loss/csa", "loss/usa"} if cusa is not None else set()
    assert terms <= logged and all(len(history[t]) == STEPS for t in terms), (objective, sorted(logged))
    ranges = {"temperature/base": cfg.loss.base.temperature} if cfg.loss.base.name == "infonce" else {}
    if cusa is not None:
        ranges |= {f"temperature/{name}": getattr(cusa, f"{name}_temperature") for name in ("cross", "image", "text")}
    for key, temperature in ranges.items():  # learnable ones stay in their range, fixed ones stay put
        assert len(history[key]) == STEPS, (objective, key)
        assert all(temperature.min - 1e-6 <= t <= temperature.max + 1e-6 for t in history[key]), (key, history[key])
    assert {metric_key("val/rsum"), metric_key("val/grid_fused2image_R@1")} <= logged  # validated, fused cells too


def test_teacher_features_from_disk_equal_live_teachers(ray_instance, tiny_dataset, tmp_path):
    cfg = run_config(tiny_dataset, tmp_path, "cusa_unified", "data.augment=false")
    store_dir = store.extract(cfg, build.build_teachers(cfg), tmp_path / "teacher", ["train"], batch_size=40, progress=False)
    disk_cfg = cfg.model_copy(update={"loss": cfg.loss.model_copy(update={
        "cusa": cfg.loss.cusa.model_copy(update={"teacher_features": store_dir})})})
    build.check_teachers(disk_cfg)

    live = build.build_teachers(cfg)
    live_batch = ingest.train_dataset(cfg, NO_SKIPS, *build.teacher_sources(cfg)).take_batch(1000, batch_format="numpy")  # the whole split
    disk_batch = ingest.train_dataset(disk_cfg, NO_SKIPS, *build.teacher_sources(disk_cfg)).take_batch(1000, batch_format="numpy")  # the whole split
    # the live pipeline ships teacher inputs, the disk pipeline extracted embeddings; caption draws
    # differ between the two, so compare on the disk batch's own (image, caption) picks
    live_emb = worker.teacher_embeddings({k: torch.as_tensor(np.array(v)) for k, v in live_batch.items() if v.dtype != object}, live, "cpu")
    assert set(live_emb) == {"teacher_image", "teacher_text"} and "teacher_image" not in live_batch
    by_pick = {(g, k): i for i, (g, k) in enumerate(zip(live_batch["group_ids"], live_batch["caption_index"]))}
    common = [(i, by_pick[g, k]) for i, (g, k) in enumerate(zip(disk_batch["group_ids"], disk_batch["caption_index"]))
              if (g, k) in by_pick]
    assert len(common) >= 50
    disk_rows, live_rows = map(list, zip(*common))
    for key in ("teacher_image", "teacher_text"):
        np.testing.assert_allclose(disk_batch[key][disk_rows], live_emb[key][live_rows].numpy(), rtol=1e-5, atol=1e-6)

    # the same student features with either teacher source give the same CUSA loss
    objective = build_objective(cfg.loss)
    g = torch.Generator().manual_seed(0)
    student = {k: torch.randn(len(common), 128, generator=g)
               for k in ("image", "text", "image_unimodal", "text_unimodal")}
    groups = torch.as_tensor(disk_batch["group_ids"][disk_rows])
    from_disk = objective(**student, group_ids=groups, teacher_image=torch.as_tensor(disk_batch["teacher_image"][disk_rows]),
                          teacher_text=torch.as_tensor(disk_batch["teacher_text"][disk_rows]))
    from_live = objective(**student, group_ids=groups, teacher_image=live_emb["teacher_image"][live_rows],
                          teacher_text=live_emb["teacher_text"][live_rows])
    for key in ("loss", "loss/csa", "loss/usa"):
        assert from_disk[key].item() == pytest.approx(from_live[key].item(), rel=1e-5)
