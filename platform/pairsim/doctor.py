"""``pairsim doctor``: what this machine (and the Ray cluster, when one is named) gives a run,
and whether the run config's choices can run on it — before a job is submitted.

Each :class:`Finding` is a line of the report; a finding is *blocking* when the config asks for
something that cannot run (GPUs that are not there, bf16 on a GPU without it, DeepSpeed's
FusedAdam with no way to build it, a storage path that cannot be written, a cluster smaller
than one run), and ``pairsim doctor`` then exits with 1. A *warning* does not block: Ray,
DeepSpeed or MLflow installed outside the versions :mod:`pairsim.compat` was tested on.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from pairsim import cluster as clusters
from pairsim import compat
from pairsim import storage as stores
from pairsim.config import RunConfig


@dataclass(frozen=True)
class Finding:
    topic: str
    detail: str
    blocking: bool = False  # the run config asks for what this finding says cannot run
    warning: bool = False  # worth a look, but the run may go ahead


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def software() -> list[Finding]:
    cuda = torch.version.cuda or "none (CPU build)"
    return [Finding("python", f"{platform.python_version()} ({sys.executable})"),
            Finding("packages", ", ".join(f"{p} {_version(p)}" for p in ("torch", "open_clip_torch", "pyarrow"))),
            *tested_versions(),  # Ray, DeepSpeed and MLflow, each against its tested range
            Finding("torch CUDA build", cuda)]


def tested_versions() -> list[Finding]:
    """Ray's, DeepSpeed's, MLflow's and torch's installed version against the range :mod:`pairsim.compat`
    was tested on (:func:`pairsim.compat.version_report`); a warning outside it."""
    return [Finding(check.name, f"{check.installed}, within the tested range {check.tested}") if check.within else
            Finding(check.name, f"{check.installed or 'not installed'}, outside the tested range {check.tested}: "
                                "pairsim's use of its internals (pairsim.compat) may break", warning=True)
            for check in compat.version_report()]


def gpus(cfg: RunConfig) -> list[Finding]:
    """The GPUs this process sees, NCCL, and whether ``train.use_gpu`` / bf16 can run on them."""
    if not torch.cuda.is_available():
        return [Finding("GPUs", "none visible" + (": train.use_gpu=true cannot run on a local instance"
                                                   if cfg.train.use_gpu and clusters.starts_local_instance(cfg) else ""),
                        blocking=cfg.train.use_gpu and clusters.starts_local_instance(cfg))]
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append(Finding(f"GPU {index}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                                             f"compute capability {props.major}.{props.minor}"))
    found.append(Finding("NCCL", ".".join(map(str, torch.cuda.nccl.version()))))
    no_bf16 = (cfg.train.use_gpu and cfg.train.precision in ("bf16", "amp_bf16")
               and not torch.cuda.is_bf16_supported())
    found.append(Finding("bf16", "supported" if torch.cuda.is_bf16_supported() else
                         "not supported" + (f": train.precision={cfg.train.precision} cannot run; use fp16 or fp32"
                                            if no_bf16 else ""),
                         blocking=no_bf16))
    wanted = cfg.train.num_workers * cfg.train.gpus_per_worker
    short = cfg.train.use_gpu and clusters.starts_local_instance(cfg) and wanted > torch.cuda.device_count()
    if short:
        found.append(Finding("train.num_workers", f"{cfg.train.num_workers} workers × {cfg.train.gpus_per_worker:g} "
                                                  f"GPUs need {wanted:g}; {torch.cuda.device_count()} visible",
                             blocking=True))
    return found


def compiler(cfg: RunConfig) -> list[Finding]:
    """nvcc, DeepSpeed's pre-built ops, ``TORCH_CUDA_ARCH_LIST`` as DeepSpeed will read it and,
    with ``train.compile``, the C compiler Inductor builds with."""
    from pairsim.train import engine

    nvcc = shutil.which("nvcc")
    found = [Finding("nvcc", nvcc or "not found (torch's fused AdamW, the default optim.impl, needs none)")]
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list:
        normalised = engine.deepspeed_arch_list(arch_list)
        found.append(Finding("TORCH_CUDA_ARCH_LIST", arch_list + (f" (DeepSpeed ops get {normalised!r})"
                                                                  if normalised != arch_list else "")))
    problem = engine.deepspeed_ops_problem()
    optimizer = "torch.optim.AdamW (fused)" if cfg.optim.impl == "torch" else "DeepSpeed FusedAdam"
    found.append(Finding("optimizer", optimizer + ("" if cfg.optim.impl == "torch" else
                                                   f": {problem}" if problem else ": can be built or is pre-built"),
                         blocking=cfg.optim.impl == "deepspeed" and problem is not None))
    if cfg.train.compile:
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        found.append(Finding("train.compile", f"torch.compile's Inductor builds with {cc}" if cc else
                             "no C compiler (cc, gcc, $CC) here: torch.compile's Inductor needs one; install one "
                             "or set train.compile=false", blocking=cc is None))
    return found


def cluster(cfg: RunConfig) -> list[Finding]:
    """The resources a run gets: the named cluster's (joined, not started), or what a local
    instance would start with."""
    need = clusters.run_cpus(cfg)
    gpus_needed = cfg.train.num_workers * cfg.train.gpus_per_worker if cfg.train.use_gpu else 0
    plan = (f"one run takes {need:g} CPUs ({cfg.train.num_workers} workers × {cfg.train.cpus_per_worker:g} + "
            f"ray.data_cpus {cfg.ray.data_cpus:g})" + (f" and {gpus_needed:g} GPUs, NCCL" if gpus_needed else ""))
    if clusters.starts_local_instance(cfg):
        return [Finding("Ray", f"a local instance of {need:g} logical CPUs on this machine's {os.cpu_count()} cores; "
                               + plan)]
    import ray

    clusters.join(cfg.ray.address, log_to_driver=False)
    try:
        resources = ray.cluster_resources()
    finally:
        ray.shutdown()
    cpus, gpus_there = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    small = cpus < need or gpus_there < gpus_needed
    return [Finding("Ray", f"cluster {cfg.ray.address or os.environ['RAY_ADDRESS']}: {cpus:g} CPUs, "
                           f"{gpus_there:g} GPUs; {plan}" + ("; it does not fit" if small else ""), blocking=small)]


def storage(cfg: RunConfig) -> list[Finding]:
    """Free space and write access where checkpoints go (an object store: reached and written)."""
    if stores.is_uri(cfg.ray.storage_path):
        return [object_storage(cfg.ray.storage_path)]
    path = Path(cfg.ray.storage_path).resolve()
    if problem := stores.local_storage_problem(path):
        return [Finding("ray.storage_path", problem, blocking=True)]
    free = shutil.disk_usage(stores.nearest_existing(path)).free / 2**30
    return [Finding("ray.storage_path", f"{path}: {free:.1f} GiB free")]


def object_storage(uri: str) -> Finding:
    """Whether a probe file can be written at ``uri`` and removed, through its ``pyarrow.fs``
    filesystem (endpoint and credentials from the environment)."""
    try:
        location = stores.Location.of(uri)
        probe = location / f".pairsim-doctor-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.delete()
    except (OSError, ValueError) as exc:  # pyarrow raises OSError for I/O, ArrowInvalid (a ValueError) for URIs
        return Finding("ray.storage_path", f"{uri}: cannot be written ({exc})", blocking=True)
    return Finding("ray.storage_path", f"{uri}: reachable and writable ({location.fs.type_name})")


def diagnose(cfg: RunConfig) -> list[Finding]:
    return software() + gpus(cfg) + compiler(cfg) + cluster(cfg) + storage(cfg)


def report(findings: list[Finding]) -> str:
    width = max(len(f.topic) for f in findings)
    return "\n".join(f"{'✗' if f.blocking else '!' if f.warning else '·'} {f.topic:<{width}}  {f.detail}"
                     for f in findings)
