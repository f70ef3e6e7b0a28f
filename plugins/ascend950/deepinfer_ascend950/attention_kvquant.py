"""``sparse_attention`` over packed FP8 pools through torch_npu's
``npu_kv_quant_sparse_flash_attention`` (QSFA).

**Format.**  The backend declares ``kv_formats={"fp8": "fp8_tile128"}`` (:data:`~.backend.KV_FORMATS`),
so with ``kv_cache_dtype="fp8"`` the engine stores the window ring and the compressed entries as
:class:`~deepinfer_core.ops.kv_tile.TileFp8KVPool` rows: 512 e4m3 values, the operator's 64-wide
rope operand, four float32 scales, 656 bytes -- the operator's ``KV_D`` with
``key_quant_mode=2`` (per tile), ``quant_scale_repo_mode=1`` (scales in the row),
``tile_size=128``.  The model makes this step's keys a pool of the same format.  The rows go to
the operator as they are (``float8_e4m3fn``, viewed ``PA_BSND``), as key and as value.

**Query.**  576 wide: V4's 512-wide head (rope channels included; the pool quantises them with
the rest, so the operator's 512-wide value operand is the whole row) and a 64-wide rope part.

**Sinks.**  The operator has no ``sinks`` argument, so the op folds them into the rope operand,
which the pool rows leave zero: one extra key row with zero values and a rope operand of
``[1, 1, 1, 0, ...]``, listed last for every query, and per head a query rope part holding
``sink / scale`` split into three bfloat16 parts (``hi + mid + lo``, 24 significant bits).  Its
logit is then the sink (``(hi + mid + lo) * scale``), it takes its share of the softmax and adds
nothing to the output: the contract's sink.  The split needs bfloat16's exponent range, so the
op takes bfloat16 queries only.

As in :mod:`.attention_sparse`, the sources are concatenated into one key tensor per call.
"""

from __future__ import annotations

import torch

from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.kv_tile import ROPE_SLOT, TileFp8KVPool, tile_row_layout

from .attention_checks import Verdict, finite_number, first_problem, is_tensor, not_batch_invariant
from .attention_sparse import KV_BLOCK, SFA_HEAD_DIM, key_positions, valid_first
from .npu import torch_npu

QSFA_HEADS = (1, 2, 4, 8, 16, 32, 48, 64, 128)
"""Query heads the operator takes (48 on the 950 only)."""
SINK_PARTS = 3
"""bfloat16 parts a sink logit is split into (8 significant bits each)."""


