"""The DeepSpeed engine a training worker runs.

:func:`create_engine` builds the retrieval model and objective as one module
(:class:`TrainingModule`), locks towers and turns on gradient checkpointing as configured, and
hands it to DeepSpeed with the config :func:`deepspeed_config` derives from the run config
(``train.deepspeed`` merged over, checked by DeepSpeed's parser: :func:`check_deepspeed_config`).
Its checkpoints are :mod:`pairsim.train.checkpoints`.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from pairsim import dist, log
from pairsim.compat.deepspeed import (import_muon_lazily, master_fragment, skip_one_rank_gradient_allreduce,
                                      skip_shared_memory_allreduce)
from pairsim.config import ConfigError, OptimConfig, RunConfig, TrainConfig, merge
from pairsim.build import build_objective
from pairsim.losses import Objective, temperatures
from pairsim.models import clip, retrieval
from pairsim.models.retrieval import RetrievalModel
from pairsim.train import checkpoints

logger = log.get_logger("train")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "amp_bf16": torch.float32}
"""The dtype of the module's weights, and of the pixels given to it, for each ``train.precision``
(under ``amp_bf16`` autocast casts inside the forward)."""


class TrainingModule(torch.nn.Module):
    """What the DeepSpeed engine wraps: the retrieval model and the objective, whose learnable
    temperatures train (and are partitioned by ZeRO) with the model.

    :meth:`embed` gives the model's embeddings, :meth:`loss` the objective's loss terms. Call
    them through the engine, ``engine(image=..., text=...)`` and ``engine(method="loss", ...)``
    (:meth:`forward` runs the one ``method`` names), so that they run under the engine's autocast,
    ZeRO-3 parameter gathering and gradient-accumulation scaling.
    """

    def __init__(self, model: RetrievalModel, objective: Objective):
        super().__init__()
        self.model, self.objective = model, objective

    def embed(self, image=None, text=None) -> dict[str, torch.Tensor]:
        """The model's embeddings of ``image`` and/or ``text`` (``image``, ``text`` and what else
        the model was built with: ``fused``, uni-modal heads)."""
        return self.model(image=image, text=text)

    def loss(self, image, text, group_ids, cached_features: dict[str, torch.Tensor] | None = None,
             **teachers) -> dict[str, torch.Tensor]:
        """The objective's loss terms (``loss`` and its parts) over the batch's embeddings,
        followed by ``cached_features`` when given (the other micro-batches of a gradient-cache
        step, :mod:`pairsim.train.accumulation`); ``group_ids`` (and ``teachers``, the rows'
        ``teacher_image`` / ``teacher_text`` for CUSA) cover those rows too."""
        features = self.embed(image, text)
        if cached_features is not None:
            features = {k: torch.cat([v, cached_features[k]]) for k, v in features.items()}
        return self.objective(**features, group_ids=group_ids, **teachers)

    def forward(self, method: str = "embed", **inputs) -> dict[str, torch.Tensor]:
        """What the engine calls: :meth:`embed` or, with ``method="loss"``, :meth:`loss`."""
        if method == "embed":
            return self.embed(**inputs)
        if method == "loss":
            return self.loss(**inputs)
        raise ValueError(f"TrainingModule: no method {method!r} (embed, loss)")


def deepspeed_config(train: TrainConfig, optim: OptimConfig, total_steps: int) -> dict[str, Any]:
    """The DeepSpeed config of a run: ZeRO stage, precision, clipping, AdamW, warm-up + cosine LR
    over ``total_steps`` optimizer steps, gradient accumulation, with ``train.deepspeed`` merged over."""
    return merge({
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.accumulate_steps,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": {"stage": train.zero_stage},
        "bf16": {"enabled": train.precision == "bf16"},
        "fp16": {"enabled": train.precision == "fp16"},
        "torch_autocast": {"enabled": train.precision == "amp_bf16", "dtype": "bfloat16"},
        "optimizer": {
            "type": "AdamW",
            # torch_adam: DeepSpeed builds torch.optim.AdamW with the other params; fused: one kernel over
            # every parameter, on a GPU or a CPU (docs/benchmarks.md: what it saves a CPU step)
            "params": {"lr": optim.lr, "betas": list(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay,
                       "torch_adam": optim.impl == "torch"}
            | ({"fused": True} if optim.impl == "torch" else {}),
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": max(total_steps, 1), "warmup_num_steps": max(optim.warmup_steps, 1),
                       "warmup_type": "linear", "warmup_min_ratio": 0.0, "cos_min_ratio": optim.min_lr_ratio}
            # DeepSpeed refuses 0 warm-up steps and starts at LR 0: none is 2 steps at full LR from the first
            | ({} if optim.warmup_steps else {"warmup_min_ratio": 1.0, "last_batch_iteration": 0}),
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }, train.deepspeed)


def check_deepspeed_config(ds_config: dict[str, Any]) -> None:
    """Parse ``ds_config`` with DeepSpeed's own parser on the driver: a bad ``train.deepspeed``
    key fails here, named, not in every worker."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(ds_config)
    except Exception as exc:  # DeepSpeed raises pydantic, assertion and value errors alike
        raise ConfigError(f"train.deepspeed: DeepSpeed refuses the merged config: {exc}") from None


