"""``moe_experts`` on FP4 e2m1 experts in TileLang: the two GEMM launches of the Triton path
(:mod:`deepinfer_cuda_sm100.kernels.moe`) as register-A wgmma kernels on SM90, the other two
reused.

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
accumulator) and the tile's ``BLOCK_M`` tokens as its N (16, 32, 64 or 128), so no MMA row is spent
on padding.  A CTA takes :data:`ROWS` = 128 weight rows (gate: 64 intermediate features' gate
rows and their 64 up rows; down: 128 model features) of one expert and one tile of tokens, two
fp32 accumulators ``[64, BLOCK_M]``.

**Producer and consumer** (as :mod:`deepinfer_cuda_sm100.tl.fp8_gemm`): TileLang's warp
specialisation adds a producer warpgroup that fills a :data:`STAGES`-deep ring of shared
buffers per K step of :data:`BLOCK_K` = 128 inputs: the packed bytes ``[128, 64]`` by TMA (two
boxes for gate / up), their scales ``[128, 4]`` by 4-byte (ue8m0) or 16-byte (fp32)
``cp.async``, the activations ``[BLOCK_M, 128]`` by TMA (down: the sorted ``h`` rows) or
4-byte ``cp.async`` gathered by token (gate / up; a thread keeps one row, a warp reads 32
contiguous bytes of each of four rows; with ``gathered``, by TMA from the rows that
:func:`~deepinfer_cuda_sm100.kernels.moe_gather.gather_sorted_rows` wrote in K order before the
launch, as the down kernel reads ``h``).  The consumer warpgroup decodes each 64-row block
straight into wgmma's A fragment in registers and issues ``wgmma`` with A from registers and
the activations from shared memory (block 0's GEMMs asynchronous while block 1 decodes): the
weights cross shared memory once, as packed bytes; no decoded tile is stored.  The registers are
split by ``setmaxnreg`` (:data:`SPLIT_REGS`): the producer drops to 24 (40 at ``BLOCK_M`` 64),
the consumers rise to what more CTAs an SM leave them (four CTAs an SM at ``BLOCK_M`` 16, three
at 32, two at 64, where the compiler's allotment left room for two, two and one: the kernel is
latency bound, ncu on an H200 showing 0.4 instructions a cycle and scheduler with one CTA of the
wide variant an SM). ``split_registers=False`` keeps the compiler's allotment (the same bits).
TileLang has no statement for a thread's own fragment registers; the kernels annotate the A
fragments with the layout ``T.gemm`` wants for them (:func:`a_fragment_layout`) and hand a
device function (:func:`decode_source`) the address of fragment element ``(0, 0)``, local index
0 of every thread's register array, which it fills by the register order of the layout
(:func:`a_register`).

**The wide variant** (``consumers=2``; the dispatcher's language ``"tilelang_wide"``).  A CTA
of two consumer warpgroups, each owning 128 weight rows as above (gate / up: the CTA covers 128
intermediate features, warpgroup ``g`` their gate and up rows ``64 g ..``; down: 256 model
features, block ``b`` rows ``128 b ..`` of which warpgroup ``g`` holds ``64 g ..``), both
against the CTA's one activation tile in shared memory (the producer's gathers per weight
halved).  The A fragments and accumulators span 128 rows with ``T.gemm``'s ``FullRow`` policy
(8 warps in one column; :func:`a_fragment_layout` ``(128)`` is that policy's wgmma layout, and
:func:`~deepinfer_cuda_sm100.tl.fp8_gemm.fix_wgmma_accumulator_fence` makes TileLang fence a
warpgroup's own accumulator registers).  TileLang gives the producer as many threads as the
consumers when it issues ``cp.async`` gathers, so a CTA has 512 threads; the registers are split
by ``setmaxnreg`` (:data:`WIDE_REGS`): the producer drops to 24, the consumers rise to 104 with
``__launch_bounds__(512, 2)`` at ``BLOCK_M`` 16 (two CTAs an SM: 512 x 64 registers a CTA), to
232 with one CTA an SM at 32 and 64 (at 32 the consumers need more than 104: 12-28 bytes of
spills).  Each output row is computed by one warpgroup with the same wgmma shapes, K order,
decoding and rounding points as the one-warpgroup kernels: the result is bitwise theirs.

**The K order.**  In the A fragment of ``m64nNk16`` the thread ``c`` of a quad holds, of each
row, the k pairs ``2c, 2c + 1`` of every 8.  The kernels permute each step's 128 inputs
(:func:`k_position`) so that those are inputs ``32c .. 32c + 31``: one scale group, 16
contiguous packed bytes, one shared load per row.  Both operands share the order: the gate /
up gather stores each 4-byte input pair at its position, the gate / up epilogue writes ``h``
in the order the down kernel reads (``h`` is private to the op), and K being the contracted
dimension the product is unchanged.

**Dequantisation** (bitwise :meth:`QuantizedTensor.dequantize` ``(bf16)``, as the Triton
path): per row and scale group the consumer builds the lookup tables of the scaled magnitudes
(:data:`~deepinfer_cuda_sm100.e2m1_ptx.TABLE_UE8M0_PTX`: the 8 e2m1 magnitudes times the ue8m0
scale by ``mul.rn.bf16x2``, bytes 0 and 255 giving 0 and inf where torch reads 2**-127 and NaN,
as the Triton path; :data:`~deepinfer_cuda_sm100.e2m1_ptx.TABLE_FP32_PTX`: their fp32 products
with the fp32 scale, each rounded once to bf16, as the reference), then :data:`E2M1X8_PTX`
looks up 8 weights a 32-bit word (``prmt``, 15 instructions, the sign applied per byte): each
weight the rounded product of its exact value and its scale.  fp32 accumulation (wgmma).

**Rounding points** as the Triton path: gate / up, ``silu(min(g, L))``, ``h`` and the down
output each rounded to bf16; the routing weight rounded to bf16 before it scales (the default
mode's rule; the batch-invariant mode keeps the Triton path, see below).  The down kernel reads
the routing weights in their own dtype (:func:`routing_weights`: ``moe_route``'s bf16 ones
without a conversion launch), flattened, and its epilogue reads each tile row's pair and weight
once into shared memory for all of the row's outputs (the gate / up epilogue likewise its rows'
pairs): read per output, with the bounds checks of their indices and the division of a pair by
the top-k, they had made the down epilogue about five times the instructions it is now (offline,
``nvcc 13 -arch=sm_90a``: 6,213 against 1,091 SASS instructions after the last wgmma at
``BLOCK_M`` 32, the main loop's ~500 running 16 times).

**Batch invariance.**  With tokens on the N side a token's column of the product depends on
its own activation row only, the K order and the tile shape are fixed by the static
configuration, so a token's result here does not depend on the other tokens as long as
``BLOCK_M`` stays the same.  The dispatcher (:mod:`deepinfer_cuda_sm100.moe_dispatch`) picks
TileLang or Triton by the token count, and the two accumulate in different orders, so the
batch-invariant mode runs Triton throughout.

**Cost (an offline estimate, not a measurement)**: lowered for sm_90 with TileLang 0.1.15, built
with ``nvcc 13 -arch=sm_90a``; a K step of a CTA is 16,384 weights; gate / up, ``BLOCK_M`` 16,
ue8m0 scales (fp32 in brackets); "before": the previous version, one warpgroup decoding into
swizzled bf16 tiles in shared memory for shared-memory wgmma:

| | register A (this) | before |
| --- | --- | --- |
| registers (no spills) | 106 (107): two CTAs an SM | 72 (80) |
| SASS a thread a step | consumer 377 (415), no shared stores; producer 127 / 82 | 644 (895) |
| warp instructions a step | ~1,880 (2,040); down ~1,770 (1,930) | 2,576 (3,580); down 2,556 (3,564) |
| shared-memory bytes a weight | ~1.8 (packed bytes in and out once) | ~5.7 (decoded tiles stored, read) |
| shared-memory wavefronts a step | ~340 (~48 weights a clock and SM) | ~740 (~22) |

(``BLOCK_M`` 32: 124 registers, two CTAs an SM; 64: 155, one; shared memory 51 KB, ``BLOCK_M``
64 with fp32 scales 106 KB; these counts and CTAs an SM are the compiler's allotment,
``split_registers=False``: :data:`SPLIT_REGS` now fits more CTAs an SM.) Shared memory stops
being the bound; the integer pipe becomes it: the consumer issues 242 ALU-pipe instructions a
thread a step (``prmt`` 177; the pipe takes 16 lanes a clock per SMSP), ~29-34 weights a clock
and SM with and without the producer's ALU work: **~3.8-4.4 TB/s of FP4 weights** on an H200
(132 SMs, 1.98 GHz) at full pipe throughput (~4.5 TB/s at full issue, 4 warp instructions a
clock and SM), near HBM's ~4.3 TB/s copy rate; 2.5 TB/s needs ~60-65 % of the pipe.

**The wide variant's resources (an offline estimate, not a measurement)**: lowered for sm_90
with TileLang 0.1.15, ``nvcc 13 -arch=sm_90a -Xptxas -v``; every configuration (gate / up and
down, both scale kinds) without spills, stack frame or local memory; "highest register" is the
highest register the SASS names (consumer code, under its ``setmaxnreg`` ceiling); shared memory
per CTA, ue8m0 (fp32) scales, 4 stages; "one": the one-warpgroup kernels (256 threads, no
``setmaxnreg``), "wide": registers at launch / producer / consumers, and the highest register;
"CTAs, warps": CTAs and consumer warps an SM; BM: ``BLOCK_M``; shared memory in KiB:

| BM | one: registers | one: shared | one: CTAs, warps | wide: registers | wide: shared | wide: CTAs, warps |
| --- | --- | --- | --- | --- | --- | --- |
| 16 | 106-107 | 50 (56) | 2, 8 | 64 / 24 / 104, R92 | 84 (96) | 2, 16 |
| 32 | 122-126 | 68 (80) | 2, 8 | 128 / 24 / 232, R122 | 100 (112) | 1, 8 |
| 64 | 154-158 | 100 (104) | 1, 4 | 128 / 24 / 232, R155 | 132 (144) | 1, 8 |

Measured on an H200 (``bench_moe.py``'s ``tilelang_wide_fp4`` column, 256 experts 4096 x 2048,
top-6): 2.20 / 2.33 / 2.30 / 2.26 TB/s of FP4 weights at 16 / 64 / 128 / 256 tokens against
the one-warpgroup kernels' 1.92-1.97, 1.15-1.18x (1.10-1.15x over 64 experts); at one token
1.06 against 1.12 TB/s (a 6-expert call has too few CTAs for 512-thread ones).  The measured
table takes the wide variant where it won by more than the near-tie margin.

**PDL.**  Where the Triton kernels use programmatic dependent launch, both GEMMs start with
the PDL prologue (:mod:`deepinfer_cuda_sm100.tl.pdl`), after their barriers' set-up and before
any global access (the tile's expert comes from the layout kernel): their launch overlaps the
kernel before, and the next kernel's launch overlaps theirs.

Static configurations: ``(hidden, inter, BLOCK_M, scale kind, consumers, stages, routing-weight
dtype, split registers, pdl)``, compiled once each
(:func:`_kernel`, TileLang's disk cache keeps them); token, tile and expert counts are dynamic.
"""

