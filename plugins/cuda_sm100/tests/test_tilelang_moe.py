"""The TileLang FP4 ``moe_experts`` GEMMs and the choice between kernel languages.

**Here** (no GPU): the e2m1 decoding the TileLang kernels call (the scale tables and the
table lookup, :data:`~deepinfer_cuda_sm100.tl.moe.E2M1X8_PTX`, run through the PTX emulator of
``test_moe_e2m1_ptx.py``: every byte in every position, every ue8m0 exponent and edge-case fp32
scales, bitwise against ``QuantizedTensor.dequantize``), the whole per-thread decoding of a
64 x 128 block assembled by wgmma's A-fragment layout (the reference weight in the kernels' K
order), the CUDA source built around it, the launch plan, which calls the TileLang kernels
refuse (with the reason) and the dispatcher's choice (batch-invariant mode, the FP8 math, the
measured table, the wide variant ``tilelang_wide`` only where timed and fastest, the benchmark's
rows as table points).  Where TileLang imports, every shipped configuration of both variants
lowers for sm_90 to the register-A form (the wide one with its ``setmaxnreg`` split), and the
A-fragment layout the decoding writes is TileLang's wgmma layout for the kernels' warps (slow).

**GPU** (marked ``gpu``; skipped where TileLang cannot compile): the TileLang path against the
reference op on the FP4 conformance cases at V4-Flash shapes (widths 4096 x 2048, 1 to 256
tokens, ue8m0 and float32 scales, a token routed twice to one expert, a shared expert), and the
replay of a captured CUDA graph (bitwise equal to the eager call); the wide variant
(``consumers=2``) bitwise equal to the one-warpgroup kernels at 1 to 2048 tokens (tiles of 16, 32
and 64 rows, both scale formats) and in a replayed graph.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from cuda_sm100_checks import lowered_sm90, pdl_prologue_problem, replayed, sm90a_cubin
from deepinfer_cuda_sm100 import e2m1_ptx, kernel_choice, moe_dispatch
from deepinfer_cuda_sm100.tl import moe as tlm
from deepinfer_cuda_sm100.tl import tilelang_problem

from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.weights.quant import UE8M0_DTYPE, QuantizedTensor

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")
from test_moe_e2m1_ptx import run_ptx  # noqa: E402  (the emulator; it needs triton's module)

BOTH = frozenset({"triton", "tilelang"})


# ---------------------------------------------------------------------------------------------
# the decoding (the kernels' PTX through the emulator)


def _tables(ptx: str, scale_bits: np.ndarray) -> list[np.ndarray]:
    """The five table registers of :data:`TABLE_UE8M0_PTX` / :data:`TABLE_FP32_PTX` for each
    scale (uint32: the ue8m0 byte, or the fp32 bits)."""
    return run_ptx(ptx, [None] * 5 + [scale_bits.astype(np.uint32)])[:5]


def _decode(words: np.ndarray, tables: list[np.ndarray]) -> np.ndarray:
    """:data:`E2M1X8_PTX` on uint32 ``words`` with per-word ``tables``: ``[n, 8]`` bf16 bit
    patterns in register order (register r: low half, high half)."""
    out = run_ptx(tlm.E2M1X8_PTX, [None] * 4 + [words.astype(np.uint32), *tables])
    regs = np.stack(out[:4], axis=1).astype(np.uint32)
    return np.stack([regs & 0xFFFF, regs >> 16], axis=2).reshape(len(words), 8).astype(np.int64)


def _reference_bits(words: np.ndarray, scales: torch.Tensor) -> np.ndarray:
    """``QuantizedTensor.dequantize(bf16)`` of each word (8 inputs) with its own scale."""
    data = torch.from_numpy(np.repeat(words.astype(np.uint32), 4).view(np.uint8).copy()).view(len(words), 16)
    want = QuantizedTensor(data, scales.view(len(words), 1), "fp4", (1, 32)).dequantize(torch.bfloat16)
    return (want[:, :8].contiguous().view(torch.int16).numpy().astype(np.int64) & 0xFFFF).reshape(-1, 8)


def test_unit_scale_tables_are_the_plain_lookup_tables():
    """Scale 1 (ue8m0 127, fp32 1.0) gives the unscaled tables of :mod:`e2m1_ptx`."""
    want = [int(v, 0) & 0xFFFFFFFF for v in e2m1_ptx.IMMEDIATE_TABLES]
    for ptx, bits in ((e2m1_ptx.TABLE_UE8M0_PTX, 127), (e2m1_ptx.TABLE_FP32_PTX, 0x3F800000)):
        got = [int(t[0]) for t in _tables(ptx, np.array([bits]))]
        assert got == want, [hex(v) for v in got]


def test_decode_gives_every_byte_in_every_position_in_input_order():
    b = np.arange(256, dtype=np.uint32)
    words = np.concatenate([(b << (8 * p)) | (((b + 77) % 256) << (8 * ((p + 1) % 4))) for p in range(4)])
    e = np.full(len(words), 127, dtype=np.uint32)
    got = _decode(words, _tables(e2m1_ptx.TABLE_UE8M0_PTX, e))
    want = _reference_bits(words, torch.ones(len(words)))
    assert (got == want).all(), f"{int((got != want).sum())} values differ"
    neg_zero = _decode(np.array([0x00000088], dtype=np.uint32), _tables(e2m1_ptx.TABLE_UE8M0_PTX, e[:1]))[0]
    assert neg_zero[:2].tolist() == [0x8000, 0x8000], "code 8 is -0.0, as the reference decodes it"


def test_ue8m0_tables_give_the_reference_dequantisation_for_every_exponent():
    """Every exponent torch reads as a power of two (1..254), random words: bitwise
    ``QuantizedTensor.dequantize(bf16)`` (subnormal and overflowing products included)."""
    g = np.random.default_rng(0)
    e = np.repeat(np.arange(1, 255, dtype=np.uint32), 8)
    words = g.integers(0, 2**32, size=len(e), dtype=np.uint64).astype(np.uint32)
    got = _decode(words, _tables(e2m1_ptx.TABLE_UE8M0_PTX, e))
    want = _reference_bits(words, torch.from_numpy(e.astype(np.uint8)).view(UE8M0_DTYPE))
    assert (got == want).all(), f"{int((got != want).sum())} values differ"


def test_fp32_tables_give_the_reference_dequantisation():
    """Random, negative, subnormal-producing and huge fp32 scales: bitwise
    ``QuantizedTensor.dequantize(bf16)`` (the fp32 product rounded once to bf16)."""
    gen = torch.Generator().manual_seed(1)
    special = torch.tensor(
        [1.0, -1.0, 0.0, -0.0, 2.0**-20, 2.0**-126, 2.0**-140, 1e-45, 3.0e38, -1.7e38, -0.37, 1.0 / 3]
    )
    scales = torch.cat(
        [special, torch.randn(500, generator=gen) * 0.05, torch.rand(500, generator=gen) * 1e-3]
    )
    scales = scales.repeat_interleave(4)
    words = np.random.default_rng(2).integers(0, 2**32, size=len(scales), dtype=np.uint64).astype(np.uint32)
    got = _decode(words, _tables(e2m1_ptx.TABLE_FP32_PTX, scales.view(torch.int32).numpy().view(np.uint32)))
    want = _reference_bits(words, scales)
    assert (got == want).all(), f"{int((got != want).sum())} values differ"


def test_k_order_is_a_permutation_keeping_pairs_and_groups():
    order = tlm.k_order()
    assert sorted(order) == list(range(tlm.BLOCK_K))
    assert all(tlm.k_position(n) == p for p, n in enumerate(order))
    assert all(order[p + 1] == order[p] + 1 for p in range(0, tlm.BLOCK_K, 2))  # 4-byte runs
    # thread c of a quad (positions 2c, 2c + 1 of every 8) holds exactly scale group c
    assert all(order[p] // tlm.GROUP == (p % 8) // 2 for p in range(tlm.BLOCK_K))


def test_decoded_registers_form_the_dequantised_a_fragment_in_k_order():
    """The whole per-thread decoding of a 64 x 128 block (each thread: its two rows' 16 bytes
    and scale, the emulated PTX, the register placement of :func:`a_register`) assembled by
    the fragment layout TileLang gives wgmma's A operand, equals the reference weight with its
    columns in :func:`k_order` -- for both scale kinds."""
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (tlm.ATOM, tlm.BLOCK_K // 2), generator=gen, dtype=torch.int32).to(
        torch.uint8
    )
    for kind in tlm.SCALE_KINDS:
        if kind == "ue8m0":
            scale = torch.randint(100, 140, (tlm.ATOM, 4), generator=gen).to(torch.uint8).view(UE8M0_DTYPE)
            bits = scale.view(torch.uint8).numpy().astype(np.uint32)
            ptx = e2m1_ptx.TABLE_UE8M0_PTX
        else:
            scale = torch.randn(tlm.ATOM, 4, generator=gen) * 0.01
            bits, ptx = scale.view(torch.int32).numpy().view(np.uint32), e2m1_ptx.TABLE_FP32_PTX
        want = QuantizedTensor(data, scale, "fp4", (1, 32)).dequantize(torch.bfloat16)[:, tlm.k_order()]
        regs = np.zeros((tlm.THREADS, 32), dtype=np.uint32)  # each thread's A fragment
        words = data.numpy().view(np.uint32)  # [64, 16]: row, word
        t, rh = np.meshgrid(np.arange(tlm.THREADS), np.arange(2), indexing="ij")  # one lane each
        t, rh = t.reshape(-1), rh.reshape(-1)
        row, c = 16 * (t // 32) + 8 * rh + (t % 32) // 4, t % 4
        tables = _tables(ptx, bits[row, c])
        for q in range(4):
            pairs = run_ptx(tlm.E2M1X8_PTX, [None] * 4 + [words[row, 4 * c + q], *tables])[:4]
            for i in range(4):
                regs[t, tlm.a_register(q, i) + rh] = pairs[i]
        halves = np.stack([regs & 0xFFFF, regs >> 16], axis=2).reshape(tlm.THREADS, 64)
        got = np.array(
            [[halves[tlm._a_thread(i, j), tlm._a_local(i, j)] for j in range(128)] for i in range(64)]
        )
        want_bits = want.contiguous().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        assert (got == want_bits).all(), f"{kind}: {int((got != want_bits).sum())} weights differ"


def test_decode_source_embeds_the_emulated_ptx():
    src = tlm.decode_source()
    for name in (tlm.DECODE_UE8M0, tlm.DECODE_FP32, tlm.KEEP):
        assert f"void {name}(" in src
    for ptx in (tlm.E2M1X8_PTX, e2m1_ptx.TABLE_UE8M0_PTX, e2m1_ptx.TABLE_FP32_PTX):
        for line in ptx.splitlines()[1:-1]:
            assert line.strip().replace("$", "%") in src  # the very instructions tested above


# ---------------------------------------------------------------------------------------------
# launch plan, supports, choice


@pytest.mark.parametrize("consumers", tlm.CONSUMERS)
@pytest.mark.parametrize("tokens", [1, 16, 64, 256, 4096])
def test_launch_plan_covers_every_feature_and_tile(tokens, consumers):
    from deepinfer_cuda_sm100.kernels.moe import tile_count

    plan = tlm.launch_plan(tokens, 6, 256, 4096, 2048, consumers)
    bm = tlm.tile_height(tokens * 6, 256)
    assert plan["block_m"] == bm and plan["tiles"] == tile_count(tokens * 6, 256, bm)
    # 64 features a consumer warpgroup, their gate and up rows
    assert plan["gate_up_grid"] == (2048 // (64 * consumers), plan["tiles"])
    assert plan["down_grid"][0] * 128 * consumers == 4096  # 128 model features a warpgroup
    assert bm in (16, 32, 64)  # the wgmma N of the token side


@pytest.mark.parametrize(
    ("tokens", "experts", "height"),
    [(1, 256, 16), (256, 256, 16), (128, 64, 16), (256, 64, 32), (512, 64, 32), (8192, 256, 64)],
)
def test_tile_height_takes_32_rows_from_one_and_a_half_tiles_an_expert(tokens, experts, height):
    from deepinfer_cuda_sm100.kernels.moe import tile_rows

    assert tlm.tile_height(tokens * 6, experts) == height
    if height != 32:
        assert height == tile_rows(tokens * 6, experts, False)  # elsewhere the Triton path's rows


def test_launch_plan_takes_a_given_tile_height_and_names_a_wrong_one():
    from deepinfer_cuda_sm100.kernels.moe import tile_count

    plan = tlm.launch_plan(256, 6, 64, 4096, 2048, 2, block_m=16)
    assert plan["block_m"] == 16 and plan["tiles"] == tile_count(256 * 6, 64, 16)
    with pytest.raises(ValueError, match="block_m=24"):
        tlm.launch_plan(256, 6, 64, 4096, 2048, 2, block_m=24)
    tall = tlm.launch_plan(8192, 6, 64, 4096, 2048, 1, block_m=tlm.PREFILL_BLOCK_M)
    assert tall["tiles"] == tile_count(8192 * 6, 64, 128) and tall["gate_up_grid"] == (32, tall["tiles"])
    with pytest.raises(ValueError, match="block_m=96: the TileLang MoE kernels with 2 consumer"):
        tlm.launch_plan(8192, 6, 64, 4096, 2048, 2, block_m=96)
    assert tlm.tile_height(8192 * 6, 64) == 64, "the one-warpgroup kernels' default heights stop at 64 rows"
    wide = tlm.launch_plan(8192, 6, 64, 4096, 2048, 2)
    assert wide["block_m"] == 128 and wide["down_grid"] == (16, tile_count(8192 * 6, 64, 128))


@pytest.mark.parametrize(
    ("pairs_an_expert", "height"), [(tlm.WIDE_TALL_PAIRS, 128), (tlm.WIDE_TALL_PAIRS - 1, 64)]
)
def test_the_wide_variant_takes_128_rows_from_its_tall_threshold(pairs_an_expert, height):
    assert tlm.tile_height(pairs_an_expert * 64, 64, consumers=2) == height
    assert tlm.tile_height(pairs_an_expert * 64, 64, consumers=1) == 64


def test_the_wide_variant_names_the_widths_and_variants_it_refuses():
    assert tlm.wide_problem(4096, 2048) is None
    assert "multiple of 256" in tlm.wide_problem(384, 2048)
    x, ids, w, gu, dn, lim = _call(d=384, i=128, gate_up=_fp4(8, 256, 384), down=_fp4(8, 384, 128))
    assert moe_dispatch.tilelang_supports(x, ids, w, gu, dn, lim) is True  # the narrow kernels take it
    with pytest.raises(ValueError, match="multiple of 256"):
        tlm.moe_experts(x, ids, w, gu, dn, lim, consumers=2)
    with pytest.raises(ValueError, match="consumers=3"):
        tlm.moe_experts(*_call(), consumers=3)
    assert moe_dispatch.languages(384, 128) == {"triton", "tilelang"}
    assert moe_dispatch.languages(4096, 2048) == {"triton", "tilelang", "tilelang_wide"}


def _fp4(e, out, inp, scale_dtype="ue8m0", group=32):
    data = torch.zeros(e, out, inp // 2, dtype=torch.uint8)
    scale = torch.ones(e, out, inp // group)
    return QuantizedTensor(
        data, scale.to(UE8M0_DTYPE) if scale_dtype == "ue8m0" else scale, "fp4", (1, group)
    )


def _call(t=4, d=256, i=128, e=8, k=2, dtype=torch.bfloat16, **kw):
    x = torch.zeros(t, d, dtype=dtype)
    ids = torch.zeros(t, k, dtype=torch.int64)
    w = torch.ones(t, k)
    gate_up = kw.get("gate_up", _fp4(e, 2 * i, d))
    down = kw.get("down", _fp4(e, d, i))
    return x, ids, w, gate_up, down, 10.0


def test_tilelang_supports_v4_fp4_calls_and_names_what_it_refuses():
    assert moe_dispatch.tilelang_supports(*_call()) is True
    assert moe_dispatch.tilelang_supports(*_call(gate_up=_fp4(8, 256, 256, "fp32"))) is True
    cases = {
        "bfloat16": _call(dtype=torch.float16),
        "FP4 QuantizedTensor": _call(down=torch.zeros(8, 256, 128, dtype=torch.bfloat16)),
        "groups of 64": _call(gate_up=_fp4(8, 256, 256, group=64)),
        "multiples of 128": _call(d=192, gate_up=_fp4(8, 256, 192), down=_fp4(8, 192, 128)),
        "no (token, slot) pairs": _call(t=0),
    }
    for needle, args in cases.items():
        verdict = moe_dispatch.tilelang_supports(*args)
        assert isinstance(verdict, str) and needle in verdict, (needle, verdict)
    x, ids, w, gu, dn, lim = _call()
    many = 300_000  # one expert, 16 slots a token: 4.8M pairs in tiles of 64, past the grid's 65535
    big = (x[:1].expand(many, -1), ids[:1, :1].expand(many, 16), w[:1, :1].expand(many, 16))
    assert "at most 65535" in moe_dispatch.tilelang_supports(*big, _fp4(1, 256, 256), _fp4(1, 256, 128), lim)
    strided = QuantizedTensor(gu.data.transpose(0, 1).contiguous().transpose(0, 1), gu.scale, "fp4", (1, 32))
    assert "contiguous" in moe_dispatch.tilelang_supports(x, ids, w, strided, dn, lim)


def test_choice_kind_names_the_scale_format():
    assert moe_dispatch.choice_kind(_fp4(2, 4, 64)) == "fp4"
    assert moe_dispatch.choice_kind(_fp4(2, 4, 64, "fp32")) == "fp4+fp32"


def _point(pairs: int, tl: float, tr: float, wide: float | None = None) -> kernel_choice.Point:
    ms = {"tilelang": tl, "triton": tr} | ({} if wide is None else {"tilelang_wide": wide})
    return kernel_choice.Point("moe_experts", "fp4", "bfloat16", 4096, 2048, pairs, 256, ms)


def test_measured_points_pick_the_faster_language_and_triton_outside_them():
    points = (_point(96, 1.0, 2.0), _point(1536, 3.0, 2.0))

    def choose(pairs, available=BOTH):
        return kernel_choice.choose(
            "moe_experts", "fp4", "bfloat16", 4096, 2048, pairs, 256, "sm90", available, points=points
        )

    assert choose(96) == "tilelang" and choose(120) == "tilelang"
    assert choose(1536) == "triton"
    assert choose(6) == "triton"  # fewer pairs than any measured point
    assert choose(96, frozenset({"triton"})) == "triton"


def test_the_wide_variant_is_taken_only_where_timed_and_fastest():
    """``tilelang_wide`` is a language of its own in the table: chosen where it was timed around
    the pair count and fastest, never extrapolated past its points, never for widths it refuses."""
    points = (
        _point(6, 1.0, 2.0, wide=0.8),
        _point(96, 1.0, 2.0, wide=0.5),
        _point(384, 1.0, 2.0, wide=1.5),
        _point(1536, 1.0, 2.0),  # not timed here
    )

    def choose(pairs, widths=(4096, 2048)):
        return kernel_choice.choose(
            "moe_experts", "fp4", "bfloat16", 4096, 2048, pairs, 256, "sm90",
            moe_dispatch.languages(*widths), points=points,
        )  # fmt: skip

    assert choose(6) == "tilelang_wide" and choose(96) == "tilelang_wide"
    assert choose(384) == "tilelang"  # timed, slower than the one-warpgroup kernels
    assert choose(1536) == "tilelang"  # past the wide variant's measured pairs: not extrapolated
    assert choose(96, widths=(384, 2048)) == "tilelang"  # widths the wide kernels refuse


def test_bench_rows_become_points_that_pick_the_fastest_timed_variant():
    """``bench_moe.py --write-choices``: its rows' times become ``moe_experts`` points with a
    ``tilelang_wide`` entry where the wide variant was timed, which the dispatcher's choice reads."""
    from cuda_sm100_checks import choice_writers

    writers = choice_writers()
    rows = [
        {"T": 1, "triton_fp4_us": 80.0, "tilelang_fp4_us": 70.0, "tilelang_wide_fp4_us": 50.0},
        {"T": 16, "triton_fp4_us": 400.0, "tilelang_fp4_us": 300.0, "tilelang_wide_fp4_us": 350.0},
        {"T": 64, "triton_fp4_us": 500.0, "tilelang_fp4_us": 450.0, "tilelang_wide_fp4_us": None},
        {"T": 128, "triton_fp4_us": 500.0, "tilelang_fp4_us": None},  # no TileLang time: left out
    ]
    dicts = writers.moe_points(rows, 4096, 2048, 256, 6)
    assert [p["tokens"] for p in dicts] == [6, 96, 384]
    assert dicts[0]["ms"] == {"triton": 0.08, "tilelang": 0.07, "tilelang_wide": 0.05}
    assert set(dicts[2]["ms"]) == {"triton", "tilelang"}
    points = tuple(kernel_choice.Point(**p) for p in dicts)

    def choose(pairs):
        return kernel_choice.choose(
            "moe_experts", "fp4", "bfloat16", 4096, 2048, pairs, 256, "sm90",
            moe_dispatch.languages(4096, 2048), points=points,
        )  # fmt: skip

    assert [choose(6), choose(96), choose(384)] == ["tilelang_wide", "tilelang", "tilelang"]
    # float32-scale points are their own kind: the ue8m0 points never decide those calls
    fp32 = writers.moe_points(rows, 4096, 2048, 256, 6, "fp4+fp32")
    assert {p["kind"] for p in fp32} == {"fp4+fp32"} and [p["ms"] for p in fp32] == [p["ms"] for p in dicts]
    assert kernel_choice.choose(
        "moe_experts", "fp4+fp32", "bfloat16", 4096, 2048, 6, 256, "sm90",
        moe_dispatch.languages(4096, 2048), points=points,
    ) == "triton"  # fmt: skip


