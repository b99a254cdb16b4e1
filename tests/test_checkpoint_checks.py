"""Checkpoints and exports are checked before any of their files is loaded (issue 31, item 4):
every file inside its folder (a link leading elsewhere is refused, named), every file matching
its checksum, and the model card parsed into its typed model — in ``export``, ``evaluate``,
``model.init_from``, a resume and ``pairsim checkpoints list|verify`` alike, each a one-line
refusal naming the file (and the card's field), never a traceback. ``torch.load`` is replaced by
a probe that fails the test if it is reached."""

import json
from pathlib import Path

import pytest
import torch

from pairsim import cluster, storage
from pairsim.cli import main
from pairsim.config import ConfigError, ModelConfig
from pairsim.models import retrieval
from pairsim.models.saved import MAX_METADATA_BYTES, ModelCard, UnsafeCheckpointError
from pairsim.train import checkpoints

MODEL_STATES = f"{checkpoints.CHECKPOINT_TAG}/mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def model() -> retrieval.RetrievalModel:
    torch.manual_seed(0)
    return retrieval.create_retrieval_model(ModelConfig(crossmodal_heads=True))


def card(model: retrieval.RetrievalModel) -> ModelCard:
    return retrieval.model_card(ModelConfig(crossmodal_heads=True), model, zero_stage=0, epoch=1, step=10,
                                val={"val/rsum": 101.0})


def make_checkpoint(root: Path, model: retrieval.RetrievalModel) -> Path:
    """A ZeRO-0 checkpoint of ``model`` in a run directory as one rank writes it: DeepSpeed's
    model states, the model card and the rank's checksums."""
    ckpt = root / "run" / "checkpoint_2026-01-01_00-00-00.000000"
    (ckpt / checkpoints.CHECKPOINT_TAG).mkdir(parents=True)
    torch.save({"module": {f"{checkpoints.MODEL_PREFIX}{k}": v for k, v in model.state_dict().items()}},
               ckpt / MODEL_STATES)
    (ckpt / checkpoints.CARD_FILE).write_text(card(model).model_dump_json(indent=2))
    checkpoints.write_checksums(ckpt, 0, 1)
    return ckpt


def make_export(root: Path, model: retrieval.RetrievalModel) -> Path:
    weights = root / "export" / "model.pt"
    weights.parent.mkdir(parents=True)
    retrieval.write_exported(card(model), model.state_dict(), weights)
    return weights


def resummed(ckpt: Path) -> None:
    """The checkpoint's checksums written again over what is there now: whoever changed a file
    changed its checksum too."""
    (ckpt / checkpoints.CHECKSUMS_DIR / "rank_0.json").unlink()
    checkpoints.write_checksums(ckpt, 0, 1)


def passwd(root: Path) -> Path:
    """A file outside every checkpoint, standing in for /etc/passwd."""
    target = root / "etc" / "passwd"
    target.parent.mkdir()
    target.write_text("root:x:0:0:root:/root:/bin/bash\n")
    return target


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """``torch.load`` replaced by a probe that records the file and fails: a check that lets a
    file through to the loader fails the test."""
    reached = []

    def probe(f, *args, **kwargs):
        reached.append(str(f))
        raise AssertionError(f"torch.load reached {f} before the checks refused it")

    monkeypatch.setattr(torch, "load", probe)
    return reached


@pytest.fixture
def no_ray(monkeypatch) -> None:
    def reached(*args, **kwargs):
        raise AssertionError("init_ray was reached: the refusal came after Ray started")

    monkeypatch.setattr(cluster, "init_ray", reached)


def export_cli(ckpt: Path, out: Path) -> list[str]:
    return ["export", "--checkpoint", str(ckpt), "--out", str(out)]


