"""The ``cuda_sm100`` MoE kernels (``moe_experts``: FP4 or plain experts) against the reference.

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not
leak into this pytest process, so the interpreter checks run in a child: ``python
test_moe_kernel.py --interpreter-report`` prints a JSON report and each test below reads one
part of it.  On small shapes it runs

- the conformance suite (``check_backend``) on a CPU ``BackendSpec`` holding the op: the core's
  cases and the kernel's (:data:`deepinfer_cuda_sm100.moe_ops.SMALL`: FP4 experts with float32
  and ue8m0 scales, plain experts, a mix; T=1, duplicate ids in a token, tokens sharing
  experts, T > E*k) in float32, bfloat16 and float16, in the default and the batch-invariant
  mode;
- the launches (float32; bfloat16 with one expert taking every token): every tile height
  (16 / 32 / 64 rows), top-1, a single expert, widths that are not powers of two, scale groups
  of 16 and 64, more experts than (token, slot) pairs;
- the sorted layout the first launch builds (every pair once, tiles of one expert each);
- the kernels' e2m1 decoding of every byte against ``unpack_fp4``;
- batch invariance (bitwise, batch-invariant mode): a token's row computed with the whole
  batch or with a slice of it.

**Compile** (no GPU needed): the kernels compile for sm_90 and sm_100 through Triton's NVIDIA
backend (catches what the interpreter lets through: type changes across branches, bad layouts),
FP4 ones with the inline-PTX e2m1 decoding, which ptxas assembles there (the interpreter cannot
run it; ``test_moe_e2m1_ptx.py`` emulates its instructions).

**GPU** (skipped without CUDA): conformance at the plugin's GPU cases, the full V4-Flash widths
(D=4096, I=2048, E=64..256, top-6, T in 1, 16, 64, 256) against the reference, batch invariance
and the replay of a captured CUDA graph.
"""

from __future__ import annotations

import json
import os
import sys

import cuda_sm100_checks as checks
import pytest
import torch
from cuda_sm100_checks import compile_problem, compile_typed, failed_rows

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

import triton  # noqa: E402  (after the skip: the kernels need it)
import triton.language as tl  # noqa: E402
from deepinfer_cuda_sm100.kernels.moe import _e2m1  # noqa: E402

OP = "moe_experts"


@triton.jit
def _decode_bytes(b_ptr, out_ptr):
    """Both nibbles of 256 bytes through the kernels' e2m1 decoding (even, then odd input)."""
    i = tl.arange(0, 256)
    b = tl.load(b_ptr + i)
    tl.store(out_ptr + 2 * i, _e2m1(b & 15))
    tl.store(out_ptr + 2 * i + 1, _e2m1(b >> 4))


# ---------------------------------------------------------------------------------------------
# checks shared by the interpreter child and the GPU tests


def _impl():
    from deepinfer_cuda_sm100.moe_ops import moe_ops

    return moe_ops()[OP]


