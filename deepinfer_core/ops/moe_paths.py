"""The reference's paths of ``moe_experts`` (:func:`deepinfer_core.ops.moe.moe_experts`): the
routed sum chosen from shapes, dtypes and the device (every expert on every token, grouped
GEMMs, a chunked fallback, the batch-invariant mode's fixed tiles), the dequantisation of only
the experts a call routes to, and the ascending-expert combine :func:`expert_order_sum`."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepinfer_core.weights.quant import QuantizedTensor

from .cast import cast
from .modes import ROW_TILE, batch_invariant_enabled, mode_matmul

Experts = torch.Tensor | QuantizedTensor


def routed_experts(
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


HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
"""Whether this torch has ``torch._grouped_mm``."""
GROUPED_MM_MAJORS = (9, 10)
"""The CUDA compute capabilities (majors) whose bf16 ``torch._grouped_mm`` reads the group offsets
on the device (elsewhere it copies them to the host: a sync, not capturable)."""


@functools.cache
def cuda_major(index: int | None) -> int:
    """The compute capability's major of CUDA device ``index`` (read once per device)."""
    return torch.cuda.get_device_capability(index)[0]


def _grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands exactly and without a host sync.

    On CPU it takes fp32 / bf16 / fp16 (not float64).  On CUDA only the bf16 kernels of sm90 /
    sm100 (with 16-byte aligned rows) take the group offsets on the device: every other case
    falls back to a per-group loop that copies the offsets to the host.
    """
    if not HAS_GROUPED_MM or not x.dtype == gate_up.dtype == down.dtype:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        aligned = x.shape[1] % 8 == 0 and down.shape[2] % 8 == 0
        return x.dtype == torch.bfloat16 and aligned and cuda_major(x.device.index) in GROUPED_MM_MAJORS
    return False


def expert_groups(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    _, order, ends = expert_groups(ids, num_experts)
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
    sorted_ids, order, ends = expert_groups(ids, E)
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
