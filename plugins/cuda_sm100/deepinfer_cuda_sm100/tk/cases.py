"""Inputs of the TileKernels-adapted ops at DeepSeek-V4-Flash (and V4.1) shapes, for any token count.

:func:`v4_flash_args` builds one call of an op as the model makes it: 4 mHC streams of 4096,
64 heads of 512 with a rope of 64 (and the key row ``[T, 512]``), 256 routed experts top-6
with ``sqrtsoftplus`` (float32 logits, with the ``noaux_tc`` bias, and hash routing),
V4.1's KV numerics (FP8 window rows of 512 in blocks of 32, FP4 indexer rows of 128), and its
Engram (4-grams, 8 heads, 4 streams of 4096).  The benchmark
(``scripts/bench_tilekernels.py``) and the GPU tests use them.
"""

from __future__ import annotations

import torch

HIDDEN, HC, HEADS, HEAD_DIM, ROPE = 4096, 4, 64, 512, 64
EXPERTS, TOP_K, ROUTED_SCALE = 256, 6, 1.5
NGRAM, ENGRAM_HEADS = 4, 8

VARIANTS = {
    "hc_pre": ("streams",),
    "hc_post": ("streams",),
    "apply_rope": ("heads", "key"),
    "moe_route": ("topk+bias", "hash"),
    "deepseek_v41.hc_collapse": ("streams",),
    "deepseek_v41.kv_qdq": ("fp8_ue8m0", "fp4_ue8m0"),
    "deepseek_v41.engram_hash": ("hash",),
    "deepseek_v41.engram_mix": ("gate",),
}
"""The calls of each op the model makes (the first argument of :func:`v4_flash_args`)."""
ROW_ARGS = {
    "hc_pre": (0,),
    "hc_post": (0, 1, 2, 3),
    "apply_rope": (0, 1, 2),
    "moe_route": (0, 2),
    "deepseek_v41.hc_collapse": (0, 1),
    "deepseek_v41.kv_qdq": (0,),
    "deepseek_v41.engram_hash": (0,),
    "deepseek_v41.engram_mix": (0, 1),
}
"""The positional arguments of each op indexed by token (dim 0)."""


def _randn(g, *shape, dtype=torch.float32, scale=1.0, device="cuda"):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def v4_flash_args(op: str, variant: str, tokens: int, g: torch.Generator, device: str = "cuda") -> tuple:
    """The arguments of one ``op`` call (``variant`` from :data:`VARIANTS`) with ``tokens`` rows."""
    t, bf = tokens, torch.bfloat16

    def r(*shape, **kw):
        return _randn(g, *shape, device=device, **kw)

    if op == "hc_pre":
        m = (2 + HC) * HC
        return (
            r(t, HC, HIDDEN, dtype=bf),
            r(m, HC * HIDDEN, scale=0.02),
            r(m, scale=0.1),
            1 + r(3, scale=0.1),
            1e-6,
            1e-6,
            20,
        )
    if op == "hc_post":
        return (
            r(t, HIDDEN, dtype=bf),
            r(t, HC, HIDDEN, dtype=bf),
            2 * r(t, HC).sigmoid(),
            r(t, HC, HC).softmax(-1),
        )
    if op == "apply_rope":
        angles = torch.rand(t, ROPE // 2, generator=g).to(device) * 6.3
        cos, sin = angles.cos().to(bf), angles.sin().to(bf)
        x = r(t, HEADS, HEAD_DIM, dtype=bf) if variant == "heads" else r(t, HEAD_DIM, dtype=bf)
        return (x, cos, sin)
    if op == "moe_route":
        logits = r(t, EXPERTS, scale=2.0)
        if variant == "hash":
            ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(t)]).to(device)
            return (logits, None, ids, TOP_K, "sqrtsoftplus", ROUTED_SCALE)
        return (logits, r(EXPERTS, scale=0.3), None, TOP_K, "sqrtsoftplus", ROUTED_SCALE)
    if op == "deepseek_v41.hc_collapse":
        return (r(t, HC, HIDDEN, dtype=bf), torch.rand(t, HC, generator=g).to(device) + 1e-6)
    if op == "deepseek_v41.kv_qdq":
        if variant == "fp8_ue8m0":
            return (r(t, HEAD_DIM, dtype=bf, scale=3.0), "fp8_ue8m0", 32)
        return (r(t, HEADS, 128, dtype=bf, scale=3.0), "fp4_ue8m0", 32)
    if op == "deepseek_v41.engram_hash":
        tokens_ = torch.randint(0, 99092, (t, NGRAM), generator=g).to(device)
        mult = (torch.randint(0, 2**40, (NGRAM,), generator=g) * 2 + 1).to(device)
        primes = torch.randint(15_000_000, 17_000_000, ((NGRAM - 1) * ENGRAM_HEADS,), generator=g)
        offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), primes[:-1]]), 0)
        return (tokens_, mult, primes.to(device), offsets.to(device))
    if op == "deepseek_v41.engram_mix":
        return (
            r(t, HC, HIDDEN, dtype=bf),
            r(t, (HC + 1) * HIDDEN, dtype=bf),
            1 + r(HC, HIDDEN, scale=0.1),
            1 + r(HC, HIDDEN, scale=0.1),
            1e-6,
        )
    raise KeyError(f"no V4-Flash inputs for op {op!r}")
