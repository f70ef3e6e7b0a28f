"""Ascend 950 ops of the MoE and linear side: routing (top-k and hash layers), dense FP8/MXFP8
linears, FP4/MXFP4 experts, MoE dispatch/combine over HCCL (``torch_npu`` fused operators)."""

from __future__ import annotations

OPS: dict = {}
