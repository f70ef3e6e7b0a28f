"""``linear`` over an FP8 block weight by the fastest path measured at its shape.

Three paths compute the contract's arithmetic (a quantised weight counts as its dequantised
value, :func:`deepinfer_core.ops.linear.linear`):

- ``"triton"``: the FP8 block GEMM (:mod:`deepinfer_cuda_sm100.kernels.fp8_gemm`), which reads
  the e4m3 tiles and scales them in registers: fewest bytes, the decode path;
- ``"cublas"``: the weight dequantised by one kernel into a scratch tensor
  (:mod:`deepinfer_cuda_sm100.kernels.fp8_dequant`, bitwise the reference's dequantisation),
  then cuBLAS's ``F.linear``: the reference op's own computation, at cuBLAS's tensor-core rate
  (prefill shapes, where the GEMM is compute-bound and the extra weight pass is small);
- ``"tilelang"``: the TileLang GEMM (:mod:`deepinfer_cuda_sm100.tl.fp8_gemm`, ``M <= 256``,
  bfloat16 activations): TMA weight stream, register-A wgmma on the transposed product, the
  weight converted to the reference's dequantised bf16 value.  Taken only where TileLang can
  compile here (:func:`~deepinfer_cuda_sm100.tl.tilelang_problem`, else one warning and the
  other paths) and the kernel takes the call (:func:`~deepinfer_cuda_sm100.tl.fp8_gemm.problem`).

In the opt-in W8A8 prefill (``DEEPINFER_FP8_PREFILL=w8a8``, :mod:`~deepinfer_cuda_sm100.kernels.
fp8_gemm`) the two paths are Triton's W8A8 tile and ``"scaled_mm"``, cuBLAS's block-scaled FP8
GEMM on the same quantised activations (:mod:`deepinfer_cuda_sm100.scaled_mm`).

The grouped output projection (``grouped_linear``, ``x [T, G, K]`` times the ``G`` row blocks
of one ``[G*N, K]`` weight) has three paths: ``"triton"`` (every group in one launch of the same
kernel), ``"tilelang"`` (the TileLang GEMM, each CTA's activation tile read from its group's
inputs: :func:`~deepinfer_cuda_sm100.tl.fp8_gemm.grouped_linear_fp8`) and ``"cublas"`` (the weight
dequantised, then the reference's batched GEMM, bitwise the reference), chosen by the table's
op ``"grouped_linear_fp8"`` (kind ``"w8a16"``, keyed by the
weight's ``G*N x K``, the groups as ``keys`` and the call's ``T``).

A call takes the path the measured table of this GPU's architecture
(:mod:`deepinfer_cuda_sm100.kernel_choice`, op ``"linear_fp8"``, kind ``"w8a16"`` or
``"w8a8"``, keyed by the weight's ``N x K`` and the call's rows ``M``; re-measured by ``python
plugins/cuda_sm100/scripts/bench_fp8_gemm.py --write-choices``) found fastest at the nearest
measured ``M``.  Where no point was measured around the call, a W8A16 call of more than
:data:`PREFILL_ROWS` rows takes ``"cublas"`` and any other Triton (:func:`default_path`).
Batch-invariant mode always takes Triton (cuBLAS picks kernels by the whole shape; the
TileLang GEMM's tile and splits change with M).
The TileLang GEMM's K splits are measured too (:mod:`deepinfer_cuda_sm100.gemm_splits`). The
choice depends on static shapes only, so a captured graph replays what it captured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer_core.ops.modes import batch_invariant_enabled
from deepinfer_core.weights.quant import QuantizedTensor
from deepinfer_cuda_sm100 import kernel_choice, tl

OP = "linear_fp8"
"""The op name of the GEMM points in the measured table."""
V4_FLASH_SHAPES = "4096x1536,1024x32768,1024x8192,8192x4096,4096x4096,2048x4096,4096x1024,4096x512,4096x2048"
"""``K x N`` of DeepSeek-V4-Flash's FP8 projections as the V4 model runs them (``q_a`` + ``kv``
fused, ``q_b``, the indexer's ``q_b``, ``o_b``, the shared expert's gate + up fused and its
down), then the unfused ``q_a``, ``kv`` and gate: the shapes the shipped table measures
(``bench_fp8_gemm.py``) and the TileLang GEMMs precompiled (``tl.precompile``)."""
DENSE_OP = "linear_dense"
"""The op name of the plain-weight points in the measured table: ``cublas`` (the reference's
``F.linear``, the default) against the dense GEMV (``triton``, :mod:`~deepinfer_cuda_sm100.
kernels.gemv`), keyed by the weight's ``N`` (``heads``) and ``K`` (``head_dim``, ``keys``) and
the call's rows (``tokens``); ``bench_dense_gemv.py --write-choices`` measures them."""
DENSE_PATHS = frozenset({"cublas", "triton"})
V4_FLASH_GROUPED = "8x4096x1024"
"""``G x K x N`` of V4-Flash's grouped output projection ``o_a`` (8 groups of 4096 -> 1024)."""
GROUPED_OP = "grouped_linear_fp8"
"""The op name of the grouped GEMM points in the measured table."""
GROUPED_PATHS = frozenset({"triton", "cublas", "tilelang"})
"""The paths of the grouped GEMM (W8A16 only)."""
PREFILL_ROWS = 256
"""Above this many rows, a W8A16 call the table has no point around takes ``"cublas"`` (the
weight dequantised, then cuBLAS), not the Triton GEMM.  Such a call is compute-bound: the
GEMM's FLOPs grow with the rows while the extra pass over the weight does not, and Triton's
W8A16 tile runs well below cuBLAS's tensor-core rate there.  The shipped table's points: at
1,024, 4,096 and 8,192 rows (six V4-Flash weight shapes, an H200) the cuBLAS path is 1.9-4.8x
faster than Triton at all 18; at 256 rows (an H100) faster at 9 of the 10 weights (the
grouped one included), 0.94x at the other; the TileLang GEMM takes at most 256 rows.  At most this
many rows the decode kernels are the measured choice, so an unmeasured call keeps Triton."""
PATHS = {
    "w8a16": frozenset({"triton", "cublas", "tilelang"}),
    "w8a8": frozenset({"triton", "scaled_mm"}),
}
"""The paths of each math."""
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def dense_refusal(x: torch.Tensor, weight: torch.Tensor, interpreted: bool) -> str | None:
    """``None`` when ``linear(x, weight)`` on a plain weight takes the dense GEMV: the kernel can
    take the call (:func:`~deepinfer_cuda_sm100.kernels.gemv.gemv_problem`) and the measured table
    (op :data:`DENSE_OP`) found it faster than cuBLAS at this weight and the nearest measured rows
    (by the table's margin); else why not.  Under Triton's interpreter the shipped SM90 table
    decides.  Shapes only: a captured graph replays what it captured."""
    from deepinfer_cuda_sm100.kernels.gemv import gemv_problem

    problem = gemv_problem(x, weight, interpreted)
    if problem:
        return problem
    n, k = weight.shape
    arch = "sm90" if interpreted else kernel_choice.device_arch(x.device)
    key = (DENSE_OP, "w16", _DTYPES[x.dtype], n, k, x.numel() // k, k, arch, DENSE_PATHS)
    if kernel_choice.choose(*key, default="cublas") != "triton":
        return f"{n}x{k} at {x.numel() // k} rows: cuBLAS, as measured (or unmeasured) here"
    return None


def tilelang_usable(x: torch.Tensor, weight, groups: int = 0) -> bool:
    """Whether the TileLang GEMM may take this W8A16 call (``groups``: a grouped one): TileLang
    compiles here (else one warning) and the kernel takes the shapes and dtypes."""
    from deepinfer_cuda_sm100.tl import fp8_gemm as tl_gemm

    if not tl.usable_for("linear (FP8)", "the Triton and cuBLAS paths serve every call"):
        return False
    return tl_gemm.problem(x, weight, groups) is None


def choose_path(x: torch.Tensor, weight) -> str:
    """``"triton"``, ``"cublas"``, ``"tilelang"`` or ``"scaled_mm"`` for ``linear(x, weight)``
    (see the module docstring)."""
    from deepinfer_cuda_sm100 import scaled_mm
    from deepinfer_cuda_sm100.kernels import fp8_gemm

    if batch_invariant_enabled() or x.device.type != "cuda":
        return "triton"
    math = "w8a8" if fp8_gemm.prefill_w8a8(x) else "w8a16"
    paths = PATHS[math] if math == "w8a16" or scaled_mm.available() else frozenset({"triton"})
    n, k = weight.data.shape
    m = x.numel() // max(k, 1)
    default = default_path(m) if math == "w8a16" else "triton"
    return _choose_usable(x, weight, 0, (OP, math, _DTYPES[x.dtype], n, k, m, k), paths, default)


def default_path(rows: int) -> str:
    """The W8A16 path of a call of ``rows`` rows where the table has no point around it:
    ``"cublas"`` above :data:`PREFILL_ROWS`, else ``"triton"``."""
    return "cublas" if rows > PREFILL_ROWS else "triton"


def _choose_usable(
    x: torch.Tensor, weight, groups: int, key: tuple, paths: frozenset[str], default: str
) -> str:
    """The table's choice for ``key`` (op, kind, dtype, heads, head dim, tokens, keys) among
    ``paths``, ``default`` where no point decides; where that is TileLang but the kernel cannot
    take the call (:func:`tilelang_usable` with ``groups``), the choice among the others.  The
    TileLang checks run only where the table picks it: the other calls stay a memoised lookup."""
    arch = kernel_choice.device_arch(x.device)
    choice = kernel_choice.choose(*key, arch, paths, default=default)
    if choice == "tilelang" and not tilelang_usable(x, weight, groups):
        paths = paths - {"tilelang"}
        choice = kernel_choice.choose(*key, arch, paths, default=default)
    return choice if choice in paths else "triton"


def tilelang_splits(x: torch.Tensor, m: int, n: int, k: int, groups: int) -> int | None:
    """The TileLang GEMM's K splits for an ``M``-token call of an ``N x K`` weight on ``x``'s
    device: the measured table's count (:mod:`deepinfer_cuda_sm100.gemm_splits`), ``None`` for
    the plan's rule."""
    from deepinfer_cuda_sm100.gemm_splits import measured_splits
    from deepinfer_cuda_sm100.kernels.fp8_gemm import sm_count

    arch = kernel_choice.device_arch(x.device)
    return measured_splits(m, n, k, sm_count(x.device), groups, arch)


def cublas_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """The ``"cublas"`` path: dequantise (bitwise the reference's), then ``F.linear``."""
    from deepinfer_cuda_sm100.kernels.fp8_dequant import dequantize_fp8

    return F.linear(x, dequantize_fp8(weight.data, weight.scale, tuple(weight.block), x.dtype))


def choose_grouped_path(x: torch.Tensor, weight) -> str:
    """``"triton"``, ``"tilelang"`` or ``"cublas"`` for ``grouped_linear(x [T, G, K], weight
    [G*N, K])`` (see the module docstring; Triton in the batch-invariant mode, off CUDA and in
    the W8A8 prefill)."""
    from deepinfer_cuda_sm100.kernels import fp8_gemm

    if batch_invariant_enabled() or x.device.type != "cuda" or fp8_gemm.prefill_w8a8(x[:, 0]):
        return "triton"
    t, groups, k = x.shape
    rows = weight.data.shape[0]
    key = (GROUPED_OP, "w8a16", _DTYPES[x.dtype], rows, k, t, groups)
    return _choose_usable(x, weight, groups, key, GROUPED_PATHS, default_path(t))


def cublas_grouped_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """The grouped ``"cublas"`` path: dequantise (bitwise the reference's), then the reference's
    batched GEMM."""
    from deepinfer_core.ops.linear import grouped_linear
    from deepinfer_cuda_sm100.kernels.fp8_dequant import dequantize_fp8

    return grouped_linear(x, dequantize_fp8(weight.data, weight.scale, tuple(weight.block), x.dtype))


def make_grouped_linear(triton_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The ``grouped_linear`` op: the path :func:`choose_grouped_path` picks, ``triton_fn`` for
    ``"triton"``."""

    def grouped_linear(x, weight) -> torch.Tensor:
        path = choose_grouped_path(x, weight)
        if path == "cublas":
            return cublas_grouped_linear(x, weight)
        if path == "tilelang":
            from deepinfer_cuda_sm100.tl.fp8_gemm import grouped_linear_fp8

            t, groups, k = x.shape
            return grouped_linear_fp8(x, weight, tilelang_splits(x, t, weight.data.shape[0], k, groups))
        return triton_fn(x, weight)

    grouped_linear.__doc__ = f"Dispatcher over the grouped FP8 GEMM's paths.\n\n{__doc__}"
    return grouped_linear


def make_linear(triton_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The op: the path :func:`choose_path` picks, ``triton_fn`` for ``"triton"``."""

    def linear(x, weight) -> torch.Tensor:
        if not isinstance(weight, QuantizedTensor):  # ``supports`` let only the GEMV's through
            # (dense_refusal)
            from deepinfer_cuda_sm100.kernels.gemv import dense_linear

            return dense_linear(x, weight)
        path = choose_path(x, weight)
        if path == "cublas":
            return cublas_linear(x, weight)
        if path == "scaled_mm":
            from deepinfer_cuda_sm100.scaled_mm import scaled_mm_linear

            return scaled_mm_linear(x, weight)
        if path == "tilelang":
            from deepinfer_cuda_sm100.tl.fp8_gemm import linear_fp8

            n, k = weight.data.shape
            return linear_fp8(x, weight, splits=tilelang_splits(x, x.numel() // k, n, k, 1))
        return triton_fn(x, weight)

    linear.__doc__ = (
        "Dispatcher over the FP8 block GEMM and the cuBLAS paths; a plain weight takes the dense GEMV "
        f"(kernels.gemv).\n\n{__doc__}"
    )
    return linear
