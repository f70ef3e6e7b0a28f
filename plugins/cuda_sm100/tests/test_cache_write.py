"""The ``cuda_sm100`` ``cache_write`` (one Triton launch into a packed FP8 pool or a block-scaled
one) against the reference's bytes.

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not
leak into this pytest process, so the interpreter checks run in a child: ``python
test_cache_write.py --interpreter-report`` prints a JSON report and each test below reads one
part of it.  It runs

- the conformance suite (``check_backend``) on a CPU ``BackendSpec`` holding the op: the core's
  cases and the op's own (:data:`deepinfer_cuda_sm100.cache_ops.SMALL_ROWS`) in float32,
  bfloat16 and float16, in the default and the batch-invariant mode (the core's cases into the
  other packed formats are refused, so the reference writes them);
- the edges (:func:`byte_problems`): every written row's bytes equal
  :func:`~deepinfer_core.ops.kv_format.quantize_fp8_rows`'s (V4's FP8 pools) or
  :func:`~deepinfer_core.ops.kv_blockscaled.quantize_block_rows`'s (V4.1's three block-scaled
  formats: every e2m1 rounding tie, blocks under each scale floor, zero, ``-0``, huge and tiny
  blocks, an e4m3-subnormal scale) and the other rows are untouched,
  for every e4m3 magnitude around each binade and its rounding ties, groups whose largest
  magnitude sits at each scale boundary (``448 * 2**e`` and one ulp above), all-zero and
  negative-zero groups, fp32 subnormal groups, the largest and smallest scales, groups holding
  ``±inf`` or NaN, fp32 values that round to bfloat16 ties in the rope part, the V4-Flash row
  (448 + 64) and odd / rope-less ones;
- batch invariance: a row's bytes written alone equal those written within a batch.

**Compile** (no GPU needed): both kernels (every block-scaled format) compile for sm_90 and
sm_100.

**GPU** (skipped without CUDA): conformance at :data:`~deepinfer_cuda_sm100.cache_ops.V4_FLASH_ROWS`,
the edges, and the replay of a captured CUDA graph on new values.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import cuda_sm100_checks as checks
import pytest
import torch
from cuda_sm100_checks import compile_problem

from deepinfer_core.ops.kv_format import Fp8KVPool, quantize_fp8_rows

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

OP = "cache_write"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# checks shared by the interpreter child and the GPU tests


def _impl():
    from deepinfer_cuda_sm100.cache_ops import cache_ops

    return cache_ops()[OP]


def _conformance(device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    from cuda_sm100_checks import op_conformance_rows

    return op_conformance_rows("cuda_sm100_cache_write", OP, _impl, device, dtypes)


def _e4m3_grid() -> torch.Tensor:
    """Every positive e4m3 value, the midpoints between neighbours (rounding ties) and one fp32
    ulp either side of each midpoint, signed both ways."""
    codes = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(0.0))
    pos = torch.cat([codes, mids, up, down, torch.tensor([0.0, 2.0**-10, 2.0**-11, 448.0])])
    return torch.cat([pos, -pos])


def edges() -> list[tuple[str, int, int, torch.Tensor]]:
    """``(label, dim, rope_dim, values [M, dim] fp32)`` (see the module docstring)."""
    g = torch.Generator().manual_seed(5)
    grid = _e4m3_grid()
    out = []
    n = grid.numel()
    rows = -(-n // 448)
    x = torch.zeros(rows * 448)
    x[:n] = grid
    # every group scaled so its largest magnitude is exactly 448: the grid's codes themselves
    v = torch.cat([x.view(rows, 448), torch.randn(rows, 64, generator=g)], dim=1)
    v[:, 0] = 448.0
    v[:, 64::64] = 448.0
    out.append(("the e4m3 grid at scale 1", 512, 64, v))
    out.append(("the grid scaled by 2**-20", 512, 64, v * 2.0**-20))
    out.append(("the grid scaled by 2**30", 512, 64, v * 2.0**30))
    bounds = []
    for e in (-126, -60, -9, -1, 0, 1, 7, 60, 110):
        top = 448.0 * 2.0**e
        above = torch.nextafter(torch.tensor(top), torch.tensor(float("inf")))
        row = torch.randn(512, generator=g) * top / 8
        row[0], row[64] = top, above
        row[128:192] = 0.0
        row[192:256] = -0.0
        row[256:320] = torch.randn(64, generator=g) * 1e-40  # fp32 subnormals
        row[320] = 3.0e38
        bounds.append(row)
    out.append(("scale boundaries, zero, -0, subnormal and huge groups", 512, 64, torch.stack(bounds)))
    ties = torch.randn(3, 512, generator=g)
    ties[:, 448:] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3.0 + 2.0**-7]).repeat(
        16
    )
    out.append(("bfloat16 ties in the rope part", 512, 64, ties))
    special = torch.randn(2, 512, generator=g)
    special[0, 70], special[0, 200], special[1, 5] = float("inf"), float("-inf"), float("nan")
    special[1, 400] = float("nan")  # (a NaN's bfloat16 bits differ between torch's CPU and CUDA casts)
    # a NaN value's e4m3 code is compared as NaN: its sign bit is the hardware's (x86 keeps the
    # operand's, a GPU's product gives the canonical positive NaN)
    out.append(("inf and NaN values", 512, 64, special))
    out.append(("an odd nope part", 75, 4, torch.randn(4, 75, generator=g) * 30))
    out.append(("no rope part", 130, 0, torch.randn(3, 130, generator=g)))
    out.append(("one value", 1, 0, torch.tensor([[0.3], [-5.0]])))
    out.append(("rope only", 8, 8, torch.randn(2, 8, generator=g)))
    return out


BLOCK_FORMATS = ("fp8_ue8m0", "fp4_e4m3", "fp4_ue8m0")


def block_edges() -> list[tuple[str, int, str, torch.Tensor]]:
    """``(label, dim, format, values [M, dim] fp32)`` for the block-scaled pools: blocks whose
    scaled values land on every e2m1 rounding tie (block maxima ``3 * 2**k`` and ``5.5 * 2**k``:
    power-of-two scales ``2**k``), blocks below each format's scale floor, zero and ``-0``
    blocks, huge and tiny magnitudes, random rows."""
    g = torch.Generator().manual_seed(9)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 0.5, 1.0, 3.0, -0.25, -1.25, -2.5, -0.75, 0.1, 2.9, -3.0, 0.0]
    more = [3.5, 5.0, 5.5, -3.5, -5.0, 4.5, 2.0, 0.25, 1.5, -5.5, 0.0, -0.0, 4.0, 5.5, 1.75, 2.75]
    block = torch.tensor(ties + ties + more + more)  # two 16-value blocks, then one of 32
    tie_rows = torch.stack([torch.cat([block] * 4) * 2.0**k for k in (-20, -3, 0, 7, 100)])
    special = torch.randn(3, 256, generator=g)
    special[0, :32] = 0.0
    special[0, 32:64] = -0.0
    special[1, :32] = torch.randn(32, generator=g) * 1e-7  # below fp8_ue8m0's floor (1e-4 / 448)
    special[1, 32:64] = torch.randn(32, generator=g) * 1e-38  # below the FP4 floors
    special[2, :32] = torch.randn(32, generator=g) * 1e30
    special[2, 64:96] = torch.randn(32, generator=g) * 2.0**-8  # fp4_e4m3: a subnormal e4m3 scale
    out = []
    for fmt in BLOCK_FORMATS:
        out.append((f"{fmt} ties", 256, fmt, tie_rows))
        out.append((f"{fmt} floors, zeros, extremes", 256, fmt, special))
        out.append((f"{fmt} random", 64, fmt, torch.randn(5, 64, generator=g) * 7))
    return out


def _write_problem(
    label: str, pool, values: torch.Tensor, want_rows: torch.Tensor, impl, device
) -> str | None:
    """Why writing ``values`` at random rows of ``pool`` (its copy on ``device``) does not leave
    the reference's bytes ``want_rows`` there and the old bytes elsewhere, or ``None``."""
    before = pool.data.clone()
    dest = torch.randperm(before.shape[0], generator=torch.Generator().manual_seed(2))[: values.shape[0]]
    pool = replace(pool, data=before.to(device))
    verdict = impl.supports(pool, dest.to(device), values.to(device))
    if verdict is not True:
        return f"{label}: refused: {verdict}"
    impl.fn(pool, dest.to(device), values.to(device))
    got, want = pool.data.cpu(), before.clone()
    want[dest] = want_rows
    differ = got != want
    if isinstance(pool, Fp8KVPool):  # a NaN's e4m3 code: its sign is the hardware's (0x7F / 0xFF)
        nan_codes = ((got & 0x7F) == 0x7F) & ((want & 0x7F) == 0x7F)
        differ[:, : pool.dim - pool.rope_dim] &= ~nan_codes[:, : pool.dim - pool.rope_dim]
    if differ.any():
        return f"{label}: bytes differ at (row, byte) {differ.nonzero()[:4].tolist()}"
    return None


