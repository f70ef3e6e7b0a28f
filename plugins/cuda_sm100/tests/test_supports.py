"""The ``supports`` predicates: what the kernels refuse, and why (no Triton or GPU needed)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_cuda_sm100.cases import SMALL, own_cases
from deepinfer_cuda_sm100.ops import FUSED_OPS, make_supports

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
