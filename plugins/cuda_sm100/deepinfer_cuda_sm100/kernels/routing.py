"""``moe_route``: expert scores, ``noaux_tc`` top-k or hash routing, renormalised weights
(contract: ``deepinfer_core/ops/moe.py``).

One kernel; a program routes ``BLOCK_T`` tokens (``BLOCK_T`` from the expert count alone), each
token's ``E`` scores held in registers as one row of a ``[BLOCK_T, BLOCK_E]`` tile:

1. **Scores** in fp32 from the logits, rounded to the logits' dtype where the reference's
   intermediate tensors are (``round_through``):

   - ``sqrtsoftplus``: ``sqrt(softplus(x))`` with torch's ``softplus`` (``beta=1``,
     ``threshold=20``: ``x if x > 20 else log1p(exp(x))``), the softplus rounded to the
     dtype before the square root (the reference's two ops);
   - ``sigmoid``: ``1 / (1 + exp(-x))``;
   - ``softmax``: ``exp(x - max) / sum``, the sum in the order of PyTorch's CUDA warp softmax
     (``PersistentSoftmax.cuh``, rows of at most 1024): lane ``l`` of ``W = min(pow2(E), 32)``
     adds ``e[l], e[l + W], ...`` in turn, then the lanes are combined by halving
     (``l + W/2``, then ``l + W/4``, ...: its xor-shuffle butterfly).

   On the GPU ``exp`` / ``log1p`` are libdevice's ``__nv_expf`` / ``__nv_log1pf`` (what
   PyTorch's CUDA kernels call: ``std::exp`` / ``::log1p``), without libdevice's flush to
   zero (``enable_reflect_ftz=False``: nvcc's default), divisions ``div.rn`` and square roots
   ``sqrt.rn`` (IEEE, as nvcc's defaults), multiply-adds contracted as Triton's LLVM does
   (nvcc contracts by default too): fp32 scores meant to equal PyTorch's CUDA ones bit for
   bit (``tests/test_routing_kernel.py`` checks it on the GPU).  Triton's interpreter has no
   libdevice: there ``exp`` and ``log1p`` are evaluated in float64 and rounded to fp32
   (correctly rounded but for rare halfway cases).  PyTorch's CPU kernels differ from both in
   the last bit now and then (SLEEF ``exp`` / ``log1p``, and a ``sqrt`` that is not always
   correctly rounded), so on the CPU the kernel matches the reference within tolerances, and
   a torch emulation of the kernel's arithmetic bit for bit.

2. **Selection** (learned routing): each score plus the correction bias (fp32, selection
   only) becomes an int64 key, ``(order-preserving int32 image of the fp32 bits) << 32 |
   (BLOCK_E - 1 - expert)``; ``k`` rounds of an integer max over the row pick the largest
   biased score, ties to the lower expert id, and retire it: exactly the order of the
   reference's stable descending sort (``-0.0`` counts as ``+0.0``, NaN above everything, as
   ``torch.sort`` orders them).  Integer max is exact, so the picks do not depend on any
   reduction order.  Hash routing reads the ids from ``fixed_ids`` instead (no selection; an
   id outside ``[0, E)`` gets weight 0 where the reference would raise: no value is checked
   on the host).

3. **Weights**: the chosen experts' uncorrected scores (extracted exactly: a masked sum with
   one non-zero term), summed in fp32 in the order of PyTorch's CUDA ``sum`` over a ``[T, k]``
   row (``Reduce.cuh``: ``B`` = largest power of two <= k lanes, lane ``x`` adding slots ``x``
   and ``x + B``, then adjacent lanes pairwise: for k=6 ``((w0+w4) + (w1+w5)) + (w2+w3)``),
   the sum rounded to the dtype, plus ``1e-20`` (rounded again), each weight divided by it
   (``div.rn``, rounded) and multiplied by ``routed_scale`` in fp32 (rounded once): the
   reference's op sequence.  PyTorch's CPU ``sum`` has another order: there fp32 weights may
   differ by an ulp (in bf16 / fp16 the sum of ``k`` dtype values is usually exact in fp32).

Batch invariance: a token's row is computed with element-wise operations and exact or
explicitly ordered row reductions only, so its results are bitwise the same whatever the
number of tokens or its position in a tile.  No host synchronisation and a grid from shapes
only (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED, cast_to, cdiv, exact_exp, libdevice, pow2, round_through
from .pdl import pdl_args, pdl_enter

SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
"""The scoring functions and their kernel codes."""

MAX_EXPERTS = 1024
"""Most experts: a token's scores are one register row (and softmax's warp order is PyTorch's
for rows of at most 1024)."""
MAX_TOP_K = 16
"""Most experts per token (the ``k`` selection rounds are unrolled)."""

_TILE_ELEMS = 1024  # scores per program: BLOCK_T = _TILE_ELEMS // BLOCK_E tokens (at most _MAX_BLOCK_T)
_MAX_BLOCK_T = 64
_WARP = 32  # lanes of PyTorch's warp softmax

_INTERP = tl.constexpr(INTERPRETED)
_I64_MIN = tl.constexpr(-(2**63))
_I32_MAX = tl.constexpr(2**31 - 1)
_TINY = tl.constexpr(2.0**-30)  # below it log1p(y) rounds to y in fp32


@triton.jit
def _log1p(y):
    """fp32 ``log1p`` of ``y >= 0``: libdevice's ``log1pf`` on the GPU; float64 in the interpreter
    (``1 + y`` is exact in float64 for ``y >= 2**-30``; below, ``log1p(y)`` rounds to ``y``)."""
    if _INTERP:
        big = tl.log(y.to(tl.float64) + 1.0).to(tl.float32)
        r = tl.where(y < _TINY, y, big)
    else:
        r = libdevice.log1p(y)
    return r


@triton.jit
def _tree_sum(acc, BLOCK_T: tl.constexpr, LANES: tl.constexpr):
    """``[BLOCK_T, LANES]`` -> ``[BLOCK_T]``: lanes combined by halving (``l + LANES/2``, then
    ``l + LANES/4``, ...), the order of a warp's xor-shuffle butterfly (``LANES <= 32``)."""
    if LANES >= 32:
        acc = tl.sum(tl.reshape(acc, [BLOCK_T, 2, 16]), axis=1)
    if LANES >= 16:
        acc = tl.sum(tl.reshape(acc, [BLOCK_T, 2, 8]), axis=1)
    if LANES >= 8:
        acc = tl.sum(tl.reshape(acc, [BLOCK_T, 2, 4]), axis=1)
    if LANES >= 4:
        acc = tl.sum(tl.reshape(acc, [BLOCK_T, 2, 2]), axis=1)
    if LANES >= 2:
        acc = tl.sum(tl.reshape(acc, [BLOCK_T, 2, 1]), axis=1)
    return tl.reshape(acc, [BLOCK_T])


