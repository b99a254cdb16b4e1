import pytest

from pairsim.config import load_config
from pairsim.train.engine import deepspeed_config


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_derived_config_is_what_deepspeed_parses(stage, precision):
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = load_config(None, [f"train.zero_stage={stage}", f"train.precision={precision}",
                             "train.micro_batch_size=48", "optim.grad_clip=0.5", "optim.lr=3e-4",
                             "optim.warmup_steps=7", "optim.min_lr_ratio=0.1"])
    parsed = DeepSpeedConfig(deepspeed_config(cfg.train, cfg.optim, total_steps=100))
    assert parsed.zero_optimization_stage == stage
    assert parsed.bfloat16_config.enabled == (precision == "bf16")
    assert parsed.float16_config.enabled == (precision == "fp16")
    assert parsed.gradient_clipping == 0.5
    assert parsed.train_micro_batch_size_per_gpu == 48 and parsed.gradient_accumulation_steps == 1
    assert parsed.optimizer_name == "adamw" and parsed.optimizer_params["lr"] == 3e-4
    assert parsed.scheduler_name == "WarmupCosineLR"
    assert parsed.scheduler_params == {"total_num_steps": 100, "warmup_num_steps": 7, "warmup_type": "linear",
                                       "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}
