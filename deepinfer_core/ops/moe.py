"""Mixture-of-experts ops: routing and expert computation (SwiGLU with clamp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._cases import randn
from .modes import batch_invariant_enabled, pad_rows, padded_len, row_padded, tiled_linear
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
    return [
        (
            (
                randn(g, 5, d, dtype=dtype),
                ids,
                randn(g, 5, 2).abs(),
                randn(g, e, 2 * i, d, dtype=dtype, scale=0.3),
                randn(g, e, d, i, dtype=dtype, scale=0.3),
                10.0,
            ),
            {},
        )
    ]


@define_op("moe_experts", "moe", batch_invariant=True, sample_cases=_experts_cases)
@row_padded({"x": 0.0, "ids": 0, "weights": 0.0})
def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Routed experts: ``sum_j weights[t,j] * down_e(silu(min(g,L)) * clamp(u,-L,L))``.

    Args:
        x: ``[T, D]`` tokens; ids: ``[T, k]`` int64 expert ids; weights: ``[T, k]``.
        gate_up: ``[E, 2I, D]`` (gate rows first, then up rows); down: ``[E, D, I]``.
        limit: SwiGLU clamp (gate clamped above, up clamped both sides).

    Returns:
        ``[T, D]`` in x's dtype.

    Batch invariance: a token's result must not depend on which other tokens chose the same
    experts; its expert contributions are added in ascending expert order.
    """
    num_experts, top_k = gate_up.shape[0], ids.shape[1]
    if batch_invariant_enabled():
        return _experts_tiled(x, ids, weights, gate_up, down, limit)
    if num_experts <= _DENSE_WASTE * top_k and x.shape[0] * num_experts <= _DENSE_MAX_ROWS:
        return _experts_dense(x, ids, weights, gate_up, down, limit)
    if _HAS_GROUPED_MM and x.device.type == "cpu":
        return _experts_grouped(x, ids, weights, gate_up, down, limit)
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_of = order // top_k
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start : start + c]
        tok = token_of[start : start + c]
        start += c
        h = F.linear(x[tok], gate_up[e])
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
        h = F.linear(h, down[e]) * weights.reshape(-1)[sel, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


# With few experts (at most this many times top_k) and few tokens, running every expert on
# every token costs fewer, larger ops than the per-expert gather loop: the wasted FLOPs are
# cheaper than the per-op dispatch on small batches.  Unselected experts get weight exactly 0.
_DENSE_WASTE = 4
_DENSE_MAX_ROWS = 2048  # tokens x experts


def _experts_dense(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    t, e = x.shape[0], gate_up.shape[0]
    h = F.linear(x, gate_up.reshape(-1, x.shape[1])).view(t, e, -1)
    gate, up = h.chunk(2, dim=-1)
    h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)  # [T, E, I]
    y = torch.bmm(h.transpose(0, 1), down.transpose(1, 2))  # [E, T, D]
    dense_w = weights.new_zeros(t, e).scatter_add_(1, ids, weights)  # duplicate ids add up
    return (y * dense_w.t().unsqueeze(-1).to(y.dtype)).sum(dim=0).to(x.dtype)


_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _experts_grouped(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The per-expert computation as two grouped GEMMs over the (token, expert) pairs sorted
    by expert (``torch._grouped_mm``, exact per group): no wasted FLOPs and no per-expert
    dispatch.  Contributions reach each token in ascending expert order, as in the loop."""
    top_k, num_experts = ids.shape[1], gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    tok = order // top_k
    h = torch._grouped_mm(x.index_select(0, tok), gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    y = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1).index_select(0, order).unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))


def _experts_tiled(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The per-expert loop of the batch-invariant mode: each expert's rows, however many,
    are zero-padded to whole ``ROW_TILE`` tiles (fixed-shape GEMMs and no SIMD tails), and
    the contributions reach each token in ascending expert order (one ``index_add_`` per
    expert, single-threaded)."""
    out = torch.zeros_like(x)
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    flat_w = weights.reshape(-1)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start : start + c]
        start += c
        rows = padded_len(c)
        tok = sel // top_k
        h = tiled_linear(pad_rows(x.index_select(0, tok), rows), gate_up[e])
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
        h = tiled_linear(h, down[e]) * pad_rows(flat_w.index_select(0, sel), rows).unsqueeze(-1)
        out.index_add_(0, tok, h[:c].to(out.dtype))
    return out


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
