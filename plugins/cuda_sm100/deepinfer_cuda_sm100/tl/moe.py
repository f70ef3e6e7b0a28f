"""``moe_experts`` on FP4 e2m1 experts in TileLang: the two GEMM launches of the Triton path
(:mod:`deepinfer_cuda_sm100.kernels.moe`) as wgmma kernels on SM90, the other two reused.

Contract: ``deepinfer_core.ops.moe.moe_experts``.  Four launches, as the Triton path:

1. the Triton layout kernel (:func:`~deepinfer_cuda_sm100.kernels.moe.sorted_layout`): the
   ``P = T * k`` (token, slot) pairs sorted by expert into tiles of ``BLOCK_M`` rows;
2. :func:`build_gate_up`: ``h`` (bf16, per sorted row) = clamped SwiGLU of the tile's tokens
   times the expert's gate and up rows;
3. :func:`build_down`: each pair's contribution (bf16, per pair) = ``h`` times the expert's
   down rows, times the routing weight;
4. the Triton combine kernel: a token's ``k`` contributions summed in ascending expert order.

**The transposed product.**  At decode an expert sees a handful of tokens, while wgmma's M is
64: the kernels compute ``W @ X^T`` with the weights on wgmma's M side (64 output features per
accumulator) and the tile's ``BLOCK_M`` tokens as its N (16, 32 or 64), so no MMA row is spent
on padding.  A CTA takes :data:`ROWS` = 128 weight rows (gate: 64 intermediate features' gate
rows and their 64 up rows; down: 128 model features) of one expert and one tile of tokens, one
warpgroup (:data:`THREADS` = 128 threads), two fp32 accumulators ``[64, BLOCK_M]``.

**The K loop** (:data:`BLOCK_K` = 128 inputs a step, :data:`STAGES` deep, ``cp.async``):
each step copies the packed bytes ``[128, 64]`` (as two halves of 64 inputs, 32 bytes a row),
their ue8m0 (or fp32) scales ``[128, 4]`` and the activation rows ``[BLOCK_M, 128]`` (gathered
by token for gate / up, the sorted ``h`` rows for down) into shared memory; every thread then
decodes one group of 32 inputs of each of four 64-row blocks (a 16-byte shared load, 4 x 8
values by :data:`E2M1X8_PTX`, the scale applied, four 16-byte stores into the wgmma operand
tile, 128-byte swizzled); then 4 wgmma GEMMs ``[64, 64] x [64, BLOCK_M]`` (two K halves times
two accumulators) with fp32 accumulation.

**Dequantisation** (bitwise :meth:`QuantizedTensor.dequantize` ``(bf16)``, as the Triton
path): :data:`E2M1X8_PTX` turns 4 packed bytes into their 8 exact bf16 values in input order
(``prmt`` lookups: 15 integer instructions); a ue8m0 scale byte ``e`` is the bf16 ``e << 7``
(``2**(e - 127)``, exact; bytes 0 and 255 give 0 and inf where torch reads 2**-127 and NaN, as
the Triton path) and one ``mul.rn.bf16x2`` per two weights rounds the exact product once; an
fp32 scale multiplies in fp32, rounded to bf16 (the reference's fp32 product).

**Rounding points** as the Triton path: gate / up, ``silu(min(g, L))``, ``h`` and the down
output each rounded to bf16; the routing weight rounded to bf16 before it scales (the default
mode's rule; the batch-invariant mode keeps the Triton path, see below).

**Batch invariance.**  With tokens on the N side a token's column of the product depends on
its own activation row only, the K order (steps of 128, wgmma's k16 order) and the tile shape
are fixed by the static configuration, so a token's result here does not depend on the other
tokens as long as ``BLOCK_M`` stays the same.  The dispatcher
(:mod:`deepinfer_cuda_sm100.moe_dispatch`) picks TileLang or Triton by the token count, and
the two accumulate in different orders, so the batch-invariant mode runs Triton throughout.

**Cost** (offline lowering for sm_90 with TileLang 0.1.15, ``nvcc -arch=sm_90a``; gate / up,
``BLOCK_M`` 16): 72 registers (80 with fp32 scales), no spills, ~70 KB of shared memory (3
CTAs an SM).  A step of 16K weights per CTA moves ~740 shared-memory wavefronts: the decoded
tiles' stores (256) and wgmma's reads of them (256), the packed bytes (64 in, 64 out), the
activations (wgmma reads 64, copies 32), so shared memory bounds it near 20-22 weights per clock
and SM, ~2.8 TB/s of FP4 weights on an H200 (1.98 GHz, 132 SMs) at full shared-memory
throughput; the decoding itself issues ~2.9 instructions per weight (~1.6 warp instructions
per clock and SM at 2.5 TB/s, of 4).  TileLang's pipeline puts a ``__syncthreads`` at each
stage hand-over (~11 a step).  The way past the shared-memory bound is wgmma with the weights
in registers (decoded straight into the A fragment, the activations' K order permuted to
match), which TileLang's tile language does not express (a thread cannot address its own
fragment registers).  Not yet measured on a GPU.

Static configurations: ``(hidden, inter, BLOCK_M, scale kind)``, compiled once each
(:func:`_kernel`, TileLang's disk cache keeps them); token, tile and expert counts are dynamic.
"""

