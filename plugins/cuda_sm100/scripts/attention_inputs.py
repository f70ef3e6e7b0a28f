"""The inputs of ``bench_attention.py``: DeepSeek-V4-Flash attention and indexer calls on the
GPU (decode batches, prefill chunks, packed FP8 pools), with the bytes and FLOPs of their
rooflines, and the roofline itself (the running GPU's HBM bandwidth, the bf16 matrix rate)."""

from __future__ import annotations

import torch

from deepinfer_core.distributed.gpu_specs import device_hbm_bandwidth
from deepinfer_core.ops.attention import PagedIndex

HEADS, HEAD_DIM, WINDOW, TOPK = 64, 512, 128, 512
CSA_RATIO, HCA_RATIO, PAGE = 4, 128, 256
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 64, 128, 512
PEAK_FLOPS = 790e12
"""FLOP/s of the rooflines: the H200's dense bf16 matrix product, measured (the H100 SXM has the
same SMs and clocks)."""


def roofline_ms(bytes_: float, flops: float, peak_bytes: float) -> float:
    """The roofline of a call in ms: its bytes at ``peak_bytes`` B/s or its FLOPs at
    :data:`PEAK_FLOPS`, whichever takes longer."""
    return 1e3 * max(bytes_ / peak_bytes, flops / PEAK_FLOPS)


def device_peak_bytes() -> tuple[float, str]:
    """The running GPU's HBM bytes/s (its cost-model preset; the H200's, said so, for another
    GPU) and the GPU kind it is for."""
    bandwidth, kind, known = device_hbm_bandwidth(torch.cuda.get_device_name())
    if not known:
        print(f"roofline: {kind}: no preset for this GPU; the H200's HBM bandwidth is used")
    return bandwidth, kind


