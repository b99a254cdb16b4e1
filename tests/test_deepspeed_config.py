import pytest
import torch

from pairsim.cli import DEMO_CONFIG, objective_config, shipped_objectives
from pairsim.config import load_config
from pairsim.train.engine import deepspeed_config


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "amp_bf16"])
def test_derived_config_is_what_deepspeed_parses(stage, precision):
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = load_config(None, [f"train.zero_stage={stage}", f"train.precision={precision}",
                             "train.micro_batch_size=48", "optim.grad_clip=0.5", "optim.lr=3e-4",
                             "optim.warmup_steps=7", "optim.min_lr_ratio=0.1"])
    parsed = DeepSpeedConfig(deepspeed_config(cfg.train, cfg.optim, total_steps=100))
    assert parsed.zero_optimization_stage == stage
    assert parsed.bfloat16_config.enabled == (precision == "bf16")
    assert parsed.float16_config.enabled == (precision == "fp16")
    assert parsed.torch_autocast_enabled == (precision == "amp_bf16")
    if precision == "amp_bf16":
        assert parsed.torch_autocast_dtype == torch.bfloat16
    assert parsed.gradient_clipping == 0.5
    assert parsed.train_micro_batch_size_per_gpu == 48 and parsed.gradient_accumulation_steps == 1
    assert parsed.optimizer_name == "adamw" and parsed.optimizer_params["lr"] == 3e-4
    assert parsed.scheduler_name == "WarmupCosineLR"
    assert parsed.scheduler_params == {"total_num_steps": 100, "warmup_num_steps": 7, "warmup_type": "linear",
                                       "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}


# ---------------------------------------------------------------- the optimizer: no compiler by default

def test_default_optimizer_is_torch_adamw_fused_on_gpu_and_cpu_and_deepspeed_parses_it():
    from deepspeed.runtime.config import DeepSpeedConfig

    for use_gpu in (False, True):
        cfg = load_config(None, [f"train.use_gpu={str(use_gpu).lower()}"])
        parsed = DeepSpeedConfig(deepspeed_config(cfg.train, cfg.optim, total_steps=10))
        assert parsed.optimizer_params["torch_adam"] is True
        assert parsed.optimizer_params.get("fused", False) is True
    cfg = load_config(None, ["train.use_gpu=true", "optim.impl=deepspeed"])
    params = deepspeed_config(cfg.train, cfg.optim, total_steps=10)["optimizer"]["params"]
    assert params["torch_adam"] is False and "fused" not in params


def test_deepspeed_optimizer_needs_a_gpu():
    from pairsim.config import ConfigError

    with pytest.raises(ConfigError) as exc:
        load_config(None, ["optim.impl=deepspeed"])
    assert exc.value.keys == ("optim.impl", "train.use_gpu") and "'deepspeed'" in str(exc.value)


def _fused_engine(rank, world):
    """DeepSpeed builds the optimizer pairsim's config names (torch AdamW, fused: one kernel on a
    CPU as on a GPU) and steps it, here under ZeRO-2 and bf16."""
    import deepspeed

    cfg = load_config(None, ["train.micro_batch_size=2", "train.zero_stage=2",
                             "train.precision=bf16", "optim.warmup_steps=0"])  # full LR at step 1
    ds_config = deepspeed_config(cfg.train, cfg.optim, total_steps=10)
    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
    base = engine.optimizer.optimizer
    before = engine.module.weight.float().clone()
    engine.backward(engine(torch.ones(2, 4, dtype=torch.bfloat16)).float().square().sum())
    engine.step()
    return type(base).__name__, base.defaults["fused"], bool((engine.module.weight.float() != before).any())


def test_deepspeed_steps_torch_fused_adamw():
    from conftest import on_gloo_ranks

    for name, fused, moved in on_gloo_ranks(_fused_engine, world=1).values():
        assert (name, fused, moved) == ("AdamW", True, True)


def _amp_engines(rank, world):
    """pairsim's engine under ``train.precision: amp_bf16`` (ZeRO-0 and ZeRO-2): its loss against
    the same module called by hand under ``torch.autocast`` to bfloat16 and in plain float32; the
    weights' dtype before and after a step."""
    from pairsim.train import engine as engines
    from test_train import fixed_inputs

    out = {}
    for stage in (0, 2):
        cfg = load_config(None, ["model.arch=pairsim-tiny", "train.precision=amp_bf16", f"train.zero_stage={stage}",
                                 "train.micro_batch_size=6", "optim.warmup_steps=0"])
        engine = engines.create_engine(cfg, deepspeed_config(cfg.train, cfg.optim, total_steps=10))
        pixels, tokens = fixed_inputs(cfg)
        batch = {"image": pixels.to(engines.DTYPES["amp_bf16"]), "text": tokens, "group_ids": torch.arange(6)}
        loss = engine(method="loss", **batch)["loss"]
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                by_hand = engine.module.loss(**batch)["loss"]
            in_fp32 = engine.module.loss(**batch)["loss"]
            embedded = engine(image=pixels)["image"]
        before = engine.module.model.clip.visual.conv1.weight.detach().clone()
        engine.backward(loss)
        engine.step()
        after = engine.module.model.clip.visual.conv1.weight
        out[stage] = {"loss": loss.item(), "by_hand": by_hand.item(), "fp32": in_fp32.item(),
                      "embedding_dtype": str(embedded.dtype), "weights": {str(p.dtype) for p in engine.module.parameters()},
                      "moved": bool((after != before).any())}
    return out


def test_amp_bf16_runs_the_forward_under_autocast_with_float32_weights():
    from conftest import on_gloo_ranks

    for stage, got in on_gloo_ranks(_amp_engines, world=1)[0].items():
        assert got["loss"] == got["by_hand"], stage  # the engine's autocast is torch's, bit for bit
        assert got["loss"] != got["fp32"] and got["loss"] == pytest.approx(got["fp32"], rel=0.05), stage
        assert got["embedding_dtype"] == "torch.bfloat16", stage  # the projection ran in bfloat16
        assert got["weights"] == {"torch.float32"} and got["moved"], stage


@pytest.mark.parametrize("raw,expected,crashed", [("9.0a", "9.0", True), ("8.6 9.0a+PTX", "8.6;9.0+PTX", True),
                                                  ("7.5;8.0;8.0", "7.5;8.0", False), ("10.0f;12.0", "10.0;12.0", True)])
def test_arch_list_is_made_what_deepspeed_parses(raw, expected, crashed, monkeypatch):
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA builder, whatever the accelerator

    from pairsim.train.engine import deepspeed_arch_list

    assert deepspeed_arch_list(raw) == expected
    builder = FusedAdamBuilder()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", expected)
    flags = builder.compute_capability_args()
    assert any("arch=compute_" in flag for flag in flags)
    if crashed:  # what DeepSpeed did with the raw list
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", raw)
        with pytest.raises(ValueError):
            builder.compute_capability_args()


def schedule_rates(cfg, steps: int) -> list[float]:
    """The LR of each of ``steps`` optimizer steps under the schedule DeepSpeed builds from the
    config's derived ``scheduler`` section."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    params = deepspeed_config(cfg.train, cfg.optim, total_steps=steps)["scheduler"]["params"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    schedule = WarmupCosineLR(optimizer, **params)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_deepspeed_builds_the_schedule_and_no_warmup_starts_at_the_full_rate(warmup):
    """The cusa_paper preset has no warm-up, which DeepSpeed's WarmupCosineLR refuses."""
    rates = schedule_rates(load_config(None, [f"optim.warmup_steps={warmup}", "optim.lr=1e-3",
                                              "optim.min_lr_ratio=0.1"]), steps=30)
    peak = rates.index(max(rates))
    assert max(rates) == pytest.approx(1e-3, rel=0 if warmup == 0 else 0.01)
    assert peak == 0 if warmup == 0 else (rates[0] == 0.0 and peak >= warmup)
    assert rates[:peak + 1] == sorted(rates[:peak + 1]) and rates[peak:] == sorted(rates[peak:], reverse=True)
    assert 1e-4 <= rates[-1] < 1.2e-4  # cosine down to min_lr_ratio × lr


@pytest.mark.parametrize("preset", shipped_objectives())
def test_every_objective_preset_gives_a_schedule_deepspeed_builds(preset):
    cfg = load_config([DEMO_CONFIG, objective_config(preset)])
    lrs = schedule_rates(cfg, steps=100)
    assert max(lrs) == pytest.approx(cfg.optim.lr, rel=1e-3)  # the preset's peak LR is reached
    peak = lrs.index(max(lrs))
    assert peak <= cfg.optim.warmup_steps + 2 and all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:]))
    assert lrs[-1] <= cfg.optim.lr * (cfg.optim.min_lr_ratio + 0.01)  # decayed to the floor by the last step


