"""The release's KV cache formats of a V4.1 layer's window records, compressed entries and
indexer keys (:data:`KV_FORMATS`): the cache specs that pack them (:func:`kv_specs`,
``kv_cache_dtype="fp8"``) and the store of rows with the release's numerics (:func:`store_kv`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from deepinfer_core.errors import ConfigError
from deepinfer_core.models.cache_spec import CacheSpec, PagedSpec, RingSpec
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.kv_blockscaled import block_format, packs
from deepinfer_core.ops.kv_format import KVPool, PackedKVPool

from .ops import op

WINDOW_KV_FORMAT = ("fp8_ue8m0", 32)
"""The release's window record: every channel (rope included) e4m3, one ue8m0 scale per 32."""
COMPRESSED_KV_FORMAT = ("fp4_e4m3", 16)
"""The release's compressed entries: e2m1, one e4m3 scale per 16 channels."""
INDEXER_FORMAT = ("fp4_ue8m0", 32)
"""The release's indexer keys and queries: e2m1, one ue8m0 scale per 32 channels."""
KV_FORMATS = {"window": WINDOW_KV_FORMAT, "ckv": COMPRESSED_KV_FORMAT, "ikv": INDEXER_FORMAT}
"""The release's format of each cache a V4.1 layer keeps rows of (a ``kv_qdq`` format and block,
also the name of the packed ``kv_format`` of ``kv_cache_dtype="fp8"``)."""


def kv_specs(specs: list[CacheSpec], kv_cache_dtype: str) -> tuple[list[CacheSpec], list[str]]:
    """``specs`` with the window / ``ckv`` / ``ikv`` rows in the release's packed formats when
    ``kv_cache_dtype="fp8"`` (``kv_format`` = their :data:`KV_FORMATS` name: MXFP8 window
    records, NVFP4-like entries, MXFP4 indexer keys), and the names of those kept plain because
    their width is not a whole number of blocks (``kv_qdq`` leaves such rows unchanged, so a
    plain cache holds exactly their values).  ``"auto"``: unchanged."""
    if kv_cache_dtype == "auto":
        return specs, []
    if kv_cache_dtype != "fp8":
        raise ConfigError(f"deepseek_v41: kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    out: list[CacheSpec] = []
    plain: list[str] = []
    for s in specs:
        if isinstance(s, RingSpec | PagedSpec) and s.name in KV_FORMATS:
            fmt, block = KV_FORMATS[s.name]
            assert block_format(fmt).block == block, (fmt, block)  # the pool's block is kv_qdq's
            if packs(fmt, s.dim):
                s = replace(s, kv_format=fmt)
            else:
                plain.append(f"{s.name} ({s.dim} values, {fmt} blocks of {block})")
        out.append(s)
    return out, plain


def store_kv(ops: OpTable, pool: KVPool, rows: torch.Tensor, values: torch.Tensor, fmt: tuple) -> None:
    """``values`` into ``pool`` at ``rows`` with the release's numerics ``fmt``: a packed pool
    quantises them itself (``cache_write``, bit for bit ``kv_qdq``'s values once dequantised), a
    plain one takes their ``kv_qdq`` values.  Never both: a second ``fp4_e4m3`` quantisation of
    ``kv_qdq``'s output is not always a no-op (:mod:`deepinfer_core.ops.kv_blockscaled`)."""
    if not isinstance(pool, PackedKVPool):
        values = op(ops, "kv_qdq")(values, *fmt)
    ops.cache_write(pool, rows, values)
