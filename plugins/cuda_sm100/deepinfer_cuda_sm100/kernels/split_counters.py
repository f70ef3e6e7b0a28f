"""Tile counters of the split-K GEMMs whose last program (CTA) of a tile sums the splits' partials
in the same launch (the Triton FP8 GEMM, :mod:`~deepinfer_cuda_sm100.kernels.fp8_gemm`, and the
TileLang FP8 GEMM, :mod:`~deepinfer_cuda_sm100.tl.fp8_gemm`).

A launch counts each program in its tile's counter and the last one resets it, so every launch
leaves the counters at zero and consecutive launches in one stream share one buffer:
:func:`tile_counters` keeps one zeroed int32 buffer per device and stream role, made by the first
eager call and never freed (a replaced, shorter buffer is kept alive too, since captured graphs
hold its address).  The engine runs a device's kernels on two streams where a block's chains
overlap (:mod:`deepinfer_core.ops.overlap`): GEMMs of the side stream may run while the current
stream's do, so the side stream's launches take the second half of one allocation, the current
stream's (the default stream, a graph's capture stream) the first.

A buffer made during a CUDA-graph capture would be zeroed by a memset recorded in that graph,
not before it, so other graphs (or eager calls) could find it unset: while a capture runs and
no buffer exists, :func:`tile_counters` gives ``None`` and the caller sums the splits another
way for that call (logged once).  The engine's warm-up before its capture makes the buffer.
"""

from __future__ import annotations

import functools
import logging

import torch

from deepinfer_core.ops.overlap import on_side_stream

logger = logging.getLogger("deepinfer.cuda_sm100")

SLOTS = 1 << 16
"""Counters a buffer holds at least (a decode GEMM's tiles are far fewer)."""

_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[torch.Tensor] = []


def tile_counters(device: torch.device, tiles: int, side: bool | None = None) -> torch.Tensor | None:
    """The zeroed counters of ``device`` with room for ``tiles`` (the first ``tiles`` are the
    launch's) for the current stream (``side``: the side stream's share, ``None`` = whether the
    current stream is the side stream), or ``None`` while a CUDA graph is captured before any
    buffer was made."""
    if side is None:
        side = on_side_stream(device)
    halves = _BUFFERS.get(device)
    if halves is not None and halves[0].numel() >= tiles:
        return halves[side]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _warn_capture_without_counters()
        return None
    if halves is not None:
        _RETIRED.extend(halves)
    size = max(tiles, SLOTS)
    both = torch.zeros(2 * size, dtype=torch.int32, device=device)
    halves = _BUFFERS[device] = (both[:size], both[size:])
    return halves[side]


def buffers() -> list[torch.Tensor]:
    """Every buffer made so far (each all zeros between launches)."""
    return [*(h for halves in _BUFFERS.values() for h in halves), *_RETIRED]


@functools.cache
def _warn_capture_without_counters() -> None:
    logger.warning(
        "split-K GEMM: a CUDA graph is captured before any eager call made the tile counters; the "
        "captured calls sum the splits' partials outside the GEMM's launch"
    )
