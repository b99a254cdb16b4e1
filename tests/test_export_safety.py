"""An export writes its weights, heads file and model card as one unit (issue 51): every place
is checked before any work — a file pairsim did not write, a directory, a device or a place that
cannot be written is refused in one line, nothing replaced — an earlier export of pairsim's is
replaced whole (a heads file the new one lacks removed), and each file lands by a rename."""

import os
from pathlib import Path

import pytest
import torch

from pairsim import tracking
from pairsim.cli import main
from pairsim.config import ModelConfig
from pairsim.models import retrieval
from pairsim.outputs import OutputRefused
from pairsim.train import checkpoints


def make_checkpoint(root: Path, heads: bool) -> Path:
    """A ZeRO-0 checkpoint of a pairsim-tiny model, with cross-modal heads or none, as one rank writes it."""
    cfg = ModelConfig(crossmodal_heads=heads)
    torch.manual_seed(0)
    model = retrieval.create_retrieval_model(cfg)
    ckpt = root / f"run-{'heads' if heads else 'plain'}" / "checkpoint_2026-01-01_00-00-00.000000"
    (ckpt / checkpoints.CHECKPOINT_TAG).mkdir(parents=True)
    torch.save({"module": {f"{checkpoints.MODEL_PREFIX}{k}": v for k, v in model.state_dict().items()}},
               ckpt / checkpoints.CHECKPOINT_TAG / "mp_rank_00_model_states.pt")
    card = retrieval.model_card(cfg, model, zero_stage=0, epoch=1, step=10, val={"val/rsum": 101.0})
    (ckpt / checkpoints.CARD_FILE).write_text(card.model_dump_json(indent=2))
    checkpoints.write_checksums(ckpt, 0, 1)
    return ckpt


def export(ckpt: Path, out: Path | str) -> int:
    return main(["export", "--checkpoint", str(ckpt), "--out", str(out)])


def one_line_refusal(capsys, *named: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("pairsim: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert all(name in err for name in named), err
    return err


@pytest.mark.parametrize("foreign", ["settings.json", "settings.heads.pt", "settings.pt"])
def test_a_file_of_the_set_pairsim_did_not_write_is_refused_and_left_alone(tmp_path, capsys, foreign):
    ckpt = make_checkpoint(tmp_path, heads=True)
    victim = tmp_path / "vict"
    victim.mkdir()
    (victim / foreign).write_text("someone's settings")
    assert export(ckpt, victim / "settings.pt") == 2
    one_line_refusal(capsys, str(victim / foreign), "pairsim did not write")
    assert sorted(p.name for p in victim.iterdir()) == [foreign]
    assert (victim / foreign).read_text() == "someone's settings"


def test_an_earlier_export_is_replaced_whole_and_its_heads_file_removed(tmp_path, capsys):
    out, with_heads = tmp_path / "out" / "model.pt", make_checkpoint(tmp_path, heads=True)
    assert export(with_heads, out) == 0
    assert out.with_suffix(".heads.pt").is_file()
    assert export(make_checkpoint(tmp_path, heads=False), out) == 0  # the same --out, a model without heads
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.json", "model.pt"]  # no temporary left either
    card = checkpoints.initial_state(out)[0]  # model.init_from takes it: no stray heads file
    assert not card.model.crossmodal_heads and card.sha256.heads is None
    capsys.readouterr()

    out.write_bytes(b"altered")  # no longer the weights the card sums: not pairsim's to replace
    assert export(with_heads, out) == 2
    one_line_refusal(capsys, str(out))
    assert out.read_bytes() == b"altered" and not out.with_suffix(".heads.pt").exists()


@pytest.mark.parametrize("out", ["/dev/null", "{tmp}", "{tmp}/model.json", "{tmp}/a-file/model.pt"])
def test_a_device_a_directory_or_a_place_that_cannot_be_written_is_refused_in_one_line(tmp_path, capsys, out):
    ckpt = make_checkpoint(tmp_path, heads=False)
    (tmp_path / "a-file").write_text("")
    out = Path(out.format(tmp=tmp_path))
    before = sorted(tmp_path.rglob("*"))
    assert export(ckpt, out) == 2
    one_line_refusal(capsys, str(out))
    assert not Path("/dev/null.json").exists() and sorted(tmp_path.rglob("*")) == before


def test_a_read_only_out_directory_is_refused_in_one_line(tmp_path, capsys):
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if os.access(read_only, os.W_OK):
        pytest.skip("this user writes into read-only directories (root)")
    ckpt = make_checkpoint(tmp_path, heads=False)
    assert export(ckpt, read_only / "model.pt") == 2
    one_line_refusal(capsys, str(read_only), "cannot be created or written")


def test_a_run_model_download_checks_the_places_before_mlflow_is_asked(tmp_path):
    """``export --run-id`` goes through the same check, before MLflow reads the store."""
    store = tmp_path / "mlflow.db"
    store.write_bytes(b"")  # no MLflow store: reaching it would fail otherwise
    (tmp_path / "model.json").write_text("{}")
    with pytest.raises(OutputRefused) as err:
        tracking.download_run_model("0" * 32, f"sqlite:///{store}", tmp_path / "model.pt")
    assert f"{tmp_path / 'model.json'}:" in str(err.value)  # the file in the way


def test_a_run_model_download_replaces_an_earlier_export_whole(tmp_path):
    """``export --run-id`` over an earlier export with heads, from a run whose model has none:
    that heads file is removed."""
    from mlflow.tracking import MlflowClient

    from conftest import new_experiment

    out, logged = tmp_path / "out" / "model.pt", tmp_path / "logged" / "model.pt"
    checkpoints.export_checkpoint(make_checkpoint(tmp_path, heads=True), out)
    checkpoints.export_checkpoint(make_checkpoint(tmp_path, heads=False), logged)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(new_experiment(uri)).info.run_id
    client.log_artifacts(run_id, str(logged.parent), tracking.MODEL_ARTIFACTS)
    assert tracking.download_run_model(run_id, uri, out) == [out, out.with_suffix(".json")]
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.json", "model.pt"]
    assert retrieval.verified_export_card(out).sha256.heads is None
