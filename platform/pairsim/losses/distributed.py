"""The one place where loss inputs cross workers (with :mod:`pairsim.dist`'s collectives).

As open_clip's ``ClipLoss`` with ``gather_with_grad``: each feature a loss reads whole is
all-gathered with autograd (on first use: :attr:`GlobalBatch.columns`), so the backward
reduce-scatters (sums) each slice's gradient to the worker that produced it. Each worker then
scores either every global row (``local_loss=False``) or only its own rows (``local_loss=True``:
memory O(B_local × B_global)) against all global columns. A loss that needs one block of
columns at a time passes them around the ring instead (:meth:`GlobalBatch.ring`, memory
O(B_local²) per block). With the data-parallel gradient average a DeepSpeed engine applies,
each gives exactly the gradient of the loss on the global batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from pairsim import dist


class Gathered(Mapping[str, torch.Tensor]):
    """Every worker's tensors by name, concatenated in rank order, each all-gathered when first
    read. Every worker must read the same names in the same order (the losses' code paths do
    not depend on a worker's data)."""

    def __init__(self, local: dict[str, torch.Tensor], world_size: int):
        self._local, self._world_size, self._gathered = local, world_size, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._gathered:
            local = self._local[name]
            self._gathered[name] = dist.all_gather(local) if self._world_size > 1 else local
        return self._gathered[name]

    def __contains__(self, name: object) -> bool:
        return name in self._local  # without gathering it

    def __iter__(self) -> Iterator[str]:
        return iter(self._local)

    def __len__(self) -> int:
        return len(self._local)


@dataclass
class GlobalBatch:
    """Loss inputs of one step: each worker's rows and the whole global batch of columns."""

    local: dict[str, torch.Tensor]
    local_loss: bool
    rank: int
    world_size: int
    columns: Gathered = field(init=False)
    _similarities: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.columns = Gathered(self.local, self.world_size)

    @property
    def local_size(self) -> int:
        return next(iter(self.local.values())).shape[0]

    @property
    def size(self) -> int:
        """The global batch size."""
        return self.local_size * self.world_size

    @property
    def first_row(self) -> int:
        """Global index of the first row :meth:`rows` returns."""
        return self.rank * self.local_size if self.local_loss else 0

    def rows(self, name: str) -> torch.Tensor:
        """The rows this worker scores: its own (``local_loss``) or all of them."""
        return self.local[name] if self.local_loss else self.columns[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.columns.get(name)

    def similarity(self, rows: str, columns: str) -> torch.Tensor:
        """rows(``rows``) @ columns[``columns``]ᵀ, computed once per step for all loss terms."""
        key = (rows, columns)
        if key not in self._similarities:
            self._similarities[key] = self.rows(rows) @ self.columns[columns].T
        return self._similarities[key]

    def ring(self, *names: str) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Every worker's ``names`` (those the batch has), one worker's at a time, passed around
        the ring (:func:`pairsim.dist.shift_right`, with autograd) rather than gathered: this
        worker's first, then its left neighbour's, and so on, each with the global index of its
        first row — SigLIP's distributed form (Zhai et al. 2023; open_clip's ``dist_impl="shift"``)."""
        block = {name: self.local[name] for name in names if name in self.local}
        for step in range(self.world_size):
            if step:
                block = {name: dist.shift_right(tensor) for name, tensor in block.items()}
            yield (self.rank - step) % self.world_size * self.local_size, block


def gather_batch(features: dict[str, torch.Tensor | None], *, local_loss: bool, rank: int,
                 world_size: int) -> GlobalBatch:
    """The step's batch over every (non-None) input; each is gathered when a loss first reads
    it whole. All workers must pass the same names and batch size."""
    return GlobalBatch({k: v for k, v in features.items() if v is not None}, local_loss, rank, world_size)
