"""Conformance cases for the shapes the kernels target: DeepSeek-V4-Flash, or a scaled copy.

:func:`own_cases` returns ``{op name: (generator, dtype) -> [(args, kwargs), ...]}`` (the
form of ``OpImpl.sample_cases``) for a :class:`Shapes`: :data:`V4_FLASH` on the GPU,
:data:`SMALL` (same structure, narrow) under Triton's CPU interpreter.  The cases follow the
model's calls (``deepinfer_core/models/deepseek_v4``): norms of the hidden state, of the
query LoRA and of the per-head queries, strided views of a fused projection, the rope of
queries + shared key and its inverse (``qk_norm_rope``: with the norms before it, V4's and
V4.1's), its cos/sin tables (``rope_cos_sin``: positions up to ~1M, scale 1 and a YaRN
factor), the shared expert's clamped SwiGLU (``swiglu``: gate and up
as views of the fused router + shared-expert projection, values beyond the limit), and the
mHC ops with ``hc_mult`` streams (``hc_post_pre``: after a block, for the first block, and with
the unweighted norm); each with a single token (decode), a token block and a
ragged count; and the compressor's entries
(``compress_entries``) and their pooling alone (``compress_pool``, V4.1's) of CSA windows
(``2r`` rows, the first window's first half empty), of HCA windows (``r`` rows) and of the
indexer's keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Cases = list[tuple[tuple, dict]]


@dataclass(frozen=True)
class Shapes:
    """Model widths and token counts of one family of cases."""

    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    hc_mult: int
    q_lora: int
    index_heads: int
    index_head_dim: int
    tokens: tuple[int, ...]
    long_row: int
    """Width of an extra ``rms_norm`` row longer than one kernel tile (multi-tile path)."""
    csa_ratio: int
    """Compress ratio of CSA layers (overlapping windows of ``2 * csa_ratio`` rows)."""
    hca_ratio: int
    """Compress ratio of HCA layers (windows of ``hca_ratio`` rows)."""
    linear_shapes: tuple[tuple[int, int], ...] = ()
    """``(K, N)`` of the FP8 ``linear`` cases (V4-Flash's dense projections, or small ones)."""
    linear_tokens: tuple[int, ...] = ()
    """Token counts ``M`` of the ``linear`` cases: decode launches (``M <= 64``) and prefill."""
    grouped_shape: tuple[int, int, int] = (1, 128, 128)
    """``(G, K, N)`` of the FP8 ``grouped_linear`` cases (V4-Flash's output projection ``o_a``)."""
    shared_inter: int = 2048
    """Intermediate width ``I`` of the shared expert (``swiglu``'s ``[T, I]`` gate and up)."""
    experts: int = 256
    """Router width: the logits that lead the fused projection the shared gate / up are views of."""
    swiglu_tokens: tuple[int, ...] = (1, 64, 256, 37)
    """Token counts of the ``swiglu`` cases: decode, blocks and a ragged count."""
    table_tokens: tuple[int, ...] = (1, 7, 256)
    """Token counts of the ``rope_cos_sin`` cases."""


V4_FLASH = Shapes(
    hidden=4096,
    heads=64,
    head_dim=512,
    rope_dim=64,
    hc_mult=4,
    q_lora=1024,
    index_heads=64,
    index_head_dim=128,
    tokens=(1, 16, 37),
    long_row=16384,
    csa_ratio=4,
    hca_ratio=128,
    linear_shapes=((4096, 1024), (1024, 32768), (4096, 512), (2048, 4096)),
    linear_tokens=(1, 16, 64, 128),
    grouped_shape=(8, 4096, 1024),
    shared_inter=2048,
    experts=256,
    swiglu_tokens=(1, 64, 256, 37),
    table_tokens=(1, 7, 256),
)
SMALL = Shapes(
    hidden=256,
    heads=4,
    head_dim=64,
    rope_dim=16,
    hc_mult=4,
    q_lora=128,
    index_heads=4,
    index_head_dim=32,
    tokens=(1, 5, 19),
    long_row=4100,
    csa_ratio=4,
    hca_ratio=8,
    linear_shapes=((256, 128), (128, 384), (384, 256), (320, 192)),
    linear_tokens=(1, 16, 64, 70),
    grouped_shape=(2, 256, 128),
    shared_inter=1100,  # over one column tile (1024), a partial second one
    experts=16,
    swiglu_tokens=(1, 3, 6),
    table_tokens=(1, 7, 300),  # 300: three programs of BLOCK_T = 128 rows at R = 16
)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _cos_sin(g: torch.Generator, t: int, rope_dim: int, theta: float, dtype: torch.dtype):
    """Rope tables of ``t`` random positions, as ``rope_cos_sin`` builds them."""
    positions = torch.randint(0, 65536, (t,), generator=g)
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2).float() / rope_dim))
    freqs = positions.float()[:, None] * inv
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def own_cases(s: Shapes) -> dict[str, object]:
    """The sample-case functions of every op, for shapes ``s``."""
    t_one, t_block, t_ragged = s.tokens
    n, d = s.hc_mult, s.hidden

    def rms_norm(g: torch.Generator, dtype: torch.dtype) -> Cases:
        fused = _randn(g, t_block, s.q_lora + s.head_dim + s.rope_dim, dtype=dtype)
        q_a = fused[:, : s.q_lora]  # strided views of a fused projection, as the model passes
        kv = fused[:, s.q_lora : s.q_lora + s.head_dim]
        return [
            ((_randn(g, t_block, d, dtype=dtype), 1 + _randn(g, d, scale=0.1), 1e-6), {}),
            ((_randn(g, t_one, d, dtype=dtype), 1 + _randn(g, d, scale=0.1), 1e-6), {}),
            ((q_a, 1 + _randn(g, s.q_lora, scale=0.1), 1e-6), {}),
            ((kv, 1 + _randn(g, s.head_dim, scale=0.1), 1e-6), {}),
            (
                (
                    _randn(g, t_one, s.head_dim, dtype=dtype),
                    (1 + _randn(g, 2 * s.head_dim, scale=0.1))[::2],
                    1e-6,
                ),
                {},
            ),
            ((_randn(g, t_ragged, s.heads, s.head_dim, dtype=dtype), None, 1e-6), {}),
            ((_randn(g, 3, s.long_row, dtype=dtype, scale=3.0), None, 1e-6), {}),
            ((_randn(g, 3, s.long_row, dtype=dtype), 1 + _randn(g, s.long_row, scale=0.1), 1e-5), {}),
        ]

    def apply_rope(g: torch.Generator, dtype: torch.dtype) -> Cases:
        cos, sin = _cos_sin(g, t_block, s.rope_dim, 10000.0, dtype)
        icos, isin = _cos_sin(g, t_ragged, s.rope_dim, 160000.0, dtype)
        qkv = _randn(g, t_block, s.heads + 1, s.head_dim, dtype=dtype)
        return [
            ((qkv, cos, sin), {}),  # queries and the shared key
            ((qkv[:, : s.heads], cos, -sin), {}),  # strided; the inverse rotation
            ((_randn(g, t_ragged, s.index_heads, s.index_head_dim, dtype=dtype), icos, isin), {}),
            ((_randn(g, t_ragged, s.head_dim, dtype=dtype), icos, isin), {}),  # compressor entries
            ((_randn(g, t_block, s.rope_dim, dtype=dtype), cos, sin), {}),  # all channels rotate
        ]

    def qk_norm_rope(g: torch.Generator, dtype: torch.dtype) -> Cases:
        cases = []
        for i, t in enumerate(s.tokens):
            cos, sin = _cos_sin(g, t, s.rope_dim, 10000.0 if i % 2 else 160000.0, dtype)
            # the key row: a strided view of the fused input projection, as the model passes it
            fused = _randn(g, t, s.q_lora + s.head_dim + s.rope_dim, dtype=dtype, scale=3.0)
            kv = fused[:, s.q_lora : s.q_lora + s.head_dim]
            q = _randn(g, t, s.heads, s.head_dim, dtype=dtype, scale=3.0)
            w = 1 + _randn(g, s.head_dim, scale=0.1)
            cases += [((q, kv, w, 1e-6, cos, sin), {}), ((q, kv, w, 1e-6, cos, sin), {"norm_q": False})]
        cases.append(((q, kv, None, 1e-6, cos, sin), {}))  # an unweighted key norm
        return cases

    def rope_cos_sin(g: torch.Generator, dtype: torch.dtype) -> Cases:
        inv = 1.0 / (10000.0 ** (torch.arange(0, s.rope_dim, 2).float() / s.rope_dim))
        yarn = 0.1 * math.log(16) + 1.0  # a YaRN attention factor (compressed rope, factor 16)
        cases = []
        for t in s.table_tokens:
            positions = torch.randint(0, 1 << 20, (t,), generator=g)  # up to ~1M (long contexts)
            positions[-1] = 1_000_000
            cases += [((positions, inv, 1.0, dtype), {}), ((positions, inv, yarn, dtype), {})]
        wide = torch.randint(0, 1 << 20, (2 * t_block,), generator=g)
        # int32 positions, strided (every other one), and a strided inv_freq
        cases.append(((wide.to(torch.int32)[::2], torch.stack([inv, inv], 1)[:, 0], 1.0, dtype), {}))
        return cases

    def swiglu(g: torch.Generator, dtype: torch.dtype) -> Cases:
        inter, limit = s.shared_inter, 10.0
        cases = []
        for i, t in enumerate(s.swiglu_tokens):
            # gate and up are views of the fused [T, E + 2I] router + shared-expert projection;
            # scale 6: a few values beyond the limit on both sides
            fused = _randn(g, t, s.experts + 2 * inter, dtype=dtype, scale=6.0)
            gate, up = fused[:, s.experts : s.experts + inter], fused[:, s.experts + inter :]
            if i % 2:  # contiguous operands too
                gate, up = gate.contiguous(), up.contiguous()
            cases.append(((gate, up, limit), {}))
        return cases

    def hc_pre(g: torch.Generator, dtype: torch.dtype) -> Cases:
        m, k = (2 + n) * n, n * d
        cases = []
        for t in s.tokens:
            fn = _randn(g, m, k, scale=k**-0.5)
            base, scale = _randn(g, m), 1 + _randn(g, 3, scale=0.1)
            cases.append(((_randn(g, t, n, d, dtype=dtype), fn, base, scale, 1e-6, 1e-6, 20), {}))
        return cases

    def hc_post(g: torch.Generator, dtype: torch.dtype) -> Cases:
        cases = []
        for t in s.tokens:
            post = 2 * _randn(g, n, t).sigmoid().t()  # transposed, as hc_pre's reference returns it
            comb = _randn(g, t, n, n).softmax(-1)
            cases.append(((_randn(g, t, d, dtype=dtype), _randn(g, t, n, d, dtype=dtype), post, comb), {}))
        return cases

    def hc_post_pre(g: torch.Generator, dtype: torch.dtype) -> Cases:
        cases = []
        for (args, _), (post_args, _) in zip(hc_pre(g, dtype), hc_post(g, dtype), strict=True):
            _, fn, base, scale, *eps = args
            block_out, streams, post, comb = post_args
            norm = 1 + _randn(g, d, scale=0.1)
            cases.append(((block_out, streams, post, comb, fn, base, scale, *eps, norm), {}))
        (streams, *pre_args), _ = hc_pre(g, dtype)[-1]  # the ragged count
        cases.append(((None, streams, None, None, *pre_args, 1 + _randn(g, d, scale=0.1)), {}))  # first block
        block_out, streams, post, comb = hc_post(g, dtype)[-1][0]
        cases.append(((block_out, streams, post, comb, *pre_args, None), {}))  # an unweighted norm
        return cases

    def hc_head(g: torch.Generator, dtype: torch.dtype) -> Cases:
        k = n * d
        return [
            (
                (
                    _randn(g, t, n, d, dtype=dtype),
                    _randn(g, n, k, scale=k**-0.5),
                    _randn(g, n),
                    _randn(g, 1).abs(),
                    1e-6,
                    1e-6,
                ),
                {},
            )
            for t in s.tokens
        ]

    def hc_head_norm(g: torch.Generator, dtype: torch.dtype) -> Cases:
        cases = [((*args, 1 + _randn(g, d, scale=0.1)), {}) for args, _ in hc_head(g, dtype)]
        return [*cases, ((*cases[-1][0][:-1], None), {})]  # and an unweighted norm

    def compress_entries(g: torch.Generator, dtype: torch.dtype) -> Cases:
        inv = 1.0 / (160000.0 ** (torch.arange(0, s.rope_dim, 2).float() / s.rope_dim))

        def case(m: int, length: int, dim: int, ratio: int, scale: float, strided: bool = False) -> tuple:
            # a strided kv: the second-half series of CSA's [M, L, 2D] staging rows, as sliced
            kv = _randn(g, m, length, 2 * dim, dtype=dtype)[..., dim:] if strided else None
            gate = _randn(g, m, length, dim, scale=2.0)
            if length == 2 * ratio:  # CSA: the first window has no previous window's half
                gate[0, :ratio] = float("-inf")
            n = m + 7
            return (
                kv if strided else _randn(g, m, length, dim, dtype=dtype),
                gate,
                1 + _randn(g, dim, scale=0.1),
                1e-6,
                torch.randint(0, 65536 // ratio, (m,), generator=g) * ratio,
                inv,
                scale,
                _randn(g, n, dim, dtype=dtype),
                torch.randperm(n, generator=g)[:m],
            )

        csa, hca = s.csa_ratio, s.hca_ratio
        return [
            (case(t_block, 2 * csa, s.head_dim, csa, 1.0), {}),  # CSA main entries
            (case(t_one, 2 * csa, s.head_dim, csa, 1.0, strided=True), {}),
            (case(t_ragged, 2 * csa, s.index_head_dim, csa, 1.0), {}),  # indexer keys
            (case(t_one, hca, s.head_dim, hca, 1.0), {}),  # HCA: one window closes at decode
            (case(3, hca, s.head_dim, hca, 1.2), {}),  # a YaRN cos/sin scale
        ]

    def compress_pool(g: torch.Generator, dtype: torch.dtype) -> Cases:
        # the windows of the compressor's entries (kv and gate, the first two arguments)
        return [(args[:2], {}) for args, _ in compress_entries(g, dtype)]

    def linear(g: torch.Generator, dtype: torch.dtype) -> Cases:
        from deepinfer_core.ops._cases import randn_fp8

        cases = []
        for i, (k, n) in enumerate(s.linear_shapes):
            w = randn_fp8(g, n, k, scale=k**-0.5, scale_dtype="ue8m0" if i % 2 else "fp32")
            cases += [((_randn(g, m, k, dtype=dtype), w), {}) for m in s.linear_tokens]
        return cases

    def tile_matmul(g: torch.Generator, dtype: torch.dtype) -> Cases:
        # the mode's tiles: ROW_TILE rows against one shared weight (linear), per-expert
        # weights (moe_experts), and a ragged shape with partial blocks everywhere
        k = s.hidden
        shared = _randn(g, s.q_lora, k, dtype=dtype, scale=k**-0.5)
        return [
            ((_randn(g, 2, 64, k, dtype=dtype), shared.unsqueeze(0).expand(2, -1, -1)), {}),
            (
                (
                    _randn(g, 3, 64, k, dtype=dtype),
                    _randn(g, 3, 2 * s.index_head_dim, k, dtype=dtype, scale=k**-0.5),
                ),
                {},
            ),
            ((_randn(g, 2, 5, 33, dtype=dtype), _randn(g, 2, 17, 33, dtype=dtype, scale=0.2)), {}),
        ]

    def grouped_linear(g: torch.Generator, dtype: torch.dtype) -> Cases:
        from deepinfer_core.ops._cases import randn_fp8

        groups, k, n = s.grouped_shape
        cases = []
        for i, m in enumerate(s.linear_tokens):
            w = randn_fp8(g, groups * n, k, scale=k**-0.5, scale_dtype="ue8m0" if i % 2 else "fp32")
            cases.append(((_randn(g, m, groups, k, dtype=dtype), w), {}))
        return cases

    return {
        "tile_matmul": tile_matmul,
        "grouped_linear": grouped_linear,
        "linear": linear,
        "rms_norm": rms_norm,
        "apply_rope": apply_rope,
        "qk_norm_rope": qk_norm_rope,
        "rope_cos_sin": rope_cos_sin,
        "swiglu": swiglu,
        "compress_pool": compress_pool,
        "hc_pre": hc_pre,
        "hc_post": hc_post,
        "hc_post_pre": hc_post_pre,
        "hc_head": hc_head,
        "hc_head_norm": hc_head_norm,
        "compress_entries": compress_entries,
    }
