"""The GEMM of batch-invariant mode: ``tile_matmul(a [n, R, K], b [n, N, K]) -> [n, R, N]``.

Every fixed-tile product of the core's batch-invariant mode runs on this op (see
``deepinfer_core/ops/modes.py``), so providing it makes the reference's GEMM-bearing ops
(``linear`` on plain weights, ``grouped_linear``, ``moe_experts``) batch invariant on the GPU,
where ``torch.bmm`` is not: cuBLAS picks its kernel and split-K from the whole shape,
including the item count ``n``.

One launch shape for every call: program ``(item, row block, column block)`` computes a
``[BLOCK_M, BLOCK_N]`` output tile, walking K (a compile-time constant: one compiled kernel
per width) from 0 in steps of ``BLOCK_K`` with one
``tl.dot`` per step into an fp32 accumulator, and stores it in ``a``'s dtype.  The block sizes
depend on the dtype only, never on ``n``, ``R``, ``N``, ``K`` or strides, and no program's
result depends on another's, so an output element's bits are a function of its row of ``a``
and its row of ``b`` alone.  ``float32`` products run in full fp32 (``input_precision="ieee"``,
no TF32).

Under Triton's CPU interpreter the operands are converted to fp32 before the dot (its bf16
dot is unreliable) and bf16 stores round on the bits (:func:`~._common.cast_to`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED, cast_to, cdiv
from .pdl import pdl_args, pdl_enter

TILES = {torch.float32: (64, 64, 32), torch.bfloat16: (64, 64, 64), torch.float16: (64, 64, 64)}
"""``(BLOCK_M, BLOCK_N, BLOCK_K)`` per dtype: the only thing the launch shape depends on."""

_FP32_DOT = tl.constexpr(INTERPRETED)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _tile_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    R,
    N,
    sa0,
    sa1,
    sa2,
    sb0,
    sb1,
    sb2,
    sc0,
    sc1,
    K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    item = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + item.to(tl.int64) * sa0
    b_base = b_ptr + item.to(tl.int64) * sb0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(
            a_base + rows[:, None] * sa1 + kk[None, :] * sa2,
            mask=(rows[:, None] < R) & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_base + cols[None, :] * sb1 + kk[:, None] * sb2,
            mask=(cols[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        if _FP32_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = c_ptr + item.to(tl.int64) * sc0 + rows[:, None] * sc1 + cols[None, :]
    tl.store(c, cast_to(acc, OUT_DTYPE), mask=(rows[:, None] < R) & (cols[None, :] < N))


def tile_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.transpose(1, 2)`` for ``a [n, R, K]``, ``b [n, N, K]`` (any strides, ``b`` may be
    a stride-0 expansion), in ``a``'s dtype, with bits independent of ``n`` and the other rows
    (the contract of the core op ``tile_matmul``)."""
    n, r, k = a.shape
    big_n = b.shape[1]
    out = torch.empty((n, r, big_n), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    bm, bn, bk = TILES[a.dtype]
    b = b.to(a.dtype)
    grid = (n, cdiv(r, bm), cdiv(big_n, bn))
    _tile_matmul_kernel[grid](
        a,
        b,
        out,
        r,
        big_n,
        *a.stride(),
        *b.stride(),
        out.stride(0),
        out.stride(1),
        K=k,
        OUT_DTYPE=_TL_DTYPES[a.dtype],
        IEEE=a.dtype == torch.float32,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=4,
        **pdl_args(),
    )
    return out
