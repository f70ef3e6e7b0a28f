"""The paged kernels' entry -> (page, slot) split by a multiply and a shift
(:mod:`deepinfer_cuda_sm100.tl.page_division`): exact against Python's ``//`` and ``%`` for every
divisor and entry in range, the multiplier in an int32, and (where TileLang imports) no integer
division by the entries per page left in any paged kernel's generated CUDA."""

from __future__ import annotations

import importlib.util
import random
import re

import pytest
from deepinfer_cuda_sm100.tl.page_division import ENTRY_BITS, divider

MASK64 = (1 << 64) - 1


def _page(e: int, magic: int, shift: int) -> int:
    """The kernels' arithmetic: ``e`` as an unsigned 32-bit value widened to 64 bits, times the
    multiplier, shifted (the product wraps at 64 bits, as on the GPU)."""
    return (((e & 0xFFFFFFFF) * magic) & MASK64) >> shift


def test_the_split_is_exact_for_every_divisor_and_entry_in_range():
    rng = random.Random(0)
    divisors = list(range(1, 4097)) + [1 << k for k in range(12, 31)] + [(1 << 31) - 1]
    divisors += [rng.randrange(1, 1 << 31) for _ in range(500)]
    top = (1 << ENTRY_BITS) - 1
    for d in divisors:
        magic, shift = divider(d)
        assert 0 < magic < 1 << 31, d  # an int32 launch argument
        entries = {0, 1, d - 1, d, d + 1, top, top - 1, top - d % (top + 1)}
        entries |= {k * d + r for k in (1, 2, 3, 1000, top // d) for r in (-1, 0, 1)}
        entries |= {rng.randrange(0, top + 1) for _ in range(64)}
        for e in (e for e in entries if 0 <= e <= top):
            assert _page(e, magic, shift) == e // d, (d, e)


def test_entries_per_page_out_of_range_are_refused():
    for bad in (0, -3, 1 << 31):
        with pytest.raises(ValueError, match="entries per page"):
            divider(bad)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
def test_no_paged_kernel_divides_by_the_entries_per_page():
    """Lowered for sm_90, the paged attention kernels (both schedules, plain and FP8 pools) and
    the paged indexer scores (one token a CTA and grouped) compute an entry's page and slot
    without ``/`` or ``%`` by ``epp`` (each was a 64-bit division subroutine); the direct
    attention kernels and the split combine normalise by one reciprocal a row, not a division
    an output."""
    from cuda_sm100_checks import lowered_sm90
    from deepinfer_cuda_sm100.tl import indexer as tli
    from deepinfer_cuda_sm100.tl import indexer_grouped as tlg
    from deepinfer_cuda_sm100.tl import sparse_attention as tla
    from deepinfer_cuda_sm100.tl import sparse_attention_ws as tlw

    from deepinfer_core.ops.kv_format import fp8_row_layout

    lay = fp8_row_layout(512, 64)
    fp8 = tla.Fp8Geometry(lay.nope, lay.rope_offset, lay.scale_offset, lay.groups)
    legalize = {"tl.disable_safe_memory_legalize": True}
    geometries = (None, fp8)
    attention = [tla.build_attention(True, False, 64, 512, "bfloat16", g) for g in geometries]
    seesaw = [tlw.build_attention_ws(True, False, 64, 512, "bfloat16", g) for g in geometries]
    kernels = {
        "attention": [(f, legalize) for f in attention],
        "seesaw": [(f, tlw.pass_configs(g)) for f, g in zip(seesaw, geometries, strict=True)],
        "indexer": [(tli.build_scores("paged", 64, 128, "bfloat16", 4), legalize),
                    (tlg.build_grouped_scores(64, 128, "bfloat16", 4), legalize)],
        "combine": [(tla.build_combine(64, 512, "bfloat16"), {})],
    }  # fmt: skip
    for name, funcs in kernels.items():
        for func, passes in funcs:
            src = lowered_sm90(func, passes)
            body = src[src.index("__global__ void __launch_bounds__") :]
            assert not re.search(r"[/%] \(?(\(int64_t\))?epp\)", body), f"{name}: a division by epp"
            if name != "indexer":
                assert not re.search(r"\] / (l\[|den\b)", body), f"{name}: a division an output"
