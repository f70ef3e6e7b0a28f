"""``moe_experts`` makes no host sync on any of its paths (dense, grouped GEMM, the chunked dense
fallback, the batch-invariant tiles), with plain or quantised (FP4, ``keep_quantized``) experts,
and the sync-free batch-invariant path gives bitwise the results of the per-expert loop it
replaces.

On CPU the syncs are recorded as the ops that would make one on CUDA (``sync_check``); with a
CUDA device the same runs happen under ``torch.cuda.set_sync_debug_mode("error")`` and inside a
captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.ops import moe, moe_paths
from deepinfer_core.ops.modes import ROW_TILE, batch_invariant_mode, pad_rows, padded_len, tiled_linear
from deepinfer_core.weights.quant import QuantizedTensor, quant_fp4
from tests.ops.sync_check import record_host_syncs

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


def _case(t: int, e: int, k: int, d: int = 16, i: int = 8, dtype=torch.float32, dup: bool = False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    if dup:
        ids = torch.randint(0, e, (t, k), generator=g)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    gate_up = (torch.randn(e, 2 * i, d, generator=g) * 0.3).to(dtype)
    down = (torch.randn(e, d, i, generator=g) * 0.3).to(dtype)
    return x, ids, w, gate_up, down


def _oracle(x, ids, w, gate_up, down, limit):
    out = torch.zeros(x.shape, dtype=torch.float64)
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += float(w[t, j]) * (down[e] @ (F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)))
    return out


def _tiled_loop_reference(x, ids, weights, gate_up, down, limit):
    """The batch-invariant path as it was: a host loop over the experts present (it reads the
    per-expert counts with ``.tolist()``), one ``index_add_`` per expert."""
    out = torch.zeros_like(x)
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    flat_w = weights.reshape(-1)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start : start + c]
        start += c
        rows = padded_len(c)
        tok = sel // top_k
        h = tiled_linear(pad_rows(x.index_select(0, tok), rows), gate_up[e])
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
        h = tiled_linear(h, down[e]) * pad_rows(flat_w.index_select(0, sel), rows).unsqueeze(-1)
        out.index_add_(0, tok, h[:c].to(out.dtype))
    return out


PATHS = {
    "dense": dict(t=5, e=4, k=2),  # few experts: every expert on every token
    "grouped": dict(t=9, e=40, k=2),  # torch._grouped_mm with device offsets
    "grouped_dup": dict(t=9, e=40, k=3, dup=True),  # a token choosing an expert twice
    "fallback_f64": dict(t=9, e=40, k=2, dtype=torch.float64),  # _grouped_mm has no float64
}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_moe_experts_paths_make_no_host_sync(name):
    x, ids, w, gate_up, down = _case(**PATHS[name])
    with record_host_syncs() as syncs:
        got = moe.moe_experts(x, ids, w, gate_up, down, 3.0)
    assert syncs == []
    torch.testing.assert_close(got.double(), _oracle(x, ids, w, gate_up, down, 3.0), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dup", [False, True])
def test_batch_invariant_path_makes_no_host_sync(dup):
    x, ids, w, gate_up, down = _case(t=37, e=8, k=2, d=64, i=32, dup=dup)
    with batch_invariant_mode(), record_host_syncs() as syncs:
        got = moe.moe_experts(x, ids, w, gate_up, down, 10.0)
    assert syncs == []
    torch.testing.assert_close(got.double(), _oracle(x, ids, w, gate_up, down, 10.0), atol=1e-4, rtol=1e-4)


def _fp4(w: torch.Tensor, scale_dtype: str = "fp32") -> QuantizedTensor:
    """``w`` as packed FP4 experts with one scale per 8 inputs (the tests' widths are small)."""
    return QuantizedTensor(*quant_fp4(w, 8, scale_dtype), "fp4", (1, 8))


QUANTISED_PATHS = {
    **PATHS,
    "grouped_few_pairs": dict(t=3, e=40, k=2),  # 6 pairs < 40 experts: only the routed ones
    "grouped_many_pairs": dict(t=30, e=40, k=2),  # 60 pairs >= 40 experts: the whole stacks
}


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("name", sorted(QUANTISED_PATHS))
def test_quantised_experts_make_no_host_sync_and_equal_their_dequantised_values(name, invariant):
    x, ids, w, gate_up, down = _case(**QUANTISED_PATHS[name])
    q_gate_up, q_down = _fp4(gate_up), _fp4(down, "ue8m0")
    with batch_invariant_mode(invariant):
        with record_host_syncs() as syncs:
            got = moe.moe_experts(x, ids, w, q_gate_up, q_down, 3.0)
        want = moe.moe_experts(x, ids, w, q_gate_up.dequantize(x.dtype), q_down.dequantize(x.dtype), 3.0)
    assert syncs == []
    assert torch.equal(got, want)  # only the routed experts or all: the same per-expert GEMMs


def test_few_pairs_dequantise_only_the_routed_experts(monkeypatch):
    x, ids, w, gate_up, down = _case(t=2, e=40, k=2, dup=True)
    seen = []
    inner = QuantizedTensor.dequantize
    monkeypatch.setattr(
        QuantizedTensor, "dequantize", lambda self, dtype: seen.append(self.shape) or inner(self, dtype)
    )
    moe.moe_experts(x, ids, w, _fp4(gate_up), _fp4(down), 3.0)
    assert [s[0] for s in seen] == [4, 4]  # 4 pairs: 4 expert slots of 40, each stack


def test_chunked_dense_fallback_makes_no_host_sync(monkeypatch):
    monkeypatch.setattr(moe_paths, "HAS_GROUPED_MM", False)
    monkeypatch.setattr(moe_paths, "_FALLBACK_MAX_ROWS", 100)  # 40 experts: chunks of 2 tokens
    x, ids, w, gate_up, down = _case(t=9, e=40, k=2)
    with record_host_syncs() as syncs:
        got = moe.moe_experts(x, ids, w, gate_up, down, 3.0)
        quantised = moe.moe_experts(x, ids, w, _fp4(gate_up), _fp4(down), 3.0)
    assert syncs == []
    torch.testing.assert_close(got.double(), _oracle(x, ids, w, gate_up, down, 3.0), atol=1e-4, rtol=1e-4)
    plain = _fp4(gate_up).dequantize(), _fp4(down).dequantize()
    assert torch.equal(quantised, moe.moe_experts(x, ids, w, *plain, 3.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "t,e,k,dup", [(1, 8, 2, False), (5, 64, 6, True), (70, 8, 2, False), (130, 16, 6, True)]
)
def test_tiles_are_bitwise_the_per_expert_loop(dtype, t, e, k, dup):
    x, ids, w, gate_up, down = _case(t=t, e=e, k=k, d=32, i=16, dtype=dtype, dup=dup, seed=t + e)
    with batch_invariant_mode():
        rows = padded_len(t)  # what the op's row padding does
        padded = [pad_rows(a, rows) for a in (x, ids, w)]
        want = _tiled_loop_reference(*padded, gate_up, down, 3.0)[:t]
        got = moe.moe_experts(x, ids, w, gate_up, down, 3.0)
    assert torch.equal(got, want)


def test_tiles_in_weight_chunks_are_bitwise_one_batch(monkeypatch):
    x, ids, w, gate_up, down = _case(t=100, e=16, k=4, d=32, i=16, dup=True)
    with batch_invariant_mode():
        whole = moe.moe_experts(x, ids, w, gate_up, down, 3.0)
        monkeypatch.setattr(moe_paths, "_TILE_WEIGHT_BUDGET", 1)  # one tile's weights per bmm
        chunked = moe.moe_experts(x, ids, w, gate_up, down, 3.0)
    assert torch.equal(whole, chunked)


def test_tile_bound_covers_every_routing():
    """``n_tiles`` must hold every expert's padded rows: the worst case spreads the pairs over
    as many experts as possible, each with a partly filled last tile."""
    for p in (1, 2, 63, 64, 65, 200, 1000):
        for e in (1, 2, 8, 64, 300):
            bound = (p + (ROW_TILE - 1) * min(e, p)) // ROW_TILE
            counts = [p // min(e, p) + (j < p % min(e, p)) for j in range(min(e, p))]
            assert sum(-(-c // ROW_TILE) for c in counts) <= bound
            skewed = [p - min(e, p) + 1] + [1] * (min(e, p) - 1)
            assert sum(-(-c // ROW_TILE) for c in skewed) <= bound


def test_grouped_mm_is_used_only_where_it_takes_device_offsets():
    f32 = torch.zeros(2, 16)
    w32 = torch.zeros(4, 16, 16), torch.zeros(4, 16, 8)
    assert moe_paths._grouped_mm_supported(f32, *w32) is moe_paths.HAS_GROUPED_MM
    assert not moe_paths._grouped_mm_supported(f32.double(), *(a.double() for a in w32))
    assert not moe_paths._grouped_mm_supported(f32.bfloat16(), *w32)  # mixed dtypes


# ---- on a CUDA device --------------------------------------------------------------------------


def _cuda_cases():
    major = torch.cuda.get_device_capability()[0] if HAS_CUDA else 0
    cases = [("dense", dict(t=5, e=4, k=2)), ("fallback_f32", dict(t=9, e=40, k=2))]
    if major in (9, 10):
        cases.append(("grouped_bf16", dict(t=9, e=40, k=2, d=64, i=32, dtype=torch.bfloat16)))
    return cases


@needs_cuda
@pytest.mark.parametrize("quantised", [False, True])
@pytest.mark.parametrize("invariant", [False, True])
def test_moe_experts_on_cuda_makes_no_host_sync_and_replays_in_a_graph(invariant, quantised):
    for name, kw in _cuda_cases():
        args = [a.cuda() for a in _case(**kw)]
        if quantised:  # FP4 experts dequantised per call, inside the graph too
            args[3:] = [_fp4(a.float()).to("cuda") for a in args[3:]]
        with batch_invariant_mode(invariant):
            eager = moe.moe_experts(*args, 3.0)  # warm-up (lazy init may sync), outside the check
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                again = moe.moe_experts(*args, 3.0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                moe.moe_experts(*args, 3.0)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = moe.moe_experts(*args, 3.0)
            graph.replay()
        torch.cuda.synchronize()
        tol = 3e-2 if kw.get("dtype") == torch.bfloat16 else 1e-3
        cpu = [a.cpu() if isinstance(a, torch.Tensor) else a.to("cpu").dequantize() for a in args]
        want = _oracle(*cpu, 3.0)
        torch.testing.assert_close(eager.cpu().double(), want, atol=tol, rtol=tol, msg=name)
        assert torch.equal(again, eager), name
        assert torch.equal(captured, eager), name
