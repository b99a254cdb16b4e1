"""The one writer (:mod:`pairsim.outputs`) and the one error boundary (:func:`pairsim.cli.main`),
as a careless or hostile user meets them (issue 51): a writer refuses what it does not own
before any work and leaves no stale file; every command maps bad input to one line and exit 2."""

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict

from pairsim import cli, locks, untrusted
from pairsim.data import shards, synth
from pairsim.data.builder import BUILD_LOCK
from pairsim.errors import shown
from pairsim.outputs import Marker, OutputRefused, check_file_target, claim_directory
from pairsim.storage import Location, NotARegularFile
from pairsim.untrusted import UntrustedFileError

SMALL = ["--num-train", "12", "--num-val", "4", "--num-test", "0", "--rows-per-shard", "5"]


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_line_failure(capsys, status: int, expected: int) -> str:
    err = capsys.readouterr().err
    assert status == expected, err
    assert err.startswith("pairsim: ") and "Traceback" not in err, err
    return err


def test_synth_refuses_a_directory_of_someone_elses_files(tmp_path, capsys):
    out = tmp_path / "d"
    (out / "train").mkdir(parents=True)
    (out / "train" / "part-00000.parquet").write_text("the user's own table")
    before = tree_digest(out)
    err = one_line_failure(capsys, cli.main(["data", "synth", "--out", str(out), *SMALL]), 2)
    assert "part-00000.parquet" in err
    assert tree_digest(out) == before


def test_synth_refuses_to_replace_a_dataset_built_from_another_source(tmp_path, capsys):
    out = tmp_path / "csv-built"
    synth.generate(tmp_path / "shapes", num_train=5, num_val=0, num_test=0, progress=False)
    (out / "train").mkdir(parents=True)
    (out / "train" / "part-00000.parquet").write_bytes((tmp_path / "shapes/train/part-00000.parquet").read_bytes())
    shards.write_manifest(out, "csv:pairs.csv", {"train": {"images": 5, "captions": 25, "shards": 1}})
    before = tree_digest(out)
    one_line_failure(capsys, cli.main(["data", "synth", "--out", str(out), *SMALL]), 2)
    assert tree_digest(out) == before


def test_a_smaller_second_synth_leaves_no_stale_shard(tmp_path, capsys):
    out = tmp_path / "d"
    assert cli.main(["data", "synth", "--out", str(out), "--num-train", "30", "--num-val", "10", "--num-test", "0",
                     "--rows-per-shard", "5"]) == 0
    assert len(list((out / "train").glob("*.parquet"))) == 6
    assert cli.main(["data", "synth", "--out", str(out), *SMALL]) == 0
    assert sorted(p.name for p in (out / "train").glob("*.parquet")) == [shards.shard_name(i) for i in range(3)]
    assert cli.main(["shards", "verify", str(out)]) == 0
    assert shards.read_manifest(out).splits["train"].images == 12
    user_file = out / "train" / "notes.txt"  # not a shard: a replacement leaves it
    user_file.write_text("mine")
    assert cli.main(["data", "synth", "--out", str(out), *SMALL]) == 0
    assert user_file.read_text() == "mine"


@pytest.mark.parametrize("target", ["/dev/null", "file", "link"])
def test_synth_refuses_a_device_a_file_or_a_link_where_its_directory_goes(tmp_path, capsys, target):
    path = {"/dev/null": Path("/dev/null"), "file": tmp_path / "file", "link": tmp_path / "link"}[target]
    if target == "file":
        path.write_text("keep")
    if target == "link":
        path.symlink_to(tmp_path / "file-elsewhere")
        (tmp_path / "file-elsewhere").write_text("keep")
    before = tree_digest(tmp_path)
    one_line_failure(capsys, cli.main(["data", "synth", "--out", str(path), *SMALL]), 2)
    assert tree_digest(tmp_path) == before
    assert not Path("/dev/null.json").exists()


