"""pairsim.compat, the one boundary with Ray's, DeepSpeed's, MLflow's and torch's internals: each shim
against the installed packages, and the versions each was tested on. DeepSpeed's Muon import and
its optimizers' master weights are tested through the engine (``tests/test_deepspeed_config.py``,
``tests/test_temperature.py``)."""

import json
import logging
import signal
import subprocess
import sys
from importlib import metadata

import pytest
import torch
from packaging.requirements import Requirement

from pairsim import compat, storage
from pairsim.signals import JobStopped
from pairsim.train import checkpoints


@pytest.mark.parametrize("shim", [compat.ray, compat.deepspeed, compat.mlflow, compat.torch], ids=lambda m: m.__name__)
def test_each_shims_tested_range_parses_and_holds_the_installed_version(shim):
    requirement = Requirement(shim.TESTED)
    assert requirement.name == shim.__name__.rsplit(".", 1)[1] and shim.TESTED in compat.TESTED_RANGES
    assert requirement.specifier.contains(metadata.version(requirement.name), prereleases=True)


def test_the_version_report_names_each_distribution_its_version_and_range(monkeypatch):
    assert compat.version_report() == [
        compat.VersionCheck(name, metadata.version(name), tested, True)
        for name, tested in zip(("ray", "deepspeed", "mlflow", "torch"), compat.TESTED_RANGES)]
    monkeypatch.setattr(compat, "TESTED_RANGES", ("ray<2", "pairsim-no-such-distribution>=1"))
    assert compat.version_report() == [compat.VersionCheck("ray", metadata.version("ray"), "ray<2", False),
                                       compat.VersionCheck("pairsim-no-such-distribution", None,
                                                           "pairsim-no-such-distribution>=1", False)]


