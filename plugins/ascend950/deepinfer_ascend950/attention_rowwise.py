"""Row-wise ops on torch_npu operators: ``rms_norm`` (``npu_rms_norm``), ``apply_rope``
(``npu_rotary_mul``, interleave mode) and ``cache_write`` (``npu_scatter_nd_update_``).

``cache_write`` stores rows of the core's caches, whose paged pools are the operators'
``PA_BSND`` layout as a view (see :mod:`.attention_sparse`); a packed pool (FP8, block-scaled)
takes the bytes of the core's own quantisation (``PackedKVPool.quantize``, exact by definition)
scattered as ``int8`` rows, so every KV format the core defines is written through the operator.
"""

from __future__ import annotations

import torch

from deepinfer_core.ops.kv_format import PackedKVPool

from .attention_checks import FLOAT_DTYPES, Verdict, dtype_in, first_problem, is_tensor, not_batch_invariant
from .npu import torch_npu

ROTARY_MAX_DIM = 896
"""``npu_rotary_mul``: the rotated width ``D`` must be even and below this."""
ROTARY_MAX_HEADS = 1000
"""``npu_rotary_mul``, interleave mode: ``B * N`` must be below this (``N`` for TND)."""
SCATTER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64)
"""Cache dtypes ``npu_scatter_nd_update_`` takes (``bool`` too, never a cache here)."""


def rms_norm(x, weight, eps):
    """The contract's ``rms_norm``: weighted, ``npu_rms_norm``'s output; unweighted, ``x`` times
    the operator's ``rstd`` rounded to ``x``'s dtype (the contract rounds the factor first)."""
    npu = torch_npu()
    if weight is not None:
        return npu.npu_rms_norm(x, weight, eps)[0]
    ones = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
    y, rstd = npu.npu_rms_norm(x, ones, eps)
    if x.dtype == torch.float32:
        return y
    return x * rstd.to(x.dtype).unsqueeze(-1)


def rms_norm_supports(x, weight, eps) -> Verdict:
    ok = first_problem(is_tensor("x", x), not_batch_invariant())
    if ok is not True:
        return ok
    ok = first_problem(
        dtype_in("x", x, FLOAT_DTYPES),
        (2 <= x.dim() <= 8, f"x has {x.dim()} dims; the operator takes 2..8"),
        (x.numel() > 0, "empty x"),
    )
    if ok is not True or weight is None:
        return ok
    return first_problem(
        is_tensor("weight", weight),
        (
            tuple(weight.shape) == (x.shape[-1],),
            f"weight has shape {tuple(weight.shape)}, expected [{x.shape[-1]}]",
        ),
        (weight.dtype == torch.float32, f"weight dtype {weight.dtype}: the contract's weight is float32"),
    )


def apply_rope(x, cos, sin):
    """The contract's ``apply_rope``: the trailing ``R`` channels through ``npu_rotary_mul``
    (interleave mode, TND input, ``T1D`` tables with each pair's angle repeated)."""
    npu = torch_npu()
    r = 2 * cos.shape[-1]
    rope = x[..., -r:]
    tnd = rope if x.dim() == 3 else rope.unsqueeze(1)
    r1 = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    r2 = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    rotated = npu.npu_rotary_mul(tnd.contiguous(), r1, r2, rotary_mode="interleave")
    if x.dim() == 2:
        rotated = rotated.squeeze(1)
    return torch.cat([x[..., :-r], rotated], dim=-1)


def apply_rope_supports(x, cos, sin) -> Verdict:
    ok = first_problem(is_tensor("x", x), is_tensor("cos", cos), is_tensor("sin", sin))
    if ok is not True:
        return ok
    ok = first_problem(
        dtype_in("x", x, FLOAT_DTYPES),
        (x.dim() in (2, 3), f"x has {x.dim()} dims, expected [T, D] or [T, H, D]"),
        (cos.dim() == 2 and sin.shape == cos.shape, "cos / sin must be [T, R/2] alike"),
        (cos.dtype == x.dtype and sin.dtype == x.dtype, "cos / sin dtype differs from x's"),
    )
    if ok is not True:
        return ok
    r, heads = 2 * cos.shape[-1], x.shape[1] if x.dim() == 3 else 1
    return first_problem(
        (cos.shape[0] == x.shape[0] and x.shape[0] >= 1, "cos rows differ from x's, or no rows"),
        (2 <= r <= x.shape[-1], f"rope width {r} is not in [2, {x.shape[-1]}]"),
        (r < ROTARY_MAX_DIM, f"rope width {r} >= {ROTARY_MAX_DIM}"),
        (heads < ROTARY_MAX_HEADS, f"{heads} heads >= {ROTARY_MAX_HEADS}"),
    )


def cache_write(cache, rows, values):
    """The contract's ``cache_write`` through ``npu_scatter_nd_update_`` (rows of the cache's
    first dim; a packed pool's quantised bytes as ``int8``)."""
    npu = torch_npu()
    index = rows.view(-1, 1)
    if isinstance(cache, PackedKVPool):
        npu.npu_scatter_nd_update_(
            cache.data.view(torch.int8), index, cache.quantize(values).view(torch.int8)
        )
        return cache
    npu.npu_scatter_nd_update_(cache, index, values.to(cache.dtype))
    return cache


def cache_write_supports(cache, rows, values) -> Verdict:
    ok = first_problem(is_tensor("rows", rows), is_tensor("values", values))
    if ok is not True:
        return ok
    ok = first_problem(
        (rows.dim() == 1 and rows.numel() >= 1, "rows must be a non-empty [M] vector"),
        (rows.dtype in (torch.int32, torch.int64), f"rows dtype {rows.dtype} is not int32 / int64"),
        (values.shape[0] == rows.shape[0] if values.dim() else False, "values rows differ from rows"),
    )
    if ok is not True:
        return ok
    if isinstance(cache, PackedKVPool):
        return first_problem(
            (values.dim() == 2 and values.shape[1] == cache.dim, f"values must be [M, {cache.dim}]"),
            (values.is_floating_point(), f"values dtype {values.dtype} is not a float dtype"),
        )
    return first_problem(
        is_tensor("cache", cache),
        dtype_in("cache", cache, SCATTER_DTYPES) if isinstance(cache, torch.Tensor) else (True, ""),
        (
            isinstance(cache, torch.Tensor) and tuple(values.shape[1:]) == tuple(cache.shape[1:]),
            "values' row shape differs from the cache's",
        ),
    )
