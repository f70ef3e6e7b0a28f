"""The hardware tier of the ascend950 attention ops: the same checks as the emulated tests, on
device ``npu`` with the REAL ``torch_npu`` operators.  Marked ``npu``: skipped with the probe's
reason where no Ascend NPU is usable; ``bash scripts/test_npu.sh`` runs them.  These tests have
never run (no NPU was available where they were written): they are correct by reading only.

- conformance: every attention op the backend implements against the reference, on ``npu``,
  in bfloat16 and float32 (the op's own cases and the backend's cases at the operators' shapes);
- greedy = reference: the operator-shaped tiny V4 and V4.1 models (as in
  ``test_emulated_engine.py``) served by the ``ascend950`` backend give the reference backend's
  (CPU) greedy token after each prompt's prefill;
- batch invariance where the operators' work is per element (``apply_rope``, ``hc_post``,
  ``cache_write``): a row's result alone equals its result in a batch, bit for bit, in
  batch-invariant mode.  The other ops refuse batch-invariant mode (no operator documents a
  fixed reduction order), so the reference takes those calls.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_ascend950 import attention_mhc, attention_rowwise, backend, ops_attention, plugin
from test_emulated_engine import PAGE_SIZE, PROMPTS, V4_SHAPED, V41_SHAPED, _greedy, _v41_config

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.models.deepseek_v4 import tiny as tiny_v4
from deepinfer_core.models.deepseek_v41 import tiny as tiny_v41
from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.testing import conformance_cases, manager_with_plugin

pytestmark = pytest.mark.npu

MANAGER = manager_with_plugin(plugin, "ascend950")
SPEC = MANAGER.get_backend("ascend950")
ATTENTION_OPS = tuple(ops_attention.OPS)


@pytest.mark.parametrize(
    "case",
    conformance_cases(SPEC, dtypes=(torch.bfloat16, torch.float32), device="npu", ops=ATTENTION_OPS),
    ids=str,
)
def test_conformance_on_the_npu(case):
    case.check()


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_operator_shaped_tiny_models_decode_the_reference_token(family, tmp_path):
    if family == "v4":
        model = tiny_v4.make_tiny(tmp_path / family, dtype=torch.bfloat16, config=V4_SHAPED)
    else:
        model = tiny_v41.make_tiny(tmp_path / family, dtype=torch.bfloat16, config=_v41_config(**V41_SHAPED))
    cfg = {"model": str(model), "max_num_seqs": 4, "dtype": "bfloat16", "page_size": PAGE_SIZE}
    npu = LLMEngine(EngineConfig(backend="ascend950", **cfg), plugins=MANAGER)
    reference = LLMEngine(EngineConfig(backend="reference", **cfg))
    assert _greedy(npu, PROMPTS, 1) == _greedy(reference, PROMPTS, 1)


def _rows_alone_equal_batch(fn, args: tuple, row_args: tuple[int, ...]) -> None:
    """``fn(*args)`` row by row equals ``fn`` on each row alone (the ``row_args`` sliced), bitwise."""
    with batch_invariant_mode():
        whole = fn(*args)
        for i in range(whole.shape[0]):
            alone = fn(*[a[i : i + 1] if k in row_args else a for k, a in enumerate(args)])
            assert torch.equal(alone[0], whole[i]), f"row {i} differs alone"


def test_per_element_ops_are_batch_invariant_on_the_npu():
    g = torch.Generator().manual_seed(0)
    dev, dt = "npu", torch.bfloat16
    x = torch.randn(7, 9, 512, generator=g).to(dev, dt)
    cos, sin = torch.randn(7, 32, generator=g).to(dev, dt), torch.randn(7, 32, generator=g).to(dev, dt)
    assert attention_rowwise.apply_rope_supports(x, cos, sin) is True
    _rows_alone_equal_batch(attention_rowwise.apply_rope, (x, cos, sin), (0, 1, 2))
    streams = torch.randn(7, 4, 64, generator=g).to(dev, dt)
    out = torch.randn(7, 64, generator=g).to(dev, dt)
    post = torch.rand(7, 4, generator=g).to(dev)
    comb = torch.rand(7, 4, 4, generator=g).softmax(-1).to(dev)
    assert attention_mhc.hc_post_supports(out, streams, post, comb) is True
    _rows_alone_equal_batch(attention_mhc.hc_post, (out, streams, post, comb), (0, 1, 2, 3))


def test_the_probe_finds_the_npu():
    assert backend.is_available() == (True, None)
