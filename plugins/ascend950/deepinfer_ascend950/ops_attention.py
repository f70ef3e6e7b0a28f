"""Ascend 950 ops of the attention side: sparse attention, indexer + top-k, compressor, cache
writes in the NPU's KV layout, mHC, RMSNorm, RoPE (``torch_npu`` fused operators and TileKernels)."""

from __future__ import annotations

OPS: dict = {}
