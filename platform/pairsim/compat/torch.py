"""What pairsim uses of torch beyond its public API: oneDNN's fp32 matrix product on dense CPU
tensors (:func:`inner_products`), the op behind torch's compiled CPU ``linear``, and whether the
CPU multiplies bfloat16 natively (:func:`native_bf16_products`, for
:func:`bf16_inner_products`).

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


BF16_PRODUCT_ROUNDING = 2.0**-8
"""Relative error of each of :func:`bf16_inner_products`' products against the float32 sum it
is rounded from: bfloat16's unit roundoff (8 significant bits, rounded to nearest even)."""


def native_bf16_products(device: torch.device) -> bool:
    """Whether :func:`bf16_inner_products` runs natively on ``device``: a CPU with oneDNN's
    bfloat16 kernels (AVX-512 BF16 or AMX), about twice as fast as the float32 product there."""
    import torch

    return device.type == "cpu" and torch.backends.mkldnn.is_available() and \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_inner_products(queries: torch.Tensor, keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``queries @ keys.T`` of bfloat16 rows through oneDNN, into the float32 ``out``
    ([len(queries), len(keys)]): each entry the float32 sum of the exact products of the
    bfloat16 entries, rounded to bfloat16 (relative error at most
    :data:`BF16_PRODUCT_ROUNDING`; subnormals may be flushed to zero)."""
    import torch

    return out.copy_(torch.mm(queries, keys.T))
