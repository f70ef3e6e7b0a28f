"""The compressor's step op of the ``cuda_sm100`` backend: ``compress_windows`` in three Triton
launches (kernels in :mod:`deepinfer_cuda_sm100.kernels.compressor_windows`).

:func:`compressor_ops` returns its :class:`OpImpl` with a ``supports`` predicate (shapes,
dtypes and devices only) and conformance cases: CSA's overlapping windows with carries and
page snapshots, HCA's long windows and the indexer's keys, at V4-Flash widths on the GPU
(:data:`V4_FLASH_WINDOWS`) and small ones under Triton's CPU interpreter
(:data:`SMALL_WINDOWS`); projections that are strided views of a wider one, state rows that the
call both reads and rewrites, a step where no window closes and packed FP8 pools.

Importing this module does not import Triton; :func:`compressor_ops` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.ops import OpImpl
from deepinfer_core.ops.compressor import window_case
from deepinfer_core.ops.kv_format import PackedKVPool
from deepinfer_cuda_sm100.checks import FLOAT_DTYPES, device_problem, first_problem, int_vector, is_int_tensor

Verdict = bool | str
Cases = list[tuple[tuple, dict]]

WINDOW_OPS = ("compress_windows",)
"""The ops :func:`compressor_ops` provides."""

MAX_ENTRY_DIM = 4096
"""Widest compressor entry (``D``) ``compress_entries`` and ``compress_windows`` take: the row
lives in registers."""


@dataclass(frozen=True)
class WindowShapes:
    """Entry widths, ratios and step sizes of one family of ``compress_windows`` cases."""

    head_dim: int
    index_dim: int
    rope_dim: int
    csa: int
    hca: int
    tokens: tuple[int, int]
    """A decode step (one token a request, as many windows planned) and a larger chunk."""


V4_FLASH_WINDOWS = WindowShapes(head_dim=512, index_dim=128, rope_dim=64, csa=4, hca=128, tokens=(64, 200))
"""GPU cases: V4-Flash's entries (512 wide, indexer keys 128; ratios 4 and 128)."""
SMALL_WINDOWS = WindowShapes(head_dim=64, index_dim=32, rope_dim=16, csa=4, hca=16, tokens=(3, 9))
"""Interpreter cases: narrower entries, fewer windows."""


