"""Fused input projections: the weights that read one input, run as few matmuls as possible.

V4 blocks project their input several ways (attention: ``q_a``, ``kv`` and the compressors'
projections; MoE: the router and the shared expert's gate and up).  The parts are concatenated
along the output dim, so one ``ops.linear`` computes them all, and the fused copy is the only one
held.  With ``keep_quantized`` some parts are :class:`~deepinfer_core.weights.quant.QuantizedTensor`:

- consecutive quantised parts of one format concatenate their data and block scales when every
  part but the last has an output dim that is a multiple of the block rows (no scale tile spans
  two parts; true for V4-Flash's FP8 ``q_a`` / ``kv`` and shared-expert projections);
- plain parts (checkpoint BF16 projections, e.g. the router and the compressors) concatenate as
  before, so a block of mixed parts runs one matmul per run of consecutive parts of one kind;
- quantised parts that cannot be concatenated are dequantised at load (to the model dtype, as the
  loader would have) and join their plain neighbours; :attr:`FusedProjection.dequantized` says
  why, and the model logs it once.
"""

from __future__ import annotations

import torch

from deepinfer_core.ops import OpTable
from deepinfer_core.weights.quant import QuantizedTensor, Weight, concat_problem, concat_quantized


class FusedProjection:
    """The parts ``[(name, weight [out_i, in])]`` of one input's projections, fused.

    Args:
        parts: the weights in output order, each named for messages.
        dtype: the model dtype (that of quantised parts dequantised at load).
        where: the block, for messages (``model.layers.3.self_attn``).

    Attributes:
        groups: ``[(weight, [out sizes])]``, one matmul each, in output order.
        dequantized: ``None``, or which quantised parts were dequantised at load and why.
    """

    def __init__(self, parts: list[tuple[str, Weight]], dtype: torch.dtype, where: str):
        self.where = where
        self.dequantized: str | None = None
        runs: list[list[tuple[str, Weight]]] = []
        for name, w in parts:
            if runs and _run_key(runs[-1][-1][1]) == _run_key(w):
                runs[-1].append((name, w))
            else:
                runs.append([(name, w)])
        notes: list[str] = []
        merged: list[list[tuple[str, Weight]]] = []
        for run in runs:
            quantized = [w for _, w in run if isinstance(w, QuantizedTensor)]
            problem = concat_problem(quantized) if len(quantized) > 1 else None
            if problem is not None:
                notes.append(f"{', '.join(n.removesuffix('.weight') for n, _ in run)}: {problem}")
                run = [(n, w.dequantize(dtype)) for n, w in run]  # type: ignore[union-attr]
            if not _is_q(run) and merged and not _is_q(merged[-1]):
                merged[-1].extend(run)  # plain parts after plain parts: one matmul
            else:
                merged.append(run)
        if notes:
            self.dequantized = f"{where} ({'; '.join(notes)})"
        self.groups: list[tuple[Weight, list[int]]] = []
        for run in merged:
            ws = [w for _, w in run]
            sizes = [int(w.shape[-2]) for w in ws]
            if len(ws) == 1:
                fused: Weight = ws[0]
            elif isinstance(ws[0], QuantizedTensor):
                fused = concat_quantized(ws)  # type: ignore[arg-type]
            else:
                fused = torch.cat(ws)  # type: ignore[arg-type]
            self.groups.append((fused, sizes))

    def __call__(self, x: torch.Tensor, ops: OpTable) -> list[torch.Tensor]:
        """The parts' projections of ``x`` ``[T, in]``: ``[T, out_i]`` each, in order."""
        out: list[torch.Tensor] = []
        for w, sizes in self.groups:
            out.extend(ops.linear(x, w).split(sizes, dim=-1))
        return out

    @property
    def part_count(self) -> int:
        """How many parts the projection has."""
        return sum(len(sizes) for _, sizes in self.groups)

    def matmul_of(self, part: int) -> int:
        """The index in :attr:`groups` of the matmul that computes part ``part``."""
        first = 0
        for i, (_, sizes) in enumerate(self.groups):
            first += len(sizes)
            if part < first:
                return i
        raise IndexError(f"{self.where}: part {part} of {first}")

    def separable(self, parts: range) -> bool:
        """Whether the matmuls of ``parts`` compute no other part, so that :meth:`project` of
        ``parts`` and of the rest run different matmuls."""
        theirs = {self.matmul_of(p) for p in parts}
        return not any(self.matmul_of(p) in theirs for p in range(self.part_count) if p not in parts)

    def project(self, x: torch.Tensor, ops: OpTable, parts: range) -> list[torch.Tensor]:
        """The projections of ``parts`` only (:meth:`__call__`'s outputs of those indices, the same
        bits): the matmuls that compute them."""
        out: list[torch.Tensor] = []
        first = 0
        for w, sizes in self.groups:
            mine = [p - first for p in parts if first <= p < first + len(sizes)]
            if mine:
                pieces = ops.linear(x, w).split(sizes, dim=-1)
                out.extend(pieces[i] for i in mine)
            first += len(sizes)
        return out


def _run_key(w: Weight) -> tuple | None:
    """Parts with equal keys may share a matmul: plain ones, or quantised ones of one format."""
    if isinstance(w, QuantizedTensor):
        return (w.fmt, w.block, w.scale.dtype, tuple(w.shape[:-2]), w.shape[-1])
    return None


def _is_q(run: list[tuple[str, Weight]]) -> bool:
    return isinstance(run[0][1], QuantizedTensor)
