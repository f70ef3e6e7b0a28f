"""Expert-parallel ops: ``moe_dispatch`` sends each (token, expert) pair's row to the rank that
holds its physical expert slot, ``moe_combine`` brings the expert outputs back and adds them.

Layout (the one the MoE kernels compute on, tokens grouped by expert with their source):
the MoE block routes its ``T`` tokens to ``k`` logical experts each, maps them to physical slots
(:class:`~deepinfer_core.contract.placement.ExpertPlacement`; rank ``r`` holds slots
``[r * S, (r + 1) * S)``), and calls::

    recv_x, recv_ids, recv_w, handle = ops.moe_dispatch(x, slots, weights, S, group)
    y = ops.moe_experts(recv_x, recv_ids[:, None], recv_w[:, None], local_gate_up, local_down, L)
    out = ops.moe_combine(y, handle, ids)

``moe_experts`` with one expert per row returns each received pair's weighted contribution;
``moe_combine`` adds a token's ``k`` contributions in ascending logical expert order with the
arithmetic of the single-process ``moe_experts`` (see :func:`~deepinfer_core.ops.moe_paths.expert_order_sum`),
so that under ``batch_invariant=True`` a distributed run is bitwise a single process.

**Backends.** A DeepEP-style kernel replaces both ops together (``moe_combine`` only reads
handles of its own ``moe_dispatch``): the inputs, the outputs' shapes, dtypes and order (rows
grouped by ascending local expert; padding rows, if any, at the end with weight 0 and local id
``-1``, which ``moe_experts`` skips) and the summation order of the combine are the contract;
the handle is opaque (a :class:`DispatchHandle` or a subclass). ``capacity`` asks for the
fixed-shape exchange a CUDA graph can capture: every rank sends ``capacity`` rows to every rank
(real pairs first, then zero rows), the split sizes are static and nothing reads a device value
on the host; the caller chooses one ``capacity`` for every rank of the group, at least every
rank's ``T * k`` (e.g. ``max_num_batched_tokens * k``). The dynamic exchange (``capacity``
``None``) first exchanges the per-rank counts and reads them on the host (a sync).

**Fixed-shape steps.**  A model runner that replays a device graph of ``rows`` rows on every
rank of the group (a decode graph of one batch bucket) runs the forward inside
:func:`fixed_dispatch_rows` ``(rows)``; an MoE block reads :func:`dispatch_rows` and then asks
for ``capacity = rows * k`` (a rank sends at most ``T * k <= rows * k`` pairs to one rank).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.weights.quant import dequant_fp8, quant_fp8

from ._cases import randn
from .moe_paths import expert_order_sum
from .registry import define_op

FP8_DISPATCH_BLOCK = (1, 128)
"""FP8 dispatch quantisation: each row in groups of 128 channels, one fp32 scale a group."""

_FIXED_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("fixed_dispatch_rows", default=None)


@contextlib.contextmanager
def fixed_dispatch_rows(rows: int | None) -> Iterator[None]:
    """Within the block, expert-parallel MoE blocks use the fixed-shape (capturable) exchange
    sized for ``rows`` token rows a rank (``None``: the dynamic exchange).  Every rank of the
    group must run the same forward under the same ``rows``, at least its own row count."""
    token = _FIXED_ROWS.set(rows)
    try:
        yield
    finally:
        _FIXED_ROWS.reset(token)


def dispatch_rows() -> int | None:
    """The ``rows`` of the enclosing :func:`fixed_dispatch_rows`, or ``None`` (dynamic exchange)."""
    return _FIXED_ROWS.get()


class DispatchHandle:
    """What :func:`moe_combine` needs of its :func:`moe_dispatch` (opaque to the model).

    Two handles compare equal when they describe the same ``(num_tokens, top_k)`` routing, so
    the conformance suite can compare a backend's dispatch (whose handle may subclass this one)
    with the reference's.

    Attributes:
        num_tokens, top_k: the dispatching rank's routing shape.
        group: the process group (``None``: a single process).
        send_order: ``[T*k]`` pair indices in send order (by destination rank, then pair).
        pair_pos: ``[T*k]`` each pair's row in the send buffer.
        send_splits, recv_splits: rows to / from each rank (``None`` with a capacity).
        recv_order: ``[N]`` received row of each output row (grouped by local expert).
        capacity: rows per destination of the fixed-shape exchange, or ``None``.
    """

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DispatchHandle):
            return NotImplemented
        return (self.num_tokens, self.top_k) == (other.num_tokens, other.top_k)

    def __hash__(self) -> int:
        return hash((self.num_tokens, self.top_k))

    def __repr__(self) -> str:
        return f"DispatchHandle(num_tokens={self.num_tokens}, top_k={self.top_k}, capacity={self.capacity})"


def _world(group: Any) -> tuple[int, int]:
    """``(rank, size)`` in ``group``; ``(0, 1)`` without one."""
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _exchange(
    t: torch.Tensor, out_rows: int, out_splits: list[int] | None, in_splits: list[int] | None, group: Any
) -> torch.Tensor:
    """``all_to_all_single`` of ``t``'s rows (the counts, the packed dispatch rows of
    :func:`_exchange_packed`, the combine's outputs)."""
    if _world(group)[1] == 1:
        return t
    out = t.new_empty((out_rows, *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
    return out


def _exchange_packed(
    parts: list[torch.Tensor],
    out_rows: int,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    group: Any,
) -> list[torch.Tensor]:
    """:func:`_exchange` of several tensors with the same rows in one ``all_to_all_single``:
    each row's bytes side by side (exact: bit-for-bit views), split and viewed back on arrival.
    One collective instead of one per tensor (rows, weights, ids, FP8 scales): each is a
    kernel launch and a latency-bound transfer of a few bytes a row.  (FP8 travels as bytes
    too: gloo has no float8.)"""
    if _world(group)[1] == 1:
        return parts
    rows = parts[0].shape[0]
    wires = [t.contiguous().reshape(rows, math.prod(t.shape[1:])).view(torch.uint8) for t in parts]
    widths = [w.shape[1] for w in wires]
    out = _exchange(torch.cat(wires, dim=1), out_rows, out_splits, in_splits, group)
    got = []
    for t, piece in zip(parts, out.split(widths, dim=1), strict=True):
        got.append(piece.contiguous().view(t.dtype).reshape(out_rows, *t.shape[1:]))
    return got


def _dispatch_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    slots = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(5)])
    x, w = randn(g, 5, 16, dtype=dtype), randn(g, 5, 2).abs()
    return [((x, slots, w, 6, None), {}), ((x, slots, w, 6, None), {"capacity": 10})]


