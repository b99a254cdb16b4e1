import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pairsim import data, shards
from pairsim.config import RunConfig


def _equal_steps_worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mine = [torch.full((2,), i) for i in range(3 if rank == 0 else 5)]  # deliberately uneven
    seen = []
    for batch in data.equal_steps(mine):
        dist.all_reduce(batch.clone())  # a collective per step, as training does: would hang if counts differed
        seen.append(int(batch[0]))
    out.put((rank, seen))
    out.close()
    out.join_thread()  # the result is in the pipe before os._exit below
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    dist.destroy_process_group()
    # The result is delivered; skip interpreter teardown, where torch 2.15 sporadically aborts
    # (std::terminate on a joinable C++ thread: 2 of ~80 spawned ranks under CI load).
    os._exit(0)


def test_equal_steps_stops_every_rank_with_the_shortest(free_port):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_equal_steps_worker, args=(r, free_port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert results == {0: [0, 1, 2], 1: [0, 1, 2]}


@pytest.fixture(scope="module")
def dataset_with_bad_images(tiny_dataset, tmp_path_factory):
    """The tiny dataset with its last (56-row) train shard opening with 18 undecodable images:
    garbage, a truncated PNG, empty bytes — more than a whole 16-row batch."""
    root = tmp_path_factory.mktemp("bad") / "shapes"
    shutil.copytree(tiny_dataset, root)
    last = sorted((root / "train").glob("*.parquet"))[-1]
    rows = pq.read_table(last).to_pylist()
    for row in rows[:18]:
        row["image"] = b"not an image"
    rows[1]["image"] = rows[30]["image"][:40]  # truncated PNG
    rows[2]["image"] = b""
    pq.write_table(pa.Table.from_pylist(rows, schema=shards.SHARD_SCHEMA), last)
    return root, {row["image_id"] for row in rows[:18]}


def _count_batches(config):
    import ray.train

    cfg = RunConfig.model_validate(config["cfg"])
    shard = ray.train.get_dataset_shard("train")
    counts = []
    for _ in range(2):  # two epochs
        batches = shard.iter_torch_batches(batch_size=cfg.train.micro_batch_size, drop_last=True,
                                           local_shuffle_buffer_size=cfg.data.shuffle_buffer)
        n = 0
        for batch in data.equal_steps(batches):
            assert batch["pixels"].shape == (cfg.train.micro_batch_size, 3, 64, 64)
            assert batch["tokens"].shape == (cfg.train.micro_batch_size, 32)
            n += 1
        counts.append(n)
    rank = ray.train.get_context().get_world_rank()
    with open(f"{config['out']}/rank{rank}.json", "w") as f:
        json.dump(counts, f)


@pytest.mark.slow
def test_every_rank_runs_the_same_steps_and_bad_images_are_counted(ray_instance, dataset_with_bad_images,
                                                                    tmp_path):
    import ray
    from ray.train import DataConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    root, bad = dataset_with_bad_images
    cfg = RunConfig.model_validate({"data": {"path": str(root), "shuffle_buffer": 40},
                                    "train": {"micro_batch_size": 16}})
    ledger = data.skip_ledger("test-ledger")
    trainer = TorchTrainer(
        _count_batches, train_loop_config={"cfg": cfg.model_dump(mode="json"), "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path / "ray")),
        datasets={"train": data.train_dataset(cfg, "test-ledger")},
        dataset_config=DataConfig(datasets_to_split=["train"]))
    trainer.fit()
    counts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert counts[0] == counts[1], counts
    # 238 decodable rows split equally: 119 per rank → 7 full batches of 16 each epoch
    assert counts[0] == [7, 7]
    skipped = ray.get(ledger.get.remote())
    assert set(skipped) == bad
    assert all(reason for reason in skipped.values())
    ray.kill(ledger)


def train_rows(root, n):
    batch = pq.read_table(shards.split_files(root, "train")[0]).slice(0, n).to_pydict()
    return {k: np.asarray(v, dtype=object) for k, v in batch.items()}


def test_pairs_per_image_gives_distinct_captions_of_one_group(tiny_dataset):
    cfg = RunConfig.model_validate({"data": {"path": str(tiny_dataset), "pairs_per_image": 3}})
    batch = train_rows(tiny_dataset, 8)
    out = data.TrainPreprocess(cfg, "unused-ledger")(batch)
    assert out["pixels"].shape[0] == out["tokens"].shape[0] == 24
    groups, picks = out["group_ids"].reshape(8, 3), out["caption_index"].reshape(8, 3)
    assert (groups == groups[:, :1]).all() and len(set(groups[:, 0])) == 8
    assert all(len(set(row)) == 3 for row in picks)  # 5 captions each: 3 distinct draws
    np.testing.assert_array_equal(groups[:, 0], data.group_ids(batch["image_id"]))


def test_caption_draws_differ_between_the_copies_ray_ships_to_tasks(tiny_dataset):
    import pickle

    cfg = RunConfig.model_validate({"data": {"path": str(tiny_dataset)}})
    preprocess = data.TrainPreprocess(cfg, "unused-ledger")
    batch = train_rows(tiny_dataset, 32)
    draws = [pickle.loads(pickle.dumps(preprocess))(batch)["tokens"] for _ in range(2)]
    assert draws[0].shape == (32, 32)
    # 32 images × 5 captions: two independent draws agree on every image with chance 5^-32
    assert not np.array_equal(draws[0], draws[1])
