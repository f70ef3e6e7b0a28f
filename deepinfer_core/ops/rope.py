"""Rotary position embedding (V4's partial, interleaved RoPE)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ._cases import randn
from .cast import cast
from .modes import row_padded
from .norm import rms_norm
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
    # the third: only rope channels, a strided view (the rope slice of wider rows)
    return [
        ((randn(g, 6, 3, 32, dtype=dtype), cos, sin), {}),
        ((randn(g, 6, 16, dtype=dtype), cos, sin), {}),
        ((randn(g, 6, 3, 24, dtype=dtype)[..., -8:], cos, sin), {}),
    ]


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


_REFERENCES = SimpleNamespace(rms_norm=rms_norm, apply_rope=apply_rope)


def _qk_norm_rope(
    ops: Any,
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_q: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm_rope`` as its sequence over ``ops`` (a resolved table, or the references)."""
    if norm_q:
        q = ops.rms_norm(q, None, eps)
    kv = ops.rms_norm(kv, kv_weight, eps)
    # the queries and the key rotated apart: no copy of the queries into one tensor
    return ops.apply_rope(q, cos, sin), ops.apply_rope(kv.unsqueeze(1), cos, sin)[:, 0]


def _qk_norm_rope_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    cos, sin = randn(g, 5, 4, dtype=dtype), randn(g, 5, 4, dtype=dtype)
    fused = randn(g, 5, 3 * 32, dtype=dtype)  # the key row as a strided view of a projection
    q, kv, w = randn(g, 5, 3, 32, dtype=dtype), fused[:, 32:64], 1 + randn(g, 32, scale=0.1)
    return [((q, kv, w, 1e-6, cos, sin), {}), ((q, kv, w, 1e-6, cos, sin), {"norm_q": False})]


@define_op(
    "qk_norm_rope",
    "rope",
    batch_invariant=True,
    sample_cases=_qk_norm_rope_cases,
    decomposition=_qk_norm_rope,
)
def qk_norm_rope(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_q: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention block's queries and shared key-value row, normed and rotated.

    Exactly ``rms_norm(q, None, eps)`` (per head, unweighted; skipped with ``norm_q=False``),
    ``rms_norm(kv, kv_weight, eps)``, then :func:`apply_rope` of each with ``cos`` / ``sin``;
    a backend may fuse the sequence (the op's decomposition runs it over a table's own ops where
    the backend does not).

    Args:
        q: ``[T, H, D]`` queries; kv: ``[T, D]`` the shared key-value rows (any row stride).
        kv_weight: ``[D]`` float32 weight of the row's norm, or ``None``; eps: both norms' eps.
        cos, sin: ``[T, R/2]`` from :func:`rope_cos_sin`.
        norm_q: whether the queries are normed (V4) or only rotated (V4.1).

    Returns:
        ``(q [T, H, D], kv [T, D])``, contiguous, in the inputs' dtype.
    """
    return _qk_norm_rope(_REFERENCES, q, kv, kv_weight, eps, cos, sin, norm_q)