@define_op("moe_dispatch", "moe", sample_cases=_dispatch_cases)
def moe_dispatch(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    slots_per_rank: int,
    group: Any = None,
    *,
    fp8: bool = False,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each (token, expert) pair's row to the rank holding its physical expert slot.

    Args:
        x: ``[T, D]`` this rank's tokens; slots: ``[T, k]`` int64 physical expert slots (rank
            ``slot // slots_per_rank``, local expert ``slot % slots_per_rank``); weights:
            ``[T, k]`` routing weights (any float dtype, sent as is).
        slots_per_rank: physical slots per rank ``S``.
        group: the expert-parallel process group (``None``: one process, all slots local).
        fp8: quantise the rows for the exchange (FP8 e4m3, one fp32 scale per 128 channels;
            dequantised to ``x.dtype`` on arrival): half the bytes of bf16, a quarter of fp32;
            each element off by at most ``2**-4 |x| + 2**-10 s`` (``s = amax / 448`` of its group).
        capacity: rows sent to each rank in the fixed-shape (graph-capturable) exchange, the
            same on every rank of the group and at least ``T * k`` on each (e.g.
            ``max_num_batched_tokens * k``), or ``None`` for the dynamic one (counts exchanged,
            one host sync).

    Returns:
        ``(recv_x [N, D] in x's dtype, recv_ids [N] int64 local expert ids, recv_weights [N],
        handle)``: the pairs every rank sent here, grouped by ascending local expert (within
        one expert by source rank, then source pair order).  With ``capacity``, ``N = world *
        capacity`` and the padding rows come last (zero rows, weight 0, local id ``-1``: no
        expert, so ``moe_experts`` computes nothing for them).
    """
    if slots.dim() != 2 or slots.shape[0] != x.shape[0] or weights.shape != slots.shape:
        raise ValueError(
            f"moe_dispatch: slots {tuple(slots.shape)} and weights {tuple(weights.shape)} must be [T, k] "
            f"for x of {x.shape[0]} tokens"
        )
    num_tokens, top_k = slots.shape
    _, world = _world(group)
    dev, pairs = x.device, slots.numel()
    flat = slots.reshape(-1).long()
    dest, local = flat // slots_per_rank, flat % slots_per_rank
    dest_sorted, send_order = torch.sort(dest, stable=True)
    ranks = torch.arange(world, device=dev)
    ends = torch.searchsorted(dest_sorted, ranks, right=True)
    starts = ends - torch.diff(ends, prepend=ends.new_zeros(1))
    rows = x.index_select(0, send_order // top_k)
    send_w, send_ids = weights.reshape(-1).index_select(0, send_order), local.index_select(0, send_order)
    if capacity is None:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "moe_dispatch: the dynamic exchange reads the per-rank counts on the host and cannot be "
                "captured in a CUDA graph; pass capacity= for the fixed-shape one"
            )
        send_splits = torch.diff(ends, prepend=ends.new_zeros(1))
        recv_splits = _exchange(send_splits, world, None, None, group)
        send_list, recv_list = send_splits.tolist(), recv_splits.tolist()  # the dynamic exchange's sync
        n_recv = sum(recv_list)
        pair_pos = torch.empty_like(send_order).index_copy_(0, send_order, torch.arange(pairs, device=dev))
    else:
        if capacity < max(pairs, 1):  # from shapes: a rank sends at most T * k pairs to one rank
            raise ValueError(
                f"moe_dispatch: capacity ({capacity}) must be >= the {pairs} (token, expert) pairs of this "
                "rank (the most it may send to one rank)"
            )
        send_list = recv_list = None
        n_recv = world * capacity
        # each pair's row: its destination's block + its rank among the pairs to that destination
        within = torch.arange(pairs, device=dev) - starts.index_select(0, dest_sorted)
        pos = dest_sorted * capacity + within
        rows = x.new_zeros(n_recv, x.shape[1]).index_copy_(0, pos, rows)
        send_w = weights.new_zeros(n_recv).index_copy_(0, pos, send_w)
        send_ids = torch.full((n_recv,), -1, dtype=torch.int64, device=dev).index_copy_(0, pos, send_ids)
        pair_pos = torch.empty_like(pos).index_copy_(0, send_order, pos)
    ids32 = send_ids.to(torch.int32)  # local slots and -1: the wire carries 4 bytes an id
    if fp8:
        data, scale = quant_fp8(rows, FP8_DISPATCH_BLOCK)
        data, scale, recv_w, recv_ids = _exchange_packed(
            [data, scale, send_w, ids32], n_recv, recv_list, send_list, group
        )
        recv_x = dequant_fp8(data, scale, FP8_DISPATCH_BLOCK, x.dtype)
    else:
        recv_x, recv_w, recv_ids = _exchange_packed(
            [rows, send_w, ids32], n_recv, recv_list, send_list, group
        )
    recv_ids = recv_ids.long()
    key = torch.where(recv_ids < 0, torch.full_like(recv_ids, slots_per_rank), recv_ids)  # padding last
    key, recv_order = torch.sort(key, stable=True)
    recv_ids = torch.where(key < slots_per_rank, key, torch.full_like(key, -1))
    handle = DispatchHandle(
        num_tokens=num_tokens,
        top_k=top_k,
        group=group,
        send_order=send_order,
        pair_pos=pair_pos,
        send_splits=send_list,
        recv_splits=recv_list,
        recv_order=recv_order,
        capacity=capacity,
    )
    # padding rows (capacity) arrive as zeros: FP8 zeros dequantise to zeros
    return recv_x.index_select(0, recv_order), recv_ids, recv_w.index_select(0, recv_order), handle


def _combine_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    cases = []
    for capacity in (None, 10):
        ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(5)])
        x, w = randn(g, 5, 16, dtype=dtype), randn(g, 5, 2).abs()
        recv_x, _, _, handle = moe_dispatch(x, ids, w, 6, None, capacity=capacity)
        cases.append(((randn(g, *recv_x.shape, dtype=dtype), handle, ids), {}))
    return cases


@define_op("moe_combine", "moe", sample_cases=_combine_cases)
def moe_combine(y: torch.Tensor, handle: DispatchHandle, ids: torch.Tensor) -> torch.Tensor:
    """Send the expert outputs of :func:`moe_dispatch`'s rows back and add each token's.

    Args:
        y: ``[N, D]`` the weighted contribution of each row ``moe_dispatch`` returned here (its
            order; padding rows are ignored).
        handle: that dispatch's handle.
        ids: ``[T, k]`` the dispatching rank's *logical* expert ids (their order only: the
            contributions are added in ascending logical expert, then slot, order).

    Returns:
        ``[T, D]`` in y's dtype: each token's ``k`` contributions added with the arithmetic of
        the single-process ``moe_experts`` (:func:`~deepinfer_core.ops.moe_paths.expert_order_sum`:
        sequential adds in fp32 / fp64; for lower precisions an fp32 sum rounded after each
        expert).
    """
    h = handle
    if ids.shape != (h.num_tokens, h.top_k):
        raise ValueError(
            f"moe_combine: ids {tuple(ids.shape)} do not match the dispatch's [{h.num_tokens}, {h.top_k}]"
        )
    _, world = _world(h.group)
    pairs = h.num_tokens * h.top_k
    back = torch.empty_like(y).index_copy_(0, h.recv_order, y)  # in the order received
    n_sent = pairs if h.capacity is None else world * h.capacity
    sent = _exchange(back, n_sent, h.send_splits, h.recv_splits, h.group)
    contrib = sent.index_select(0, h.pair_pos).view(h.num_tokens, h.top_k, y.shape[1])
    return expert_order_sum(contrib, ids)