def _start_up_imports(rank, world, extensions):
    """A fresh process: pairsim's engine under ZeRO-2 and one step, then DeepSpeed's Muon kernel
    called once; whether ``torch._inductor`` was loaded after each, the kernel's result against
    ``torch.compile`` of its function, and what torch's extension builds (in ``extensions``) hold."""
    import os
    import sys

    from pairsim.train import engine as engines
    from test_train import fixed_inputs

    os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    inductor = "torch._inductor.compile_fx"
    cfg = load_config(None, ["model.arch=pairsim-tiny", "train.zero_stage=2", "train.micro_batch_size=6"])
    engine = engines.create_engine(cfg, deepspeed_config(cfg.train, cfg.optim, total_steps=10))
    pixels, tokens = fixed_inputs(cfg)
    engine.backward(engine(method="loss", image=pixels, text=tokens, group_ids=torch.arange(6))["loss"])
    engine.step()
    after_step = inductor in sys.modules
    from deepspeed.runtime.zero.muon import original_muon  # loaded by DeepSpeed above, or now

    kernel = original_muon.zeropower_via_newtonschulz5
    matrix = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    deferred = kernel(matrix, steps=5)
    after_kernel = inductor in sys.modules
    return {"after_step": after_step, "after_kernel": after_kernel,
            "same_as_compiled": torch.equal(deferred, torch.compile(kernel.__wrapped__)(matrix, steps=5)),
            "extensions_built": sorted(os.listdir(extensions))}


