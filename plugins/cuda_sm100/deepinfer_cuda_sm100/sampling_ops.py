"""Greedy sampling's argmax on the ``cuda_sm100`` backend: ``argmax_rows`` in two Triton
launches (kernels in :mod:`deepinfer_cuda_sm100.kernels.argmax`) where ``torch.argmax`` reduces
each row in one thread block.

:func:`sampling_ops` returns its :class:`OpImpl` with a ``supports`` predicate (shapes, dtypes,
strides and devices only) and conformance cases at the shapes the kernel targets:
:data:`V4_FLASH_ROWS` on the GPU (V-Flash's vocabulary of 129,280 columns; 1, 64 and 256 rows),
:data:`SMALL_ROWS` under Triton's CPU interpreter (three chunks and a ragged tail); each with
the maximum tied across chunks, NaN, ``+inf``, ``-inf`` rows and a strided view.

Importing this module does not import Triton; :func:`sampling_ops` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_core.ops import OpImpl
from deepinfer_cuda_sm100.checks import FLOAT_DTYPES, device_problem, first_problem

Verdict = bool | str
Cases = list[tuple[tuple, dict]]

SAMPLING_OPS = ("argmax_rows",)
"""The ops :func:`sampling_ops` provides."""

MAX_COLS = 1 << 24
"""Longest row the kernels take (:data:`deepinfer_cuda_sm100.kernels.argmax.MAX_COLS`)."""
CHUNK = 4096
"""Columns per stage-1 program of long rows (:data:`deepinfer_cuda_sm100.kernels.argmax.CHUNK`):
the cases plant ties and NaN around its boundaries."""


@dataclass(frozen=True)
class ArgmaxShapes:
    """The row width and row counts of one family of ``argmax_rows`` cases."""

    vocab: int
    rows: tuple[int, ...]


V4_FLASH_ROWS = ArgmaxShapes(vocab=129280, rows=(1, 64, 256))
"""GPU cases: V-Flash's logits at decode batches of 1, 64 and 256 rows."""
SMALL_ROWS = ArgmaxShapes(vocab=3 * 4096 + 77, rows=(1, 5))
"""Interpreter cases: three whole chunks and a ragged tail."""


def make_supports(interpreted: bool) -> Callable[..., Verdict]:
    """The ``argmax_rows`` ``supports`` predicate, for ``interpreted`` (CPU) or compiled (CUDA)
    kernels; looks at shapes, dtypes and devices only (never at values: no device sync)."""

    def argmax_rows(x) -> Verdict:
        problem = device_problem(interpreted, [("x", x)])
        if problem:
            return problem
        ok = first_problem(
            (x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} is not one of float32, bfloat16, float16"),
            (x.dim() == 2, f"x has {x.dim()} dims, expected [B, V]"),
        )
        if ok is not True:
            return ok
        width = x.shape[1]
        return first_problem(
            (1 <= width <= MAX_COLS, f"rows of {width} columns: 1..{MAX_COLS} are supported")
        )

    return argmax_rows


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def argmax_cases(s: ArgmaxShapes) -> Callable[[torch.Generator, torch.dtype], Cases]:
    """``argmax_rows`` cases of shapes ``s`` (see the module docstring)."""

    def cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
        v, chunk = s.vocab, CHUNK
        out: Cases = [((_randn(g, b, v, dtype=dtype),), {}) for b in s.rows]
        tied = _randn(g, 4, v, dtype=dtype)
        tied[0, [2 * chunk + 5, chunk, 2 * chunk - 1]] = 100.0  # first in the second chunk
        tied[1, [chunk - 1, v - 1]] = 100.0  # the last column of the first chunk, the row's last
        tied[2] = 1.0  # one value: column 0
        tied[3, v - 1] = 100.0  # in the ragged tail alone
        out.append(((tied,), {}))
        special = _randn(g, 5, v, dtype=dtype)
        special[0, [2 * chunk + 1, chunk + 1]] = float("nan")  # the first NaN, in chunk 1
        special[1, [chunk, 2 * chunk]] = float("inf")  # the first +inf
        special[1, 2 * chunk + 3] = float("nan")  # NaN above +inf
        special[2] = float("-inf")  # all -inf: column 0
        special[3, : v - 1] = float("-inf")  # one finite value, the last column
        special[4, [3, chunk + 3]] = float("inf")
        out.append(((special,), {}))
        wide = _randn(g, 3, v + 24, dtype=dtype)
        out.append(((wide[:, 8 : 8 + v],), {}))  # rows of a wider buffer
        return out

    return cases


def sampling_ops() -> dict[str, OpImpl]:
    """``{op name: OpImpl}`` for :data:`SAMPLING_OPS` (imports Triton and the kernels)."""
    from deepinfer_cuda_sm100.kernels import _common, argmax

    interpreted = _common.INTERPRETED
    shapes = SMALL_ROWS if interpreted else V4_FLASH_ROWS
    return {
        "argmax_rows": OpImpl(
            fn=argmax.argmax_rows, supports=make_supports(interpreted), sample_cases=argmax_cases(shapes)
        )
    }