def test_dispatch_keeps_triton_off_the_gpu_in_batch_invariant_mode_and_fp8_math(monkeypatch):
    """The CPU calls here, the batch-invariant mode and the FP8 math never reach TileLang,
    whatever the table says."""
    assert moe_dispatch.choose_language(*_call()) == "triton"  # a CPU tensor
    cuda = torch.device("cuda", 0)
    assert "cpu" in moe_dispatch.mode_problem(torch.device("cpu"))
    with batch_invariant_mode(True):
        assert "batch-invariant" in moe_dispatch.mode_problem(cuda)
    monkeypatch.setenv("DEEPINFER_MOE_MATH", "fp8")
    assert "fp8" in moe_dispatch.mode_problem(cuda)
    monkeypatch.setenv("DEEPINFER_MOE_MATH", "bf16")
    assert moe_dispatch.mode_problem(cuda) is None


def test_the_op_registers_the_dispatcher():
    from deepinfer_cuda_sm100.moe_ops import moe_ops

    fn = moe_ops()["moe_experts"].fn
    assert fn.__name__ == "moe_experts" and "TileLang" in fn.__doc__


def test_precompile_lists_every_decode_tile_and_scale_kind():
    from deepinfer_cuda_sm100.tl.precompile import moe_configurations

    configs = moe_configurations(4096, 2048)
    assert len(configs) == len(set(configs)) == 34
    assert {(c[0], c[3], c[4], c[5]) for c in configs if len(c) == 10} == {
        (kind, bm, scale, consumers)
        for kind in ("gate_up", "down")
        for consumers in (1, 2)
        for bm in (16, 32, 64, *((tlm.PREFILL_BLOCK_M,) if consumers == 2 else ()))
        for scale in tlm.SCALE_KINDS
    }
    # what decode-sized calls run by default: the one-warpgroup gate / up kernel on gathered rows
    gathered = {(c[0], c[3], c[4], c[5]) for c in configs if len(c) == 11 and c[10]}
    assert gathered == {("gate_up", bm, scale, 1) for bm in (16, 32, 64) for scale in tlm.SCALE_KINDS}
    assert tlm.gathers_rows(tlm.GATHER_MAX_TOKENS, 1) and not tlm.gathers_rows(tlm.GATHER_MAX_TOKENS + 1, 1)
    assert not tlm.gathers_rows(1, 2)
    assert {c[5] for c in moe_configurations(384, 2048)} == {1}  # the wide kernels refuse D=384


