"""``moe_experts`` by kernel path: TileLang, the decode-width GEMVs, the dequantised experts or
cuBLAS's grouped GEMMs where measured faster, else Triton.

:func:`make_moe_experts` wraps the Triton path (:mod:`deepinfer_cuda_sm100.kernels.moe`, which
takes every call the backend's ``supports`` accepts) in a dispatcher.  A call leaves it only
when all of these hold:

- it runs on a CUDA device and the engine is not in batch-invariant mode (the paths accumulate
  in different orders and the choice below depends on the token count, so a token's bits would
  change with the batch; the batch-invariant mode keeps Triton throughout);
- the FP4 experts' math is the default ``bf16`` (``DEEPINFER_MOE_MATH=fp8`` is Triton's);
- the other path takes the call: the TileLang GEMMs (:mod:`deepinfer_cuda_sm100.tl.moe`) where
  TileLang can compile here (:func:`~deepinfer_cuda_sm100.tl.tilelang_problem`; if not, one
  warning says why and how to install it) and :func:`tilelang_supports` (bfloat16 activations,
  both stacks FP4 with scale groups of 32, hidden and intermediate widths multiples of 128,
  ...); the decode-width GEMVs (:mod:`deepinfer_cuda_sm100.kernels.moe_gemv`, Triton) where
  :func:`gemv_supports` takes it (bfloat16, FP4 stacks in groups of 32, at most
  :data:`~deepinfer_cuda_sm100.kernels.moe_gemv.MAX_TOKENS` tokens); the dequantised experts
  (:mod:`deepinfer_cuda_sm100.kernels.moe_dequant`: the FP4 stacks decoded once per call into
  scratch stacks, then Triton's plain-stack launches) where :func:`dequant_supports` does; the
  grouped GEMMs (:mod:`deepinfer_cuda_sm100.kernels.moe_grouped`: ``torch._grouped_mm`` over the
  expert-sorted pairs, FP4 stacks dequantised first; plain bf16 stacks too) where
  :func:`grouped_supports` does;
- the measured table of this GPU's architecture (:mod:`deepinfer_cuda_sm100.kernel_choice`, op
  ``moe_experts``, kind :func:`choice_kind`, ``heads`` = hidden, ``head_dim`` = intermediate,
  ``tokens`` = (token, slot) pairs, ``keys`` = experts) picks it at the nearest measured point;
  unmeasured shapes stay on Triton.

The table names the paths as languages: ``"tilelang"`` (one consumer warpgroup a CTA),
``"tilelang_wide"`` (two, :func:`~deepinfer_cuda_sm100.tl.moe.moe_experts`'s ``consumers=2``;
bitwise the same result), ``"triton_gemv"`` (the decode-width GEMVs), ``"triton_dequant"`` (the
dequantised experts) and ``"cublas_grouped"`` (the grouped GEMMs; the only other path of plain
bf16 stacks, whose points have the kind ``bf16``).  Each is a language of
its own in the table: taken only where it was timed around the call's pair count and fastest,
never extrapolated, and only for calls it takes (the wide variant: widths of
:func:`~deepinfer_cuda_sm100.tl.moe.wide_problem`).  A table without points of a language never
picks it.

The choice depends on static shapes only, so a captured graph replays the kernels it captured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_core.ops.modes import batch_invariant_enabled
from deepinfer_core.ops.moe_paths import GROUPED_MM_MAJORS, cuda_major
from deepinfer_core.weights.quant import QuantizedTensor
from deepinfer_cuda_sm100 import kernel_choice, tl

OP = "moe_experts"
WIDTH_MULTIPLE = 128
"""Hidden and intermediate widths must be multiples of this (the TileLang K step and CTA rows)."""
GROUP = 32
"""The FP4 scale group the TileLang kernels read."""
MAX_GRID_Y = 65535
"""CUDA's limit on a grid's second dimension, the TileLang kernels' tiles of tokens."""
WIDE = "tilelang_wide"
"""The table's name of the wide TileLang variant (two consumer warpgroups a CTA)."""
LANGUAGES = frozenset({"triton", "tilelang", WIDE})
"""The languages of the TileLang side (with Triton's) that :func:`languages` narrows by width."""
GEMV = "triton_gemv"
"""The table's name of the decode-width GEMVs (:mod:`deepinfer_cuda_sm100.kernels.moe_gemv`)."""
DEQUANT = "triton_dequant"
"""The table's name of the dequantised experts (:mod:`deepinfer_cuda_sm100.kernels.moe_dequant`)."""
GROUPED = "cublas_grouped"
"""The table's name of the grouped GEMMs (:mod:`deepinfer_cuda_sm100.kernels.moe_grouped`)."""
PLAIN_KIND = "bf16"
"""The table's kind of calls on plain bf16 stacks."""


