"""The mHC residual between blocks, with the last block's ``hc_post`` deferred.

A block ends with ``hc_post`` (its output mixed into the streams) and the next one starts with
``hc_pre`` and the norm of its input.  :class:`Residual` carries the streams together with the
output not yet mixed in, so the next block runs the whole transition as one op,
``hc_post_pre``, which a backend may fuse (its decomposition is the three ops in sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.ops import OpTable


@dataclass(frozen=True)
class Residual:
    """``streams`` ``[T, N, D]``, with ``hc_post(block_out, streams, post, comb)`` still to apply
    when ``block_out`` is set (else the streams are final)."""

    streams: torch.Tensor
    block_out: torch.Tensor | None = None
    post: torch.Tensor | None = None
    comb: torch.Tensor | None = None

    def enter(
        self,
        ops: OpTable,
        hc: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        norm_weight: torch.Tensor,
        eps: float,
        hc_eps: float,
        iters: int,
    ) -> tuple[Residual, torch.Tensor]:
        """Into the next block (mHC weights ``hc = (fn, base, scale)``, input norm
        ``norm_weight``): ``(its residual, still waiting for the block's output, its normed
        input [T, D])``."""
        streams, post, comb, x = ops.hc_post_pre(
            self.block_out, self.streams, self.post, self.comb, *hc, eps, hc_eps, iters, norm_weight
        )
        return Residual(streams, None, post, comb), x

    def leave(self, block_out: torch.Tensor) -> Residual:
        """The block's output ``[T, D]``, to be mixed in by the next :meth:`enter` (or :meth:`settled`)."""
        return Residual(self.streams, block_out, self.post, self.comb)

    def settled(self, ops: OpTable) -> torch.Tensor:
        """The streams with any pending block output mixed in (``hc_post``)."""
        if self.block_out is None:
            return self.streams
        return ops.hc_post(self.block_out, self.streams, self.post, self.comb)