@triton.jit
def _adjacent_sum(acc, BLOCK_T: tl.constexpr, N: tl.constexpr):
    """``[BLOCK_T, N]`` -> ``[BLOCK_T]`` by adjacent pairs (``(0+1) + (2+3)``, ...; ``N <= 16``),
    the order of a warp's shuffle-down reduction."""
    if N >= 16:
        acc = tl.sum(tl.reshape(acc, [BLOCK_T, 8, 2]), axis=2)
    if N >= 8:
        acc = tl.sum(tl.reshape(acc, [BLOCK_T, 4, 2]), axis=2)
    if N >= 4:
        acc = tl.sum(tl.reshape(acc, [BLOCK_T, 2, 2]), axis=2)
    if N >= 2:
        acc = tl.sum(tl.reshape(acc, [BLOCK_T, 1, 2]), axis=2)
    return tl.reshape(acc, [BLOCK_T])


@triton.jit
def _scores(
    row_ptr,
    stride_le,
    row_ok,
    E: tl.constexpr,
    SCORING_FN: tl.constexpr,
    dtype: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    LANES: tl.constexpr,
):
    """The ``[BLOCK_T, BLOCK_E]`` scores (fp32 holding ``dtype`` values) of the logit rows at
    ``row_ptr`` (``[BLOCK_T, 1]`` pointers); padded experts score 0."""
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    m2 = row_ok[:, None] & col_ok[None, :]
    x = tl.load(row_ptr + cols[None, :] * stride_le, mask=m2, other=0.0).to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))
    if SCORING_FN == 0:  # sqrt(softplus(x)), each op rounded to the dtype
        sp = tl.where(x > 20.0, x, _log1p(exact_exp(x)))
        s = round_through(tl.sqrt_rn(round_through(sp, dtype)), dtype)
    elif SCORING_FN == 1:  # sigmoid
        one = tl.full(x.shape, 1.0, tl.float32)
        s = round_through(tl.math.div_rn(one, 1.0 + exact_exp(-x)), dtype)
    else:  # softmax, the sum in PyTorch's warp-softmax order
        mx = tl.max(x, axis=1)
        lanes = tl.arange(0, LANES)
        acc = tl.zeros([BLOCK_T, LANES], dtype=tl.float32)
        for it in tl.static_range(BLOCK_E // LANES):
            c = it * LANES + lanes
            mi = row_ok[:, None] & (c < E)[None, :]
            xi = tl.load(row_ptr + c[None, :] * stride_le, mask=mi, other=0.0).to(tl.float32)
            xi = tl.where((c < E)[None, :], xi, float("-inf"))
            acc += exact_exp(xi - mx[:, None])
        total = _tree_sum(acc, BLOCK_T, LANES)
        s = round_through(tl.math.div_rn(exact_exp(x - mx[:, None]), total[:, None]), dtype)
    return s


@triton.jit
def _route_kernel(
    logits_ptr,
    stride_lt,
    stride_le,
    bias_ptr,
    stride_b,
    fixed_ptr,
    stride_ft,
    stride_fk,
    w_ptr,
    ids_ptr,
    n_rows,
    routed_scale,
    E: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    K_FOLD: tl.constexpr,
    SCORING_FN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HASH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    LANES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    dtype = w_ptr.dtype.element_ty
    # what does not depend on the logits is loaded before the scores' reductions (its latency
    # overlaps theirs): the selection bias, or the hash layers' fixed picks
    if HASH:
        fixed = ()
        for j in tl.static_range(K):
            pick = tl.load(fixed_ptr + rows * stride_ft + j * stride_fk, mask=row_ok, other=0)
            fixed = fixed + (pick.to(tl.int64),)
    elif HAS_BIAS:
        b = tl.load(bias_ptr + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)
    s = _scores(
        logits_ptr + rows[:, None] * stride_lt,
        stride_le,
        row_ok,
        E,
        SCORING_FN,
        dtype,
        BLOCK_T,
        BLOCK_E,
        LANES,
    )

    # ---- selection keys: (order-preserving image of the biased score) << 32 | reversed column
    if not HASH:
        if HAS_BIAS:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
            sel = s + b[None, :]
        else:
            sel = s
        sel = tl.where(sel == 0.0, 0.0, sel)  # -0.0 ties with +0.0, as in the sort
        bits = sel.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & _I32_MAX)  # signed order = float order
        key = tl.where(sel != sel, _I32_MAX, key)  # NaN first, as torch.sort puts it
        packed = (key.to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)[None, :]
        packed = tl.where(col_ok[None, :], packed, _I64_MIN)

    # ---- k picks and their (uncorrected) scores
    slots = tl.arange(0, K_PAD)
    wts = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int64)
    for j in tl.static_range(K):
        if HASH:
            idx = fixed[j]
        else:
            best = tl.max(packed, axis=1)
            idx = (BLOCK_E - 1 - best.to(tl.int32)).to(tl.int64)  # low 32 bits: reversed column
            packed = tl.where(cols[None, :] == idx[:, None], _I64_MIN, packed)
        w = tl.sum(tl.where(cols[None, :] == idx[:, None], s, 0.0), axis=1)  # one non-zero term
        wts = tl.where(slots[None, :] == j, w[:, None], wts)
        ids = tl.where(slots[None, :] == j, idx[:, None], ids)

    # ---- their sum in the order of PyTorch's CUDA sum over k (K_FOLD = largest power of two
    # <= K lanes, lane x adding slots x and x + K_FOLD, then adjacent lanes pairwise); the
    # padded slots hold +0.0 (adding them is exact)
    if K_FOLD < K_PAD:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        folded = tl.sum(tl.reshape(wts, [BLOCK_T, 2, K_FOLD]), axis=1)
    else:
        folded = wts
    total_w = _adjacent_sum(folded, BLOCK_T, K_FOLD)

    # ---- renormalise as the reference: w / (sum + 1e-20) * routed_scale, dtype roundings
    den = round_through(round_through(total_w, dtype) + 1e-20, dtype)
    q = round_through(tl.math.div_rn(wts, den[:, None]), dtype)
    out = cast_to(q * routed_scale, dtype)
    m_out = row_ok[:, None] & (slots < K)[None, :]
    offs = rows[:, None] * K + slots[None, :]
    tl.store(w_ptr + offs, out, mask=m_out)
    tl.store(ids_ptr + offs, ids, mask=m_out)