# No ``from __future__ import annotations``: TileLang reads the kernels' annotations as objects.
import functools

import torch

from deepinfer_cuda_sm100.e2m1_ptx import e2m1x8_bf16_ptx

ROWS = 128
"""Weight rows per CTA (two wgmma M atoms of 64)."""
ATOM = 64
"""Rows per accumulator (wgmma's M)."""
BLOCK_K = 128
"""Inputs per K step (two halves of :data:`HALF_K`, one 128-byte swizzle atom each in bf16)."""
HALF_K = 64
GROUP = 32
"""Inputs per scale (the FP4 expert format's group; the kernels take this group only)."""
THREADS = 128
"""One warpgroup."""
STAGES = 3
"""Pipeline depth of the copies."""
SCALE_KINDS = ("ue8m0", "fp32")

# 4 packed bytes ($4; byte b holds inputs 2b (low nibble) and 2b + 1) -> 8 exact bf16 values in
# input order ($0 = inputs 0, 1; ... $3 = inputs 6, 7); how: :mod:`deepinfer_cuda_sm100.e2m1_ptx`.
E2M1X8_PTX = e2m1x8_bf16_ptx(((0, "0x5140"), (0, "0x7362"), (1, "0x5140"), (1, "0x7362")))
MUL_BF16X2_PTX = "mul.rn.bf16x2 $0, $1, $2;"
"""Two bf16 products, each the exact product rounded once to nearest even (subnormals kept)."""

DECODE_UE8M0 = "deepinfer_e2m1x32_ue8m0"
DECODE_FP32 = "deepinfer_e2m1x32_fp32"


def _cuda_asm(ptx: str) -> str:
    """PTX text with ``$k`` operands as a CUDA ``asm`` string body (``%k``)."""
    import re

    body = re.sub(r"\$(\d+)", r"%\1", ptx)
    return "".join(f'"{line}\\n"\n' for line in body.splitlines())


