"""EPLB: placement policies against brute force and their invariants, the load window, and the
weight move of a rebalancing in a gloo world (the oracle: the checkpoint's own tensors)."""

from __future__ import annotations

import itertools
import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.backends.resolve import resolve_backend
from deepinfer_core.config import EPLBConfig
from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.contract.placement import EXPERT_PLACEMENT_KEY, ExpertPlacement
from deepinfer_core.distributed.eplb.policy import (
    balanced_packing,
    gpu_loads,
    imbalance,
    log2phy_from,
    rebalance_experts,
    replicate_experts,
)
from deepinfer_core.distributed.eplb.rebalance import EplbController, infer_num_nodes, local_expert_weights
from deepinfer_core.distributed.eplb.stats import ExpertLoadWindow
from deepinfer_core.distributed.eplb.weight_move import align_placement, plan_layer_moves, weight_parts
from deepinfer_core.models.deepseek_v4 import tiny
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.loader import load_checkpoint
from deepinfer_core.models.deepseek_v4.moe import MoE
from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.weights.quant import UE8M0_DTYPE, QuantizedTensor, Weight


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


def _needs(old: list[int], new: list[int], ranks: int) -> int:
    """(rank, expert) pairs a move from ``old`` to ``new`` must transfer (brute force)."""
    per = len(old) // ranks
    return sum(
        len(set(new[r * per : (r + 1) * per]) - set(old[r * per : (r + 1) * per])) for r in range(ranks)
    )


def gpu_sets(phy2log: torch.Tensor, per: int) -> list[list[int]]:
    """The sorted expert multisets of the GPUs of a placement row (or rows), sorted."""
    return sorted(sorted(g) for g in phy2log.reshape(-1, per).tolist())


def _overlap(a: list[int], b: list[int]) -> int:
    return sum(min(a.count(e), b.count(e)) for e in set(a))


@pytest.mark.parametrize(("gpus", "nodes"), [(4, 1), (4, 2), (2, 1)])
def test_align_placement_keeps_loads_and_moves_less(gpus: int, nodes: int) -> None:
    experts, num_phy, layers = 16, 16 + gpus, 4
    old = rebalance_experts(zipf_loads(layers, experts, seed=1), num_phy, experts, nodes, gpus)[0]
    w = zipf_loads(layers, experts, seed=2)
    new = rebalance_experts(w, num_phy, experts, nodes, gpus)[0]
    aligned = align_placement(old, new, gpus, nodes)
    per, per_node = num_phy // gpus, num_phy // nodes
    for layer in range(layers):
        for n in range(nodes):  # the same expert sets on each node's GPUs, only permuted
            part = slice(n * per_node, (n + 1) * per_node)
            assert gpu_sets(aligned[layer, part], per) == gpu_sets(new[layer, part], per)
        o, a, x = old[layer].tolist(), aligned[layer].tolist(), new[layer].tolist()
        assert _needs(o, a, gpus) <= _needs(o, x, gpus)
        for g in range(gpus):  # every expert a GPU keeps stays in its slot
            og, ag = o[g * per : (g + 1) * per], a[g * per : (g + 1) * per]
            assert sum(u == v for u, v in zip(og, ag, strict=True)) == _overlap(og, ag)
    assert torch.allclose(gpu_loads(w, aligned, gpus).sort(1).values, gpu_loads(w, new, gpus).sort(1).values)
    # a placement permuted within and across GPUs aligns back to the old one: nothing moves
    shuffled = old.view(layers, gpus, per).flip(1).flip(2).reshape(layers, -1)
    assert torch.equal(align_placement(old, shuffled, gpus, 1), old)


def test_plan_layer_moves_against_brute_force() -> None:
    """Every receiver gets exactly the experts it lacks, from a rank that holds them, each once;
    senders are spread over the holders."""
    g = torch.Generator().manual_seed(5)
    for _ in range(30):
        ranks, per, experts = 4, 3, 8
        old = torch.cat(
            [torch.arange(experts), torch.randint(0, experts, (ranks * per - experts,), generator=g)]
        )
        old = old[torch.randperm(ranks * per, generator=g)].tolist()
        new = torch.cat(
            [torch.arange(experts), torch.randint(0, experts, (ranks * per - experts,), generator=g)]
        )
        new = new[torch.randperm(ranks * per, generator=g)].tolist()
        moves = plan_layer_moves(old, new, ranks)
        for r in range(ranks):
            lacks = set(new[r * per : (r + 1) * per]) - set(old[r * per : (r + 1) * per])
            got = [e for (s, d), es in moves.items() if d == r for e in es]
            assert sorted(got) == sorted(lacks)
        for (s, d), es in moves.items():
            assert s != d and es == sorted(es)
            assert all(e in old[s * per : (s + 1) * per] for e in es)
        assert sum(map(len, moves.values())) == _needs(old, new, ranks)


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