def window_cases(s: WindowShapes):
    """The sample-case function of the kernel's conformance cases at shapes ``s``."""

    def cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
        one, chunk = s.tokens
        fp8_dim = s.rope_dim + 64 * max(1, (s.head_dim - s.rope_dim) // 64)
        c = lambda *a, **k: window_case(g, dtype, *a, rope_dim=s.rope_dim, **k)  # noqa: E731
        return [
            c(one, one, s.csa, s.head_dim, True),  # CSA decode: a window planned per request
            c(chunk, chunk // s.csa, s.csa, s.head_dim, True, snap=False),  # a chunk, no snapshots
            c(one, one, s.csa, s.index_dim, True, strided=False),  # the indexer's keys
            c(one, 2, s.hca, s.head_dim, False),  # HCA: long windows, no carries
            c(one, 0, s.csa, s.head_dim, True),  # no window closes: the buffer writes alone
            c(one, 3, s.csa, fp8_dim, True, fp8_pool=True),  # a packed FP8 pool
        ]

    return cases


def _rows_of(name: str, x: torch.Tensor, width: int) -> tuple[bool, str]:
    ok = x.dim() == 2 and x.shape[1] == width and x.is_contiguous()
    return ok, f"{name} is not [B, {width}] contiguous"


def _carries(name: str, x: torch.Tensor | None, r: int, d: int) -> tuple[bool, str]:
    ok = x is None or (x.dim() == 3 and tuple(x.shape[1:]) == (r, d) and x.is_contiguous())
    return ok, f"{name} is not [n, {r}, {d}] contiguous"


def make_supports(interpreted: bool):
    """The ``supports`` predicate of ``compress_windows``."""

    def supports(
        kv, gate, buf_kv, buf_gate, bias, windows, buf_rows, norm_weight, eps, positions, inv_freq,
        rope_scale, pool, dest, carry_kv=None, carry_gate=None, prev=None, carry_rows=None,
        page_kv=None, page_gate=None, snap_page=None, live=None,
    ) -> Verdict:  # fmt: skip
        plain = isinstance(pool, torch.Tensor)
        tensors = dict(
            kv=kv, gate=gate, buf_kv=buf_kv, buf_gate=buf_gate, bias=bias, windows=windows,
            buf_rows=buf_rows, norm_weight=norm_weight, positions=positions, inv_freq=inv_freq,
            dest=dest, carry_kv=carry_kv, carry_gate=carry_gate, prev=prev, carry_rows=carry_rows,
            page_kv=page_kv, page_gate=page_gate, snap_page=snap_page, live=live,
            pool=pool if plain else pool.data,
        )  # fmt: skip
        problem = device_problem(interpreted, [(k, v) for k, v in tensors.items() if v is not None])
        if problem:
            return problem
        overlap = carry_kv is not None
        if kv.dim() != 2 or windows.dim() != 2:
            return f"kv has {kv.dim()} dims and windows {windows.dim()}, expected [T, C] and [M, r]"
        (t, c), (m, r) = kv.shape, windows.shape
        d = c // 2 if overlap else c
        state = [("gate", gate), ("buf_kv", buf_kv), ("buf_gate", buf_gate)]
        checks = [
            (kv.dtype in FLOAT_DTYPES, f"kv dtype {kv.dtype} is not one of float32, bfloat16, float16"),
            *((x.dtype == kv.dtype, f"{n} dtype {x.dtype} differs from kv's {kv.dtype}") for n, x in state),
            (tuple(gate.shape) == (t, c), f"gate has shape {tuple(gate.shape)}, expected {(t, c)}"),
            _rows_of("buf_kv", buf_kv, c),
            _rows_of("buf_gate", buf_gate, c),
            (bias.dtype == torch.float32 and tuple(bias.shape) == (r, c), f"bias is not [{r}, {c}] float32"),
            (
                d % 2 == 0 and 2 <= d <= MAX_ENTRY_DIM,
                f"entry width D={d} is not even in [2, {MAX_ENTRY_DIM}]",
            ),
            (not overlap or c % 2 == 0, f"kv width {c} is odd: no two series"),
            (1 <= 2 * inv_freq.shape[0] <= d, f"rope width {2 * inv_freq.shape[0]} is not in [2, D={d}]"),
            (norm_weight.shape == (d,), f"norm_weight has shape {tuple(norm_weight.shape)}, expected ({d},)"),
            (plain or isinstance(pool, PackedKVPool), f"pool is a {type(pool).__name__}"),
            (not plain or (pool.dim() == 2 and pool.shape[1] == d), f"pool rows are not {d} wide"),
            (
                not plain or pool.dtype in FLOAT_DTYPES,
                f"pool dtype {getattr(pool, 'dtype', None)} is not a float",
            ),
            (not plain or pool.stride(1) == 1, "pool has a non-unit channel stride"),
        ]
        if overlap:
            for n, x in (("carry_kv", carry_kv), ("carry_gate", carry_gate), ("page_kv", page_kv)):
                checks.append(_carries(n, x, r, d))
            checks += [
                (prev is not None and carry_rows is not None, "carries given without prev and carry_rows"),
                _carries("page_gate", page_gate, r, d),
                (carry_gate is not None and carry_gate.dtype == torch.float32, "carry_gate is not float32"),
                (carry_kv.dtype == kv.dtype, f"carry_kv dtype {carry_kv.dtype} differs from kv's"),
                (page_gate is None or page_gate.dtype == torch.float32, "page_gate is not float32"),
                ((snap_page is None) == (page_kv is None) == (page_gate is None), "snapshots half given"),
            ]
        problem = first_problem(*checks)
        if problem is not True:
            return problem
        if not is_int_tensor(windows):
            return f"windows dtype {windows.dtype} is not an integer dtype"
        vectors = [
            ("buf_rows", buf_rows, t),
            ("positions", positions, m),
            ("dest", dest, m),
            ("live", live, 1),
        ]
        vectors += [("prev", prev, m), ("carry_rows", carry_rows, m), ("snap_page", snap_page, m)]
        for n, x, k in vectors:
            problem = True if x is None else int_vector(n, x, k)
            if problem is not True:
                return problem
        return True

    return supports


def compressor_ops() -> dict[str, OpImpl]:
    """``{op name: OpImpl}`` for :data:`WINDOW_OPS` (imports Triton and the kernels)."""
    from deepinfer_cuda_sm100.kernels import _common, compressor_windows

    interpreted = _common.INTERPRETED
    shapes = SMALL_WINDOWS if interpreted else V4_FLASH_WINDOWS
    return {
        "compress_windows": OpImpl(
            fn=compressor_windows.compress_windows,
            supports=make_supports(interpreted),
            sample_cases=window_cases(shapes),
        )
    }
