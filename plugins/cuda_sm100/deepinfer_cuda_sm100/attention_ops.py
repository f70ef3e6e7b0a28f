"""The attention ops of the ``cuda_sm100`` backend: ``sparse_attention`` and ``indexer_topk``.

:func:`attention_ops` returns their :class:`OpImpl` objects (kernels in
:mod:`deepinfer_cuda_sm100.kernels.attention` and :mod:`~deepinfer_cuda_sm100.kernels.indexer`)
with ``supports`` predicates and conformance cases at the shapes the kernels target:
:data:`V4_FLASH` on the GPU, :data:`SMALL` (same structure, narrow) under Triton's CPU
interpreter.  The cases follow the model's calls (``deepinfer_core/models/deepseek_v4``): a
sliding window split between the slot's ring and this step's rows (a strided view of the
fused q/kv tensor), plus the indexer's top-k picks (CSA) or a paged index over every
compressed entry (HCA), for a single decode token, a block of tokens and a ragged count; a
long paged context that takes the split-KV path; the same calls with every pool a packed
:class:`~deepinfer_core.ops.kv_format.Fp8KVPool` (``kv_cache_dtype="fp8"``, which packs the
ring, this step's rows and the compressed entries alike) and two that mix plain and packed
pools; and indexer selections on integer-valued data (exact scores, many ties: the picks
must equal the reference's bit for bit) and on random data.

The kernels read plain pools and ``Fp8KVPool`` rows only: any other packed pool (DeepSeek-V4.1's
block-scaled :class:`~deepinfer_core.ops.kv_blockscaled.BlockScaledKVPool`, ``kv_cache_dtype="fp8"``),
and any packed indexer key pool, is refused by ``supports`` with :data:`PACKED_KV_REFUSAL` in the
reason, so the op table runs the reference for that call (logged once per op).

Importing this module does not import Triton; :func:`attention_ops` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer_core.ops import OpImpl
from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.kv_format import Fp8KVPool, PackedKVPool
from deepinfer_cuda_sm100.checks import device_problem, is_int_tensor

Verdict = bool | str
Cases = list[tuple[tuple, dict]]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Activation dtypes the kernels take, and the dtypes of plain (``[N, D]`` tensor) KV pools."""

MAX_SOURCES = 4
MAX_HEAD_DIM = 1024
MAX_INDEX_HEADS = 128
MAX_INDEX_DIM = 512
MAX_TOPK = 4096
_INT32_MAX = 2**31 - 1

PACKED_KV_REFUSAL = "the kernel does not read this packed KV format (the reference dequantises it)"
"""In ``supports``' reason for a packed pool the kernels do not read (a ``BlockScaledKVPool`` in
``sparse_attention``, any packed ``key_pool`` in ``indexer_topk``): the reference takes the call."""


@dataclass(frozen=True)
class AttnShapes:
    """Widths and counts of one family of attention cases."""

    heads: int
    head_dim: int
    rope_dim: int
    """Trailing channels a packed FP8 pool keeps in bfloat16 (``kv_cache_dtype="fp8"``)."""
    window: int
    topk: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    page_size: int
    csa_ratio: int
    hca_ratio: int
    context: int
    """Positions of the longest request (compressed entries = context // ratio)."""
    long_context: int
    """Context of the split-KV decode case."""
    tokens: tuple[int, ...]


V4_FLASH = AttnShapes(
    heads=64,
    head_dim=512,
    rope_dim=64,
    window=128,
    topk=512,
    index_heads=64,
    index_head_dim=128,
    index_topk=512,
    page_size=256,
    csa_ratio=4,
    hca_ratio=128,
    context=16384,
    long_context=1 << 19,
    tokens=(1, 16, 37),
)
SMALL = AttnShapes(
    heads=8,
    head_dim=64,
    rope_dim=16,
    window=8,
    topk=16,
    index_heads=4,
    index_head_dim=32,
    index_topk=8,
    page_size=16,
    csa_ratio=4,
    hca_ratio=8,
    context=160,
    long_context=1024,
    tokens=(1, 5, 9),
)


# ---------------------------------------------------------------------------------------------
# supports


def _tensors_of(a) -> list[tuple[str, object]]:
    if isinstance(a, PagedIndex):
        return [("block_table", a.block_table), ("token_rows", a.token_rows), ("counts", a.counts)]
    return [("", a)]


