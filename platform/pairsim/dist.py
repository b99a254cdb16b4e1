"""Where this process sits among the training workers, and the collectives pairsim uses.

Every collective takes its tensors on the device of the process group's backend
(:func:`collective_device`): NCCL only moves CUDA tensors, gloo only CPU ones. Callers pass
tensors from wherever they are; results come back on the caller's device.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist

# the device type each backend reduces on; other backends are asked through torch
BACKEND_DEVICES = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "xccl": "xpu"}
SINGLE_RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}  # a launcher's, for one process


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextlib.contextmanager
def single_process_group(backend: str = "gloo") -> Iterator[None]:
    """A process group of this process alone for the ``with`` block — what DeepSpeed builds an
    engine in — for a run trained in the calling process (a warm sweep trial), with the
    launcher's variables DeepSpeed reads (:data:`SINGLE_RANK_ENV`); destroyed after, and the
    environment as it was, so the next run in the process starts without one. Its rendezvous is
    a file, not a port."""
    if dist.is_initialized():
        raise RuntimeError("this process already has a process group: one run at a time trains in it")
    before = {name: os.environ.get(name) for name in SINGLE_RANK_ENV}
    os.environ.update(SINGLE_RANK_ENV)
    try:
        with tempfile.TemporaryDirectory(prefix="pairsim-pg-") as tmp:
            dist.init_process_group(backend, store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
            try:
                yield
            finally:
                if dist.is_initialized():  # Ray Train's local mode destroys it when its run ends
                    dist.destroy_process_group()
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def collective_device(backend: str | None = None) -> torch.device:
    """The device the default group's backend (or ``backend``) reduces on."""
    backend = str(backend or dist.get_backend()).lower()
    kind = BACKEND_DEVICES.get(backend, "cpu")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``tensor`` reduced over all ranks, returned on ``tensor``'s device (unchanged with one rank)."""
    if not is_distributed():
        return tensor
    work = tensor.to(collective_device())
    dist.all_reduce(work, op=op)
    return work.to(tensor.device)


def all_true(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (one all-reduce of a flag)."""
    return bool(all_reduce(torch.tensor([int(flag)], dtype=torch.int32), op=dist.ReduceOp.MIN).item())


def mean_over_ranks(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each scalar averaged over the ranks, in one all-reduce."""
    stacked = torch.stack([v.detach().float().reshape(()) for v in values.values()])
    return dict(zip(values, (all_reduce(stacked) / world_size()).tolist()))


def barrier() -> None:
    if is_distributed():
        dist.barrier()


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 with synchronous c10d calls. The backward all-reduces the
    gradient of the gathered tensor (every worker's loss reads every slice) and keeps this
    worker's slice — what ``torch.distributed.nn.all_gather`` did on gloo before torch
    deprecated it. (Its suggested replacement, the functional collectives, keeps async work
    handles in a process-wide registry; under Ray Train, whose training function runs in a
    thread beside Ray Data's prefetch threads, 3 of 8 multi-epoch runs with them aborted on
    heap corruption, and none has since.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.rank, ctx.rows = dist.get_rank(), x.shape[0]
        return _gathered(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = all_reduce(grad.contiguous().clone())
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def _gathered(x: torch.Tensor) -> torch.Tensor:
    work = x.contiguous().to(collective_device())
    out = work.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, work)  # all_gather_into_tensor's successor
    return out.to(x.device)


def _exchanged(x: torch.Tensor, to_rank: int, from_rank: int) -> torch.Tensor:
    work = x.contiguous().to(collective_device())
    out = torch.empty_like(work)
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, work, to_rank),
                                           dist.P2POp(dist.irecv, out, from_rank)]):
        request.wait()
    return out.to(x.device)


class _ShiftRight(torch.autograd.Function):
    """``x`` to the next rank, the previous rank's back; the backward sends the gradient of
    what was received back to its sender, and receives that of what was sent."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, to_rank: int, from_rank: int) -> torch.Tensor:
        ctx.to_rank, ctx.from_rank = to_rank, from_rank
        return _exchanged(x, to_rank, from_rank)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchanged(grad, ctx.from_rank, ctx.to_rank), None, None


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """Rank r's ``x`` sent to rank r + 1 (mod the world), rank r − 1's returned: one step of a
    ring, point to point (all ranks' ``x`` of one shape); differentiable when ``x`` requires grad."""
    if not is_distributed():
        return x
    rank, world = dist.get_rank(), dist.get_world_size()
    to_rank, from_rank = (rank + 1) % world, (rank - 1) % world
    return _ShiftRight.apply(x, to_rank, from_rank) if x.requires_grad else _exchanged(x, to_rank, from_rank)


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0 in rank order; differentiable when ``x``
    requires grad (the backward sends each rank the gradient of its own slice)."""
    if not is_distributed():
        return x
    return _AllGather.apply(x) if x.requires_grad else _gathered(x)