def test_expert_load_counts_only_request_rows(tiny_dir) -> None:
    """The MoE's load counts are the (token, expert) pairs of requests' rows: decode steps
    replayed from (emulated) graphs padded to their bucket route the padding rows too, but
    those are not load (3 requests run in the bucket of 4)."""
    from deepinfer_core.distributed.eplb.rebalance import step_counts
    from deepinfer_core.engine.graphs import EmulatedGraph

    llm = LLM(
        model=str(tiny_dir),
        enforce_eager=True,
        async_scheduling=False,
        enable_prefix_caching=False,
        max_num_seqs=8,
    )
    runner = llm.engine.runner
    assert runner.capture_graphs(EmulatedGraph) is None
    cfg = llm.engine.model_config
    counts = step_counts(runner.model, cfg.num_hidden_layers, cfg.n_routed_experts, runner.device)
    counts.zero_()
    replays: list[int] = []
    for b, graph in runner.graph_manager.graphs("decode").items():
        inner = graph.replay
        graph.replay = lambda inner=inner, b=b: replays.append(b) or inner()
    prompts = [[5, 9, 23, 7], [88, 12, 4, 6, 1], [17] * 6]
    new = 6
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=new, ignore_eos=True))
    assert replays and set(replays) == {4}  # every decode step padded one row
    rows = sum(len(p) + new - 1 for p in prompts)  # the last sampled token is never forwarded
    assert counts.sum(dim=1).tolist() == [rows * cfg.num_experts_per_tok] * cfg.num_hidden_layers


# ---- the weight move in a gloo world ---------------------------------------------------------
LAYERS, EXPERTS, D, INTER = 3, 8, 64, 16


