"""``sparse_attention``: multi-source MQA with per-head sinks (contract: ``deepinfer_core.ops.attention``).

FlashMLA-style decoding kernel.  All ``H`` query heads of a token share one K=V row per key,
so a program takes one token and ``BLOCK_H`` heads, loads each key row once per block of
``BLOCK_N`` keys and runs ``[BLOCK_H, D] x [D, BLOCK_N]`` (logits) and
``[BLOCK_H, BLOCK_N] x [BLOCK_N, D]`` (values) through ``tl.dot``, with an online softmax in
fp32 (base-2 exponentials of logits pre-multiplied by ``log2(e)``).

**Key order.**  A small prologue kernel compacts each query's *valid* keys: for every
explicit source (``[T, K]`` rows, ``-1`` = none) it writes the valid rows, in column order,
to a ``[T, sum K]`` int32 scratch and counts them; a :class:`PagedIndex` source contributes
its first ``min(counts[t], max_count)`` entries, located through the block table inside the
main kernel (no per-query list is materialised for it).  Query ``t`` then sees the sequence
``source 0's valid keys, source 1's, ...`` of length ``L_t``, and reduces it in *chunks* of
``CHUNK`` keys (each a multiple of ``BLOCK_N``): a chunk's partial ``(m, l, acc)`` starts
from ``m = -inf`` and is merged, chunk after chunk in order, into a running state that
starts from the sink (``m = sink``, ``l = 1``).  Two launch shapes run the same arithmetic:

- *direct*: grid ``(T, head blocks)``; a program loops over its query's chunks and writes
  the output;
- *split-KV* (decode with few tokens and long contexts): grid ``(T, head blocks, splits)``,
  one chunk per program, partials to an fp32 scratch; a combine kernel merges them (in the
  same order, with the same merge helper) and writes the output.

The choice between them and ``CHUNK`` depend only on static shapes (``T``, ``H``, the widest
key list), never on tensor values.  In batch-invariant mode ``CHUNK`` is fixed
(:data:`BI_CHUNK`) and the result of a query depends only on its valid key sequence: not on
``T``, the other queries, the split between sources or where and how many ``-1`` slots
there are (blocks past ``L_t`` are never visited).

**KV formats.**  Each source's pool has its own format, a constexpr of the kernel
(``FMT0..3``), and the key load (:func:`_load_kv`) is the only code that depends on it:

- :data:`KV_PLAIN`: rows ``[N, D]`` in q's dtype (fp32 / bf16 / fp16), loaded as they are;
- :data:`KV_FP8_V4`: an :class:`~deepinfer_core.ops.kv_format.Fp8KVPool`, FlashMLA's V4 rows
  (``uint8 [N, row_bytes]``: ``D-R`` float8 e4m3 "nope" values, ``R`` bfloat16 rope values, one
  UE8M0 scale byte per 64 nope values; 592 bytes per row on V4-Flash).  The kernel loads the
  row bytes and dequantises in registers: nope ``= float(e4m3 byte) * 2**(scale byte - 127)``
  (the power of two built from the scale byte's bits), rope ``=`` the bfloat16 bits shifted
  into an fp32, both exact, then converted to q's dtype (exact too, barring underflow) -- the
  values the reference dequantises to -- before the same ``tl.dot`` as a plain tile.  Row
  pointers are built as ``base + row * (stride / 8) * 8`` so that the compiler sees 8-byte
  aligned rows (the host re-lays a pool whose rows are not) and loads the nope bytes and the
  rope values in wide (pipelined) copies; a row's scale bytes are one 8-byte word when they
  fit one (V4: 7 bytes at 576), spread over the channels with shifts.

A block of keys that spans sources of both formats (``kv_cache_dtype="fp8"`` packs the
window ring, this step's rows and the compressed entries alike, but tests mix a plain
window with a packed pool) loads the plain rows and the packed rows under complementary
masks and selects per key; a call whose pools share one format loads once.  The packed
pools of one call share one row layout (``dim``, ``rope_dim``: constexprs of the kernel).
With fp32 queries and packed pools the tiles take 16 keys and one pipeline stage
(:func:`default_config`: shared memory).

Loops whose trip count is a tensor value are written twice: a ``for`` (compiled: the
software pipeliner needs it) and a ``while`` for Triton's CPU interpreter, whose ``range``
cannot take a run-time bound with NumPy 2.  Everything is CUDA-graph capturable: no host
synchronisation, grids and scratch sizes from shapes only.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.kv_format import Fp8KVPool, Fp8RowLayout, KVPool
from deepinfer_core.ops.modes import batch_invariant_enabled

from ._common import INTERPRETED, cast_to, cdiv, paged_row, pow2
from .pdl import pdl_args, pdl_enter

KV_PLAIN = 0
"""Key rows stored in the pool's floating dtype (fp32, bf16 or fp16): a ``[N, D]`` tensor."""
KV_FP8_V4 = 1
"""Packed FP8 rows, FlashMLA's V4 layout (:class:`~deepinfer_core.ops.kv_format.Fp8KVPool`:
e4m3 nope values with a UE8M0 scale per 64, then bf16 rope values)."""

SRC_NONE, SRC_ROWS, SRC_PAGED = 0, 1, 2
MAX_SOURCES = 4
"""Key sources per call (V4 uses 2 or 3: window ring, this step's rows, compressed entries)."""