def _index_problem(name: str, index, t: int) -> str | None:
    """Shape and dtype problems of a ``[T, K]`` row list or a :class:`PagedIndex` of ``t`` queries."""
    if isinstance(index, PagedIndex):
        bt, rows, counts = index.block_table, index.token_rows, index.counts
        for part, x, dims in (("block_table", bt, 2), ("token_rows", rows, 1), ("counts", counts, 1)):
            if x.dim() != dims or not is_int_tensor(x):
                return f"{name}.{part} must be a {dims}-D integer tensor, got {x.dim()}-D {x.dtype}"
        if rows.shape[0] != t or counts.shape[0] != t:
            return f"{name}: token_rows / counts have {rows.shape[0]} / {counts.shape[0]} rows, expected {t}"
        if not isinstance(index.entries_per_page, int) or index.entries_per_page < 1:
            return f"{name}.entries_per_page must be a positive int, got {index.entries_per_page!r}"
        if not isinstance(index.max_count, int) or not 0 <= index.max_count <= _INT32_MAX:
            return f"{name}.max_count must be an int in [0, 2**31), got {index.max_count!r}"
        return None
    if not isinstance(index, torch.Tensor):
        return f"{name} is a {type(index).__name__}, not a tensor or PagedIndex"
    if index.dim() != 2 or not is_int_tensor(index):
        return f"{name} must be a [T, K] integer tensor, got {index.dim()}-D {index.dtype}"
    if index.shape[0] != t:
        return f"{name} has {index.shape[0]} rows, expected T={t}"
    if index.shape[1] > _INT32_MAX:
        return f"{name} has {index.shape[1]} columns (int32 positions)"
    return None


def make_supports(interpreted: bool) -> dict[str, Callable[..., Verdict]]:
    """The ``supports`` predicates, for kernels that are ``interpreted`` (CPU) or compiled (CUDA)."""

    def sparse_attention(q, kv_pools, indices, sinks, scale) -> Verdict:
        if not isinstance(kv_pools, list | tuple) or not isinstance(indices, list | tuple):
            return "kv_pools and indices must be lists"
        if len(kv_pools) != len(indices) or not 1 <= len(kv_pools) <= MAX_SOURCES:
            return f"{len(kv_pools)} pools / {len(indices)} index lists: 1..{MAX_SOURCES} pairs are supported"
        for i, p in enumerate(kv_pools):  # before the device checks: only Fp8KVPool bytes are read
            if isinstance(p, PackedKVPool) and not isinstance(p, Fp8KVPool):
                return f"kv_pools[{i}] is a {type(p).__name__}: {PACKED_KV_REFUSAL}"
        named = [("q", q), ("sinks", sinks)]
        for i, p in enumerate(kv_pools):  # a packed pool: its bytes
            named.append(
                (f"kv_pools[{i}].data", p.data) if isinstance(p, Fp8KVPool) else (f"kv_pools[{i}]", p)
            )
        for i, index in enumerate(indices):
            named += [(f"indices[{i}]" + (f".{n}" if n else ""), x) for n, x in _tensors_of(index)]
        problem = device_problem(interpreted, named)
        if problem:
            return problem
        if q.dim() != 3 or q.dtype not in FLOAT_DTYPES:
            return f"q must be [T, H, D] float32/bfloat16/float16, got {q.dim()}-D {q.dtype}"
        t, h, d = q.shape
        if not 1 <= d <= MAX_HEAD_DIM:
            return f"head dim {d} is outside 1..{MAX_HEAD_DIM}"
        packed = None
        for i, pool in enumerate(kv_pools):
            if isinstance(pool, Fp8KVPool):  # kv_cache_dtype="fp8": dequantised in the kernel
                if pool.dim != d:
                    return f"kv_pools[{i}] is an Fp8KVPool of {pool.dim} values per row, expected {d}"
                if packed is not None and pool.rope_dim != packed.rope_dim:
                    return (
                        f"kv_pools[{i}] is an Fp8KVPool with rope_dim={pool.rope_dim}, an earlier one has "
                        f"{packed.rope_dim}: the packed pools of a call must share one row layout"
                    )
                if pool.data.shape[0] > _INT32_MAX:
                    return f"kv_pools[{i}] has {pool.data.shape[0]} rows (int32 row ids)"
                packed = pool
                continue
            if pool.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8):
                return (
                    f"kv_pools[{i}] is a plain {pool.dtype} tensor: FP8 KV rows must come packed as an "
                    "Fp8KVPool (kv_cache_dtype='fp8')"
                )
            if pool.dtype != q.dtype:
                return f"kv_pools[{i}] dtype {pool.dtype} differs from q's {q.dtype}"
            if pool.dim() != 2 or pool.shape[1] != d:
                return f"kv_pools[{i}] has shape {tuple(pool.shape)}, expected [N, {d}]"
            if pool.shape[0] > _INT32_MAX:
                return f"kv_pools[{i}] has {pool.shape[0]} rows (int32 row ids)"
        for i, index in enumerate(indices):
            problem = _index_problem(f"indices[{i}]", index, t)
            if problem:
                return problem
        if not sinks.is_floating_point() or tuple(sinks.shape) != (h,):
            return f"sinks must be a float [{h}] tensor, got {tuple(sinks.shape)} {sinks.dtype}"
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            return f"scale must be a finite number, got {scale!r}"
        return True

    def indexer_topk(q, weights, key_pool, candidates, k, scale) -> Verdict:
        if isinstance(key_pool, PackedKVPool):
            return f"key_pool is a {type(key_pool).__name__}: {PACKED_KV_REFUSAL}"
        named = [("q", q), ("weights", weights), ("key_pool", key_pool)]
        named += [("candidates" + (f".{n}" if n else ""), x) for n, x in _tensors_of(candidates)]
        problem = device_problem(interpreted, named)
        if problem:
            return problem
        if q.dim() != 3 or q.dtype not in FLOAT_DTYPES:
            return f"q must be [T, H, D] float32/bfloat16/float16, got {q.dim()}-D {q.dtype}"
        t, h, d = q.shape
        if not 1 <= h <= MAX_INDEX_HEADS:
            return f"{h} indexer heads: 1..{MAX_INDEX_HEADS} are supported (one tile of heads)"
        if not 1 <= d <= MAX_INDEX_DIM:
            return f"indexer head dim {d} is outside 1..{MAX_INDEX_DIM}"
        if key_pool.dtype != q.dtype or key_pool.dim() != 2 or key_pool.shape[1] != d:
            return f"key_pool must be [N, {d}] {q.dtype}, got {tuple(key_pool.shape)} {key_pool.dtype}"
        if not weights.is_floating_point() or tuple(weights.shape) != (t, h):
            return f"weights must be a float [{t}, {h}] tensor, got {tuple(weights.shape)} {weights.dtype}"
        problem = _index_problem("candidates", candidates, t)
        if problem:
            return problem
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            return f"k must be a non-negative int, got {k!r}"
        c = candidates.max_count if isinstance(candidates, PagedIndex) else candidates.shape[1]
        if min(k, c) > MAX_TOPK:
            return f"min(k, C) = {min(k, c)} exceeds {MAX_TOPK} (the picks are sorted in one program)"
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            return f"scale must be a finite number, got {scale!r}"
        return True

    return {"sparse_attention": sparse_attention, "indexer_topk": indexer_topk}


