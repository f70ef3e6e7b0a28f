"""Per-step plans of DeepSeek-V4.1: V4's, plus the full-resolution (ratio 1) entry plan.

The window rows, and for each compress ratio ``r > 1`` the compressor's window plan and each
query's visible entries, are exactly V4's (:func:`~deepinfer_core.models.deepseek_v4.metadata.
build_metadata`: V4.1's ratio-2 compressor is V4's non-overlapping one without a position
bias).  A ratio-1 kv source (the CED decoder's, layer 20 of the release) projects one entry per
token: :class:`FullPlan` gives each token's pool row and each query's visible entries (those of
positions ``<= t``).  Engram layers read each token's look-back ids: :class:`LookbackPlan`.
Everything is derived on the device from shapes alone, as V4's plans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.step_inputs import StepInputs
from deepinfer_core.models.deepseek_v4.metadata import StepMetadata, build_metadata
from deepinfer_core.ops.attention import PagedIndex


@dataclass
class FullPlan:
    """Entries of a ratio-1 kv source: one per token.

    ``dest`` ``[T]``: the pool row of each token's entry (page of its position in its request's
    block table), or a trash-page row for a token before its request's prefix-cache boundary
    (its entry is cached; replayed tokens never rewrite it); ``entries``: each query's visible
    entries, positions ``0..t``.
    """

    dest: torch.Tensor
    entries: PagedIndex


@dataclass
class LookbackPlan:
    """Where each token's Engram look-back ids come from.

    The ids of a request's last ``R = K + S`` positions (``K`` look-back ids, ``S`` draft tokens)
    wait in a per-slot ring (``[slots + 1, R]``, position ``q`` at ``slot*R + q % R``), so each
    request carries its own history: interleaved requests never share one, and with async
    scheduling the ids stay on the device.  ``src`` ``[T, K]``: for look-back ``s`` (column
    ``s - 1``) of each token, an index into ``[this step's ids (T) ; the flat ring]``, or ``-1``
    (the pad id) before the request's start or its replay start (``window_from``);
    ``ring_rows`` ``[T]``: the ring row each token's id is written to (the trash slot's for all
    but a chunk's last ``R`` positions, so the writes are distinct).
    """

    src: torch.Tensor
    ring_rows: torch.Tensor


@dataclass
class V41StepMetadata:
    """V4's plans (``v4``: window rows, ratio > 1 compressor plans) plus the ratio-1 plan and the
    Engram look-back plan."""

    v4: StepMetadata
    full: FullPlan | None
    lookback: LookbackPlan | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        return self.v4.input_ids

    @property
    def positions(self) -> torch.Tensor:
        return self.v4.positions

    @property
    def sample_rows(self) -> torch.Tensor:
        return self.v4.sample_rows

    def entries(self, ratio: int) -> PagedIndex:
        """Each query's visible entries of ratio ``ratio`` (``(t + 1) // ratio`` of them)."""
        if ratio == 1:
            assert self.full is not None
            return self.full.entries
        return self.v4.plans[ratio].entries


def build_v41_metadata(
    inputs: StepInputs,
    window: int,
    ratios: list[int],
    page_size: int,
    num_slots: int,
    trash_page: int,
    num_spec_tokens: int = 0,
    lookback: int = 0,
) -> V41StepMetadata:
    """The step's plans for compress ``ratios`` (0 and duplicates ignored) and, with
    ``lookback > 0``, the Engram look-back of that many ids (:class:`LookbackPlan`)."""
    pooled = sorted({r for r in ratios if r > 1})
    v4 = build_metadata(inputs, window, pooled, page_size, num_slots, trash_page, num_spec_tokens)
    if 1 not in ratios and lookback == 0:
        return V41StepMetadata(v4=v4, full=None)
    t, n_req = inputs.num_tokens, inputs.num_reqs
    req = inputs.req
    dev = inputs.input_ids.device
    cum = torch.cumsum(req["len"], 0)
    tok = torch.arange(t, device=dev)
    tok_req = torch.searchsorted(cum, tok, right=True).clamp_(max=max(n_req - 1, 0))
    pos = v4.positions
    full = None
    if 1 in ratios:
        tables = inputs.block_tables.index_select(0, req["slot"])  # [R, P]
        col = (pos // page_size).clamp(max=tables.shape[1] - 1)
        page = tables[tok_req, col]
        live = pos >= req["cached"][tok_req]
        dest = torch.where(live, page * page_size + pos % page_size, trash_page * page_size)
        entries = PagedIndex(
            block_table=tables,
            token_rows=tok_req,
            counts=pos + 1,
            entries_per_page=page_size,
            max_count=inputs.max_end,
        )
        full = FullPlan(dest=dest, entries=entries)
    plan = None
    if lookback:
        rows = lookback + num_spec_tokens  # ring rows per slot
        slot, start = req["slot"][tok_req], req["start"][tok_req]
        end = start + req["len"][tok_req]
        q = pos[:, None] - torch.arange(1, lookback + 1, device=dev)  # [T, K]
        in_chunk = q >= start[:, None]
        in_ring = ~in_chunk & (q >= req["window_from"][tok_req][:, None]) & (q >= 0)
        ring = t + slot[:, None] * rows + q % rows
        src = torch.where(in_chunk, tok[:, None] - (pos[:, None] - q), torch.where(in_ring, ring, -1))
        ring_rows = torch.where(pos >= end - rows, slot, num_slots) * rows + pos % rows
        plan = LookbackPlan(src=src, ring_rows=ring_rows)
    return V41StepMetadata(v4=v4, full=full, lookback=plan)