MAX_HEAD_DIM = 1024
"""Widest head dimension (one ``[BLOCK_H, D]`` query tile per program)."""

BI_CHUNK = 32 if INTERPRETED else 512
"""Keys per chunk in batch-invariant mode (fixed, whatever the batch; small when interpreted so
that the small test shapes span several chunks)."""

MIN_SPLIT_KEYS = 32 if INTERPRETED else 256
"""Fewest keys a split-KV program gets (below that the partials' traffic dominates)."""

LOG2E = 1.4426950408889634

_INTERP = tl.constexpr(INTERPRETED)


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shapes and launch parameters of the main kernel (static per ``(H, D, dtype)``)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int


def default_config(h: int, d: int, dtype: torch.dtype, packed: bool = False) -> AttentionConfig:
    """The tiles for ``H`` heads of width ``D`` (``packed``: some pool is an ``Fp8KVPool``): a
    function of static shapes only."""
    block_d = max(16, pow2(d))
    if INTERPRETED:
        return AttentionConfig(block_h=max(16, min(pow2(h), 64)), block_n=16, num_warps=4, num_stages=1)
    block_h = max(16, min(pow2(h), 64))
    wide = block_d * (4 if dtype == torch.float32 else 2)  # bytes of one key row
    block_n = 32 if wide >= 1024 else 64
    warps = 8 if block_h * block_d >= 64 * 256 else 4
    if packed and dtype == torch.float32 and wide >= 1024:
        # fp32 tiles dequantised from packed rows: at D=512 the 32-key tiles (and a second
        # pipeline stage) need more than the 227 KiB of shared memory of an SM90 / SM100 block
        return AttentionConfig(block_h=block_h, block_n=16, num_warps=warps, num_stages=1)
    return AttentionConfig(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=2)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: small, so that small tests exercise the split-KV path
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# ---------------------------------------------------------------------------------------------
# prologue: count each source's valid keys, compact the explicit sources' rows


@triton.jit
def _place_rows(r, dst_ptr, n):
    """The valid rows (``>= 0``) of the block ``r`` stored in order to ``dst_ptr`` from position
    ``n``; ``n`` plus their count."""
    ok = r >= 0
    oki = ok.to(tl.int32)
    pos = n + tl.cumsum(oki, 0) - oki
    tl.store(dst_ptr + pos, r.to(tl.int32), mask=ok)
    return n + tl.sum(oki, 0)


@triton.jit
def _compact_block(idx_ptr, s_t, s_c, K, t, c0, dst_ptr, n, BLOCK_C: tl.constexpr):
    cols = c0 + tl.arange(0, BLOCK_C)
    r = tl.load(idx_ptr + t * s_t + cols * s_c, mask=cols < K, other=-1)
    return _place_rows(r, dst_ptr, n)


@triton.jit
def _preload_source(
    KIND: tl.constexpr, ONE_BLOCK: tl.constexpr, idx_ptr, s_t, s_c, K, t, BLOCK_C: tl.constexpr
):
    """What of one source of query ``t`` is read ahead of any store: a paged source's clamped
    count; with ``ONE_BLOCK``, an explicit list's rows as one block (``-1`` past ``K``); else
    zero (nothing)."""
    if KIND == 1 and ONE_BLOCK:
        cols = tl.arange(0, BLOCK_C)
        out = tl.load(idx_ptr + t * s_t + cols * s_c, mask=cols < K, other=-1)
    elif KIND == 2:  # paged: idx_ptr = counts, K = max_count
        out = tl.minimum(tl.maximum(tl.load(idx_ptr + t * s_t), 0), K).to(tl.int32)
    else:
        out = tl.zeros((), tl.int32)
    return out


