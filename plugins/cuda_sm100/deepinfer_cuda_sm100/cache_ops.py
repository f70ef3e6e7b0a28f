"""KV cache writes on the ``cuda_sm100`` backend: ``cache_write``.

Into a packed pool the rows are quantised and stored by one Triton launch instead of the
reference's ~20: a packed FP8 pool (:class:`~deepinfer_core.ops.kv_format.Fp8KVPool`, V4's
``kv_cache_dtype="fp8"``; :mod:`deepinfer_cuda_sm100.kernels.cache_write`) or a block-scaled one
(:class:`~deepinfer_core.ops.kv_blockscaled.BlockScaledKVPool`, DeepSeek-V4.1's window records,
compressed entries and indexer keys; :mod:`deepinfer_cuda_sm100.kernels.cache_write_blocks`),
bit for bit the reference's bytes.  Into a plain cache tensor by ``index_copy_`` of the values
cast to its dtype, as the reference does (one copy kernel, plus the cast where the dtypes
differ).  Per-tile FP8 pools are refused with the reason, so the reference serves them (logged
once).

:func:`cache_ops` returns the :class:`OpImpl` with its ``supports`` predicate (shapes, dtypes,
strides, devices and pool types only) and conformance cases at the shapes the kernels target:
:data:`V4_FLASH_ROWS` on the GPU (V4-Flash's 512-wide rows with a 64-wide rope part: a decode
step's window rows and a prefill chunk's; V4.1's formats at their widths), :data:`SMALL_ROWS`
under Triton's CPU interpreter; each with groups from 1e-6 (a subnormal-range scale) to 1e4,
zero and negative-zero groups, values at rounding ties, a pool whose nope part is odd (its
alignment byte), a pool without rope values, and strided values.

Importing this module does not import Triton; :func:`cache_ops` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_core.ops import OpImpl
from deepinfer_core.ops.cache import cache_write as reference_cache_write
from deepinfer_core.ops.kv_blockscaled import BlockScaledKVPool
from deepinfer_core.ops.kv_format import Fp8KVPool, PackedKVPool
from deepinfer_cuda_sm100.checks import FLOAT_DTYPES, device_problem, first_problem, is_int_tensor

Verdict = bool | str
Cases = list[tuple[tuple, dict]]

CACHE_OPS = ("cache_write",)
"""The ops :func:`cache_ops` provides."""
KERNEL_POOLS = (Fp8KVPool, BlockScaledKVPool)
"""The packed pools the kernels write (V4's FP8 rows; V4.1's block-scaled formats)."""
REFERENCE_POOL_REFUSAL = "pools are written by the reference"
"""In ``supports``' reason for a packed pool of another format (e.g. the NPU backend's per-tile
FP8 rows): the reference writes it."""


@dataclass(frozen=True)
class RowShapes:
    """Pool geometry and written row counts of one family of ``cache_write`` cases."""

    dim: int
    rope_dim: int
    pool_rows: int
    writes: tuple[int, ...]
    block_dim: int
    """The narrow block-scaled rows' width (V4.1's indexer keys)."""


V4_FLASH_ROWS = RowShapes(dim=512, rope_dim=64, pool_rows=1024, writes=(1, 64, 256), block_dim=128)
"""GPU cases: V4-Flash's 592-byte rows; a decode step's rows at batches 1, 64, 256; V4.1's
formats at 512 (window records, compressed entries) and 128 (indexer keys)."""
SMALL_ROWS = RowShapes(dim=192, rope_dim=8, pool_rows=40, writes=(1, 5), block_dim=64)
"""Interpreter cases: three FP8 groups, a narrow rope part; whole blocks of every format."""


def make_supports(interpreted: bool) -> Callable[..., Verdict]:
    """The ``cache_write`` ``supports`` predicate, for ``interpreted`` (CPU) or compiled (CUDA)
    kernels."""

    def cache_write(cache, rows, values) -> Verdict:
        if isinstance(cache, PackedKVPool) and not isinstance(cache, KERNEL_POOLS):
            return f"{type(cache).__name__} {REFERENCE_POOL_REFUSAL}"
        packed = isinstance(cache, KERNEL_POOLS)
        target = cache.data if packed else cache
        problem = device_problem(interpreted, [("cache", target), ("rows", rows), ("values", values)])
        if problem or not packed:
            return problem or True  # a plain cache: the reference's own index_copy_
        m = rows.shape[0] if rows.dim() == 1 else -1
        return first_problem(
            (
                is_int_tensor(rows) and rows.dim() == 1,
                f"rows ({rows.dtype}, {rows.dim()} dims) is not [M] int",
            ),
            (
                values.dtype in FLOAT_DTYPES,
                f"values dtype {values.dtype} is not one of float32, bfloat16, float16",
            ),
            (
                tuple(values.shape) == (m, cache.dim),
                f"values have shape {tuple(values.shape)}, expected [{m}, {cache.dim}]",
            ),
        )

    return cache_write


def write(cache, rows: torch.Tensor, values: torch.Tensor):
    """``cache_write``: an :class:`Fp8KVPool` or a :class:`BlockScaledKVPool` by its Triton
    kernel, a plain tensor by the reference's ``index_copy_``."""
    if isinstance(cache, Fp8KVPool):
        from deepinfer_cuda_sm100.kernels.cache_write import write_fp8_rows

        return write_fp8_rows(cache, rows, values)
    if isinstance(cache, BlockScaledKVPool):
        from deepinfer_cuda_sm100.kernels.cache_write_blocks import write_block_rows

        return write_block_rows(cache, rows, values)
    return reference_cache_write(cache, rows, values)


