"""The token embedding on the ``cuda_sm100`` backend: ``embedding`` in one Triton launch
(:mod:`deepinfer_cuda_sm100.kernels.embedding`) that takes part in the step's chain of
programmatic dependent launches, where ``F.embedding``'s gather does not.

:func:`embedding_ops` returns its :class:`OpImpl` with a ``supports`` predicate (shapes, dtypes,
strides and devices only) and conformance cases: :data:`V4_FLASH_TABLE` on the GPU (V4-Flash's
width over a 16k-row table; 1, 64, 256 and a ragged 37 tokens), :data:`SMALL_TABLE` under
Triton's CPU interpreter (a ragged column tile); each with the table's first and last rows,
repeated ids and a strided ids view.

Importing this module does not import Triton; :func:`embedding_ops` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_core.ops import OpImpl
from deepinfer_cuda_sm100.checks import FLOAT_DTYPES, device_problem, first_problem, is_int_tensor

Verdict = bool | str
Cases = list[tuple[tuple, dict]]

EMBEDDING_OPS = ("embedding",)
"""The ops :func:`embedding_ops` provides."""


@dataclass(frozen=True)
class TableShapes:
    """The table and token counts of one family of ``embedding`` cases."""

    vocab: int
    width: int
    tokens: tuple[int, ...]


V4_FLASH_TABLE = TableShapes(vocab=16384, width=4096, tokens=(1, 64, 256, 37))
"""GPU cases: V4-Flash's hidden width (four column tiles a token)."""
SMALL_TABLE = TableShapes(vocab=300, width=1500, tokens=(1, 9))
"""Interpreter cases: two column tiles, the second ragged."""


def make_supports(interpreted: bool) -> Callable[..., Verdict]:
    """The ``embedding`` ``supports`` predicate, for ``interpreted`` (CPU) or compiled (CUDA)
    kernels; looks at shapes, dtypes and devices only (never at values: no device sync)."""

    def embedding(ids, weight) -> Verdict:
        problem = device_problem(interpreted, [("ids", ids), ("weight", weight)])
        if problem:
            return problem
        return first_problem(
            (is_int_tensor(ids), f"ids dtype {ids.dtype} is not an integer dtype"),
            (ids.dim() == 1, f"ids has {ids.dim()} dims, expected [T]"),
            (
                weight.dtype in FLOAT_DTYPES,
                f"weight dtype {weight.dtype} is not one of float32, bfloat16, float16",
            ),
            (weight.dim() == 2, f"weight has {weight.dim()} dims, expected [V, D]"),
        )

    return embedding


def embedding_cases(s: TableShapes) -> Callable[[torch.Generator, torch.dtype], Cases]:
    """``embedding`` cases of shapes ``s`` (see the module docstring)."""

    def cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
        weight = torch.randn(s.vocab, s.width, generator=g).to(dtype)
        out: Cases = [((torch.randint(0, s.vocab, (t,), generator=g), weight), {}) for t in s.tokens]
        edges = torch.tensor([0, s.vocab - 1, 5, 5, 0, s.vocab - 1])  # first / last rows, repeats
        out.append(((edges, weight), {}))
        strided = torch.randint(0, s.vocab, (2 * s.tokens[-1],), generator=g, dtype=torch.int32)[::2]
        out.append(((strided, weight), {}))
        return out

    return cases


def embedding_ops() -> dict[str, OpImpl]:
    """``{op name: OpImpl}`` for :data:`EMBEDDING_OPS` (imports Triton and the kernel)."""
    from deepinfer_cuda_sm100.kernels import _common, embedding

    interpreted = _common.INTERPRETED
    shapes = SMALL_TABLE if interpreted else V4_FLASH_TABLE
    return {
        "embedding": OpImpl(
            fn=embedding.embedding, supports=make_supports(interpreted), sample_cases=embedding_cases(shapes)
        )
    }