def test_a_second_writer_is_refused_while_the_first_holds_the_output(tmp_path, capsys):
    out = tmp_path / "d"
    synth.generate(out, num_train=5, num_val=0, num_test=0, progress=False)
    before = tree_digest(out)
    with locks.hold(out / BUILD_LOCK, "the first writer"):
        one_line_failure(capsys, cli.main(["data", "synth", "--out", str(out), *SMALL]), 2)
        assert {k: v for k, v in tree_digest(out).items() if k != BUILD_LOCK} == before


class MarkCard(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    made_by: Literal["pairsim-test"]


MARK = Marker("mark", MarkCard)


def test_claim_directory_tells_owned_from_foreign(tmp_path):
    assert claim_directory(tmp_path / "new", "--out", [MARK]).path == str(tmp_path / "new")
    (tmp_path / "lock-only").mkdir()
    (tmp_path / "lock-only" / "x.lock").write_text("{}")
    claim_directory(tmp_path / "lock-only", "--out", [MARK], ignored=["x.lock"])  # empty but for a lock
    (tmp_path / "lock-only" / "data.bin").write_text("foreign")
    with pytest.raises(OutputRefused, match="data.bin"):  # a lock proves nothing about the rest
        claim_directory(tmp_path / "lock-only", "--out", [MARK], ignored=["x.lock"])
    (tmp_path / "lock-only" / "mark").write_text('{"made_by": "pairsim-test"}')
    claim_directory(tmp_path / "lock-only", "--out", [MARK])


@pytest.mark.parametrize("content", ["{}", '{"made_by": "someone"}', "not json", '{"made_by": "pairsim-test", '
                                     '"made_by": "pairsim-test"}', "link"])
def test_a_marker_named_right_that_is_not_the_card_proves_nothing(tmp_path, content):
    out = tmp_path / "out"
    out.mkdir()
    (out / "users-file.txt").write_text("mine")
    if content == "link":  # a link to a real card elsewhere
        (tmp_path / "real-mark").write_text('{"made_by": "pairsim-test"}')
        (out / "mark").symlink_to(tmp_path / "real-mark")
    else:
        (out / "mark").write_text(content)
    with pytest.raises(OutputRefused, match="not one pairsim wrote") as refused:
        claim_directory(out, "--out", [MARK])
    assert "mark" in str(refused.value)


def test_an_output_directory_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "real")
    with pytest.raises(OutputRefused, match="symbolic link"):
        claim_directory(tmp_path / "out", "--out", [MARK])


def test_check_file_target_refuses_all_but_a_new_or_owned_file(tmp_path):
    assert check_file_target(tmp_path / "new.pt", "--out") == tmp_path / "new.pt"
    (tmp_path / "old.pt").write_text("x")
    with pytest.raises(OutputRefused, match="did not write"):
        check_file_target(tmp_path / "old.pt", "--out")
    assert check_file_target(tmp_path / "old.pt", "--out", owned=True)
    (tmp_path / "link.pt").symlink_to(tmp_path / "old.pt")
    for path, kind in ((tmp_path, "a directory"), (Path("/dev/null"), "a character device"),
                       (tmp_path / "link.pt", "a symbolic link")):
        with pytest.raises(OutputRefused, match=kind):
            check_file_target(path, "--out", owned=True)
    with pytest.raises(OutputRefused, match="under-a-file.pt"):
        check_file_target(tmp_path / "old.pt" / "under-a-file.pt", "--out")


@pytest.mark.parametrize("value", ['!!python/object/apply:os.system ["touch TMP/pwned"]', "[&a 1, *a]", "\x1b",
                                  "{a: 1, a: 2}", "[" * 200, "\x00"])
def test_yaml_in_a_set_value_is_refused_in_one_line(tmp_path, capsys, value):
    status = cli.main(["train", "--set", f"train.epochs={value.replace('TMP', str(tmp_path))}", "--config",
                       str(cli.DEMO_CONFIG)])
    err = one_line_failure(capsys, status, 2)
    assert "train.epochs" in err
    assert not (tmp_path / "pwned").exists()