# No ``from __future__ import annotations``: TileLang reads the kernels' annotations as objects.
import functools

import torch

from deepinfer_cuda_sm100.e2m1_ptx import TABLE_FP32_PTX, TABLE_UE8M0_PTX, e2m1x8_bf16_ptx
from deepinfer_cuda_sm100.tl.compile_log import logged_compile
from deepinfer_cuda_sm100.tl.pdl import prologue, tl_pdl_enabled
from deepinfer_cuda_sm100.tl.target import cuda_target

ROWS = 128
"""Weight rows per CTA (two wgmma M atoms of 64)."""
ATOM = 64
"""Rows per accumulator (wgmma's M)."""
BLOCK_K = 128
"""Inputs per K step: 64 packed bytes a row, four scale groups."""
GROUP = 32
"""Inputs per scale (the FP4 expert format's group; the kernels take this group only)."""
THREADS = 128
"""Consumer threads (one warpgroup); TileLang adds a producer warpgroup."""
STAGES = 4
"""Depth of the shared-memory ring."""
SCALE_KINDS = ("ue8m0", "fp32")
CONSUMERS = (1, 2)
"""Consumer warpgroups a CTA: 1 (:data:`ROWS` weight rows a CTA) or 2 (the wide variant, each
warpgroup :data:`ROWS` rows of its own, ``2 * ROWS`` a CTA)."""
WIDE_REGS = {16: (2, 24, 104), 32: (1, 24, 232), 64: (1, 24, 232), 128: (1, 24, 232)}
"""The wide variant's register split by ``BLOCK_M``: ``(CTAs an SM, producer, consumer
registers a thread)`` (``setmaxnreg``; the launch bound ``__launch_bounds__(512, CTAs)``).  At
128 rows (:data:`WIDE_TALL_PAIRS`) a consumer thread holds two ``[128, 128]`` fp32 accumulators
over 256 threads (128 registers) and two A fragments (64)."""
WIDE_TALL_PAIRS = 192
"""The wide variant takes tiles of 128 rows (:func:`tile_height`) once the call averages this
many (token, slot) pairs an expert (three tiles of 64): each decoded weight then serves 128
tokens, halving the decoding per FLOP of a 64-row tile, at the cost of at most 127 padding rows
an expert.  Measured on an H100 (``bench_moe.py --experts 64 --tokens 2048,8192 --heights
64,128``, the whole op, every output bitwise the 64-row tiles'): 2,244.9 against 2,367.1 µs at
192 pairs an expert (2,048 tokens, top-6), 7,484.3 against 8,430.0 at 768 (8,192 tokens), where
the bf16 experts' Triton kernel takes 7,944 µs; the one-warpgroup kernels lose at 128 rows
(3,159.7 against 2,758.6 µs; 10,241.4 against 10,066.8).  Fewer pairs an expert are unmeasured."""
SPLIT_REGS = {16: (4, 24, 104), 32: (3, 24, 136), 64: (2, 40, 216)}
"""The one-warpgroup kernels' register split (``split_registers``, the default; 256 threads a CTA,
producer and consumer warpgroups): ``(CTAs an SM, producer, consumer registers a thread)``, so
``producer + consumer = 2 x 65536 / (256 CTAs)`` (rounded down to 8) and more CTAs share an
SM than the compiler's allotment leaves room for (2, 2 and 1: 106, 122-126 and 154-158
registers every thread).  Measured on an H200 (``bench_moe.py --experts 64``, the whole op):
408 against 464 µs at 64 tokens (``BLOCK_M`` 16), 577 against 647 at 256 (32); the wide
variant's 403 and 641.  Built with ``nvcc 13 -arch=sm_90a``, no configuration spills (a
24-register producer does at ``BLOCK_M`` 64: 40 there).  At ``BLOCK_M`` 16 the four CTAs an SM
leave ptxas 64 registers a thread at launch, and it serialises the consumer's wgmma
instructions (C7512, "insufficient register resources": a wait after each of a step's 16),
as it does the wide variant's at 16 rows; three CTAs an SM (:func:`split_for`: 80 at launch,
:data:`SPLIT_REGS`'s 32-row split) do not.  ``bench_moe.py --ctas-per-sm 16=3`` times that
split against this one: on an H100 at 256 experts (bits equal) 450.6 / 1,094.2 / 1,467.7 µs
at 16 / 64 / 256 tokens against 466.1 / 1,125.7 / 1,442.6, 3 % faster at decode sizes and 2 %
slower at 256 tokens, so the four-CTA split stays."""