def decode_inputs(batch: int, context: int, layer: str, dtype: torch.dtype, g: torch.Generator) -> dict:
    """One decode query per request at position ``context - 1`` (see the module docstring)."""
    dev = "cuda"
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g, device=dev).to(dtype)
    ring = torch.randn(batch * WINDOW, HEAD_DIM, generator=g, device=dev).to(dtype)
    kv = torch.randn(batch, HEAD_DIM, generator=g, device=dev).to(dtype)
    slots = torch.arange(batch, device=dev)
    ring_idx = slots[:, None] * WINDOW + torch.arange(WINDOW, device=dev)[None, :]
    ring_idx[:, -1] = -1  # the newest key is this step's row
    chunk_idx = torch.full((batch, WINDOW), -1, dtype=torch.int64, device=dev)
    chunk_idx[:, -1] = torch.arange(batch, device=dev)
    sinks = torch.randn(HEADS, generator=g, device=dev)
    if layer == "swa":
        return _window_only(q, ring, kv, ring_idx, chunk_idx, sinks, batch * WINDOW)
    ratio = CSA_RATIO if layer == "csa" else HCA_RATIO
    entries = context // ratio
    epp = PAGE // ratio
    pages = -(-entries // epp)
    table = torch.randperm(batch * pages, generator=g, device=dev).view(batch, pages)
    ckv = torch.randn(batch * pages * epp, HEAD_DIM, generator=g, device=dev).to(dtype)
    if layer == "csa":
        picks = torch.rand(batch, entries, generator=g, device=dev).argsort(dim=1)[:, :TOPK]
        e = picks
        third = table.gather(1, e // epp) * epp + e % epp
        keys = WINDOW + min(TOPK, entries)
        index_bytes = 8 * batch * (2 * WINDOW + TOPK)
    else:
        third = PagedIndex(table, slots, torch.full((batch,), entries, device=dev), epp, entries)
        keys = WINDOW + entries
        index_bytes = 8 * batch * (2 * WINDOW + pages)
    elem = torch.finfo(dtype).bits // 8
    bytes_ = batch * keys * HEAD_DIM * elem + 2 * batch * HEADS * HEAD_DIM * elem + index_bytes
    flops = 4 * batch * HEADS * HEAD_DIM * keys
    args = (q, [ring, kv, ckv], [ring_idx, chunk_idx, third], sinks, HEAD_DIM**-0.5)
    return {"args": args, "bytes": bytes_, "flops": flops, "keys": keys}


def _window_only(q, ring, kv, ring_idx, chunk_idx, sinks, rows_read: int) -> dict:
    """A sliding-window layer's call (``layer="swa"``): the ring and this step's rows only,
    ``WINDOW`` keys a query; ``rows_read`` key rows read."""
    t, elem = q.shape[0], q.element_size()
    bytes_ = rows_read * HEAD_DIM * elem + 2 * t * HEADS * HEAD_DIM * elem + 16 * t * WINDOW
    flops = 4 * t * HEADS * HEAD_DIM * WINDOW
    args = (q, [ring, kv], [ring_idx, chunk_idx], sinks, HEAD_DIM**-0.5)
    return {"args": args, "bytes": bytes_, "flops": flops, "keys": WINDOW}


def packed_inputs(inp: dict) -> dict:
    """``inp`` with every pool packed as FP8 rows (``kv_cache_dtype="fp8"``: 64 rope channels in
    bfloat16), the bytes read counted from the packed rows."""
    from deepinfer_core.ops.kv_format import Fp8KVPool

    q, pools, idx, sinks, scale = inp["args"]
    packed = [Fp8KVPool.from_values(p, 64) for p in pools]
    row_bytes, plain_bytes = packed[0].row_bytes, HEAD_DIM * q.element_size()
    key_bytes = q.shape[0] * inp["keys"] * plain_bytes
    bytes_ = inp["bytes"] - key_bytes + key_bytes * row_bytes // plain_bytes
    return {**inp, "args": (q, packed, idx, sinks, scale), "bytes": bytes_}


def prefill_inputs(t: int, context: int, layer: str, dtype: torch.dtype, g: torch.Generator) -> dict:
    """A prefill chunk: ``t`` queries of one request at positions ``context - t .. context - 1``;
    each query's window split between the ring (older keys) and the chunk's rows, then its
    top-512 visible compressed entries (CSA) or every visible one through a paged index (HCA)."""
    dev = "cuda"
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g, device=dev).to(dtype)
    ring = torch.randn(WINDOW, HEAD_DIM, generator=g, device=dev).to(dtype)
    kv = torch.randn(t, HEAD_DIM, generator=g, device=dev).to(dtype)
    pos = torch.arange(context - t, context, device=dev)
    kpos = pos[:, None] + torch.arange(1 - WINDOW, 1, device=dev)[None, :]
    start = context - t
    ring_idx = torch.where((kpos >= 0) & (kpos < start), kpos % WINDOW, -1)
    chunk_idx = torch.where(kpos >= start, kpos - start, -1)
    sinks = torch.randn(HEADS, generator=g, device=dev)
    if layer == "swa":
        return _window_only(q, ring, kv, ring_idx, chunk_idx, sinks, WINDOW + t)
    ratio = CSA_RATIO if layer == "csa" else HCA_RATIO
    entries, epp = context // ratio, PAGE // ratio
    table = torch.randperm(-(-entries // epp), generator=g, device=dev).view(1, -1)
    ckv = torch.randn(table.numel() * epp, HEAD_DIM, generator=g, device=dev).to(dtype)
    visible = (pos + 1) // ratio
    if layer == "csa":
        ranks = torch.rand(t, entries, generator=g, device=dev).masked_fill(
            torch.arange(entries, device=dev)[None, :] >= visible[:, None], 2.0
        )
        e = ranks.argsort(dim=1)[:, :TOPK]
        third = torch.where(e < visible[:, None], table[0, e // epp] * epp + e % epp, -1)
        keys = WINDOW + min(TOPK, entries)
    else:
        third = PagedIndex(table, torch.zeros(t, dtype=torch.long, device=dev), visible, epp, entries)
        keys = WINDOW + entries
    elem = torch.finfo(dtype).bits // 8
    bytes_ = (WINDOW + t + table.numel() * epp) * HEAD_DIM * elem + 2 * t * HEADS * HEAD_DIM * elem
    flops = 4 * t * HEADS * HEAD_DIM * keys
    args = (q, [ring, kv, ckv], [ring_idx, chunk_idx, third], sinks, HEAD_DIM**-0.5)
    return {"args": args, "bytes": bytes_, "flops": flops, "keys": keys}


def indexer_inputs(
    t: int, c: int, dtype: torch.dtype, g: torch.Generator, causal: bool = False, device: str = "cuda"
) -> dict:
    """Decode (``t <= 1024``: each query its own paged entries) or prefill (one request).
    ``causal`` (prefill only): the ``t`` tokens end a context of ``c`` entries (``c x 4``
    positions), each seeing the entries its position closes (``(position + 1) // 4``) instead
    of all ``c``; the FLOPs count the entries seen.  ``g``: a generator on ``device``."""
    dev = device
    q = torch.randn(t, INDEX_HEADS, INDEX_DIM, generator=g, device=dev).to(dtype)
    w = torch.randn(t, INDEX_HEADS, generator=g, device=dev) * INDEX_HEADS**-0.5
    epp = PAGE // CSA_RATIO
    pages = -(-c // epp)
    requests = t if t <= 1024 else 1
    table = torch.randperm(requests * pages, generator=g, device=dev).view(requests, pages)
    keys = torch.randn(requests * pages * epp, INDEX_DIM, generator=g, device=dev).to(dtype)
    rows = torch.arange(t, device=dev) % requests
    counts = torch.full((t,), c, device=dev)
    if causal and requests == 1:
        positions = c * CSA_RATIO - t + torch.arange(t, device=dev)
        counts = ((positions + 1) // CSA_RATIO).clamp(0, c)
    cand = PagedIndex(table, rows, counts, epp, c)
    elem = torch.finfo(dtype).bits // 8
    distinct_keys = requests * c * INDEX_DIM * elem
    bytes_ = distinct_keys + t * INDEX_HEADS * (INDEX_DIM * elem + 4) + t * INDEX_TOPK * 8
    flops = 2 * int(counts.sum()) * INDEX_HEADS * INDEX_DIM
    return {"args": (q, w, keys, cand, INDEX_TOPK, INDEX_DIM**-0.5), "bytes": bytes_, "flops": flops}
