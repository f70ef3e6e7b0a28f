"""Mixture-of-experts ops: routing and expert computation (SwiGLU with clamp)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepinfer_core.weights.quant import QuantizedTensor

from ._cases import randn, randn_fp4
from .cast import cast
from .modes import ROW_TILE, batch_invariant_enabled, mode_matmul, row_padded
from .registry import define_op

Experts = torch.Tensor | QuantizedTensor

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
    routed = _routed_experts(x, ids, weights, gate_up, down, limit)
    return routed if shared is None else routed + shared


def _routed_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: Experts, down: Experts, limit: float
) -> torch.Tensor:
    """The routed sum of :func:`moe_experts` (its path chosen from shapes, dtypes, device)."""
    num_experts, top_k = gate_up.shape[0], ids.shape[1]
    quantized = isinstance(gate_up, QuantizedTensor) or isinstance(down, QuantizedTensor)
    dense = num_experts <= _DENSE_WASTE * top_k and x.shape[0] * num_experts <= _DENSE_MAX_ROWS
    if dense and not batch_invariant_enabled():
        # runs every expert on every token: all of them are needed (ids outside [0, E) match
        # no expert in its dense weights, so they contribute nothing)
        gate_up, down = _dequantized(gate_up, x.dtype), _dequantized(down, x.dtype)
        return _experts_dense(x, ids, weights, gate_up, down, limit)
    valid = (ids >= 0) & (ids < num_experts)  # other ids contribute nothing (weight 0 on expert 0)
    ids, weights = torch.where(valid, ids, 0), torch.where(valid, weights, 0.0)
    if batch_invariant_enabled():
        if quantized:
            ids, gate_up, down = _used_experts(ids, gate_up, down, x.dtype)
        return _experts_tiled(x, ids, weights, gate_up, down, limit)
    if _grouped_mm_supported(x, _dequantized_meta(gate_up, x.dtype), _dequantized_meta(down, x.dtype)):
        if quantized:
            ids, gate_up, down = _used_experts(ids, gate_up, down, x.dtype)
        return _experts_grouped(x, ids, weights, gate_up, down, limit)
    gate_up, down = _dequantized(gate_up, x.dtype), _dequantized(down, x.dtype)
    return _experts_dense_chunked(x, ids, weights, gate_up, down, limit)


# ---- quantised experts (keep_quantized) ------------------------------------------------------
# Each path runs on the dequantised weights exactly as on plain ones, so a quantised stack gives
# bitwise the result of its dequantised copy.  The grouped and tiled paths compute each expert's
# rows on their own, so they can run on just the experts the call routes to (renumbered in
# ascending order, which keeps every group, tile and summation order); the dense paths run every
# expert on every token and take the whole stack.


def _dequantized(w: Experts, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, QuantizedTensor) else w


def _dequantized_meta(w: Experts, dtype: torch.dtype) -> torch.Tensor:
    """A stand-in with the shape, dtype and device the dequantised ``w`` will have (for path choices)."""
    if isinstance(w, QuantizedTensor):
        return torch.empty(w.shape, dtype=dtype, device="meta")
    return w


def _used_experts(
    ids: torch.Tensor, gate_up: Experts, down: Experts, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(local ids, gate_up, down)`` with the stacks dequantised: when the call has fewer
    (token, expert) pairs ``P`` than experts ``E``, only the ``P`` slots of the experts it routes
    to (ascending, the unused slots repeating expert 0 and routed to by no pair), else all.

    From shapes alone (no host sync): the distinct experts are ranked on the device.
    """
    num_experts, pairs = gate_up.shape[0], ids.numel()
    if pairs >= num_experts:
        return ids, _dequantized(gate_up, dtype), _dequantized(down, dtype)
    sorted_ids = torch.sort(ids.reshape(-1).long()).values
    new = torch.ones_like(sorted_ids)
    new[1:] = (sorted_ids[1:] != sorted_ids[:-1]).long()
    rank = torch.cumsum(new, 0) - 1  # the local id of each sorted pair's expert
    used = torch.zeros_like(sorted_ids).scatter_(0, rank, sorted_ids)  # equal values per rank
    local = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_(0, sorted_ids, rank)
    stacks = []
    for w in (gate_up, down):
        w = w.index_select(used) if isinstance(w, QuantizedTensor) else w.index_select(0, used)
        stacks.append(_dequantized(w, dtype))
    return local.index_select(0, ids.reshape(-1).long()).view(ids.shape), stacks[0], stacks[1]


