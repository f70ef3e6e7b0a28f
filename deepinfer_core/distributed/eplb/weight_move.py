"""The EPLB weight move (:mod:`.rebalance` drives it between engine steps): a new placement
aligned with the current one so that experts already on a rank keep their slot
(:func:`align_placement`), the transfers of each layer (:func:`plan_layer_moves`) and the
point-to-point move that rewrites a rank's local expert stacks in place
(:func:`move_expert_weights`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.weights.quant import QuantizedTensor, Weight


def weight_parts(w: Weight) -> list[torch.Tensor]:
    """The tensors of a weight, each with the local slots as leading dimension."""
    return [w.data, w.scale] if isinstance(w, QuantizedTensor) else [w]


# ---- placement alignment -----------------------------------------------------------------------
def _overlap(a: list[int], b: list[int]) -> int:
    """Size of the multiset intersection of ``a`` and ``b``."""
    rest, n = list(b), 0
    for x in a:
        if x in rest:
            rest.remove(x)
            n += 1
    return n


def align_placement(old: torch.Tensor, new: torch.Tensor, num_gpus: int, num_nodes: int = 1) -> torch.Tensor:
    """``new`` ``[L, P]`` rearranged to move as few weights as possible from ``old``, with the
    same per-GPU multisets of experts (so the same loads and node membership).

    Per layer and node, the new GPUs' expert sets are assigned to the node's old GPUs by
    greedy largest overlap (ties: lower new GPU, then lower old GPU); then inside each GPU an
    expert that the GPU already held keeps its old slot, the others fill the free slots in
    ascending order.  Deterministic.
    """
    layers, num_phy = new.shape
    per_gpu, gpus_per_node = num_phy // num_gpus, num_gpus // num_nodes
    out = torch.empty_like(new)
    for layer in range(layers):
        o = old[layer].view(num_gpus, per_gpu).tolist()
        n = new[layer].view(num_gpus, per_gpu).tolist()
        for node in range(num_nodes):
            gpus = range(node * gpus_per_node, (node + 1) * gpus_per_node)
            pairs = sorted(
                ((-_overlap(n[a], o[b]), a, b) for a in gpus for b in gpus), key=lambda t: (t[0], t[1], t[2])
            )
            target: dict[int, int] = {}
            used: set[int] = set()
            for _, a, b in pairs:
                if a not in target and b not in used:
                    target[a] = b
                    used.add(b)
            for a, b in target.items():
                slots: list[int | None] = [None] * per_gpu
                rest = list(n[a])
                for k, e in enumerate(o[b]):
                    if e in rest:
                        slots[k] = e
                        rest.remove(e)
                rest.sort()
                for k in range(per_gpu):
                    if slots[k] is None:
                        slots[k] = rest.pop(0)
                out[layer, b * per_gpu : (b + 1) * per_gpu] = torch.tensor(slots, dtype=new.dtype)
    return out


# ---- the weight move ---------------------------------------------------------------------------
def plan_layer_moves(
    old_row: list[int], new_row: list[int], ep_size: int
) -> dict[tuple[int, int], list[int]]:
    """The transfers of one layer: ``{(sender, receiver): [logical experts, ascending]}``.

    A rank receives each logical expert that its new slots hold and its old slots do not, once;
    the sender is one of the expert's old holders, chosen deterministically and spread: the
    ``i``-th receiver of an expert (by rank) gets it from holder ``i mod holders``."""
    per = len(old_row) // ep_size
    old_local = [set(old_row[r * per : (r + 1) * per]) for r in range(ep_size)]
    needs = [sorted(set(new_row[r * per : (r + 1) * per]) - old_local[r]) for r in range(ep_size)]
    moves: dict[tuple[int, int], list[int]] = {}
    for e in sorted({e for need in needs for e in need}):
        holders = [r for r in range(ep_size) if e in old_local[r]]
        receivers = [r for r in range(ep_size) if e in needs[r]]
        for i, r in enumerate(receivers):
            moves.setdefault((holders[i % len(holders)], r), []).append(e)
    return moves


def _peer(group: Any, rank: int) -> int:
    """The default-group rank of ``group``'s rank ``rank``."""
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def move_expert_weights(
    old_phy2log: torch.Tensor,
    new_phy2log: torch.Tensor,
    local_weights: Sequence[Sequence[Weight]],
    ep_rank: int,
    ep_size: int,
    group: Any = None,
) -> int:
    """Rewrite this rank's local expert stacks from placement ``old_phy2log`` to ``new_phy2log``
    (both ``[L, P]``, rank ``r`` holding slots ``[r * S, (r + 1) * S)``), in place.

    Every rank of the EP ``group`` calls this with the same placements.  Per layer, each rank
    sends to each peer one byte buffer of the experts the peer lacks and this rank was chosen
    to send (:func:`plan_layer_moves`), receives its own the same way (``batch_isend_irecv``),
    then fills its new slots from its old slots or the received experts and copies the result
    into the existing tensors (``QuantizedTensor`` data and scale alike).

    Args:
        local_weights: per layer, the local expert stacks (leading dimension ``S``).
        ep_rank, ep_size: this rank in the EP group, and its size.
        group: the EP process group (``None``: the default group).

    Returns:
        The number of experts this rank received.
    """
    layers, num_phy = new_phy2log.shape
    per = num_phy // ep_size
    if len(local_weights) != layers:
        raise ValueError(
            f"move_expert_weights: {len(local_weights)} layers of weights for {layers} placement layers"
        )
    received = 0
    for layer in range(layers):
        old_row, new_row = old_phy2log[layer].tolist(), new_phy2log[layer].tolist()
        if old_row == new_row:
            continue
        parts = [t for w in local_weights[layer] for t in weight_parts(w)]
        for t in parts:
            if t.shape[0] != per:
                raise ValueError(
                    f"move_expert_weights: layer {layer} has a local expert stack of {t.shape[0]} slots, "
                    f"the placement gives each rank {per}"
                )
        sizes = [t[0].numel() * t.element_size() for t in parts]
        expert_bytes = sum(sizes)
        old_local = old_row[ep_rank * per : (ep_rank + 1) * per]
        new_local = new_row[ep_rank * per : (ep_rank + 1) * per]
        moves = plan_layer_moves(old_row, new_row, ep_size)
        ops: list[dist.P2POp] = []
        recv_bufs: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for (src, dst), experts in sorted(moves.items()):
            if src == ep_rank:
                rows = [old_local.index(e) for e in experts]
                buf = torch.cat([_bytes(t[k]) for k in rows for t in parts])
                ops.append(dist.P2POp(dist.isend, buf, _peer(group, dst), group))
            elif dst == ep_rank:
                device = parts[0].device
                buf = torch.empty(len(experts) * expert_bytes, dtype=torch.uint8, device=device)
                recv_bufs[src] = (buf, experts)
                ops.append(dist.P2POp(dist.irecv, buf, _peer(group, src), group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if old_local == new_local:
            continue
        incoming: dict[int, list[torch.Tensor]] = {}  # expert -> its parts, from the buffers
        for buf, experts in recv_bufs.values():
            offset = 0
            for e in experts:
                pieces = []
                for t, size in zip(parts, sizes, strict=True):
                    pieces.append(buf[offset : offset + size].view(t.dtype).view(t.shape[1:]))
                    offset += size
                incoming[e] = pieces
        received += len(incoming)
        for i, t in enumerate(parts):
            fresh = torch.empty_like(t)
            for k, e in enumerate(new_local):
                fresh[k] = t[old_local.index(e)] if e in old_local else incoming[e][i]
            t.copy_(fresh)
    return received


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat (any dtype, float8 included, travels as uint8)."""
    return t.contiguous().reshape(-1).view(torch.uint8)
