"""Expert parallelism against the single-process computation: the placement, the
``moe_dispatch`` / ``moe_combine`` ops over gloo (world 2 and 4, one spawned process a rank)
against ``moe_experts`` on all experts in one process (bitwise under batch-invariant mode,
within 1e-5 otherwise; FP8 dispatch bitwise against the single process on the FP8-rounded
rows), the MoE block on per-rank loaded tiny weights, and the per-rank loader (reads only
its experts, weight memory shrinks)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.contract.placement import EXPERT_PLACEMENT_KEY, ExpertPlacement
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.deepseek_v4 import tiny
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.family import FAMILY
from deepinfer_core.models.deepseek_v4.moe import MoE
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.expert_parallel import FP8_DISPATCH_BLOCK, moe_combine, moe_dispatch
from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.ops.moe import moe_experts, moe_route
from deepinfer_core.weights.quant import QuantizedTensor, dequant_fp8, quant_fp4, quant_fp8
from deepinfer_core.weights.safetensors_io import TensorSource

E, D, I, K, LIMIT = 8, 64, 32, 2, 10.0


# ---- placement ----------------------------------------------------------------------------------
def test_default_placement_layout() -> None:
    p = ExpertPlacement.default(num_layers=3, num_experts=8, ep_size=4, num_redundant=4)
    assert (p.num_slots, p.slots_per_rank, p.num_redundant) == (12, 3, 4)
    assert p.phy2log[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert p.local_logical(2, 1) == [3, 4, 5]
    assert p.logcnt[0].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    assert p.log2phy.shape == (3, 8, 5)  # padded to num_redundant + 1 replicas
    assert p.log2phy[0, 0, :3].tolist() == [0, 8, -1] and p.log2phy[0, 7, :2].tolist() == [7, -1]


def test_placement_roundtrip_and_replica_choice() -> None:
    g = torch.Generator().manual_seed(0)
    rows = [
        torch.cat([torch.randperm(8, generator=g), torch.randint(0, 8, (4,), generator=g)]) for _ in range(2)
    ]
    phy2log = torch.stack([r[torch.randperm(12, generator=g)] for r in rows])
    p = ExpertPlacement(phy2log, num_experts=8, ep_size=2)
    for layer in range(2):
        for e in range(8):
            slots = p.log2phy[layer, e, : p.logcnt[layer, e]]
            assert (phy2log[layer, slots] == e).all() and slots.tolist() == sorted(slots.tolist())
            assert (p.log2phy[layer, e, p.logcnt[layer, e] :] == -1).all()
    ids = torch.randint(0, 8, (50, 2), generator=g)
    phys = p.physical(1, ids, salt=3)
    assert torch.equal(p.phy2log[1][phys], ids)  # every pair lands on a slot of its expert
    for t in range(50):
        for j in range(2):
            e = int(ids[t, j])
            assert int(phys[t, j]) == int(p.log2phy[1, e, (t + 3) % int(p.logcnt[1, e])])
    assert torch.equal(p.physical(1, ids, salt=3), phys)  # deterministic


def test_placement_update_in_place() -> None:
    p = ExpertPlacement.default(1, 4, 2, num_redundant=2)
    ids = torch.tensor([[0, 1], [2, 3]])
    before = p.physical(0, ids)
    cached = p._on(ids.device)[0]
    p.update(torch.tensor([[3, 2, 1, 0, 3, 3]]))
    assert p.local_logical(0, 1) == [0, 3, 3] and p._on(ids.device)[0] is cached
    assert not torch.equal(p.physical(0, ids), before)
    assert torch.equal(p.phy2log[0][p.physical(0, ids)], ids)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ExpertPlacement(torch.tensor([[0, 1, 2, 3], [0, 1, 2, 9]]), 4, 2), r"phy2log\[1, 3\] = 9"),
        (lambda: ExpertPlacement(torch.tensor([[0, 1, 2, 2]]), 4, 2), "layer 0 has no slot for expert 3"),
        (lambda: ExpertPlacement(torch.tensor([[0, 1, 2, 3, 0]]), 4, 2), "multiple of ep_size"),
        (lambda: ExpertPlacement(torch.zeros(4), 4, 2), "integer tensor"),
        (lambda: ExpertPlacement.default(2, 8, 3), r"num_redundant \(8 \+ 0\) must be a multiple"),
        (lambda: ExpertPlacement.default(2, 8, 2).local_logical(2, 0), "layer 2 outside"),
        (lambda: ExpertPlacement.default(2, 8, 2).local_logical(0, 2), "rank 2 outside"),
        (lambda: ExpertPlacement.default(1, 4, 2).update(torch.tensor([[0, 1, 2, 3, 0, 1]])), "shape"),
    ],
)
def test_placement_errors(build: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


# ---- ops in one process ---------------------------------------------------------------------------
def _assert_grouped(recv_ids: torch.Tensor, what: str = "") -> int:
    """The received rows' layout: the real pairs first, grouped by ascending local expert, then
    the padding rows (id -1); returns the number of real rows."""
    n = int((recv_ids >= 0).sum())
    assert (recv_ids[:n].diff() >= 0).all() and (recv_ids[:n] >= 0).all(), what
    assert (recv_ids[n:] == -1).all(), what
    return n


def test_dispatch_combine_single_process_bitwise() -> None:
    """Without a group every slot is local: dispatch groups the pairs by expert (stable),
    combine restores them; the experts then match ``moe_experts`` bit for bit in the mode."""
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(37, D, generator=g), torch.randn(37, E, generator=g)
    w, ids = moe_route(logits, None, None, K, "sqrtsoftplus", 1.5)
    gu, dn = torch.randn(E, 2 * I, D, generator=g) * 0.3, torch.randn(E, D, I, generator=g) * 0.3
    for capacity in (None, 80):
        with batch_invariant_mode():
            rx, rid, rw, h = moe_dispatch(x, ids, w, E, None, capacity=capacity)
            n = _assert_grouped(rid)
            assert n == ids.numel() and rid.shape[0] == (capacity or n)
            y = moe_experts(rx, rid[:, None], rw[:, None], gu, dn, LIMIT)
            assert not y[n:].any()  # no expert's output on the padding rows
            out = moe_combine(y, h, ids)
            assert torch.equal(out, moe_experts(x, ids, w, gu, dn, LIMIT))
    with pytest.raises(ValueError, match="moe_dispatch: slots"):
        moe_dispatch(x, ids[:5], w, E, None)
    with pytest.raises(ValueError, match="moe_combine: ids"):
        moe_combine(rx, h, ids[:5])
    with pytest.raises(ValueError, match=r"capacity \(73\) must be >= the 74 \(token, expert\) pairs"):
        moe_dispatch(x, ids, w, E, None, capacity=73)


# ---- ops over gloo -------------------------------------------------------------------------------
def _entry(rank: int, world: int, store: str, fn: Callable[..., None], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _spawn(fn: Callable[..., None], world: int, *args: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world, join=True)


def _problem(world: int, skew: bool, dtype: torch.dtype) -> dict[str, Any]:
    """Every rank's tokens and routing (rank 1 has none; uneven counts) and the full experts."""
    g = torch.Generator().manual_seed(7)
    tokens = [37, 0, 70, 5][:world]
    bias = torch.zeros(E)
    if skew:
        bias[:2] = 4.0  # most pairs go to experts 0 and 1 (rank 0's)
    prob: dict[str, Any] = {"x": [], "ids": [], "w": []}
    for t in tokens:
        prob["x"].append(torch.randn(t, D, generator=g).to(dtype))
        w, ids = moe_route(torch.randn(t, E, generator=g) + bias, None, None, K, "sqrtsoftplus", 1.5)
        prob["w"].append(w)
        prob["ids"].append(ids)
    prob["gu"] = (torch.randn(E, 2 * I, D, generator=g) * 0.3).to(dtype)
    prob["dn"] = (torch.randn(E, D, I, generator=g) * 0.3).to(dtype)
    return prob


