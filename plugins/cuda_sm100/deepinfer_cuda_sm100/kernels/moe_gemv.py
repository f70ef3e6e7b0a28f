"""``moe_experts`` at decode width: FP4 experts as GEMVs on CUDA cores, many small programs.

Contract: ``deepinfer_core.ops.moe.moe_experts``.  Built for calls with very few (token, slot)
pairs per expert (a decode step of a few tokens: at ``T = 1``, top-6, each routed expert has
one row), where :mod:`~deepinfer_cuda_sm100.kernels.moe`'s tiles of 16 rows carry one valid
row and few CTAs stream the experts' weights.  Here no tensor-core tile: each program computes
a few output features of one (token, slot) pair as dot products over the whole K on CUDA cores
(:func:`~deepinfer_cuda_sm100.kernels.moe_gemv_rows.gemv_rows`, with the FP4 loads and the
e2m1 decoding of :mod:`~deepinfer_cuda_sm100.kernels.moe`: inline PTX on the GPU, arithmetic
in the interpreter).  Three launches, no host synchronisation (the grids depend on shapes only:
CUDA-graph capturable), the two GEMVs each with a :class:`GemvLaunch` (defaults :data:`GATE_UP`,
:data:`DOWN`; a call may pass others, as ``scripts/bench_moe.py --gemv-sweep`` does):

1. :func:`_gemv_gate_up_kernel`, a program per (pair ``t * k + j``, block of ``block_n``
   intermediate features): the pair's expert's gate and up rows of those features times
   ``x[t]`` over ``D``, then the clamped SwiGLU at the Triton path's rounding points (gate and
   up, ``silu`` and ``h`` rounded to ``x``'s dtype: the same helper as its gate / up kernel);
   ``h [T * k, I]`` in ``x``'s dtype.
2. :func:`_gemv_down_kernel`, a program per (pair, block of ``2 * block_n`` model features, two
   row sets): the pair's expert's down rows times its ``h`` row over ``I``; the contribution
   rounded to ``x``'s dtype, times the routing weight rounded to it, rounded again (the Triton
   path's stored contribution), stored at row ``t * k + j`` of ``y [T * k, D]``.
3. The Triton path's combine (:func:`~deepinfer_cuda_sm100.kernels.moe.combine_pairs`, a program
   per token and 1024 model features): the token's contributions summed in fp32 in ascending
   (expert, slot) order, the order of the contract; with ``shared`` the sum rounded to ``x``'s
   dtype and the shared expert's row added (the reference's ``routed + shared``).  These are the
   values and the order of a down program per token summing its slots itself, so the result is
   bitwise that formulation's (``tests/test_moe_gemv.py`` compares the two in the interpreter),
   with ``k`` times the down programs at the price of a launch and the ``[T * k, D]``
   contributions' round trip through L2.

A pair whose id is outside ``[0, E)`` returns at once in launches 1 and 2 (its rows of ``h``
and ``y`` are neither written nor read) and the combine skips it: it contributes nothing.  No
atomics: a token's result depends on its own row only, summed in a fixed order.

**The dot products.**  K steps of ``block_k`` inputs; per step and row set the packed bytes as
a ``[block_n, runs, 16]`` tile (a run: the 16 bytes, 32 inputs, of one scale group; one run of
one row per thread at the default sizes, a 16-byte load), one scale per run and the
activations' even and odd inputs, widened to fp32.  Two ways by the scales:

* **ue8m0 scales, bf16 or fp32 activations: the scale folded after the run's sum.**  The e2m1
  values ``v`` are decoded unscaled (no per-group table, no bf16x2 scale product), each run's 32
  fp32 products ``v * x`` summed within the thread, and the run's sum times its scale ``s =
  2**(e - 127)`` added to an fp32 accumulator per (row, run): an FADD and an FFMA per 32
  weights (not a bf16x2 product per two).  Exact: ``v`` has two significant bits, so the
  reference's weight ``v * s`` (rounded to ``x``'s dtype) is exact in bf16 and fp32 alike (both
  have fp32's exponent range); its product with a bf16 ``x`` (8 bits) is exact in fp32 (with an
  fp32 ``x`` it rounds once, to the same bits either way); and multiplying by a power of two
  commutes with every fp32 rounding, so ``s * sum(v * x) == sum((v * s) * x)`` bitwise for the
  same summation order.  The limit is fp32's
  range, where the reference's bf16 dequantisation has its own: at ``e = 254`` the weights
  ``|v| >= 2`` overflow to ``inf`` there while the folded products stay finite, and products or
  sums below ``2**-126`` (subnormal) or past ``2**128`` round once here, per product there.
  Scale bytes 0 and 255 (torch reads ``2**-127`` and NaN) are taken as the fp32 exponent field,
  as the Triton path does: 0 and ``inf``.  A group of byte 0 contributes nothing (as there); one
  of byte 255 makes the row non-finite (as there and in the reference; the bits may differ:
  ``inf`` times the run's sum here is ±inf, NaN for a zero sum, where the Triton path's ``inf``
  weights give NaN for every zero code).  fp16 activations keep the dequantised weights: ``v *
  s`` may round in fp16, which the fold would skip.
* **float32 scales (and fp16 activations)**: each weight dequantised to ``x``'s dtype (``value *
  scale`` rounded, bitwise :meth:`QuantizedTensor.dequantize`; its products round, so they
  cannot be folded), the fp32 products ``w * x`` (exact for bf16 and fp16 activations)
  accumulated elementwise in an fp32 ``[block_n, runs, 16]`` tile.

The accumulators are reduced after the K loop.  So a result differs from the Triton path's only
in the fp32 summation order of the dot products: not its bits, so the dispatcher never takes it
in the batch-invariant mode (within this path a row's result does not depend on the other rows
either).

**Sizes** (V4-Flash, ``D = 4096``, ``I = 2048``, ``T = 1``, top-6; defaults): gate / up 6 x 256 =
1536 programs of 8 features (16 weight rows, 32 KiB of packed FP4), 8 K steps of 512 inputs;
down 6 x 256 = 1536 programs of 16 model features (two row sets of 8, 16 KiB), 4 K steps of 512
inputs; 4 warps, one stage; the combine 4 programs.  Offline compile for sm_90 (Triton 3.6, bf16
activations; ``tests/test_moe_gemv.py`` prints each kernel's resource line): 72 registers with
ue8m0 scales, 128 with float32 scales, both kernels, no stack or local memory.  SASS of a K step
(two row sets of 32 weights a thread; counted offline, not timed): ue8m0 317 instructions (~5.0
a weight: decoding 1.9, widening 1, FFMA 1, the rest layout conversions through shared memory
and the loop), float32 scales 550 (~8.6).  Speed on the GPU: ``scripts/bench_moe.py``'s
``triton_gemv_fp4`` column; ``--gemv-sweep`` times each kernel over a grid of launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer_core.weights.quant import QuantizedTensor

from ._common import INTERPRETED, cast_to, cdiv, pow2, round_through
from .moe import _clamped_swiglu, _weight_args, combine_pairs, e2m1_ptx, empty_call
from .moe_gemv_rows import gemv_rows
from .pdl import pdl_args, pdl_enter


class GemvLaunch(NamedTuple):
    """A GEMV kernel's launch: ``block_n`` weight rows a row set (gate / up: intermediate
    features, each with its gate and its up row; down: model features, two sets a program),
    ``block_k`` inputs a K step (at most the width's power of two), Triton's ``num_warps`` and
    ``num_stages``.  Powers of two; the FP4 decoding runs in PTX for at least 4 packed bytes a
    thread and set (``block_n * block_k >= 256 * warps``), else arithmetically (slow)."""

    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 1


GATE_UP = GemvLaunch(4, 512, 2, 1)
"""The gate / up launch: 4 features a program (their 8 rows), 2 warps, 3072 programs at T = 1;
the fastest of ``bench_moe.py --gemv-sweep`` on the H200 at 1, 2 and 4 tokens (27.2 µs at one
token over 64 experts of 4096 x 2048, top-6: 1.97 TB/s; 8 features and 4 warps 30.3 µs)."""
DOWN = GemvLaunch(4, 512, 2, 1)
"""The down launch: the gate / up kernel's thread tile, 8 model features a program; the
sweep's fastest at 1, 2 and 4 tokens (15.6 µs at one token, 1.71 TB/s; before 17.0)."""
INTERPRETER_BLOCK_N = 64
"""Default rows per row set under Triton's interpreter, whose cost is per program."""
MAX_TOKENS = 16
"""Most tokens :func:`~deepinfer_cuda_sm100.moe_dispatch.gemv_supports` lets through: a GEMV
reads an expert's weights once per pair, the tiled kernels once per tile of 16 or more rows."""
_FP32_DOT = tl.constexpr(INTERPRETED)


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr,
    stride_x,
    ids_ptr,
    stride_ids,
    w_ptr,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    h_ptr,
    E,
    limit,
    TOP_K: tl.constexpr,
    D: tl.constexpr,
    I: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Pair ``program_id(0)`` (``t * TOP_K + j``), intermediate features ``program_id(1) *
    BLOCK_N ..``: the pair's ``h`` (clamped SwiGLU of its expert's gate and up rows times
    ``x[t]``), stored at row ``t * TOP_K + j`` of ``h [T * TOP_K, I]``."""
    pdl_enter(USE_PDL)
    pair = tl.program_id(0)
    t = (pair // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + t * stride_ids + pair % TOP_K).to(tl.int64)
    if (expert >= 0) & (expert < E):  # other ids contribute nothing: no row
        dtype = x_ptr.dtype.element_ty
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < I
        w_gate = expert * stride_we + cols.to(tl.int64) * stride_wn
        s_gate = expert * stride_se + cols.to(tl.int64) * stride_sn
        g, u = gemv_rows(
            x_ptr + t * stride_x, w_ptr, w_gate, w_gate + I * stride_wn,
            s_ptr, s_gate, s_gate + I * stride_sn, n_ok, n_ok, E >> 31,
            D, dtype, UE8M0, HALF_GROUP, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
        )  # fmt: skip
        h = _clamped_swiglu(g, u, limit, dtype)
        tl.store(h_ptr + pair.to(tl.int64) * I + cols, h, mask=n_ok)


@triton.jit
def _gemv_down_kernel(
    h_ptr,
    ids_ptr,
    stride_ids,
    rw_ptr,
    stride_rw,
    w_ptr,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    y_ptr,
    E,
    TOP_K: tl.constexpr,
    D: tl.constexpr,
    I: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Pair ``program_id(0)`` (``t * TOP_K + j``), model features ``program_id(1) * 2 * BLOCK_N
    ..`` (two row sets of ``BLOCK_N``): the pair's weighted contribution (see the module
    docstring), stored at row ``t * TOP_K + j`` of ``y [T * TOP_K, D]``."""
    pdl_enter(USE_PDL)
    pair = tl.program_id(0)
    t = (pair // TOP_K).to(tl.int64)
    j = pair % TOP_K
    expert = tl.load(ids_ptr + t * stride_ids + j).to(tl.int64)
    if (expert >= 0) & (expert < E):  # other ids contribute nothing: no row
        dtype = y_ptr.dtype.element_ty
        # the Triton path's contribution: the output and the weight in x's dtype, their product
        # rounded to it (the reference's default paths); the weight loaded before the dot
        # products, so its latency overlaps theirs
        rw = round_through(tl.load(rw_ptr + t * stride_rw + j).to(tl.float32), dtype)
        cols0 = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
        cols1 = cols0 + BLOCK_N
        w_rows = expert * stride_we + cols0.to(tl.int64) * stride_wn
        s_rows = expert * stride_se + cols0.to(tl.int64) * stride_sn
        y0, y1 = gemv_rows(
            h_ptr + pair.to(tl.int64) * I, w_ptr, w_rows, w_rows + BLOCK_N * stride_wn,
            s_ptr, s_rows, s_rows + BLOCK_N * stride_sn, cols0 < D, cols1 < D, E >> 31,
            I, dtype, UE8M0, HALF_GROUP, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
        )  # fmt: skip
        row = y_ptr + pair.to(tl.int64) * D
        tl.store(row + cols0, cast_to(round_through(y0, dtype) * rw, dtype), mask=cols0 < D)
        tl.store(row + cols1, cast_to(round_through(y1, dtype) * rw, dtype), mask=cols1 < D)


def _default(launch: GemvLaunch) -> GemvLaunch:
    """A default launch as this process runs it (under the interpreter: wider row sets)."""
    return launch._replace(block_n=INTERPRETER_BLOCK_N) if INTERPRETED else launch


def launch_plan(
    tokens: int,
    top_k: int,
    hidden: int,
    inter: int,
    gate_up: GemvLaunch | None = None,
    down: GemvLaunch | None = None,
) -> dict[str, dict]:
    """The GEMV launches from shapes only (``gate_up`` / ``down``: :class:`GemvLaunch` overrides
    of :data:`GATE_UP` / :data:`DOWN`): for ``gate_up`` and ``down`` the ``grid``, ``block_n``
    (rows per set), ``block_k`` (inputs per K step, clamped to ``[32, pow2(K)]``), ``warps``,
    ``stages`` and whether the FP4 decoding runs in PTX (``e2m1_ptx``; never under the
    interpreter).  Raises ``ValueError`` for sizes or warps that are not powers of two."""
    plan = {}
    for name, launch, k, n, cols in (
        ("gate_up", gate_up or _default(GATE_UP), hidden, inter, 1),
        ("down", down or _default(DOWN), inter, hidden, 2),
    ):
        if any(v < 1 or pow2(v) != v for v in launch[:3]) or launch.stages < 1:
            raise ValueError(f"{name} launch {launch}: sizes and warps must be powers of two, stages >= 1")
        bk = max(32, min(launch.block_k, pow2(k)))
        plan[name] = {
            "grid": (tokens * top_k, cdiv(n, cols * launch.block_n)),
            "block_n": launch.block_n,
            "block_k": bk,
            "warps": launch.warps,
            "stages": launch.stages,
            "e2m1_ptx": e2m1_ptx(launch.block_n, bk, launch.warps),
        }
    return plan


def gate_up_h(x: torch.Tensor, ids: torch.Tensor, gate_up, limit: float, plan: dict) -> torch.Tensor:
    """Launch 1: ``h [T * k, I]`` (``x``'s dtype), row ``t * k + j`` the clamped SwiGLU of pair
    ``(t, j)`` (rows of ids outside ``[0, E)`` unwritten).  ``x`` ``[T, D]`` and ``ids``
    ``[T, k]`` unit-strided along their last dim; ``plan``: :func:`launch_plan`'s
    ``"gate_up"``."""
    gu, gu_se, gu_sn, gu_s, gu_sse, gu_ssn, _, ue8m0, half = _weight_args(gate_up)
    t, d = x.shape
    top_k, inter = ids.shape[1], gate_up.shape[1] // 2
    h = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    _gemv_gate_up_kernel[plan["grid"]](
        x, x.stride(0), ids, ids.stride(0), gu, gu_se, gu_sn, gu_s, gu_sse, gu_ssn, h,
        gate_up.shape[0], float(limit), TOP_K=top_k, D=d, I=inter, UE8M0=ue8m0, HALF_GROUP=half,
        BLOCK_N=plan["block_n"], BLOCK_K=plan["block_k"], FP32_DOT=_FP32_DOT,
        E2M1_PTX=plan["e2m1_ptx"], num_warps=plan["warps"], num_stages=plan["stages"], **pdl_args(),
    )  # fmt: skip
    return h


def down_contributions(
    h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, down, plan: dict
) -> torch.Tensor:
    """Launch 2: ``y [T * k, D]`` (``h``'s dtype), row ``t * k + j`` pair ``(t, j)``'s weighted
    contribution, rounded as the Triton path stores it (rows of ids outside ``[0, E)``
    unwritten).  ``h``: :func:`gate_up_h`'s; ``ids`` / ``weights`` ``[T, k]`` unit-strided along
    the slots; ``plan``: :func:`launch_plan`'s ``"down"``."""
    dn, dn_se, dn_sn, dn_s, dn_sse, dn_ssn, _, ue8m0, half = _weight_args(down)
    d, inter = down.shape[1], down.shape[2]
    top_k = ids.shape[1]
    y = torch.empty(h.shape[0], d, dtype=h.dtype, device=h.device)
    _gemv_down_kernel[plan["grid"]](
        h, ids, ids.stride(0), weights, weights.stride(0), dn, dn_se, dn_sn, dn_s, dn_sse, dn_ssn,
        y, down.shape[0], TOP_K=top_k, D=d, I=inter, UE8M0=ue8m0, HALF_GROUP=half,
        BLOCK_N=plan["block_n"], BLOCK_K=plan["block_k"], FP32_DOT=_FP32_DOT,
        E2M1_PTX=plan["e2m1_ptx"], num_warps=plan["warps"], num_stages=plan["stages"], **pdl_args(),
    )  # fmt: skip
    return y


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up,
    down,
    limit: float,
    shared: torch.Tensor | None = None,
    *,
    gate_up_launch: GemvLaunch | None = None,
    down_launch: GemvLaunch | None = None,
) -> torch.Tensor:
    """``moe_experts`` (the core contract) by decode-width GEMVs on FP4 expert stacks.

    ``x`` ``[T, D]`` (float32 / bfloat16 / float16); ``ids`` / ``weights`` ``[T, k]`` (an id
    outside ``[0, E)`` contributes nothing); ``gate_up`` ``[E, 2I, D]`` and ``down`` ``[E, D, I]``:
    FP4 :class:`~deepinfer_core.weights.quant.QuantizedTensor` stacks (ue8m0 or float32 scales,
    scale groups a power of two dividing the widths, unit stride along the inputs); ``shared``
    (optional ``[T, D]``, ``x``'s dtype) added as the reference does.  ``gate_up_launch`` /
    ``down_launch``: :class:`GemvLaunch` overrides of :data:`GATE_UP` / :data:`DOWN` (other
    sizes may change the fp32 summation order of the dot products, not the rounding).  Returns
    ``[T, D]`` in ``x``'s dtype.

    Three launches (see the module docstring), no host sync.  For calls with few pairs per
    expert: the dispatcher takes it only where the measured table timed it fastest, never in the
    batch-invariant mode (:func:`~deepinfer_cuda_sm100.moe_dispatch.gemv_supports`).
    """
    for name, w in (("gate_up", gate_up), ("down", down)):
        if not isinstance(w, QuantizedTensor) or w.fmt != "fp4":
            raise ValueError(f"{name}: the decode-width GEMVs read FP4 QuantizedTensor stacks")
    t, d = x.shape
    num_experts, inter = gate_up.shape[0], down.shape[2]
    out, done = empty_call(x, ids, num_experts, shared)
    if done:
        return out
    x, ids, weights = (v if v.stride(1) == 1 else v.contiguous() for v in (x, ids, weights))
    plan = launch_plan(t, ids.shape[1], d, inter, gate_up_launch, down_launch)
    h = gate_up_h(x, ids, gate_up, limit, plan["gate_up"])
    y = down_contributions(h, ids, weights, down, plan["down"])
    return combine_pairs(y, ids, num_experts, False, shared, out)
