"""Normalisation ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._cases import randn
from .cast import cast
from .modes import row_padded
from .registry import define_op


def _rms_norm_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    return [
        ((randn(g, 5, 64, dtype=dtype), 1 + randn(g, 64, scale=0.1), 1e-6), {}),
        ((randn(g, 3, 4, 32, dtype=dtype), None, 1e-6), {}),
    ]


@define_op("rms_norm", "norm", batch_invariant=True, sample_cases=_rms_norm_cases)
@row_padded({"x": 0.0})
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dimension.

    Args:
        x: ``[..., D]`` activations, any float dtype.
        weight: ``[D]`` float32 scale, or ``None`` for the unweighted norm (V4's per-head
            query norm and the mHC input norm).
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x.dtype``.  Weighted: computed in fp32, scaled by the fp32
        weight, cast once.  Unweighted: ``x * rsqrt(mean(x²)+eps)`` with the factor cast
        to ``x.dtype`` first (transformers' ``DeepseekV4UnweightedRMSNorm``).
    """
    if weight is None:
        if x.dtype == torch.float32:  # same math, one fused op
            return F.rms_norm(x, (x.shape[-1],), None, eps)
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    f32 = torch.float32
    return cast(F.rms_norm(cast(x, f32), (x.shape[-1],), cast(weight, f32), eps), x.dtype)