def byte_problems(device: str, dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[str]:
    """Every edge whose written bytes differ from the reference's, or that touched another row,
    or that ``supports`` refused: V4's FP8 pools (:func:`edges`), V4.1's block-scaled ones
    (:func:`block_edges`)."""
    from deepinfer_core.ops.kv_blockscaled import BlockScaledKVPool, quantize_block_rows

    impl, g = _impl(), torch.Generator().manual_seed(1)
    problems = []
    for dtype in dtypes:
        for label, dim, rope_dim, x in edges():
            pool = Fp8KVPool.from_values(torch.randn(x.shape[0] + 3, dim, generator=g), rope_dim)
            values = x.to(dtype)
            want = quantize_fp8_rows(values, rope_dim)
            problems.append(_write_problem(f"{label} {dtype}", pool, values, want, impl, device))
        for label, dim, fmt, x in block_edges():
            pool = BlockScaledKVPool.from_values(torch.randn(x.shape[0] + 3, dim, generator=g), fmt)
            values = x.to(dtype)
            if not torch.isfinite(values).all():  # the formats take finite values only
                values = values.nan_to_num(posinf=0.0, neginf=0.0)
            want = quantize_block_rows(values, fmt)
            problems.append(_write_problem(f"{label} {dtype}", pool, values, want, impl, device))
    return [p for p in problems if p]


def invariance_problems(device: str) -> list[str]:
    """A row's bytes are the same written alone and within batches."""
    fn = _impl().fn
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 512, generator=g) * 10).to(torch.bfloat16).to(device)
    alone = Fp8KVPool.zeros(9, 512, 64, device)
    for i in range(9):
        fn(alone, torch.tensor([i], device=device), x[i : i + 1])
    problems = []
    for n in (2, 9):
        batch = Fp8KVPool.zeros(9, 512, 64, device)
        fn(batch, torch.arange(n, device=device), x[:n])
        problems += [
            f"row {i} differs in {n} rows" for i in range(n) if not torch.equal(batch.data[i], alone.data[i])
        ]
    return problems


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    report: dict = {"interpreted": _common.INTERPRETED}
    report["conformance"] = _conformance("cpu", DTYPES)
    report["bytes"] = byte_problems("cpu")
    report["invariance"] = invariance_problems("cpu")
    return report


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernel
test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted  # the report's shared test
REFUSED = "written by the reference"
"""The refusal of the core's cases into the other packed formats (served by the reference)."""