def decode_source() -> str:
    """The CUDA device functions the kernels call: 16 packed bytes (32 inputs of one scale
    group) at ``packed`` -> 32 bf16 weights at ``out`` (both 16-byte aligned)."""
    return f"""
#ifndef DEEPINFER_E2M1X32
#define DEEPINFER_E2M1X32
__device__ __forceinline__ void deepinfer_e2m1x8(unsigned w, unsigned* o) {{
  asm(
{_cuda_asm(E2M1X8_PTX)}    : "=r"(o[0]), "=r"(o[1]), "=r"(o[2]), "=r"(o[3]) : "r"(w));
}}
__device__ __forceinline__ unsigned deepinfer_mul_bf16x2(unsigned a, unsigned b) {{
  unsigned d;
  asm({_cuda_asm(MUL_BF16X2_PTX).strip()} : "=r"(d) : "r"(a), "r"(b));
  return d;
}}
__device__ __forceinline__ void {DECODE_UE8M0}(const void* packed, void* out, unsigned char e) {{
  const uint4 p = *reinterpret_cast<const uint4*>(packed);
  const unsigned s = ((unsigned)e << 7) | ((unsigned)e << 23);  // bf16x2 of 2**(e - 127)
  const unsigned words[4] = {{p.x, p.y, p.z, p.w}};
  uint4* o = reinterpret_cast<uint4*>(out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    unsigned v[4];
    deepinfer_e2m1x8(words[i], v);
    o[i] = make_uint4(deepinfer_mul_bf16x2(v[0], s), deepinfer_mul_bf16x2(v[1], s),
                      deepinfer_mul_bf16x2(v[2], s), deepinfer_mul_bf16x2(v[3], s));
  }}
}}
__device__ __forceinline__ unsigned deepinfer_scale_pair(unsigned v, float s) {{
  const float lo = __uint_as_float(v << 16) * s;
  const float hi = __uint_as_float(v & 0xFFFF0000u) * s;
  unsigned d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}}
__device__ __forceinline__ void {DECODE_FP32}(const void* packed, void* out, float s) {{
  const uint4 p = *reinterpret_cast<const uint4*>(packed);
  const unsigned words[4] = {{p.x, p.y, p.z, p.w}};
  uint4* o = reinterpret_cast<uint4*>(out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    unsigned v[4];
    deepinfer_e2m1x8(words[i], v);
    o[i] = make_uint4(deepinfer_scale_pair(v[0], s), deepinfer_scale_pair(v[1], s),
                      deepinfer_scale_pair(v[2], s), deepinfer_scale_pair(v[3], s));
  }}
}}
#endif
"""


def _scale_dtype(scale: str) -> str:
    return "uint8" if scale == "ue8m0" else "float32"