@triton.jit
def _count_source(
    KIND: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    loaded,
    idx_ptr,
    s_t,
    s_c,
    K,
    t,
    dst_ptr,
    BLOCK_C: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Valid keys of one source for query ``t`` (``loaded``: its :func:`_preload_source`);
    explicit rows are compacted to ``dst_ptr``, from the preloaded block with ``ONE_BLOCK``,
    else read block after block."""
    n = tl.zeros((), tl.int32)
    if KIND == 1:
        if ONE_BLOCK:
            n = _place_rows(loaded, dst_ptr, n)
        elif INTERP:
            c0 = 0
            while c0 < K:
                n = _compact_block(idx_ptr, s_t, s_c, K, t, c0, dst_ptr, n, BLOCK_C)
                c0 += BLOCK_C
        else:
            for c0 in range(0, K, BLOCK_C):
                n = _compact_block(idx_ptr, s_t, s_c, K, t, c0, dst_ptr, n, BLOCK_C)
    elif KIND == 2:
        n = loaded
    return n


@triton.jit
def _prologue_kernel(
    nvalid_ptr,
    compact_ptr,
    KE,
    i0,
    t0,
    c0,
    k0,
    i1,
    t1,
    c1,
    k1,
    i2,
    t2,
    c2,
    k2,
    i3,
    t3,
    c3,
    k3,
    KIND0: tl.constexpr,
    KIND1: tl.constexpr,
    KIND2: tl.constexpr,
    KIND3: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERP: tl.constexpr,
    ONE_BLOCK: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    row = compact_ptr + t * KE
    # every source read before the first store where each list fits a block (ONE_BLOCK): one
    # round of load latency; wider lists are read block after block, source after source
    l0 = _preload_source(KIND0, ONE_BLOCK, i0, t0, c0, k0, t, BLOCK_C)
    l1 = _preload_source(KIND1, ONE_BLOCK, i1, t1, c1, k1, t, BLOCK_C)
    l2 = _preload_source(KIND2, ONE_BLOCK, i2, t2, c2, k2, t, BLOCK_C)
    l3 = _preload_source(KIND3, ONE_BLOCK, i3, t3, c3, k3, t, BLOCK_C)
    n0 = _count_source(KIND0, ONE_BLOCK, l0, i0, t0, c0, k0, t, row, BLOCK_C, INTERP)
    e1 = n0 if KIND0 == 1 else 0
    n1 = _count_source(KIND1, ONE_BLOCK, l1, i1, t1, c1, k1, t, row + e1, BLOCK_C, INTERP)
    e2 = e1 + (n1 if KIND1 == 1 else 0)
    n2 = _count_source(KIND2, ONE_BLOCK, l2, i2, t2, c2, k2, t, row + e2, BLOCK_C, INTERP)
    e3 = e2 + (n2 if KIND2 == 1 else 0)
    n3 = _count_source(KIND3, ONE_BLOCK, l3, i3, t3, c3, k3, t, row + e3, BLOCK_C, INTERP)
    base = nvalid_ptr + t * 4
    tl.store(base, n0)
    tl.store(base + 1, n1)
    tl.store(base + 2, n2)
    tl.store(base + 3, n3)


# ---------------------------------------------------------------------------------------------
# main kernel


@triton.jit
def _source_ptrs(
    KIND: tl.constexpr,
    FMT: tl.constexpr,
    pptrs,
    fptrs,
    fsel,
    p,
    off,
    n,
    ce,
    crow_ptr,
    pool,
    ps,
    bt,
    bt0,
    bt1,
    npages,
    trow,
    epp,
):
    """Row pointers of the compact positions ``p`` that fall in this source (others kept):
    into ``pptrs`` for a plain pool (``ps``: its row stride), into ``fptrs`` (and marked in
    ``fsel``) for a packed one (``ps``: its row stride in 8-byte words)."""
    if KIND != 0:
        inside = (p >= off) & (p < off + n)
        if KIND == 1:
            r = tl.load(crow_ptr + ce + (p - off), mask=inside, other=0).to(tl.int64)
        else:  # paged
            r = paged_row(tl.where(inside, p - off, 0), epp, bt + trow * bt0, bt1, npages, inside)
        if FMT == 0:
            pptrs = tl.where(inside, pool + r * ps, pptrs)
        else:  # ps in 8-byte units: the compiler sees 8-byte aligned rows (wide loads)
            fptrs = tl.where(inside, pool + (r * ps) * 8, fptrs)
            fsel = fsel | inside
    return pptrs, fptrs, fsel


@triton.jit
def _load_fp8_rows(rows, d, ok, dmask, NOPE: tl.constexpr, ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_D]`` fp32 tile dequantised from packed rows (byte pointers ``rows``,
    8-byte aligned; zeros where not ``ok``): channel ``c < NOPE`` is ``e4m3(byte c) *
    2**(byte[SCALE_OFF + c // 64] - 127)``, channel ``c >= NOPE`` the bfloat16 at byte
    ``ROPE_OFF + 2 (c - NOPE)``.  The nope bytes and the rope values are contiguous runs (wide
    loads); a row's scale bytes, when they fit one aligned 8-byte word (V4: 7 at byte 576), are
    one load per row, spread over the channels with shifts."""
    is_nope = d < NOPE
    nmask = ok[:, None] & is_nope[None, :]
    q8 = tl.load(rows[:, None] + d[None, :], mask=nmask, other=0)
    group = d // 64
    if SCALE_OFF % 8 == 0 and NOPE > 0 and NOPE <= 512:  # (NOPE = 0: no scale byte in the row)
        word = tl.load((rows + SCALE_OFF).to(tl.pointer_type(tl.uint64)), mask=ok, other=0)
        shift = (8 * tl.minimum(group, 7)).to(tl.uint64)
        sb = (word[:, None] >> shift[None, :]) & 0xFF
    else:
        sb = tl.load(rows[:, None] + (SCALE_OFF + group)[None, :], mask=nmask, other=0)
    scale = (sb.to(tl.uint32) << 23).to(tl.float32, bitcast=True)  # 2**(byte - 127), exactly
    nope = q8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    rmask = ok[:, None] & (dmask & ~is_nope)[None, :]
    rope_ptrs = (rows + ROPE_OFF).to(tl.pointer_type(tl.uint16))  # ROPE_OFF is even
    bits = tl.load(rope_ptrs[:, None] + (d - NOPE)[None, :], mask=rmask, other=0)
    rope = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)  # bf16 -> fp32, exactly
    return tl.where(is_nope[None, :], nope, rope)