def launch_registers(ctas: int, threads: int = 256) -> int:
    """Registers a thread that ``ctas`` CTAs of ``threads`` threads an SM get at launch: the
    65,536 of the register file shared out, rounded down to the 8 a thread they are allotted in
    (at most 255, rounded likewise)."""
    return min(65536 // (threads * ctas), 255) // 8 * 8


def split_for(ctas: int, producer: int = 24) -> tuple[int, int, int]:
    """The one-warpgroup kernels' register split for ``ctas`` CTAs an SM: ``(ctas, producer,
    consumer)``.  ``setmaxnreg`` moves registers within the CTA's own pool (``CTAPOOL`` in the
    SASS): the consumer warpgroup's increase waits until the producer's decrease has returned
    them, so the consumer gets at most the launch allotment (:func:`launch_registers`) twice
    over less the producer's, a multiple of 8 (at most 256); asking for more waits forever."""
    consumer = min(2 * launch_registers(ctas) - producer, 256) // 8 * 8
    if ctas < 1 or producer < 24 or producer % 8 or consumer < producer:
        raise ValueError(f"no register split of {ctas} CTAs an SM with a {producer}-register producer")
    return ctas, producer, consumer


def check_split(split: tuple[int, int, int]) -> tuple[int, int, int]:
    """``split`` (``(CTAs an SM, producer, consumer)``) if the consumer's ``setmaxnreg``
    increase can be met from its CTA's pool (:func:`split_for`); otherwise a ``ValueError``
    naming it, since the kernel would hang at its first increase."""
    ctas, producer, consumer = split
    if producer + consumer > 2 * launch_registers(ctas) or consumer % 8 or producer % 8:
        raise ValueError(
            f"register split {split} asks for {producer} + {consumer} registers a thread, more than "
            f"the {2 * launch_registers(ctas)} two warpgroups of a CTA get at {ctas} CTAs an SM "
            "(or not multiples of 8): the consumers would wait forever; use tl.moe.split_for"
        )
    return split


PREFILL_BLOCK_M = 128
"""A tile height for many rows an expert: wgmma's N = 128, so each decoded weight serves twice
the tokens of a 64-row tile.  The one-warpgroup kernels take it with the compiler's register
allotment (:data:`SPLIT_REGS` has no split for it): 219 registers a thread, one CTA an SM, no
spills (offline, ``nvcc 13 -arch=sm_90a``; a ``setmaxnreg`` split of 24 / 240 spills 32 bytes in
the gate / up kernel); shared memory ~162 KB at 4 stages; :func:`tile_height` gives it to them
at no call.  The wide variant takes it (:data:`WIDE_REGS`) from :data:`WIDE_TALL_PAIRS` pairs an
expert.  ``bench_moe.py --heights 64,128`` times both at it."""


GATHER_MAX_TOKENS = 256
"""Calls of at most this many tokens gather their activations into the sorted rows first in the
one-warpgroup variant (:func:`gathers_rows`).  Measured on an H100 (``bench_moe.py --tokens
16,64,256 --gathered``, 256 experts, top-6, the whole op with the gather launch, CUDA graphs):
467 / 1,131 / 1,497 us against 506 / 1,232 / 1,609 gathering in the kernel (7-8 % less), the
same bits; the wide variant gains 0-2 % at 16 and 64 tokens and loses 2 % at 256, so it keeps
its own gathers.  Larger calls are unmeasured and keep them too (the gathered copy is ``T * k``
rows of the activations)."""


def gathers_rows(tokens: int, consumers: int) -> bool:
    """Whether a call of ``tokens`` tokens on the ``consumers`` variant takes ``gathered`` by
    default (:data:`GATHER_MAX_TOKENS`)."""
    return consumers == 1 and tokens <= GATHER_MAX_TOKENS


def tile_heights(consumers: int) -> tuple[int, ...]:
    """The tile heights the kernels with ``consumers`` consumer warpgroups take."""
    return (*WIDE_REGS, PREFILL_BLOCK_M) if consumers == 1 else tuple(WIDE_REGS)


TOKEN_SHIFT = 40
"""A pair's token is ``(pair * ceil(2**40 / top_k)) >> 40``: exact for ``pair * top_k < 2**40``
(pairs stay below ``65535 * 64`` tiles' rows)."""

# 4 packed bytes ($4; byte b holds inputs 2b (low nibble), 2b + 1) and a scale group's tables
# ($5..$9) -> the 8 dequantised bf16 weights as pairs (inputs 0, 1 in $0; ... 6, 7 in $3).
E2M1X8_PTX = e2m1x8_bf16_ptx(
    ((0, "0x5140"), (0, "0x7362"), (1, "0x5140"), (1, "0x7362")), ("$5", "$6", "$7", "$8", "$9")
)

DECODE_UE8M0 = "deepinfer_e2m1_row_ue8m0"
DECODE_FP32 = "deepinfer_e2m1_row_fp32"
HALF = "_half"
"""Suffix of the decode functions that take half a scale group (8 bytes: one K half's registers)."""
KEEP = "deepinfer_keep_stage"


def k_position(n):
    """Position in wgmma's K order of input ``n`` (0..127) of a K step: thread ``c`` of a quad
    holds inputs ``32c .. 32c + 31`` of its rows (one scale group, 16 contiguous bytes), which
    the A fragment of ``m64nNk16`` places at ``16 ki + 8 h + 2 c + (0, 1)``; works on ints and
    TIR expressions alike."""
    return 16 * ((n % 32) // 4) + 8 * ((n % 4) // 2) + 2 * (n // 32) + n % 2


def k_order() -> list[int]:
    """``k_order()[p]``: the input at position ``p`` of a K step (the inverse of :func:`k_position`)."""
    out = [0] * BLOCK_K
    for n in range(BLOCK_K):
        out[k_position(n)] = n
    return out


def a_register(q: int, i: int) -> int:
    """The 32-bit A-fragment register (plus the row half ``rh``) that takes output ``i`` (inputs
    ``8 q + 2 i``, ``+ 1``) of word ``q`` of a thread's 16 bytes: input ``32 c + 4 ki + 2 h``
    sits at ``k_position`` ``16 ki + 8 h + 2 c``, which the fragment holds in register
    ``4 ki + 2 h + rh``."""
    n = 8 * q + 2 * i
    return 4 * (n // 4) + 2 * ((n % 4) // 2)


def _a_thread(i, j):
    return i // 16 * 32 + i % 8 * 4 + j % 8 // 2


def _a_local(i, j):
    return j // 8 * 4 + i % 16 // 8 * 2 + j % 2


def _cuda_asm(ptx: str) -> str:
    """PTX text with ``$k`` operands as a CUDA ``asm`` string body (``%k``)."""
    import re

    body = re.sub(r"\$(\d+)", r"%\1", ptx)
    return "".join(f'"{line}\\n"\n' for line in body.splitlines())


def decode_source() -> str:
    """The CUDA device functions the kernels call: one row's 16 packed bytes (a scale group)
    and its scale -> its 32 dequantised weights, written into the A fragment registers they
    occupy (``frag``: the thread's 32 bf16 pairs, ``rh``: the row's half of the 16-row slab)."""
    # registers of word q: a_register(q, i) = 8 q + a_register(0, i)
    stores = "\n".join(f"    r[8 * q + {a_register(0, i)} + rh] = v[{i}];" for i in range(4))
    assert all(a_register(q, i) == 8 * q + a_register(0, i) for q in range(4) for i in range(4))
    return f"""
#ifndef DEEPINFER_E2M1_REGA
#define DEEPINFER_E2M1_REGA
__device__ __forceinline__ void deepinfer_e2m1x8_scaled(unsigned w, const unsigned* t, unsigned* o) {{
  asm(
{_cuda_asm(E2M1X8_PTX)}    : "=r"(o[0]), "=r"(o[1]), "=r"(o[2]), "=r"(o[3])
    : "r"(w), "r"(t[0]), "r"(t[1]), "r"(t[2]), "r"(t[3]), "r"(t[4]));
}}
__device__ __forceinline__ void deepinfer_e2m1_table_ue8m0(unsigned e, unsigned* t) {{
  asm(
{_cuda_asm(TABLE_UE8M0_PTX)}    : "=r"(t[0]), "=r"(t[1]), "=r"(t[2]), "=r"(t[3]), "=r"(t[4]) : "r"(e));
}}
__device__ __forceinline__ void deepinfer_e2m1_table_fp32(float s, unsigned* t) {{
  asm(
{_cuda_asm(TABLE_FP32_PTX)}    : "=r"(t[0]), "=r"(t[1]), "=r"(t[2]), "=r"(t[3]), "=r"(t[4])
    : "r"(__float_as_uint(s)));
}}
__device__ __forceinline__ void deepinfer_e2m1_row(const void* packed, const unsigned* t, void* frag,
                                                   int rh) {{
  const uint4 p = *reinterpret_cast<const uint4*>(packed);
  const unsigned words[4] = {{p.x, p.y, p.z, p.w}};
  unsigned* r = reinterpret_cast<unsigned*>(frag);
#pragma unroll
  for (int q = 0; q < 4; ++q) {{
    unsigned v[4];
    deepinfer_e2m1x8_scaled(words[q], t, v);
{stores}
  }}
}}
__device__ __forceinline__ void deepinfer_e2m1_half_row(const void* packed, const unsigned* t, void* frag,
                                                        int rh) {{
  const uint2 p = *reinterpret_cast<const uint2*>(packed);
  const unsigned words[2] = {{p.x, p.y}};
  unsigned* r = reinterpret_cast<unsigned*>(frag);
#pragma unroll
  for (int q = 0; q < 2; ++q) {{
    unsigned v[4];
    deepinfer_e2m1x8_scaled(words[q], t, v);
{stores}
  }}
}}
__device__ __forceinline__ void {DECODE_UE8M0}(const void* packed, unsigned char e, void* frag, int rh) {{
  unsigned t[5];
  deepinfer_e2m1_table_ue8m0(e, t);
  deepinfer_e2m1_row(packed, t, frag, rh);
}}
__device__ __forceinline__ void {DECODE_FP32}(const void* packed, float s, void* frag, int rh) {{
  unsigned t[5];
  deepinfer_e2m1_table_fp32(s, t);
  deepinfer_e2m1_row(packed, t, frag, rh);
}}
__device__ __forceinline__ void {DECODE_UE8M0}{HALF}(const void* packed, unsigned char e, void* frag,
                                                          int rh) {{
  unsigned t[5];
  deepinfer_e2m1_table_ue8m0(e, t);
  deepinfer_e2m1_half_row(packed, t, frag, rh);
}}
__device__ __forceinline__ void {DECODE_FP32}{HALF}(const void* packed, float s, void* frag, int rh) {{
  unsigned t[5];
  deepinfer_e2m1_table_fp32(s, t);
  deepinfer_e2m1_half_row(packed, t, frag, rh);
}}
__device__ __forceinline__ void {KEEP}(const void*) {{}}
#endif
"""


def _scale_dtype(scale: str) -> str:
    return "uint8" if scale == "ue8m0" else "float32"


def a_fragment_layout(rows: int = ATOM, width: int = BLOCK_K):
    """The register layout of wgmma's A operand (``m64nNk16``, bf16, ``BLOCK_K`` wide), as
    TileLang lays out a fragment A of ``T.gemm``: element ``(i, j)`` lives in thread
    ``32 (i // 16) + 4 (i % 8) + (j % 8) // 2``, local bf16 ``4 (j // 8) + 2 ((i % 16) // 8) +
    j % 2`` (so 32-bit register ``4 ki + 2 h + rh`` for ``j = 16 ki + 8 h + 2 c + (0, 1)``).
    ``rows`` 128 (the wide variant): the same formulas over two warpgroups, rows ``64 g ..
    64 g + 63`` in warpgroup ``g`` (threads ``128 g ..``), as ``T.gemm``'s ``FullRow`` policy
    places them."""
    from tilelang.layout import Fragment

    return Fragment((rows, width), forward_thread_fn=_a_thread, forward_index_fn=_a_local)


def _macros(scale: str, consumers: int = 1, halves: bool = False):
    """The consumer's pieces shared by both kernels: decoding one block of ``64 * consumers``
    rows into its A fragment (each warpgroup its own 64 rows), and the K step's GEMMs
    (``halves``: each block in two K halves through two half-width fragments, :func:`_halves_step`)."""
    import tilelang.language as T

    fn = DECODE_UE8M0 if scale == "ue8m0" else DECODE_FP32
    src = decode_source()
    block_rows = ATOM * consumers
    # one consumer warpgroup: the compiler's own warp split; two: warpgroup g its rows 64 g ..
    gemm_kw = {} if consumers == 1 else {"policy": T.GemmWarpPolicy.FullRow}

    @T.macro
    def row_of(b, rh):
        """The weight row a consumer thread decodes in block ``b``, row half ``rh``."""
        tx = T.get_thread_binding()
        return b * block_rows + (tx // 32) * 16 + rh * 8 + (tx % 32) // 4

    @T.macro
    def decode(wp, sc, packed, frag, b, half=-1, scales=None):
        """Block ``b``'s weights into ``frag``: the thread of lane ``l`` in consumer warp ``v``
        decodes scale group ``l % 4`` of rows ``64 consumers b + 16 v + l // 4`` and ``+ 8``
        (one 16-byte shared load each; a warp reads 512 contiguous bytes, free of bank
        conflicts); ``half`` 0 / 1: only that K half of the group (8 bytes), into a half-width
        fragment, with the two rows' scales from ``scales`` (read once for both halves, so the
        compiler builds each row's tables once)."""
        T.import_source(src)
        tx = T.get_thread_binding()
        size = 16 if half < 0 else 8
        for rh in T.unroll(2):
            row = row_of(b, rh)
            for v in T.vectorized(size):
                packed[v] = wp[row, (tx % 4) * 16 + max(half, 0) * 8 + v]
            name = fn if half < 0 else fn + HALF
            scale = sc[row, tx % 4] if scales is None else scales[rh]
            T.call_extern("handle", name, T.address_of(packed[0]), scale, T.address_of(frag[0, 0]), rh)

    @T.macro
    def read_scales(sc, scales, b):
        """Block ``b``'s two row scales of this thread into ``scales``."""
        tx = T.get_thread_binding()
        for rh in T.unroll(2):
            scales[rh] = sc[row_of(b, rh), tx % 4]

    @T.macro
    def step_math(wp, sc, xs, wr, acc, packed):
        """Block 0 decoded and its GEMMs issued (asynchronous), block 1 decoded meanwhile, its
        GEMMs then waited for with all others; the empty call that takes the weight stage's
        address after them holds the stage's release (and with it the activations', which the
        pipeline ties to it) until the GEMMs are done."""
        decode(wp, sc, packed, wr[0], 0)
        T.wgmma_gemm(wr[0], xs, acc[0], transpose_B=True, **gemm_kw)
        decode(wp, sc, packed, wr[1], 1)
        T.gemm(wr[1], xs, acc[1], transpose_B=True, **gemm_kw)
        T.call_extern("handle", KEEP, T.address_of(wp[0, 0]))

    @T.macro
    def halves_step(wp, sc, xs, wr, acc, packed):
        """The K step in four quarters (block, K half), each decoded into one of two half-width
        fragments while the quarter before it multiplies: a fragment is decoded again only
        after the wait that leaves one group in flight, so 16 A registers a thread live at a
        time instead of 32.  Each accumulator takes its K positions in the same order as
        :func:`step_math`'s, so the result is the same."""
        h = BLOCK_K // 2
        bm = xs.shape[0]
        scales = T.alloc_local((2,), sc.dtype)
        read_scales(sc, scales, 0)
        decode(wp, sc, packed, wr[0], 0, 0, scales)
        T.wgmma_gemm(wr[0], xs[0:bm, 0:h], acc[0], transpose_B=True, **gemm_kw)
        decode(wp, sc, packed, wr[1], 0, 1, scales)
        T.wgmma_gemm(wr[1], xs[0:bm, h:BLOCK_K], acc[0], transpose_B=True, **gemm_kw)
        T.wait_wgmma(1)
        read_scales(sc, scales, 1)
        decode(wp, sc, packed, wr[0], 1, 0, scales)
        T.wgmma_gemm(wr[0], xs[0:bm, 0:h], acc[1], transpose_B=True, **gemm_kw)
        T.wait_wgmma(1)
        decode(wp, sc, packed, wr[1], 1, 1, scales)
        T.gemm(wr[1], xs[0:bm, h:BLOCK_K], acc[1], transpose_B=True, **gemm_kw)
        T.call_extern("handle", KEEP, T.address_of(wp[0, 0]))

    return halves_step if halves else step_math


def _register_split(block_m: int, consumers: int, split_registers: bool | tuple = True):
    """The kernels' register allotment, a macro: one consumer warpgroup splits them by
    :data:`SPLIT_REGS` (``split_registers`` true, at the heights it names), by the given
    ``(CTAs an SM, producer, consumer)`` (a tuple, :func:`split_for`'s), or not at all (false:
    the compiler's, no ``setmaxnreg``); the wide variant takes TileLang's producer / consumer
    split with :func:`_wide_setup`'s minimum CTAs an SM and register counts."""
    import tilelang.language as T

    if consumers != 1:
        cta_min, nreg_prod, nreg_cons = _wide_setup(block_m)
    elif isinstance(split_registers, tuple):
        cta_min, nreg_prod, nreg_cons = check_split(split_registers)
    else:
        cta_min, nreg_prod, nreg_cons = SPLIT_REGS.get(block_m, (1, 0, 0)) if split_registers else (1, 0, 0)
    split = nreg_cons > 0

    @T.macro
    def register_split():
        if split:
            T.annotate_min_blocks_per_sm(cta_min)
            T.annotate_producer_reg_dealloc(nreg_prod)
            T.annotate_consumer_reg_alloc(nreg_cons)
        else:
            T.disable_warp_group_reg_alloc()

    return register_split


def _alloc_step(block_m: int, scale: str, consumers: int = 1, halves: bool = False):
    """The stage buffers (TileLang multi-buffers them), the two A fragments (``halves``: half
    width, :func:`_macros`) and accumulators (``64 * consumers`` rows each), and the decoding's
    local bytes."""
    import tilelang.language as T

    rows = ROWS * consumers
    width = BLOCK_K // 2 if halves else BLOCK_K
    wp = T.alloc_shared((rows, BLOCK_K // 2), "uint8")
    sc = T.alloc_shared((rows, BLOCK_K // GROUP), _scale_dtype(scale))
    xs = T.alloc_shared((block_m, BLOCK_K), "bfloat16")
    wr = [T.alloc_fragment((ATOM * consumers, width), "bfloat16") for _ in range(2)]
    acc = [T.alloc_fragment((ATOM * consumers, block_m), "float32") for _ in range(2)]
    packed = T.alloc_local((16,), "uint8")
    layout = a_fragment_layout(ATOM * consumers, width)
    T.annotate_layout({wr[0]: layout, wr[1]: layout})
    return wp, sc, xs, wr, acc, packed


def _token(slot_pair, tile, block_m: int, r, tok_magic):
    """The token of row ``r`` of ``tile`` (a padding row's ``-1`` reads token 0)."""
    import tilelang.language as T

    pair = T.Cast("int64", T.max(slot_pair[tile * block_m + r], 0))
    return (pair * tok_magic) >> TOKEN_SHIFT


def _wide_setup(block_m: int):
    """The wide variant's pieces outside the kernel: TileLang's wgmma fence fixed for two
    warpgroups in one column, and ``(CTAs an SM, producer, consumer registers)``."""
    from deepinfer_cuda_sm100.tl.fp8_gemm import fix_wgmma_accumulator_fence

    fix_wgmma_accumulator_fence()
    return WIDE_REGS[block_m]


def build_gate_up(
    hidden: int,
    inter: int,
    block_m: int,
    scale: str,
    stages: int | None = None,
    consumers: int = 1,
    split_registers: bool | tuple = True,
    pdl: bool = False,
    gathered: bool = False,
    halves: bool = False,
):
    """The gate / up ``prim_func``: grid ``(inter / (64 consumers), tiles)``; CTA ``(nb,
    tile)`` writes ``h[tile * BLOCK_M + j, :]`` at the positions (:func:`k_position` within each
    128) of intermediate features ``nb * 64 consumers + i`` for the tile's real rows ``j``.

    Args:
        hidden: ``D`` (a multiple of :data:`BLOCK_K`); inter: ``I`` (a multiple of 128).
        block_m: ``BLOCK_M`` (16, 32 or 64; one consumer warpgroup also :data:`PREFILL_BLOCK_M`);
            scale: ``"ue8m0"`` or ``"fp32"``.
        stages: the ring's depth (default :data:`STAGES`).
        consumers: consumer warpgroups a CTA (:data:`CONSUMERS`).
        split_registers: one consumer warpgroup: the registers split by :data:`SPLIT_REGS`
            (``False``: the compiler's allotment; a tuple: that split, :func:`split_for`'s; the
            same result).
        pdl: start with the PDL prologue (:func:`deepinfer_cuda_sm100.tl.pdl.prologue`: wait
            for the kernel before, then let the next be scheduled) before any global access.
        gathered: ``x`` is the activations already gathered into the sorted rows in K order
            (:func:`~deepinfer_cuda_sm100.kernels.moe_gather.gather_sorted_rows`, ``[tiles *
            BLOCK_M, D]``), loaded a tile's rows by one TMA copy a step as the down kernel loads
            ``h``, instead of gathered by token here; the same result.
        halves: the K step in two K halves of each block (:func:`_macros`): half the live A
            registers, for a register split that would otherwise serialise the wgmma; the same
            result.
    """
    import tilelang.language as T

    D, I, BM = hidden, inter, block_m
    n_tok, n_tiles, n_slots, n_exp = T.dynamic("T"), T.dynamic("NT"), T.dynamic("NS"), T.dynamic("E")
    step_math = _macros(scale, consumers, halves)
    wide = consumers != 1
    F, R = ATOM * consumers, ROWS * consumers  # features (gate and up rows each), weight rows
    register_split = _register_split(BM, consumers, split_registers)
    start = prologue()
    stages = stages or STAGES

    @T.prim_func
    def moe_gate_up(
        x: T.Tensor((n_tok, D), "bfloat16"),
        tile_expert: T.Tensor((n_tiles,), "int32"),
        slot_pair: T.Tensor((n_slots,), "int32"),
        w: T.Tensor((n_exp, 2 * I, D // 2), "uint8"),
        s: T.Tensor((n_exp, 2 * I, D // GROUP), _scale_dtype(scale)),
        h: T.Tensor((n_slots, I), "bfloat16"),
        limit: T.float32,
        tok_magic: T.int64,
    ):
        with T.Kernel(I // F, n_tiles, threads=THREADS * consumers) as (nb, tile):
            register_split()
            wp, sc, xs, wr, acc, packed = _alloc_step(BM, scale, consumers, halves)
            live = T.alloc_shared((BM,), "int32", scope="shared")
            if pdl:  # the tile's expert and every input come from the kernels before
                start()
            if tile_expert[tile] < n_exp:  # tiles past the used ones read nothing
                T.clear(acc[0])
                T.clear(acc[1])
                for k in T.Pipelined(D // BLOCK_K, num_stages=stages):
                    T.copy(
                        w[tile_expert[tile], nb * F : nb * F + F, k * 64 : k * 64 + 64],
                        wp[0:F, :],
                    )
                    T.copy(
                        w[tile_expert[tile], I + nb * F : I + nb * F + F, k * 64 : k * 64 + 64],
                        wp[F:R, :],
                    )
                    for r, g in T.Parallel(R, BLOCK_K // GROUP):
                        src_row = T.if_then_else(r < F, nb * F + r, I + nb * F + r - F)
                        sc[r, g] = s[tile_expert[tile], src_row, k * (BLOCK_K // GROUP) + g]
                    if gathered:  # the tile's rows, already in K order
                        T.copy(x[tile * BM : tile * BM + BM, k * BLOCK_K : k * BLOCK_K + BLOCK_K], xs)
                    else:
                        # a thread keeps its row across iterations; a warp reads 32 contiguous
                        # bytes of each of 4 rows and stores them, 4 bytes apart, in K order
                        for kq, r, m, j in T.Parallel(BLOCK_K // 16, BM, 8, 2):
                            xs[r, k_position(16 * kq + 2 * m + j)] = x[
                                _token(slot_pair, tile, BM, r, tok_magic), k * BLOCK_K + 16 * kq + 2 * m + j
                            ]
                    step_math(wp, sc, xs, wr, acc, packed)
                for j in T.Parallel(BM):  # each row's liveness read once, for all its outputs
                    live[j] = slot_pair[tile * BM + j]
                for i, j in T.Parallel(F, BM):
                    g = T.min(T.Cast("float32", T.Cast("bfloat16", acc[0][i, j])), limit)
                    u = T.Cast("float32", T.Cast("bfloat16", acc[1][i, j]))
                    u = T.min(T.max(u, -limit), limit)
                    act = T.Cast("float32", T.Cast("bfloat16", g / (1.0 + T.exp(-g))))
                    if live[j] >= 0:
                        if wide:  # features nb * 128 + i: one K step of the down kernel
                            h[tile * BM + j, nb * BLOCK_K + k_position(i)] = T.Cast("bfloat16", act * u)
                        else:
                            col = (nb // 2) * BLOCK_K + k_position((nb % 2) * ATOM + i)
                            h[tile * BM + j, col] = T.Cast("bfloat16", act * u)

    return moe_gate_up


def build_down(
    hidden: int,
    inter: int,
    block_m: int,
    scale: str,
    stages: int | None = None,
    consumers: int = 1,
    weights: str = "bfloat16",
    split_registers: bool | tuple = True,
    pdl: bool = False,
    halves: bool = False,
):
    """The down ``prim_func``: grid ``(hidden / (128 consumers), tiles)``; CTA ``(nb, tile)``
    writes ``y[pair, nb * 128 consumers + i]`` for the pairs of the tile's real rows: the bf16
    product rounded, times the routing weight rounded to bf16, rounded.  ``hs`` holds each 128
    inputs in K order (as :func:`build_gate_up` writes them); ``rw`` is the ``[T, k]`` routing
    weights flattened (contiguous), so pair ``p``'s weight is ``rw[p]``: no division by ``k``
    per output (each one, with the bounds check of a 2-D index, was five 32-bit integer
    divisions by the runtime ``k``).

    Args:
        hidden: ``D`` (a multiple of ``128 consumers``); inter: ``I`` (a multiple of
        :data:`BLOCK_K`); block_m, scale, stages, consumers, split_registers, pdl, halves: as
        :func:`build_gate_up`.
        weights: the routing weights' dtype, a value of :data:`WEIGHT_DTYPES` (read as they
            are: no conversion launch before the kernel; the bf16 rounding makes the two the
            same product for a bf16 weight).
    """
    import tilelang.language as T

    D, I, BM = hidden, inter, block_m
    n_tiles, n_slots, n_exp = T.dynamic("NT"), T.dynamic("NS"), T.dynamic("E")
    n_pairs, n_weights = T.dynamic("P"), T.dynamic("TK")
    step_math = _macros(scale, consumers, halves)
    A, R = ATOM * consumers, ROWS * consumers  # rows a block (warpgroup g its 64 g ..), a CTA
    register_split = _register_split(BM, consumers, split_registers)
    start = prologue()
    stages = stages or STAGES

    @T.prim_func
    def moe_down(
        hs: T.Tensor((n_slots, I), "bfloat16"),
        tile_expert: T.Tensor((n_tiles,), "int32"),
        slot_pair: T.Tensor((n_slots,), "int32"),
        w: T.Tensor((n_exp, D, I // 2), "uint8"),
        s: T.Tensor((n_exp, D, I // GROUP), _scale_dtype(scale)),
        rw: T.Tensor((n_weights,), weights),
        y: T.Tensor((n_pairs, D), "bfloat16"),
    ):
        with T.Kernel(D // R, n_tiles, threads=THREADS * consumers) as (nb, tile):
            register_split()
            wp, sc, xs, wr, acc, packed = _alloc_step(BM, scale, consumers, halves)
            pairs = T.alloc_shared((BM,), "int32", scope="shared")
            scales = T.alloc_shared((BM,), "float32", scope="shared")
            if pdl:  # the tile's expert and every input come from the kernels before
                start()
            if tile_expert[tile] < n_exp:
                T.clear(acc[0])
                T.clear(acc[1])
                for k in T.Pipelined(I // BLOCK_K, num_stages=stages):
                    T.copy(w[tile_expert[tile], nb * R : nb * R + R, k * 64 : k * 64 + 64], wp)
                    for r, g in T.Parallel(R, BLOCK_K // GROUP):
                        sc[r, g] = s[tile_expert[tile], nb * R + r, k * (BLOCK_K // GROUP) + g]
                    T.copy(hs[tile * BM : tile * BM + BM, k * BLOCK_K : k * BLOCK_K + BLOCK_K], xs)
                    step_math(wp, sc, xs, wr, acc, packed)
                # each row's pair and its weight (rounded to bf16) read once, for every output of
                # the row: pair p's weight is rw[p], the [T, k] weights flattened
                for j in T.Parallel(BM):
                    p = slot_pair[tile * BM + j]
                    pairs[j] = p
                    scales[j] = T.Cast("float32", T.Cast("bfloat16", rw[T.max(p, 0)]))
                for b in (0, 1):
                    for i, j in T.Parallel(A, BM):
                        if pairs[j] >= 0:
                            v = T.Cast("float32", T.Cast("bfloat16", acc[b][i, j])) * scales[j]
                            y[pairs[j], nb * R + b * A + i] = T.Cast("bfloat16", v)

    return moe_down


PASS_CONFIGS: dict = {}
"""TileLang's defaults: TMA loads and a warp-specialised producer."""


@functools.cache
@logged_compile("moe")
def _kernel(
    kind: str,
    hidden: int,
    inter: int,
    block_m: int,
    scale: str,
    consumers: int = 1,
    stages: int = STAGES,
    weights: str = "bfloat16",
    split_registers: bool | tuple = True,
    pdl: bool = False,
    gathered: bool = False,
    halves: bool = False,
):
    """A compiled kernel (``kind``: ``"gate_up"`` or ``"down"``; ``consumers``: 1, or 2 for the
    wide variant; ``stages``: the ring's depth; ``weights``: the down kernel's routing-weight
    dtype, :func:`build_down`'s; the default is ``moe_route``'s with the model's bf16 logits,
    so precompiled configurations, which leave it out, are the ones a call runs;
    ``split_registers``, ``pdl``, ``gathered`` (gate / up only), ``halves``:
    :func:`build_gate_up`'s)."""
    import tilelang

    kw = dict(stages=stages, consumers=consumers, split_registers=split_registers, pdl=pdl, halves=halves)
    if kind == "gate_up":
        func = build_gate_up(hidden, inter, block_m, scale, gathered=gathered, **kw)
    else:
        func = build_down(hidden, inter, block_m, scale, weights=weights, **kw)
    return tilelang.compile(func, out_idx=None, target=cuda_target(), pass_configs=PASS_CONFIGS)


WEIGHT_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
"""Routing-weight dtypes the down kernel reads as they are (``moe_route`` returns the logits'
dtype: bfloat16 in the model); others are cast to float32 first (exact)."""


def routing_weights(weights: torch.Tensor) -> tuple[torch.Tensor, str]:
    """``(weights as the down kernel reads them, their dtype's name)``: a bfloat16 or float32
    tensor as it is (contiguous: no launch when it already is, as ``moe_route`` returns it);
    another dtype converted to float32 (exactly).  The kernel rounds a weight to bf16 before it
    scales, so a bf16 weight read as it is gives the same bits as its float32 copy did."""
    name = WEIGHT_DTYPES.get(weights.dtype)
    if name is None:
        return weights.to(torch.float32).contiguous(), "float32"
    return weights.contiguous(), name


def scale_kind(w) -> str:
    """``"ue8m0"`` or ``"fp32"``: the scale format of the FP4 stack ``w``."""
    return "fp32" if w.scale.dtype == torch.float32 else "ue8m0"


def wide_problem(hidden: int, inter: int) -> str | None:
    """Why the wide variant (``consumers=2``) cannot take these widths, or ``None``: its down
    CTA covers 256 model features, its gate / up CTA 128 intermediate features."""
    if hidden % (ROWS * 2) or inter % BLOCK_K:
        return (
            f"widths D={hidden}, I={inter}: the wide TileLang kernels take D a multiple of {ROWS * 2} "
            f"and I a multiple of {BLOCK_K}"
        )
    return None


def tile_height(pairs: int, experts: int, consumers: int = 1) -> int:
    """``BLOCK_M`` of the TileLang kernels for ``pairs`` (token, slot) pairs over ``experts``
    (shapes only): the Triton path's :func:`~deepinfer_cuda_sm100.kernels.moe.tile_rows`, but 32
    rows once the average expert has 1.5 tiles of 16, and for the wide variant (``consumers``
    2) 128 rows from :data:`WIDE_TALL_PAIRS` pairs an expert on average.  Measured on the H200
    over 64 experts (the whole op, two consumers): at 24 pairs an expert 32 rows take 0.66 ms
    against 0.80 with 16 (each expert's weights decoded once instead of twice); at 12, 16 rows
    0.46 against 0.55.
    The result is the same bits at any height (a token's column does not depend on its tile)."""
    from deepinfer_cuda_sm100.kernels.moe import DECODE_BLOCK_M, tile_rows

    if consumers != 1 and pairs >= WIDE_TALL_PAIRS * max(experts, 1):
        return PREFILL_BLOCK_M
    bm = tile_rows(pairs, experts, False)
    if bm == DECODE_BLOCK_M and 2 * pairs >= 3 * DECODE_BLOCK_M * max(experts, 1):
        return 2 * DECODE_BLOCK_M
    return bm


def launch_plan(
    tokens: int,
    top_k: int,
    experts: int,
    hidden: int,
    inter: int,
    consumers: int = 1,
    block_m: int | None = None,
) -> dict:
    """The launches of a call (shapes only, the batch-invariant mode off): ``block_m``
    (:func:`tile_height`, or the given one), ``tiles`` (the Triton layout's
    :func:`~deepinfer_cuda_sm100.kernels.moe.tile_count`) and the two grids, ``(feature
    blocks, tiles)``: gate / up ``inter / (64 consumers)`` blocks of ``64 consumers``
    intermediate features (each with their gate and up rows), down ``hidden / (128
    consumers)`` blocks of ``128 consumers`` model features."""
    from deepinfer_cuda_sm100.kernels.moe import tile_count

    pairs = tokens * top_k
    bm = tile_height(pairs, experts, consumers) if block_m is None else block_m
    if bm not in tile_heights(consumers):
        raise ValueError(
            f"block_m={bm}: the TileLang MoE kernels with {consumers} consumer warpgroup(s) take tiles of "
            f"{list(tile_heights(consumers))} rows"
        )
    tiles = tile_count(pairs, experts, bm)
    return {
        "block_m": bm,
        "tiles": tiles,
        "gate_up_grid": (inter // (ATOM * consumers), tiles),
        "down_grid": (hidden // (ROWS * consumers), tiles),
    }


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte aligned start (the kernels copy 16-byte vectors)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def moe_experts(
    x,
    ids,
    weights,
    gate_up,
    down,
    limit,
    shared=None,
    consumers: int = 1,
    stages: int = STAGES,
    block_m=None,
    split_registers: bool | tuple = True,
    gathered: bool | None = None,
    halves: bool = False,
) -> torch.Tensor:
    """The op on FP4 stacks (:func:`~deepinfer_cuda_sm100.moe_dispatch.tilelang_supports`
    says which calls it takes): the Triton layout, the two TileLang GEMMs, the Triton combine.
    ``consumers``: 1 (one consumer warpgroup a CTA) or 2 (the wide variant, bitwise the same
    result; :func:`wide_problem` says which widths it takes); ``stages``: the shared-memory
    ring's depth (the same result at any depth; ``bench_moe.py --stages`` sweeps it);
    ``block_m``: the tile height, 16, 32 or 64, one consumer warpgroup also
    :data:`PREFILL_BLOCK_M` (default :func:`tile_height`; the same result at
    any height; ``bench_moe.py --heights`` sweeps it); ``split_registers``: one consumer
    warpgroup with the registers split by :data:`SPLIT_REGS` (``False``: the compiler's
    allotment, the same result; ``bench_moe.py --compiler-registers`` times it; a tuple: that
    split, :func:`split_for`'s, ``bench_moe.py --ctas-per-sm`` times it); ``gathered``:
    the activations gathered into the sorted rows by one Triton launch first
    (:func:`~deepinfer_cuda_sm100.kernels.moe_gather.gather_sorted_rows`) and loaded by TMA in
    the gate / up kernel (the same result; ``bench_moe.py --gathered`` times both; ``None``:
    :func:`gathers_rows`); ``halves``: both kernels' K steps in two K halves of each block
    (:func:`build_gate_up`; the same result; ``bench_moe.py --halves`` times it)."""
    from deepinfer_cuda_sm100.kernels import moe as triton_moe
    from deepinfer_cuda_sm100.kernels.moe_gather import gather_sorted_rows

    t, d = x.shape
    top_k = ids.shape[1]
    experts, inter = gate_up.shape[0], down.shape[2]
    if consumers not in CONSUMERS:
        raise ValueError(f"consumers={consumers}: the TileLang MoE kernels take one of {CONSUMERS}")
    problem = wide_problem(d, inter) if consumers != 1 else None
    if problem:
        raise ValueError(problem)
    if isinstance(split_registers, tuple) and consumers != 1:
        raise ValueError("a register split of its own is for the one-warpgroup kernels (consumers=1)")
    if isinstance(split_registers, tuple):
        check_split(split_registers)  # before any launch: an impossible split would hang
    split_registers = split_registers or consumers != 1  # (the wide variant always splits)
    gathered = gathers_rows(t, consumers) if gathered is None else gathered
    plan = launch_plan(t, top_k, experts, d, inter, consumers, block_m)
    bm = plan["block_m"]
    ids = ids if ids.stride(1) == 1 else ids.contiguous()
    tile_expert, slot_pair = triton_moe.sorted_layout(ids, experts, bm)
    x = _aligned(x)
    h = torch.empty(plan["tiles"] * bm, inter, dtype=x.dtype, device=x.device)
    gu_scale = gate_up.scale.view(torch.uint8) if scale_kind(gate_up) == "ue8m0" else gate_up.scale
    magic = ((1 << TOKEN_SHIFT) + top_k - 1) // top_k
    pdl = tl_pdl_enabled()
    config = (bm, scale_kind(gate_up), consumers, stages, "bfloat16", split_registers, pdl)
    extra = (halves,) if halves else ()  # (the shipped configurations' keys otherwise)
    gate_up_kernel = _kernel("gate_up", d, inter, *config, gathered, *extra)
    rows = gather_sorted_rows(x, tile_expert, slot_pair, top_k, experts) if gathered else x
    gate_up_kernel(rows, tile_expert, slot_pair, gate_up.data, gu_scale, h, float(limit), magic)
    y = torch.empty(t * top_k, d, dtype=x.dtype, device=x.device)
    dn_scale = down.scale.view(torch.uint8) if scale_kind(down) == "ue8m0" else down.scale
    rw, rw_dtype = routing_weights(weights)
    down_config = (bm, scale_kind(down), consumers, stages, rw_dtype, split_registers, pdl)
    down_kernel = (
        _kernel("down", d, inter, *down_config, False, *extra)
        if halves
        else _kernel("down", d, inter, *down_config)
    )
    down_kernel(h, tile_expert, slot_pair, down.data, dn_scale, rw.view(-1), y)
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    return triton_moe.combine_pairs(y, ids, experts, False, shared, out)