# No path reads a tensor value on the host (no ``.tolist()`` / ``.item()``, no ``bincount``,
# which syncs on CUDA to size its output): the choice between them and every loop depend on
# shapes, dtypes and the device only, so a step that runs them can be captured in a CUDA graph.
# Per-expert groups are found on the device from the expert-sorted (token, expert) pairs:
# ``searchsorted(sorted_ids, e, right=True)`` is the number of pairs with an expert <= e.

# With few experts (at most this many times top_k) and few tokens, running every expert on
# every token costs fewer, larger ops than grouping the tokens by expert: the wasted FLOPs are
# cheaper than the per-op dispatch on small batches.  Unselected experts get weight exactly 0.
# Measured on CPU (one thread, the tiny model: 8 experts, top-2, D=64, I=32), dense wins up to
# ~32 tokens (30 vs 51 us at 1 token, 71 vs 74 us at 32) and loses beyond (112 vs 85 us at 64).
_DENSE_WASTE = 4
_DENSE_MAX_ROWS = 256  # tokens x experts
# The fallback where grouped GEMMs are not available runs every expert on chunks of at most
# this many tokens x experts rows (bounds the [tokens, experts, 2I] intermediate).
_FALLBACK_MAX_ROWS = 16384


def _experts_dense(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    t, e = x.shape[0], gate_up.shape[0]
    h = F.linear(x, gate_up.reshape(-1, x.shape[1])).view(t, e, gate_up.shape[1])
    gate, up = h.chunk(2, dim=-1)
    h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)  # [T, E, I]
    y = torch.bmm(h.transpose(0, 1), down.transpose(1, 2))  # [E, T, D]
    # [T, E] routing weights: duplicate ids add up (in slot order), ids outside [0, E) match
    # no expert
    match = ids.unsqueeze(-1) == _expert_range(e, ids.device)  # [T, k, E]
    dense_w = torch.where(match, weights.unsqueeze(-1), 0.0).sum(dim=1)
    return cast((y * cast(dense_w.t().unsqueeze(-1), y.dtype)).sum(dim=0), x.dtype)


_RANGES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _expert_range(num_experts: int, device: torch.device) -> torch.Tensor:
    """A cached ``arange(num_experts)`` (int64) on ``device``."""
    key = (num_experts, device)
    if key not in _RANGES:
        _RANGES[key] = torch.arange(num_experts, device=device)
    return _RANGES[key]


