"""EPLB placement policies: which logical expert each physical expert slot holds.

Pure functions on CPU tensors, after DeepSeek's EPLB (https://github.com/deepseek-ai/EPLB):
given the load of every logical expert of every MoE layer (tokens routed to it over a window),
choose ``P`` physical slots (``P - E`` of them redundant replicas of hot experts) and their
order, so that consecutive runs of ``P / num_gpus`` slots (one GPU's experts) carry balanced
load.  A token routed to an expert with ``c`` replicas is assumed to go to each with
probability ``1 / c`` (the router spreads tokens over the replicas evenly), so a replica
carries ``load / c``.

The ``hierarchical`` policy first packs expert groups onto nodes (each node gets the same
number of groups, the group loads balanced), then inside each node replicates the hottest
experts and packs the node's physical experts onto its GPUs: a group, and so every replica of
its experts, stays within one node (traffic of the group-limited routing stays on the fast
intra-node links).  The ``global`` policy is the same with one node and one group.

Every step is deterministic: ties go to the lower index (of expert, replica or pack).
"""

from __future__ import annotations

from typing import Literal

import torch

Policy = Literal["hierarchical", "global"]


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split each row's ``n`` items into ``num_packs`` packs of exactly ``n / num_packs`` items,
    the packs' total weights balanced: greedy longest-processing-time with a cardinality limit
    (items by decreasing weight, each into the lightest pack that is not full).

    Args:
        weight: ``[X, n]`` item weights (``n`` a multiple of ``num_packs``).
        num_packs: packs per row.

    Returns:
        ``pack [X, n]`` (the pack of each item) and ``slot [X, n]`` (its position in the pack,
        in the order items were placed), both int64.
    """
    rows, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"balanced_packing: {n} items do not split into {num_packs} packs of equal size")
    cap = n // num_packs
    w = weight.to(torch.float64)
    order = torch.sort(w, dim=1, descending=True, stable=True).indices  # ties: lower index first
    pack = torch.empty(rows, n, dtype=torch.int64)
    slot = torch.empty(rows, n, dtype=torch.int64)
    loads = torch.zeros(rows, num_packs, dtype=torch.float64)
    counts = torch.zeros(rows, num_packs, dtype=torch.int64)
    r = torch.arange(rows)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for k in range(n):
        item = order[:, k]
        open_loads = torch.where(counts < cap, loads, inf)
        p = open_loads.argmin(dim=1)  # the first of equal minima: the lower pack
        pack[r, item] = p
        slot[r, item] = counts[r, p]
        loads[r, p] += w[r, item]
        counts[r, p] += 1
    return pack, slot


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give each row's ``n`` logical experts ``num_phy`` physical replicas (at least one each),
    minimising the largest load per replica: every extra replica goes to the expert whose load
    per replica is highest (the lower index on a tie).

    Args:
        weight: ``[X, n]`` loads.
        num_phy: replicas per row, ``>= n``.

    Returns:
        ``phy2log [X, num_phy]`` (the first ``n`` are the experts themselves, in order),
        ``rank [X, num_phy]`` (which replica of its expert each is) and ``count [X, n]``.
    """
    rows, n = weight.shape
    if num_phy < n:
        raise ValueError(f"replicate_experts: {num_phy} physical experts cannot hold {n} logical ones")
    w = weight.to(torch.float64)
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(rows, 1)
    rank = torch.zeros(rows, num_phy, dtype=torch.int64)
    count = torch.ones(rows, n, dtype=torch.int64)
    r = torch.arange(rows)
    for i in range(n, num_phy):
        hot = (w / count).argmax(dim=1)
        phy2log[:, i] = hot
        rank[:, i] = count[r, hot]
        count[r, hot] += 1
    return phy2log, rank, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations ``[X, n]``."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand_as(perm).contiguous())
    return inv


