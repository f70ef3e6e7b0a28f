"""The KV compressor's entry op: pool each closed window, norm it, rotate it, store it.

One op for what the compressor does with every window that closes in a step, so a backend
can fuse it into one kernel: softmax-gated pooling of the window's rows, RMS norm, the rope
rotation at the window's first position and the store into the entry pool.  The reference
is exactly the sequence of the separate ops (:func:`~deepinfer_core.ops.attention.compress_pool`,
:func:`~deepinfer_core.ops.norm.rms_norm`, :func:`~deepinfer_core.ops.rope.rope_cos_sin`,
:func:`~deepinfer_core.ops.rope.apply_rope`, :func:`~deepinfer_core.ops.cache.cache_write`),
so the model's outputs are bitwise those of the unfused sequence.
"""

from __future__ import annotations

import torch

from ._cases import randn
from .attention import compress_pool
from .cache import cache_write
from .norm import rms_norm
from .registry import define_op
from .rope import apply_rope, rope_cos_sin


def _inv_freq(rope_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def _entries_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    def case(m: int, r: int, d: int, rope_dim: int, n: int, scale: float, first_empty: bool) -> tuple:
        gate = randn(g, m, r, d)
        if first_empty and m:  # CSA's first window: the previous window's half is empty
            gate[0, : r // 2] = float("-inf")
        positions = torch.randint(0, 4096, (m,), generator=g) * r
        dest = torch.randperm(n, generator=g)[:m]
        return (
            randn(g, m, r, d, dtype=dtype),
            gate,
            1 + randn(g, d, scale=0.1),
            1e-6,
            positions,
            _inv_freq(rope_dim),
            scale,
            randn(g, n, d, dtype=dtype),
            dest,
        )

    return [
        (case(3, 8, 32, 8, 10, 1.0, True), {}),  # CSA-like: overlapping windows, L = 2r
        (case(2, 4, 16, 16, 5, 1.25, False), {}),  # every channel rotates; a YaRN scale
        (case(0, 4, 16, 8, 4, 1.0, False), {}),  # no window closes this step
    ]


@define_op("compress_entries", "compressor", batch_invariant=True, sample_cases=_entries_cases)
def compress_entries(
    kv: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    pool: torch.Tensor,
    dest: torch.Tensor,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compress ``M`` closed windows into entries and store them in the entry pool.

    Per window ``m`` (all arithmetic in fp32; ``round`` = a cast to ``kv.dtype``, round to
    nearest even; nothing is rounded for fp32 ``kv``):

    1. pooling (``compress_pool``): ``p[l] = round(softmax_l(gate[m])[l])`` per channel,
       ``pooled = round(sum_l round(kv[m, l] * p[l]))`` (the sum in fp32);
    2. RMS norm (``rms_norm``, weighted): ``e = round(pooled * rsqrt(mean(pooled²) + eps) * norm_weight)``;
    3. rope (``rope_cos_sin`` then ``apply_rope``) at ``positions[m]``: with
       ``f_i = float(positions[m]) * inv_freq[i]``, ``c_i = round(cos(f_i) * rope_scale)`` and
       ``s_i = round(sin(f_i) * rope_scale)``, the trailing ``R = 2 * len(inv_freq)``
       channels of ``e`` rotate in interleaved pairs:
       ``(e[2i], e[2i+1]) -> (round(e[2i] c_i - e[2i+1] s_i), round(e[2i] s_i + e[2i+1] c_i))``
       (offsets from the start of the rope slice); the leading ``D - R`` channels pass through;
    4. store (``cache_write``): ``pool[dest[m]] = entry``, in the pool's format.

    Args:
        kv: ``[M, L, D]`` the ``L`` source rows of each window (model dtype).
        gate: ``[M, L, D]`` float32 gate logits, position bias included; ``-inf`` marks an
            empty slot (each channel needs a finite logit, else the entry is NaN).
        norm_weight: ``[D]`` float32 RMS-norm weight; eps: the norm's eps.
        positions: ``[M]`` int64 position each entry is rotated to (its window's first).
        inv_freq: ``[R/2]`` float32 inverse frequencies; rope_scale: cos/sin multiplier.
        pool: ``[N, D]`` the entry pool: any cache :func:`~deepinfer_core.ops.cache.cache_write`
            takes (a tensor, whose dtype the entries are cast to, or a packed FP8 pool).
        dest: ``[M]`` int64 pool rows, distinct except the trash page's rows (as ``cache_write``).
        live: optional ``[1]`` int64 count of real windows, on the device: windows
            ``m >= live[0]`` are a fixed-shape step's padding, whose ``dest`` rows are the
            trash page's (nothing reads them), so an implementation may skip them; the
            reference computes them like the others.  ``None``: every window is real.

    Returns:
        ``pool``, written in place (rows not in ``dest`` untouched; with ``live``, the rows of
        padding windows may be left as they were).

    Batch invariance: window ``m``'s entry depends only on row ``m`` of ``kv``, ``gate``,
    ``positions`` and ``dest``, never on ``M`` (each step's ops are batch invariant).
    """
    entries = rms_norm(compress_pool(kv, gate), norm_weight, eps)
    cos, sin = rope_cos_sin(positions, inv_freq, rope_scale, entries.dtype)
    return cache_write(pool, dest, apply_rope(entries, cos, sin))
