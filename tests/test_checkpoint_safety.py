"""Checkpoints load without running code: every file is opened with ``weights_only=True``
(DeepSpeed's own state classes allowed) before DeepSpeed's loader, which unpickles freely."""

import json
from pathlib import Path

import pytest
import torch

from conftest import on_gloo_ranks
from pairsim.cli import main
from pairsim.config import load_config
from pairsim.train import engine


class Exploit:
    """A pickle that runs code when loaded: it creates the file ``target``."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return Path.touch, (self.target,)


def crafted_checkpoint(root: Path, marker: Path) -> Path:
    """A directory shaped like a pairsim ZeRO-0 checkpoint whose model states are an exploit."""
    ds_dir = root / "checkpoint_000000" / engine.CHECKPOINT_TAG
    ds_dir.mkdir(parents=True)
    torch.save({"module": {"model.clip.w": torch.zeros(2)}, "hook": Exploit(marker)}, ds_dir / "mp_rank_00_model_states.pt")
    (ds_dir.parent / engine.CARD_FILE).write_text(json.dumps({"zero_stage": 0, "model": {}}))
    return ds_dir.parent


def test_a_crafted_checkpoint_is_refused_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    checkpoint = crafted_checkpoint(tmp_path, marker)
    with pytest.raises(engine.UnsafeCheckpointError, match="mp_rank_00_model_states.pt: refused to load"):
        engine.export_checkpoint(checkpoint, tmp_path / "out" / "model.pt")
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out" / "model.pt")]) == 1
    assert "refused to load" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out" / "model.pt").exists()
    torch.load(checkpoint / engine.CHECKPOINT_TAG / "mp_rank_00_model_states.pt", weights_only=False)
    assert marker.exists()  # the file is the exploit it claims: an unchecked load runs it


def test_a_file_that_is_no_torch_zip_is_refused(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"\x80\x04K\x01.")  # a bare pickle, not torch.save's zip format
    with pytest.raises(engine.UnsafeCheckpointError, match="x.pt: refused"):
        engine.verify_checkpoint_files(tmp_path)


def _save_and_reload(rank, world, directory):
    """Every file a DeepSpeed engine writes with pairsim's config (ZeRO 0–3 × fp32/bf16) passes
    the check, and the engine loads the checkpoint back."""
    import deepspeed

    written = {}
    for stage in range(4):
        for precision in ("fp32", "bf16"):
            cfg = load_config(None, [f"train.zero_stage={stage}", f"train.precision={precision}",
                                     "train.micro_batch_size=2"])
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
            ds, *_ = deepspeed.initialize(model=model, config=engine.deepspeed_config(cfg.train, cfg.optim, 10),
                                          model_parameters=engine.parameter_groups(model, 0.1))
            ds.backward(ds(torch.ones(2, 4, dtype=engine.DTYPES[precision])).float().square().sum())
            ds.step()
            ckpt_dir = Path(directory, f"{stage}-{precision}")
            ds.save_checkpoint(ckpt_dir, tag=engine.CHECKPOINT_TAG)
            engine.verify_checkpoint_files(ckpt_dir)
            ds.load_checkpoint(ckpt_dir, tag=engine.CHECKPOINT_TAG)
            written[stage, precision] = sorted(p.name for p in (ckpt_dir / engine.CHECKPOINT_TAG).glob("*.pt"))
    return written


@pytest.mark.slow
def test_every_checkpoint_deepspeed_writes_passes(tmp_path):
    written = on_gloo_ranks(_save_and_reload, str(tmp_path), world=1)[0]
    assert len(written) == 8 and all(any("model_states" in f for f in files) for files in written.values())
    assert any("optim_states" in f for f in written[3, "bf16"])