def test_deepspeed_start_up_compiles_nothing_it_does_not_run(tmp_path):
    """DeepSpeed imports its Muon optimizer under ZeRO whatever the optimizer, and Muon's
    ``@torch.compile`` loaded ``torch._inductor`` (~2 s of a worker's start-up): pairsim's engine
    and its first step leave it unloaded, and Muon's kernel still compiles on its first call, to
    what ``torch.compile`` makes of it. On CPU DeepSpeed compiled its shared-memory all-reduce
    kernel (34 s on a new machine), used only by tensor-parallel inference: nothing is built."""
    from conftest import on_gloo_ranks

    got = on_gloo_ranks(_start_up_imports, str(tmp_path), world=1)[0]
    assert got == {"after_step": False, "after_kernel": True, "same_as_compiled": True, "extensions_built": []}


def test_a_deepspeed_without_its_compile_decorator_is_left_as_it_is(monkeypatch):
    """A DeepSpeed installed past the tested range (``pip install`` without ``constraints.txt``
    and ``--no-deps``): where ``deepspeed.runtime.compiler.compile`` is gone,
    nothing is deferred and nothing is imported (rather than every run failing at its engine)."""
    import sys

    from deepspeed.runtime import compiler
    from pairsim.compat.deepspeed import import_muon_lazily

    name = "deepspeed.runtime.zero.muon.muon_optimizer"
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delattr(compiler, "compile")
    import_muon_lazily()
    assert name not in sys.modules
