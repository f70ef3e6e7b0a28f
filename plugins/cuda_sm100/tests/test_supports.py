"""The ``supports`` predicates: what the kernels refuse, and why (no Triton or GPU needed)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_cuda_sm100.cases import SMALL, own_cases
from deepinfer_cuda_sm100.ops import COMPRESSOR_OPS, FUSED_OPS, make_supports

CUDA_KERNELS = make_supports(interpreted=False)
CPU_KERNELS = make_supports(interpreted=True)


def _cases(op, dtype=torch.bfloat16):
    return own_cases(SMALL)[op](torch.Generator().manual_seed(0), dtype)


@pytest.mark.parametrize("op", FUSED_OPS)
def test_the_kernels_own_cases_are_supported(op):
    for args, kwargs in _cases(op):
        assert CPU_KERNELS[op](*args, **kwargs) is True


@pytest.mark.parametrize("op", FUSED_OPS)
def test_cpu_tensors_are_refused_by_the_compiled_kernels(op):
    args, kwargs = _cases(op)[0]
    verdict = CUDA_KERNELS[op](*args, **kwargs)
    assert isinstance(verdict, str) and "is on cpu" in verdict and "cuda" in verdict


def test_the_interpreter_refuses_other_devices():
    x = torch.empty(2, 8, device="meta")
    assert "is on meta" in CPU_KERNELS["rms_norm"](x, None, 1e-6)


@pytest.mark.parametrize(
    ("op", "args", "reason"),
    [
        ("rms_norm", (torch.ones(2, 8, dtype=torch.int32), None, 1e-6), "dtype torch.int32"),
        ("rms_norm", (torch.ones(2, 8, dtype=torch.float64), None, 1e-6), "dtype torch.float64"),
        ("rms_norm", (torch.ones(2, 8), torch.ones(4), 1e-6), "weight has shape (4,)"),
        ("apply_rope", (torch.ones(2, 8), torch.ones(2, 5), torch.ones(2, 5)), "exceeds"),
        ("apply_rope", (torch.ones(2, 8), torch.ones(3, 2), torch.ones(3, 2)), "cos has shape (3, 2)"),
        ("apply_rope", (torch.ones(2, 2, 2, 8), torch.ones(2, 2), torch.ones(2, 2)), "has 4 dims"),
        (
            "hc_post",
            (torch.ones(2, 8), torch.ones(2, 4, 8).bfloat16(), torch.ones(2, 4), torch.ones(2, 4, 4)),
            "differs",
        ),
        (
            "hc_head",
            (torch.ones(2, 16, 8), torch.ones(16, 128), torch.ones(16), torch.ones(1), 1e-6, 1e-6),
            "N must",
        ),
        (
            "hc_head",
            (torch.ones(2, 4, 8), torch.ones(4, 32), torch.ones(4), torch.ones(3), 1e-6, 1e-6),
            "scale",
        ),
        (
            "hc_pre",
            (torch.ones(2, 4, 8), torch.ones(24, 32), torch.ones(24), torch.ones(3), 1e-6, 1e-6, 2.0),
            "sinkhorn_iters",
        ),
    ],
)
def test_refusals_name_the_reason(op, args, reason):
    verdict = CPU_KERNELS[op](*args)
    assert isinstance(verdict, str) and reason in verdict, verdict


# compress_entries (COMPRESSOR_OPS): the kernel's own cases, and the refusals


class _PackedPool:
    """Stands for a packed cache format (an ``Fp8KVPool``): not a plain tensor."""


def _entries_call(**changes):
    m, length, d = 3, 8, 32
    call = {
        "kv": torch.zeros(m, length, d, dtype=torch.bfloat16),
        "gate": torch.zeros(m, length, d),
        "norm_weight": torch.ones(d),
        "eps": 1e-6,
        "positions": torch.zeros(m, dtype=torch.int64),
        "inv_freq": torch.ones(4),
        "rope_scale": 1.0,
        "pool": torch.zeros(10, d, dtype=torch.bfloat16),
        "dest": torch.arange(m),
    }
    return {**call, **changes}


@pytest.mark.parametrize("op", COMPRESSOR_OPS)
def test_compressor_kernel_takes_its_own_cases_and_refuses_cpu_when_compiled(op):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for args, kwargs in _cases(op, dtype):
            assert CPU_KERNELS[op](*args, **kwargs) is True
    verdict = CUDA_KERNELS[op](**_entries_call())
    assert isinstance(verdict, str) and "is on cpu" in verdict and "cuda" in verdict


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({}, None),
        ({"pool": _PackedPool()}, "_PackedPool"),
        ({"kv": torch.zeros(3, 8, 32)}, None),
        ({"kv": torch.zeros(3, 8, 32, dtype=torch.float64)}, "kv dtype torch.float64"),
        ({"kv": torch.zeros(3, 32, dtype=torch.bfloat16)}, "expected [M, L, D]"),
        ({"gate": torch.zeros(3, 8, 32, dtype=torch.bfloat16)}, "gate dtype"),
        ({"gate": torch.zeros(3, 4, 32)}, "gate has shape"),
        ({"kv": torch.zeros(3, 8, 31), "gate": torch.zeros(3, 8, 31)}, "not even"),
        ({"kv": torch.zeros(3, 8, 8192), "gate": torch.zeros(3, 8, 8192)}, "not even in [2, 4096]"),
        ({"norm_weight": torch.ones(16)}, "norm_weight has shape"),
        ({"inv_freq": torch.ones(17)}, "rope width 34"),
        ({"pool": torch.zeros(10, 16, dtype=torch.bfloat16)}, "pool rows have 16 channels"),
        ({"pool": torch.zeros(32, 10, dtype=torch.bfloat16).t()}, "channel stride"),
        ({"pool": torch.zeros(10, 32, dtype=torch.float8_e4m3fn)}, "pool dtype"),
        ({"positions": torch.zeros(3)}, "positions dtype"),
        ({"dest": torch.arange(4)}, "dest has shape (4,)"),
    ],
)
def test_compressor_refusals_name_the_reason(changes, reason):
    verdict = CPU_KERNELS["compress_entries"](**_entries_call(**changes))
    if reason is None:
        assert verdict is True
    else:
        assert isinstance(verdict, str) and reason in verdict, verdict


# DeepSeek-V4.1's block-scaled KV pools (kv_cache_dtype="fp8"): no kernel reads them


def _block_scaled_calls():
    from deepinfer_core.ops.attention import PagedIndex
    from deepinfer_core.ops.kv_blockscaled import BlockScaledKVPool

    g = torch.Generator().manual_seed(0)
    t, h, d = 3, 4, 32
    q = torch.randn(t, h, d, generator=g)
    ring = BlockScaledKVPool.from_values(torch.randn(10, d, generator=g), "fp8_ue8m0")
    ckv = BlockScaledKVPool.from_values(torch.randn(8, d, generator=g), "fp4_e4m3")
    keys = BlockScaledKVPool.from_values(torch.randn(8, d, generator=g), "fp4_ue8m0")
    rows = torch.randint(0, 10, (t, 4), generator=g)
    paged = PagedIndex(
        torch.arange(2).view(1, 2), torch.zeros(t, dtype=torch.int64), torch.full((t,), 8), 4, 8
    )
    attention = (
        q,
        [ring, torch.randn(t, d, generator=g), ckv],
        [rows, rows[:, :2] % t, paged],
        torch.randn(h),
        0.2,
    )
    indexer = (q, torch.randn(t, h, generator=g), keys, paged, 3, 0.2)
    return {"sparse_attention": attention, "indexer_topk": indexer}


@pytest.mark.parametrize("op", ["sparse_attention", "indexer_topk"])
def test_block_scaled_pools_are_refused_and_the_reference_takes_the_call(op, caplog):
    """Interpreted and compiled kernels refuse them by name (before any device check), and an op table runs
    the reference for the call, logging the rejection once; nothing reaches the kernel."""
    from deepinfer_cuda_sm100.attention_ops import PACKED_KV_REFUSAL
    from deepinfer_cuda_sm100.attention_ops import make_supports as attention_supports

    from deepinfer_core.ops import OpImpl, OpTable, get_op

    call = _block_scaled_calls()[op]
    for interpreted in (True, False):
        verdict = attention_supports(interpreted)[op](*call)
        assert isinstance(verdict, str) and PACKED_KV_REFUSAL in verdict and "BlockScaledKVPool" in verdict

    def kernel(*args):
        raise AssertionError("the kernel was handed a block-scaled pool")

    table = OpTable({op: OpImpl(fn=kernel, supports=attention_supports(True)[op])}, backend="cuda_sm100")
    with caplog.at_level("WARNING", logger="deepinfer.ops"):
        got = table[op](*call)
    assert torch.equal(got, get_op(op).reference(*call))
    assert (
        f"op '{op}': backend 'cuda_sm100' rejects a case" in caplog.text and PACKED_KV_REFUSAL in caplog.text
    )


def test_the_compressor_kernel_refuses_a_block_scaled_entry_pool():
    from deepinfer_core.ops.kv_blockscaled import BlockScaledKVPool

    pool = BlockScaledKVPool.zeros(10, 32, "fp4_e4m3")
    verdict = CPU_KERNELS["compress_entries"](**_entries_call(pool=pool))
    assert isinstance(verdict, str) and "BlockScaledKVPool" in verdict and "reference" in verdict