def _conformance(device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    """The conformance suite on the op alone, in the default and the batch-invariant mode."""
    from cuda_sm100_checks import op_conformance_rows

    return op_conformance_rows("cuda_sm100_moe", OP, _impl, device, dtypes)


def _experts(g, e: int, out: int, inp: int, scale: float, kind: str, dtype: torch.dtype, group: int = 32):
    """An expert stack: ``kind`` ``fp32`` / ``ue8m0`` (FP4 scales) or ``plain`` (``dtype``)."""
    from deepinfer_core.ops._cases import randn_fp4

    if kind == "plain":
        return (torch.randn(e, out, inp, generator=g) * scale).to(dtype)
    return randn_fp4(g, e, out, inp, scale=scale, group=group, scale_dtype=kind)


def _to(w, device: str):
    return w.to(device)


def _routing(g, t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, weights)`` of ``t`` tokens: distinct experts (repeats only where ``k > e``)."""
    if k > e:
        ids = torch.randint(0, e, (t, k), generator=g)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.1
    return ids, 1.5 * w / w.sum(-1, keepdim=True)


LAUNCHES = (
    # (label, T, D, I, E, k, gate_up kind, down kind, group)
    ("decode T=1", 1, 64, 32, 8, 3, "fp32", "ue8m0", 32),
    ("tiles of 32 rows", 200, 64, 32, 8, 3, "ue8m0", "fp32", 32),
    ("tiles of 64 rows", 400, 64, 32, 8, 3, "fp32", "plain", 32),
    ("top-1", 9, 64, 32, 4, 1, "fp32", "fp32", 32),
    ("one expert", 7, 64, 32, 1, 2, "ue8m0", "ue8m0", 32),
    ("widths not powers of two", 6, 96, 64, 5, 2, "fp32", "fp32", 32),
    ("plain, widths not powers of two", 6, 80, 40, 5, 2, "plain", "plain", 32),
    ("scale groups of 16", 5, 64, 32, 4, 2, "fp32", "ue8m0", 16),
    ("scale groups of 64", 5, 128, 64, 4, 2, "ue8m0", "fp32", 64),
    ("more experts than pairs", 4, 64, 32, 64, 6, "ue8m0", "ue8m0", 32),
)


SHARED_OUTPUT_LAUNCHES = ("decode T=1", "widths not powers of two")
"""Launches also run with the shared expert's output, checked against the contract's
``routed + shared`` bit for bit."""


def launch_problems(dtype: torch.dtype, device: str, shared: bool = False) -> list[str]:
    """Each launch of :data:`LAUNCHES` against the reference, within the op's tolerances
    relative to the largest output (the reference's own paths differ by an ulp of it: which
    of them runs depends on the shapes, and some round the running sum after every pair).

    ``shared``: every token also routes to expert 0 (one expert takes every token).
    """
    from deepinfer_core.ops.moe import moe_experts as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    atol, rtol = DEFAULT_TOLERANCES[dtype]
    impl = _impl()
    g = torch.Generator().manual_seed(7)
    problems = []
    for label, t, d, i, e, k, gu_kind, dn_kind, group in LAUNCHES:
        gate_up = _experts(g, e, 2 * i, d, 1.5 * d**-0.5, gu_kind, dtype, group)
        down = _experts(g, e, d, i, i**-0.5, dn_kind, dtype, group)
        ids, weights = _routing(g, t, e, k)
        if shared:
            ids[:, 0] = 0
        x = torch.randn(t, d, generator=g).to(dtype)
        args = [
            x.to(device),
            ids.to(device),
            weights.to(device),
            _to(gate_up, device),
            _to(down, device),
            10.0,
        ]
        verdict = impl.supports(*args)
        if verdict is not True:
            problems.append(f"{label}: refused: {verdict}")
            continue
        routed = impl.fn(*args)
        got, want = routed.float(), reference(*args).float()
        bound = atol * max(1.0, want.abs().max().item())
        if got.shape != want.shape or not torch.allclose(got, want, atol=bound, rtol=rtol):
            err = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
            problems.append(f"{label}{' (shared)' if shared else ''}: max abs err {err:.3g}")
        if label in SHARED_OUTPUT_LAUNCHES:  # the shared expert's output added in the combine
            extra = torch.randn(t, d, generator=g).to(dtype).to(device)
            if not torch.equal(impl.fn(*args, shared=extra), routed + extra):
                problems.append(f"{label}: moe_experts(shared=s) is not moe_experts() + s bit for bit")
    return problems


def layout_problems(device: str) -> list[str]:
    """The sorted layout: each pair in exactly one row, tiles of one expert in ascending
    expert order, pairs in pair order within an expert, ``-1`` padding, unused tiles ``E``."""
    from deepinfer_cuda_sm100.kernels.moe import sorted_layout, tile_count

    g = torch.Generator().manual_seed(3)
    problems = []
    cases = (
        (1, 6, 256, 16),
        (5, 2, 4, 16),
        (40, 3, 8, 16),
        (300, 2, 5, 32),
        (70, 6, 3, 64),
        (300, 6, 5, 128),
    )
    for t, k, e, bm in cases:
        ids = torch.randint(0, e, (t, k), generator=g)
        ids[0, -1] = ids[0, 0]  # a duplicate
        tile_expert, slot_pair = (v.cpu() for v in sorted_layout(ids.to(device), e, bm))
        label = f"T={t} k={k} E={e} rows={bm}"
        if tile_expert.shape != (tile_count(t * k, e, bm),):
            problems.append(f"{label}: {tile_expert.shape[0]} tiles")
            continue
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=e)
        want_tiles = torch.repeat_interleave(torch.arange(e), (counts + bm - 1) // bm)
        used = want_tiles.shape[0]
        if not torch.equal(tile_expert[:used].long(), want_tiles) or bool((tile_expert[used:] != e).any()):
            problems.append(f"{label}: tile experts {tile_expert.tolist()}")
            continue
        rows = slot_pair[: used * bm].view(used, bm).long()
        for expert in range(e):
            mine = rows[want_tiles == expert].reshape(-1)
            want = (flat == expert).nonzero().reshape(-1)
            if not torch.equal(mine[: want.shape[0]], want) or bool((mine[want.shape[0] :] != -1).any()):
                problems.append(f"{label}: expert {expert} rows {mine.tolist()}, want {want.tolist()}")
    return problems


def e2m1_problems() -> list[str]:
    """The kernels' decoding of both nibbles of every byte against ``unpack_fp4`` (interpreter)."""
    from deepinfer_core.weights.quant import unpack_fp4

    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(512)
    _decode_bytes[(1,)](packed, out)
    want = unpack_fp4(packed)
    bad = (out != want).nonzero().reshape(-1).tolist()
    return [f"byte {i // 2} nibble {i % 2}: {out[i].item()} != {want[i].item()}" for i in bad]


def invariance_problems(dtype: torch.dtype, device: str) -> list[str]:
    """Batch-invariant mode: a token's row is bitwise the same computed alone and in batches of
    several sizes (its pairs sit at other rows of other tiles), with strided activations."""
    from deepinfer_cuda_sm100.moe_ops import SMALL, V4_FLASH_LIKE, moe_cases

    from deepinfer_core.ops.modes import batch_invariant_mode

    shapes = SMALL if device == "cpu" else V4_FLASH_LIKE
    fn = _impl().fn
    problems = []
    cases = moe_cases(shapes)(torch.Generator().manual_seed(0), dtype)
    with batch_invariant_mode():
        for c in (1, 3):  # duplicate ids, FP4 ue8m0; T > E * k, FP4 gate_up + plain down
            x, ids, w, gate_up, down, limit = (a.to(device) if hasattr(a, "to") else a for a in cases[c][0])
            t = x.shape[0]
            rows = sorted({0, 1, 2, t - 3, t - 2, t - 1} & set(range(t)))  # first and last rows of tiles
            alone = {i: fn(x[i : i + 1], ids[i : i + 1], w[i : i + 1], gate_up, down, limit) for i in rows}
            for b in sorted({2, 7, t} & set(range(1, t + 1))):
                wide = torch.cat([x[:b], x[:b]], dim=1)[:, : x.shape[1]]  # strided rows
                out = fn(wide, ids[:b], w[:b], gate_up, down, limit)
                for i in (i for i in rows if i < b):
                    if not torch.equal(out[i : i + 1], alone[i]):
                        err = (out[i] - alone[i][0]).abs().max().item()
                        problems.append(f"case {c}: row {i} of a batch of {b} differs alone (max {err:.3g})")
    return problems


# ---------------------------------------------------------------------------------------------
# the fp8 math (DEEPINFER_MOE_MATH=fp8) against an emulation of its quantisation


def using_moe_math(value: str):
    """The kernel module's ``using_moe_math`` (imported when called: the interpreter report
    must import the kernels only after ``TRITON_INTERPRET`` is set)."""
    from deepinfer_cuda_sm100.kernels.moe import using_moe_math as use

    return use(value)


def fp8_quantise(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation quantisation: ``a [R, K]`` (``K`` a multiple of 32) per row and
    per 32 inputs to e4m3 with the smallest power-of-two scale ``s`` that keeps ``amax / s <=
    448``: ``(values [R, K/32, 32] fp32 (e4m3 values), scales [R, K/32] fp32)``."""
    r, k = a.shape
    g = a.float().reshape(r, k // 32, 32)
    bits = g.abs().amax(-1).clamp(min=2.0**-100).view(torch.int32)
    e = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).int()  # the scale's biased exponent
    scale, inv = (e << 23).view(torch.float32), ((254 - e) << 23).view(torch.float32)
    return (g * inv[..., None]).to(torch.float8_e4m3fn).float(), scale


def _emulated_linear(a: torch.Tensor, w, dtype: torch.dtype) -> torch.Tensor:
    """``a [R, K] @ w.T`` in float64 as the kernels compute it: the fp8 math (activations
    quantised, exact e2m1 x e4m3 products, each group of 32 scaled by its activation and weight
    scales) for the stacks it takes, else the weights dequantised to ``dtype`` (exact products)."""
    from deepinfer_cuda_sm100.kernels.moe import fp8_math_applies

    from deepinfer_core.weights.quant import unpack_fp4

    if not fp8_math_applies(w):
        dense = w if isinstance(w, torch.Tensor) else w.dequantize(dtype)
        return a.double() @ dense.double().T
    q, sx = fp8_quantise(a)
    codes = unpack_fp4(w.data).double()  # [N, K]
    n, k = codes.shape
    sw = w.scale.float().double().repeat_interleave(w.block[1] // 32, dim=1)  # [N, K/32]
    part = torch.einsum("rgk,ngk->rng", q.double(), codes.view(n, k // 32, 32))
    return (part * sx.double()[:, None, :] * sw[None, :, :]).sum(-1)


def fp8_math_emulation(x, ids, weights, gate_up, down, limit: float) -> torch.Tensor:
    """``moe_experts`` as the kernels compute it in the ``fp8`` math (default mode): each pair's
    GEMMs by :func:`_emulated_linear` and the reference's rounding points (gate / up, ``silu``,
    ``h`` and the down output rounded to ``x``'s dtype, ``h`` then quantised, the routing weight
    rounded to it), a token's contributions summed in fp32 in ascending (expert, slot) order."""
    from deepinfer_core.weights.quant import QuantizedTensor

    def expert(w, e):
        return w[e] if isinstance(w, torch.Tensor) else QuantizedTensor(w.data[e], w.scale[e], w.fmt, w.block)

    def rnd(v):
        return v.to(x.dtype).float()

    t, d = x.shape
    out = torch.zeros(t, d, device=x.device)
    ids_cpu = ids.cpu()
    for tok in range(t):
        acc = torch.zeros(d, device=x.device)
        for j in sorted(range(ids.shape[1]), key=lambda j: (int(ids_cpu[tok, j]), j)):
            e = int(ids_cpu[tok, j])
            gu = _emulated_linear(x[tok : tok + 1].float(), expert(gate_up, e), x.dtype).float()[0]
            i = gu.shape[0] // 2
            g = torch.clamp(rnd(gu[:i]), max=limit)
            u = torch.clamp(rnd(gu[i:]), -limit, limit)
            h = rnd(rnd(g / (1 + torch.exp(-g))) * u)
            y = rnd(_emulated_linear(h[None], expert(down, e), x.dtype).float()[0])
            acc += rnd(y * rnd(weights[tok, j].float()))
        out[tok] = acc
    return out.to(x.dtype)


FP8_LAUNCHES = (
    # (label, T, D, I, E, k, gate_up kind, down kind, group)
    ("decode T=1, ue8m0", 1, 64, 32, 8, 3, "ue8m0", "ue8m0", 32),
    ("fp32 scales, groups of 64, K not a power of two", 6, 192, 192, 5, 2, "fp32", "fp32", 64),
    ("tiles of 32 rows", 200, 64, 32, 8, 3, "ue8m0", "fp32", 32),
    ("fp4 gate_up, plain down", 9, 64, 32, 4, 2, "ue8m0", "plain", 32),
    ("plain gate_up, fp4 down", 9, 64, 32, 4, 2, "plain", "ue8m0", 32),
    ("groups of 16: the bf16 math", 5, 64, 32, 4, 2, "ue8m0", "ue8m0", 16),
)


def fp8_math_problems(dtype: torch.dtype, device: str) -> tuple[list[str], list[dict]]:
    """``DEEPINFER_MOE_MATH=fp8``: each of :data:`FP8_LAUNCHES` against
    :func:`fp8_math_emulation` (the interpreter: the same quantisation and products, only fp32
    sums in another order; the GPU: also the e4m3 MMAs' accumulation), and the error of the fp8
    math against the reference, which must stay bounded (returned per case)."""
    from deepinfer_core.ops.moe import moe_experts as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    atol, rtol = DEFAULT_TOLERANCES[dtype]
    if dtype == torch.float32:
        atol, rtol = (1e-5, 1e-5) if device == "cpu" else (2e-3, 2e-3)
    impl = _impl()
    g = torch.Generator().manual_seed(9)
    problems, errors = [], []
    for label, t, d, i, e, k, gu_kind, dn_kind, group in FP8_LAUNCHES:
        gate_up = _experts(g, e, 2 * i, d, 1.5 * d**-0.5, gu_kind, dtype, group)
        down = _experts(g, e, d, i, i**-0.5, dn_kind, dtype, group)
        ids, weights = _routing(g, t, e, k)
        ids[:, 0] = 0  # expert 0 takes every token (several tiles of it past 16 tokens)
        x = torch.randn(t, d, generator=g).to(dtype)
        args = [x, ids, weights, gate_up, down, 10.0]
        args = [a.to(device) if hasattr(a, "to") else a for a in args]
        with using_moe_math("fp8"):
            got = impl.fn(*args).float()
        with using_moe_math("bf16"):
            bf16_math = impl.fn(*args).float()
        want = fp8_math_emulation(*args).float()
        exact = reference(*args).float()
        scale = max(1.0, exact.abs().max().item())
        if not torch.allclose(got, want, atol=atol * scale, rtol=rtol):
            problems.append(f"{label}: max abs err {(got - want).abs().max().item():.3g} from the emulation")
        err = (got - exact).abs().max().item() / scale
        rms = ((got - exact).norm() / exact.norm().clamp(min=1e-30)).item()
        errors.append({"case": label, "dtype": str(dtype), "max_err_vs_reference": err, "rel_rms": rms})
        if err > 0.15:
            problems.append(f"{label}: the fp8 math is {err:.3g} (of the largest output) off the reference")
        fp8_taken = any(kind != "plain" and group >= 32 for kind in (gu_kind, dn_kind))
        if fp8_taken and dtype == torch.float32 and torch.equal(got, bf16_math):
            problems.append(f"{label}: DEEPINFER_MOE_MATH=fp8 gave the bf16 math's result")
        if not fp8_taken and not torch.equal(got, bf16_math):
            problems.append(f"{label}: a stack the fp8 math does not take changed with it")
    return problems, errors


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    report: dict = {"interpreted": _common.INTERPRETED}
    report["conformance"] = _conformance("cpu", (torch.float32, torch.bfloat16, torch.float16))
    report["launches"] = launch_problems(torch.float32, "cpu") + launch_problems(torch.bfloat16, "cpu", True)
    report["layout"] = layout_problems("cpu")
    report["e2m1"] = e2m1_problems()
    report["invariance"] = invariance_problems(torch.float32, "cpu") + invariance_problems(
        torch.bfloat16, "cpu"
    )
    report["fp8_math"], report["fp8_math_errors"] = [], []
    for dtype in (torch.float32, torch.bfloat16):
        problems, errors = fp8_math_problems(dtype, "cpu")
        report["fp8_math"] += problems
        report["fp8_math_errors"] += errors
    with using_moe_math("fp8"):
        report["fp8_invariance"] = invariance_problems(torch.bfloat16, "cpu")
    return report


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernels
test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted  # the report's shared tests
test_interpreter_conformance = checks.test_interpreter_conformance


@slow
def test_interpreter_launches(report):
    assert not report["launches"], "\n".join(report["launches"])


@slow
def test_interpreter_sorted_layout(report):
    assert not report["layout"], "\n".join(report["layout"])


@slow
def test_interpreter_e2m1_decoding(report):
    assert not report["e2m1"], "\n".join(report["e2m1"])


@slow
def test_interpreter_batch_invariance(report):
    assert not report["invariance"], "\n".join(report["invariance"])


@slow
def test_interpreter_fp8_math_matches_its_emulation(report):
    """``DEEPINFER_MOE_MATH=fp8``: the kernels against a torch emulation of the same activation
    quantisation with exact products (tight), and within a bound of the reference."""
    assert len(report["fp8_math_errors"]) == 2 * len(FP8_LAUNCHES)
    assert not report["fp8_math"], "\n".join(report["fp8_math"])


@slow
def test_interpreter_fp8_math_is_batch_invariant(report):
    assert not report["fp8_invariance"], "\n".join(report["fp8_invariance"])


# ---------------------------------------------------------------------------------------------
# launch shapes and supports (no kernel runs)


def test_tile_rows_depend_on_shapes_only():
    from deepinfer_cuda_sm100.kernels.moe import DECODE_BLOCK_M, MAX_BLOCK_M, tile_count, tile_rows

    assert tile_rows(6, 256, False) == DECODE_BLOCK_M  # decode: one short tile per expert
    assert tile_rows(256 * 6, 256, False) == DECODE_BLOCK_M
    assert tile_rows(8192 * 6, 256, False) == MAX_BLOCK_M  # prefill: 192 pairs per expert
    assert tile_rows(8192 * 6, 256, True) == DECODE_BLOCK_M  # batch-invariant: fixed
    assert tile_count(6, 256, 16) == 6  # every pair on its own expert at worst
    assert tile_count(64 * 6, 256, 16) == (384 + 15 * 256) // 16
    assert tile_count(0, 8, 16) == 0


def test_e2m1_ptx_takes_tiles_of_whole_instances():
    """The PTX decoding (4 packed bytes an instance) only for tiles of >= 4 bytes per thread."""
    from deepinfer_cuda_sm100.kernels import moe

    assert moe.e2m1_ptx(64, 128, 4) is (not moe.INTERPRETED)  # decode tiles: 32 bytes a thread
    assert moe.e2m1_ptx(64, 128, 8) is (not moe.INTERPRETED)
    assert moe.e2m1_ptx(32, 32, 4) is (not moe.INTERPRETED)  # exactly 4
    assert moe.e2m1_ptx(16, 32, 4) is False  # 2 bytes a thread: the arithmetic decoding
    assert moe.e2m1_ptx(32, 32, 8) is False
    assert moe.fp8_e2m1_ptx(64, 4) is (not moe.INTERPRETED)  # fp8 math: 16 bytes a row, 2 an instance
    assert moe.fp8_e2m1_ptx(16, 4) is (not moe.INTERPRETED)
    assert moe.fp8_e2m1_ptx(16, 8) is False


def test_moe_math_switch(monkeypatch):
    """``DEEPINFER_MOE_MATH``: read at each call, ``bf16`` by default, anything else refused."""
    from deepinfer_cuda_sm100.kernels.moe import MOE_MATH_ENV, moe_math

    monkeypatch.delenv(MOE_MATH_ENV, raising=False)
    assert moe_math() == "bf16"
    monkeypatch.setenv(MOE_MATH_ENV, " FP8 ")
    assert moe_math() == "fp8"
    monkeypatch.setenv(MOE_MATH_ENV, "")
    assert moe_math() == "bf16"
    monkeypatch.setenv(MOE_MATH_ENV, "fp4")
    with pytest.raises(ValueError, match=MOE_MATH_ENV):
        moe_math()


def test_fp8_math_takes_fp4_stacks_in_groups_of_32():
    from deepinfer_cuda_sm100.kernels.moe import fp8_math_applies

    g = torch.Generator().manual_seed(2)
    assert fp8_math_applies(_experts(g, 2, 8, 64, 0.1, "ue8m0", torch.bfloat16, 32))
    assert fp8_math_applies(_experts(g, 2, 8, 128, 0.1, "fp32", torch.bfloat16, 64))
    assert not fp8_math_applies(_experts(g, 2, 8, 64, 0.1, "ue8m0", torch.bfloat16, 16))
    assert not fp8_math_applies(_experts(g, 2, 8, 64, 0.1, "plain", torch.bfloat16))


def test_fp8_quantise_emulation_bounds():
    """The emulated activation quantisation: power-of-two scales, ``|value / scale| <= 448``,
    relative error at most 2**-4 for normal e4m3 values."""
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)) * torch.logspace(-8, 8, 96)
    q, s = fp8_quantise(x)
    assert bool((torch.frexp(s).mantissa == 0.5).all())  # powers of two
    assert q.abs().amax().item() <= 448 and q.abs().amax(-1).min().item() >= 224  # (224, 448] rounded
    back = (q * s[..., None]).reshape(5, 96)
    normal = (x.abs().reshape(5, 3, 32) >= s[..., None] * 2.0**-6).reshape(5, 96)
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max().item() <= 2.0**-4


