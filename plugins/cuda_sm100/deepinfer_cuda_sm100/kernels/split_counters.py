"""Tile counters of the split-K GEMM whose last program of a tile sums the splits' partials in the
same launch (the Triton FP8 GEMM, :mod:`~deepinfer_cuda_sm100.kernels.fp8_gemm`).

A launch counts each program in its tile's counter and the last one resets it, so every launch
leaves the counters at zero and consecutive launches share one buffer: :func:`tile_counters`
keeps one zeroed int32 buffer per device, made by the first eager call and never freed (a
replaced, shorter buffer is kept alive too, since captured graphs hold its address).  The
launches of a device run in stream order (as the engine's do: one stream a device); two
streams running such GEMMs at the same time on one device would need buffers of their own.

A buffer made during a CUDA-graph capture would be zeroed by a memset recorded in that graph,
not before it, so other graphs (or eager calls) could find it unset: while a capture runs and
no buffer exists, :func:`tile_counters` gives ``None`` and the caller sums the splits another
way for that call (logged once).  The engine's warm-up before its capture makes the buffer.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger("deepinfer.cuda_sm100")

SLOTS = 1 << 16
"""Counters a buffer holds at least (a decode GEMM's tiles are far fewer)."""

_BUFFERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The zeroed counters of ``device`` with room for ``tiles`` (the first ``tiles`` are the
    launch's), or ``None`` while a CUDA graph is captured before any buffer was made."""
    buf = _BUFFERS.get(device)
    if buf is not None and buf.numel() >= tiles:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _warn_capture_without_counters()
        return None
    if buf is not None:
        _RETIRED.append(buf)
    _BUFFERS[device] = buf = torch.zeros(max(tiles, SLOTS), dtype=torch.int32, device=device)
    return buf


def buffers() -> list[torch.Tensor]:
    """Every buffer made so far (each all zeros between launches)."""
    return [*_BUFFERS.values(), *_RETIRED]


@functools.cache
def _warn_capture_without_counters() -> None:
    logger.warning(
        "split-K GEMM: a CUDA graph is captured before any eager call made the tile counters; the "
        "captured calls sum the splits' partials outside the GEMM's launch"
    )