def test_register_splits_fill_the_register_file_and_the_bench_names_them():
    """``split_for``: ``setmaxnreg`` moves registers within a CTA's pool, so producer and consumer
    together get twice the launch allotment of ``ctas`` CTAs of 256 threads (65,536 registers
    an SM, rounded down to 8 a thread) and no more; :data:`SPLIT_REGS`'s splits are its (the
    same counts at 4 and 3 CTAs, a 40-register producer at 2); impossible splits are refused,
    and a split asking for more than the pool holds (which would hang at its first increase)
    is refused before any launch; ``bench_moe.py``'s ``--compiler-registers`` /
    ``--ctas-per-sm`` items parse to those splits."""
    import sys
    from pathlib import Path

    assert tlm.split_for(4) == tlm.SPLIT_REGS[16] == (4, 24, 104)
    assert tlm.split_for(3) == tlm.SPLIT_REGS[32] == (3, 24, 136)
    assert tlm.split_for(2, producer=40) == tlm.SPLIT_REGS[64] == (2, 40, 216)
    for ctas in (1, 2, 3, 4, 5):
        c, producer, consumer = tlm.check_split(tlm.split_for(ctas))
        pool = 2 * (min(65536 // (256 * c), 255) // 8 * 8)  # two warpgroups' launch registers
        assert consumer % 8 == 0 and producer + consumer <= pool
        assert consumer == 256 or pool < producer + consumer + 8
    for split in tlm.SPLIT_REGS.values():
        assert tlm.check_split(split) == split
    with pytest.raises(ValueError, match=r"\(3, 24, 144\).*wait forever"):
        tlm.check_split((3, 24, 144))  # 168 registers a thread against the 160 of three CTAs
    with pytest.raises(ValueError, match="register split"):
        tlm.split_for(11)  # 46 registers a thread: no room for a consumer beside the producer
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from register_splits import register_splits

    assert register_splits("16,32", "16=3") == [(16, False), (32, False), (16, (3, 24, 136))]
    with pytest.raises(ValueError, match="one-warpgroup"):
        x, ids, w = torch.zeros(1, 256), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2)
        stacks = (torch.zeros(2, 256, 256), torch.zeros(2, 256, 128))  # widths the wide kernels take
        tlm.moe_experts(x, ids, w, *stacks, 1.0, consumers=2, split_registers=(3, 24, 136))
    with pytest.raises(ValueError, match="wait forever"):  # refused before the layout's launch
        tlm.moe_experts(x, ids, w, *stacks, 1.0, consumers=1, split_registers=(3, 24, 144))


def test_routing_weights_reach_the_down_kernel_without_a_conversion():
    """``moe_route``'s bf16 weights (and float32 ones) go to the down kernel as they are (no
    launch), the kernel compiled for their dtype, by default the bf16 one precompile builds; the
    kernel's bf16 rounding of a weight makes that the product its float32 copy gave.  Another
    dtype is converted to float32 exactly, as before."""
    import inspect

    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 6, generator=g).to(torch.bfloat16)
    for x, name in ((w, "bfloat16"), (w.float(), "float32")):
        rw, got = tlm.routing_weights(x)
        assert rw is x and got == name
    rw, got = tlm.routing_weights(w.t())  # a strided view: made contiguous, dtype kept
    assert got == "bfloat16" and rw.is_contiguous() and torch.equal(rw, w.t())
    rw, got = tlm.routing_weights(w.half())
    assert got == "float32" and rw.dtype == torch.float32 and torch.equal(rw, w.half().float())
    # what the kernel multiplies by: float(bf16(weight)), the same bits either way
    assert torch.equal(w.float().to(torch.bfloat16).float().view(torch.int32), w.float().view(torch.int32))
    for fn in (tlm._kernel, tlm.build_down):
        assert inspect.signature(fn).parameters["weights"].default == "bfloat16"