def _placements(world: int) -> list[ExpertPlacement]:
    g = torch.Generator().manual_seed(3)
    row = torch.cat([torch.randperm(E, generator=g), torch.zeros(world, dtype=torch.int64)])  # expert 0 hot
    return [
        ExpertPlacement.default(1, E, world),
        ExpertPlacement(row[torch.randperm(E + world, generator=g)][None], E, world),
    ]


def _local(w: torch.Tensor | QuantizedTensor, experts: list[int]) -> torch.Tensor | QuantizedTensor:
    idx = torch.tensor(experts)
    return w.index_select(idx) if isinstance(w, QuantizedTensor) else w.index_select(0, idx)


def _ops_worker(rank: int, world: int) -> None:
    group = dist.group.WORLD
    for dtype, bi, skew, fp8, quant in [
        (torch.float32, True, False, False, False),
        (torch.float32, True, True, False, False),
        (torch.bfloat16, True, True, False, False),
        (torch.float32, False, True, False, False),
        (torch.float32, True, False, True, False),
        (torch.float32, True, True, False, True),
    ]:
        prob = _problem(world, skew, dtype)
        x, ids, w = prob["x"][rank], prob["ids"][rank], prob["w"][rank]
        gu, dn = prob["gu"], prob["dn"]
        if quant:  # FP4 experts (keep_quantized)
            gu, dn = (QuantizedTensor(*quant_fp4(t, 32), "fp4", (1, 32)) for t in (gu, dn))
        x_ref = dequant_fp8(*quant_fp8(x, FP8_DISPATCH_BLOCK), FP8_DISPATCH_BLOCK, dtype) if fp8 else x
        for placement in _placements(world):
            local = placement.local_logical(0, rank)
            gu_l, dn_l = _local(gu, local), _local(dn, local)
            slots = placement.physical(0, ids, salt=rank)
            cap = max(len(t) for t in prob["x"]) * K
            for capacity in (None, cap):
                what = f"rank {rank}/{world} {dtype} bi={bi} skew={skew} fp8={fp8} fp4={quant} cap={capacity}"
                with batch_invariant_mode(bi):
                    ref = moe_experts(x_ref, ids, w, gu, dn, LIMIT)
                    rx, rid, rw, h = moe_dispatch(
                        x, slots, w, placement.slots_per_rank, group, fp8=fp8, capacity=capacity
                    )
                    n = _assert_grouped(rid, what)
                    y = moe_experts(rx, rid[:, None], rw[:, None], gu_l, dn_l, LIMIT)
                    assert not y[n:].any(), what  # no expert's output on the padding rows
                    out = moe_combine(y, h, ids)
                if capacity is None:  # every pair sent to this rank arrived, none else
                    sent = [placement.physical(0, prob["ids"][r], salt=r) for r in range(world)]
                    mine = sum(int((s // placement.slots_per_rank == rank).sum()) for s in sent)
                    assert rx.shape[0] == mine, what
                if bi:
                    assert torch.equal(out, ref), what
                else:
                    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=what)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dispatch_combine_over_gloo(world: int) -> None:
    _spawn(_ops_worker, world)


# ---- the MoE block on per-rank loaded weights ------------------------------------------------------
def _parallel(rank: int, world: int, group: Any = None) -> ParallelState:
    return ParallelState(
        rank=rank, world_size=world, dp_rank=rank, dp_size=world, ep_rank=rank, ep_size=world,
        device_group=group, ep_group=group,
    )  # fmt: skip


def _moe_worker(rank: int, world: int, model_dir: str) -> None:
    cfg = DeepseekV4Config.from_file(model_dir)
    parallel = _parallel(rank, world, dist.group.WORLD)
    full = FAMILY.load_weights(Path(model_dir), cfg, torch.float32, torch.device("cpu"), ())
    mine = FAMILY.load_weights(
        Path(model_dir), cfg, torch.float32, torch.device("cpu"), (), parallel=parallel
    )
    ops = OpTable.reference()
    g = torch.Generator().manual_seed(11 + rank)
    t = [9, 0, 30, 3][rank]
    x, input_ids = (
        torch.randn(t, cfg.hidden_size, generator=g),
        torch.randint(0, cfg.vocab_size, (t,), generator=g),
    )
    load = torch.zeros(cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.int64)
    for layer in range(cfg.num_hidden_layers):
        ref_block = MoE(cfg, layer, dict(full), torch.float32)
        ep_block = MoE(cfg, layer, dict(mine), torch.float32, parallel=parallel)
        assert ep_block.gate_up.shape[0] == cfg.n_routed_experts // world
        ep_block.expert_load = load
        with batch_invariant_mode():
            ref, out = ref_block(x, input_ids, ops), ep_block(x, input_ids, ops)
        assert torch.equal(out, ref), f"rank {rank} layer {layer}"
    assert int(load.sum()) == t * cfg.num_experts_per_tok * cfg.num_hidden_layers


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_moe_block_expert_parallel_matches_single_process(tiny_dir: Path, world: int) -> None:
    _spawn(_moe_worker, world, str(tiny_dir))


# ---- per-rank loading ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def native_fp4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.make_tiny(tmp_path_factory.mktemp("tiny_native_fp4"), names="native", fp4_experts=True)


@pytest.mark.parametrize("scheme", ["hf", "native_fp4"])
def test_loader_reads_only_local_experts(
    tiny_dir: Path, native_fp4_dir: Path, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_dir if scheme == "hf" else native_fp4_dir
    keep = ("fp4_experts",) if scheme == "native_fp4" else ()
    cfg = DeepseekV4Config.from_file(model_dir)
    dev = torch.device("cpu")
    full = FAMILY.load_weights(model_dir, cfg, torch.float32, dev, keep)
    reads: list[tuple[str, list[int] | None]] = []
    get, get_rows = TensorSource.get, TensorSource.get_rows
    monkeypatch.setattr(TensorSource, "get", lambda self, n: reads.append((n, None)) or get(self, n))
    monkeypatch.setattr(
        TensorSource,
        "get_rows",
        lambda self, n, rows: reads.append((n, list(rows))) or get_rows(self, n, rows),
    )
    placement = _placements(2)[1]
    placement = ExpertPlacement(placement.phy2log.expand(cfg.num_hidden_layers, -1), E, 2)
    sizes = []
    for rank in range(2):
        reads.clear()
        parallel = _parallel(rank, 2)
        w = FAMILY.load_weights(
            model_dir, cfg, torch.float32, dev, keep, parallel=parallel, placement=placement
        )
        assert w[EXPERT_PLACEMENT_KEY] is placement
        assert set(w) - {EXPERT_PLACEMENT_KEY} == set(full)
        for layer in range(cfg.num_hidden_layers):
            local = placement.local_logical(layer, rank)
            for part in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{part}"
                got, want = w[name], _local(full[name], local)
                if isinstance(want, QuantizedTensor):
                    assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
                else:
                    assert torch.equal(got, want)
            # what was read of this layer's experts: exactly the local ones
            expert_reads = [(n, r) for n, r in reads if f"layers.{layer}." in n and ".experts." in n]
            if scheme == "hf":
                assert expert_reads and all(r == local for _, r in expert_reads), expert_reads
            else:
                read_experts = {int(n.split(".experts.")[1].split(".")[0]) for n, _ in expert_reads}
                assert read_experts == set(local), (layer, read_experts, local)
        for name in full:
            if ".experts." not in name:
                ref, got = full[name], w[name]
                assert ref.shape == got.shape and (
                    torch.equal(ref, got)
                    if isinstance(ref, torch.Tensor)
                    else torch.equal(ref.data, got.data)
                )
        model = FAMILY.build_model(cfg, w, OpTable.reference(), parallel=parallel)
        sizes.append(model.weight_bytes())
    full_model = FAMILY.build_model(cfg, full, OpTable.reference())
    expert_bytes = sum(
        (t.data.nbytes + t.scale.nbytes) if isinstance(t, QuantizedTensor) else t.nbytes
        for n, t in full_model.w.items()
        if ".experts." in n and isinstance(t, torch.Tensor | QuantizedTensor)
    )
    slots = placement.slots_per_rank
    for size in sizes:  # 6 of the 8 experts' slots held per rank (8 + 4 replicas over 2 ranks)
        assert full_model.weight_bytes() - size == expert_bytes * (E - slots) // E


def test_loader_placement_mismatch_and_v41_refusal(tiny_dir: Path) -> None:
    cfg = DeepseekV4Config.from_file(tiny_dir)
    with pytest.raises(ConfigError, match="does not fit the model"):
        FAMILY.load_weights(
            tiny_dir, cfg, torch.float32, torch.device("cpu"), (), parallel=_parallel(0, 2),
            placement=ExpertPlacement.default(1, E, 2),
        )  # fmt: skip
    from deepinfer_core.models.deepseek_v41.family import load_weights as load_v41

    with pytest.raises(ConfigError, match="enable_expert_parallel is not implemented"):
        load_v41(tiny_dir, None, torch.float32, torch.device("cpu"), (), parallel=_parallel(0, 2))  # type: ignore[arg-type]
