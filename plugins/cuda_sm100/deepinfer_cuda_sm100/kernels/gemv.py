"""``linear`` on a plain (bf16 / fp16) weight at decode widths: ``y = x @ w.T`` for up to
:data:`MAX_ROWS` token rows of a wide weight (V4's LM head, ``129280 x 4096``), one Triton launch
that streams the weight once at close to the HBM's rate and takes part in the step's
programmatic-dependent-launch chain (:mod:`.pdl`).

Two kernels, both with one program per ``BLOCK_N`` weight rows over all of ``K`` (no split, no
second launch), fp32 accumulation, the result rounded once to the activations' dtype:

* :func:`_gemv_row_kernel` (one token row): each program multiplies ``[BLOCK_N, BLOCK_K]`` weight
  tiles by the row's inputs elementwise in fp32 and sums them into a ``[BLOCK_N, BLOCK_K]``
  accumulator, reduced over ``K`` at the end: 8 weight rows of 1024 inputs a step keep 16 KiB of
  loads in flight per program.
* :func:`_gemv_dot_kernel` (2 to 16 rows): ``tl.dot`` of the rows (padded to 16 with zeros) by
  the transposed ``[BLOCK_N, BLOCK_K]`` weight tile, the weight read once for every row.

One-row programs take 8 weight rows where that leaves at least two programs an SM, else 4, 2 or
1 (:func:`row_block_n`: the narrow plain weights, a router's or a compressor's, still spread over
the SMs).  On an H100 the V4 head at 1 / 4 / 16 rows took 334 / 344 / 350 µs (3.17 / 3.08 / 3.02
TB/s) against cuBLAS's 376 / 387 / 384 µs; these block sizes are the fastest of a sweep of block
sizes, warps and stages (the grid ``bench_dense_gemv.py --sweep`` times).  Which calls take the GEMV is the
measured table's choice (:func:`deepinfer_cuda_sm100.gemm_dispatch.dense_refusal`);
:func:`gemv_problem` says which calls it can take.

The order of the fp32 sums differs from cuBLAS's, so results differ from the reference by
rounding only (the op's tolerance), and one row's result does not depend on the other rows of
its kernel; the two kernels differ from each other, so the batch-invariant mode does not take
this path (:func:`gemv_problem`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED
from .fp8_gemm import sm_count
from .pdl import pdl_args, pdl_enter

MAX_ROWS = 16
"""The most token rows this path takes (``tl.dot``'s smallest M tile)."""
ROW_BLOCK_N, ROW_BLOCK_K = 8, 1024
"""One row: weight rows and inputs per program step."""
DOT_BLOCK_N, DOT_BLOCK_K = 64, 256
"""2 to 16 rows: weight rows and inputs per program step."""
_FP32_DOT = tl.constexpr(INTERPRETED)  # the interpreter's bf16 tl.dot is not exact: fp32 there


@triton.jit
def _gemv_row_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    stride_w,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """``y[0, n] = sum_k x[0, k] w[n, k]`` for the program's ``BLOCK_N`` rows ``n``."""
    pdl_enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    inside = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_rows + (k0 + cols)[None, :], mask=inside[:, None], other=0.0)
        x = tl.load(x_ptr + k0 + cols)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _gemv_dot_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    stride_x,
    stride_w,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """``y[m, n] = sum_k x[m, k] w[n, k]`` for the ``M <= 16`` rows and the program's
    ``BLOCK_N`` weight rows ``n``."""
    pdl_enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, 16)
    cols = tl.arange(0, BLOCK_K)
    inside = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + tokens[:, None] * stride_x
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_rows + (k0 + cols)[None, :], mask=inside[:, None], other=0.0)
        x = tl.load(x_rows + (k0 + cols)[None, :], mask=tokens[:, None] < M, other=0.0)
        if _FP32_DOT:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out = y_ptr + tokens[:, None] * N + rows[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(tokens[:, None] < M) & inside[None, :])


def row_block_n(n: int, sms: int) -> int:
    """Weight rows per one-row program: :data:`ROW_BLOCK_N`, halved down to 1 while fewer than
    two programs an SM would run (shapes only)."""
    block = ROW_BLOCK_N
    while block > 1 and n < 2 * sms * block:
        block //= 2
    return block