@triton.jit
def _load_kv(
    pptrs,
    fptrs,
    fsel,
    d,
    ok,
    dmask,
    ANY_PLAIN: tl.constexpr,
    ANY_FP8: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr,
):
    """A ``[BLOCK_N, BLOCK_D]`` tile of key(=value) rows in q's dtype (``pptrs``' element type;
    zeros where not ``ok``): plain rows as they are, packed rows (``fsel``) dequantised."""
    if ANY_FP8:
        fok = (ok & fsel) if ANY_PLAIN else ok
        x = _load_fp8_rows(fptrs, d, fok, dmask, NOPE, ROPE_OFF, SCALE_OFF)
        x = cast_to(x, pptrs.dtype.element_ty)
    if ANY_PLAIN:
        pok = (ok & ~fsel) if ANY_FP8 else ok
        kv = tl.load(pptrs[:, None] + d[None, :], mask=pok[:, None] & dmask[None, :], other=0.0)
        if ANY_FP8:
            kv = tl.where(fsel[:, None], x, kv)
    else:
        kv = x
    return kv


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _block(
    q,
    m,
    l,
    acc,
    p0,
    hi,
    t,
    crow_ptr,
    qk_scale,
    o0,
    n0,
    ce0,
    pool0,
    ps0,
    bt_0,
    bta0,
    btb0,
    np0,
    tr0,
    epp0,
    o1,
    n1,
    ce1,
    pool1,
    ps1,
    bt_1,
    bta1,
    btb1,
    np1,
    tr1,
    epp1,
    o2,
    n2,
    ce2,
    pool2,
    ps2,
    bt_2,
    bta2,
    btb2,
    np2,
    tr2,
    epp2,
    o3,
    n3,
    ce3,
    pool3,
    ps3,
    bt_3,
    bta3,
    btb3,
    np3,
    tr3,
    epp3,
    d,
    dmask,
    pbase,
    fbase,
    KIND0: tl.constexpr,
    KIND1: tl.constexpr,
    KIND2: tl.constexpr,
    KIND3: tl.constexpr,
    FMT0: tl.constexpr,
    FMT1: tl.constexpr,
    FMT2: tl.constexpr,
    FMT3: tl.constexpr,
    ANY_PLAIN: tl.constexpr,
    ANY_FP8: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One block of ``BLOCK_N`` compact positions ``p0 ..`` (``< hi``) into ``(m, l, acc)``."""
    p = p0 + tl.arange(0, BLOCK_N)
    zero = tl.zeros([BLOCK_N], tl.int64)
    pp, fp, fs = pbase + zero, fbase + zero, p < 0  # plain rows, packed rows, "packed" flags
    pp, fp, fs = _source_ptrs(
        KIND0, FMT0, pp, fp, fs, p, o0, n0, ce0, crow_ptr, pool0, ps0, bt_0, bta0, btb0, np0, tr0, epp0
    )
    pp, fp, fs = _source_ptrs(
        KIND1, FMT1, pp, fp, fs, p, o1, n1, ce1, crow_ptr, pool1, ps1, bt_1, bta1, btb1, np1, tr1, epp1
    )
    pp, fp, fs = _source_ptrs(
        KIND2, FMT2, pp, fp, fs, p, o2, n2, ce2, crow_ptr, pool2, ps2, bt_2, bta2, btb2, np2, tr2, epp2
    )
    pp, fp, fs = _source_ptrs(
        KIND3, FMT3, pp, fp, fs, p, o3, n3, ce3, crow_ptr, pool3, ps3, bt_3, bta3, btb3, np3, tr3, epp3
    )
    ok = p < hi
    kv = _load_kv(pp, fp, fs, d, ok, dmask, ANY_PLAIN, ANY_FP8, NOPE, ROPE_OFF, SCALE_OFF)
    if DOT_FP32:
        kv = kv.to(tl.float32)
    s = _dot(q, tl.trans(kv), IEEE) * qk_scale  # [BLOCK_H, BLOCK_N] logits, log2 units
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    pr = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(pr, 1)
    acc = acc * alpha[:, None] + _dot(pr.to(kv.dtype), kv, IEEE)
    return m_new, l, acc


@triton.jit
def _merge(m, l, acc, mi, li, acci):
    """Fold a chunk's partial ``(mi, li, acci)`` into the running state (explicit FMAs, so
    the direct kernel and the combine kernel round alike)."""
    mn = tl.maximum(m, mi)
    a = tl.exp2(m - mn)
    b = tl.exp2(mi - mn)
    l = tl.math.fma(l, a, li * b)
    acc = tl.math.fma(acc, a[:, None], acci * b[:, None])
    return mn, l, acc


@triton.jit
def _attn_kernel(
    q_ptr,
    sq_t,
    sq_h,
    sink_ptr,
    out_ptr,
    so_t,
    so_h,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    nvalid_ptr,
    compact_ptr,
    KE,
    H,
    D,
    CHUNK,
    NSPLIT,
    qk_scale,
    pool0,
    ps0,
    bt_0,
    bta0,
    btb0,
    np0,
    tr_0,
    trs0,
    epp0,
    pool1,
    ps1,
    bt_1,
    bta1,
    btb1,
    np1,
    tr_1,
    trs1,
    epp1,
    pool2,
    ps2,
    bt_2,
    bta2,
    btb2,
    np2,
    tr_2,
    trs2,
    epp2,
    pool3,
    ps3,
    bt_3,
    bta3,
    btb3,
    np3,
    tr_3,
    trs3,
    epp3,
    pbase,
    fbase,
    KIND0: tl.constexpr,
    KIND1: tl.constexpr,
    KIND2: tl.constexpr,
    KIND3: tl.constexpr,
    FMT0: tl.constexpr,
    FMT1: tl.constexpr,
    FMT2: tl.constexpr,
    FMT3: tl.constexpr,
    ANY_PLAIN: tl.constexpr,
    ANY_FP8: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(
        q_ptr + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    nv = nvalid_ptr + t * 4
    n0 = tl.load(nv)
    n1 = tl.load(nv + 1)
    n2 = tl.load(nv + 2)
    n3 = tl.load(nv + 3)
    o0 = tl.zeros((), tl.int32)
    o1 = o0 + n0
    o2 = o1 + n1
    o3 = o2 + n2
    total = o3 + n3
    ce0 = tl.zeros((), tl.int32)
    ce1 = ce0 + (n0 if KIND0 == 1 else 0)
    ce2 = ce1 + (n1 if KIND1 == 1 else 0)
    ce3 = ce2 + (n2 if KIND2 == 1 else 0)
    tr0 = tl.load(tr_0 + t * trs0) if KIND0 == 2 else 0
    tr1 = tl.load(tr_1 + t * trs1) if KIND1 == 2 else 0
    tr2 = tl.load(tr_2 + t * trs2) if KIND2 == 2 else 0
    tr3 = tl.load(tr_3 + t * trs3) if KIND3 == 2 else 0
    crow = compact_ptr + t * KE
    nchunks = (total + CHUNK - 1) // CHUNK

    if SPLIT:
        c = tl.program_id(2)
        if c < nchunks:
            lo = c * CHUNK
            hi = tl.minimum(total, lo + CHUNK)
            m = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            if INTERP:
                p0 = lo
                while p0 < hi:
                    m, l, acc = _block(
                        q, m, l, acc, p0, hi, t, crow, qk_scale,
                        o0, n0, ce0, pool0, ps0, bt_0, bta0, btb0, np0, tr0, epp0,
                        o1, n1, ce1, pool1, ps1, bt_1, bta1, btb1, np1, tr1, epp1,
                        o2, n2, ce2, pool2, ps2, bt_2, bta2, btb2, np2, tr2, epp2,
                        o3, n3, ce3, pool3, ps3, bt_3, bta3, btb3, np3, tr3, epp3,
                        d, dmask, pbase, fbase, KIND0, KIND1, KIND2, KIND3, FMT0, FMT1, FMT2, FMT3,
                        ANY_PLAIN, ANY_FP8, NOPE, ROPE_OFF, SCALE_OFF, BLOCK_N, DOT_FP32, IEEE,
                    )  # fmt: skip
                    p0 += BLOCK_N
            else:
                for p0 in range(lo, hi, BLOCK_N):
                    m, l, acc = _block(
                        q, m, l, acc, p0, hi, t, crow, qk_scale,
                        o0, n0, ce0, pool0, ps0, bt_0, bta0, btb0, np0, tr0, epp0,
                        o1, n1, ce1, pool1, ps1, bt_1, bta1, btb1, np1, tr1, epp1,
                        o2, n2, ce2, pool2, ps2, bt_2, bta2, btb2, np2, tr2, epp2,
                        o3, n3, ce3, pool3, ps3, bt_3, bta3, btb3, np3, tr3, epp3,
                        d, dmask, pbase, fbase, KIND0, KIND1, KIND2, KIND3, FMT0, FMT1, FMT2, FMT3,
                        ANY_PLAIN, ANY_FP8, NOPE, ROPE_OFF, SCALE_OFF, BLOCK_N, DOT_FP32, IEEE,
                    )  # fmt: skip
            pidx = (t * NSPLIT + c) * H + heads
            tl.store(part_m_ptr + pidx, m, mask=hmask)
            tl.store(part_l_ptr + pidx, l, mask=hmask)
            tl.store(part_acc_ptr + pidx[:, None] * D + d[None, :], acc, mask=hmask[:, None] & dmask[None, :])
    else:
        m = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
        l = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        if INTERP:
            c = 0
            while c < nchunks:
                lo = c * CHUNK
                hi = tl.minimum(total, lo + CHUNK)
                mi = tl.full([BLOCK_H], float("-inf"), tl.float32)
                li = tl.zeros([BLOCK_H], tl.float32)
                acci = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
                p0 = lo
                while p0 < hi:
                    mi, li, acci = _block(
                        q, mi, li, acci, p0, hi, t, crow, qk_scale,
                        o0, n0, ce0, pool0, ps0, bt_0, bta0, btb0, np0, tr0, epp0,
                        o1, n1, ce1, pool1, ps1, bt_1, bta1, btb1, np1, tr1, epp1,
                        o2, n2, ce2, pool2, ps2, bt_2, bta2, btb2, np2, tr2, epp2,
                        o3, n3, ce3, pool3, ps3, bt_3, bta3, btb3, np3, tr3, epp3,
                        d, dmask, pbase, fbase, KIND0, KIND1, KIND2, KIND3, FMT0, FMT1, FMT2, FMT3,
                        ANY_PLAIN, ANY_FP8, NOPE, ROPE_OFF, SCALE_OFF, BLOCK_N, DOT_FP32, IEEE,
                    )  # fmt: skip
                    p0 += BLOCK_N
                m, l, acc = _merge(m, l, acc, mi, li, acci)
                c += 1
        else:
            for c in range(0, nchunks):
                lo = c * CHUNK
                hi = tl.minimum(total, lo + CHUNK)
                mi = tl.full([BLOCK_H], float("-inf"), tl.float32)
                li = tl.zeros([BLOCK_H], tl.float32)
                acci = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
                for p0 in range(lo, hi, BLOCK_N):
                    mi, li, acci = _block(
                        q, mi, li, acci, p0, hi, t, crow, qk_scale,
                        o0, n0, ce0, pool0, ps0, bt_0, bta0, btb0, np0, tr0, epp0,
                        o1, n1, ce1, pool1, ps1, bt_1, bta1, btb1, np1, tr1, epp1,
                        o2, n2, ce2, pool2, ps2, bt_2, bta2, btb2, np2, tr2, epp2,
                        o3, n3, ce3, pool3, ps3, bt_3, bta3, btb3, np3, tr3, epp3,
                        d, dmask, pbase, fbase, KIND0, KIND1, KIND2, KIND3, FMT0, FMT1, FMT2, FMT3,
                        ANY_PLAIN, ANY_FP8, NOPE, ROPE_OFF, SCALE_OFF, BLOCK_N, DOT_FP32, IEEE,
                    )  # fmt: skip
                m, l, acc = _merge(m, l, acc, mi, li, acci)
        out = tl.math.div_rn(acc, l[:, None])
        tl.store(
            out_ptr + t * so_t + heads[:, None] * so_h + d[None, :],
            cast_to(out, out_ptr.dtype.element_ty),
            mask=hmask[:, None] & dmask[None, :],
        )


@triton.jit
def _combine_kernel(
    sink_ptr,
    out_ptr,
    so_t,
    so_h,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    nvalid_ptr,
    H,
    D,
    CHUNK,
    NSPLIT,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    nv = nvalid_ptr + t * 4
    total = tl.load(nv) + tl.load(nv + 1) + tl.load(nv + 2) + tl.load(nv + 3)
    nchunks = (total + CHUNK - 1) // CHUNK
    m = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    amask = hmask[:, None] & dmask[None, :]
    if INTERP:
        c = 0
        while c < nchunks:
            pidx = (t * NSPLIT + c) * H + heads
            mi = tl.load(part_m_ptr + pidx, mask=hmask, other=0.0)
            li = tl.load(part_l_ptr + pidx, mask=hmask, other=0.0)
            acci = tl.load(part_acc_ptr + pidx[:, None] * D + d[None, :], mask=amask, other=0.0)
            m, l, acc = _merge(m, l, acc, mi, li, acci)
            c += 1
    else:
        for c in range(0, nchunks):
            pidx = (t * NSPLIT + c) * H + heads
            mi = tl.load(part_m_ptr + pidx, mask=hmask, other=0.0)
            li = tl.load(part_l_ptr + pidx, mask=hmask, other=0.0)
            acci = tl.load(part_acc_ptr + pidx[:, None] * D + d[None, :], mask=amask, other=0.0)
            m, l, acc = _merge(m, l, acc, mi, li, acci)
    out = tl.math.div_rn(acc, l[:, None])
    tl.store(
        out_ptr + t * so_t + heads[:, None] * so_h + d[None, :],
        cast_to(out, out_ptr.dtype.element_ty),
        mask=amask,
    )


# ---------------------------------------------------------------------------------------------
# host side


@dataclass(frozen=True)
class Plan:
    """How a call is launched: ``split`` (split-KV + combine) or direct, ``chunk`` keys per chunk."""

    split: bool
    chunk: int
    nsplit: int


def plan_launch(t: int, h: int, max_keys: int, cfg: AttentionConfig, device: torch.device) -> Plan:
    """Launch shape from static shapes only (``T``, ``H``, the widest key list).

    Batch-invariant mode: chunks of :data:`BI_CHUNK` keys whatever the batch (either launch
    shape gives the same bits).  Otherwise one chunk per query (direct) when the programs
    fill at least half the GPU, else split-KV with chunks of at least :data:`MIN_SPLIT_KEYS`
    keys.
    """
    hb = cdiv(h, cfg.block_h)
    progs = t * hb
    sms = _num_sms(device)
    max_keys = max(max_keys, 1)
    if batch_invariant_enabled():
        chunk = max(BI_CHUNK, cfg.block_n)
        nsplit = cdiv(max_keys, chunk)
        # split only while the partials stay small; both shapes round alike
        split = nsplit > 1 and progs < sms
        return Plan(split=split, chunk=chunk, nsplit=nsplit if split else 1)
    whole = cdiv(max_keys, cfg.block_n) * cfg.block_n
    # H200, V4-Flash decode (640 keys): at 32 tokens split-KV (3 chunks) halves the time, at
    # 128 tokens (128 programs on 132 SMs) the direct launch is already faster
    if 2 * progs > sms:
        return Plan(split=False, chunk=whole, nsplit=1)
    want = min(cdiv(2 * sms, progs), cdiv(max_keys, MIN_SPLIT_KEYS))
    if want <= 1:
        return Plan(split=False, chunk=whole, nsplit=1)
    chunk = cdiv(cdiv(max_keys, want), cfg.block_n) * cfg.block_n
    return Plan(split=True, chunk=chunk, nsplit=cdiv(max_keys, chunk))


@dataclass(frozen=True)
class _Pools:
    """The pools of a call as the kernel takes them: per source the tensor it reads (a packed
    pool's ``data``) and its format; the base pointers of the two row-pointer vectors; the
    packed rows' layout (constexprs)."""

    tensors: list[torch.Tensor]
    formats: list[int]
    plain_base: torch.Tensor
    fp8_base: torch.Tensor
    layout: Fp8RowLayout | None


def _pools(q: torch.Tensor, kv_pools: Sequence[KVPool], placeholder: torch.Tensor) -> _Pools:
    tensors, formats, layout = [], [], None
    for i, pool in enumerate(kv_pools):
        if isinstance(pool, Fp8KVPool):
            if layout is None:
                layout = pool.layout
            elif (pool.dim, pool.rope_dim) != (layout.dim, layout.rope_dim):
                raise ValueError(
                    f"kv_pools[{i}] packs dim={pool.dim}, rope_dim={pool.rope_dim}; an earlier packed pool "
                    f"dim={layout.dim}, rope_dim={layout.rope_dim} (one row layout per call)"
                )
            data = pool.data
            if data.stride(1) != 1 or data.stride(0) % 8 or data.data_ptr() % 8:  # not a cache's layout
                data = data.clone(memory_format=torch.contiguous_format)  # 8-byte aligned rows
            tensors.append(data)
            formats.append(KV_FP8_V4)
        else:
            tensors.append(pool if pool.stride(1) == 1 else pool.contiguous())
            formats.append(KV_PLAIN)
    plain = [x for x, f in zip(tensors, formats, strict=True) if f == KV_PLAIN]
    packed = [x for x, f in zip(tensors, formats, strict=True) if f == KV_FP8_V4]
    return _Pools(tensors, formats, plain[0] if plain else q, packed[0] if packed else placeholder, layout)


def sparse_attention_impl(
    q: torch.Tensor,
    kv_pools: Sequence[KVPool],
    indices: Sequence[torch.Tensor | PagedIndex],
    sinks: torch.Tensor,
    scale: float,
    *,
    config: AttentionConfig | None = None,
    plan: Plan | None = None,
) -> torch.Tensor:
    """:func:`sparse_attention` with optional tile ``config`` / launch ``plan`` overrides (tests,
    benchmarks)."""
    t, h, d = q.shape
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or h == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    placeholder = torch.empty(1, dtype=torch.int64, device=q.device)  # never read: no fill launch
    pools = _pools(q, kv_pools, placeholder)
    cfg = config or default_config(h, d, q.dtype, packed=pools.layout is not None)
    kinds, fmts, idx_args, src_args = [], [], [], []
    ke, max_keys = 0, 0
    for pool, fmt, index in zip(pools.tensors, pools.formats, indices, strict=True):
        fmts.append(fmt)
        ps = pool.stride(0) // 8 if fmt == KV_FP8_V4 else pool.stride(0)  # packed: 8-byte words
        if isinstance(index, PagedIndex):
            bt = index.block_table
            kinds.append(SRC_PAGED)
            idx_args += [index.counts, index.counts.stride(0), 0, int(index.max_count)]
            src_args += [pool, ps, bt, bt.stride(0), bt.stride(1), max(bt.shape[1], 1)]
            src_args += [index.token_rows, index.token_rows.stride(0), int(index.entries_per_page)]
            max_keys += int(index.max_count)
        else:
            k = index.shape[1]
            kinds.append(SRC_ROWS if k > 0 else SRC_NONE)
            idx_args += [index, index.stride(0), index.stride(1), k]
            src_args += [pool, ps, placeholder, 0, 0, 1, placeholder, 0, 1]
            ke += k
            max_keys += k
    while len(kinds) < MAX_SOURCES:
        kinds.append(SRC_NONE)
        fmts.append(KV_PLAIN)
        idx_args += [placeholder, 0, 0, 0]
        src_args += [src_args[0], 0, placeholder, 0, 0, 1, placeholder, 0, 1]
    used = {f for f, k in zip(fmts, kinds, strict=True) if k != SRC_NONE}
    any_fp8 = KV_FP8_V4 in used
    lay = pools.layout

    nvalid, compact = _prologue(t, q.device, kinds, idx_args, ke)

    pl = plan or plan_launch(t, h, max_keys, cfg, q.device)
    block_d = max(16, pow2(d))
    hb = cdiv(h, cfg.block_h)
    fp32 = q.dtype == torch.float32
    common = dict(
        KIND0=kinds[0],
        KIND1=kinds[1],
        KIND2=kinds[2],
        KIND3=kinds[3],
        FMT0=fmts[0],
        FMT1=fmts[1],
        FMT2=fmts[2],
        FMT3=fmts[3],
        ANY_PLAIN=KV_PLAIN in used or not any_fp8,  # no key at all: a (never run) plain load
        ANY_FP8=any_fp8,
        NOPE=lay.nope if lay else 0,
        ROPE_OFF=lay.rope_offset if lay else 0,
        SCALE_OFF=lay.scale_offset if lay else 0,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        DOT_FP32=INTERPRETED or fp32,
        IEEE=fp32 and not INTERPRETED,
        INTERP=INTERPRETED,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    qk_scale = float(scale) * LOG2E  # (the kernels read the sinks in their dtype, as fp32)
    if pl.split:
        part_m = torch.empty((t, pl.nsplit, h), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((t, pl.nsplit, h, d), dtype=torch.float32, device=q.device)
    else:  # unused without a split
        part_m = part_l = part_acc = torch.empty(1, dtype=torch.float32, device=q.device)
    _attn_kernel[(t, hb, pl.nsplit if pl.split else 1)](
        q,
        q.stride(0),
        q.stride(1),
        sinks,
        out,
        out.stride(0),
        out.stride(1),
        part_m,
        part_l,
        part_acc,
        nvalid,
        compact,
        compact.stride(0),
        h,
        d,
        pl.chunk,
        pl.nsplit,
        qk_scale,
        *src_args,
        pools.plain_base,
        pools.fp8_base,
        SPLIT=pl.split,
        **common,
        **pdl_args(),
    )
    if pl.split:
        _combine_kernel[(t, hb)](
            sinks,
            out,
            out.stride(0),
            out.stride(1),
            part_m,
            part_l,
            part_acc,
            nvalid,
            h,
            d,
            pl.chunk,
            pl.nsplit,
            BLOCK_H=cfg.block_h,
            BLOCK_D=block_d,
            INTERP=INTERPRETED,
            num_warps=cfg.num_warps,
            **pdl_args(),
        )
    return out


PROLOGUE_BLOCK = 1024
"""The prologue's widest block of a list's rows: where every explicit list fits one (V4's
window and top-k lists), all sources are read before the first store, so the query's loads
wait out one latency instead of one a source (stores through ``compact`` could alias the
lists for the compiler, which then keeps each source's loads behind the stores before it)."""


def _prologue(t: int, device: torch.device, kinds: list[int], idx_args: list, ke: int):
    """Launch the prologue: ``(nvalid [T, 4], compact [T, max(ke, 1)])``."""
    nvalid = torch.empty((t, 4), dtype=torch.int32, device=device)
    compact = torch.empty((t, max(ke, 1)), dtype=torch.int32, device=device)
    widest = max([a for a, k in zip(idx_args[3::4], kinds, strict=True) if k == SRC_ROWS] + [1])
    block_c = min(max(16, pow2(widest)), PROLOGUE_BLOCK)
    _prologue_kernel[(t,)](
        nvalid,
        compact,
        compact.stride(0),
        *idx_args,
        KIND0=kinds[0],
        KIND1=kinds[1],
        KIND2=kinds[2],
        KIND3=kinds[3],
        BLOCK_C=block_c,
        INTERP=INTERPRETED,
        ONE_BLOCK=widest <= block_c,
        num_warps=4,
        **pdl_args(),
    )
    return nvalid, compact


def compact_sources(indices: Sequence[torch.Tensor | PagedIndex]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each source's valid keys per query and the explicit sources' valid rows compacted:
    ``(nvalid [T, 4] int32, compact [T, KE] int32)``, ``KE`` the explicit lists' total width.

    ``nvalid[t, i]``: the rows ``>= 0`` of list ``i``, or ``min(max(counts[t], 0), max_count)``
    of a :class:`PagedIndex`, zero past the call's sources; ``compact[t]`` holds the valid rows
    of the explicit lists, list after list, each in its order (the rest of the row is
    unspecified)."""
    first = indices[0].counts if isinstance(indices[0], PagedIndex) else indices[0]
    placeholder = torch.empty(1, dtype=torch.int64, device=first.device)  # never read
    kinds, idx_args, ke = [], [], 0
    for index in indices:
        if isinstance(index, PagedIndex):
            kinds.append(SRC_PAGED)
            idx_args += [index.counts, index.counts.stride(0), 0, int(index.max_count)]
        else:
            kinds.append(SRC_ROWS if index.shape[1] > 0 else SRC_NONE)
            idx_args += [index, index.stride(0), index.stride(1), index.shape[1]]
            ke += index.shape[1]
    while len(kinds) < MAX_SOURCES:
        kinds.append(SRC_NONE)
        idx_args += [placeholder, 0, 0, 0]
    return _prologue(first.shape[0], first.device, kinds, idx_args, ke)


def sparse_attention(
    q: torch.Tensor,
    kv_pools: Sequence[KVPool],
    indices: Sequence[torch.Tensor | PagedIndex],
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton ``sparse_attention``: the reference's signature, shapes and semantics.

    ``q`` ``[T, H, D]`` (fp32 / bf16 / fp16, any row and head strides), up to
    :data:`MAX_SOURCES` pools -- ``[N_i, D]`` tensors of q's dtype or packed
    :class:`~deepinfer_core.ops.kv_format.Fp8KVPool` pools of ``D`` values per row (all of
    one ``rope_dim``), in any mix -- with ``[T, K_i]`` row lists or :class:`PagedIndex` entries,
    ``sinks`` ``[H]``.  Returns a contiguous ``[T, H, D]``.
    """
    return sparse_attention_impl(q, kv_pools, indices, sinks, scale)


def max_keys_of(indices: Sequence[torch.Tensor | PagedIndex]) -> int:
    """The static bound on a query's key count (sum of list widths and ``max_count``)."""
    return sum(int(i.max_count) if isinstance(i, PagedIndex) else i.shape[1] for i in indices)


__all__ = [
    "BI_CHUNK",
    "KV_FP8_V4",
    "KV_PLAIN",
    "MAX_HEAD_DIM",
    "MAX_SOURCES",
    "AttentionConfig",
    "Plan",
    "compact_sources",
    "default_config",
    "max_keys_of",
    "plan_launch",
    "sparse_attention",
    "sparse_attention_impl",
]
