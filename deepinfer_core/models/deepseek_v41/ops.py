"""DeepSeek-V4.1's own ops: extension ops of the contract, namespaced ``deepseek_v41.*``.

V4.1 reuses the core ops wherever its math is V4's (sparse attention, the indexer's top-k,
compressor pooling, rope, norms, MoE, ``hc_post``).  What V4 has no op for is here, each
defined by its pure-PyTorch reference (the docstring is the contract) with conformance cases,
as :func:`~deepinfer_core.ops.registry.define_op` asks of plugin ops:

- ``hc_mix``: single-pass mHC.  One projection of the streams gives a site's ``pre``,
  ``post`` and ``comb``; the site collapses its streams with the *previous* site's ``pre``.
- ``hc_collapse``: the final collapse with the last site's ``pre`` (V4.1 has no ``hc_head``).
- ``candidate_blocks``: level one of the hierarchical two-level top-k.
- ``kv_qdq``: the KV numerics of the release (FP8 window records, FP4 compressed entries and
  indexer keys / queries) as quantise-dequantise: what a plain cache (``kv_cache_dtype="auto"``)
  stores, and bit for bit what the packed pools of ``kv_cache_dtype="fp8"``
  (:mod:`deepinfer_core.ops.kv_blockscaled`) dequantise to.

The ops join the contract when this module is imported (the family module imports it, so an
:class:`~deepinfer_core.ops.OpTable` built after the family was resolved has them); the model
falls back to these references for a table built before (:func:`op`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

from deepinfer_core.ops import OpTable
from deepinfer_core.ops._cases import randn
from deepinfer_core.ops.attention import PagedIndex, _paged_case, gather_rows
from deepinfer_core.ops.kv_blockscaled import (
    BLOCK_FORMATS,
    FP4_MAX,
    BlockScaledKVPool,
    block_scales,
    e2m1_codes,
    e2m1_values,
)
from deepinfer_core.ops.kv_format import FP8_MAX, KVPool
from deepinfer_core.ops.modes import (
    KEY_BLOCK,
    batch_invariant_enabled,
    pad_cols,
    padded_len,
    row_padded,
    tiled_linear,
)
from deepinfer_core.ops.registry import define_op, get_op
from deepinfer_core.weights.quant import QuantizedTensor, quant_fp8

NAMESPACE = "deepseek_v41"


def op(ops: OpTable, name: str) -> Callable[..., Any]:
    """The resolved ``deepseek_v41.<name>`` of ``ops`` (its reference when ``ops`` predates this
    module's import)."""
    full = f"{NAMESPACE}.{name}"
    try:
        return ops[full]
    except KeyError:
        return get_op(full).reference


# ---- single-pass mHC ---------------------------------------------------------------------------
def _hc_mix_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    n, d = 4, 16
    prev = torch.rand(5, n, generator=g) + 1e-6
    onehot = torch.zeros(3, n)
    onehot[:, 0] = 1.0
    return [
        (
            (
                randn(g, 5, n, d, dtype=dtype),
                prev,
                randn(g, (2 + n) * n, n * d, scale=0.1),
                randn(g, (2 + n) * n),
                1 + randn(g, 3, scale=0.1),
                1e-6,
                1e-6,
                20,
            ),
            {},
        ),
        (
            (
                randn(g, 3, n, d, dtype=dtype),
                onehot,
                randn(g, (2 + n) * n, n * d, scale=0.1),
                randn(g, (2 + n) * n),
                1 + randn(g, 3, scale=0.1),
                1e-20,
                1e-6,
                3,
            ),
            {},
        ),
    ]


@define_op(f"{NAMESPACE}.hc_mix", "mhc", batch_invariant=True, sample_cases=_hc_mix_cases)
@row_padded({"streams": 0.0, "prev_pre": 0.0})
def hc_mix(
    streams: torch.Tensor,
    prev_pre: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-pass mHC at one site (attention or MoE) of a V4.1 block.

    Args:
        streams: ``[T, N, D]`` residual streams (model dtype).
        prev_pre: ``[T, N]`` float32 ``pre`` weights of the previous site (a one-hot on stream 0
            before the first block).
        fn: ``[(2+N)*N, N*D]`` float32 projection; base: ``[(2+N)*N]``; scale: ``[3]``.
        norm_eps: eps of the unweighted RMS norm over the flattened ``N*D`` streams.
        hc_eps: floor added to ``pre`` / ``comb`` and to the Sinkhorn denominators.
        sinkhorn_iters: Sinkhorn-Knopp iterations (the first normalises columns only).

    Returns:
        ``(pre [T, N], post [T, N], comb [T, N, N], collapsed [T, D])``, the weights float32:
        with ``m = rmsnorm(flatten(streams)) @ fn.T`` (fp32), ``pre = sigmoid(m[:N]*scale[0] +
        base[:N]) + hc_eps`` (for the *next* site), ``post = 2*sigmoid(m[N:2N]*scale[1] +
        base[N:2N])``, ``comb`` = Sinkhorn(softmax over ``k`` of ``m[2N:]*scale[2] + base[2N:]``
        viewed ``[j, k]``, plus ``hc_eps``): columns (``x / (sum_j x + eps)``), then
        ``sinkhorn_iters - 1`` rounds of rows then columns; ``collapsed = sum_n prev_pre[n] *
        streams[n]`` (fp32, cast to ``streams.dtype``): this site's block input.
    """
    t, n, d = streams.shape
    flat = F.rms_norm(streams.reshape(t, n * d).float(), (n * d,), None, norm_eps)
    linear = tiled_linear if batch_invariant_enabled() else F.linear
    mixes = linear(flat, fn.float())
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).view(t, n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb, hc_collapse(streams, prev_pre)


def _collapse_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    return [((randn(g, 5, 4, 16, dtype=dtype), torch.rand(5, 4, generator=g)), {})]


@define_op(f"{NAMESPACE}.hc_collapse", "mhc", batch_invariant=True, sample_cases=_collapse_cases)
@row_padded({"streams": 0.0, "pre": 0.0})
def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse the streams: ``sum_n pre[:, n] * streams[:, n]`` in fp32, cast to ``streams.dtype``.

    Args:
        streams: ``[T, N, D]``; pre: ``[T, N]`` float32 weights.

    Returns:
        ``[T, D]`` in ``streams.dtype``.
    """
    return (pre.float().unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


# ---- hierarchical top-k: candidate blocks --------------------------------------------------------
def _candidate_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    t, h, d, n = 5, 8, 16, 12
    paged = _paged_case(g, t, 3, 4)
    rows = torch.arange(n).repeat(t, 1)
    rows[1, 7:] = -1
    rows[2, 1:] = -1
    rows[3, :] = -1
    keys = randn(g, n, d, dtype=dtype)
    keys_mx = BlockScaledKVPool.from_values(randn(g, n, 32, dtype=dtype), "fp4_ue8m0")  # kv_cache_dtype="fp8"
    return [
        ((randn(g, t, h, d, dtype=dtype), randn(g, t, h), keys, paged, 2, 3, d**-0.5), {}),
        ((randn(g, t, h, d, dtype=dtype), randn(g, t, h), keys, rows, 2, 2, d**-0.5), {}),
        ((randn(g, t, h, d, dtype=dtype), randn(g, t, h), keys, rows, 8, 4, d**-0.5), {}),
        ((randn(g, t, h, 32, dtype=dtype), randn(g, t, h), keys_mx, paged, 2, 3, 32**-0.5), {}),
    ]


def _scores(q: torch.Tensor, weights: torch.Tensor, key_pool: KVPool, rows: torch.Tensor, scale: float):
    """Indexer scores ``[T, C]`` of candidate ``rows`` (``-inf`` where ``-1``): ``sum_h weights[t, h]
    * relu(q[t, h] . key[c]) * scale`` in fp32, as the core ``indexer_topk`` computes them (in
    fixed blocks of ``KEY_BLOCK`` candidates in batch-invariant mode; a packed key pool's rows
    dequantised to q's dtype)."""
    t, c = rows.shape
    if batch_invariant_enabled():
        nb = max(1, padded_len(c, KEY_BLOCK) // KEY_BLOCK)
        cand = pad_cols(rows, nb * KEY_BLOCK, -1)
        keys = gather_rows(key_pool, cand, q.dtype).float()
        keys = keys.view(t, nb, KEY_BLOCK, -1).transpose(0, 1).contiguous()
        qf, wf = q.float(), weights.float().unsqueeze(1)
        blocks = []
        for b in range(nb):
            s = torch.bmm(qf, keys[b].transpose(1, 2)).relu_().mul_(scale)
            blocks.append(torch.bmm(wf, s).squeeze(1))
        scores = torch.cat(blocks, dim=1)[:, :c]
    else:
        keys = gather_rows(key_pool, rows, q.dtype).float()
        scores = torch.bmm(q.float(), keys.transpose(1, 2)).relu_().mul_(scale)
        scores = torch.bmm(weights.float().unsqueeze(1), scores).squeeze(1)
    return scores.masked_fill(rows < 0, float("-inf"))


@define_op(f"{NAMESPACE}.candidate_blocks", "attention", batch_invariant=True, sample_cases=_candidate_cases)
@row_padded({"q": 0.0, "weights": 0.0, "entries": -1})
def candidate_blocks(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pool: KVPool,
    entries: torch.Tensor | PagedIndex,
    num_blocks: int,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Level one of V4.1's two-level top-k: each query's best blocks of entries.

    Entry columns ``[b*block_size, (b+1)*block_size)`` of ``entries`` form block ``b``.  A block
    scores the max of its valid entries' indexer scores (as ``indexer_topk``: ``sum_h
    weights[t, h] * relu(q[t, h] . key) * scale``, fp32); a block without a valid entry is out;
    the block holding the query's last valid column is always kept (it is the newest, maybe
    only partly filled).  The ``num_blocks`` best blocks are kept, ties toward the lower block.

    Args:
        q: ``[T, H, D]`` indexer queries; weights: ``[T, H]`` float32 head weights.
        key_pool: ``[N, D]`` indexer keys, or a packed
            :class:`~deepinfer_core.ops.kv_format.PackedKVPool` (the MXFP4 keys of
            ``kv_cache_dtype="fp8"``) read as its rows dequantised to q's dtype.
        entries: ``[T, C]`` int64 pool rows in entry order (``-1`` = none; the valid ones a
            prefix), or a :class:`~deepinfer_core.ops.attention.PagedIndex` (``C = max_count``).
        num_blocks: blocks to keep; block_size: entries per block; scale: score scale.

    Returns:
        ``[T, min(num_blocks, ceil(C / block_size)) * block_size]`` int64: the pool rows of the
        kept blocks' valid entries, in entry order (ascending block), ``-1`` elsewhere.  The
        later index sources pick their top-k among these (``indexer_topk``), so both levels
        break ties toward the earlier entry.
    """
    rows = entries.rows() if isinstance(entries, PagedIndex) else entries
    t, c = rows.shape
    nblk = -(-c // block_size)
    keep = min(num_blocks, nblk)
    scores = _scores(q, weights, key_pool, rows, scale)
    padded = F.pad(scores, (0, nblk * block_size - c), value=float("-inf"))
    block_scores = padded.view(t, nblk, block_size).amax(dim=-1)
    valid = rows >= 0
    last = (valid.sum(dim=1) - 1).div(block_size, rounding_mode="floor")  # -1 when none
    pinned = torch.arange(nblk, device=rows.device).unsqueeze(0) == last.unsqueeze(1)
    block_scores = block_scores.masked_fill(pinned, float("inf"))
    order = torch.sort(block_scores, dim=-1, descending=True, stable=True).indices[:, :keep]
    chosen = block_scores.gather(1, order) > float("-inf")
    order = torch.where(chosen, order, nblk)  # dropped picks sort last
    blocks = order.sort(dim=-1).values  # ascending block: entry order
    cols = blocks.unsqueeze(-1) * block_size + torch.arange(block_size, device=rows.device)
    cols = cols.view(t, keep * block_size)
    in_range = (blocks.unsqueeze(-1) < nblk).expand(-1, -1, block_size).reshape(t, -1) & (cols < c)
    picked = rows.gather(1, cols.clamp(max=c - 1))
    return torch.where(in_range, picked, torch.full_like(picked, -1))


# ---- KV numerics of the release ----------------------------------------------------------------
KVFormat = Literal["fp8_ue8m0", "fp4_ue8m0", "fp4_e4m3"]


def _qdq_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    x = randn(g, 6, 64, dtype=dtype, scale=3.0) * torch.tensor([1e-3, 1.0, 50.0, 1.0, 1e-6, 0.0]).view(
        6, 1
    ).to(dtype)
    return [
        ((x, "fp8_ue8m0", 32), {}),
        ((x, "fp4_ue8m0", 32), {}),
        ((x, "fp4_e4m3", 16), {}),
        ((randn(g, 3, 2, 32, dtype=dtype), "fp8_ue8m0", 32), {}),
        ((randn(g, 3, 24, dtype=dtype), "fp4_e4m3", 16), {}),  # not a whole block: unchanged
    ]


@define_op(f"{NAMESPACE}.kv_qdq", "cache", sample_cases=_qdq_cases)
def kv_qdq(x: torch.Tensor, fmt: KVFormat, block: int) -> torch.Tensor:
    """Quantise-dequantise ``x`` as the release stores it: per ``block`` trailing channels one scale.

    - ``fp8_ue8m0`` (window KV records, block 32): ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``,
      ``x -> e4m3(clamp(x / s, ±448)) * s``.
    - ``fp4_ue8m0`` (indexer keys and queries, block 32): ``s = 2**ceil(log2(max(amax, 6*2**-126)
      / 6))``, ``x -> e2m1(clamp(x / s, ±6)) * s``.
    - ``fp4_e4m3`` (compressed KV entries, block 16): ``s = e4m3(max(amax, 6*2**-9) / 6)``, then
      as ``fp4_ue8m0``.

    ``e2m1`` rounds to the nearest of ``0, .5, 1, 1.5, 2, 3, 4, 6`` (signed), ties to the even
    code; ``e4m3`` is torch's round-to-nearest-even cast.  All in fp32; returns ``x``'s shape
    and dtype.  When the last dim is not a multiple of ``block`` ``x`` is returned unchanged
    (the release's shapes always are; tiny test shapes may not be).  Each row is independent.
    """
    n = x.shape[-1]
    if n % block:
        return x
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"kv_qdq: unknown format {fmt!r}")
    blocks = x.float().reshape(*x.shape[:-1], n // block, block)
    s, _ = block_scales(blocks.abs().amax(dim=-1, keepdim=True), fmt)  # the packed pools' scales
    if fmt == "fp8_ue8m0":
        q = (blocks / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        q = e2m1_values(e2m1_codes((blocks / s).clamp(-FP4_MAX, FP4_MAX)))
    return (q * s).reshape(x.shape).to(x.dtype)


# ---- Engram --------------------------------------------------------------------------------------
def _hash_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    tokens = torch.randint(0, 99092, (6, 4), generator=g)
    tokens[0, 1:] = 7  # pad look-back
    mult = torch.randint(0, 2**40, (4,), generator=g) * 2 + 1
    primes = torch.tensor([101, 103, 107, 109, 113, 127])
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), primes[:-1]]), 0)
    return [((tokens, mult, primes, offsets), {})]


@define_op(f"{NAMESPACE}.engram_hash", "engram", batch_invariant=True, sample_cases=_hash_cases)
def engram_hash(
    tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Engram table rows of each position's n-grams (one Engram layer).

    Args:
        tokens: ``[T, N]`` int64 normalised (compressed) ids: column 0 the position's own, column
            ``s`` the one ``s`` positions back (the pad id where there is none).
        multipliers: ``[N]`` int64 odd hash multipliers of the layer.
        primes: ``[(N - 1) * heads]`` int64, n-gram-major: the bucket sizes of (n-gram ``n = 2..N``,
            head); offsets: ``[(N - 1) * heads]`` int64 where each bucket range starts in the table.

    Returns:
        ``[T, (N - 1) * heads]`` int64 rows: with ``x_s = tokens[:, s] * multipliers[s]`` (int64,
        no overflow by construction) and ``h_n = x_0 ^ x_1 ^ ... ^ x_{n-1}`` (XOR), column
        ``(n - 2) * heads + j`` is ``h_n % primes[c] + offsets[c]``.  Rows are independent.
    """
    n = tokens.shape[1]
    heads = primes.shape[0] // (n - 1)
    products = tokens.long() * multipliers.long()
    rolling, cols = products[:, 0], []
    for s in range(1, n):
        rolling = torch.bitwise_xor(rolling, products[:, s])
        cols.append(rolling.unsqueeze(-1).expand(-1, heads))
    return torch.cat(cols, dim=1) % primes.long() + offsets.long()


def _rows_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    table = randn(g, 50, 64)
    data, scale = quant_fp8(table, (1, 32), "ue8m0")
    ids = torch.randint(0, 50, (5, 3), generator=g)
    return [
        ((table.to(dtype), ids, dtype), {}),
        ((QuantizedTensor(data, scale, "fp8", (1, 32)), ids, dtype), {}),
    ]


@define_op(f"{NAMESPACE}.engram_rows", "engram", batch_invariant=True, sample_cases=_rows_cases)
def engram_rows(table: Any, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gather Engram table rows.

    Args:
        table: ``[rows, E]``: a float tensor, or a
            :class:`~deepinfer_core.weights.quant.QuantizedTensor` (``fmt="fp8"``, block ``(1, g)``:
            e4m3 rows with one scale per ``g`` channels, the release's tables) of which only the
            gathered rows are dequantised.
        ids: ``[T, C]`` int64 rows; dtype: the result dtype.

    Returns:
        ``[T, C * E]`` in ``dtype``: the rows side by side (a quantised row as ``data * scale``
        in fp32, then cast).
    """
    flat = ids.reshape(-1)
    if isinstance(table, QuantizedTensor):
        data = table.data.view(torch.uint8).index_select(0, flat).view(table.data.dtype).float()
        group = table.block[1]
        scale = table.scale.index_select(0, flat).float().repeat_interleave(group, dim=-1)
        rows = (data * scale[:, : data.shape[1]]).to(dtype)
    else:
        rows = F.embedding(flat, table).to(dtype)
    return rows.view(ids.shape[0], -1)


def _mix_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    n, d = 4, 16
    return [
        (
            (
                randn(g, 5, n, d, dtype=dtype),
                randn(g, 5, (n + 1) * d, dtype=dtype),
                1 + randn(g, n, d, scale=0.1),
                1 + randn(g, n, d, scale=0.1),
                1e-20,
            ),
            {},
        )
    ]


@define_op(f"{NAMESPACE}.engram_mix", "engram", batch_invariant=True, sample_cases=_mix_cases)
@row_padded({"streams": 0.0, "kv": 0.0})
def engram_mix(
    streams: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Gate an Engram lookup into every residual stream.

    Args:
        streams: ``[T, N, D]`` residual streams; kv: ``[T, (N + 1) * D]`` the projected lookup
            (``wkv`` of the gathered rows): a key per stream, then one value.
        q_weight, k_weight: ``[N, D]`` float32 (only their product is used); eps: norm eps.

    Returns:
        ``[T, N, D]`` in ``streams.dtype``, all in fp32: per stream ``n``, with ``h`` the stream and
        ``k`` its key, ``dot = sum_d h*q_weight*k_weight*k * rsqrt(mean(h²)+eps) * rsqrt(mean(k²)+eps)
        / sqrt(D)``, ``gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))``, result ``h + gate * value``.
    """
    t, n, d = streams.shape
    key = kv[:, : n * d].float().view(t, n, d)
    value = kv[:, n * d :].float()
    h = streams.float()
    weight = q_weight.float() * k_weight.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * rstd * d**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.unsqueeze(1)).to(streams.dtype)
