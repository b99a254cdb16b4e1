import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from conftest import NO_SKIPS, on_gloo_ranks, remanifest
from pairsim.config import RunConfig
from pairsim.data import ingest, shards, skips


def _equal_steps_worker(rank, world):
    mine = [torch.full((2,), i) for i in range(3 if rank == 0 else 5)]  # deliberately uneven
    seen = []
    for batch in ingest.equal_steps(mine):
        dist.all_reduce(batch.clone())  # a collective per step, as training does: would hang if counts differed
        seen.append(int(batch[0]))
    return seen


def test_equal_steps_stops_every_rank_with_the_shortest():
    assert on_gloo_ranks(_equal_steps_worker, timeout=180) == {0: [0, 1, 2], 1: [0, 1, 2]}


def audit_batches(rank: int) -> list[dict]:
    """Two micro-batches of 4 pairs a rank over images 0–9 (2 pairs each): rank 1's second
    batch trains image 1's first pair again, as a block delivered twice would."""
    keys = {0: [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (3, 0), (3, 1), (4, 0)],
            1: [(5, 0), (5, 1), (6, 0), (6, 1), (7, 0), (1, 0), (8, 1), (8, 0)]}[rank]
    return [{"group_ids": torch.tensor([g for g, _ in part]), "pair_slot": torch.tensor([k for _, k in part])}
            for part in (keys[:4], keys[4:])]


def _audit_worker(rank, world):
    audit = ingest.EpochAudit(train_images=10)
    for batch in audit_batches(rank):
        audit.record(batch)
    return audit.metrics()


def test_the_epoch_audit_counts_pairs_over_ranks_as_one_process_counts_them():
    one = ingest.EpochAudit(train_images=10)
    for batch in audit_batches(0) + audit_batches(1):
        one.record(batch)
    expected = one.metrics()
    keys = [(int(g), int(k)) for b in audit_batches(0) + audit_batches(1) for g, k in zip(*b.values())]
    assert expected == {"data/epoch_pairs": len(keys), "data/epoch_pairs_repeated": len(keys) - len(set(keys)),
                        "data/epoch_images_unseen": 10 - len({g for g, _ in keys})} == {
        "data/epoch_pairs": 16, "data/epoch_pairs_repeated": 1, "data/epoch_images_unseen": 1}
    assert on_gloo_ranks(_audit_worker, timeout=180) == {0: expected, 1: expected}
    assert one.metrics()["data/epoch_pairs"] == 0  # the next epoch counts afresh


@pytest.fixture(scope="module")
def dataset_with_bad_images(tiny_dataset, tmp_path_factory):
    """The tiny dataset (256 images) with 18 undecodable images added to its last shard —
    garbage, a truncated PNG, empty bytes: more than a whole 16-row batch."""
    root = tmp_path_factory.mktemp("bad") / "shapes"
    shutil.copytree(tiny_dataset, root)
    last = sorted((root / "train").glob("*.parquet"))[-1]
    rows = pq.read_table(last).to_pylist()
    bad = [dict(rows[0], image_id=f"bad-{i:02d}", image=b"not an image") for i in range(18)]
    bad[1]["image"] = rows[30]["image"][:40]  # truncated PNG
    bad[2]["image"] = b""
    pq.write_table(pa.Table.from_pylist(bad[:9] + rows + bad[9:], schema=shards.SHARD_SCHEMA), last)
    remanifest(root)  # the bad images were there when it was built: they are undecodable, not altered
    return root, {row["image_id"] for row in bad}


def _record_epochs(config):
    import ray.train

    cfg = RunConfig.model_validate(config["cfg"])
    shard = ray.train.get_dataset_shard("train")
    rank = ray.train.get_context().get_world_rank()
    epochs = []
    for epoch in range(2):
        batches = shard.iter_torch_batches(batch_size=cfg.train.micro_batch_size, drop_last=True,
                                           local_shuffle_buffer_size=cfg.data.shuffle_buffer,
                                           local_shuffle_seed=ingest.local_shuffle_seed(cfg.data.seed, epoch, rank))
        seen = []
        for batch in ingest.equal_steps(batches):
            assert batch["pixels"].shape == (cfg.train.micro_batch_size, 3, 64, 64)
            assert batch["pixels"].dtype == torch.uint8  # normalised on the worker's device
            assert batch["tokens"].shape == (cfg.train.micro_batch_size, 32)
            seen.append(batch["group_ids"].tolist())
        epochs.append(seen)
    with open(f"{config['out']}/rank{rank}.json", "w") as f:
        json.dump(epochs, f)