def test_importing_pairsim_compat_imports_none_of_the_packages_it_wraps():
    code = ("import sys, pairsim.compat; "
            "print(sorted(m for m in ('ray', 'deepspeed', 'mlflow', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split()[-1] == "[]", done.stdout


def test_inner_products_through_onednn_and_through_blas_agree_with_float64(monkeypatch):
    """Both of the shim's paths give queries @ keys.T to float32 rounding (keys a strided row
    slice, as the blocked search passes them); the BLAS path (a GPU's, or a torch without oneDNN)
    writes into the given buffer."""
    g = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(37, 24, generator=g), torch.randn(300, 24, generator=g)[100:229]
    expected = (queries.double() @ keys.double().T).float()
    assert torch.backends.mkldnn.is_available()
    torch.testing.assert_close(compat.torch.inner_products(queries, keys, torch.empty(37, 129)), expected)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    out = torch.empty(37, 129)
    assert compat.torch.inner_products(queries, keys, out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, expected)


@pytest.mark.skipif(not compat.torch.native_bf16_products(torch.device("cpu")),
                    reason="this CPU has no native bfloat16 products")
def test_bf16_inner_products_round_float32_sums_of_exact_products_once():
    """The premise of pairsim's screened retrieval: each bfloat16 product is the float32 sum of
    the exact products of its bfloat16 entries (within γ = d·2⁻²⁴ of Σ|q_i·k_i|), rounded to
    bfloat16 once (within BF16_PRODUCT_ROUNDING); in a cache-sized block as in a small one, at
    scales from 10⁻¹⁸ (products near float32's subnormals, flushed: within d·2⁻¹²⁰) to 10¹⁵. Not
    on a GPU."""
    g = torch.Generator().manual_seed(0)
    u = compat.torch.BF16_PRODUCT_ROUNDING
    for n_queries, n_keys, dim, scale in ((1024, 4096, 512, 1.0), (7, 33, 5, 1e15), (64, 300, 96, 1e-18)):
        queries = (torch.randn(n_queries, dim, generator=g) * scale).bfloat16()
        keys = (torch.randn(n_keys, dim, generator=g) * scale).bfloat16()
        out = torch.empty(n_queries, n_keys)
        assert compat.torch.bf16_inner_products(queries, keys, out).data_ptr() == out.data_ptr()
        exact = queries.double() @ keys.double().T
        summed = dim * 2.0**-24 * (queries.double().abs() @ keys.double().abs().T)
        assert ((out.double() - exact).abs() <= u * (exact.abs() + summed) + summed + dim * 2.0**-120).all()
    assert compat.torch.native_bf16_products(torch.device("cpu"))
    assert not compat.torch.native_bf16_products(torch.device("cuda"))


def test_node_on_loopback_flips_rays_switch_within_the_block_only():
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    with pytest.raises(RuntimeError), compat.ray.node_on_loopback():
        assert ray_constants.ENABLE_RAY_CLUSTER is False
        raise RuntimeError
    assert ray_constants.ENABLE_RAY_CLUSTER == before


def test_a_train_record_naming_a_gone_checkpoint_is_set_aside(tmp_path, caplog):
    run = storage.Location.of(tmp_path)
    assert compat.ray.train_record_checkpoints(run) == []
    checkpoints.set_aside_stale_snapshot(run)  # no record: nothing to do
    (tmp_path / "checkpoint_2026-01-01_00-00-00.000000").mkdir()
    record = {"checkpoint_results": [{"checkpoint_dir_name": "checkpoint_2026-01-01_00-00-00.000000"},
                                     {"checkpoint_dir_name": "checkpoint_2026-01-01_00-05-00.000000"}]}
    (tmp_path / compat.ray.TRAIN_RECORD).write_text(json.dumps(record))
    assert len(compat.ray.train_record_checkpoints(run)) == 2
    with caplog.at_level(logging.WARNING, logger="pairsim"):
        checkpoints.set_aside_stale_snapshot(run)
    assert not (tmp_path / compat.ray.TRAIN_RECORD).exists()
    aside = [p.name for p in tmp_path.glob(f"{compat.ray.TRAIN_RECORD}.stale-*")]
    assert len(aside) == 1 and aside[0] in caplog.text and "checkpoint_2026-01-01_00-05-00.000000" in caplog.text


def test_ray_trains_ctrl_c_exit_leaves_fit_as_job_stopped():
    with pytest.raises(JobStopped) as stopped, compat.ray.ctrl_c_in_fit():
        sys.exit(0)  # what Train V2's SIGINT handler does once the controller is aborted
    assert stopped.value.signum == signal.SIGINT and isinstance(stopped.value.__cause__, SystemExit)
    with pytest.raises(ValueError), compat.ray.ctrl_c_in_fit():
        raise ValueError


def test_fail_fast_http_sets_mlflows_retry_settings_and_keeps_a_users(monkeypatch):
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    monkeypatch.delenv(MLFLOW_HTTP_REQUEST_MAX_RETRIES.name, raising=False)
    monkeypatch.setenv(MLFLOW_HTTP_REQUEST_TIMEOUT.name, "3")
    compat.mlflow.fail_fast_http()
    assert (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get()) == (0, 3)


def test_mlflows_dataset_hooks(tmp_path):
    from mlflow.data.filesystem_dataset_source import FileSystemDatasetSource

    source = compat.mlflow.dataset_source_class("local")(str(tmp_path))
    assert isinstance(source, FileSystemDatasetSource) and source.to_dict() == {"uri": str(tmp_path)}

    class Named(compat.mlflow.digest_given_dataset()):
        profile = schema = None

    entity = compat.mlflow.dataset_entity(Named(source, name="d", digest="abc"))
    assert (entity.name, entity.digest, entity.source_type) == ("d", "abc", "local")
    with pytest.raises(NotImplementedError):
        Named(source, name="d")


def test_the_classes_deepspeed_pickles_into_checkpoints_load(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    states = {"address": fragment_address(numel=4, start=0), "stage": ZeroStageEnum.gradients,
              "scaler": LossScaler(2.0), "dynamic": DynamicLossScaler(2.0**16, 1000, 1, 0, False)}
    torch.save(states, tmp_path / "states.pt")
    loaded = checkpoints.load_checkpoint_file(tmp_path / "states.pt")
    assert loaded["address"] == states["address"] and loaded["stage"] is ZeroStageEnum.gradients
    assert (loaded["scaler"].cur_scale, loaded["dynamic"].cur_scale) == (2.0, 2.0**16)


class HalfUsed(torch.nn.Module):
    """Two layers, the second never in the loss: its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def _steps_with_and_without_the_one_rank_allreduce(rank, world, precision):
    """HalfUsed trained 3 optimizer steps of 2 accumulated micro-batches at ZeRO-0 by DeepSpeed as
    it comes and with ``skip_one_rank_gradient_allreduce``: whether it was left out, the
    parameters, and the tensor copies of the last step under the profiler; whether it is left
    out at ZeRO-1."""
    import deepspeed

    from pairsim.compat.deepspeed import skip_one_rank_gradient_allreduce, skip_shared_memory_allreduce
    from pairsim.config import load_config
    from pairsim.train.engine import deepspeed_config, parameter_groups

    skip_shared_memory_allreduce()
    out = {}
    for stage, skip in ((0, False), (0, True), (1, True)):
        cfg = load_config(None, [f"train.zero_stage={stage}", f"train.precision={precision}", "train.micro_batch_size=4",
                                 "train.accumulate_steps=2", "optim.warmup_steps=0", "optim.weight_decay=0.1",
                                 "optim.grad_clip=1.0"])
        torch.manual_seed(0)
        model = HalfUsed()
        engine, *_ = deepspeed.initialize(model=model, config=deepspeed_config(cfg.train, cfg.optim, 10),
                                          model_parameters=parameter_groups(model, cfg.optim.weight_decay))
        left_out = skip and skip_one_rank_gradient_allreduce(engine)
        if stage == 1:
            out["zero_1_left_out"] = left_out
            continue
        inputs = torch.randn(6, 4, 8, generator=torch.Generator().manual_seed(1)).to(engine.module.used.weight.dtype)
        for x in inputs[:-2]:
            engine.backward(engine(x).float().sin().sum())
            engine.step()
        with torch.profiler.profile() as profile:
            for x in inputs[-2:]:
                engine.backward(engine(x).float().sin().sum())
                engine.step()
        out[skip] = {"left_out": left_out, "copies": sum(e.count for e in profile.key_averages() if e.key == "aten::copy_"),
                     "params": {n: p.detach().float().numpy().copy() for n, p in engine.module.named_parameters()}}
    return out


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16", "bf16"])
def test_the_one_rank_allreduce_left_out_changes_no_bit_of_training(precision):
    """On CPU, DeepSpeed's ZeRO-0 reduces the gradients themselves in every precision (bf16:
    ``FP16_UnfusedOptimizer``, bf16 gradients sent as bf16), so it is left out in all three."""
    import numpy as np

    from conftest import on_gloo_ranks

    got = on_gloo_ranks(_steps_with_and_without_the_one_rank_allreduce, precision, world=1)[0]
    deepspeeds, skipped = got[False], got[True]
    assert skipped["left_out"] and not got["zero_1_left_out"]
    for name, value in deepspeeds["params"].items():
        np.testing.assert_array_equal(skipped["params"][name], value, err_msg=name)
    torch.manual_seed(0)
    init = HalfUsed()
    assert not np.array_equal(deepspeeds["params"]["unused.weight"], init.unused.weight.detach().float().numpy())
    assert skipped["copies"] < deepspeeds["copies"]


def _allreduces_of_a_zero_0_step(rank, world):
    """The all-reduces of one step of pairsim's engine at ZeRO-0, without gradient clipping (its
    global norm is an all-reduce of its own)."""
    from pairsim.config import load_config
    from pairsim.train import engine as engines
    from test_train import fixed_inputs

    cfg = load_config(None, ["model.arch=pairsim-tiny", "train.zero_stage=0", "train.micro_batch_size=6",
                             "optim.grad_clip=0"])
    engine = engines.create_engine(cfg, engines.deepspeed_config(cfg.train, cfg.optim, total_steps=10))
    pixels, tokens = fixed_inputs(cfg)
    with torch.profiler.profile() as profile:
        engine.backward(engine(method="loss", image=pixels, text=tokens, group_ids=torch.arange(6))["loss"])
        engine.step()
    return sum(e.count for e in profile.key_averages() if "all_reduce" in e.key)


def test_pairsims_one_worker_zero_0_engine_reduces_no_gradients():
    from conftest import on_gloo_ranks

    assert on_gloo_ranks(_allreduces_of_a_zero_0_step, world=1)[0] == 0
    assert all(n > 0 for n in on_gloo_ranks(_allreduces_of_a_zero_0_step, world=2).values())
