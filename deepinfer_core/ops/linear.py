"""Dense projections and embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.weights.quant import QuantizedTensor

from ._cases import randn, randn_fp8
from .modes import batch_invariant_enabled, tiled_linear
from .registry import define_op


def _linear_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    return [
        ((randn(g, 7, 64, dtype=dtype), randn(g, 48, 64, dtype=dtype, scale=0.1)), {}),
        # FP8 128x128 blocks (keep_quantized): whole tiles, then partial edge tiles and ue8m0 scales
        ((randn(g, 7, 256, dtype=dtype), randn_fp8(g, 256, 256, scale=0.1)), {}),
        ((randn(g, 5, 320, dtype=dtype), randn_fp8(g, 192, 320, scale=0.1, scale_dtype="ue8m0")), {}),
    ]


def _dense(weight: torch.Tensor | QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a tensor: a :class:`QuantizedTensor` dequantised (per call) to ``dtype``."""
    return weight.dequantize(dtype) if isinstance(weight, QuantizedTensor) else weight


@define_op("linear", "linear", batch_invariant=True, sample_cases=_linear_cases)
def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """``y = x @ weight.T``.

    Args:
        x: ``[T, K]`` (or ``[..., K]``) activations in the model dtype.
        weight: ``[N, K]`` weight in the model dtype (row-major, HF layout), or, with the
            engine option ``keep_quantized``, a
            :class:`~deepinfer_core.weights.quant.QuantizedTensor` of logical shape ``[N, K]``
            (``fmt="fp8"``: ``float8_e4m3fn`` data with block scales, 128x128 in V4).

    Returns:
        ``[T, N]`` in ``x.dtype``.  A quantised weight counts as its dequantised value
        ``weight.dequantize(x.dtype)`` (the reference dequantises per call).

    Batch invariance: a row's result must not depend on the number of rows (the reference
    runs fixed ``[ROW_TILE, K]`` GEMM tiles in the mode, see :mod:`.modes`).
    """
    weight = _dense(weight, x.dtype)
    if batch_invariant_enabled():
        return tiled_linear(x, weight)
    return F.linear(x, weight)


def _grouped_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    return [
        ((randn(g, 5, 2, 64, dtype=dtype), randn(g, 2 * 16, 64, dtype=dtype, scale=0.1)), {}),
        ((randn(g, 5, 2, 256, dtype=dtype), randn_fp8(g, 2 * 128, 256, scale=0.1)), {}),
    ]


@define_op("grouped_linear", "linear", batch_invariant=True, sample_cases=_grouped_cases)
def grouped_linear(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """Block-diagonal projection: group ``g`` of ``x`` times block ``g`` of ``weight``.

    Args:
        x: ``[T, G, K]``.
        weight: ``[G*N, K]``; rows ``g*N:(g+1)*N`` are group ``g``'s ``[N, K]`` block
            (V4's grouped output projection ``o_a_proj``).  With ``keep_quantized`` it may be
            a :class:`~deepinfer_core.weights.quant.QuantizedTensor` (FP8 blocks), as for
            :func:`linear`.

    Returns:
        ``[T, G, N]`` in ``x.dtype`` (a quantised weight counts as ``weight.dequantize(x.dtype)``).
    """
    weight = _dense(weight, x.dtype)
    groups = x.shape[1]
    if batch_invariant_enabled():  # one fixed-tile GEMM per group
        blocks = weight.view(groups, -1, x.shape[-1])
        return torch.stack([tiled_linear(x[:, g], blocks[g]) for g in range(groups)], dim=1)
    w = weight.view(groups, -1, x.shape[-1]).transpose(1, 2)  # [G, K, N]
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def _tile_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    shared = randn(g, 40, 96, dtype=dtype, scale=0.1)
    return [
        ((randn(g, 3, 64, 96, dtype=dtype), randn(g, 3, 40, 96, dtype=dtype, scale=0.1)), {}),
        # one weight for every tile (stride 0 over the items, as ``tiled_linear`` passes it)
        ((randn(g, 2, 64, 96, dtype=dtype), shared.unsqueeze(0).expand(2, -1, -1)), {}),
        ((randn(g, 1, 5, 33, dtype=dtype), randn(g, 1, 17, 33, dtype=dtype, scale=0.1)), {}),
    ]


@define_op("tile_matmul", "linear", batch_invariant=True, sample_cases=_tile_cases)
def tile_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The GEMM of batch-invariant mode: ``a @ b.transpose(1, 2)`` item by item.

    Args:
        a: ``[n, R, K]`` tiles of rows (the mode uses ``R = ROW_TILE``).
        b: ``[n, N, K]`` one weight per tile, in the weight layout of :func:`linear` (may be a
            stride-0 expansion of one ``[N, K]`` weight, or any other strides).

    Returns:
        ``[n, R, N]`` in ``a.dtype``.

    Batch invariance: every item, and every row of it, must get bits that do not depend on
    ``n``, on the other items or rows, or on the strides of ``b``; ``float32`` inputs are
    multiplied in full fp32 (no TF32).  Every fixed-tile product of the mode goes through this
    op (:func:`~deepinfer_core.ops.modes.mode_matmul`), so a backend that provides it makes
    the reference's GEMM-bearing ops (``linear``, ``grouped_linear``, ``moe_experts``,
    ``hc_pre``, ``hc_head``) batch invariant on its device.  The reference (``torch.bmm``) is
    batch invariant on CPU only: cuBLAS chooses kernels and split-K by the whole shape.
    """
    return torch.bmm(a, b.transpose(1, 2))


def _embed_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    return [((torch.randint(0, 50, (9,), generator=g), randn(g, 50, 32, dtype=dtype)), {})]


@define_op("embedding", "linear", batch_invariant=True, sample_cases=_embed_cases)
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Row lookup: ``weight[ids]``.

    Args:
        ids: ``[T]`` int64 token ids.
        weight: ``[V, D]`` embedding table.

    Returns:
        ``[T, D]`` in ``weight.dtype``.
    """
    return F.embedding(ids, weight)
