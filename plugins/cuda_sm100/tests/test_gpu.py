"""The compiled kernels on a GPU: the conformance suite with V4-Flash shapes, batch invariance
and CUDA-graph replay, and ``sparse_attention`` on packed FP8 KV pools (``kv_cache_dtype="fp8"``).
Skipped, with the reason, where the backend cannot run."""

from __future__ import annotations

import pytest
import torch
from cuda_sm100_checks import batch_invariance_problems, graph_replay_problems
from deepinfer_cuda_sm100.attention_ops import PACKED_KV_REFUSAL
from deepinfer_cuda_sm100.cache_ops import REFERENCE_POOL_REFUSAL
from deepinfer_cuda_sm100.cases import V4_FLASH
from deepinfer_cuda_sm100.ops import FUSED_OPS, PLAIN_WEIGHT_REFUSAL, PROVIDED_OPS
from deepinfer_cuda_sm100.tk_dispatch import OWN_LANGUAGE

from deepinfer_core.ops.registry import DEFAULT_TOLERANCES, get_op
from deepinfer_core.testing import check_backend
from deepinfer_core.testing.compare import compare

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def impls():
    from deepinfer_core.plugins import get_plugins

    return get_plugins().get_backend("cuda_sm100").load_ops()


CHECKED_OPS = tuple(dict.fromkeys(PROVIDED_OPS + tuple(OWN_LANGUAGE)))
"""The backend's own ops and those TileKernels may serve (where it is installed)."""


@pytest.mark.parametrize("op", CHECKED_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conformance_v4_flash_shapes(impls, dtype, op):
    """The conformance suite, one op a test (so that a parallel run spreads the compiles)."""
    if op not in impls:
        pytest.skip(f"{op}: the backend does not serve it here (TileKernels is not installed)")
    report = check_backend("cuda_sm100", dtypes=(dtype,), ops=(op,))
    assert report.passed, report.summary()
    skipped = [
        f"{r.op}[{r.label}]: {r.message}"
        for r in report.results
        if r.status == "skipped"
        and PLAIN_WEIGHT_REFUSAL not in r.message  # dense linear weights: cuBLAS via the reference
        and PACKED_KV_REFUSAL not in r.message  # V4.1's block-scaled KV pools: the reference
        and REFERENCE_POOL_REFUSAL not in r.message  # other backends' packed pools: the reference
    ]
    assert not skipped, "supports() rejected cases the kernels target: " + "; ".join(skipped)
    assert op in {r.op for r in report.results}


def test_every_loaded_op_is_in_the_conformance_list(impls):
    assert set(impls) <= set(CHECKED_OPS), sorted(set(impls) - set(CHECKED_OPS))


@pytest.mark.parametrize("op", FUSED_OPS)
def test_batch_invariance(impls, op):
    problems = [
        f"{dtype}: {p}"
        for dtype in (torch.bfloat16, torch.float32)
        for p in batch_invariance_problems(op, impls[op].fn, V4_FLASH, dtype, "cuda")
    ]
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("op", FUSED_OPS)
def test_cuda_graph_replay(impls, op):
    problems = graph_replay_problems(op, impls[op].fn, V4_FLASH, torch.bfloat16)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sparse_attention_reads_fp8_kv_pools(impls, dtype):
    """``kv_cache_dtype="fp8"`` at V4-Flash shapes (592-byte rows): every case with a packed pool
    (all packed as the model stores them, and plain/packed mixes; CSA, HCA, split-KV decode)
    runs the kernel -- ``supports`` takes it -- within the op's tolerance of the reference, and
    a key read alone comes back as exactly the reference's dequantised row."""
    from deepinfer_cuda_sm100.attention_ops import V4_FLASH as ATTN_SHAPES
    from deepinfer_cuda_sm100.attention_ops import attention_cases
    from test_attention_kernels import _packed, _to, fp8_dequant_problems

    impl, spec = impls["sparse_attention"], get_op("sparse_attention")
    atol, rtol = spec.tolerances.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    problems: list[str] = []
    cases = [
        c for c in attention_cases(ATTN_SHAPES)(torch.Generator().manual_seed(0), dtype) if _packed(c[0][1])
    ]
    assert len(cases) >= 8
    for i, (args, kwargs) in enumerate(cases):
        call = _to(args, "cuda")
        verdict = impl.supports(*call, **kwargs)
        if verdict is not True:
            problems.append(f"case {i}: supports() refuses it: {verdict}")
            continue
        compare(impl.fn(*call, **kwargs), spec.reference(*call, **kwargs), atol, rtol, f"case {i}", problems)
    problems += fp8_dequant_problems("cuda", (dtype,), layouts=((512, 64), (160, 16), (75, 8)))
    assert not problems, "; ".join(problems)
