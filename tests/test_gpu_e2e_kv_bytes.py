"""The KV-cache bytes a decode step reads (``benchmarks/_gpu_model.kv_bytes``), against hand counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
gm = pytest.importorskip("_gpu_model")

from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402


def _cfg(smoke: bool) -> DeepseekV4Config:
    return DeepseekV4Config.from_dict(gm.flash_config(4, 8, smoke=smoke))  # [sliding, CSA, HCA, CSA]


def test_smoke_widths_by_hand() -> None:
    """Window 8, head_dim 32, CSA ratio 4 with top-4 and indexer keys of 16, HCA ratio 16; fp32."""
    cfg = _cfg(smoke=True)
    rows = gm.kv_row_bytes(cfg, "auto", 4)
    assert rows == {"window": 32 * 4, "ckv": 32 * 4, "ikv": 16 * 4}
    window = 8 * 128  # every layer's ring, full at 64 tokens
    csa = window + 4 * 128 + 16 * 64  # top-4 of the 64/4 = 16 entries, keys of all 16
    hca = window + 4 * 128  # all 64/16 = 4 entries
    assert gm.kv_bytes(cfg, 64, rows) == window + 2 * csa + hca == 7680
    # 5 tokens: 5 window rows, one CSA entry (below top-k), no HCA entry
    assert gm.kv_bytes(cfg, 5, rows) == 4 * 5 * 128 + 2 * (128 + 64)
    # stored at 64 tokens: whole rings and every CSA entry
    assert gm.kv_bytes(cfg, 64, rows, read=False) == 4 * window + 2 * (16 * 128 + 16 * 64) + 4 * 128


def test_flash_widths_at_128k_by_hand() -> None:
    """bf16 rows of 512 (1024 B), fp8 rows of 592 B; indexer keys 128 x bf16 in both."""
    cfg, ctx = _cfg(smoke=False), 131072
    for kv_dtype, row in (("auto", 1024), ("fp8", 592)):
        rows = gm.kv_row_bytes(cfg, kv_dtype, 2)
        assert rows == {"window": row, "ckv": row, "ikv": 256}
        csa = 128 * row + 512 * row + (ctx // 4) * 256
        hca = 128 * row + (ctx // 128) * row
        assert gm.kv_bytes(cfg, ctx, rows) == 128 * row + 2 * csa + hca