@pytest.mark.slow
def test_a_process_has_one_ledger_whose_scopes_tasks_fill_apart(ray_instance):
    """Two scopes of one driver share its ledger actor and stay apart, a Ray task records
    into a scope by its name, and a dropped scope is forgotten."""
    import ray

    first, second = skips.new_scope("first"), skips.new_scope("second")
    assert first.ledger == second.ledger and first.scope != second.scope
    first.add({"a": "truncated"})
    ray.get(ray.remote(lambda scope: scope.add({"b": "not an image"})).remote(second))
    assert first.recorded() == {"a": "truncated"} and second.recorded() == {"b": "not an image"}
    first.drop()
    assert first.recorded() == {} and second.recorded() == {"b": "not an image"}
    second.drop()


# a process that starts a local instance, records, stops it, and again (as bench_train does
# between its runs): the second instance numbers its job and driver as the first did
TWO_INSTANCES_IN_TURN = """
import ray
from pairsim.data import skips
for instance in range(2):
    ray.init(num_cpus=1, include_dashboard=False)
    scope = skips.new_scope("run")
    scope.add({str(instance): "truncated"})
    print(scope.recorded(), flush=True)
    ray.shutdown()
"""


@pytest.mark.slow
def test_a_second_ray_instance_of_a_process_gets_a_ledger_of_its_own(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", TWO_INSTANCES_IN_TURN], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["{'0': 'truncated'}", "{'1': 'truncated'}"]


@pytest.mark.slow
def test_each_epoch_gives_every_image_once_in_equal_batches_and_counts_bad_images(
        ray_instance, dataset_with_bad_images, tmp_path):
    import ray
    from ray.train import DataConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    root, bad = dataset_with_bad_images
    cfg = RunConfig.model_validate({"data": {"path": str(root), "shuffle_buffer": 40},
                                    "train": {"micro_batch_size": 16}})
    run_skips = skips.new_scope("test")
    trainer = TorchTrainer(
        _record_epochs, train_loop_config={"cfg": cfg.model_dump(mode="json"), "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path / "ray")),
        datasets={"train": ingest.train_dataset(cfg, run_skips)},
        dataset_config=DataConfig(datasets_to_split=["train"],
                                  execution_options={"train": ingest.execution_options(cfg, ordered=True)}))
    trainer.fit()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    good = pq.read_table(shards.split_files(root, "train"), columns=["image_id"]).column("image_id").to_pylist()
    good_groups = sorted(ingest.group_ids([i for i in good if i not in bad]).tolist())
    for epoch in range(2):
        # 256 decodable images split equally: 128 per rank, 8 full batches of 16 on each
        assert [len(r[epoch]) for r in ranks] == [8, 8]
        seen = [g for r in ranks for batch in r[epoch] for g in batch]
        assert sorted(seen) == good_groups  # every image exactly once over the ranks
    assert ranks[0][0] != ranks[0][1]  # a new order each epoch
    skipped = run_skips.recorded()
    assert set(skipped) == bad
    assert all(reason for reason in skipped.values())
    run_skips.drop()


def _epoch_orders(cfg, epochs=2):
    """(group id, caption index, pixel checksum) of every pair, in stream order, per epoch."""
    ds = ingest.train_dataset(cfg, NO_SKIPS)
    ds.context.execution_options = ingest.execution_options(cfg, ordered=True)
    orders = []
    for _ in range(epochs):
        order = []
        for batch in ds.iter_batches(batch_size=64, batch_format="numpy"):
            order += zip(batch["group_ids"].tolist(), batch["caption_index"].tolist(),
                         batch["pixels"].reshape(len(batch["pixels"]), -1).sum(axis=1).round(3).tolist())
        orders.append(order)
    return orders


@pytest.mark.slow
def test_a_fixed_seed_gives_the_same_order_captions_and_augmentations(ray_instance, tiny_dataset):
    cfg = RunConfig.model_validate({"data": {"path": str(tiny_dataset), "seed": 7}})
    first, again = _epoch_orders(cfg), _epoch_orders(cfg)
    other = _epoch_orders(cfg.model_copy(update={"data": cfg.data.model_copy(update={"seed": 8})}), epochs=1)
    assert first == again  # both epochs replay exactly
    assert first[0] != first[1] and first[0] != other[0]
    for order in first + other:
        assert len(order) == 256 and len({g for g, _, _ in order}) == 256
    # files, captions and crops all move with the epoch
    assert [g for g, _, _ in first[0]] != [g for g, _, _ in first[1]]
    by_image = [dict((g, (k, p)) for g, k, p in order) for order in first]
    assert sum(by_image[0][g][0] != by_image[1][g][0] for g in by_image[0]) > 128
    assert sum(by_image[0][g][1] != by_image[1][g][1] for g in by_image[0]) > 200


def train_rows(root, n, seed=0):
    batch = pq.read_table(shards.split_files(root, "train")[0]).slice(0, n).to_pydict()
    rows = {k: np.asarray(v, dtype=object) for k, v in batch.items()}
    rows["draw"] = np.random.default_rng(seed).random(n)
    return rows


def test_pairs_per_image_gives_distinct_captions_of_one_group(tiny_dataset):
    cfg = RunConfig.model_validate({"data": {"path": str(tiny_dataset), "pairs_per_image": 3}})
    batch = train_rows(tiny_dataset, 8)
    out = ingest.TrainPreprocess(cfg, NO_SKIPS)(batch)
    assert out["pixels"].shape[0] == out["tokens"].shape[0] == 24
    groups, picks = out["group_ids"].reshape(8, 3), out["caption_index"].reshape(8, 3)
    assert (groups == groups[:, :1]).all() and len(set(groups[:, 0])) == 8
    assert all(len(set(row)) == 3 for row in picks)  # 5 captions each: 3 distinct draws
    assert out["pair_slot"].tolist() == [0, 1, 2] * 8
    np.testing.assert_array_equal(groups[:, 0], ingest.group_ids(batch["image_id"]))


def test_all_pairs_gives_every_caption_of_every_image(tiny_dataset):
    cfg = RunConfig.model_validate({"data": {"path": str(tiny_dataset), "pairs_per_image": "all"}})
    batch = train_rows(tiny_dataset, 6)
    out = ingest.TrainPreprocess(cfg, NO_SKIPS)(batch)
    assert out["tokens"].shape[0] == sum(len(c) for c in batch["captions"]) == 30
    assert out["caption_index"].tolist() == out["pair_slot"].tolist() == [
        k for caps in batch["captions"] for k in range(len(caps))]


def test_draws_decide_captions_and_augmentation(tiny_dataset):
    """The same draws give the same pairs (whichever copy of the callable runs them); other
    draws give other captions and crops."""
    import pickle

    cfg = RunConfig.model_validate({"data": {"path": str(tiny_dataset)}})
    preprocess = ingest.TrainPreprocess(cfg, NO_SKIPS)
    a, b = (pickle.loads(pickle.dumps(preprocess))(train_rows(tiny_dataset, 32)) for _ in range(2))
    c = preprocess(train_rows(tiny_dataset, 32, seed=1))
    for key in ("tokens", "pixels", "caption_index"):
        np.testing.assert_array_equal(a[key], b[key])
    # 32 images × 5 captions: two independent draws agree on every image with chance 5^-32
    assert not np.array_equal(a["caption_index"], c["caption_index"])
    assert not np.allclose(a["pixels"], c["pixels"])


def test_a_run_that_leaves_ray_data_no_cpu_is_refused_before_it_starts(ray_instance, tiny_dataset):
    from pairsim import cluster
    from pairsim.train import driver
    from pairsim.config import ConfigError

    cfg = RunConfig.model_validate({"data": {"path": str(tiny_dataset)},
                                    "train": {"num_workers": 2, "cpus_per_worker": 1.5}})
    roles = cluster.node_roles(cfg.ray.node_roles)  # one unlabelled node: training and Data share it
    cluster.check_cpu_budget(cfg, roles)  # 4 CPUs: 3 for training leave 1 for Data
    with pytest.raises(ConfigError) as exc:
        cluster.check_cpu_budget(cfg.model_copy(update={"train": cfg.train.model_copy(update={"cpus_per_worker": 2})}),
                                 roles)
    assert "train.cpus_per_worker = 4" in str(exc.value) and "ray.data_cpus" in str(exc.value)  # the need, the remedy
    with pytest.raises(ConfigError, match="data.max_cpus"):
        driver.plan_run(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_cpus": 0.5})}))
