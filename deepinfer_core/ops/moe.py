"""Mixture-of-experts ops: routing and expert computation (SwiGLU with clamp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.weights.quant import QuantizedTensor

from ._cases import randn, randn_fp4
from .modes import row_padded
from .moe_paths import routed_experts
from .registry import define_op

_SCORE_FNS = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}


def _route_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    return [
        ((randn(g, 6, 8, dtype=dtype), randn(g, 8, scale=0.1), None, 2, "sqrtsoftplus", 1.5), {}),
        (
            (
                randn(g, 6, 8, dtype=dtype),
                None,
                torch.randint(0, 8, (6, 2), generator=g),
                2,
                "sqrtsoftplus",
                1.5,
            ),
            {},
        ),
    ]


@define_op("moe_route", "moe", batch_invariant=True, sample_cases=_route_cases)
@row_padded({"logits": 0.0, "fixed_ids": 0})
def moe_route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    fixed_ids: torch.Tensor | None,
    top_k: int,
    scoring: str,
    routed_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick experts and their weights (``noaux_tc`` top-k, or hash routing).

    Args:
        logits: ``[T, E]`` router logits.
        correction_bias: ``[E]`` float32 bias added to the scores for *selection only*
            (``noaux_tc``); ``None`` when ``fixed_ids`` is given.
        fixed_ids: ``[T, k]`` int64 expert ids from the hash table (``tid2eid[token]``), or
            ``None`` for learned top-k.
        top_k: experts per token; scoring: ``sqrtsoftplus`` | ``sigmoid`` | ``softmax``.
        routed_scale: multiplier of the renormalised weights.

    Returns:
        ``(weights [T, k] in the scores' dtype, ids [T, k] int64)``; weights are the
        uncorrected scores of the chosen experts, renormalised to sum 1, times
        ``routed_scale``.  Top-k ties resolve toward the lower expert id.
    """
    scores = _SCORE_FNS[scoring](logits)
    if fixed_ids is None:
        biased = scores + correction_bias if correction_bias is not None else scores
        ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    else:
        ids = fixed_ids.long()
    w = scores.gather(1, ids)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scale, ids


def _experts_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    e, d, i = 4, 16, 8
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(5)])

    def plain() -> tuple:
        return (
            randn(g, 5, d, dtype=dtype),
            ids,
            randn(g, 5, 2).abs(),
            randn(g, e, 2 * i, d, dtype=dtype, scale=0.3),
            randn(g, e, d, i, dtype=dtype, scale=0.3),
            10.0,
        )

    return [
        (plain(), {}),
        # the shared expert's output added (fused into the combine by kernels)
        (plain(), {"shared": randn(g, 5, d, dtype=dtype)}),
        # FP4 e2m1 experts, one scale per 32 inputs (keep_quantized): every path's dequantisation
        # (the dense one for few tokens x experts; grouped / per-expert tiles otherwise)
        (
            (
                randn(g, 5, 64, dtype=dtype),
                ids,
                randn(g, 5, 2).abs(),
                randn_fp4(g, e, 2 * 32, 64, scale=0.3),
                randn_fp4(g, e, 64, 32, scale=0.3),
                10.0,
            ),
            {},
        ),
        (
            (
                randn(g, 3, 64, dtype=dtype),
                torch.stack([torch.randperm(40, generator=g)[:2] for _ in range(3)]),
                randn(g, 3, 2).abs(),
                randn_fp4(g, 40, 2 * 32, 64, scale=0.3, scale_dtype="ue8m0"),
                randn_fp4(g, 40, 64, 32, scale=0.3, scale_dtype="ue8m0"),
                10.0,
            ),
            {},
        ),
        # ids outside [0, E) contribute nothing (an expert-parallel dispatch's padding rows: -1)
        (
            (
                randn(g, 6, d, dtype=dtype),
                torch.tensor([[2, -1], [-1, -1], [0, 3], [e, 1], [-1, 0], [3, -1]]),
                randn(g, 6, 2).abs(),
                randn(g, e, 2 * i, d, dtype=dtype, scale=0.3),
                randn(g, e, d, i, dtype=dtype, scale=0.3),
                10.0,
            ),
            {},
        ),
    ]


@define_op("moe_experts", "moe", batch_invariant=True, sample_cases=_experts_cases)
@row_padded({"x": 0.0, "ids": 0, "weights": 0.0, "shared": 0.0})
def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor | QuantizedTensor,
    down: torch.Tensor | QuantizedTensor,
    limit: float,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts: ``sum_j weights[t,j] * down_e(silu(min(g,L)) * clamp(u,-L,L))``.

    Args:
        x: ``[T, D]`` tokens; ids: ``[T, k]`` int64 expert ids (an id outside ``[0, E)``, e.g.
            the ``-1`` of an expert-parallel dispatch's padding rows, contributes nothing: a
            kernel skips its pair); weights: ``[T, k]``.
        gate_up: ``[E, 2I, D]`` (gate rows first, then up rows); down: ``[E, D, I]``.  With
            the engine option ``keep_quantized`` either may be a
            :class:`~deepinfer_core.weights.quant.QuantizedTensor` of that logical shape
            (``fmt="fp4"``: packed e2m1 bytes ``[E, out, in/2]``, one scale per 32 inputs).
        limit: SwiGLU clamp (gate clamped above, up clamped both sides).
        shared: optional ``[T, D]`` in x's dtype added to the result (the shared expert's
            output): ``routed + shared``, the routed sum rounded to x's dtype first, so a
            kernel fusing the add into its combine gives the reference's bits for it.

    Returns:
        ``[T, D]`` in x's dtype.  Quantised experts count as their dequantised values
        (``dequantize(x.dtype)``); the reference dequantises per call only the experts the
        call routes to when there are fewer (token, expert) pairs than experts, else all.

    Batch invariance: a token's result must not depend on which other tokens chose the same
    experts; its expert contributions are added in ascending expert order.

    No host sync on any path (capturable in a CUDA graph): the path is chosen from shapes,
    dtypes and the device, and the per-expert groups are found on the device.
    """
    routed = routed_experts(x, ids, weights, gate_up, down, limit)
    return routed if shared is None else routed + shared


def _swiglu_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    return [((randn(g, 5, 16, dtype=dtype, scale=6), randn(g, 5, 16, dtype=dtype, scale=6), 10.0), {})]


@define_op("swiglu", "moe", batch_invariant=True, sample_cases=_swiglu_cases)
@row_padded({"gate": 0.0, "up": 0.0})
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU activation: ``silu(min(gate, L)) * clamp(up, -L, L)``.

    Args:
        gate, up: ``[T, I]``; limit: the clamp ``L``.

    Returns:
        ``[T, I]`` in gate's dtype.
    """
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
