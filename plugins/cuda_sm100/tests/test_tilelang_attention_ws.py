"""The warp-specialised ("seesaw") TileLang attention kernel (``tl/sparse_attention_ws.py``):
what it takes, that precompile and the dispatcher know it, its lowering (where TileLang
imports), and on a GPU its result against the reference op and under CUDA-graph replay."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from cuda_sm100_checks import loops_containing, lowered_sm90, replayed
from deepinfer_cuda_sm100.attention_dispatch import available_languages
from deepinfer_cuda_sm100.tl import sparse_attention as tla
from deepinfer_cuda_sm100.tl import sparse_attention_ws as tlw
from deepinfer_cuda_sm100.tl import tilelang_problem

from deepinfer_core.ops.kv_format import Fp8KVPool


def _pools(packed: bool):
    rows = [torch.randn(8, 512).to(torch.bfloat16) for _ in range(3)]
    return [Fp8KVPool.from_values(r, 64) for r in rows] if packed else rows


def test_it_takes_plain_pools_and_names_what_it_refuses():
    q = torch.randn(2, 64, 512).to(torch.bfloat16)
    assert tlw.supports(q, _pools(False)) is True
    reason = tlw.supports(q, _pools(True))
    assert isinstance(reason, str) and "packed" in reason


def test_the_dispatcher_offers_it_for_plain_pools_only():
    q = torch.randn(2, 64, 512).to(torch.bfloat16)
    assert available_languages(q, _pools(False)) == {"triton", "tilelang", "tilelang_ws"}
    assert available_languages(q, _pools(True)) == {"triton", "tilelang"}


def test_precompile_covers_every_configuration_a_call_makes():
    import argparse

    from deepinfer_cuda_sm100.tl import precompile

    a = argparse.Namespace(
        heads=64, dim=512, rope_dim=64, hidden=4096, inter=2048, index_heads=64, index_dim=128
    )
    a.gemm_shapes = "4096x1024"
    jobs = {c for module, c in precompile.jobs(a) if module == "sparse_attention_ws"}
    assert jobs == {(paged, split, 64, 512, "bfloat16") for paged in (False, True) for split in (False, True)}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_it_lowers_to_a_producer_and_two_independent_consumers(paged, split):
    """Lowered for sm_90: the producer drops to its register share and the consumers rise to
    theirs, each consumer runs its own ``64 x 32`` logits GEMM and ``64 x 256`` value GEMMs
    (no reduction across warpgroups), and no loop waits at a block barrier."""
    src = lowered_sm90(
        tlw.build_attention_ws(paged, split, 64, 512, "bfloat16"), {"tl.disable_safe_memory_legalize": True}
    )
    assert f"warpgroup_reg_dealloc<{tlw.PRODUCER_REGS}>" in src
    assert src.count(f"warpgroup_reg_alloc<{tlw.CONSUMER_REGS}>") == 2
    assert f"64, {tlw.BNW}, 16" in src and "64, 256, 16" in src
    assert "AllReduce<tl::MaxOp, 256" not in src and "AllReduce<tl::SumOp, 256" not in src
    assert all("__syncthreads" not in body for body in loops_containing(src, "wgmma_ss<"))
    assert all("__syncthreads" not in body for body in loops_containing(src, "cp_async_gs"))


def _cases():
    from test_tilelang_attention import _v4_cases

    return [args for args in _v4_cases() if tlw.supports(args[0], args[1]) is True]


@pytest.mark.gpu
def test_gpu_it_matches_the_reference_at_v4_flash_shapes():
    if not torch.cuda.is_available() or tilelang_problem() is not None:
        pytest.skip(f"needs a CUDA GPU and TileLang ({tilelang_problem()})")
    from deepinfer_core.ops.attention import sparse_attention as reference

    cases = _cases()
    assert len(cases) >= 6
    kinds = set()
    for args in cases:
        splits = tla.plan_splits(args[0].shape[0], 64, tla.max_keys(args[2]), tla.num_sms(args[0].device))
        kinds.add((tla.third_kind(args[2]), splits > 1))
        want = reference(*args).float()
        torch.testing.assert_close(tlw.sparse_attention(*args).float(), want, atol=2e-2, rtol=2e-2)
    assert kinds >= {(None, False), ("rows", True), ("rows", False), ("paged", True), ("paged", False)}


@pytest.mark.gpu
def test_gpu_it_replays_in_a_cuda_graph_bitwise():
    if not torch.cuda.is_available() or tilelang_problem() is not None:
        pytest.skip(f"needs a CUDA GPU and TileLang ({tilelang_problem()})")
    for args in _cases()[:4]:
        eager = tlw.sparse_attention(*args)
        assert torch.equal(replayed(lambda args=args: tlw.sparse_attention(*args)), eager)
