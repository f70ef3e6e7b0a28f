"""``sparse_attention`` in two kernel languages: TileLang where it was measured faster, else Triton.

:func:`make_sparse_attention` wraps the Triton kernel (which takes every call the backend's
``supports`` accepts) in a dispatcher.  A call goes to the TileLang kernel
(:mod:`deepinfer_cuda_sm100.tl.sparse_attention`) when all of these hold:

- TileLang can compile here (:func:`~deepinfer_cuda_sm100.tl.tilelang_problem`; if not, one
  warning says why and how to install it, and Triton serves every call);
- the engine is not in batch-invariant mode (the Triton kernel's fixed key chunks make a
  query's result independent of how its window is split between the ring and this step's
  rows; the TileLang kernel's per-source blocks do not);
- the TileLang kernel takes the call (:func:`tilelang_supports`: plain pools, or packed FP8
  pools of one layout with bfloat16 queries; 2 or 3 sources of which the first two are
  explicit row lists, heads a multiple of 64, ...);
- the measured table of this GPU's architecture picks TileLang at the nearest measured shape
  (:mod:`deepinfer_cuda_sm100.kernel_choice`).

TileLang has two attention kernels: the two-consumer one of :mod:`deepinfer_cuda_sm100.tl.
sparse_attention` (language ``"tilelang"``, plain and packed FP8 pools) and the warp-specialised
"seesaw" one of :mod:`deepinfer_cuda_sm100.tl.sparse_attention_ws` (``"tilelang_ws"``, plain
pools and packed FP8 pools of DeepSeek-V4's row layout); the table's points time each where it
ran, and a call takes the fastest of them.

The choice depends on static shapes only, so a captured graph replays the kernel it captured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.kv_format import Fp8KVPool, PackedKVPool
from deepinfer_core.ops.modes import batch_invariant_enabled
from deepinfer_cuda_sm100 import kernel_choice, tl
from deepinfer_cuda_sm100.tl import page_division
from deepinfer_cuda_sm100.tl import sparse_attention as tl_attention
from deepinfer_cuda_sm100.tl import sparse_attention_ws as tl_attention_ws
from deepinfer_cuda_sm100.tl.launch_args import TL_DTYPES

MAX_TL_HEAD_DIM = 512
"""Widest head the TileLang kernel takes: its query and two key stages fill shared memory."""
_INT32_MAX = 2**31 - 1


def tilelang_supports(q, kv_pools, indices, sinks, scale) -> bool | str:
    """``True`` when the TileLang kernel takes this call (already accepted by the Triton
    kernel's ``supports``), else the reason."""
    if q.dtype not in TL_DTYPES:
        return f"q dtype {q.dtype}: the TileLang kernel takes bfloat16 and float16"
    t, h, d = q.shape
    if h % tl_attention.BH:
        return f"{h} heads: the TileLang kernel takes multiples of {tl_attention.BH}"
    if d % 64 or d > MAX_TL_HEAD_DIM:
        return f"head dim {d}: the TileLang kernel takes multiples of 64 up to {MAX_TL_HEAD_DIM}"
    if len(kv_pools) not in (2, 3):
        return f"{len(kv_pools)} sources: the TileLang kernel takes 2 or 3"
    if any(isinstance(i, PagedIndex) for i in indices[:2]):
        return "a paged index among the first two sources: the TileLang kernel reads it third"
    if isinstance(indices[-1], PagedIndex):
        problem = page_division.entries_problem(indices[-1].max_count, "the TileLang kernel")
        if problem:
            return problem
    if isinstance(kv_pools[0], Fp8KVPool):
        return _packed_supports(q, kv_pools)
    for i, pool in enumerate(kv_pools):
        if isinstance(pool, PackedKVPool):
            return (
                f"kv_pools[{i}] is packed ({type(pool).__name__}) and kv_pools[0] is not: one format per call"
            )
        if pool.stride(1) != 1 or pool.stride(0) % 8 or pool.data_ptr() % 16:
            return f"kv_pools[{i}] rows are not 16-byte aligned contiguous rows (strides {pool.stride()})"
        if i == 2 and not pool.is_contiguous():
            return "kv_pools[2] is not contiguous"
    return True


def _packed_supports(q, kv_pools) -> bool | str:
    """The FP8 kernel: every pool an :class:`Fp8KVPool` of one layout, bfloat16 queries."""
    if q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype} with FP8 pools: the TileLang FP8 kernel takes bfloat16"
    layout = kv_pools[0].layout
    for i, pool in enumerate(kv_pools):
        if type(pool) is not Fp8KVPool or pool.layout != layout:
            return f"kv_pools[{i}] is not an Fp8KVPool of kv_pools[0]'s layout: one format per call"
        data = pool.data
        if data.stride(1) != 1 or data.stride(0) % 8 or data.data_ptr() % 8:
            return (
                f"kv_pools[{i}] packed rows are not 8-byte aligned contiguous rows (strides {data.stride()})"
            )
    if layout.dim != q.shape[2] or layout.rope_offset % 8 or layout.nope % 8:
        return f"FP8 row layout {layout}: the TileLang FP8 kernel reads 8-byte aligned nope and rope parts"
    return True


def choice_kind(indices, kv_pools) -> str:
    """The kind of a call in the measured table: the third source's (``"rows"``, ``"paged"``,
    ``"none"``), ``+fp8`` with packed FP8 pools."""
    kind = tl_attention.third_kind(indices) or "none"
    return f"{kind}+fp8" if isinstance(kv_pools[0], Fp8KVPool) else kind


def available_languages(q, kv_pools) -> frozenset[str]:
    """The languages the table may pick for a call the two-consumer TileLang kernel takes:
    Triton, that kernel, and the seesaw kernel where it takes the pools."""
    seesaw = {"tilelang_ws"} if tl_attention_ws.supports(q, kv_pools) is True else set()
    return frozenset({"triton", "tilelang", *seesaw})


def choose_language(q, kv_pools, indices, sinks, scale) -> str:
    """``"tilelang_ws"``, ``"tilelang"`` or ``"triton"`` for this call (see the module docstring)."""
    if batch_invariant_enabled() or q.device.type != "cuda":
        return "triton"
    if not tl.usable_for("sparse_attention", "the Triton kernel serves every call"):
        return "triton"
    if tilelang_supports(q, kv_pools, indices, sinks, scale) is not True:
        return "triton"
    t, h, d = q.shape
    return kernel_choice.choose(
        "sparse_attention",
        choice_kind(indices, kv_pools),
        TL_DTYPES[q.dtype],
        h,
        d,
        t,
        tl_attention.max_keys(indices),
        kernel_choice.device_arch(q.device),
        available_languages(q, kv_pools),
    )


def make_sparse_attention(triton_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The op: the TileLang kernel where :func:`choose_language` picks it, else ``triton_fn``."""

    def sparse_attention(q, kv_pools, indices, sinks, scale) -> torch.Tensor:
        language = choose_language(q, kv_pools, indices, sinks, scale)
        if language == "tilelang":
            return tl_attention.sparse_attention(q, kv_pools, indices, sinks, scale)
        if language == "tilelang_ws":
            return tl_attention_ws.sparse_attention(q, kv_pools, indices, sinks, scale)
        return triton_fn(q, kv_pools, indices, sinks, scale)

    sparse_attention.__doc__ = f"Dispatcher over TileLang and Triton.\n\n{__doc__}"
    return sparse_attention