@slow
@pytest.mark.parametrize("mode", ["default", "bi"])
def test_interpreter_conformance(report, mode):
    rows = [r for r in report["conformance"] if r["mode"] == mode]
    bad = checks.conformance_problems(rows, REFUSED)
    assert not bad, "\n".join(bad)


@slow
def test_interpreter_bytes_are_the_references(report):
    assert not report["bytes"], "\n".join(report["bytes"])


@slow
def test_interpreter_batch_invariance(report):
    assert not report["invariance"], "\n".join(report["invariance"])


# ---------------------------------------------------------------------------------------------
# supports (no kernel runs)


def _supports(interpreted: bool):
    from deepinfer_cuda_sm100.cache_ops import make_supports

    return make_supports(interpreted)


def test_supports_takes_fp8_pools_and_plain_caches():
    sup = _supports(True)
    pool = Fp8KVPool.zeros(6, 512, 64)
    for dtype in DTYPES:
        assert sup(pool, torch.tensor([1, 2]), torch.zeros(2, 512, dtype=dtype)) is True
    assert sup(pool, torch.tensor([1], dtype=torch.int32), torch.zeros(1, 520)[:, 8:]) is True
    assert sup(torch.zeros(6, 4, 8), torch.tensor([0]), torch.zeros(1, 4, 8, dtype=torch.int64)) is True