def _fp4_problem(name: str, w, path: str) -> str | None:
    """Why ``w`` is not an FP4 stack in scale groups of :data:`GROUP` inputs, which ``path``
    (the kernels named in the reason) reads, or ``None``."""
    if not isinstance(w, QuantizedTensor) or w.fmt != "fp4":
        return f"{name} is not an FP4 QuantizedTensor: {path} read FP4 stacks"
    if w.block != (1, GROUP):
        return f"{name} has FP4 scale groups of {w.block[1]} inputs: {path} take {GROUP}"
    return None


NO_PAIRS = "no (token, slot) pairs: the Triton path returns the empty result"
"""Why neither TileLang nor the GEMVs take a call without (token, slot) pairs."""


def _stack_problem(name: str, w) -> str | None:
    problem = _fp4_problem(name, w, "the TileLang kernels")
    if problem:
        return problem
    if not w.data.is_contiguous() or not w.scale.is_contiguous():
        return f"{name}: the TileLang kernels read contiguous FP4 data and scales"
    align = 16 if w.scale.dtype == torch.float32 else 4
    if w.data.data_ptr() % 16 or w.scale.data_ptr() % align:
        return f"{name}: FP4 data must start 16-byte aligned, scales {align}-byte aligned"
    return None


def tilelang_supports(x, ids, weights, gate_up, down, limit, shared=None) -> bool | str:
    """``True`` when the TileLang kernels take this call (already accepted by the Triton path's
    ``supports``), else the reason."""
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype}: the TileLang kernels take bfloat16"
    for name, w in (("gate_up", gate_up), ("down", down)):
        problem = _stack_problem(name, w)
        if problem:
            return problem
    d, inter = x.shape[1], down.shape[2]
    if d % WIDTH_MULTIPLE or inter % WIDTH_MULTIPLE:
        return f"widths D={d}, I={inter}: the TileLang kernels take multiples of {WIDTH_MULTIPLE}"
    if x.shape[0] == 0 or ids.shape[1] == 0:
        return NO_PAIRS
    from deepinfer_cuda_sm100.tl.moe import launch_plan

    tiles = launch_plan(x.shape[0], ids.shape[1], gate_up.shape[0], d, inter)["tiles"]
    if tiles > MAX_GRID_Y:
        return f"{tiles} tiles of tokens: the TileLang grids take at most {MAX_GRID_Y}"
    return True


def gemv_supports(x, ids, weights, gate_up, down, limit, shared=None) -> bool | str:
    """``True`` when the decode-width GEMVs may take this call (already accepted by the Triton
    path's ``supports``), else the reason: bfloat16 activations (the measured math), both stacks
    FP4 with scale groups of :data:`GROUP` inputs (so widths multiples of it), 1 to
    :data:`~deepinfer_cuda_sm100.kernels.moe_gemv.MAX_TOKENS` tokens."""
    from deepinfer_cuda_sm100.kernels.moe_gemv import MAX_TOKENS

    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype}: the decode-width GEMVs are measured in bfloat16"
    for name, w in (("gate_up", gate_up), ("down", down)):
        problem = _fp4_problem(name, w, "the decode-width GEMVs")
        if problem:
            return problem
    if x.shape[0] == 0 or ids.shape[1] == 0:
        return NO_PAIRS
    if x.shape[0] > MAX_TOKENS:
        return f"{x.shape[0]} tokens: the decode-width GEMVs take at most {MAX_TOKENS}"
    return True


def dequant_supports(x, ids, weights, gate_up, down, limit, shared=None) -> bool | str:
    """``True`` when the dequantised experts may take this call (already accepted by the Triton
    path's ``supports``), else the reason: bfloat16 activations (the measured math), both stacks
    FP4 stacks :func:`~deepinfer_cuda_sm100.kernels.moe_dequant.dequantize_experts` reads, at
    least one (token, slot) pair."""
    from deepinfer_cuda_sm100.kernels.moe_dequant import fp4_problem

    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype}: the dequantised experts are measured in bfloat16"
    for name, w in (("gate_up", gate_up), ("down", down)):
        problem = fp4_problem(w)
        if problem:
            return f"{name} is {problem}: the dequantised experts read FP4 stacks"
    if x.shape[0] == 0 or ids.shape[1] == 0:
        return NO_PAIRS
    return True


def grouped_device_problem(device: torch.device) -> str | None:
    """Why ``torch._grouped_mm`` would synchronise with the host on ``device`` (not a CUDA device
    of :data:`~deepinfer_core.ops.moe_paths.GROUPED_MM_MAJORS`), or ``None``."""
    if device.type != "cuda" or cuda_major(device.index) not in GROUPED_MM_MAJORS:
        return f"device {device}: torch._grouped_mm reads its offsets on the device on sm_90 / sm_100 only"
    return None