def checkpoint_experts(seed: int = 0) -> list[list[Weight]]:
    """Per layer the full expert stacks of a stand-in checkpoint: an FP4 ``QuantizedTensor``
    (packed data, e8m0 scales), a bf16 stack and an fp32 per-expert vector."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        codes = torch.randint(0, 256, (EXPERTS, 2 * INTER, D // 2), generator=g, dtype=torch.uint8)
        scale = torch.randint(120, 130, (EXPERTS, 2 * INTER, D // 32), generator=g, dtype=torch.uint8)
        gate_up = QuantizedTensor(codes, scale.view(UE8M0_DTYPE), "fp4", (1, 32))
        down = torch.randn(EXPERTS, D, INTER, generator=g).to(torch.bfloat16)
        bias = torch.randn(EXPERTS, 4, generator=g)
        layers.append([gate_up, down, bias])
    return layers


def select_experts(
    layers: list[list[Weight]], phy2log: torch.Tensor, rank: int, per: int
) -> list[list[Weight]]:
    """The local stacks of ``rank`` under ``phy2log``, taken from the full stacks (the oracle)."""
    out = []
    for layer, ws in enumerate(layers):
        ids = phy2log[layer, rank * per : (rank + 1) * per]
        out.append(
            [
                QuantizedTensor(w.data[ids].clone(), w.scale[ids].clone(), w.fmt, w.block)
                if isinstance(w, QuantizedTensor)
                else w[ids].clone()
                for w in ws
            ]
        )
    return out


def _same(a: list[list[Weight]], b: list[list[Weight]]) -> bool:
    def parts(w: Weight) -> list[torch.Tensor]:
        return [w.data, w.scale.view(torch.uint8)] if isinstance(w, QuantizedTensor) else [w]

    return all(
        torch.equal(x, y)
        for wa, wb in zip(a, b, strict=True)
        for u, v in zip(wa, wb, strict=True)
        for x, y in zip(parts(u), parts(v), strict=True)
    )


def rank_counts(rank: int, step: int, phase: int) -> torch.Tensor:
    """The ``[L, E]`` tokens rank ``rank`` routes at ``step``: skewed to a few experts that
    differ per layer and per ``phase`` (so a second rebalancing moves weights again)."""
    g = torch.Generator().manual_seed(1000 * phase + 10 * rank + step)
    w = torch.randint(0, 5, (LAYERS, EXPERTS), generator=g)
    for layer in range(LAYERS):
        w[layer, (3 * layer + phase) % EXPERTS] += 60 + 10 * rank
        w[layer, (3 * layer + phase + 5) % EXPERTS] += 25
    return w


class StandInModel:
    """What the EPLB controller needs of a model: local expert stacks and a step counts buffer."""

    def __init__(self, experts: list[list[Weight]]):
        self.experts = experts
        self.expert_counts = torch.zeros(LAYERS, EXPERTS, dtype=torch.int64)

    def expert_weights(self) -> list[list[Weight]]:
        return self.experts


def _rebalance_worker(rank: int, world: int, init: str, policy: str, nodes: int | None, spread: bool) -> None:
    """One rank: two phases of skewed loads (one with ``spread``), each ending in a rebalancing;
    after each, the local stacks must be the checkpoint's experts of the new placement, in the
    same storage.  ``spread``: the move takes one layer a step, and after every step the stacks
    are those of the half-moved placement the MoE then routes by."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    if nodes is None:  # one rank sees a launch of one process a node: the ranks agree on the most nodes
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if rank == 1:
            os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        redundant = world
        per = (EXPERTS + redundant) // world
        full = checkpoint_experts()
        placement = ExpertPlacement.default(LAYERS, EXPERTS, world, redundant)
        model = StandInModel(select_experts(full, placement.phy2log, rank, per))
        storage = [[p.data_ptr() for w in ws for p in weight_parts(w)] for ws in model.experts]
        layout = ParallelState.layout(rank, world, 1, True)
        parallel = ParallelState(**layout, ep_group=dist.group.WORLD)
        cfg = EPLBConfig(
            window_steps=3,
            rebalance_interval=3,
            num_redundant_experts=redundant,
            policy=policy,
            num_nodes=nodes,
        )
        ctl = EplbController(cfg, placement, model, parallel, layers_per_step=1 if spread else None)
        assert ctl.num_nodes == (nodes or world)
        phases = (0,) if spread else (0, 1)
        for phase in phases:
            old = placement.phy2log.clone()
            for step in range(3):
                model.expert_counts += rank_counts(rank, step, phase)
                assert ctl.step() == (step == 2), f"rank {rank}: rebalanced at step {step}"
            assert ctl.moving == spread
            halfway = 0
            while ctl.moving:  # one more layer a step; the stacks always match the placement
                mixed = placement.phy2log
                halfway += not torch.equal(mixed, old)
                assert _same(model.experts, select_experts(full, mixed, rank, per)), f"rank {rank}"
                assert ctl.step()
            assert halfway == (2 if spread else 0)  # every layer changed: two steps half way
            total = sum(rank_counts(r, s, phase) for r in range(world) for s in range(3))
            new = placement.phy2log
            assert imbalance(total, new, world) < imbalance(total, old, world)
            assert ctl.last_ratio == pytest.approx(
                (imbalance(total, old, world), imbalance(total, new, world))
            )
            # the policy's per-GPU expert sets, on the GPUs where they move the fewest experts
            ref = rebalance_experts(total, EXPERTS + redundant, EXPERTS, nodes or 1, world, policy)[0]
            assert all(gpu_sets(new[i], per) == gpu_sets(ref[i], per) for i in range(LAYERS))
            assert _same(model.experts, select_experts(full, new, rank, per)), f"rank {rank} phase {phase}"
            assert [[p.data_ptr() for w in ws for p in weight_parts(w)] for ws in model.experts] == storage
            assert int(model.expert_counts.abs().sum()) == 0
            received = torch.tensor([ctl.last_received])
            dist.all_reduce(received)
            assert int(received) > 0  # weights did travel
        assert ctl.rebalances == len(phases)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "policy", "nodes", "spread"), [(2, "global", None, True), (4, "hierarchical", 2, False)]
)
def test_rebalance_moves_weights_between_ranks(
    world: int, policy: str, nodes: int | None, spread: bool, tmp_path
) -> None:
    """A gloo world on CPU: a skewed load triggers two rebalancings; every rank's expert stacks
    (FP4 data and e8m0 scales, bf16, fp32) equal the checkpoint's tensors of its new logical
    experts (oracle: selected from the full stacks directly)."""
    mp.spawn(
        _rebalance_worker,
        args=(world, f"file://{tmp_path}/store", policy, nodes, spread),
        nprocs=world,
        join=True,
    )


