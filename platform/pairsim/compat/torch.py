"""What pairsim uses of torch beyond its public API: oneDNN's fp32 matrix product on dense CPU
tensors (:func:`inner_products`), the op behind torch's compiled CPU ``linear``.

Imports ``torch`` only when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TESTED = "torch>=2.14,<2.15"


def inner_products(queries: torch.Tensor, keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``queries @ keys.T`` for float32 rows of equal width.

    On a CPU whose torch has oneDNN: oneDNN's matmul, into a new tensor (it writes no given
    buffer), which outran torch's BLAS sgemm on the AMD EPYC ``docs/benchmarks.md`` names.
    Elsewhere (a GPU, a build without oneDNN): ``torch.mm`` into ``out`` ([len(queries),
    len(keys)]). The two sum in different orders, so a product may differ in its last bit."""
    import torch

    if queries.device.type == "cpu" and torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(queries.contiguous(), keys.contiguous(), None, "none", [None], "")
    return torch.mm(queries, keys.T, out=out)