def _values(g: torch.Generator, m: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``[m, dim]`` rows whose 64-value groups span magnitudes 1e-6 .. 1e4, with a zero group, a
    negative-zero group and values at e4m3 rounding ties."""
    mags = torch.tensor([1e-6, 1e-3, 1.0, 50.0, 1e4])
    x = torch.randn(m, dim, generator=g) * mags[torch.arange(dim) // 64 % len(mags)]
    if m > 1:
        x[1, :64] = 0.0
        x[-1, 64:128] = -0.0
        x[0, :8] = torch.tensor([1.0625, 1.1875, -17.0, 0.0029296875, 0.0048828125, 448.0, 440.0, 2.0**-9])
    return x.to(dtype)


def packed_cases(s: RowShapes) -> Callable[[torch.Generator, torch.dtype], Cases]:
    """``cache_write`` cases into packed pools of shapes ``s`` (see the module docstring)."""

    def cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
        out: Cases = []
        for m in s.writes:
            pool = Fp8KVPool.from_values(torch.randn(s.pool_rows, s.dim, generator=g), rope_dim=s.rope_dim)
            rows = torch.randperm(s.pool_rows, generator=g)[:m]
            out.append(((pool, rows, _values(g, m, s.dim, dtype)), {}))
        for fmt, dim in (("fp8_ue8m0", s.dim), ("fp4_e4m3", s.dim), ("fp4_ue8m0", s.block_dim)):
            pool = BlockScaledKVPool.zeros(s.pool_rows, dim, fmt)
            rows = torch.randperm(s.pool_rows, generator=g)[: s.writes[-1]]
            out.append(((pool, rows, _values(g, s.writes[-1], dim, dtype)), {}))
        odd = Fp8KVPool.zeros(9, 75, rope_dim=4)  # 71 nope values: an alignment byte
        out.append(((odd, torch.tensor([8, 0, 3]), _values(g, 3, 75, dtype)), {}))
        bare = Fp8KVPool.zeros(6, 130, rope_dim=0)  # no rope values
        out.append(((bare, torch.tensor([5, 1]), _values(g, 2, 130, dtype)), {}))
        wide = _values(g, 4, s.dim + 16, dtype)
        pool = Fp8KVPool.zeros(s.pool_rows, s.dim, rope_dim=s.rope_dim)
        out.append(((pool, torch.tensor([3, 2, 1, 0]), wide[:, 16:]), {}))  # strided rows
        return out

    return cases


def cache_ops() -> dict[str, OpImpl]:
    """``{op name: OpImpl}`` for :data:`CACHE_OPS` (imports Triton and the kernels)."""
    from deepinfer_cuda_sm100.kernels import _common

    interpreted = _common.INTERPRETED
    shapes = SMALL_ROWS if interpreted else V4_FLASH_ROWS
    return {
        "cache_write": OpImpl(
            fn=write, supports=make_supports(interpreted), sample_cases=packed_cases(shapes)
        )
    }
