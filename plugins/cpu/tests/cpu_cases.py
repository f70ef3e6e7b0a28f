"""Sample cases at the shapes the cpu kernels are built for (the built-in tiny model: 64 tokens,
4 streams of 64) and at the edges of their loops (other stream counts, odd widths, no token,
strided inputs)."""

from __future__ import annotations

import torch

from deepinfer_core.ops._cases import randn


def _strided(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x], dim=-1)[..., : x.shape[-1]]


def hc_pre_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    def case(t: int, n: int, d: int, iters: int, strided: bool = False) -> tuple[tuple, dict]:
        streams = randn(g, t, n, d, dtype=dtype)
        fn = randn(g, (2 + n) * n, n * d, scale=0.1)
        base, scale = randn(g, (2 + n) * n), 1 + randn(g, 3, scale=0.1)
        args = (_strided(streams) if strided else streams, fn, base, scale)
        return (*args, 1e-6, 1e-6, iters), {}

    return [case(64, 4, 64, 20), case(5, 3, 10, 7, strided=True), case(0, 4, 16, 20), case(3, 2, 9, 1)]


def hc_post_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    def case(t: int, n: int, d: int) -> tuple[tuple, dict]:
        return (
            randn(g, t, d, dtype=dtype),
            randn(g, t, n, d, dtype=dtype),
            randn(g, t, n).sigmoid(),
            randn(g, t, n, n).softmax(-1),
        ), {}

    return [case(64, 4, 64), case(5, 3, 11), case(0, 4, 8)]


def hc_head_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    def case(t: int, n: int, d: int) -> tuple[tuple, dict]:
        return (
            randn(g, t, n, d, dtype=dtype),
            randn(g, n, n * d, scale=0.1),
            randn(g, n),
            randn(g, 1).abs(),
            1e-6,
            1e-6,
        ), {}

    return [case(64, 4, 64), case(5, 3, 11), case(0, 4, 8)]


def rms_norm_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    return [
        ((randn(g, 64, 64, dtype=dtype), 1 + randn(g, 64, scale=0.1), 1e-6), {}),
        ((_strided(randn(g, 7, 13, dtype=dtype)), None, 1e-5), {}),
        ((randn(g, 64, 8, 16, dtype=dtype), None, 1e-6), {}),
        ((randn(g, 0, 32, dtype=dtype), None, 1e-6), {}),
    ]


OWN_CASES = {
    "hc_pre": hc_pre_cases,
    "hc_post": hc_post_cases,
    "hc_head": hc_head_cases,
    "rms_norm": rms_norm_cases,
}