# ---- the real MoE blocks of the tiny model, before and after a rebalancing -----------------------
def _moe_worker(rank: int, world: int, init: str, ckpt: str, quantized: bool, batch_invariant: bool) -> None:
    """One rank of a DP+EP world: the tiny model's MoE blocks holding this rank's experts run
    their tokens over the EP group before and after a rebalancing (a synthetic hot expert per
    layer added to the real routed counts); the outputs equal the single-process blocks' (all
    experts; bitwise under batch invariance) and the local stacks the checkpoint's experts."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = DeepseekV4Config.from_file(f"{ckpt}/config.json")
        keep = ("fp4_experts",) if quantized else ()
        full = load_checkpoint(ckpt, cfg, torch.float32, "cpu", keep_quantized=keep)
        ops = resolve_backend("reference")[1]
        layers, experts, redundant = cfg.num_hidden_layers, cfg.n_routed_experts, 2 * world
        per = (experts + redundant) // world
        placement = ExpertPlacement.default(layers, experts, world, redundant)
        parallel = ParallelState(
            **ParallelState.layout(rank, world, 1, True),
            device_group=dist.group.WORLD,
            ep_group=dist.group.WORLD,
        )
        experts_of = {  # the checkpoint's stacks, per layer (the oracle)
            i: [full[f"model.layers.{i}.mlp.experts.{n}"] for n in ("gate_up_proj", "down_proj")]
            for i in range(layers)
        }
        local = select_experts(list(experts_of.values()), placement.phy2log, rank, per)
        assert isinstance(local[0][0], QuantizedTensor) == quantized
        w = dict(full)
        for i in range(layers):
            w[f"model.layers.{i}.mlp.experts.gate_up_proj"], w[f"model.layers.{i}.mlp.experts.down_proj"] = (
                local[i]
            )
        w[EXPERT_PLACEMENT_KEY] = placement
        blocks = [MoE(cfg, i, w, torch.float32, parallel=parallel) for i in range(layers)]
        single = [MoE(cfg, i, dict(full), torch.float32) for i in range(layers)]
        model = types.SimpleNamespace(layers=[types.SimpleNamespace(moe=b) for b in blocks])
        g = torch.Generator().manual_seed(rank)
        tokens = 5 + 3 * rank
        x = torch.randn(tokens, cfg.hidden_size, generator=g)
        ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
        cfg_eplb = EPLBConfig(window_steps=2, rebalance_interval=2, num_redundant_experts=redundant)
        ctl = EplbController(cfg_eplb, None, model, parallel)
        assert ctl.placement is placement and all(b.expert_load is ctl.counts for b in blocks)

        def run() -> list[torch.Tensor]:
            with batch_invariant_mode(batch_invariant):
                return [b(x, ids, ops) for b in blocks]

        with batch_invariant_mode(batch_invariant):
            want = [b(x, ids, ops) for b in single]
        for step in range(2):
            got = run()
            for i in range(layers):
                ctl.counts[i, (2 * i + 1) % experts] += 40  # a hot expert per layer
            assert ctl.step() == (step == 1)
        changed = got
        for a, b in zip(changed, want, strict=True):
            assert torch.equal(a, b) if batch_invariant else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(
            placement.phy2log, ExpertPlacement.default(layers, experts, world, redundant).phy2log
        )
        assert _same(
            local_expert_weights(model),
            select_experts(list(experts_of.values()), placement.phy2log, rank, per),
        )
        for a, b in zip(run(), want, strict=True):  # the new placement routes to the moved weights
            assert torch.equal(a, b) if batch_invariant else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        assert ctl.last_ratio is not None and ctl.last_ratio[1] < ctl.last_ratio[0]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("world", "quantized", "batch_invariant"), [(2, True, True), (2, False, False)])
def test_rebalanced_moe_outputs_equal_single_process(
    world: int, quantized: bool, batch_invariant: bool, tmp_path
) -> None:
    """The tiny model's MoE blocks under EP, with and without FP4 experts kept quantised."""
    ckpt = tiny.make_tiny(tmp_path / "tiny", fp4_experts=quantized)
    args = (world, f"file://{tmp_path}/store", str(ckpt), quantized, batch_invariant)
    mp.spawn(_moe_worker, args=args, nprocs=world, join=True)