CPU = {"interpreted": True}


def _supports(interpreted: bool):
    from deepinfer_cuda_sm100.moe_ops import make_supports

    return make_supports(interpreted)


def _case(dtype=torch.bfloat16, kind="ue8m0", t=3, d=64, i=32, e=4, k=2):
    g = torch.Generator().manual_seed(0)
    ids, w = _routing(g, t, e, k)
    x = torch.randn(t, d, generator=g).to(dtype)
    return [
        x,
        ids,
        w,
        _experts(g, e, 2 * i, d, 0.1, kind, dtype),
        _experts(g, e, d, i, 0.1, kind, dtype),
        10.0,
    ]


def test_supports_takes_fp4_and_plain_experts():
    sup = _supports(True)
    for kind in ("fp32", "ue8m0", "plain"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert sup(*_case(dtype, kind)) is True, (kind, dtype)
    args = _case()
    args[3] = _case(kind="plain")[3]  # plain gate_up, FP4 down
    assert sup(*args) is True
    args = _case()
    args[0] = torch.randn(3, 72)[:, 4:68].to(torch.bfloat16)  # a strided x
    assert sup(*args) is True


def test_supports_refuses_with_reasons():
    from deepinfer_core.ops._cases import randn_fp8

    sup = _supports(True)
    g = torch.Generator().manual_seed(1)

    def with_(index, value):
        args = _case()
        args[index] = value
        return sup(*args)

    assert "fp8" in with_(3, randn_fp8(g, 64, 64))
    fp8_stack = _case()[3]
    fp8_stack.fmt = "fp8"  # a stack in another format (only the format is looked at)
    assert "FP4" in with_(3, fp8_stack)
    assert "tensor or QuantizedTensor" in with_(4, [1, 2])
    assert "dtype" in with_(3, _case(torch.float32, "plain")[3])  # plain stack, not x's dtype
    assert "shape" in with_(4, _case(d=32, i=32)[4])
    assert "x must be" in with_(0, torch.randn(3, 64, dtype=torch.float64))
    assert "ids" in with_(1, torch.zeros(3, 2))
    assert "weights" in with_(2, torch.zeros(3, 3))
    assert "top-k" in sup(*_case(k=17, e=20))
    assert "limit" in with_(5, float("nan"))
    assert "empty" in sup(*_case(d=0, kind="plain"))
    args = _case(d=96)
    args[3] = _experts(g, 4, 64, 96, 0.1, "fp32", torch.bfloat16, group=48)
    assert "groups" in sup(*args)
    assert "GPU" in _supports(False)(*_case())  # CPU tensors for the compiled kernels


def test_supports_takes_the_batch_invariant_mode():
    from deepinfer_core.ops.modes import batch_invariant_mode

    with batch_invariant_mode():
        assert _supports(True)(*_case()) is True


# ---------------------------------------------------------------------------------------------
# compile for the GPU (no GPU needed)


def _gemm_args(kind: str, dtype: str, first: str) -> dict[str, str]:
    w = "*u8" if kind != "plain" else f"*{dtype}"
    s = {"fp32": "*fp32", "ue8m0": "*u8", "plain": f"*{dtype}"}[kind]
    common = {"w_ptr": w, "stride_we": "i64", "stride_wn": "i32", "s_ptr": s, "stride_se": "i32"}
    common |= {
        "stride_sn": "i32",
        "tile_expert_ptr": "*i32",
        "slot_pair_ptr": "*i32",
        "E": "i32",
        "TOP_K": "i32",
    }
    if first == "gate_up":
        return common | {
            "x_ptr": f"*{dtype}",
            "stride_x": "i32",
            "h_ptr": f"*{dtype}",
            "xq_ptr": "*u8",
            "xs_ptr": "*fp32",
            "hs_ptr": "*fp32",
            "limit": "fp32",
        }
    return common | {
        "h_ptr": f"*{dtype}",
        "rw_ptr": "*fp32",
        "stride_rw": "i32",
        "y_ptr": f"*{dtype}",
        "hs_ptr": "*fp32",
    }


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_kernels_compile_for_the_gpu(arch):
    from deepinfer_cuda_sm100.kernels import moe

    compile_typed(
        moe._layout_kernel,
        {"ids_ptr": "*i64", "stride_ids": "i32", "tile_expert_ptr": "*i32", "slot_pair_ptr": "*i32"}
        | {"P": "i32", "TOP_K": "i32", "E": "i32", "n_tiles": "i32"},
        {"BLOCK_M": 16, "BINS": 512, "BLOCK_P": 1024},
        arch,
    )
    configs = (  # (scales, dtype, rows, warps, fp8 math, h quantised)
        ("ue8m0", "bf16", 16, 4, False, False),
        ("fp32", "fp32", 16, 4, False, False),
        ("plain", "bf16", 64, 8, False, True),  # plain gate_up storing h for an fp8-math down
        ("fp32", "fp16", 32, 4, False, False),
        ("ue8m0", "bf16", 16, 4, True, True),  # DEEPINFER_MOE_MATH=fp8 at decode
        ("fp32", "fp32", 64, 8, True, False),  # ... prefill tiles, fp32 scales, a plain down
    )
    for kind, dtype, bm, warps, fp8, h_fp8 in configs:
        consts = {"D": 4096, "I": 2048, "FP4": kind != "plain", "UE8M0": kind == "ue8m0", "HALF_GROUP": 16}
        consts |= {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 64 if kind == "plain" else 128, "FP32_DOT": False}
        consts |= {"E2M1_PTX": kind != "plain", "FP8_MATH": fp8}
        down_consts = consts | {"BI_ROUNDING": kind == "ue8m0", "FP8_MATH": fp8 and h_fp8}
        for name, kernel, cs in (
            ("gate_up", moe._gate_up_kernel, consts | {"H_FP8": h_fp8}),
            ("down", moe._down_kernel, down_consts),
        ):
            args = _gemm_args(kind, dtype, name)
            if name == "gate_up" and h_fp8 or name == "down" and cs["FP8_MATH"]:
                args["h_ptr"] = "*u8"  # h as e4m3 codes
            compiled = compile_typed(kernel, args, cs, arch, num_warps=warps, num_stages=3)
            ptx = compiled.asm["ptx"]
            label = f"{name} {kind} {dtype} fp8={cs['FP8_MATH']}"
            if cs["FP8_MATH"]:  # e4m3 MMAs (wgmma on sm_90, tcgen05 on sm_100), PTX e2m1 -> e4m3
                assert ".e4m3" in ptx or "kind::f8f6f4" in ptx, f"{label}: no e4m3 MMA"
                assert "prmt.b32 m, 0xBCB8B080" in ptx, f"{label}: no PTX e2m1 -> e4m3 decoding"
                continue
            if dtype != "fp32":  # fp32 runs IEEE products (FMA), bf16 / fp16 the tensor cores
                assert "mma" in ptx, f"{label}: no tensor-core MMA"
            if kind != "plain":  # the e2m1 decoding in PTX (and bf16 x ue8m0: bf16x2 products)
                assert "prmt.b32 h0, 0xBFBFBF80" in ptx, f"{label}: no PTX decoding"
                bf16_products = kind == "ue8m0" and dtype == "bf16"
                assert ("mul.rn.bf16x2" in ptx) == bf16_products, label
    compile_typed(
        moe._quantise_kernel,
        {"x_ptr": "*bf16", "stride_x": "i32", "q_ptr": "*u8", "qs_ptr": "*fp32"},
        {"D": 4096, "BLOCK_G": 32, "FP32_DOT": False},
        arch,
    )
    # the shared expert's output added in the combine; the grouped path's weighted rows
    for shared, weighted in ((False, False), (True, False), (True, True)):
        compile_typed(
            moe._combine_kernel,
            {
                "y_ptr": "*bf16",
                "ids_ptr": "*i64",
                "stride_ids": "i32",
                "out_ptr": "*bf16",
                "stride_out": "i32",
            }
            | {"sh_ptr": "*bf16", "stride_sh": "i32", "D": "i32", "E": "i32"}
            | {"rows_ptr": "*i32", "rw_ptr": "*fp32", "stride_rw": "i32"},
            {"TOP_K": 6, "K_PAD": 8, "BI_ROUNDING": not weighted, "SHARED": shared, "WEIGHTED": weighted}
            | {"BLOCK_D": 1024},
            arch,
        )


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)

