"""The one place where loss inputs cross workers (with :func:`pairsim.dist.all_gather`).

As open_clip's ``ClipLoss`` with ``gather_with_grad``: every feature is all-gathered with
autograd, so the backward reduce-scatters (sums) each slice's gradient to the worker that
produced it. Each worker then scores either every global row (``local_loss=False``) or only
its own rows (``local_loss=True``: memory O(B_local × B_global)) against all global columns.
With the data-parallel gradient average a DeepSpeed engine applies, both give exactly the
gradient of the loss on the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pairsim import dist


@dataclass
class GlobalBatch:
    """Loss inputs of one step: each worker's rows and the whole global batch of columns."""

    local: dict[str, torch.Tensor]
    columns: dict[str, torch.Tensor]
    local_loss: bool
    first_row: int  # global index of the first row :meth:`rows` returns
    _similarities: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict, repr=False)

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


def gather_batch(features: dict[str, torch.Tensor | None], *, local_loss: bool, rank: int,
                 world_size: int) -> GlobalBatch:
    """Gather every (non-None) input once. All workers must pass the same names and batch size."""
    local = {k: v for k, v in features.items() if v is not None}
    columns = {k: dist.all_gather(v) if world_size > 1 else v for k, v in local.items()}
    size = next(iter(local.values())).shape[0]
    return GlobalBatch(local, columns, local_loss, rank * size if local_loss else 0)
