"""Rotary position embedding (V4's partial, interleaved RoPE)."""

from __future__ import annotations

import torch

from ._cases import randn
from .cast import cast
from .modes import row_padded
from .registry import define_op


def _cos_sin_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    return [((torch.arange(0, 40, 3), inv, 1.0, dtype), {})]


@define_op("rope_cos_sin", "rope", batch_invariant=True, sample_cases=_cos_sin_cases)
@row_padded({"positions": 0})
def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin tables for positions.

    Args:
        positions: ``[T]`` int64 absolute positions.
        inv_freq: ``[R/2]`` float32 inverse frequencies (one per rotated pair).
        scale: multiplier of cos and sin (YaRN attention factor; 1.0 for V4).
        dtype: dtype of the returned tables (the activation dtype).

    Returns:
        ``(cos, sin)``, each ``[T, R/2]`` in ``dtype``: ``cos(pos*inv_freq)*scale``.
    """
    freqs = positions.to(torch.float32).unsqueeze(1) * cast(inv_freq, torch.float32)
    return cast(freqs.cos() * scale, dtype), cast(freqs.sin() * scale, dtype)


def _rope_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    cos = randn(g, 6, 4, dtype=dtype)
    sin = randn(g, 6, 4, dtype=dtype)
    return [((randn(g, 6, 3, 32, dtype=dtype), cos, sin), {}), ((randn(g, 6, 16, dtype=dtype), cos, sin), {})]


@define_op("apply_rope", "rope", batch_invariant=True, sample_cases=_rope_cases)
@row_padded({"x": 0.0, "cos": 0.0, "sin": 0.0})
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``R = 2*cos.shape[-1]`` channels of each vector, pairs interleaved.

    Channel pairs ``(2i, 2i+1)`` of the rope slice rotate by angle ``i``; leading channels
    pass through.  Pass ``-sin`` to undo a rotation (V4's attention output).

    Args:
        x: ``[T, D]`` or ``[T, H, D]``.
        cos, sin: ``[T, R/2]`` from :func:`rope_cos_sin`.

    Returns:
        Same shape and dtype as ``x``; the rotation is computed in fp32.
    """
    half = cos.shape[-1]
    f32 = torch.float32
    cis = torch.complex(cast(cos, f32), cast(sin, f32))
    if x.dim() == 3:
        cis = cis[:, None]
    nope, rope = x[..., : -2 * half], x[..., -2 * half :]
    # pairs (2i, 2i+1) as complex numbers: (a+ib)(c+is) = (ac-bs) + i(as+bc)
    rotated = torch.view_as_real(torch.view_as_complex(cast(rope, f32).unflatten(-1, (half, 2))) * cis)
    return torch.cat([nope, cast(rotated.flatten(-2), x.dtype)], dim=-1)