V4_D, V4_I, V4_K = 4096, 2048, 6


def _random_fp4(e: int, out: int, inp: int, scale_dtype: str, device: str = "cuda"):
    """An FP4 stack of random codes, built on the device (quantising 256 experts of 4096 x 4096
    would need a lot of memory): scales ``2**-j`` near ``1 / (3 sqrt(inp))``."""
    from deepinfer_core.weights.quant import UE8M0_DTYPE, QuantizedTensor

    g = torch.Generator(device=device).manual_seed(e * 7 + out)
    data = torch.randint(0, 256, (e, out, inp // 2), dtype=torch.uint8, device=device, generator=g)
    base = round(torch.log2(torch.tensor(1.0 / (3 * inp**0.5))).item())
    jitter = torch.randint(-1, 2, (e, out, inp // 32), device=device, generator=g)
    scale = torch.exp2((base + jitter).float())
    if scale_dtype == "ue8m0":
        scale = scale.to(UE8M0_DTYPE)
    return QuantizedTensor(data, scale, "fp4", (1, 32))


@pytest.fixture(scope="module")
def v4_stacks():
    """V4-Flash-width FP4 expert stacks of 256 experts (the first ``E`` are used by a case)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _random_fp4(256, 2 * V4_I, V4_D, "ue8m0"), _random_fp4(256, V4_D, V4_I, "fp32")


def _expert_slice(w, start: int, stop: int):
    """Experts ``start .. stop - 1`` of a quantised stack (views)."""
    from deepinfer_core.weights.quant import QuantizedTensor

    return QuantizedTensor(w.data[start:stop], w.scale[start:stop], w.fmt, w.block)


def _reference_by_expert_groups(args: list, group: int = 64) -> torch.Tensor:
    """The reference op's routed sum (fp32) with the experts taken ``group`` at a time: each
    call is given only its group's experts and the picks of the others weighted 0, and the
    calls' results are summed (the routed sum is linear in the picks).  A call then dequantises
    at most a group's experts (all 256 V4-Flash-width experts take ~13 GB in bf16)."""
    from deepinfer_core.ops.moe import moe_experts as reference

    x, ids, weights, gate_up, down, limit = args
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for start in range(0, gate_up.shape[0], group):
        mine = (ids >= start) & (ids < start + group)
        stacks = [_expert_slice(w, start, start + group) for w in (gate_up, down)]
        picks = torch.where(mine, ids - start, 0), torch.where(mine, weights, 0.0)
        total += reference(x, *picks, *stacks, limit).float()
    return total


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_conformance(dtype):
    rows = [r for r in _conformance("cuda", (dtype,))]
    assert any(r["own"] and r["status"] == "passed" for r in rows)
    bad = failed_rows(rows)
    assert not bad, "\n".join(bad)


def test_the_reference_by_expert_groups_is_the_reference():
    """The V4-Flash-width test's oracle, checked on CPU at a small width: the reference taken
    two experts at a time (each group's picks, the others weighted 0) sums to the reference's
    routed sum, a duplicate pick included, within the bf16 rounding of each group's result."""
    from deepinfer_core.ops.moe import moe_experts as reference

    g = torch.Generator().manual_seed(5)
    stacks = _random_fp4(8, 2 * 64, 128, "ue8m0", "cpu"), _random_fp4(8, 128, 64, "fp32", "cpu")
    ids, weights = _routing(g, 6, 8, 3)
    ids[1, 1] = ids[1, 0]
    args = [torch.randn(6, 128, generator=g).to(torch.bfloat16), ids, weights, *stacks, 10.0]
    want = reference(*args).float()
    got = _reference_by_expert_groups(args, group=2)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("experts", [64, 256])
@pytest.mark.parametrize("tokens", [1, 16, 64, 256])
def test_gpu_v4_flash_widths(v4_stacks, experts, tokens):
    g = torch.Generator().manual_seed(tokens)
    gate_up, down = (_expert_slice(w, 0, experts) for w in v4_stacks)
    ids, weights = _routing(g, tokens, experts, V4_K)
    if tokens > 1:
        ids[1, 1] = ids[1, 0]  # a duplicate
    x = torch.randn(tokens, V4_D, generator=g).to(torch.bfloat16)
    args = [x.cuda(), ids.cuda(), weights.cuda(), gate_up, down, 10.0]
    assert _impl().supports(*args) is True
    got, want = _impl().fn(*args).float(), _reference_by_expert_groups(args)
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert scale > 0.1, "degenerate outputs"
    assert torch.allclose(got, want, atol=2e-2 * scale, rtol=2e-2), (
        f"max abs err {err:.3g} (outputs to {scale:.3g})"
    )


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_launches_and_layout(dtype):
    problems = launch_problems(dtype, "cuda") + launch_problems(dtype, "cuda", shared=True)
    problems += layout_problems("cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_batch_invariance():
    problems = invariance_problems(torch.bfloat16, "cuda") + invariance_problems(torch.float32, "cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_fp8_math_launches(dtype):
    problems, _ = fp8_math_problems(dtype, "cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_gpu_fp8_math_v4_flash_widths(v4_stacks, tokens):
    """``DEEPINFER_MOE_MATH=fp8`` at the full V4-Flash widths (64 experts): against the emulation
    of its quantisation (1% of the largest output: the MMAs' fp32 accumulation, and a bf16
    rounding of ``h`` it flips moving that value's e4m3 rounding) and the reference (10%)."""
    from deepinfer_core.ops.moe import moe_experts as reference

    g = torch.Generator().manual_seed(tokens)
    gate_up, down = (_expert_slice(w, 0, 64) for w in v4_stacks)
    ids, weights = _routing(g, tokens, 64, V4_K)
    x = torch.randn(tokens, V4_D, generator=g).to(torch.bfloat16)
    args = [x.cuda(), ids.cuda(), weights.cuda(), gate_up, down, 10.0]
    with using_moe_math("fp8"):
        got = _impl().fn(*args).float()
    want = fp8_math_emulation(*args).float()
    exact = reference(*args).float()
    scale = exact.abs().max().item()
    assert scale > 0.1, "degenerate outputs"
    err = (got - want).abs().max().item()
    assert err <= 1e-2 * scale, f"max abs err {err:.3g} from the emulation (outputs to {scale:.3g})"
    err = (got - exact).abs().max().item()
    assert err <= 0.1 * scale, f"max abs err {err:.3g} from the reference (outputs to {scale:.3g})"


@needs_cuda
def test_gpu_fp8_math_graph_capture(v4_stacks):
    fn = _impl().fn
    g = torch.Generator().manual_seed(12)
    gate_up, down = v4_stacks
    ids, weights = (v.cuda() for v in _routing(g, 16, 256, V4_K))
    x = torch.randn(16, V4_D, generator=g).to(torch.bfloat16).cuda()
    with using_moe_math("fp8"):
        fn(x, ids, weights, gate_up, down, 10.0)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fn(x, ids, weights, gate_up, down, 10.0)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(y, fn(x, ids, weights, gate_up, down, 10.0)), "replay differs from eager"


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_gpu_graph_capture(v4_stacks, tokens):
    fn = _impl().fn
    g = torch.Generator().manual_seed(11)
    gate_up, down = v4_stacks
    ids, weights = (v.cuda() for v in _routing(g, tokens, 256, V4_K))
    x = torch.randn(tokens, V4_D, generator=g).to(torch.bfloat16).cuda()
    fn(x, ids, weights, gate_up, down, 10.0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(x, ids, weights, gate_up, down, 10.0)
    for replay in range(2):  # new activations and new routing, in place
        x.copy_(torch.randn_like(x))
        new_ids, new_w = _routing(g, tokens, 256, V4_K)
        ids.copy_(new_ids)
        weights.copy_(new_w)
        graph.replay()
        assert torch.equal(y, fn(x, ids, weights, gate_up, down, 10.0)), (
            f"replay {replay}: differs from eager"
        )


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
