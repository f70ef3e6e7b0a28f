"""The KV compressor of CSA / HCA layers (and of the Lightning Indexer).

Each closed window of ``r`` tokens becomes one entry: a softmax-gated pooling of the
window's projected rows (with a learned per-slot position bias), RMS-normed and rotated
to the window's first position.  CSA (``overlap=True``) projects two series per token:
entry ``w`` pools window ``w-1``'s first-half series with window ``w``'s second-half
series (width ``2r``, stride ``r``), so the previous window's first half is carried across
steps in the slot state.  Tokens of the unfinished window wait in the slot buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.models.cache_spec import CacheSpec, PagedSpec, PageStateSpec, SlotStateSpec
from deepinfer_core.ops import OpTable

from .metadata import StepMetadata, WindowPlan


class Compressor:
    """One compressor (main KV or indexer keys) of one layer.

    Args:
        prefix: weight-name prefix (``...self_attn.compressor.`` or ``...compressor.indexer.``).
        weights: the model's tensors by HF name.
        ratio: compress ratio ``r``; dim: entry width; overlap: CSA's two-series scheme.
        pool_name: name of the paged spec the entries go to; eps: RMS-norm eps.
        cos_sin: ``(inv_freq, scale)`` of the compress rope family.
    """

    def __init__(
        self,
        prefix: str,
        weights: dict[str, torch.Tensor],
        ratio: int,
        dim: int,
        overlap: bool,
        pool_name: str,
        eps: float,
    ):
        self.in_weights = [weights[prefix + "kv_proj.weight"], weights[prefix + "gate_proj.weight"]]
        self.bias = weights[prefix + "position_bias"].float()  # [r, coff*dim]
        self.norm = weights[prefix + "kv_norm.weight"]
        self.ratio, self.dim, self.overlap, self.eps = ratio, dim, overlap, eps
        self.pool_name = pool_name
        self.width = (2 if overlap else 1) * dim

    def cache_specs(self) -> list[CacheSpec]:
        """The paged entry pool plus the slot buffers (and the overlap carry for CSA)."""
        n = self.pool_name
        specs: list[CacheSpec] = [
            PagedSpec(n, self.ratio, self.dim),
            SlotStateSpec(n + ".buf_kv", (self.ratio, self.width)),
            SlotStateSpec(n + ".buf_gate", (self.ratio, self.width)),
        ]
        if self.overlap:
            specs += [
                SlotStateSpec(n + ".carry_kv", (self.ratio, self.dim)),
                SlotStateSpec(n + ".carry_gate", (self.ratio, self.dim), dtype=torch.float32),
                PageStateSpec(n + ".page_carry_kv", (self.ratio, self.dim)),
                PageStateSpec(n + ".page_carry_gate", (self.ratio, self.dim), dtype=torch.float32),
            ]
        return specs

    def __call__(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        md: StepMetadata,
        cache_get,
        ops: OpTable,
        rope: tuple[torch.Tensor, float],
    ) -> torch.Tensor:
        """Compress this step's closed windows into the pool; returns the pool tensor.

        ``kv`` and ``gate`` are this step's projections (``x @ in_weights``), ``[T, width]``.
        """
        plan: WindowPlan = md.plans[self.ratio]
        n, r = self.pool_name, self.ratio
        pool = cache_get(n)
        buf_kv, buf_gate = cache_get(n + ".buf_kv"), cache_get(n + ".buf_gate")
        if self.overlap and plan.restore_slot.numel():  # prefix hit: resume at a page boundary
            for name in ("carry_kv", "carry_gate"):
                snapshot = cache_get(f"{n}.page_{name}").index_select(0, plan.restore_page)
                cache_get(f"{n}.{name}").index_copy_(0, plan.restore_slot, snapshot)
        if plan.windows.numel():
            stage_kv = F.embedding(plan.windows, torch.cat([buf_kv.view(-1, self.width), kv]))  # [M, r, C]
            stage_gate = F.embedding(plan.windows, torch.cat([buf_gate.view(-1, self.width), gate]))
            stage_gate = stage_gate.float() + self.bias
            if self.overlap:
                d = self.dim
                carry_kv, carry_gate = cache_get(n + ".carry_kv"), cache_get(n + ".carry_gate")
                empty_kv = stage_kv.new_zeros(1, r, d)
                empty_gate = stage_gate.new_full((1, r, d), float("-inf"))
                prev_kv = torch.cat([carry_kv, stage_kv[..., :d], empty_kv]).index_select(0, plan.prev)
                prev_gate = torch.cat([carry_gate, stage_gate[..., :d], empty_gate]).index_select(
                    0, plan.prev
                )
                win_kv = torch.cat([prev_kv, stage_kv[..., d:]], dim=1)
                win_gate = torch.cat([prev_gate, stage_gate[..., d:]], dim=1)
                for name, staged in (("carry_kv", stage_kv), ("carry_gate", stage_gate)):
                    first_half = staged[:, :, :d]
                    cache_get(f"{n}.{name}").index_copy_(
                        0, plan.carry_slot, first_half.index_select(0, plan.carry_window)
                    )
                    if plan.snap_window.numel():  # the carry at each page end, for prefix hits
                        cache_get(f"{n}.page_{name}").index_copy_(
                            0, plan.snap_page, first_half.index_select(0, plan.snap_window)
                        )
            else:
                win_kv, win_gate = stage_kv, stage_gate
            entries = ops.rms_norm(ops.compress_pool(win_kv, win_gate), self.norm, self.eps)
            inv_freq, scale = rope
            cos, sin = ops.rope_cos_sin(plan.positions, inv_freq, scale, entries.dtype)
            pool.index_copy_(0, plan.dest, ops.apply_rope(entries, cos, sin).to(pool.dtype))
        if plan.buf_tokens.numel():
            buf_kv.view(-1, self.width).index_copy_(0, plan.buf_rows, kv.index_select(0, plan.buf_tokens))
            buf_gate.view(-1, self.width).index_copy_(0, plan.buf_rows, gate.index_select(0, plan.buf_tokens))
        return pool
