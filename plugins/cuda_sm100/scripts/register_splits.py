"""``bench_moe.py``'s register-split runs: the one-warpgroup TileLang MoE kernels at a tile
height with the compiler's register allotment or with the split of a given number of CTAs an SM
(``tl.moe.split_for``), each timed and checked bit for bit against the default split."""

from __future__ import annotations

import torch
from graph_timing import time_graph


def register_splits(compiler: str, ctas_per_sm: str) -> list[tuple[int, bool | tuple]]:
    """``(height, split)`` of ``--compiler-registers 16,32`` (``False``: the compiler's
    allotment) and ``--ctas-per-sm 16=3`` (``tl.moe.split_for(3)`` at height 16)."""
    from deepinfer_cuda_sm100.tl.moe import split_for

    out: list[tuple[int, bool | tuple]] = [(int(v), False) for v in compiler.split(",") if v]
    for item in filter(None, ctas_per_sm.split(",")):
        height, ctas = item.split("=")
        out.append((int(height), split_for(int(ctas))))
    return out


def time_register_split(tilelang_moe, x, routes, gate_up, down, limit, bm: int, split, args) -> dict:
    """The one-warpgroup TileLang kernels at tile height ``bm`` with the register split
    ``split`` (``False``: the compiler's allotment; a tuple: ``tl.moe.split_for``'s): µs a call
    and whether the output equals the default's."""
    kw = dict(consumers=1, block_m=bm, split_registers=split)
    got = tilelang_moe(x, *routes[0], gate_up, down, limit, **kw)
    want = tilelang_moe(x, *routes[0], gate_up, down, limit, consumers=1, block_m=bm)
    us = time_graph(
        lambda j: tilelang_moe(x, *routes[j], gate_up, down, limit, **kw),
        args.calls_per_graph,
        args.replays,
    )
    return {"T": x.shape[0], "consumers": 1, "block_m": bm, "split_registers": split, "us": us,
            "bitwise": bool(torch.equal(got, want))}  # fmt: skip