def _sink_row(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The packed sink key row: zero values, unit scales, rope operand ``[1] * SINK_PARTS + 0s``."""
    lay = tile_row_layout(SFA_HEAD_DIM)
    row = torch.zeros(lay.row_bytes, dtype=torch.uint8, device=device)
    rope = torch.zeros(ROPE_SLOT, dtype=dtype, device=device)
    rope[:SINK_PARTS] = 1
    row[lay.rope_offset : lay.scale_offset] = rope.view(torch.uint8)
    row[lay.scale_offset :] = torch.ones(lay.tiles, dtype=torch.float32, device=device).view(torch.uint8)
    return row


def _sink_query(sinks: torch.Tensor, scale: float, t: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, H, 64]`` query rope parts whose product with the sink row is ``sinks / scale``."""
    rest = sinks.float() / scale
    parts = []
    for _ in range(SINK_PARTS):
        part = rest.to(dtype)
        parts.append(part)
        rest = rest - part.float()
    h = sinks.shape[0]
    rope = torch.zeros(h, ROPE_SLOT, dtype=dtype, device=sinks.device)
    rope[:, :SINK_PARTS] = torch.stack(parts, dim=1)
    return rope.unsqueeze(0).expand(t, h, ROPE_SLOT)


def sparse_attention(q, kv_pools, indices, sinks, scale):
    """The contract's ``sparse_attention`` over :class:`TileFp8KVPool` sources through
    ``torch_npu.npu_kv_quant_sparse_flash_attention`` (see the module docstring)."""
    npu = torch_npu()
    t, h, d = q.shape
    dev = q.device
    picks, total = key_positions(kv_pools, indices)
    sink = torch.full((t, 1), total, dtype=picks.dtype, device=dev)
    picks = valid_first(torch.cat([picks, sink], dim=1))  # [T, 1, K + 1]
    rows = total + 1
    blocks = -(-rows // KV_BLOCK)
    data = [pool.data for pool in kv_pools] + [_sink_row(q.dtype, dev).view(1, -1)]
    width = data[0].shape[1]
    data.append(data[0].new_zeros(blocks * KV_BLOCK - rows, width))
    key = torch.cat(data).view(torch.float8_e4m3fn).view(blocks, KV_BLOCK, 1, width)
    query = torch.cat([q, _sink_query(sinks, scale, t, q.dtype)], dim=-1).contiguous()
    table = torch.arange(blocks, dtype=torch.int32, device=dev).view(1, blocks)
    out = npu.npu_kv_quant_sparse_flash_attention(
        query,
        key,
        key,
        picks,
        scale,
        2,  # key_quant_mode: per tile
        2,  # value_quant_mode: per tile
        block_table=table,
        actual_seq_lengths_query=torch.full((1,), t, dtype=torch.int32, device=dev),
        actual_seq_lengths_kv=torch.full((1,), blocks * KV_BLOCK, dtype=torch.int32, device=dev),
        sparse_block_size=1,
        layout_query="TND",
        layout_kv="PA_BSND",
        sparse_mode=0,
        attention_mode=2,
        quant_scale_repo_mode=1,
        tile_size=128,
        rope_head_dim=ROPE_SLOT,
    )
    out = out[0] if isinstance(out, tuple | list) else out
    return out[..., :d]  # the page gives the output the query's shape, its example the value's


def sparse_attention_supports(q, kv_pools, indices, sinks, scale) -> Verdict:
    """Whether :func:`sparse_attention` takes the call: every source a :class:`TileFp8KVPool`
    of 512 values per row, bfloat16 ``[T, H, 512]`` queries with a documented ``H``."""
    ok = first_problem(
        not_batch_invariant(),
        is_tensor("q", q),
        is_tensor("sinks", sinks),
        finite_number("scale", scale),
        (
            len(kv_pools) == len(indices) and len(kv_pools) > 0,
            "kv_pools and indices differ in length or are empty",
        ),
    )
    if ok is not True:
        return ok
    for i, pool in enumerate(kv_pools):
        if not isinstance(pool, TileFp8KVPool) or pool.dim != SFA_HEAD_DIM:
            return (
                f"kv_pools[{i}] is not a TileFp8KVPool of {SFA_HEAD_DIM} values per row (the "
                "quantised operator reads one format for every source)"
            )
    t, h, d = q.shape if q.dim() == 3 else (0, 0, 0)
    for i, index in enumerate(indices):
        if not isinstance(index, PagedIndex) and not (
            isinstance(index, torch.Tensor) and index.dim() == 2 and index.shape[0] == t
        ):
            return f"indices[{i}] must be a [{t}, K] tensor or a PagedIndex"
    return first_problem(
        (q.dim() == 3 and d == SFA_HEAD_DIM, f"q must be [T, H, {SFA_HEAD_DIM}], got {tuple(q.shape)}"),
        (q.dtype == torch.bfloat16, f"q dtype {q.dtype}: the sink split takes bfloat16 queries"),
        (h in QSFA_HEADS, f"{h} heads: the operator takes {QSFA_HEADS}"),
        (t >= 1, "no query rows"),
        (sinks.is_floating_point() and tuple(sinks.shape) == (h,), f"sinks must be a float [{h}] tensor"),
        (scale != 0, "scale must not be zero (the sinks are divided by it)"),
    )
