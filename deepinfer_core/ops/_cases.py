"""Small helpers for building conformance sample cases (random inputs of given shapes)."""

from __future__ import annotations

import torch


def randn(
    g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> torch.Tensor:
    """Seeded normal tensor of ``shape`` (drawn in fp32, then cast)."""
    return (torch.randn(*shape, generator=g) * scale).to(dtype)