def test_supports_refuses_with_the_reason():
    from deepinfer_core.ops.kv_blockscaled import BlockScaledKVPool
    from deepinfer_core.ops.kv_tile import TileFp8KVPool

    sup = _supports(True)
    pool = Fp8KVPool.zeros(6, 512, 64)
    rows = torch.tensor([1, 2])
    cases = [
        ((TileFp8KVPool.zeros(8, 64), rows, torch.zeros(2, 64)), "written by the reference"),
        ((BlockScaledKVPool.zeros(8, 64, "fp4_e4m3"), rows, torch.zeros(2, 32)), "expected [2, 64]"),
        ((pool, rows, torch.zeros(2, 500)), "expected [2, 512]"),
        ((pool, rows, torch.zeros(3, 512)), "expected [2, 512]"),
        ((pool, rows.float(), torch.zeros(2, 512)), "is not [M] int"),
        ((pool, rows, torch.zeros(2, 512, dtype=torch.float64)), "values dtype torch.float64"),
        ((pool, rows, [[0.0]]), "not a tensor"),
    ]
    for args, reason in cases:
        verdict = sup(*args)
        assert isinstance(verdict, str) and reason in verdict, (reason, verdict)


def test_compiled_supports_takes_cuda_tensors_only():
    verdict = _supports(False)(Fp8KVPool.zeros(2, 512, 64), torch.tensor([0]), torch.zeros(1, 512))
    assert isinstance(verdict, str) and "GPU" in verdict


def test_the_backend_provides_the_op():
    from deepinfer_cuda_sm100.ops import PROVIDED_OPS

    assert OP in PROVIDED_OPS


# ---------------------------------------------------------------------------------------------
# compile for the GPU (no GPU needed)


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_the_kernels_compile_for_the_gpu(arch, monkeypatch):
    from cuda_sm100_checks import compile_launch, record_launches
    from deepinfer_cuda_sm100.kernels import cache_write, cache_write_blocks

    from deepinfer_core.ops.kv_blockscaled import BlockScaledKVPool

    fp8 = record_launches(monkeypatch, cache_write, ("_fp8_rows_kernel",))
    blocks = record_launches(monkeypatch, cache_write_blocks, ("_block_rows_kernel",))
    bf16 = torch.zeros(4, 512, dtype=torch.bfloat16)
    cache_write.write_fp8_rows(Fp8KVPool.zeros(8, 512, 64), torch.arange(4), bf16)
    cache_write.write_fp8_rows(Fp8KVPool.zeros(8, 75, 4), torch.arange(2), torch.zeros(2, 75))
    for fmt in BLOCK_FORMATS:
        cache_write_blocks.write_block_rows(BlockScaledKVPool.zeros(8, 512, fmt), torch.arange(4), bf16)
    monkeypatch.undo()
    launches = fp8 + blocks
    assert len(fp8) == 2 and len(blocks) == len(BLOCK_FORMATS)
    for kernel, args, kwargs in launches:
        assert compile_launch(kernel, args, kwargs, arch).asm["ptx"]


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_conformance(dtype):
    bad = checks.conformance_problems(_conformance("cuda", (dtype,)), REFUSED)
    assert not bad, "\n".join(bad)


@needs_cuda
def test_gpu_bytes_and_invariance():
    problems = byte_problems("cuda") + invariance_problems("cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_graph_replay():
    """Captured in a CUDA graph, replayed on new values written in place: the pool holds the
    reference's bytes of the new values."""
    fn = _impl().fn
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = Fp8KVPool.zeros(300, 512, 64, "cuda")
    rows = torch.randperm(300, device="cuda", generator=g)[:64]
    x = torch.randn(64, 512, device="cuda", generator=g).to(torch.bfloat16)
    fn(pool, rows, x)  # warm: compiled outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fn(pool, rows, x)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn(64, 512, device="cuda", generator=g).to(torch.bfloat16) * 7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool.data[rows], quantize_fp8_rows(x, 64))


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