def block_k(rows: int) -> int:
    """The inputs per program step of a call on ``rows`` token rows (shapes only)."""
    return ROW_BLOCK_K if rows == 1 else DOT_BLOCK_K


def gemv_problem(x: torch.Tensor, weight, interpreted: bool = INTERPRETED) -> str | None:
    """``None`` when :func:`gemv` can take ``linear(x, weight)`` on a plain weight, else why not
    (one line): not in the batch-invariant mode; tensors where the kernels run (the GPU, or the
    CPU under Triton's interpreter); bf16 or fp16 ``x`` and weight alike, unit stride along
    ``K``; 1 to :data:`MAX_ROWS` token rows; ``K`` a multiple of :func:`block_k`.  Shapes,
    dtypes and devices only (no device sync)."""
    from deepinfer_core.ops.modes import batch_invariant_enabled
    from deepinfer_cuda_sm100.checks import device_problem

    if batch_invariant_enabled():
        return "the batch-invariant mode runs the reference's fixed tiles"
    problem = device_problem(interpreted, [("x", x), ("weight", weight)])
    if problem:
        return problem
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return f"x {x.dtype} and weight {weight.dtype}: the GEMV takes bf16 or fp16, both alike"
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not form x @ weight.T"
    k = weight.shape[1]
    rows = x.numel() // max(k, 1)
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows: the GEMV takes 1 to {MAX_ROWS}"
    if k % block_k(rows) or weight.stride(1) != 1 or x.stride(-1) != 1:
        return (
            f"K={k}, weight strides {weight.stride()}, x strides {x.stride()}: the GEMV takes unit-stride K, "
            f"a multiple of {block_k(rows)}"
        )
    return None


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear(x, weight)`` by :func:`gemv` (:func:`gemv_problem` must be ``None``)."""
    n, k = weight.shape
    return gemv(x.reshape(-1, k), weight).reshape(*x.shape[:-1], n)


class Launch(NamedTuple):
    """A launch of one of the kernels: weight rows and inputs per program step, warps, stages."""

    block_n: int
    block_k: int
    warps: int
    stages: int


def default_launch(rows: int, n: int, sms: int) -> Launch:
    """The launch :func:`gemv` takes for ``rows`` token rows of an ``N``-row weight on ``sms``
    SMs (the fastest of ``bench_dense_gemv.py --sweep`` at the head; :func:`row_block_n`)."""
    if rows == 1:
        return Launch(row_block_n(n, sms), ROW_BLOCK_K, 8, 4)
    return Launch(DOT_BLOCK_N, DOT_BLOCK_K, 4, 4)


def launch(x2: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, cfg: Launch) -> None:
    """Write ``x2 @ weight.T`` into ``y [M, N]`` (contiguous) by the one-row kernel (``M == 1``)
    or the dot kernel, launched as ``cfg`` says (``cfg.block_k`` must divide ``K``)."""
    m, k = x2.shape
    n = weight.shape[0]
    grid = (triton.cdiv(n, cfg.block_n),)
    kw = dict(num_warps=cfg.warps, num_stages=cfg.stages, **pdl_args())
    if m == 1:
        _gemv_row_kernel[grid](x2, weight, y, n, weight.stride(0), k, cfg.block_n, cfg.block_k, **kw)
    else:
        _gemv_dot_kernel[grid](
            x2, weight, y, m, n, x2.stride(0), weight.stride(0), k, cfg.block_n, cfg.block_k, **kw
        )


def gemv(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 @ weight.T`` for ``x2 [M, K]`` (``1 <= M <= MAX_ROWS``, unit stride along ``K``) and
    a plain ``weight [N, K]`` (unit stride along ``K``), ``K`` a multiple of :func:`block_k`,
    both of one float dtype: ``[M, N]`` in that dtype (contiguous), by :func:`default_launch`.
    One compiled kernel per ``K``."""
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    launch(x2, weight, y, default_launch(m, n, sm_count(x2.device)))
    return y