def log2phy_from(phy2log: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log2phy [L, E, R], logcnt [L, E])`` of a placement ``phy2log [L, P]``: the physical
    slots of each logical expert in increasing order, padded with ``-1`` to ``R`` = the most
    replicas of any expert."""
    layers, num_phy = phy2log.shape
    logcnt = torch.zeros(layers, num_experts, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    width = max(int(logcnt.max()), 1)
    # the replica index of each slot: how many earlier slots of the row hold the same expert
    same = phy2log.unsqueeze(2) == phy2log.unsqueeze(1)  # [L, P, P]
    earlier = torch.ones(num_phy, num_phy, dtype=torch.bool).tril(-1)
    replica = (same & earlier).sum(2)
    log2phy = torch.full((layers, num_experts * width), -1, dtype=torch.int64)
    slots = torch.arange(num_phy, dtype=torch.int64).expand(layers, -1)
    log2phy.scatter_(1, phy2log * width + replica, slots.contiguous())
    return log2phy.view(layers, num_experts, width), logcnt


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    policy: Policy = "hierarchical",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A balanced placement of ``E`` logical experts in ``num_replicas`` physical slots.

    Args:
        weight: ``[L, E]`` load of each logical expert of each MoE layer (token counts).
        num_replicas: physical slots ``P >= E``, a multiple of ``num_gpus``; GPU ``g`` holds
            slots ``[g * P / num_gpus, (g + 1) * P / num_gpus)``.
        num_groups: expert groups (``E`` a multiple of it; ``E`` for models without group-limited
            routing); the hierarchical policy keeps each group within one node.
        num_nodes: nodes (``num_gpus`` and ``num_groups`` multiples of it) for ``hierarchical``.
        num_gpus: GPUs (EP ranks).
        policy: ``hierarchical`` or ``global`` (one node, one group).

    Returns:
        ``phy2log [L, P]`` (the logical expert of each slot), ``log2phy [L, E, R]`` (each
        expert's slots, increasing, ``-1``-padded) and ``logcnt [L, E]`` (replicas per expert),
        all int64.
    """
    if weight.dim() != 2:
        raise ValueError(f"rebalance_experts: weight has shape {tuple(weight.shape)}, need [layers, experts]")
    layers, num_experts = weight.shape
    if policy == "global":
        num_groups, num_nodes = 1, 1
    elif policy != "hierarchical":
        raise ValueError(f"rebalance_experts: unknown policy {policy!r} (use 'hierarchical' or 'global')")
    if num_replicas < num_experts or num_replicas % num_gpus:
        raise ValueError(
            f"rebalance_experts: num_replicas={num_replicas} must be >= the {num_experts} experts "
            f"and a multiple of num_gpus={num_gpus}"
        )
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"rebalance_experts: {num_experts} experts do not split in num_groups={num_groups}")
    if num_nodes < 1 or num_groups % num_nodes or num_gpus % num_nodes:
        raise ValueError(
            f"rebalance_experts: num_nodes={num_nodes} must divide num_groups={num_groups} and "
            f"num_gpus={num_gpus} (use policy='global' otherwise)"
        )
    w = weight.detach().to("cpu", torch.float64)
    group_size = num_experts // num_groups
    per_node_log, per_node_phy = num_experts // num_nodes, num_replicas // num_nodes
    per_gpu = num_replicas // num_gpus

    # 1. groups onto nodes; renumber experts node-major ("mlog": node, group in node, member)
    group_node, group_slot = balanced_packing(w.view(layers, num_groups, group_size).sum(-1), num_nodes)
    group_base = (group_node * (num_groups // num_nodes) + group_slot) * group_size  # [L, G]
    log2mlog = (group_base.unsqueeze(-1) + torch.arange(group_size)).flatten(1)  # [L, E]
    mlog2log = _inverse(log2mlog)

    # 2. replicas within each node: rows are (layer, node)
    w_mlog = w.gather(1, mlog2log).view(layers * num_nodes, per_node_log)
    phy2mlog, _, mcount = replicate_experts(w_mlog, per_node_phy)

    # 3. the node's physical experts onto its GPUs
    phy_load = (w_mlog / mcount).gather(1, phy2mlog)
    gpu, slot = balanced_packing(phy_load, num_gpus // num_nodes)
    pos2phy = _inverse(gpu * per_gpu + slot)  # node-local position -> node-local physical expert
    pos2mlog = phy2mlog.gather(1, pos2phy).view(layers, num_nodes, per_node_phy)
    pos2mlog = pos2mlog + (torch.arange(num_nodes) * per_node_log).view(1, -1, 1)
    phy2log = mlog2log.gather(1, pos2mlog.flatten(1))
    log2phy, logcnt = log2phy_from(phy2log, num_experts)
    return phy2log, log2phy, logcnt


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """``[L, num_gpus]`` load of each GPU under placement ``phy2log [L, P]``: the sum over its
    slots of ``load / replicas`` of the slot's expert (float64)."""
    w = weight.to("cpu", torch.float64)
    cnt = torch.zeros_like(w).scatter_add_(1, phy2log, torch.ones_like(phy2log, dtype=torch.float64))
    per_slot = (w / cnt.clamp(min=1)).gather(1, phy2log)
    return per_slot.view(phy2log.shape[0], num_gpus, -1).sum(-1)


def imbalance(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> float:
    """Max / mean GPU load of placement ``phy2log`` under ``weight``, summed over the layers
    (each layer's max over its mean, weighted by the layer's load); 1.0 is perfect balance."""
    loads = gpu_loads(weight, phy2log, num_gpus)
    mean = loads.mean(1)
    if float(mean.sum()) == 0:
        return 1.0
    return float(loads.max(1).values.sum() / mean.sum())
