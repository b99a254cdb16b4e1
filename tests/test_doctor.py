"""``pairsim doctor`` on this machine: what it reports, and that it exits 1 exactly when the run
config asks for something the machine cannot run."""

import re
import shutil
from importlib import metadata

import pytest
import torch

from pairsim import cli, compat, doctor
from pairsim.config import ConfigError, load_config
from pairsim.train import driver, engine


def run_doctor(capsys, *overrides: str) -> tuple[int, str]:
    code = cli.main(["doctor", *[arg for key in overrides for arg in ("--set", key)]])
    return code, capsys.readouterr().out


def test_reports_the_machine_and_passes_a_config_it_can_run(capsys, tmp_path):
    code, out = run_doctor(capsys, f"ray.storage_path={tmp_path / 'runs'}")
    assert code == 0, out
    assert f"torch {metadata.version('torch')}, open_clip_torch " in out
    assert re.search(rf"^· ray +{re.escape(metadata.version('ray'))}, within the tested range ray>=", out, re.M), out
    assert f"{tmp_path / 'runs'}: " in out and "GiB free" in out
    assert "one run takes 4 CPUs (2 workers × 1 + ray.data_cpus 2)" in out
    assert "✗" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_gpus_asked_for_and_not_there_fail_it(capsys):
    code, out = run_doctor(capsys, "train.use_gpu=true")
    assert code == 1
    assert "✗ GPUs" in out and "train.use_gpu=true cannot run" in out and "and 2 GPUs, NCCL" in out


def test_storage_it_cannot_write_fails_it(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out = run_doctor(capsys, f"ray.storage_path={blocker / 'runs'}")
    assert code == 1
    assert "✗ ray.storage_path" in out and f"({blocker} is a file)" in out


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """This machine as one without nvcc (an empty PATH, torch finding no CUDA_HOME)."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("fused_adam"):
        pytest.skip("this DeepSpeed carries FusedAdam pre-built: no compiler is needed")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", None)
    assert shutil.which("nvcc") is None


def test_deepspeed_ops_without_a_compiler_are_refused_before_launch(no_compiler, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local instance: the check runs on this machine
    cfg = load_config(None, ["train.use_gpu=true", "optim.impl=deepspeed"])
    problem = engine.deepspeed_ops_problem()
    assert problem and "no nvcc" in problem and "optim.impl=torch" in problem
    with pytest.raises(ConfigError, match="no nvcc on PATH"):
        driver.plan_run(cfg)
    findings = {f.topic: f for f in doctor.compiler(cfg)}
    assert findings["optimizer"].blocking and "no nvcc" in findings["optimizer"].detail
    assert not {f.topic: f for f in doctor.compiler(load_config(None, ["train.use_gpu=true"]))}["optimizer"].blocking


def test_the_arch_list_deepspeed_would_choke_on_is_reported(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    findings = {f.topic: f for f in doctor.compiler(load_config(None))}
    assert findings["TORCH_CUDA_ARCH_LIST"].detail == "9.0a (DeepSpeed ops get '9.0')"


def test_compile_without_a_c_compiler_is_reported_blocking(monkeypatch, tmp_path):
    """``train.compile`` needs the C compiler Inductor builds with: named where there is one,
    blocking where there is none; without ``train.compile`` nothing is said."""
    assert "train.compile" not in {f.topic for f in doctor.compiler(load_config(None))}
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    finding = {f.topic: f for f in doctor.compiler(load_config(None, ["train.compile=true"]))}["train.compile"]
    assert finding.blocking and "no C compiler" in finding.detail
    (tmp_path / "cc").write_text("#!/bin/sh\n")
    (tmp_path / "cc").chmod(0o755)
    finding = {f.topic: f for f in doctor.compiler(load_config(None, ["train.compile=true"]))}["train.compile"]
    assert not finding.blocking and str(tmp_path / "cc") in finding.detail


def test_ray_deepspeed_mlflow_and_torch_are_reported_against_their_tested_ranges(capsys, tmp_path):
    code, out = run_doctor(capsys, f"ray.storage_path={tmp_path / 'runs'}")
    assert code == 0, out
    for name, tested in zip(("ray", "deepspeed", "mlflow", "torch"), compat.TESTED_RANGES):
        line = next(line for line in out.splitlines() if line.split()[:2] == ["·", name])
        assert line.endswith(f"{metadata.version(name)}, within the tested range {tested}"), line
    assert "!" not in {line[0] for line in out.splitlines()}


def test_a_version_outside_the_tested_range_is_a_warning_not_a_failure(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(compat, "TESTED_RANGES", ("ray<2.0", *compat.TESTED_RANGES[1:]))
    findings = {f.topic: f for f in doctor.tested_versions()}
    assert findings["ray"].warning and not findings["ray"].blocking and not findings["mlflow"].warning
    code, out = run_doctor(capsys, f"ray.storage_path={tmp_path / 'runs'}")
    assert code == 0, out
    assert "! ray  " in out and f"{metadata.version('ray')}, outside the tested range ray<2.0" in out