# ---------------------------------------------------------------------------------------------
# lowering (where TileLang imports, no GPU needed)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("consumers", tlm.CONSUMERS)
@pytest.mark.parametrize("kind", ["gate_up", "down"])
def test_every_configuration_lowers_for_sm90(kind, consumers):
    """Every configuration precompile lists lowers to the warp-specialised register-A form: a
    TMA producer, the decoding into the A fragment, ``wgmma`` with A in registers; both variants
    with their register split (``setmaxnreg``) and launch bound, and the accumulator fence
    naming exactly a thread's accumulator registers."""
    import re

    import tilelang
    import tvm
    from deepinfer_cuda_sm100.tl.precompile import moe_configurations
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90"})
    build = tlm.build_gate_up if kind == "gate_up" else tlm.build_down
    plain = [c for c in moe_configurations(4096, 2048) if len(c) == 10]  # (not the gathered rows')
    configs = [c for c in plain if c[0] == kind and c[5] == consumers]
    assert len(configs) == (6 if consumers == 1 else 8)  # the wide variant also at 128 rows
    for _, hidden, inter, bm, scale, *_ in configs:  # (consumers, stages)
        with target, tvm.transform.PassContext(config=tlm.PASS_CONFIGS):
            func = (
                build(hidden, inter, bm, scale)
                if consumers == 1
                else build(hidden, inter, bm, scale, consumers=2)
            )
            src = tilelang.lower(func, target=target).kernel_source
        assert f"64, {bm}, 16" in src, "the transposed wgmma: 64 weight rows x BLOCK_M tokens"
        assert "wgmma_rs<" in src and "wgmma_ss<" not in src, "the weights reach wgmma in registers"
        assert "tma_load(" in src and "mbarrier" in src, "a TMA producer feeds a shared ring"
        fn = tlm.DECODE_UE8M0 if scale == "ue8m0" else tlm.DECODE_FP32
        assert f"{fn}(" in src
        assert src.count("__syncthreads()") == 1, "one block barrier (after the mbarriers' set-up)"
        ctas, producer, consumer = (tlm.SPLIT_REGS if consumers == 1 else tlm.WIDE_REGS)[bm]
        # consumers x 128 producer + consumers x 128 consumer threads
        assert f"__launch_bounds__({256 * consumers}, {ctas})" in src
        assert f"warpgroup_reg_dealloc<{producer}>" in src and f"warpgroup_reg_alloc<{consumer}>" in src
        assert 128 * consumers * (producer + consumer) * ctas <= 65536, "the split fits the register file"
        fences = re.findall(r"warpgroup_fence_operand\(reinterpret_cast<float\*>\(\w+ \+ 0\), (\d+)\)", src)
        assert fences and {int(n) for n in fences} == {64 * bm // 128}, "a thread's accumulator registers"


def _ptxas_report(func, path) -> str:
    """``ptxas -v``'s report of ``func`` (a ``prim_func``) lowered and built for sm_90a."""
    return sm90a_cubin(lowered_sm90(func, tlm.PASS_CONFIGS), path)


@pytest.mark.slow
@pytest.mark.skipif(tilelang_problem() is not None, reason=f"needs TileLang and nvcc: {tilelang_problem()}")
@pytest.mark.parametrize("kind", ["gate_up", "down"])
def test_three_ctas_an_sm_keep_the_16_row_kernels_wgmma_pipelined(kind, tmp_path):
    """Built for sm_90a, the one-warpgroup kernels at 16-row tiles with :func:`split_for` ``(3)``
    compile without spills and without ptxas serialising their wgmma instructions (C7512), which
    it does under :data:`SPLIT_REGS`'s four CTAs an SM (64 registers at launch)."""
    build = tlm.build_gate_up if kind == "gate_up" else tlm.build_down
    reports = {
        ctas: _ptxas_report(
            build(4096, 2048, 16, "ue8m0", split_registers=tlm.split_for(ctas)), tmp_path / f"k{ctas}.cu"
        )
        for ctas in (3, 4)
    }
    assert "C7512" not in reports[3] and "0 bytes spill stores" in reports[3]
    assert "C7512" in reports[4], "the four-CTA split's serialisation (documented in SPLIT_REGS) went away"


@pytest.mark.slow
@pytest.mark.skipif(tilelang_problem() is not None, reason=f"needs TileLang and nvcc: {tilelang_problem()}")
@pytest.mark.parametrize("consumers", tlm.CONSUMERS)
@pytest.mark.parametrize("kind", ["gate_up", "down"])
def test_k_halves_keep_the_default_splits_wgmma_pipelined(kind, consumers, tmp_path):
    """Built for sm_90a with the default register split at 16-row tiles (four CTAs an SM for one
    consumer warpgroup, two for the wide variant), the K step in two halves (``halves``: 16 live
    A registers a thread instead of 32) compiles without spills and without ptxas serialising
    its wgmma (C7512), which the one-pass step does there."""
    build = tlm.build_gate_up if kind == "gate_up" else tlm.build_down
    reports = {
        halves: _ptxas_report(
            build(4096, 2048, 16, "ue8m0", consumers=consumers, halves=halves), tmp_path / f"k{halves}.cu"
        )
        for halves in (True, False)
    }
    assert "C7512" not in reports[True] and "0 bytes spill stores" in reports[True]
    assert "C7512" in reports[False], "the one-pass step's serialisation went away: halves may not be needed"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("consumers", tlm.CONSUMERS)
@pytest.mark.parametrize("block_m", [16, 32])
def test_the_down_epilogue_reads_each_rows_pair_and_weight_once_without_dividing(block_m, consumers):
    """The down kernel's epilogue: one global read of ``slot_pair`` and one of the routing
    weights per row of the tile (into shared memory, behind the consumers' barrier), the
    weights read flat (``rw[p]``), so no integer division or remainder by a runtime value
    anywhere in the kernel; every output then reads its row's pair and weight from shared
    memory."""
    import re

    src = lowered_sm90(tlm.build_down(4096, 2048, block_m, "ue8m0", consumers=consumers), tlm.PASS_CONFIGS)
    body = src[src.index("__global__ void __launch_bounds__") :]
    assert body.count("slot_pair[") == 1 and body.count("rw[") == 1, "one read of each per row"
    assert not re.search(r"[%/] (K|TK|T|NS|P)\)", body), "an integer division by a runtime value"
    staged = body.index("pairs[")
    assert re.search(r"__sync_thread_partial\(\d+, \d+\)", body[staged:]), "the consumers' barrier"
    assert "y[" in body[staged:] and "y[" not in body[:staged]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("consumers", tlm.CONSUMERS)
def test_with_gathered_activations_the_gate_up_kernel_loads_them_by_tma(consumers):
    """``gathered``: the activations arrive by TMA copies of the tile's rows (as ``h`` in the
    down kernel), with no per-token address arithmetic or 4-byte gathers of ``x`` in the
    producer; the launch bound, the register split and the wgmma are the default's."""
    import re

    default = lowered_sm90(tlm.build_gate_up(4096, 2048, 32, "ue8m0", consumers=consumers), tlm.PASS_CONFIGS)
    src = lowered_sm90(
        tlm.build_gate_up(4096, 2048, 32, "ue8m0", consumers=consumers, gathered=True), tlm.PASS_CONFIGS
    )
    assert "tma_load(x_desc" in src and "tma_load(x_desc" not in default
    assert "tok_magic) >>" in default and "tok_magic) >>" not in src, "no token arithmetic per row"
    assert re.findall(r"cp_async_gs_conditional<4>\(\(&\(\(\(bfloat16_t\*\)xs\)", default)
    assert not re.findall(r"\(bfloat16_t\*\)xs\)\[[^;]*cp_async", src) and "(&(x[" not in src
    for pattern in (r"__launch_bounds__\(\d+, \d+\)", r"warpgroup_reg_(?:de)?alloc<\d+>", r"wgmma_rs<[^>]*>"):
        found = sorted(set(re.findall(pattern, src)))
        assert found and found == sorted(set(re.findall(pattern, default))), pattern


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("kind", ["gate_up", "down"])
def test_the_prefill_tile_height_lowers_to_n_128_without_a_register_split(kind):
    """``PREFILL_BLOCK_M`` rows: the one-warpgroup kernels' wgmma with N = 128 and the
    compiler's register allotment (one CTA an SM), the same accumulator fence rule."""
    import re

    import tilelang
    import tvm
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90"})
    build = tlm.build_gate_up if kind == "gate_up" else tlm.build_down
    bm = tlm.PREFILL_BLOCK_M
    with target, tvm.transform.PassContext(config=tlm.PASS_CONFIGS):
        src = tilelang.lower(build(4096, 2048, bm, "ue8m0"), target=target).kernel_source
    assert f"64, {bm}, 16" in src and "wgmma_rs<" in src
    assert "__launch_bounds__(256, 1)" in src and "warpgroup_reg_alloc" not in src
    fences = re.findall(r"warpgroup_fence_operand\(reinterpret_cast<float\*>\(\w+ \+ 0\), (\d+)\)", src)
    assert fences and {int(n) for n in fences} == {64 * bm // 128}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("consumers", tlm.CONSUMERS)
def test_a_fragment_layout_is_tilelangs_wgmma_layout_for_the_kernels_warps(consumers):
    """The decoding writes the A fragment by :func:`a_fragment_layout`; it must be the layout
    TileLang's wgmma emitter reads for the kernels' warp split (one warpgroup: the default
    policy over 4 warps; two: ``FullRow`` over 8, warpgroup ``g`` rows ``64 g ..``)."""
    import tvm.tirx as tirx
    from tilelang import ir
    from tilelang import language as T
    from tilelang.cuda.intrinsics.macro.wgmma_macro_generator import TensorCoreIntrinEmitter
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90"})
    rows = tlm.ATOM * consumers
    policy = T.GemmWarpPolicy.Square if consumers == 1 else T.GemmWarpPolicy.FullRow
    for bm in (16, 32, 64):
        warps = ir.GemmWarpPolicy(int(policy), 0, 0).compute_warp_partition(
            rows, bm, 128 * consumers, target, "cuda.wgmma"
        )
        assert warps == (4 * consumers, 1)
        emitter = TensorCoreIntrinEmitter(
            a_dtype="bfloat16", b_dtype="bfloat16", accum_dtype="float32", a_transposed=False,
            b_transposed=True, block_row_warps=warps[0], block_col_warps=warps[1],
            warp_row_tiles=rows // warps[0], warp_col_tiles=bm // warps[1], chunk=tlm.BLOCK_K,
        )  # fmt: skip
        frag = tirx.decl_buffer((rows, tlm.BLOCK_K), "bfloat16", scope="local.fragment")
        assert tlm.a_fragment_layout(rows).is_equal(emitter.make_mma_load_layout(frag, matrix="A"))


# ---------------------------------------------------------------------------------------------
# GPU

V4_D, V4_I, V4_K = 4096, 2048, 6


def _gpu_ready() -> None:
    if not torch.cuda.is_available() or tilelang_problem() is not None:
        pytest.skip(f"needs a CUDA GPU and TileLang ({tilelang_problem()})")


def _v4_cases(
    tokens: tuple[int, ...] = (1, 16, 64, 256), scales: tuple[str, ...] = ("ue8m0", "fp32")
) -> list[tuple]:
    """FP4 conformance cases at V4-Flash widths on the GPU, 64 experts (random codes, scales
    near ``1 / (3 sqrt(inp))``): each of ``scales`` (ue8m0, float32), each of ``tokens``, a
    duplicate expert, a shared expert at 16 tokens."""
    from test_moe_kernel import _random_fp4, _routing

    out = []
    for scale in scales:
        gate_up, down = _random_fp4(64, 2 * V4_I, V4_D, scale), _random_fp4(64, V4_D, V4_I, scale)
        for t in tokens:
            g = torch.Generator().manual_seed(t)
            ids, weights = _routing(g, t, 64, V4_K)
            if t > 1:
                ids[1, 1] = ids[1, 0]  # a token routed twice to one expert
            x = torch.randn(t, V4_D, generator=g).to(torch.bfloat16).cuda()
            shared = torch.randn(t, V4_D, generator=g).to(torch.bfloat16).cuda() if t == 16 else None
            out.append((x, ids.cuda(), weights.cuda(), gate_up, down, 10.0, shared))
    return out


@pytest.mark.gpu
def test_gpu_tilelang_matches_the_reference_at_v4_flash_shapes():
    _gpu_ready()
    from deepinfer_core.ops.moe import moe_experts as reference

    for args in _v4_cases():
        assert moe_dispatch.tilelang_supports(*args) is True
        want = reference(*args).float()
        got = tlm.moe_experts(*args).float()
        scale = want.abs().max().item()
        assert scale > 0.1, "degenerate outputs"
        torch.testing.assert_close(got, want, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_tilelang_replays_in_a_cuda_graph_bitwise():
    _gpu_ready()
    for args in _v4_cases()[1:4]:
        eager = tlm.moe_experts(*args)
        assert torch.equal(replayed(lambda args=args: tlm.moe_experts(*args)), eager)


def _wide_cases() -> list[tuple]:
    """:func:`_v4_cases` from 1 to 2048 tokens: tiles of 16, 32 and 64 rows."""
    return _v4_cases((1, 16, 64, 256, 512, 2048))


@pytest.mark.gpu
def test_gpu_wide_variant_is_bitwise_the_one_warpgroup_kernels():
    """Two consumer warpgroups a CTA change only which warpgroup computes which rows: the same
    K order, decoding and rounding points, so the result is bitwise that of ``consumers=1``;
    so is the one-warpgroup kernels' result with the compiler's register allotment."""
    _gpu_ready()
    from deepinfer_cuda_sm100.kernels.moe import tile_rows

    heights = set()
    for args in _wide_cases():
        heights.add(tile_rows(args[0].shape[0] * V4_K, 64, False))
        narrow = tlm.moe_experts(*args)
        wide = tlm.moe_experts(*args, consumers=2)
        compiler_registers = tlm.moe_experts(*args, split_registers=False)
        assert narrow.abs().max().item() > 0.1, "degenerate outputs"
        assert torch.equal(wide, narrow), (args[0].shape[0], args[3].scale.dtype)
        assert torch.equal(compiler_registers, narrow), (args[0].shape[0], args[3].scale.dtype)
    assert heights == {16, 32, 64}


@pytest.mark.gpu
def test_gpu_prefill_tiles_are_bitwise_the_64_row_tiles():
    """A token's column does not depend on its tile: 128-row tiles give the 64-row tiles' bits,
    in both variants (512, 2,048 and 4,608 tokens over 64 experts: 48, 192 and 432 rows an
    expert, tiles part full; the last the wide variant's default 128 rows)."""
    _gpu_ready()
    for args in _v4_cases((512, 2048, 4608)):
        want = tlm.moe_experts(*args, block_m=64)
        assert want.abs().max().item() > 0.1, "degenerate outputs"
        for consumers in tlm.CONSUMERS:
            tall = tlm.moe_experts(*args, consumers=consumers, block_m=tlm.PREFILL_BLOCK_M)
            assert torch.equal(tall, want), (args[0].shape[0], consumers)
        assert torch.equal(tlm.moe_experts(*args, consumers=2), want), "the wide default height"


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["gathered", "halves"])
def test_gpu_gathered_activations_and_k_halves_give_the_same_bits(option):
    """The activations gathered into the sorted rows first and loaded by TMA (``gathered``), and
    each K step decoded and multiplied in two K halves (``halves``), each give bitwise the
    default kernels' result, both variants, tiles of 16, 32 and 64 rows, both scale formats (the
    two together too); and replay in a CUDA graph bitwise."""
    _gpu_ready()
    on = {option: True}
    for args in _wide_cases():
        for consumers in tlm.CONSUMERS:
            want = tlm.moe_experts(*args, consumers=consumers, gathered=False)
            got = tlm.moe_experts(*args, consumers=consumers, **on)
            assert torch.equal(got, want), (args[0].shape[0], consumers, args[3].scale.dtype)
    for args in _v4_cases()[1:4]:
        eager = tlm.moe_experts(*args, **on)
        assert torch.equal(tlm.moe_experts(*args, gathered=True, halves=True), eager)
        assert torch.equal(replayed(lambda args=args: tlm.moe_experts(*args, **on)), eager)


@pytest.mark.gpu
def test_gpu_other_register_splits_give_the_same_bits():
    """Three CTAs an SM at 16-row tiles (:func:`split_for`) and the compiler's allotment give the
    default split's bits, in both scale formats (the split moves registers between warpgroups
    and touches no arithmetic)."""
    _gpu_ready()
    for args in _v4_cases((1, 16, 64)):
        want = tlm.moe_experts(*args, block_m=16)
        for split in (tlm.split_for(3), False):
            assert torch.equal(tlm.moe_experts(*args, block_m=16, split_registers=split), want), split


@pytest.mark.gpu
def test_gpu_wide_variant_replays_in_a_cuda_graph_bitwise():
    _gpu_ready()
    cases = _wide_cases()
    for args in (cases[1], cases[3], cases[4], cases[5], cases[6]):
        eager = tlm.moe_experts(*args, consumers=2)
        assert torch.equal(replayed(lambda args=args: tlm.moe_experts(*args, consumers=2)), eager)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("consumers", tlm.CONSUMERS)
@pytest.mark.parametrize("kind", ["gate_up", "down"])
def test_with_pdl_the_gemms_wait_before_any_global_access(kind, consumers):
    """With ``pdl`` both GEMMs (one and two consumer warpgroups) wait for the kernel before them
    (``griddepcontrol.wait``: the layout kernel writes the tiles' experts and rows, the gate /
    up kernel ``h``) after setting up their barriers and before any global access, then let the
    next kernel be scheduled; TileLang marks them for a PDL launch.  Without ``pdl`` none of
    it is there; precompile lists the variant this device launches."""
    from deepinfer_cuda_sm100.tl.pdl import tl_pdl_enabled
    from deepinfer_cuda_sm100.tl.precompile import moe_configurations

    build = tlm.build_gate_up if kind == "gate_up" else tlm.build_down
    accesses = r"(tma_load|\btile_expert\[|\bslot_pair\[|\bx\[|\bs\[|\bh\[|\bhs\[|\brw\[|\by\[)"
    problem = pdl_prologue_problem(build(4096, 2048, 16, "ue8m0", consumers=consumers, pdl=True), accesses)
    assert problem is None, problem
    plain = lowered_sm90(build(4096, 2048, 16, "ue8m0", consumers=consumers))
    assert "cudaGridDependencySynchronize" not in plain and "cudaTriggerProgrammatic" not in plain
    assert {c[9] for c in moe_configurations(4096, 2048)} == {tl_pdl_enabled()}