def last_pow2(n: int) -> int:
    """The largest power of two <= ``max(n, 1)``."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def block_rows(num_experts: int) -> int:
    """Tokens per program: from the expert count only (a token's results never depend on it)."""
    return max(1, min(_MAX_BLOCK_T, _TILE_ELEMS // pow2(num_experts)))


def moe_route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    fixed_ids: torch.Tensor | None,
    top_k: int,
    scoring: str,
    routed_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``moe_route``: same signature, shapes and semantics as the reference.

    ``logits`` ``[T, E]`` (fp32, bf16 or fp16; any strides), ``correction_bias`` ``[E]`` fp32
    or ``None``, ``fixed_ids`` ``[T, k]`` integer (hash routing: ``top_k`` and the bias are
    then ignored, as in the reference) or ``None``.  Returns contiguous ``(weights [T, k] in
    logits' dtype, ids [T, k] int64)``.  No host synchronisation; the grid depends on ``T``
    and ``E`` only.
    """
    t, e = logits.shape
    k = fixed_ids.shape[1] if fixed_ids is not None else int(top_k)
    weights = torch.empty(t, k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t == 0 or k == 0:
        return weights, ids
    hashed = fixed_ids is not None
    has_bias = correction_bias is not None and not hashed
    block_e = pow2(e)
    block_t = block_rows(e)
    _route_kernel[(cdiv(t, block_t),)](
        logits,
        logits.stride(0),
        logits.stride(1),
        correction_bias if has_bias else logits,
        correction_bias.stride(0) if has_bias else 0,
        fixed_ids if hashed else ids,
        fixed_ids.stride(0) if hashed else 0,
        fixed_ids.stride(1) if hashed else 0,
        weights,
        ids,
        t,
        float(routed_scale),
        E=e,
        K=k,
        K_PAD=pow2(k),
        K_FOLD=last_pow2(k),
        SCORING_FN=SCORING[scoring],
        HAS_BIAS=has_bias,
        HASH=hashed,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        LANES=min(block_e, _WARP),
        num_warps=4 if block_t * block_e <= 2048 else 8,
        enable_reflect_ftz=False,
        **pdl_args(),  # libdevice without flush to zero, as nvcc builds PyTorch
    )
    return weights, ids
