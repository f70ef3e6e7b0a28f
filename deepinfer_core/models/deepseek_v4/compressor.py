"""The KV compressor of CSA / HCA layers (and of the Lightning Indexer).

Each closed window of ``r`` tokens becomes one entry: a softmax-gated pooling of the
window's projected rows (with a learned per-slot position bias), RMS-normed and rotated
to the window's first position.  CSA (``overlap=True``) projects two series per token:
entry ``w`` pools window ``w-1``'s first-half series with window ``w``'s second-half
series (width ``2r``, stride ``r``), so the previous window's first half is carried across
steps in the slot state.  Tokens of the unfinished window wait in the slot buffer.

Slot state geometry, with ``nb = 1 + ceil(S/r)`` (:func:`~.metadata.buffer_windows`, ``S``
the most draft tokens of a speculative verify step, 0 without speculation, hence ``nb = 1``):
the buffers ``buf_kv``/``buf_gate`` hold ``nb`` windows per slot, ``[slot, nb*r, width]``,
position ``q`` at row ``q % (nb*r)``; the carries ``carry_kv``/``carry_gate`` hold ``nb``
windows' first halves per slot, ``[slot, nb, r, dim]``, window ``w``'s at index ``w % nb``.
Rejected draft tokens that close windows thus leave the state the accepted tokens need in
place (the per-step row plans are in :mod:`.metadata`).  The page snapshots
``page_carry_*`` keep one carry per page.
"""

from __future__ import annotations

import torch

from deepinfer_core.models.cache_spec import CacheSpec, PagedSpec, PageStateSpec, SlotStateSpec
from deepinfer_core.ops import OpTable
from deepinfer_core.weights.quant import Weight

from .metadata import StepMetadata, WindowPlan, buffer_windows


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
        weights: dict[str, Weight],
        ratio: int,
        dim: int,
        overlap: bool,
        pool_name: str,
        eps: float,
    ):
        self.prefix = prefix
        self.bias = weights[prefix + "position_bias"].float()  # [r, coff*dim]
        self.norm = weights[prefix + "kv_norm.weight"]
        self.ratio, self.dim, self.overlap, self.eps = ratio, dim, overlap, eps
        self.pool_name = pool_name
        self.width = (2 if overlap else 1) * dim

    def pop_in_weights(self, weights: dict[str, Weight]) -> list[tuple[str, Weight]]:
        """The kv and gate projections ``(name, weight)``, removed from ``weights``: the attention
        block fuses them into its input projection, so only the fused copy is kept."""
        return [(n, weights.pop(self.prefix + n)) for n in ("kv_proj.weight", "gate_proj.weight")]

    def cache_specs(self, num_spec_tokens: int = 0) -> list[CacheSpec]:
        """The paged entry pool plus the slot buffers (and the overlap carries for CSA), sized for
        verify steps of up to ``num_spec_tokens`` drafts (see the module docstring)."""
        n, r = self.pool_name, self.ratio
        nb = buffer_windows(r, num_spec_tokens)
        specs: list[CacheSpec] = [
            PagedSpec(n, r, self.dim),
            SlotStateSpec(n + ".buf_kv", (nb * r, self.width)),
            SlotStateSpec(n + ".buf_gate", (nb * r, self.width)),
        ]
        if self.overlap:
            specs += [
                SlotStateSpec(n + ".carry_kv", (nb, r, self.dim)),
                SlotStateSpec(n + ".carry_gate", (nb, r, self.dim), dtype=torch.float32),
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

        ``kv`` and ``gate`` are this step's projections (see :meth:`pop_in_weights`), ``[T, width]``.
        """
        plan: WindowPlan = md.plans[self.ratio]
        n, r = self.pool_name, self.ratio
        pool = cache_get(n)
        state = {}
        if self.overlap:
            for name in ("carry_kv", "carry_gate"):
                state[name] = cache_get(f"{n}.{name}").view(-1, r, self.dim)  # [slots * nb, r, dim]
                if plan.restore_rows is not None:  # prefix hit: resume at a page boundary
                    snapshot = cache_get(f"{n}.page_{name}").index_select(0, plan.restore_page)
                    ops.cache_write(state[name], plan.restore_rows, snapshot)
            state |= dict(prev=plan.prev, carry_rows=plan.carry_rows)
            if plan.snap_page is not None:  # the carry at each page end, for prefix hits
                state |= dict(
                    page_kv=cache_get(f"{n}.page_carry_kv"),
                    page_gate=cache_get(f"{n}.page_carry_gate"),
                    snap_page=plan.snap_page,
                )
        inv_freq, scale = rope
        ops.compress_windows(
            kv,
            gate,
            cache_get(n + ".buf_kv").view(-1, self.width),
            cache_get(n + ".buf_gate").view(-1, self.width),
            self.bias,
            plan.windows,
            plan.buf_rows,
            self.norm,
            self.eps,
            plan.positions,
            inv_freq,
            scale,
            pool,
            plan.dest,
            **state,
            live=plan.live,  # padding windows may be skipped
        )
        return pool