# ---------------------------------------------------------------------------------------------
# conformance cases


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _randint(g: torch.Generator, lo: int, hi: int, *shape: int, dtype: torch.dtype = torch.float32):
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


@dataclass
class _Batch:
    """A flat batch of requests, as the metadata builder lays it out (see ``metadata.py``)."""

    pos: torch.Tensor  # [T] position of each token
    req: torch.Tensor  # [T] request of each token
    start: torch.Tensor  # [R] first position of this step's chunk
    offset: torch.Tensor  # [R] first token row of the request
    slot: torch.Tensor  # [R] cache slot


def _batch(g: torch.Generator, t: int, context: int, window: int) -> _Batch:
    """``t`` tokens: one long decode token, then a prefill chunk, then more decode tokens."""
    lens = [1] if t == 1 else [1, t - 1] if t < 4 else [1, t - 3, 1, 1]
    starts = []
    for i, n in enumerate(lens):
        if n == 1:
            starts.append(context - 1 if i == 0 else int(torch.randint(1, context, (1,), generator=g)))
        else:  # a chunk starting mid-window of an earlier one
            starts.append(int(torch.randint(0, max(1, context - n), (1,), generator=g)))
    r = len(lens)
    start = torch.tensor(starts)
    lens_t = torch.tensor(lens)
    offset = torch.cumsum(lens_t, 0) - lens_t
    req = torch.repeat_interleave(torch.arange(r), lens_t)
    tok = torch.arange(t)
    pos = start[req] + tok - offset[req]
    slot = torch.randperm(r + 2, generator=g)[:r]
    return _Batch(pos, req, start, offset, slot)


