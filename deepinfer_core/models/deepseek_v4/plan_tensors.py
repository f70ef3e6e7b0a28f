"""Tensors the step plans keep: those that depend only on static ints (sizes, the cache
geometry), made on first use and kept for the life of the process.

A captured graph reads them by address, so none is ever dropped or written in place; a graph
capture that misses one records its making instead (nothing is kept while a stream
captures).
"""

from __future__ import annotations

import torch

_KEPT: dict[tuple, torch.Tensor] = {}


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a graph."""
    if device.type == "cpu":
        return False
    check = getattr(getattr(torch, device.type, None), "is_current_stream_capturing", None)
    return bool(check()) if check is not None else False


def kept(key: tuple, device: torch.device, make) -> torch.Tensor:
    """The tensor ``make()`` makes for ``key`` on ``device``, kept after its first making
    (outside graph capture).  Not to be modified in place."""
    x = _KEPT.get((key, device))
    if x is None:
        x = make()
        if not capturing(device):
            _KEPT[(key, device)] = x
    return x


def kept_arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` (int64): a prefix of a kept one whose length is a power of two."""
    size = 1 << max(n - 1, 0).bit_length()
    return kept(("arange", size), device, lambda: torch.arange(size, device=device))[:n]


def kept_scalar(value: int, device: torch.device) -> torch.Tensor:
    """``value`` as a kept 0-dim int64 tensor: ``torch.where`` with it is one op (with a
    Python number it also fills a tensor with the number first)."""
    return kept(("scalar", value), device, lambda: torch.full((), value, dtype=torch.int64, device=device))


def kept_column(values: list[int], device: torch.device, keep: bool = True) -> torch.Tensor:
    """``values`` as an int64 column ``[n, 1]`` (one value per ratio), kept unless ``keep`` is
    false (values that change from step to step).  Made by fills only (no host copy), so that
    a graph capture may make one."""

    def make() -> torch.Tensor:
        x = torch.full((len(values), 1), values[0], dtype=torch.int64, device=device)
        for i, v in enumerate(values):
            if i and v != values[0]:
                x[i] = v
        return x

    return kept(("col", *values), device, make) if keep else make()
