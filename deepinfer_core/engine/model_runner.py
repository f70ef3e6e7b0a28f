"""The model runner: loads a checkpoint, owns the model and its cache, runs steps.

``execute(chunks)`` turns the scheduler's chunks into one flat varlen batch (host-side
index plans, :mod:`deepinfer_core.models.deepseek_v4.metadata`), runs the model and
returns the logits of the rows that sample.
"""

from __future__ import annotations

import logging
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepinfer_core.models.cache_spec import HybridCache, spec_bytes
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.metadata import build_metadata
from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.weights import load_checkpoint

from .batch import SeqChunk
from .kv_cache import KVCacheManager

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig

logger = logging.getLogger("deepinfer.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Loads ``model_dir`` and runs forward steps over a paged hybrid KV cache.

    Args:
        model_dir: checkpoint directory (``config.json`` + safetensors).
        config: the engine configuration (dtype, device, max_num_seqs, max_model_len,
            page_size, num_cache_pages / kv_cache_memory_gb).
        ops: the resolved op table.
    """

    def __init__(self, model_dir: str | Path, config: EngineConfig, ops: OpTable):
        self.model_config = cfg = DeepseekV4Config.from_file(model_dir)
        self.device = torch.device(config.device or "cpu")
        self.dtype = _DTYPES[config.resolved_dtype(self.device.type)]
        self.ops = ops
        self.batch_invariant = config.batch_invariant
        weights = load_checkpoint(model_dir, cfg, self.dtype, self.device)
        self.model = DeepseekV4Model(cfg, weights, ops)
        self.page_size = config.resolved_page_size(self.model.ratios)
        self.max_model_len = config.resolved_max_model_len(cfg.max_position_embeddings)
        specs = self.model.cache_specs()
        per_page = per_slot = 0
        for layer_specs in specs:
            for spec in layer_specs:
                p, s = spec_bytes(spec, self.page_size, self.dtype)
                per_page, per_slot = per_page + p, per_slot + s
        num_pages = self._num_pages(config, per_page)
        self.kv_cache = KVCacheManager(
            num_pages, self.page_size, config.max_num_seqs, enable_prefix_caching=config.enable_prefix_caching
        )
        self.replay_tail = self._replay_tail(config)
        self.cache = HybridCache(
            specs, num_pages, self.page_size, config.max_num_seqs, self.dtype, self.device
        )
        logger.info(
            "KV cache: %d pages x %d tokens = %d token capacity (%.1f MiB paged, %.1f MiB per-seq state)",
            num_pages,
            self.page_size,
            num_pages * self.page_size,
            num_pages * per_page / 2**20,
            config.max_num_seqs * per_slot / 2**20,
        )

    def _num_pages(self, config: EngineConfig, per_page: int) -> int:
        if config.num_cache_pages is not None:
            return config.num_cache_pages
        if config.kv_cache_memory_gb is not None:
            return max(1, int(config.kv_cache_memory_gb * 2**30 // max(per_page, 1)))
        return config.max_num_seqs * -(-self.max_model_len // self.page_size)

    def _replay_tail(self, config: EngineConfig) -> int:
        """Tokens recomputed before a prefix-cache hit to rebuild every layer's window.

        A layer's window KV at position ``p`` is exact once the layer below is exact over
        ``[p - W + 1, p]``, so the receptive field grows by one window per windowed layer:
        the exact V4 bound is ``align(align(W, P) + (N - 1) * W, P)`` with ``N`` windowed
        layers and page size ``P``.  ``config.replay_tail`` overrides it (rounded up to a
        page; a shorter tail gives an approximate window, as V4.1's decoder-side tail does).
        """
        p, w = self.page_size, self.model_config.sliding_window
        n = self.model_config.num_hidden_layers  # every V4 layer has a sliding window

        def align(x: int) -> int:
            return -(-x // p) * p

        return align(config.replay_tail) if config.replay_tail is not None else align(align(w) + (n - 1) * w)

    @property
    def capacity_tokens(self) -> int:
        """Token positions the paged cache can hold."""
        return self.kv_cache.num_pages * self.page_size

    def execute(self, chunks: list[SeqChunk], prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; float32 logits of every sampling row, in chunk order.

        A chunk contributes its last row when ``sample`` is set, or all its rows when
        ``all_logits`` is set.  ``prev_tokens`` (async scheduling) are the previous step's
        sampled tokens, still on the device: chunks with ``prev_row >= 0`` take their token
        from it, so no host round trip separates two steps.
        """
        for c in chunks:
            if len(c.block_table) * self.page_size < c.end_pos:
                raise ValueError(
                    f"slot {c.seq_slot}: block table of {len(c.block_table)} pages cannot hold "
                    f"{c.end_pos} positions (page_size {self.page_size})"
                )
        md = build_metadata(
            chunks,
            self.model_config.sliding_window,
            self.model.ratios,
            self.page_size,
            self.kv_cache.num_slots,
            self.device,
        )
        pending = [(i, c.prev_row) for i, c in enumerate(chunks) if c.prev_row >= 0]
        if pending:
            if prev_tokens is None:
                raise ValueError("chunks refer to the previous step's tokens but none were given")
            starts = list(accumulate((c.num_tokens for c in chunks), initial=0))
            rows = torch.tensor([starts[i] for i, _ in pending], device=md.input_ids.device)
            src = torch.tensor([r for _, r in pending], device=prev_tokens.device)
            md.input_ids.index_copy_(0, rows, prev_tokens.index_select(0, src).to(md.input_ids))
        with batch_invariant_mode(self.batch_invariant):
            return self.model.forward(md, self.cache)