# ---- the engine: DP + EP with EPLB against a single process ----------------------------------------
ENGINE_PROMPTS = [
    "hello world",
    "the quick brown fox jumps over",
    "a b c d e",
    "once upon a time there",
    "1 2 3",
]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "policy", "nodes"), [(2, "global", None), (4, "hierarchical", 2)])
def test_engine_eplb_outputs_equal_single_process(world: int, policy: str, nodes: int | None) -> None:
    """``LLM`` with DP + EP over ``world`` ranks and EPLB rebalancing every 2 steps (``world``
    redundant experts): greedy tokens and logprobs bitwise equal to a single process with
    ``batch_invariant=True``, while the rebalancings lower the window's max/mean GPU load and
    move weights; ``get_metrics()["eplb"]`` reports the controller's checks, the same on every
    rank."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    with LLM(backend="reference", batch_invariant=True) as llm:
        want = llm.generate(ENGINE_PROMPTS, params)
    eplb = {"rebalance_interval": 2, "window_steps": 2, "num_redundant_experts": world, "policy": policy}
    if nodes is not None:
        eplb["num_nodes"] = nodes
    with LLM(
        backend="reference",
        data_parallel_size=world,
        enable_expert_parallel=True,
        batch_invariant=True,
        eplb=eplb,
    ) as llm:
        got = llm.generate(ENGINE_PROMPTS, params)
        ctl = llm.engine.eplb
        assert ctl is not None and ctl.rebalances >= 2 and ctl.num_nodes == (nodes or 1)
        before, after = ctl.last_ratio
        assert after < before
        default = ExpertPlacement.default(ctl.placement.num_layers, ctl.placement.num_experts, world, world)
        assert not torch.equal(ctl.placement.phy2log, default.phy2log)
        metrics = llm.get_metrics()
    # get_metrics()["eplb"]: rank 0's controller figures; every rank reports the same loads
    m = metrics["eplb"]
    assert (m["steps"], m["rebalances"], m["rebalance_interval"]) == (ctl.steps, ctl.rebalances, 2)
    assert (m["last_imbalance_before"], m["last_imbalance_after"]) == (before, after)
    assert m["checks"] and all(c["step"] % 2 == 0 for c in m["checks"])
    assert sum(c["rebalanced"] for c in m["checks"]) == ctl.rebalances
    assert all(c["rebalanced"] == (c["imbalance_after"] < c["imbalance_before"]) for c in m["checks"])
    ranks = [r["eplb"] for r in metrics["per_rank"]]
    assert len(ranks) == world and all(r["checks"] == m["checks"] for r in ranks)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.slow
def test_engine_eplb_layers_per_step_outputs_equal_single_process() -> None:
    """``eplb.layers_per_step=1`` reaches the controller: each rebalancing's move is spread over
    the following steps (one layer a step), and the greedy tokens and logprobs stay bitwise a
    single process's (``batch_invariant=True``)."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    with LLM(backend="reference", batch_invariant=True) as llm:
        want = llm.generate(ENGINE_PROMPTS, params)
    eplb = {"rebalance_interval": 2, "window_steps": 2, "num_redundant_experts": 2, "layers_per_step": 1}
    with LLM(
        backend="reference",
        data_parallel_size=2,
        enable_expert_parallel=True,
        batch_invariant=True,
        eplb=eplb,
    ) as llm:
        ctl = llm.engine.eplb
        assert ctl is not None and ctl.layers_per_step == 1
        moving: list[bool] = []
        step = ctl.step

        def recording_step() -> bool:
            changed = step()
            moving.append(ctl.moving)
            return changed

        ctl.step = recording_step  # type: ignore[method-assign]
        got = llm.generate(ENGINE_PROMPTS, params)
        assert ctl.rebalances >= 1 and any(moving), (ctl.rebalances, moving)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_infer_num_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert infer_num_nodes(8) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert infer_num_nodes(8) == 2 and infer_num_nodes(6) == 1  # 6 ranks do not make whole nodes of 4
