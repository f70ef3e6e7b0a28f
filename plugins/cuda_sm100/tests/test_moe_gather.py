"""The FP4 MoE's activations gathered into the sorted rows in the TileLang GEMMs' K order
(``kernels/moe_gather.py``).

**Interpreter** (a child with ``TRITON_INTERPRET=1``, ``python test_moe_gather.py
--interpreter-report``): :func:`~deepinfer_cuda_sm100.kernels.moe_gather.gather_sorted_rows`
bitwise against the same gather in torch (each row its token's activations, every 128-input
block permuted by :func:`deepinfer_cuda_sm100.tl.moe.k_position`, padding rows zero) on the
used tiles of the layouts :func:`~deepinfer_cuda_sm100.kernels.moe.sorted_layout` makes (tiles
of 16 and 32 rows, padding ids, unused tiles, widths of one and several programs, bfloat16 and
float16, a strided ``x``).

**Here**: the refusal of widths that are not whole K steps.
"""

from __future__ import annotations

import json
import os
import sys

import cuda_sm100_checks as checks
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

slow = pytest.mark.slow  # they read the report of a fresh interpreter

CASES = (
    # (label, T, D, E, k, BLOCK_M, dtype, padding ids, strided x)
    ("tiles of 16, one program a row", 5, 256, 4, 2, 16, torch.bfloat16, False, False),
    ("tiles of 32, padding ids", 9, 384, 6, 3, 32, torch.bfloat16, True, False),
    ("two programs a row, float16", 3, 2048 + 128, 3, 2, 16, torch.float16, False, False),
    ("a strided x", 4, 256, 4, 2, 16, torch.bfloat16, False, True),
)


def expected(x: torch.Tensor, slot_pair: torch.Tensor, top_k: int) -> torch.Tensor:
    """The gather in torch: ``out[r, 128 b + k_position(n)] = x[slot_pair[r] // top_k, 128 b + n]``,
    zero rows where ``slot_pair[r] < 0``."""
    from deepinfer_cuda_sm100.tl.moe import k_position

    d = x.shape[1]
    perm = torch.tensor([128 * (c // 128) + k_position(c % 128) for c in range(d)])
    rows = x[slot_pair.clamp(min=0).long() // top_k]
    rows = torch.where((slot_pair >= 0)[:, None], rows, torch.zeros_like(rows))
    out = torch.empty_like(rows)
    out[:, perm] = rows
    return out


def gather_problems() -> list[str]:
    """Each of :data:`CASES` bitwise against :func:`expected` on the Triton layout's rows."""
    from deepinfer_cuda_sm100.kernels.moe import sorted_layout
    from deepinfer_cuda_sm100.kernels.moe_gather import gather_sorted_rows

    g = torch.Generator().manual_seed(5)
    problems, padding_rows, unused_tiles = [], 0, 0
    for label, t, d, e, k, bm, dtype, padding, strided in CASES:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        if padding:
            ids[0, 0], ids[1, :] = -1, e
        tile_expert, slot_pair = sorted_layout(ids, e, bm)
        used = (tile_expert < e).repeat_interleave(bm)  # an unused tile's rows: never written
        x = torch.randn(t, 2 * d if strided else d, generator=g).to(dtype)[:, :d]
        got = gather_sorted_rows(x, tile_expert, slot_pair, k, e)
        want = expected(x, slot_pair.masked_fill(~used, -1), k)
        same = torch.equal(got[used].view(torch.int16), want[used].view(torch.int16))
        if got.shape != want.shape or not same:
            problems.append(f"{label}: not the activations' bits in K order")
        padding_rows += int((slot_pair[used] < 0).sum())
        unused_tiles += int((tile_expert >= e).sum())
    if not padding_rows or not unused_tiles:
        problems.append(f"the cases made {padding_rows} padding rows and {unused_tiles} unused tiles")
    return problems


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {"interpreted": _common.INTERPRETED, "gather": gather_problems()}


test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted  # the report's shared test


@slow
def test_interpreter_gather_is_the_activations_in_k_order(report):
    assert not report["gather"], "\n".join(report["gather"])


def test_the_k_order_is_the_tilelang_gemms():
    """The kernel's K order is :func:`deepinfer_cuda_sm100.tl.moe.k_position` (a permutation of
    each 128 inputs), written here as the kernel writes it."""
    from deepinfer_cuda_sm100.kernels.moe_gather import K_STEP
    from deepinfer_cuda_sm100.tl.moe import BLOCK_K, k_position

    def kernel_formula(n):
        return 16 * ((n % 32) // 4) + 8 * ((n % 4) // 2) + 2 * (n // 32) + n % 2

    assert K_STEP == BLOCK_K
    assert [kernel_formula(n) for n in range(K_STEP)] == [k_position(n) for n in range(K_STEP)]
    assert sorted(k_position(n) for n in range(K_STEP)) == list(range(K_STEP))


def test_widths_that_are_not_whole_k_steps_are_refused():
    from deepinfer_cuda_sm100.kernels.moe_gather import gather_sorted_rows

    with pytest.raises(ValueError, match="multiple of 128"):
        rows = torch.zeros(16, dtype=torch.int32)
        gather_sorted_rows(torch.zeros(2, 200, dtype=torch.bfloat16), rows[:1], rows, 2, 4)


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