def evaluate_cli(ckpt: Path, data: Path, tmp_path: Path) -> list[str]:
    return ["evaluate", "--checkpoint", str(ckpt), "--data", str(data), "--split", "val",
            "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]


def test_an_untouched_checkpoint_and_export_pass_every_check(tmp_path, model, capsys):
    """The control: what the other tests tamper with exports, verifies and starts a run."""
    ckpt = make_checkpoint(tmp_path, model)
    assert main(["checkpoints", "verify", str(ckpt.parent)]) == 0
    assert main(export_cli(ckpt, tmp_path / "out" / "model.pt")) == 0
    _, exported_card = retrieval.load_exported(tmp_path / "out" / "model.pt")
    assert exported_card.sha256 is not None and exported_card.epoch == 1
    checkpoints.check_init_from(ModelConfig(crossmodal_heads=True, init_from=tmp_path / "out" / "model.pt"))
    checkpoints.check_init_from(ModelConfig(crossmodal_heads=True, init_from=ckpt))
    assert "wrote" in capsys.readouterr().out


# ------------------------------------------------------------------ links leading outside

def test_a_checkpoint_file_linked_outside_is_refused_naming_it_before_torch_load(
        tmp_path, model, capsys, loads, no_ray, tiny_dataset):
    ckpt = make_checkpoint(tmp_path, model)
    (ckpt / MODEL_STATES).unlink()
    (ckpt / MODEL_STATES).symlink_to(passwd(tmp_path))
    resummed(ckpt)  # its checksum matches what it leads to: only the link gives it away
    named = f"{MODEL_STATES}: leads to {tmp_path}/etc/passwd, outside {ckpt}"
    assert checkpoints.verify_checkpoint(ckpt) == [named]
    assert main(["checkpoints", "verify", str(ckpt)]) == 1
    assert named in capsys.readouterr().out
    assert main(export_cli(ckpt, tmp_path / "out" / "model.pt")) == 2
    assert named in capsys.readouterr().err
    assert main(evaluate_cli(ckpt, tiny_dataset, tmp_path)) == 2
    assert named in capsys.readouterr().err
    with pytest.raises(ConfigError, match=f"model.init_from: .*{named}"):
        checkpoints.check_init_from(ModelConfig(crossmodal_heads=True, init_from=ckpt))
    with pytest.raises(UnsafeCheckpointError, match=named):  # what restore runs on every rank before loading
        checkpoints.verify_checkpoint_files(ckpt)
    run = storage.Location.of(ckpt.parent)
    with pytest.raises(RuntimeError) as err:
        checkpoints.resume_point(run, registered_through=ckpt.name)
    assert f"registered {ckpt.name}" in str(err.value)  # the checkpoint Ray Train's record names
    assert not (tmp_path / "out").exists() and loads == []


def test_a_linked_folder_leading_outside_and_a_loop_of_links_are_refused(tmp_path, model, loads):
    ckpt = make_checkpoint(tmp_path, model)
    (ckpt / "extra").symlink_to(passwd(tmp_path).parent, target_is_directory=True)
    (ckpt / "a").symlink_to(ckpt / "b")
    (ckpt / "b").symlink_to(ckpt / "a")
    assert sorted(checkpoints.verify_checkpoint(ckpt)) == [
        "a: a loop of links", "b: a loop of links", f"extra: leads to {tmp_path}/etc, outside {ckpt}"]
    assert loads == []


def test_an_export_file_linked_outside_is_refused_naming_it_before_torch_load(tmp_path, model, loads):
    weights = make_export(tmp_path, model)
    outside = tmp_path / "elsewhere" / "model.pt"
    outside.parent.mkdir()
    weights.rename(outside)
    weights.symlink_to(outside)  # the card's checksum still matches: only the link gives it away
    named = f"model.pt: leads to {outside}, outside {weights.parent}"
    with pytest.raises(UnsafeCheckpointError, match=named):  # what evaluate --run-id and export --register load
        retrieval.load_exported(weights)
    # model.init_from follows a link it is given to the export beside the link's target
    # (tests/test_init_from.py): the card here does not vouch for the weights there
    beside_target = f"model.init_from: {weights} leads to {outside}: {outside}: no model card"
    with pytest.raises(ConfigError, match=beside_target):
        checkpoints.check_init_from(ModelConfig(crossmodal_heads=True, init_from=weights))
    with pytest.raises(ValueError, match=f"{outside}: no model card"):  # what each worker loads with model.init_from
        checkpoints.initial_state(weights)
    assert loads == []


# ------------------------------------------------------------------ model cards

def test_a_card_that_is_not_json_is_named_by_list_verify_and_export(tmp_path, model, capsys, loads):
    ckpt = make_checkpoint(tmp_path, model)
    (ckpt / checkpoints.CARD_FILE).write_text('{"model": {"arch": "pairsim-tiny"}, "epo')  # cut short
    resummed(ckpt)
    named = f"{ckpt / checkpoints.CARD_FILE}: not JSON (Unterminated string"
    assert main(["checkpoints", "list", str(ckpt.parent)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{ckpt.name}  epoch ?  step ?") and named in out
    assert main(["checkpoints", "verify", str(ckpt.parent)]) == 1
    assert named in capsys.readouterr().out
    assert main(export_cli(ckpt, tmp_path / "out" / "model.pt")) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert loads == []


@pytest.mark.parametrize("content, problem", [
    ("[1, 2]", "<root>: Input should be a valid dictionary"),
    ('"' + "x" * MAX_METADATA_BYTES + '"', f"larger than {MAX_METADATA_BYTES:,} bytes"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_a_card_of_another_shape_or_size_is_refused_naming_the_file(tmp_path, model, capsys, loads, content, problem):
    ckpt = make_checkpoint(tmp_path, model)
    (ckpt / checkpoints.CARD_FILE).write_text(content)
    resummed(ckpt)
    assert main(["checkpoints", "verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert str(ckpt / checkpoints.CARD_FILE) in out and problem in out
    assert main(export_cli(ckpt, tmp_path / "out" / "model.pt")) == 2
    assert problem in capsys.readouterr().err and loads == []


@pytest.mark.parametrize("change, problem", [
    ({"zero_stage": "0"}, "zero_stage: Input should be a valid integer (got '0')"),
    ({"fused": 1}, "fused: Input should be a valid boolean (got 1)"),
    ({"val": {"val/rsum": "101"}}, "val.val/rsum: Input should be a valid number (got '101')"),
    ({"model": {"arch": "pairsim-tiny", "crossmodal_heads": "yes"}}, "model.crossmodal_heads: Input should be a valid "
                                                                     "boolean (got 'yes')"),
    ({"epochs": 1}, "epochs: unknown key"),
])
def test_a_card_with_a_wrong_field_and_a_matching_checksum_fails_verify_and_export(
        tmp_path, model, capsys, loads, change, problem):
    ckpt = make_checkpoint(tmp_path, model)
    edited = json.loads((ckpt / checkpoints.CARD_FILE).read_text()) | change
    (ckpt / checkpoints.CARD_FILE).write_text(json.dumps(edited))
    resummed(ckpt)
    assert main(["checkpoints", "verify", str(ckpt.parent)]) == 1
    out = capsys.readouterr().out
    assert f"{ckpt / checkpoints.CARD_FILE}" in out and problem in out
    assert "1 of the checkpoints failed" in out
    assert main(export_cli(ckpt, tmp_path / "out" / "model.pt")) == 2
    err = capsys.readouterr().err
    assert problem in err and "Traceback" not in err and not (tmp_path / "out").exists()
    assert loads == []


def test_a_missing_card_field_is_named(tmp_path, model, capsys):
    ckpt = make_checkpoint(tmp_path, model)
    edited = json.loads((ckpt / checkpoints.CARD_FILE).read_text())
    del edited["zero_stage"]
    (ckpt / checkpoints.CARD_FILE).write_text(json.dumps(edited))
    resummed(ckpt)
    assert main(["checkpoints", "verify", str(ckpt)]) == 1
    assert "zero_stage: Field required" in capsys.readouterr().out


def test_an_export_card_with_a_wrong_field_is_refused_naming_it(tmp_path, model, loads):
    weights = make_export(tmp_path, model)
    card_file = weights.with_suffix(".json")
    card_file.write_text(json.dumps(json.loads(card_file.read_text()) | {"unimodal_heads": "no"}))
    with pytest.raises(UnsafeCheckpointError) as err:
        retrieval.load_exported(weights)
    assert str(card_file) in str(err.value) and "\n  unimodal_heads:" in str(err.value)  # the card, the field
    with pytest.raises(ConfigError) as err:
        checkpoints.check_init_from(ModelConfig(crossmodal_heads=True, init_from=weights))
    assert err.value.keys == ("model.init_from",) and str(card_file) in str(err.value)
    assert "\n  unimodal_heads:" in str(err.value)
    assert loads == []


# ------------------------------------------------------------------ altered weights

def altered(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def test_an_altered_checkpoint_file_is_refused_by_export_and_evaluate_before_torch_load(
        tmp_path, model, capsys, loads, no_ray, tiny_dataset):
    ckpt = make_checkpoint(tmp_path, model)
    altered(ckpt / MODEL_STATES)
    named = f"{MODEL_STATES}: content differs from its checksum"
    assert main(export_cli(ckpt, tmp_path / "out" / "model.pt")) == 2
    assert named in capsys.readouterr().err
    assert main(evaluate_cli(ckpt, tiny_dataset, tmp_path)) == 2
    assert named in capsys.readouterr().err
    assert loads == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("part", ["model.pt", "model.heads.pt"])
def test_an_altered_export_file_is_refused_by_init_from_and_evaluate_before_torch_load(tmp_path, model, loads, part):
    weights = make_export(tmp_path, model)
    torch.manual_seed(1)
    other = make_export(tmp_path / "other", retrieval.create_retrieval_model(ModelConfig(crossmodal_heads=True)))
    (weights.parent / part).write_bytes((other.parent / part).read_bytes())  # a whole, loadable file, not the one summed
    named = f"{part}: content differs from its checksum"
    with pytest.raises(ConfigError, match=f"model.init_from: .*{named}"):
        checkpoints.check_init_from(ModelConfig(crossmodal_heads=True, init_from=weights))
    with pytest.raises(UnsafeCheckpointError, match=named):
        checkpoints.initial_state(weights)
    with pytest.raises(UnsafeCheckpointError, match=named):
        retrieval.load_exported(weights)
    assert loads == []


def test_a_heads_file_the_export_card_does_not_sum_is_refused(tmp_path, model, loads):
    weights = make_export(tmp_path, model)
    card_file = weights.with_suffix(".json")
    edited = json.loads(card_file.read_text())
    edited["sha256"]["heads"] = None
    card_file.write_text(json.dumps(edited))
    with pytest.raises(UnsafeCheckpointError) as err:
        retrieval.load_exported(weights)
    assert "model.heads.pt:" in str(err.value) and "checksum" in str(err.value)  # the file, what it lacks
    assert loads == []


def test_an_export_written_before_cards_held_checksums_still_loads(tmp_path, model):
    weights = make_export(tmp_path, model)
    card_file = weights.with_suffix(".json")
    card_file.write_text(json.dumps({k: v for k, v in json.loads(card_file.read_text()).items() if k != "sha256"}))
    loaded, loaded_card = retrieval.load_exported(weights)
    assert loaded_card.sha256 is None
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key], rtol=0, atol=0, msg=key)


def test_a_run_trained_in_process_keeps_the_latest_and_its_two_best_checkpoints(tmp_path, model):
    """:func:`checkpoints.keep_checkpoint`, for a run trained in the calling process (a warm sweep
    trial), does what Ray Train's ``CheckpointConfig(num_to_keep=2)`` does for the others: each
    checkpoint is copied in under a Ray Train name, then the two best by the val metric and the
    latest stay, with no partial copy left behind."""
    (tmp_path / "run").mkdir()
    run, keeping = storage.Location.of(tmp_path / "run"), checkpoints.Keeping("val/rsum", "max", 2)
    kept = []
    for rsum in (100.0, 120.0, 90.0, 110.0, 80.0):
        source = tmp_path / f"saved-{rsum}"
        source.mkdir()
        (source / checkpoints.CARD_FILE).write_text(
            card(model).model_copy(update={"val": {"val/rsum": rsum}}).model_dump_json())
        kept.append(checkpoints.keep_checkpoint(source, run, keeping))
    assert [c.name for c in checkpoints.checkpoints_in(run)] == [kept[4].name, kept[3].name, kept[1].name]
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")] == []
