"""EPLB: placement policies against brute force and their invariants, the load window, and the
weight move of a rebalancing in a gloo world (the oracle: the checkpoint's own tensors)."""

from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer_core.distributed.eplb.policy import (
    balanced_packing,
    gpu_loads,
    imbalance,
    log2phy_from,
    rebalance_experts,
    replicate_experts,
)
from deepinfer_core.distributed.eplb.stats import ExpertLoadWindow


# ---- synthetic loads -------------------------------------------------------------------------
def zipf_loads(layers: int, experts: int, seed: int, s: float = 1.2, tokens: int = 100_000) -> torch.Tensor:
    """``[L, E]`` token counts: Zipf over a different random expert order in each layer."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, experts + 1, dtype=torch.float64)
    p = ranks.pow(-s) / ranks.pow(-s).sum()
    rows = [(p[torch.randperm(experts, generator=g)] * tokens).round().to(torch.int64) for _ in range(layers)]
    return torch.stack(rows)


def hot_loads(layers: int, experts: int, seed: int) -> torch.Tensor:
    """A few hot experts (10-40x the base load) per layer, different ones in each layer."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(50, 150, (layers, experts), generator=g)
    for layer in range(layers):
        hot = torch.randperm(experts, generator=g)[:3]
        w[layer, hot] *= torch.randint(10, 40, (3,), generator=g)
    return w


def default_phy2log(layers: int, experts: int) -> torch.Tensor:
    """The placement before any rebalancing: expert ``e`` in slot ``e`` (no redundancy)."""
    return torch.arange(experts).repeat(layers, 1)


# ---- policies --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["hierarchical", "global"])
@pytest.mark.parametrize("make", [zipf_loads, hot_loads])
def test_rebalance_lowers_max_over_mean_load(policy: str, make) -> None:
    layers, experts, gpus, nodes = 4, 64, 8, 2
    w = make(layers, experts, seed=3)
    default = imbalance(w, default_phy2log(layers, experts), gpus)
    no_redundancy = rebalance_experts(w, experts, experts, nodes, gpus, policy)[0]
    redundant = rebalance_experts(w, experts + 16, experts, nodes, gpus, policy)[0]
    r_none, r_red = imbalance(w, no_redundancy, gpus), imbalance(w, redundant, gpus)
    assert default > r_none > r_red >= 1.0, (default, r_none, r_red)
    assert r_red < 1.15  # replicas of the hot experts make it nearly flat
    # per layer as well: no layer gets worse than the default
    before = gpu_loads(w, default_phy2log(layers, experts), gpus)
    after = gpu_loads(w, redundant, gpus)
    assert bool((after.max(1).values < before.max(1).values).all())


def test_hot_expert_needs_replicas() -> None:
    """One expert with more load than a GPU's share: without replicas it bounds the max; its
    replicas (all 4 extra slots: 2000 / 5 per replica still beats every other expert) spread it,
    and the max is the best 5 slots a GPU allow: two replicas and three cold experts."""
    w = torch.full((1, 16), 100, dtype=torch.int64)
    w[0, 5] = 2000  # total 3500, mean per GPU (4) 875
    none = rebalance_experts(w, 16, 16, 1, 4, "global")[0]
    assert gpu_loads(w, none, 4).max() >= 2000
    phy2log, _, logcnt = rebalance_experts(w, 20, 16, 1, 4, "global")
    assert int(logcnt[0, 5]) == 5 and gpu_loads(w, phy2log, 4).max() == pytest.approx(1100)


def _brute_force_packing(weights: list[float], packs: int) -> float:
    """The smallest possible heaviest pack over every split into equal-size packs."""
    n, cap, best = len(weights), len(weights) // packs, float("inf")
    for labels in itertools.product(range(packs), repeat=n):
        if labels[0] != 0 or any(labels.count(p) != cap for p in range(packs)):
            continue
        loads = [0.0] * packs
        for x, p in zip(weights, labels, strict=True):
            loads[p] += x
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize(("packs", "per_pack"), [(2, 2), (3, 2), (4, 2), (2, 3), (3, 3), (2, 4)])
def test_balanced_packing_against_brute_force(packs: int, per_pack: int) -> None:
    """Two items per pack: the greedy pairs largest with smallest, which is optimal; three per
    pack: within Kellerer & Woeginger's 4/3 - 1/(3m) bound of modified LPT; always >= optimum."""
    g = torch.Generator().manual_seed(packs * 10 + per_pack)
    n = packs * per_pack
    worst = 1.0
    for _ in range(25):
        w = torch.randint(1, 100, (1, n), generator=g).to(torch.float64)
        pack, slot = balanced_packing(w, packs)
        assert sorted(pack[0].tolist()) == sorted(list(range(packs)) * per_pack)
        for p in range(packs):  # slots in a pack are 0..cap-1
            assert sorted(slot[0, pack[0] == p].tolist()) == list(range(per_pack))
        greedy = float(torch.zeros(packs, dtype=torch.float64).index_add_(0, pack[0], w[0]).max())
        opt = _brute_force_packing(w[0].tolist(), packs)
        assert greedy >= opt
        worst = max(worst, greedy / opt)
        if per_pack == 2:
            assert greedy == opt
        if per_pack == 3:
            assert greedy <= (4 / 3 - 1 / (3 * packs)) * opt + 1e-9
    assert worst < 4 / 3


