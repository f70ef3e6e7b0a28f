"""Small helpers for building conformance sample cases (random inputs of given shapes)."""

from __future__ import annotations

import torch

from deepinfer_core.weights.quant import QuantizedTensor, quant_fp4, quant_fp8


def randn(
    g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> torch.Tensor:
    """Seeded normal tensor of ``shape`` (drawn in fp32, then cast)."""
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def randn_fp8(
    g: torch.Generator,
    rows: int,
    cols: int,
    *,
    scale: float = 1.0,
    block: tuple[int, int] = (128, 128),
    scale_dtype: str = "fp32",
) -> QuantizedTensor:
    """A seeded ``[rows, cols]`` weight quantised to FP8 e4m3 with ``block`` scales."""
    data, s = quant_fp8(randn(g, rows, cols, scale=scale), block, scale_dtype)
    return QuantizedTensor(data, s, "fp8", block)


def randn_fp4(
    g: torch.Generator, *shape: int, scale: float = 1.0, group: int = 32, scale_dtype: str = "fp32"
) -> QuantizedTensor:
    """A seeded ``[..., out, in]`` weight quantised to packed FP4 e2m1 with per-``group`` scales."""
    packed, s = quant_fp4(randn(g, *shape, scale=scale), group, scale_dtype)
    return QuantizedTensor(packed, s, "fp4", (1, group))
