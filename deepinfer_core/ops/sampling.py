"""Sampling ops: greedy sampling's pick of each row of logits (``argmax_rows``)."""

from __future__ import annotations

import torch

from ._cases import randn
from .registry import define_op


def _argmax_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """Random rows of several shapes (``V`` not a multiple of any power-of-two chunk, one row,
    many rows, no row, one column, a strided view), exact ties, NaN, ``±inf`` and ``-inf`` rows."""
    nan, inf = float("nan"), float("inf")
    ties = (torch.randint(-3, 3, (5, 9000), generator=g) / 2).to(dtype)  # exact in every float dtype
    ties[1] = 1.0  # a whole row tied: index 0
    ties[2, 5000:] = 4.0  # the maximum first at a column past the first 4096
    ties[3, :2] = torch.tensor([-0.0, 0.0])  # signed zeros are equal...
    ties[3, 2:] = -1.0  # ...so the first of them wins
    specials = randn(g, 6, 5000, dtype=dtype, scale=4.0)
    specials[0, [4100, 4500]] = nan  # the first NaN wins, across a chunk boundary
    specials[1, [0, 3]] = nan  # NaN in the first column
    specials[2, -1] = nan  # NaN in the last column, after a +inf
    specials[2, 10] = inf
    specials[3, [7, 4097]] = inf  # the first of two +inf
    specials[4] = -inf  # all -inf: index 0
    specials[5, :-1] = -inf  # one finite value, in the last column
    wide = randn(g, 9, 3000, dtype=dtype)
    return [
        ((randn(g, 1, 1000, dtype=dtype),), {}),
        ((randn(g, 7, 12345, dtype=dtype),), {}),
        ((randn(g, 33, 700, dtype=dtype),), {}),
        ((randn(g, 3, 1, dtype=dtype),), {}),
        ((randn(g, 0, 50, dtype=dtype),), {}),
        ((wide[:, 5:2994],), {}),  # a strided view of wider rows
        ((ties,), {}),
        ((specials,), {}),
    ]


@define_op("argmax_rows", "sampling", batch_invariant=True, sample_cases=_argmax_cases)
def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value: greedy sampling's token (``torch.argmax(x, dim=-1)``).

    Args:
        x: ``[B, V]`` logits, any float dtype and strides, ``V >= 1`` (``B`` may be 0).

    Returns:
        ``[B]`` int64, a new tensor on ``x``'s device (callers may write into it): per row the
        index of its maximum as ``torch.argmax`` orders values -- ties go to the lowest index
        (the first maximum; ``-0.0`` equals ``+0.0``), NaN counts as larger than every number
        (a row holding NaN gives its first NaN), ``+inf`` is larger than every finite value,
        and a row of ``-inf`` gives 0.  Exact, so a row's index does not depend on the other
        rows.  No host synchronisation and an output shape that follows the input's alone
        (an implementation must keep both: the sampler calls it inside a step that may be
        captured in a device graph).
    """
    return torch.argmax(x, dim=-1)