def test_replicate_experts_minimises_max_per_replica() -> None:
    """Against brute force: the largest load per replica is the least over every way of
    handing out the extra replicas."""
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        w = torch.randint(1, 60, (1, 5), generator=g).to(torch.float64)
        extra = int(torch.randint(1, 5, (1,), generator=g))
        phy2log, rank, count = replicate_experts(w, 5 + extra)
        got = float((w[0] / count[0]).max())
        best = min(
            float((w[0] / (1 + torch.bincount(torch.tensor(c, dtype=torch.int64), minlength=5))).max())
            for c in itertools.combinations_with_replacement(range(5), extra)
        )
        assert got == best
        assert phy2log[0, :5].tolist() == list(range(5))
        assert torch.equal(torch.bincount(phy2log[0], minlength=5), count[0])
        for e in range(5):  # replica ranks of an expert: 0..count-1
            assert sorted(rank[0, phy2log[0] == e].tolist()) == list(range(int(count[0, e])))


@pytest.mark.parametrize(
    ("experts", "groups", "nodes", "gpus", "redundant", "policy"),
    [(64, 64, 2, 8, 16, "hierarchical"), (64, 8, 2, 4, 8, "hierarchical"), (32, 4, 4, 8, 8, "hierarchical"),
     (64, 1, 1, 8, 8, "global"), (8, 8, 1, 2, 2, "global"), (8, 8, 1, 4, 0, "hierarchical")],
)  # fmt: skip
def test_placement_invariants(
    experts: int, groups: int, nodes: int, gpus: int, redundant: int, policy: str
) -> None:
    layers = 3
    w = zipf_loads(layers, experts, seed=experts + gpus)
    num_phy = experts + redundant
    phy2log, log2phy, logcnt = rebalance_experts(w, num_phy, groups, nodes, gpus, policy)
    assert phy2log.shape == (layers, num_phy) and phy2log.dtype == torch.int64
    assert log2phy.shape[:2] == (layers, experts) and log2phy.shape[2] == int(logcnt.max())
    assert bool((logcnt >= 1).all()) and bool((logcnt.sum(1) == num_phy).all())
    # P / gpus slots per GPU by construction of the contiguous layout; each slot once in log2phy
    assert num_phy % gpus == 0
    for layer in range(layers):
        assert torch.equal(torch.bincount(phy2log[layer], minlength=experts), logcnt[layer])
        seen = []
        for e in range(experts):
            slots = log2phy[layer, e]
            real = slots[slots >= 0]
            assert len(real) == int(logcnt[layer, e]) and bool((slots[len(real) :] == -1).all())
            assert real.tolist() == sorted(real.tolist())
            assert bool((phy2log[layer, real] == e).all())
            seen += real.tolist()
        assert sorted(seen) == list(range(num_phy))
    assert torch.equal(log2phy_from(phy2log, experts)[0], log2phy)
    if policy == "hierarchical":  # every slot of a group's experts on one node
        per_node, group_size = num_phy // nodes, experts // groups
        node = torch.arange(num_phy) // per_node
        for layer in range(layers):
            for grp in range(groups):
                members = (phy2log[layer] // group_size) == grp
                assert len(set(node[members].tolist())) == 1
            # each node holds the same number of groups
            groups_on = [set((phy2log[layer][node == n] // group_size).tolist()) for n in range(nodes)]
            assert all(len(s) == groups // nodes for s in groups_on)
    # deterministic
    again = rebalance_experts(w.clone(), num_phy, groups, nodes, gpus, policy)
    assert all(torch.equal(a, b) for a, b in zip((phy2log, log2phy, logcnt), again, strict=True))


def test_rebalance_experts_rejects_bad_shapes() -> None:
    w = torch.ones(2, 8)
    with pytest.raises(ValueError, match="num_replicas=9"):
        rebalance_experts(w, 9, 8, 1, 2)
    with pytest.raises(ValueError, match="num_nodes=3"):
        rebalance_experts(w, 12, 8, 3, 6)
    with pytest.raises(ValueError, match="unknown policy"):
        rebalance_experts(w, 8, 8, 1, 2, "random")  # type: ignore[arg-type]


# ---- the load window --------------------------------------------------------------------------
def test_load_window_sums_the_last_steps() -> None:
    g = torch.Generator().manual_seed(0)
    steps = [torch.randint(0, 50, (3, 8), generator=g) for _ in range(11)]
    win = ExpertLoadWindow(4, 3, 8)
    step_buffer = torch.zeros(3, 8, dtype=torch.int64)
    for i, counts in enumerate(steps):
        step_buffer += counts  # what the MoE does during a step
        win.record(step_buffer, reset=True)
        assert int(step_buffer.abs().sum()) == 0
        assert torch.equal(win.load(), torch.stack(steps[max(0, i - 3) : i + 1]).sum(0))
    with pytest.raises(ValueError, match=r"counts have shape \(3, 7\)"):
        win.record(torch.zeros(3, 7, dtype=torch.int64))
    win.clear()
    assert int(win.load().sum()) == 0 and win.steps == 0
