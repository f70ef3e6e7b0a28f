"""Execution modes the reference ops consult: batch-invariant mode.

Under :func:`batch_invariant_mode` every op marked ``batch_invariant`` in the contract gives
each row (token, window, query) a result that is bitwise independent of the other rows of the
call, of how many there are, and of how much ``-1`` padding the index lists carry.  Measured
on CPU (torch 2.13, MKL), three things otherwise make a row's bits depend on the batch:

- **GEMM kernel choice by shape.**  ``x @ w.T`` for one row takes a GEMV path, two and three
  rows small-matrix kernels, and with several threads the split over rows moves; each sums
  in a different order.  In the mode every matmul runs on fixed tiles of
  :data:`ROW_TILE` rows (the last one zero-padded), one ``bmm`` item per tile, so every
  GEMM has the same shape.
- **Scalar tails of vectorised loops.**  An elementwise kernel runs SIMD over the flat
  tensor and finishes the last ``numel % 32`` elements with scalar code, whose ``exp`` /
  ``sigmoid`` / ``sin`` differ from the SIMD ones in the last bit.  In the mode each op
  zero-pads its row dimension to a multiple of :data:`ROW_TILE`, so no tensor it touches
  has a tail and every element takes the SIMD path.
- **Thread splits.**  With several intra-op threads, parallel loops and reductions split at
  points that depend on the tensor size.  The mode runs with one intra-op thread (restored
  on exit); on the tiny CPU model that is also the faster setting.

On other devices the same structure holds once every fixed tile runs through a GEMM whose
per-row bits do not depend on the tile count (cuBLAS picks kernels and split-K by the whole
``bmm`` shape): the mode takes that GEMM as ``matmul`` (the engine passes its op table's
``tile_matmul``, which a backend may provide; the reference is ``torch.bmm``), and every
fixed-tile product of the mode goes through :func:`mode_matmul`.

Reductions whose length depends on the batch (attention over the keys, indexer scores over
the candidates) run in fixed blocks of :data:`KEY_BLOCK` over the valid entries in a
canonical order; all-padding blocks are exact no-ops (see ``ops/attention.py``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

ROW_TILE = 64
"""Rows per GEMM tile, and the multiple every op pads its row dimension to in the mode
(a multiple of the widest SIMD loop step: 32 fp32 / 64 bf16 lanes x 2 on AVX-512)."""

KEY_BLOCK = 64
"""Keys (attention) or candidates (indexer) per block of a batch-dependent-length reduction."""

_ENABLED: ContextVar[bool] = ContextVar("deepinfer_batch_invariant", default=False)

TileMatmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_MATMUL: ContextVar[TileMatmul | None] = ContextVar("deepinfer_tile_matmul", default=None)


def batch_invariant_enabled() -> bool:
    """Whether the calling context runs in batch-invariant mode."""
    return _ENABLED.get()


@contextmanager
def batch_invariant_mode(enabled: bool = True, matmul: TileMatmul | None = None) -> Iterator[None]:
    """Run the enclosed ops batch-invariantly (``enabled=False``: a cheap no-op scope).

    Args:
        enabled: whether the mode is on in the scope.
        matmul: the fixed-tile GEMM the mode's products run on (the ``tile_matmul`` op's
            signature); ``None``: ``torch.bmm``, batch invariant on CPU only.

    Enabling also sets torch's intra-op threads to 1 for the scope (process-wide, restored
    on exit): see the module docstring.
    """
    token = _ENABLED.set(enabled)
    matmul_token = _MATMUL.set(matmul)
    threads = torch.get_num_threads()
    if enabled and threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if enabled and threads != 1:
            torch.set_num_threads(threads)
        _MATMUL.reset(matmul_token)
        _ENABLED.reset(token)


def mode_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.transpose(1, 2)`` for ``a [n, R, K]`` and ``b [n, N, K]`` on the mode's GEMM
    (see :func:`batch_invariant_mode`): item ``i`` of the result, and each of its rows, has
    bits that do not depend on ``n`` or on the other items."""
    fn = _MATMUL.get()
    if fn is None:
        return torch.bmm(a, b.transpose(1, 2))
    return fn(a, b)


def padded_len(n: int, multiple: int = ROW_TILE) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def pad_rows(x: torch.Tensor, rows: int, value: float = 0) -> torch.Tensor:
    """``x`` with dim 0 extended to ``rows`` by rows filled with ``value``."""
    if x.shape[0] == rows:
        return x
    out = x.new_full((rows, *x.shape[1:]), value)
    out[: x.shape[0]] = x
    return out


def pad_cols(x: torch.Tensor, cols: int, value: float = 0) -> torch.Tensor:
    """2-D ``x`` with dim 1 extended to ``cols`` by columns filled with ``value``."""
    if x.shape[1] == cols:
        return x
    out = x.new_full((x.shape[0], cols), value)
    out[:, : x.shape[1]] = x
    return out


def tiled_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with every GEMM on a ``[ROW_TILE, K] x [K, N]`` tile.

    ``x`` is ``[..., K]``; the rows are zero-padded to a multiple of :data:`ROW_TILE` and run
    as the items of one :func:`mode_matmul` against the (stride-0 expanded) weight, so a
    row's result does not depend on how many rows there are or where it sits.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k).contiguous()
    t = flat.shape[0]
    tiles = padded_len(max(t, 1)) // ROW_TILE
    xp = pad_rows(flat, tiles * ROW_TILE).view(tiles, ROW_TILE, k)
    w = weight.unsqueeze(0).expand(tiles, -1, -1)
    return mode_matmul(xp, w).reshape(tiles * ROW_TILE, -1)[:t].view(*lead, weight.shape[0])


def _explicit(a: Any) -> torch.Tensor:
    """A tensor argument as is; a structured index (``PagedIndex``) as its explicit rows."""
    return a if isinstance(a, torch.Tensor) else a.rows()


def row_padded(pad_values: Mapping[str, float]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for an op whose named arguments are row-indexed (dim 0; lists: each item).

    In batch-invariant mode they are made contiguous and their rows zero-padded (with
    ``pad_values[name]``) to a multiple of :data:`ROW_TILE`; every tensor the op returns is
    cut back to the original rows.  Outside the mode the op runs as is.
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not _ENABLED.get():
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            first = bound.arguments[next(iter(pad_values))]
            t = (first[0] if isinstance(first, list | tuple) else first).shape[0]
            rows = padded_len(max(t, 1))
            # contiguous too: a strided view (a split of a fused projection) takes other
            # (per-row scalar) loops than the padded copy would
            for name, value in pad_values.items():
                a = bound.arguments.get(name)  # an optional argument left out: not padded
                if isinstance(a, list | tuple):
                    bound.arguments[name] = [pad_rows(_explicit(i), rows, value).contiguous() for i in a]
                elif a is not None:
                    bound.arguments[name] = pad_rows(_explicit(a), rows, value).contiguous()
            out = fn(*bound.args, **bound.kwargs)
            if t == rows:
                return out
            if isinstance(out, tuple):
                return tuple(o[:t] for o in out)
            return out[:t]

        return call

    return wrap