def test_bad_input_exits_2_in_every_command(tmp_path, capsys):
    missing = tmp_path / "missing"
    (tmp_path / "config.yaml").write_text("train: {epochs: 1}\n")
    commands = [
        ["train", "--config", str(missing / "run.yaml")],
        ["tune", "--space", str(missing / "sweep.yaml")],
        ["doctor", "--config", str(tmp_path / "config.yaml"), "--set", "train.epochs=-1"],
        ["shards", "inspect", str(missing)],
        ["shards", "verify", str(missing)],
        ["data", "synth", "--out", str(tmp_path / "d"), "--num-train", "0", "--num-val", "0", "--num-test", "0"],
        ["export", "--checkpoint", str(missing), "--out", str(tmp_path / "m.pt")],
        ["evaluate", "--checkpoint", str(missing), "--data", str(missing)],
        ["checkpoints", "verify", str(missing)],
        ["extract-teacher", "--config", str(missing / "run.yaml"), "--out", str(tmp_path / "t")],
    ]
    for command in commands:
        one_line_failure(capsys, cli.main(command), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(OutputRefused):
        cli.main(["--debug", "data", "synth", "--out", "/dev/null"])


def test_synth_marks_its_output_before_writing_a_shard(tmp_path):
    out = tmp_path / "d"
    synth.generate(out, num_train=3, num_val=0, num_test=0, progress=False, seed=7)
    assert json.loads((out / synth.MARKER).read_text())["seed"] == 7
    assert not (out / BUILD_LOCK).exists()


@pytest.mark.parametrize("line", ["not json", "[1, 2]", '{"kind": 3}', '{"kind": ' * 5000])
def test_a_garbled_rejects_file_is_refused_in_one_line(tmp_path, capsys, line):
    data = tmp_path / "d"
    synth.generate(data, num_train=4, num_val=0, num_test=0, progress=False)
    manifest = json.loads((data / shards.MANIFEST).read_text())
    (data / shards.MANIFEST).write_text(json.dumps(manifest | {"rejected": 1}))
    (data / shards.REJECTS).write_text(line + "\n")
    err = one_line_failure(capsys, cli.main(["shards", "inspect", str(data)]), 2)
    assert shards.REJECTS in err


def test_inspect_never_replaces_a_file_with_its_contact_sheet(tmp_path, capsys):
    data = tmp_path / "d"
    synth.generate(data, num_train=4, num_val=0, num_test=0, progress=False)
    (tmp_path / "photo.png").write_bytes(b"the user's photo")
    one_line_failure(capsys, cli.main(["shards", "inspect", str(data), "--sheet", str(tmp_path / "photo.png")]), 2)
    assert (tmp_path / "photo.png").read_bytes() == b"the user's photo"
    assert cli.main(["shards", "inspect", str(data), "--sheet", str(tmp_path / "sheet.png")]) == 0
    assert (tmp_path / "sheet.png").read_bytes().startswith(b"\x89PNG")


def test_extract_teacher_refuses_a_foreign_output_before_ray(tmp_path, capsys, monkeypatch):
    from pairsim import cluster

    monkeypatch.setattr(cluster, "init_ray", lambda *a, **k: pytest.fail("Ray was started before the refusal"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    status = cli.main(["extract-teacher", "--config", str(cli.OBJECTIVES / "cusa_paper.yaml"),
                       "--out", str(tmp_path / "out")])
    assert "keep.txt" in one_line_failure(capsys, status, 2)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("content", ["[]", '{"data_content_hash": 1, "splits": "train", "teachers": {}}', "{" * 10_000])
def test_a_garbled_teacher_store_manifest_is_one_config_error(tmp_path, content):
    from pairsim.config import ConfigError
    from pairsim.teachers import store

    (tmp_path / store.STORE_MANIFEST).write_text(content)
    with pytest.raises(ConfigError, match=store.STORE_MANIFEST):
        store.TeacherStore(tmp_path).manifest()


@pytest.mark.parametrize("command", [["export", "--out", "m.pt"], ["evaluate", "--data", "d"]])
def test_a_model_from_an_unreachable_mlflow_server_is_refused_in_seconds(tmp_path, capsys, monkeypatch, command):
    from conftest import unused_port

    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    status = cli.main([*command, "--run-id", "0123abcd", "--tracking-uri", f"http://127.0.0.1:{unused_port()}"])
    assert "no MLflow server answers" in one_line_failure(capsys, status, 2)
    assert time.monotonic() - started < 60  # MLflow's own client retries for minutes
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the one reader of a user-named path (issue 78)

@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_pipe_device_or_directory_is_refused_unread_and_without_blocking(tmp_path, kind):
    path = {"fifo": tmp_path / "pipe", "directory": tmp_path, "device": Path("/dev/zero")}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes to it: a blocking open would wait for ever
    with pytest.raises(UntrustedFileError, match="not a regular file"):
        Location.of(path).read_bounded(1 << 20, UntrustedFileError, "too big")
    with pytest.raises(NotARegularFile):
        untrusted.sha256(path)


@pytest.mark.parametrize("recorded", [10**15, 2**63 - 1])
def test_a_read_bound_taken_from_a_file_is_capped_by_the_file(tmp_path, recorded):
    path = tmp_path / "small.bin"
    path.write_bytes(b"x" * 100)  # a card may record any size: the read allocates what the file holds
    assert Location.of(path).read_bounded(recorded, UntrustedFileError, "too big") == b"x" * 100
    with pytest.raises(UntrustedFileError, match="larger than 99 bytes"):
        Location.of(path).read_bounded(99, UntrustedFileError, "too big")


def test_a_key_twice_in_a_file_read_back_is_refused(tmp_path):
    path = tmp_path / "card.json"
    path.write_text('{"a": 1, "b": {"c": 1, "c": 2}}')  # the second c would replace the first unseen
    with pytest.raises(UntrustedFileError, match="'c' appears twice"):
        untrusted.read_json(path, 1 << 20)
    path.write_text('{"c": 1}\n{"c": 1, "c": 2}\n')
    with pytest.raises(UntrustedFileError, match="line 2"):
        untrusted.read_json_lines(path, dict[str, int], 1 << 20)


def test_text_from_a_users_file_is_shown_cut_and_escaped():
    assert shown("a\nb\x1b[2J\rc\x00") == "a\\nb\\x1b[2J\\rc\\x00"  # no line, no terminal escape
    assert shown("ü" * 10, 4) == "üüüü… (6 more)"
    assert shown("plain words") == "plain words"


@pytest.mark.parametrize("argv", [["data", "synth", "--out", "d", "--image-size", "100000"],
                                  ["data", "synth", "--out", "d", "--num-train", "99999999999999999999"],
                                  ["evaluate", "--checkpoint", "c", "--data", "d", "--split", "../x"],
                                  ["embed", "--model", "m.pt", "--data", "d", "--out", "e", "--split", "a\nb"],
                                  ["export", "--run-id", "../../etc", "--out", "m.pt"],
                                  ["export", "--checkpoint", "c", "--out", "m.pt", "--register", "a/b"]])
def test_a_bound_or_a_name_is_checked_by_the_flag_before_any_work(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as refused:  # argparse's usage error
        cli.main(argv)
    assert refused.value.code == 2 and argv[-2] in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_synth_draws_no_image_larger_nor_more_images_than_its_bounds(tmp_path):
    with pytest.raises(synth.SynthError, match="1024"):
        synth.generate(tmp_path / "d", num_train=1, num_val=0, num_test=0, image_size=synth.MAX_IMAGE_SIZE + 1)
    with pytest.raises(synth.SynthError, match="num_train=10,000,001"):
        synth.generate(tmp_path / "d", num_train=synth.MAX_SPLIT_IMAGES + 1, num_val=0, num_test=0)
    assert not (tmp_path / "d").exists()
