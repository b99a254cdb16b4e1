"""pairsim's logging: one ``pairsim.*`` hierarchy whose level the user sets."""

import logging

import pytest

from pairsim import log
from pairsim.cli import main


@pytest.fixture(autouse=True)
def restore_level():
    root = logging.getLogger("pairsim")
    level = root.level
    yield
    root.setLevel(level)


def test_level_from_flag_else_environment_else_info(monkeypatch):
    monkeypatch.delenv(log.ENV_VAR, raising=False)
    assert log.setup() == "INFO"
    monkeypatch.setenv(log.ENV_VAR, "warning")
    assert log.setup() == "WARNING"
    assert log.setup("debug") == "DEBUG"
    assert logging.getLogger("pairsim").getEffectiveLevel() == logging.DEBUG
    log.setup()
    assert len([h for h in logging.getLogger("pairsim").handlers if getattr(h, "_pairsim", False)]) == 1


def test_messages_below_the_level_are_dropped(capfd):
    log.setup("WARNING")
    log.get_logger("data").info("an info line")
    log.get_logger("data").warning("a warning line")
    err = capfd.readouterr().err
    assert "[pairsim.data] a warning line" in err and "an info line" not in err


def test_cli_takes_the_level_and_refuses_a_bad_one(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv(log.ENV_VAR, "loud")
    assert main(["data", "synth", "--out", str(tmp_path / "d"), "--num-train", "4", "--num-val", "2",
                 "--num-test", "0"]) == 2
    assert "log level 'LOUD'" in capfd.readouterr().err
    monkeypatch.delenv(log.ENV_VAR)
    assert main(["--log-level", "error", "data", "synth", "--out", str(tmp_path / "d"), "--num-train", "4",
                 "--num-val", "2", "--num-test", "0"]) == 0
    assert logging.getLogger("pairsim").level == logging.ERROR
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "chatty", "data", "synth", "--out", str(tmp_path / "e")])
    assert exit_info.value.code == 2


def test_durations_and_the_training_eta_read_as_a_person_would():
    from pairsim.log import duration
    from pairsim.train.hooks import progress_eta

    assert (duration(7.4), duration(247), duration(3900)) == ("0m07s", "4m07s", "1h05m")
    assert progress_eta(100, 64, 640.0) == "ETA 0m10s of training (+ validation)"  # 100 steps × 64 / 640 per s
    assert progress_eta(0, 64, 640.0) == "ETA 0m00s of training (+ validation)"
    assert progress_eta(5, 64, 0.0) == "ETA unknown"


def test_known_third_party_warnings_are_quieted_and_others_are_not():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.setup()
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single` instead.", FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]
