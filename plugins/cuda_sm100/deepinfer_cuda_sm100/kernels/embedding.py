"""``embedding``: the token rows of the embedding table in one launch (contract:
``deepinfer_core.ops.linear.embedding``), a kernel of the step's programmatic-dependent-launch
chain (:mod:`.pdl`) where ``F.embedding``'s gather is not.

One program copies ``BLOCK_D`` columns of one token's row: ``out[t, :] = weight[ids[t], :]``,
bit for bit (a copy).  An id outside ``[0, V)`` reads nothing and writes zeros (the engine
refuses such ids before they reach the model; the reference would raise).  The grid depends on
shapes only (CUDA-graph capturable); no reduction, so a row does not depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, pow2
from .pdl import pdl_args, pdl_enter

MAX_BLOCK_D = 1024
"""Widest column tile of one program (V4-Flash's ``D = 4096``: four programs a token)."""


@triton.jit
def _embedding_kernel(
    ids_ptr,
    weight_ptr,
    out_ptr,
    V,
    D,
    stride_i,
    stride_v,
    stride_d,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Columns ``[pid1 * BLOCK_D, +BLOCK_D)`` of token ``pid0``'s row."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    row = tl.load(ids_ptr + t * stride_i).to(tl.int64)
    inside = (row >= 0) & (row < V)
    vals = tl.load(weight_ptr + row * stride_v + cols * stride_d, mask=mask & inside, other=0.0)
    tl.store(out_ptr + t * D + cols, vals, mask=mask)


def block_d(width: int) -> int:
    """``BLOCK_D`` for rows of ``width`` columns (shapes only)."""
    return min(pow2(width), MAX_BLOCK_D)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton ``embedding``: same signature, shapes and bits as the reference.

    ``ids`` ``[T]`` integer token ids and ``weight`` ``[V, D]``, each with any strides (read in
    place: a table is never copied).  Returns a new contiguous ``[T, D]`` tensor in ``weight``'s
    dtype."""
    vocab, width = weight.shape
    out = torch.empty((ids.shape[0], width), dtype=weight.dtype, device=weight.device)
    if out.numel() == 0:
        return out
    block = block_d(width)
    _embedding_kernel[(ids.shape[0], cdiv(width, block))](
        ids, weight, out, vocab, width, ids.stride(0), *weight.stride(), BLOCK_D=block, **pdl_args()
    )
    return out