def grouped_supports(x, ids, weights, gate_up, down, limit, shared=None) -> bool | str:
    """``True`` when the grouped GEMMs may take this call (already accepted by the Triton path's
    ``supports``), else the reason: bfloat16 activations on a CUDA device where
    :func:`grouped_device_problem` finds none, the stacks
    :func:`~deepinfer_cuda_sm100.kernels.moe_grouped.grouped_problem` takes, at least one
    (token, slot) pair."""
    from deepinfer_cuda_sm100.kernels.moe_grouped import grouped_problem

    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype}: the grouped GEMMs are measured in bfloat16"
    problem = grouped_device_problem(x.device) or grouped_problem(x, gate_up, down)
    if problem:
        return problem
    if x.shape[0] == 0 or ids.shape[1] == 0:
        return NO_PAIRS
    return True


def choice_kind(gate_up) -> str:
    """The kind of a call in the measured table: ``fp4`` (ue8m0 scales), ``fp4+fp32`` (float32
    scales; the gate / up stack's) or :data:`PLAIN_KIND` (plain stacks)."""
    if not isinstance(gate_up, QuantizedTensor):
        return PLAIN_KIND
    return "fp4+fp32" if gate_up.scale.dtype == torch.float32 else "fp4"


def mode_problem(device: torch.device) -> str | None:
    """Why no call on ``device`` leaves the Triton path now (the batch-invariant mode, the FP8
    math, a device other than CUDA), or ``None``."""
    from deepinfer_cuda_sm100.kernels.moe import MOE_MATH_ENV, moe_math

    if batch_invariant_enabled():
        return "the batch-invariant mode runs the Triton kernels"
    if moe_math() != "bf16":
        return f"{MOE_MATH_ENV}={moe_math()} is the Triton kernels' math"
    if device.type != "cuda":
        return f"a {device.type} device"
    return None


def languages(hidden: int, inter: int) -> frozenset[str]:
    """The languages the table may pick for calls of these widths (TileLang's already taking
    the call): the wide variant only where its widths fit."""
    from deepinfer_cuda_sm100.tl.moe import wide_problem

    return LANGUAGES if wide_problem(hidden, inter) is None else LANGUAGES - {WIDE}


def choose_language(x, ids, weights, gate_up, down, limit, shared=None) -> str:
    """``"tilelang"``, ``"tilelang_wide"``, ``"triton_gemv"``, ``"triton_dequant"``,
    ``"cublas_grouped"`` or ``"triton"`` for this call (see the module docstring)."""
    if mode_problem(x.device) is not None:
        return "triton"
    available = {"triton"}
    if (
        tl.usable_for("moe_experts", "the Triton kernels serve every call")
        and tilelang_supports(x, ids, weights, gate_up, down, limit, shared) is True
    ):
        available |= languages(x.shape[1], down.shape[2])
    if gemv_supports(x, ids, weights, gate_up, down, limit, shared) is True:
        available.add(GEMV)
    if dequant_supports(x, ids, weights, gate_up, down, limit, shared) is True:
        available.add(DEQUANT)
    if grouped_supports(x, ids, weights, gate_up, down, limit, shared) is True:
        available.add(GROUPED)
    if len(available) == 1:
        return "triton"
    return kernel_choice.choose(
        OP,
        choice_kind(gate_up),
        "bfloat16",
        x.shape[1],
        down.shape[2],
        x.shape[0] * ids.shape[1],
        gate_up.shape[0],
        kernel_choice.device_arch(x.device),
        frozenset(available),
    )


def make_moe_experts(triton_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The op: the TileLang GEMMs, the decode-width GEMVs, the dequantised experts or the grouped
    GEMMs where :func:`choose_language` picks them, else ``triton_fn``."""

    def moe_experts(x, ids, weights, gate_up, down, limit, shared=None) -> torch.Tensor:
        language = choose_language(x, ids, weights, gate_up, down, limit, shared)
        if language == GEMV:
            from deepinfer_cuda_sm100.kernels import moe_gemv

            return moe_gemv.moe_experts(x, ids, weights, gate_up, down, limit, shared)
        if language == DEQUANT:
            from deepinfer_cuda_sm100.kernels import moe_dequant

            return moe_dequant.moe_experts(x, ids, weights, gate_up, down, limit, shared)
        if language == GROUPED:
            from deepinfer_cuda_sm100.kernels import moe_grouped

            return moe_grouped.moe_experts(x, ids, weights, gate_up, down, limit, shared)
        if language != "triton":
            from deepinfer_cuda_sm100.tl import moe as tl_moe

            consumers = 2 if language == WIDE else 1
            return tl_moe.moe_experts(x, ids, weights, gate_up, down, limit, shared, consumers=consumers)
        return triton_fn(x, ids, weights, gate_up, down, limit, shared)

    moe_experts.__doc__ = (
        f"Dispatcher over TileLang, the GEMVs, the dequantised and grouped experts and Triton.\n\n{__doc__}"
    )
    return moe_experts