def _window_rows(b: _Batch, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ring [T, W], chunk [T, W])`` rows of each token's window (``-1`` none), as ``metadata.py``."""
    kpos = b.pos[:, None] - (window - 1) + torch.arange(window)
    valid = kpos >= 0
    in_chunk = kpos >= b.start[b.req][:, None]
    none = torch.full_like(kpos, -1)
    chunk = torch.where(valid & in_chunk, b.offset[b.req][:, None] + kpos - b.start[b.req][:, None], none)
    ring = torch.where(valid & ~in_chunk, b.slot[b.req][:, None] * window + kpos % window, none)
    return ring, chunk


def _paged(g: torch.Generator, b: _Batch, ratio: int, page_size: int, context: int) -> tuple[PagedIndex, int]:
    """Each request's compressed entries through a block table of shuffled pages."""
    epp = page_size // ratio
    r = b.start.shape[0]
    pages = -(-context // page_size)
    table = torch.randperm(r * pages + 3, generator=g)[: r * pages].view(r, pages)
    max_count = context // ratio
    index = PagedIndex(table, b.req, (b.pos + 1) // ratio, epp, max_count)
    return index, (r * pages + 3) * epp


def _topk_rows(g: torch.Generator, b: _Batch, ratio: int, k: int, n_rows: int) -> torch.Tensor:
    """The indexer's picks: distinct pool rows, ``-1`` past each query's entry count and here
    and there (batch-invariant picks come in column order with ``-1`` interleaved)."""
    t = b.pos.shape[0]
    rows = torch.stack([torch.randperm(n_rows, generator=g)[:k] for _ in range(t)])
    count = ((b.pos + 1) // ratio).clamp(max=k)
    rows = torch.where(torch.arange(k)[None, :] < count[:, None], rows, -1)
    holes = torch.rand(t, k, generator=g) < 0.1
    return torch.where(holes, -1, rows)


KV_CASE_SETS = ("plain", "fp8", "all")
"""What :func:`attention_cases` makes: plain pools only, packed FP8 pools only, or both plus
mixed calls."""


def packed_case(
    case: tuple[tuple, dict], rope_dim: int, which: Sequence[int] | None = None
) -> tuple[tuple, dict]:
    """``case`` with its pools ``which`` (all by default) packed into ``Fp8KVPool`` pools, as
    ``kv_cache_dtype="fp8"`` stores them (this step's rows too: the model packs them)."""
    (q, pools, idx, sinks, scale), kwargs = case
    pools = [
        Fp8KVPool.from_values(p, rope_dim) if which is None or i in which else p for i, p in enumerate(pools)
    ]
    return (q, pools, idx, sinks, scale), kwargs


def attention_cases(s: AttnShapes, kv: str = "all") -> Callable[[torch.Generator, torch.dtype], Cases]:
    """``sparse_attention`` cases of shapes ``s`` (see the module docstring).

    ``kv="plain"``: every pool an ``[N, D]`` tensor of the activation dtype -- a sliding-window
    case, then CSA and HCA for each token count, then the long split-KV decode (the last
    three: the largest batch's CSA and HCA, and the split-KV case); ``"fp8"``: the same cases
    (same values) with every pool packed (``kv_cache_dtype="fp8"``, :data:`AttnShapes.rope_dim`
    channels in bfloat16); ``"all"``: the plain cases, the packed ones, then two mixes (a plain
    window with packed compressed entries; packed paged entries first, then a plain window).
    """
    if kv not in KV_CASE_SETS:
        raise ValueError(f"kv must be one of {KV_CASE_SETS}, got {kv!r}")

    def plain(g: torch.Generator, dtype: torch.dtype) -> Cases:
        h, d, w = s.heads, s.head_dim, s.window
        out: Cases = []
        for i, t in enumerate(s.tokens):
            b = _batch(g, t, s.context, w)
            ring_idx, chunk_idx = _window_rows(b, w)
            qkv = _randn(g, t, h + 1, d, dtype=dtype)
            q, kv = qkv[:, :h], qkv[:, h]  # strided views, as the model passes them
            ring = _randn(g, (int(b.slot.max()) + 1) * w, d, dtype=dtype)
            sinks = _randn(g, h)
            scale = d**-0.5
            if i == 0:  # sliding-window layer
                out.append(((q, [ring, kv], [ring_idx, chunk_idx], sinks, scale), {}))
            paged, n = _paged(g, b, s.csa_ratio, s.page_size, s.context)
            ckv = _randn(g, n, d, dtype=dtype)
            topk = _topk_rows(g, b, s.csa_ratio, s.topk, n)
            out.append(((q, [ring, kv, ckv], [ring_idx, chunk_idx, topk], sinks, scale), {}))  # CSA
            paged, n = _paged(g, b, s.hca_ratio, s.page_size, s.context)
            ckv = _randn(g, n, d, dtype=dtype)
            out.append(((q, [ring, kv, ckv], [ring_idx, chunk_idx, paged], sinks, scale), {}))  # HCA
        # long-context decode (split-KV), one query with no key at all, a paged source first
        b = _batch(g, 2, s.long_context, w)
        b.pos[1] = 0
        ring_idx, chunk_idx = _window_rows(b, w)
        ring_idx[1] = -1
        chunk_idx[1] = -1
        paged, n = _paged(g, b, s.hca_ratio, s.page_size, s.long_context)
        ckv = _randn(g, n, d, dtype=dtype)
        q = _randn(g, 2, h, d, dtype=dtype)
        ring = _randn(g, (int(b.slot.max()) + 1) * w, d, dtype=dtype)
        kv = _randn(g, 2, d, dtype=dtype)
        sinks = _randn(g, h)
        out.append(((q, [ckv, ring, kv], [paged, ring_idx, chunk_idx], sinks, d**-0.5), {}))
        return out

    def cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
        base = plain(g, dtype)
        if kv == "plain":
            return base
        fp8 = [packed_case(c, s.rope_dim) for c in base]
        if kv == "fp8":
            return fp8
        mixed = [packed_case(base[-2], s.rope_dim, [2]), packed_case(base[-1], s.rope_dim, [0])]
        return base + fp8 + mixed

    return cases


def indexer_cases(s: AttnShapes) -> Callable[[torch.Generator, torch.dtype], Cases]:
    """``indexer_topk`` cases of shapes ``s`` (see the module docstring)."""

    def cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
        h, di, k = s.index_heads, s.index_head_dim, s.index_topk
        out: Cases = []
        for t in s.tokens:
            b = _batch(g, t, s.context, s.window)
            paged, n = _paged(g, b, s.csa_ratio, s.page_size, s.context)
            # integer data, power-of-two scale: exact scores in any summation order, many ties
            q = _randint(g, -3, 4, t, h, di, dtype=dtype)
            wts = _randint(g, -2, 3, t, h)
            keys = _randint(g, -3, 4, n, di, dtype=dtype)
            out.append(((q, wts, keys, paged, k, 0.125), {}))
            fused = torch.cat([wts, wts, wts], dim=1).to(dtype)  # V4's: a slice of the projection
            out.append(((q, fused[:, h : 2 * h], keys, paged, k, 0.125), {}))
            c = min(n, 8 * k)
            rows = torch.stack([torch.randperm(n, generator=g)[:c] for _ in range(t)])
            rows = torch.where(torch.rand(t, c, generator=g) < 0.2, -1, rows)
            rows[0, k // 2 :] = -1  # fewer valid candidates than k
            out.append(((q, wts, keys, rows, k, 0.125), {}))
        # random data: the model's scale and weights; few enough candidates and picks that no
        # two of the kept scores are within rounding of each other (any summation order ranks
        # them alike)
        k = min(k, 32)
        t, c = s.tokens[-1], 4 * k
        q = _randn(g, t, h, di, dtype=dtype)
        wts = _randn(g, t, h) * h**-0.5
        keys = _randn(g, c, di, dtype=dtype)
        cand = torch.stack([torch.randperm(c, generator=g) for _ in range(t)])
        cand[:, -k:] = -1
        out.append(((q, wts, keys, cand, k, di**-0.5), {}))
        return out

    return cases


def attention_ops() -> dict[str, OpImpl]:
    """``{op name: OpImpl}`` for ``sparse_attention`` and ``indexer_topk`` (imports Triton)."""
    from deepinfer_cuda_sm100 import indexer_select
    from deepinfer_cuda_sm100.attention_dispatch import make_sparse_attention
    from deepinfer_cuda_sm100.kernels import _common, attention

    interpreted = _common.INTERPRETED
    supports = make_supports(interpreted)
    shapes = SMALL if interpreted else V4_FLASH
    return {
        "sparse_attention": OpImpl(
            fn=make_sparse_attention(attention.sparse_attention),  # TileLang where measured faster
            supports=supports["sparse_attention"],
            sample_cases=attention_cases(shapes),
        ),
        "indexer_topk": OpImpl(indexer_select.indexer_topk, supports["indexer_topk"], indexer_cases(shapes)),
    }
