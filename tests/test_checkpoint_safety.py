"""Checkpoints load without running code: every file is opened with ``weights_only=True``
(DeepSpeed's own state classes allowed) before DeepSpeed's loader, which unpickles freely."""

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import on_gloo_ranks
from pairsim import storage
from pairsim.cli import main
from pairsim.config import ConfigError, ModelConfig, load_config
from pairsim.errors import InputError
from pairsim.models.saved import ModelCard
from pairsim.train import checkpoints, engine


def card_json(epoch: int = 1, rsum: float = 100.0) -> str:
    """A model card as pairsim writes it, of a ZeRO-0 pairsim-tiny checkpoint at ``epoch``."""
    return ModelCard(model=ModelConfig(), fused=False, unimodal_heads=False, zero_stage=0, epoch=epoch,
                     step=10 * epoch, val={"val/rsum": rsum}).model_dump_json()


class Exploit:
    """A pickle that runs code when loaded: it creates the file ``target``."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return Path.touch, (self.target,)


def crafted_checkpoint(root: Path, marker: Path) -> Path:
    """A directory shaped like a pairsim ZeRO-0 checkpoint whose model states are an exploit."""
    ds_dir = root / "checkpoint_000000" / checkpoints.CHECKPOINT_TAG
    ds_dir.mkdir(parents=True)
    torch.save({"module": {"model.clip.w": torch.zeros(2)}, "hook": Exploit(marker)}, ds_dir / "mp_rank_00_model_states.pt")
    (ds_dir.parent / checkpoints.CARD_FILE).write_text(card_json())
    return ds_dir.parent


def test_a_crafted_checkpoint_is_refused_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    checkpoint = crafted_checkpoint(tmp_path, marker)
    with pytest.raises(checkpoints.UnsafeCheckpointError) as err:
        checkpoints.export_checkpoint(checkpoint, tmp_path / "out" / "model.pt")
    assert "mp_rank_00_model_states.pt: refused" in str(err.value)
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out" / "model.pt")]) == 2
    assert "refused to load" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out" / "model.pt").exists()
    torch.load(checkpoint / checkpoints.CHECKPOINT_TAG / "mp_rank_00_model_states.pt", weights_only=False)
    assert marker.exists()  # the file is the exploit it claims: an unchecked load runs it


def test_a_file_that_is_no_torch_zip_is_refused(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"\x80\x04K\x01.")  # a bare pickle, not torch.save's zip format
    with pytest.raises(checkpoints.UnsafeCheckpointError, match="x.pt: refused"):
        checkpoints.verify_checkpoint_files(tmp_path)


def _save_and_reload(rank, world, directory):
    """Every file a DeepSpeed engine writes with pairsim's config (ZeRO 0–3 × fp32/bf16/amp_bf16) passes
    the check, and the engine loads the checkpoint back. amp_bf16 last: once an engine has used
    torch_autocast, DeepSpeed flags the whole process as autocast-initialised."""
    import deepspeed

    written = {}
    for precision in ("fp32", "bf16", "amp_bf16"):
        for stage in range(4):
            cfg = load_config(None, [f"train.zero_stage={stage}", f"train.precision={precision}",
                                     "train.micro_batch_size=2"])
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
            ds, *_ = deepspeed.initialize(model=model, config=engine.deepspeed_config(cfg.train, cfg.optim, 10),
                                          model_parameters=engine.parameter_groups(model, 0.1))
            ds.backward(ds(torch.ones(2, 4, dtype=engine.DTYPES[precision])).float().square().sum())
            ds.step()
            ckpt_dir = Path(directory, f"{stage}-{precision}")
            ds.save_checkpoint(ckpt_dir, tag=checkpoints.CHECKPOINT_TAG)
            checkpoints.verify_checkpoint_files(ckpt_dir)
            ds.load_checkpoint(ckpt_dir, tag=checkpoints.CHECKPOINT_TAG)
            written[stage, precision] = sorted(p.name for p in (ckpt_dir / checkpoints.CHECKPOINT_TAG).glob("*.pt"))
    return written


@pytest.mark.slow
def test_every_checkpoint_deepspeed_writes_passes(tmp_path):
    written = on_gloo_ranks(_save_and_reload, str(tmp_path), world=1)[0]
    assert len(written) == 12 and all(any("model_states" in f for f in files) for files in written.values())
    assert any("optim_states" in f for f in written[3, "bf16"])


# ------------------------------------------------------------------ checksums, verify, list

def fake_run(root: Path, epochs: int = 2, world: int = 2) -> Path:
    """A run directory with one checkpoint per epoch as pairsim writes them: each rank's files
    and checksums (rank 0 with the card), merged into one directory."""
    run = root / "run"
    for epoch in range(1, epochs + 1):
        ckpt = run / f"checkpoint_2026-01-0{epoch}_00-00-00.000000"
        for rank in range(world):
            part = root / f"rank{rank}-{epoch}"
            (part / checkpoints.CHECKPOINT_TAG).mkdir(parents=True)
            torch.save({"w": torch.full((4,), float(epoch))}, part / checkpoints.CHECKPOINT_TAG / f"zero_pp_rank_{rank}.pt")
            if rank == 0:
                (part / checkpoints.CARD_FILE).write_text(card_json(epoch, rsum=100.0 + epoch))
            checkpoints.write_checksums(part, rank, world)
            shutil.copytree(part, ckpt, dirs_exist_ok=True)
    return run


def test_checksums_catch_a_changed_missing_or_partial_checkpoint(tmp_path):
    run = fake_run(tmp_path)
    newest, oldest = checkpoints.checkpoints_in(storage.Location.of(run))
    assert newest.name.startswith("checkpoint_2026-01-02") and oldest.name.startswith("checkpoint_2026-01-01")
    assert checkpoints.verify_checkpoint(newest.path) == []
    model = Path(newest.path) / checkpoints.CHECKPOINT_TAG / "zero_pp_rank_1.pt"
    data = bytearray(model.read_bytes())
    data[-100] ^= 0xFF
    model.write_bytes(bytes(data))
    assert checkpoints.verify_checkpoint(newest.path) == [
        f"{checkpoints.CHECKPOINT_TAG}/zero_pp_rank_1.pt: content differs from its checksum (truncated or altered)"]
    (Path(oldest.path) / checkpoints.CHECKSUMS_DIR / "rank_1.json").unlink()
    assert checkpoints.verify_checkpoint(oldest.path) == ["1 of 2 ranks' checksum files"]
    (Path(oldest.path) / checkpoints.CARD_FILE).unlink()
    assert "not a complete pairsim checkpoint" in checkpoints.verify_checkpoint(oldest.path)[0]


def test_resume_skips_failed_saves_and_refuses_only_damaged_finished_work(tmp_path):
    """A save that failed part way (not registered by Ray Train) is skipped — resume from the
    one before, or from step 0 when it was the first; a damaged checkpoint Ray Train had
    registered, with none good left, refuses the run instead of redoing it."""
    run = storage.Location.of(fake_run(tmp_path, epochs=3))
    first, second, third = sorted(Path(c.path) for c in checkpoints.checkpoints_in(run))
    (third / checkpoints.CHECKPOINT_TAG / "zero_pp_rank_1.pt").unlink()  # copy cut short: a worker lost
    assert checkpoints.resume_point(run, registered_through=second.name).name == second.name
    assert checkpoints.resume_point(run).name == second.name  # Ray Train's record lost: the newest that verifies
    shutil.rmtree(second / checkpoints.CHECKSUMS_DIR)  # saved before pairsim kept checksums
    assert checkpoints.resume_point(run, registered_through=second.name).name == second.name
    assert checkpoints.resume_point(run, registered_through=first.name).name == first.name  # a failed save
    (first / checkpoints.CHECKPOINT_TAG / "zero_pp_rank_0.pt").write_bytes(b"")
    with pytest.raises(RuntimeError) as err:
        checkpoints.resume_point(run, registered_through=first.name)
    assert f"registered {first.name}" in str(err.value) and "move the run directory aside" in str(err.value)  # remedy
    assert checkpoints.resume_point(run) is None  # nothing registered: every one a failed save, start over
    shutil.rmtree(first)
    shutil.rmtree(second)
    assert checkpoints.resume_point(run, registered_through=first.name) is None  # the registered one was deleted


def test_the_best_checkpoint_is_chosen_from_every_card_and_must_verify(tmp_path):
    """Every checkpoint of the run directory competes by its card's val metric (Ray Train's
    record may rank only some); a better one that fails verification is skipped."""
    run = storage.Location.of(fake_run(tmp_path, epochs=3))  # cards: val/rsum 101, 102, 103
    first, second, third = sorted(Path(c.path) for c in checkpoints.checkpoints_in(run))
    with checkpoints.best_checkpoint(run, "val/rsum", "max") as (best, local):
        assert best.name == third.name and checkpoints.checkpoint_card(local).epoch == 3
    with checkpoints.best_checkpoint(run, "val/rsum", "min") as (best, _):
        assert best.name == first.name
    (third / checkpoints.CHECKPOINT_TAG / "zero_pp_rank_0.pt").write_bytes(b"")
    with checkpoints.best_checkpoint(run, "val/rsum", "max") as (best, _):
        assert best.name == second.name
    (third / checkpoints.CARD_FILE).write_text('{"epoch": 3, "val": {"val/rs')  # a card cut short
    with checkpoints.best_checkpoint(run, "val/rsum", "max") as (best, _):
        assert best.name == second.name
    card = json.loads((first / checkpoints.CARD_FILE).read_text())
    (first / checkpoints.CARD_FILE).write_text(json.dumps(card | {"val": {"val/rsum": 102.0}}))
    shutil.rmtree(first / checkpoints.CHECKSUMS_DIR)
    checkpoints.write_checksums(first, 0, 1)  # the card changed: sums again, as one rank
    with checkpoints.best_checkpoint(run, "val/rsum", "max") as (best, _):
        assert best.name == second.name  # a tie goes to the newer
    shutil.rmtree(second / checkpoints.CHECKSUMS_DIR)  # saved before pairsim kept checksums
    with checkpoints.best_checkpoint(run, "val/rsum", "max", registered_through=third.name) as (best, _):
        assert best.name == second.name  # trusted: Ray Train registered it
    with checkpoints.best_checkpoint(run, "val/rsum", "max", registered_through=first.name) as (best, _):
        assert best.name == first.name  # newer than Ray Train's record: a failed save
    with pytest.raises(FileNotFoundError, match="val/r1"):  # the metric no checkpoint has a finite value of
        with checkpoints.best_checkpoint(run, "val/r1", "max"):
            pass


def test_checkpoints_cli_lists_and_verifies(tmp_path, capsys):
    run = fake_run(tmp_path)
    assert main(["checkpoints", "verify", str(run)]) == 0
    assert "every checkpoint verified" in capsys.readouterr().out
    assert main(["checkpoints", "list", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0][:21] for line in lines] == ["checkpoint_2026-01-02", "checkpoint_2026-01-01"]
    assert "epoch 2  step 20  rsum 102.00  ok" in lines[0]
    newest = sorted(run.iterdir())[-1]
    (newest / checkpoints.CHECKPOINT_TAG / "zero_pp_rank_0.pt").write_bytes(b"")
    assert main(["checkpoints", "verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert "zero_pp_rank_0.pt: content differs" in out and "1 of the checkpoints failed" in out
    assert main(["checkpoints", "verify", str(sorted(run.iterdir())[0])]) == 0  # one checkpoint by its path
    assert main(["checkpoints", "list", str(tmp_path / "nothing")]) == 2


def test_a_directory_that_is_no_checkpoint_is_refused_at_once_not_walked(tmp_path, capsys):
    """``/`` has neither a model card nor ``deepspeed/``: refused by those two names alone, in
    export, ``model.init_from`` and ``checkpoints verify``, none of them walking what is under it."""
    started = time.monotonic()
    with pytest.raises(InputError) as err:
        checkpoints.export_checkpoint(Path("/"), tmp_path / "model.pt")
    assert str(err.value).startswith("/:") and checkpoints.NOT_A_CHECKPOINT in str(err.value)
    with pytest.raises(ConfigError) as err:
        checkpoints.check_init_from(ModelConfig(init_from=Path("/")))
    assert err.value.keys == ("model.init_from",) and str(err.value).startswith("model.init_from: /:") \
        and checkpoints.NOT_A_CHECKPOINT in str(err.value)
    with pytest.raises(InputError, match="^/: neither"):  # refused by its name alone
        checkpoints.inventory("/")
    assert time.monotonic() - started < 1
    assert main(["export", "--checkpoint", "/", "--out", str(tmp_path / "model.pt")]) == 2
    assert main(["checkpoints", "verify", "/"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Traceback" not in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("record", [
    b'{"foo": 1}',
    b"not json {",
    b'{"checkpoint_results": [{"checkpoint_dir_name": 7}]}',
    b'{"checkpoint_results": [{"checkpoint_dir_name": "../../elsewhere"}]}',
    b'{"checkpoint_results": [], "checkpoint_results": []}',
    b"[" * 100_000,
], ids=["foreign", "not-json", "wrong-type", "name-leaving-the-run", "key-twice", "nested"])
def test_a_foreign_train_record_is_set_aside_with_a_warning_and_kept_and_no_checkpoint_touched(tmp_path, caplog, record):
    """Ray Train's record of a run's checkpoints that is not one it writes: set aside with one
    warning naming it (kept, renamed, as a record naming a deleted checkpoint is), so that Ray
    Train starts a new one and the run resumes from the newest checkpoint that verifies
    (``resume_point``); no checkpoint is touched."""
    from pairsim import compat

    run = tmp_path / "run"
    for epoch in (1, 2):
        checkpoint = run / f"checkpoint_2026-01-01_00-0{epoch}-00.000000"
        (checkpoint / checkpoints.CHECKPOINT_TAG).mkdir(parents=True)
        (checkpoint / checkpoints.CARD_FILE).write_text(card_json(epoch))
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    (run / compat.ray.TRAIN_RECORD).write_bytes(record)
    with caplog.at_level("WARNING", logger="pairsim"):
        checkpoints.set_aside_stale_snapshot(storage.Location.of(run))
    aside = list(run.glob(f"{compat.ray.TRAIN_RECORD}.stale-*"))
    assert not (run / compat.ray.TRAIN_RECORD).exists() and len(aside) == 1 and aside[0].read_bytes() == record
    warning = [r.getMessage() for r in caplog.records]
    assert len(warning) == 1 and str(run / compat.ray.TRAIN_RECORD) in warning[0] and aside[0].name in warning[0]
    assert sorted(p.relative_to(run) for p in run.rglob("*") if p not in aside) == before