def deepspeed_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's op builder parses it: ``"9.0a"`` → ``"9.0"``,
    ``"8.6 10.0f+PTX"`` → ``"8.6;10.0+PTX"``. The builder reads each minor version with ``int()``,
    so the architecture-specific suffixes torch accepts (``a``, ``f``) crash the build."""
    archs = []
    for token in value.replace(" ", ";").split(";"):
        if match := re.fullmatch(r"(\d+)\.(\d+)[a-z]?(\+PTX)?", token.strip()):
            archs.append(f"{match[1]}.{match[2]}{match[3] or ''}")
        elif token.strip():
            archs.append(token.strip())
    return ";".join(dict.fromkeys(archs))


def deepspeed_ops_problem() -> str | None:
    """Why DeepSpeed's FusedAdam (``optim.impl: deepspeed``) cannot run here, or None: it must be
    pre-built into the DeepSpeed install or buildable, which takes ``nvcc``."""
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import CUDA_HOME

    if installed_ops.get("fused_adam") or shutil.which("nvcc") or (CUDA_HOME and Path(CUDA_HOME, "bin", "nvcc").is_file()):
        return None
    return ("optim.impl: 'deepspeed' needs DeepSpeed's FusedAdam, which this DeepSpeed install does not carry "
            "pre-built (DS_BUILD_FUSED_ADAM=1 pip install deepspeed) and which cannot be built here: no nvcc on "
            "PATH or in CUDA_HOME; keep optim.impl=torch (torch's fused AdamW, no compiler)")


def prepare_deepspeed_ops() -> None:
    """Before DeepSpeed builds its FusedAdam on first use: ``TORCH_CUDA_ARCH_LIST`` in a form it
    parses, and a clear error instead of a failed compile when it cannot be built."""
    if arch_list := os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(arch_list)
    if problem := deepspeed_ops_problem():
        raise RuntimeError(problem)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters, no weight decay on gains, biases, embeddings of position/class
    and other 1-D params (as open_clip); groups left empty by locked towers are dropped."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exclude = param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
        (no_decay if exclude else decay).append(param)
    groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]
    return [group for group in groups if group["params"]]


def create_engine(cfg: RunConfig, ds_config: dict[str, Any], objective: Objective | None = None):
    """The DeepSpeed engine over ``objective`` (the run's ``loss`` built for this rank when not
    given) and the model with what the objective reads (fused embeddings, uni-modal heads), its
    weights seeded by ``train.seed`` or loaded from ``model.init_from``."""
    import deepspeed  # imported in the worker only (ray #50406)

    if cfg.optim.impl == "deepspeed":
        prepare_deepspeed_ops()
    import_muon_lazily()
    skip_shared_memory_allreduce()
    if objective is None:
        objective = build_objective(cfg.loss, dist.rank(), dist.world_size())
    torch.manual_seed(cfg.train.seed)
    model = retrieval.create_retrieval_model(cfg.model, fused="fused" in objective.needs,
                                             unimodal_heads="image_unimodal" in objective.needs)
    if cfg.model.init_from is not None:
        checkpoints.load_initial_weights(model, cfg.model.init_from)
    clip.lock_towers(model.clip, cfg.model)
    model.clip.set_grad_checkpointing(cfg.train.grad_checkpointing)
    if cfg.train.use_gpu:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    if cfg.train.compile:
        clip.compile_towers(model.clip)
    module = TrainingModule(model, objective)
    if dist.rank() == 0:
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        logger.info("%s of %s parameters train", f"{trainable:,}", f"{sum(p.numel() for p in module.parameters()):,}")
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config,
                                           model_parameters=parameter_groups(module, cfg.optim.weight_decay))
    skip_one_rank_gradient_allreduce(engine)
    return engine


def release_process_group() -> None:
    """End the process group through DeepSpeed (``deepspeed.comm.destroy_process_group``), which
    also drops the groups it derived and caches per process: a run trained in the calling
    process does this as it ends, so the next engine built there starts from none."""
    import deepspeed.comm

    if deepspeed.comm.is_initialized():
        deepspeed.comm.destroy_process_group()


@torch.no_grad()
def clamp_temperatures(engine, to_init: bool = False) -> None:
    """Clamp every learnable temperature of the engine's module into its range after
    ``engine.step()``: the fp32 master copy the optimizer steps (this rank's fragment under
    ZeRO-1/2, its partition under ZeRO-3, the flat or per-parameter copy of ZeRO-0 with bf16 or
    fp16) and the module's copy.

    Local on every rank (no collective); the module's copy of a parameter ZeRO-3 has partitioned
    away is refreshed from the master at the next step, and used clamped meanwhile.

    ``to_init``: set every temperature, fixed ones too, to its configured ``init`` instead (a
    PBT trial that continues from another's checkpoint with a mutated τ init); collective under
    ZeRO-3, where the module's copy is gathered to be set.
    """
    import deepspeed
    from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

    for temperature in temperatures(engine.module, fixed=to_init):
        param = temperature.value
        low, high = (temperature.init, temperature.init) if to_init else (temperature.min, temperature.max)
        if param.requires_grad and hasattr(param, "ds_id"):  # ZeRO-3: this rank's partition, padding left alone
            local = safe_get_local_fp32_param(param).clone()
            local.narrow(0, 0, max(0, min(local.numel(), param.ds_numel - local.numel() * dist.rank()))).clamp_(low, high)
            safe_set_local_fp32_param(param, local)
        elif param.requires_grad:
            master = master_fragment(engine.optimizer, param)
            if master is not None:
                master.clamp_(low, high)
        if to_init:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.fill_(temperature.init)
        else:
            temperature.clamp_()  # the module's copy (at ZeRO-0 fp32 the master itself)
