"""What pairsim uses of DeepSpeed beyond its public API: the classes its checkpoints pickle
(:func:`checkpoint_globals`), its ``@torch.compile`` decorator replaced while Muon's module
imports (:func:`import_muon_lazily`), its CPU shared-memory all-reduce kernel left unbuilt
(:func:`skip_shared_memory_allreduce`), its gradient all-reduce over one rank left out
(:func:`skip_one_rank_gradient_allreduce`), and its optimizers' fp32 master copies
(:func:`master_fragment`).

Imports neither ``deepspeed`` nor ``torch`` at module level.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TESTED = "deepspeed>=0.19,<0.20"


def checkpoint_globals() -> list[type]:
    """The classes DeepSpeed pickles into its checkpoints besides tensors and plain containers
    (for ``torch.serialization.safe_globals``)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [fragment_address, ZeroStageEnum, LossScaler, DynamicLossScaler]


def import_muon_lazily() -> None:
    """Import DeepSpeed's Muon optimizer with its ``@torch.compile`` kernels compiled on first
    call instead of at import.

    DeepSpeed 0.19 imports that module while it checks the optimizer (``deepspeed.initialize``
    under ZeRO) and in ZeRO-1/2's first gradient reduction, whichever optimizer runs, and
    ``torch.compile``'s decorator loads ``torch._inductor``: about 2 s of every worker's
    start-up, for an optimizer pairsim does not build. Imported first here, with the decorator
    (``deepspeed.runtime.compiler.compile``) deferred to each kernel's first call, those later
    imports find it loaded. Muon itself runs as before (``torch.compile`` compiles lazily
    anyway; only its wrapper is built later)."""
    name = "deepspeed.runtime.zero.muon.muon_optimizer"
    if name in sys.modules:
        return
    import torch
    from deepspeed.runtime import compiler

    eager = getattr(compiler, "compile", None)
    if eager is None:  # a DeepSpeed whose modules no longer decorate through it: nothing to defer
        return

    def compile_on_first_call():
        def decorate(function):
            compiled = None

            @functools.wraps(function)
            def call(*args, **kwargs):
                nonlocal compiled
                compiled = compiled or torch.compile(function)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compiler.compile = compile_on_first_call
    try:
        importlib.import_module(name)
    except ImportError:  # a DeepSpeed without Muon: nothing to defer
        pass
    finally:
        compiler.compile = eager


def skip_shared_memory_allreduce() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce kernel
    (``deepspeed_shm_comm``) when it starts its communication backend.

    DeepSpeed 0.19 builds that kernel with the machine's C++ compiler whenever its CPU
    accelerator starts the backend (``deepspeed.comm.torch.build_shm_op``): 34 s of the first
    run's start-up on this 2-core machine, again after every new virtual environment (the
    build is keyed by its paths), and a failed run where no compiler is installed. Only
    ``inference_all_reduce`` (tensor-parallel inference) uses it; ZeRO's collectives go through
    ``torch.distributed`` either way."""
    backend = importlib.import_module("deepspeed.comm.torch")  # the package's own ``torch`` is PyTorch
    backend.build_shm_op = lambda: None


def skip_one_rank_gradient_allreduce(engine) -> bool:
    """Leave out ``engine``'s gradient all-reduce where it changes nothing: ZeRO-0 on one
    data-parallel rank (no sequence or pipeline parallelism, no MoE layers), gradients averaged
    with no pre-divide factor and sent in their own dtype. True when it was left out.

    DeepSpeed 0.19 runs it whatever the world size (``allreduce_gradients`` →
    ``buffered_allreduce_fallback``): every gradient copied into one flat buffer, multiplied by
    1, "reduced" over the one rank and copied back, about 90 more tensor copies a step of
    pairsim-tiny (``bench_train``'s profile), paid by every one-worker run and sweep trial.
    What it leaves besides the values it started with is kept: at the accumulation boundary a
    trainable parameter that got no gradient gets zeros (so weight decay and Adam's moments
    still move it, as on more ranks). Not left out where it sends gradients in another dtype
    (``communication_data_type``): DeepSpeed's ``BF16_Optimizer`` rounds its fp32 gradients to
    bf16 and back through it, on one rank as on many."""
    import torch

    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    if (engine.zero_optimization_stage() != 0 or engine.dp_world_size != 1 or engine.sequence_parallel_size != 1
            or engine.pipeline_parallelism or engine.has_moe_layers or engine.gradient_predivide_factor() != 1.0
            or hasattr(engine.optimizer, "get_grads_for_reduction")  # reduces its own copies, not the grads
            or {p.dtype for p in trainable} != {engine.communication_data_type}):
        return False

    def zero_fill_missing_gradients(bucket_size=None):
        if engine.is_gradient_accumulation_boundary():
            for param in trainable:
                if param.grad is None and param.numel():
                    param.grad = torch.zeros_like(param)

    engine.allreduce_gradients = zero_fill_missing_gradients
    return True


def master_fragment(optimizer, param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's part of the fp32 master copy of ``param`` that ``optimizer`` (a DeepSpeed
    engine's) steps, a view into DeepSpeed's buffers; None when the optimizer steps ``param``
    itself or owns none of it. Not ZeRO-3 (``deepspeed.utils.safe_get_local_fp32_param``).

    Why not DeepSpeed's public ``safe_get_full_fp32_param``/``safe_set_full_fp32_param``: the
    getter assembles the full value with an all-reduce, a collective per temperature per step
    where a clamp of this rank's own fragment needs none, and neither covers ZeRO-0 under fp16
    (``FP16_Optimizer``'s masters have no ``_hp_mapping``)."""
    import torch

    if getattr(param, "_hp_mapping", None) is not None:  # ZeRO-1/2, bf16 optimizer
        return param._hp_mapping.get_hp_fragment()
    masters = getattr(optimizer, "fp32_groups_flat", None) or getattr(optimizer, "fp32_groups", None)
    for low_precision, master in zip(getattr(optimizer, "fp16_groups", []), masters or []):
        offset = 0  # ZeRO-0 with bf16/fp16: FP16_Optimizer (flat masters) or FP16_UnfusedOptimizer (one per param)
        for index, p in enumerate(low_precision):
            if p is param:
                return master.narrow(0, offset, p.numel()) if torch.is_tensor(master) else master[index]
            offset += p.numel()
    return None
