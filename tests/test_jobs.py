"""What a run needs as a Ray job, short of a cluster (``test_job_submit.py`` has the cluster):
local paths in the config resolve against the working directory and are refused before Ray
starts when they point nowhere."""

import pytest

from pairsim.config import ConfigError, load_config
from pairsim.train import driver


def test_local_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.pt").write_bytes(b"")
    cfg = load_config(None, ["data.path=shapes", "ray.storage_path=s3://bucket/runs", "model.pretrained=weights.pt"]
                      ).with_absolute_paths()
    assert cfg.data.path == tmp_path / "shapes"
    assert cfg.model.pretrained == str(tmp_path / "weights.pt")
    assert load_config(None, ["model.pretrained=openai"]).with_absolute_paths().model.pretrained == "openai"  # a tag
    assert load_config().with_absolute_paths().ray.storage_path == tmp_path / "ray_results"  # the default too


def test_paths_that_point_nowhere_are_refused_naming_the_key_and_where_they_resolved(tmp_path, monkeypatch,
                                                                                     tiny_dataset):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=f"config file not found: run.yaml .*: {tmp_path / 'run.yaml'}"):
        load_config("run.yaml")
    refusals = {
        "data.path=nowhere": f"data.path: no dataset at {tmp_path / 'nowhere'}",
        "ray.storage_path=afile/runs": f"ray.storage_path: {tmp_path / 'afile/runs'}: cannot be created or written "
                                       f"\\({tmp_path / 'afile'} is a file\\)",
        "model.pretrained=w/model.pt": f"model.pretrained: 'w/model.pt' is neither a file \\(there is none at "
                                       f"{tmp_path / 'w/model.pt'}\\)",
    }
    for override, message in refusals.items():
        cfg = load_config(None, [f"data.path={tiny_dataset}", override]).with_absolute_paths()
        with pytest.raises(ConfigError, match=message):
            driver.check_ready(cfg)
