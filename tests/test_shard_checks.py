"""Shards checked where Ray Data reads them (issue 31, item 3; :mod:`pairsim.data.shard_reader`):
a shard whose bytes changed after its build fails the read naming it by default, is left out
and listed with ``data.shard_checks=skip``, is read with ``off``; a run stops with one line
naming it."""

import json

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from pairsim import cli
from pairsim.config import RunConfig
from pairsim.data import ingest, skips, synth
from pairsim.data.shard_reader import ShardChecksumError, checksum_failure


@pytest.fixture
def dataset(tmp_path):
    """40 train images in 4 shards of 10."""
    root = tmp_path / "data"
    synth.generate(root, num_train=40, num_val=8, num_test=0, rows_per_shard=10, progress=False)
    return root


def flip_bytes(shard):
    """64 bytes flipped inside its data pages: footer and row count as they were."""
    raw = bytearray(shard.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 64] = bytes(b ^ 0xFF for b in raw[middle:middle + 64])
    shard.write_bytes(bytes(raw))


def rewritten(shard):
    """The same rows written again, uncompressed: a valid shard with other bytes (a replacement)."""
    pq.write_table(pq.read_table(shard), shard, compression="none")
    return [str(i) for i in pq.read_table(shard, columns=["image_id"])["image_id"].to_pylist()]


def image_ids(ds) -> list[str]:
    return sorted(str(i) for batch in ds.iter_batches(batch_format="numpy") for i in batch["image_id"])


def config(root, checks: str) -> RunConfig:
    return RunConfig.model_validate({"data": {"path": str(root), "shard_checks": checks}})


def test_an_altered_shard_fails_the_read_naming_it_and_the_verify_command(dataset, ray_instance):
    from ray.train.v2.api.exceptions import WorkerGroupError

    assert len(image_ids(ingest.read_split(config(dataset, "error"), "train", ["image_id"]))) == 40
    victim = sorted((dataset / "train").glob("*.parquet"))[2]
    flip_bytes(victim)
    with pytest.raises(ShardChecksumError) as caught:
        image_ids(ingest.read_split(config(dataset, "error"), "train", ["image_id"]))
    plain = checksum_failure(caught.value)
    assert str(plain).startswith(f"{victim}: its SHA-256 is ") and f"pairsim shards verify {dataset}" in str(plain)
    assert "\n" not in str(plain)  # not Ray Data's retry advice, appended to the message in the read task
    assert cli._message(caught.value) == str(plain)  # what `pairsim evaluate` prints, reading the split on the driver
    # as a training run's driver meets it: in one rank's failure, inside Ray Train's error
    assert str(checksum_failure(WorkerGroupError("training failed", {1: caught.value}))) == str(plain)
    assert checksum_failure(WorkerGroupError("training failed", {0: RuntimeError("other")})) is None


def test_skip_leaves_the_shard_out_listing_its_image_ids(dataset, ray_instance):
    shards_ = sorted((dataset / "train").glob("*.parquet"))
    replaced = rewritten(shards_[0])
    shards_[3].write_bytes(shards_[3].read_bytes()[:200])  # truncated: too damaged to list its rows
    read_skips = skips.new_scope("shard-checks")
    try:
        read = image_ids(ingest.read_split(config(dataset, "skip"), "train", ["image_id"], skips=read_skips))
        skipped = read_skips.recorded()
    finally:
        read_skips.drop()
    assert len(read) == 20 and not set(read) & set(replaced)
    assert set(skipped) == set(replaced) | {f"shard {shards_[3]}"}
    assert all(f"in {shards_[0]}, left out: its SHA-256" in skipped[i] for i in replaced)


def test_off_and_a_manifest_without_digests_read_the_shards_as_they_are(dataset, ray_instance, tmp_path):
    replaced = rewritten(sorted((dataset / "train").glob("*.parquet"))[1])
    assert len(image_ids(ingest.read_split(config(dataset, "off"), "train", ["image_id"]))) == 40
    manifest = json.loads((dataset / "manifest.json").read_text())
    for split in manifest["splits"].values():  # written before pairsim recorded per-shard SHA-256s
        del split["shard_sha256"]
    (dataset / "manifest.json").write_text(json.dumps(manifest))
    assert set(replaced) <= set(image_ids(ingest.read_split(config(dataset, "error"), "train", ["image_id"])))


@pytest.mark.slow  # a training run up to its first batches
def test_a_run_over_an_altered_shard_stops_with_one_line_naming_it(tiny_dataset, ray_instance, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    victim = sorted((data / "train").glob("*.parquet"))[1]
    flip_bytes(victim)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sets = [f"data.path={data}", "train.epochs=1", "train.micro_batch_size=16", f"ray.storage_path={tmp_path}/ray",
            f"tracking.tracking_uri={uri}", "ray.run_name=altered"]
    code = cli.main(["train", "--config", str(cli.DEMO_CONFIG), *(arg for kv in sets for arg in ("--set", kv))])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    # the one line the CLI prints (Ray's forwarded worker logs may interleave here: the session's instance lives on)
    assert [line for line in err.splitlines() if line.startswith("pairsim: ")] == [
        line for line in err.splitlines() if line.startswith(f"pairsim: {victim}: its SHA-256 is ")] != [], err[-3000:]
    client = MlflowClient(uri)
    run, = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED"


def test_a_shard_that_does_not_parse_fails_the_read_in_one_line_naming_it(dataset, ray_instance):
    """Data pages that do not parse under a valid footer, their SHA-256 recorded to match: the
    read fails with one line naming the shard, not pyarrow's error from inside a read task."""
    from test_dataset_safety import _garble_pages, _record_as_they_are

    from pairsim.data.shards import ShardError

    victim = sorted((dataset / "train").glob("*.parquet"))[1]
    _garble_pages(victim, keep_footer=True)
    _record_as_they_are(dataset, "train")
    with pytest.raises(ShardError) as caught:
        image_ids(ingest.read_split(config(dataset, "error"), "train", ["image_id"]))
    assert cli._message(caught.value).startswith(f"{victim}: not a Parquet shard")
    assert "\n" not in cli._message(caught.value)