def _experts_dense_chunked(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """:func:`_experts_dense` over chunks of tokens: the sync-free fallback where
    ``torch._grouped_mm`` does not run without a host sync (CUDA other than bf16 on sm90 /
    sm100, float64, other devices)."""
    chunk = max(1, _FALLBACK_MAX_ROWS // gate_up.shape[0])
    if x.shape[0] <= chunk:
        return _experts_dense(x, ids, weights, gate_up, down, limit)
    parts = zip(x.split(chunk), ids.split(chunk), weights.split(chunk), strict=True)
    return torch.cat([_experts_dense(xc, ic, wc, gate_up, down, limit) for xc, ic, wc in parts])


_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


@functools.cache
def _cuda_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands exactly and without a host sync.

    On CPU it takes fp32 / bf16 / fp16 (not float64).  On CUDA only the bf16 kernels of sm90 /
    sm100 (with 16-byte aligned rows) take the group offsets on the device: every other case
    falls back to a per-group loop that copies the offsets to the host.
    """
    if not _HAS_GROUPED_MM or not x.dtype == gate_up.dtype == down.dtype:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        aligned = x.shape[1] % 8 == 0 and down.shape[2] % 8 == 0
        return x.dtype == torch.bfloat16 and aligned and _cuda_major(x.device.index) in (9, 10)
    return False


def _expert_groups(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs sorted by expert (stable: by token, then slot, within one):
    ``(sorted expert ids [P], pair order [P], group ends [E])``, where ``ends[e]`` counts the
    pairs with an expert <= e (``bincount(...).cumsum(0)`` without its host sync)."""
    sorted_ids, order = torch.sort(ids.reshape(-1).long(), stable=True)
    experts = torch.arange(num_experts, dtype=torch.int64, device=ids.device)
    return sorted_ids, order, torch.searchsorted(sorted_ids, experts, right=True)


def _experts_grouped(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The per-expert computation as two grouped GEMMs over the (token, expert) pairs sorted
    by expert (``torch._grouped_mm`` with the group offsets on the device, exact per group): no
    wasted FLOPs and no per-expert dispatch."""
    top_k, num_experts = ids.shape[1], gate_up.shape[0]
    _, order, ends = _expert_groups(ids, num_experts)
    offs = ends.to(torch.int32)
    tok = order // top_k
    h = torch._grouped_mm(x.index_select(0, tok), gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    y = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1).index_select(0, order).unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))


# Batch-invariant mode: weights of at most this many elements are gathered for one bmm.
_TILE_WEIGHT_BUDGET = 1 << 24


def _experts_tiled(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The experts of the batch-invariant mode: each expert's rows, however many, are
    zero-padded to whole ``ROW_TILE`` tiles, every tile is one item of a ``bmm`` against its
    expert's weights (fixed-shape GEMMs and no SIMD tails), and the contributions reach each
    token in ascending expert order (then slot order), added one at a time.

    Without a host sync: the pairs go to their slots in a buffer of ``n_tiles`` tiles, a bound
    on ``sum_e ceil(count_e / ROW_TILE)`` from the shapes alone (tiles past the used ones hold
    zeros and are never read back); which expert each tile belongs to is found on the device.
    """
    T, top_k = ids.shape
    E, D, I = gate_up.shape[0], x.shape[1], down.shape[2]
    P, R = T * top_k, ROW_TILE
    if P == 0:
        return torch.zeros_like(x)
    dev = x.device
    sorted_ids, order, ends = _expert_groups(ids, E)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + R - 1) // R
    tile_end = torch.cumsum(tiles, 0)
    # slot of the s-th sorted pair: its expert's first tile row + its rank among the expert's pairs
    rank = torch.arange(P, device=dev) - (ends - counts).index_select(0, sorted_ids)
    slot = (tile_end - tiles).index_select(0, sorted_ids) * R + rank
    n_tiles = (P + (R - 1) * min(E, P)) // R
    tile_expert = torch.searchsorted(tile_end, torch.arange(n_tiles, device=dev), right=True)
    tile_expert = tile_expert.clamp_(max=E - 1)  # tiles past the used ones: zeros, any expert
    xs = x.new_zeros(n_tiles * R, D).index_copy_(0, slot, x.index_select(0, order // top_k))
    flat_w = weights.reshape(-1)
    ws = flat_w.new_zeros(n_tiles * R).index_copy_(0, slot, flat_w.index_select(0, order))
    per_chunk = max(1, _TILE_WEIGHT_BUDGET // (gate_up[0].numel() + down[0].numel()))
    ys = []
    for start in range(0, n_tiles, per_chunk):
        n = min(per_chunk, n_tiles - start)
        experts = tile_expert[start : start + n]
        rows = slice(start * R, (start + n) * R)
        h = mode_matmul(xs[rows].view(n, R, D), gate_up.index_select(0, experts))
        gate, up = h.reshape(n * R, 2 * I).chunk(2, dim=-1)
        h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
        y = mode_matmul(h.view(n, R, I), down.index_select(0, experts)).reshape(n * R, D)
        ys.append(y * ws[rows].unsqueeze(-1))
    y = ys[0] if len(ys) == 1 else torch.cat(ys)
    pair_slot = torch.empty_like(slot).index_copy_(0, order, slot)
    return expert_order_sum(y.index_select(0, pair_slot).view(T, top_k, D).to(x.dtype), ids)


def expert_order_sum(contrib: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token's expert contributions ``contrib [T, k, D]`` (slot order, in the output
    dtype) added in ascending expert order of ``ids [T, k]`` (stable: duplicates in slot
    order): sequential adds from zero in fp32 / fp64; in lower precisions an fp32 sum rounded
    once per expert, a duplicated expert's contributions summed in fp32 first (what one
    ``index_add_`` per expert does).  The batch-invariant ``moe_experts`` and ``moe_combine``
    (expert parallelism) share it, so both give the same bits."""
    T, top_k, D = contrib.shape
    token_ids, by_expert = torch.sort(ids, dim=1, stable=True)
    contrib = contrib.gather(1, by_expert.unsqueeze(-1).expand(T, top_k, D))
    if contrib.dtype in (torch.float32, torch.float64):
        out = contrib.new_zeros(T, D)
        for j in range(top_k):
            out += contrib[:, j]
        return out
    acc = contrib.new_zeros(T, D, dtype=torch.float32)
    for j in range(top_k):
        if j:
            same = (token_ids[:, j] == token_ids[:, j - 1])[:, None]
            acc = torch.where(same, acc, acc.to(contrib.dtype).float())
        acc = acc + contrib[:, j].float()
    return acc.to(contrib.dtype)


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