def _macros(scale: str):
    """The K step's pieces shared by both kernels: the weight copies, the decoding, the GEMMs."""
    import tilelang.language as T

    fn = DECODE_UE8M0 if scale == "ue8m0" else DECODE_FP32
    src = decode_source()

    @T.macro
    def copy_weights(w, s, e, row0, row1, k, wp, sc):
        """Stage 0 (``cp.async``): the packed bytes of rows ``row0 + [0, 64)`` (block 0) and
        ``row1 + [0, 64)`` (block 1), inputs ``k * 128 + [0, 128)``, into ``wp[half, row, byte]``
        (``row`` = block * 64 + r), and their 4 scales a row into ``sc[row, group]``."""
        for hf, r, c in T.Parallel(2, ROWS, HALF_K // 2):
            src_row = T.if_then_else(r < ATOM, row0 + r, row1 + r - ATOM)
            wp[hf, r, c] = w[e, src_row, k * (BLOCK_K // 2) + hf * (HALF_K // 2) + c]
        for r, g in T.Parallel(ROWS, BLOCK_K // GROUP):
            src_row = T.if_then_else(r < ATOM, row0 + r, row1 + r - ATOM)
            sc[r, g] = s[e, src_row, k * (BLOCK_K // GROUP) + g]

    @T.macro
    def decode(wp, sc, wd, b, hf, packed, vals):
        """Stage 1: every thread decodes one scale group (32 inputs) of block ``b`` and K half
        ``hf`` into the bf16 operand tile ``wd`` (thread ``t``: row ``t // 2``, group ``t % 2``
        of the half: a quarter warp covers 4 rows x 64 inputs, so both the 16-byte shared loads
        and the 16-byte stores into the 128-byte swizzled tile are free of bank conflicts)."""
        T.import_source(src)
        tx = T.get_thread_binding()
        row = tx // 2
        gh = tx % 2
        for v in T.vectorized(16):
            packed[v] = wp[hf, b * ATOM + row, gh * 16 + v]
        T.call_extern(
            "handle", fn, T.address_of(packed[0]), T.address_of(vals[0]), sc[b * ATOM + row, hf * 2 + gh]
        )
        for j in T.unroll(4):
            for v in T.vectorized(8):
                wd[row, gh * 32 + j * 8 + v] = vals[j * 8 + v]

    @T.macro
    def step_math(wp, sc, wd, xs, acc, packed, vals):
        """Stage 1: block 0 decoded and its two GEMMs issued (asynchronous wgmma), block 1
        decoded meanwhile, then its two GEMMs synchronously: their wait (all wgmma) comes before
        the pipeline refills the activation stage the GEMMs read (TileLang schedules the refill
        after the stage's last GEMM, not after an asynchronous GEMM's wait)."""
        decode(wp, sc, wd[0][0], 0, 0, packed, vals)
        decode(wp, sc, wd[0][1], 0, 1, packed, vals)
        T.wgmma_gemm(wd[0][0], xs[0], acc[0], transpose_B=True)
        T.wgmma_gemm(wd[0][1], xs[1], acc[0], transpose_B=True)
        decode(wp, sc, wd[1][0], 1, 0, packed, vals)
        decode(wp, sc, wd[1][1], 1, 1, packed, vals)
        T.gemm(wd[1][0], xs[0], acc[1], transpose_B=True)
        T.gemm(wd[1][1], xs[1], acc[1], transpose_B=True)

    return copy_weights, step_math


def _alloc_step(block_m: int, scale: str):
    """Shared tiles of one K step (TileLang multi-buffers those the copies fill), the two
    accumulators and the decoding's registers."""
    import tilelang.language as T

    wp = T.alloc_shared((2, ROWS, HALF_K // 2), "uint8")
    sc = T.alloc_shared((ROWS, BLOCK_K // GROUP), _scale_dtype(scale))
    wd = [[T.alloc_shared((ATOM, HALF_K), "bfloat16") for _ in range(2)] for _ in range(2)]
    xs = [T.alloc_shared((block_m, HALF_K), "bfloat16") for _ in range(2)]
    acc = [T.alloc_fragment((ATOM, block_m), "float32") for _ in range(2)]
    packed = T.alloc_local((16,), "uint8")
    vals = T.alloc_local((GROUP,), "bfloat16")
    return wp, sc, wd, xs, acc, packed, vals


def build_gate_up(hidden: int, inter: int, block_m: int, scale: str, stages: int = STAGES):
    """The gate / up ``prim_func``: grid ``(inter / 64, tiles)``; CTA ``(nb, tile)`` writes
    ``h[tile * BLOCK_M + j, nb * 64 + i]`` for the tile's real rows ``j``.

    Args:
        hidden: ``D`` (a multiple of :data:`BLOCK_K`); inter: ``I`` (a multiple of 64).
        block_m: ``BLOCK_M`` (16, 32 or 64); scale: ``"ue8m0"`` or ``"fp32"``.
    """
    import tilelang.language as T

    D, I, BM = hidden, inter, block_m
    n_tok, n_tiles, n_slots, n_exp = T.dynamic("T"), T.dynamic("NT"), T.dynamic("NS"), T.dynamic("E")
    copy_weights, step_math = _macros(scale)

    @T.prim_func
    def moe_gate_up(
        x: T.Tensor((n_tok, D), "bfloat16"),
        tile_expert: T.Tensor((n_tiles,), "int32"),
        slot_pair: T.Tensor((n_slots,), "int32"),
        w: T.Tensor((n_exp, 2 * I, D // 2), "uint8"),
        s: T.Tensor((n_exp, 2 * I, D // GROUP), _scale_dtype(scale)),
        h: T.Tensor((n_slots, I), "bfloat16"),
        limit: T.float32,
        top_k: T.int32,
    ):
        with T.Kernel(I // ATOM, n_tiles, threads=THREADS) as (nb, tile):
            wp, sc, wd, xs, acc, packed, vals = _alloc_step(BM, scale)
            tok = T.alloc_shared((BM,), "int32")
            e = tile_expert[tile]
            if e < n_exp:  # tiles past the used ones read nothing
                for r in T.Parallel(BM):
                    tok[r] = T.max(slot_pair[tile * BM + r], 0) // top_k
                T.clear(acc[0])
                T.clear(acc[1])
                for k in T.Pipelined(D // BLOCK_K, num_stages=stages):
                    copy_weights(w, s, e, nb * ATOM, I + nb * ATOM, k, wp, sc)
                    for half in (0, 1):
                        for r, c in T.Parallel(BM, HALF_K):
                            xs[half][r, c] = x[tok[r], k * BLOCK_K + half * HALF_K + c]
                    step_math(wp, sc, wd, xs, acc, packed, vals)
                for i, j in T.Parallel(ATOM, BM):
                    g = T.min(T.Cast("float32", T.Cast("bfloat16", acc[0][i, j])), limit)
                    u = T.Cast("float32", T.Cast("bfloat16", acc[1][i, j]))
                    u = T.min(T.max(u, -limit), limit)
                    act = T.Cast("float32", T.Cast("bfloat16", g / (1.0 + T.exp(-g))))
                    if slot_pair[tile * BM + j] >= 0:
                        h[tile * BM + j, nb * ATOM + i] = T.Cast("bfloat16", act * u)

    return moe_gate_up


def build_down(hidden: int, inter: int, block_m: int, scale: str, stages: int = STAGES):
    """The down ``prim_func``: grid ``(hidden / 128, tiles)``; CTA ``(nb, tile)`` writes
    ``y[pair, nb * 128 + i]`` for the pairs of the tile's real rows: the bf16 product rounded,
    times the routing weight rounded to bf16, rounded.

    Args:
        hidden: ``D`` (a multiple of 128); inter: ``I`` (a multiple of :data:`BLOCK_K`);
        block_m, scale: as :func:`build_gate_up`.
    """
    import tilelang.language as T

    D, I, BM = hidden, inter, block_m
    n_tok, n_tiles, n_slots, n_exp = T.dynamic("T"), T.dynamic("NT"), T.dynamic("NS"), T.dynamic("E")
    n_pairs, kk = T.dynamic("P"), T.dynamic("K")
    copy_weights, step_math = _macros(scale)

    @T.prim_func
    def moe_down(
        hs: T.Tensor((n_slots, I), "bfloat16"),
        tile_expert: T.Tensor((n_tiles,), "int32"),
        slot_pair: T.Tensor((n_slots,), "int32"),
        w: T.Tensor((n_exp, D, I // 2), "uint8"),
        s: T.Tensor((n_exp, D, I // GROUP), _scale_dtype(scale)),
        rw: T.Tensor((n_tok, kk), "float32"),
        y: T.Tensor((n_pairs, D), "bfloat16"),
    ):
        with T.Kernel(D // ROWS, n_tiles, threads=THREADS) as (nb, tile):
            wp, sc, wd, xs, acc, packed, vals = _alloc_step(BM, scale)
            e = tile_expert[tile]
            if e < n_exp:
                T.clear(acc[0])
                T.clear(acc[1])
                for k in T.Pipelined(I // BLOCK_K, num_stages=stages):
                    copy_weights(w, s, e, nb * ROWS, nb * ROWS + ATOM, k, wp, sc)
                    for half in (0, 1):
                        T.copy(
                            hs[
                                tile * BM : tile * BM + BM,
                                k * BLOCK_K + half * HALF_K : k * BLOCK_K + half * HALF_K + HALF_K,
                            ],
                            xs[half],
                        )
                    step_math(wp, sc, wd, xs, acc, packed, vals)
                for b in (0, 1):
                    for i, j in T.Parallel(ATOM, BM):
                        p = slot_pair[tile * BM + j]
                        if p >= 0:
                            wt = T.Cast("float32", T.Cast("bfloat16", rw[p // kk, p % kk]))
                            v = T.Cast("float32", T.Cast("bfloat16", acc[b][i, j])) * wt
                            y[p, nb * ROWS + b * ATOM + i] = T.Cast("bfloat16", v)

    return moe_down


PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}
"""``cp.async`` pipelines in one warpgroup (no TMA producer warpgroup)."""


@functools.cache
def _kernel(kind: str, hidden: int, inter: int, block_m: int, scale: str):
    """A compiled kernel (``kind``: ``"gate_up"`` or ``"down"``)."""
    import tilelang

    build = build_gate_up if kind == "gate_up" else build_down
    func = build(hidden, inter, block_m, scale)
    return tilelang.compile(func, out_idx=None, target="cuda", pass_configs=PASS_CONFIGS)


def scale_kind(w) -> str:
    """``"ue8m0"`` or ``"fp32"``: the scale format of the FP4 stack ``w``."""
    return "fp32" if w.scale.dtype == torch.float32 else "ue8m0"


def launch_plan(tokens: int, top_k: int, experts: int, hidden: int, inter: int) -> dict:
    """The launches of a call (shapes only, the batch-invariant mode off): ``block_m`` (the
    Triton path's :func:`~deepinfer_cuda_sm100.kernels.moe.tile_rows`), ``tiles`` (its
    :func:`~deepinfer_cuda_sm100.kernels.moe.tile_count`) and the two grids, ``(feature
    blocks, tiles)``: gate / up ``inter / 64`` blocks of 64 intermediate features (each with
    their gate and up rows), down ``hidden / 128`` blocks of 128 model features."""
    from deepinfer_cuda_sm100.kernels.moe import tile_count, tile_rows

    pairs = tokens * top_k
    bm = tile_rows(pairs, experts, False)
    tiles = tile_count(pairs, experts, bm)
    return {
        "block_m": bm,
        "tiles": tiles,
        "gate_up_grid": (inter // ATOM, tiles),
        "down_grid": (hidden // ROWS, tiles),
    }


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte aligned start (the kernels copy 16-byte vectors)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def moe_experts(x, ids, weights, gate_up, down, limit, shared=None) -> torch.Tensor:
    """The op on FP4 stacks (:func:`~deepinfer_cuda_sm100.moe_dispatch.tilelang_supports`
    says which calls it takes): the Triton layout, the two TileLang GEMMs, the Triton combine."""
    from deepinfer_cuda_sm100.kernels import moe as triton_moe

    t, d = x.shape
    top_k = ids.shape[1]
    experts, inter = gate_up.shape[0], down.shape[2]
    plan = launch_plan(t, top_k, experts, d, inter)
    bm = plan["block_m"]
    ids = ids if ids.stride(1) == 1 else ids.contiguous()
    tile_expert, slot_pair = triton_moe.sorted_layout(ids, experts, bm)
    x = _aligned(x)
    h = torch.empty(plan["tiles"] * bm, inter, dtype=x.dtype, device=x.device)
    gu_scale = gate_up.scale.view(torch.uint8) if scale_kind(gate_up) == "ue8m0" else gate_up.scale
    _kernel("gate_up", d, inter, bm, scale_kind(gate_up))(
        x, tile_expert, slot_pair, gate_up.data, gu_scale, h, float(limit), top_k
    )
    y = torch.empty(t * top_k, d, dtype=x.dtype, device=x.device)
    dn_scale = down.scale.view(torch.uint8) if scale_kind(down) == "ue8m0" else down.scale
    rw = weights.to(torch.float32).contiguous()
    _kernel("down", d, inter, bm, scale_kind(down))(h, tile_expert, slot_pair, down.data, dn_scale, rw, y)
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    return triton_moe.combine_pairs(y, ids, experts, False, shared, out)
