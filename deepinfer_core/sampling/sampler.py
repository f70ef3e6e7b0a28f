"""Batched sampling: logits of the rows that sample -> next tokens (+ optional logprobs).

Pipeline per row: greedy rows (``temperature == 0``) take the argmax (``torch.argmax`` returns
the first maximum, so ties go to the lowest token id).  Other rows divide the logits by their
temperature, keep the ``top_k`` most likely tokens, then keep the nucleus of the remaining
(renormalised) distribution whose cumulative probability before each token is below ``top_p``
(at least one token always survives), and draw by inverse CDF with one uniform number from the
row's own :class:`torch.Generator`.  A row's draw depends only on its logits, its parameters and
its generator, never on the other rows: that is what makes seeded requests reproducible
whatever the batch.  Everything but the one-number-per-row draw is vectorised over the batch.

Logprobs are ``log_softmax`` of the raw fp32 logits (the model's distribution, before
temperature, top-k and top-p), as vLLM returns them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def derive_seed(base: int, index: int) -> int:
    """A 63-bit seed mixed from ``(base, index)`` with SplitMix64, so that nearby bases and indices
    give unrelated streams (``derive_seed(1, 1) != derive_seed(2, 0)``)."""
    z = (base * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (draws are made on the CPU, whatever the device)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, in row order.

    Attributes:
        temperatures: ``[B]`` float; 0 = greedy.
        top_ps: ``[B]`` float in (0, 1].
        top_ks: ``[B]`` int; 0 or -1 = off.
        generators: one per row (ignored for greedy rows, may be ``None`` there).
        num_logprobs: per row, how many top logprobs to return, or ``None``.
    """

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]


@dataclass
class SamplerOutput:
    """Sampled tokens ``[B]`` (int64, CPU) and per row ``{token_id: logprob}`` or ``None``."""

    token_ids: torch.Tensor
    logprobs: list[dict[int, float] | None]


def top_k_top_p_keep(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Which tokens survive top-k then top-p, as a bool mask ``[B, V]`` in vocabulary order.

    Args:
        logits: ``[B, V]`` fp32 (already temperature-scaled).
        top_ks: ``[B]`` int64; ``<= 0`` = off.
        top_ps: ``[B]`` float; ``1`` = off.
    """
    B, V = logits.shape
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    keep_sorted = _keep_sorted(sorted_logits, top_ks, top_ps)
    keep = torch.empty_like(keep_sorted)
    keep.scatter_(1, order, keep_sorted)
    return keep


def _keep_sorted(sorted_logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    V = sorted_logits.shape[-1]
    ranks = torch.arange(V, device=sorted_logits.device)
    k = torch.where(top_ks > 0, top_ks.clamp(max=V), torch.full_like(top_ks, V))
    keep = ranks[None, :] < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass strictly before each token
    keep &= before < top_ps[:, None]
    keep[:, 0] = True
    return keep


class Sampler:
    """Samples one token per row of fp32 logits ``[B, V]``; see the module docstring."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        B, V = logits.shape
        device = logits.device
        out = torch.empty(B, dtype=torch.int64, device=device)
        temps = torch.tensor(batch.temperatures, dtype=torch.float32, device=device)
        greedy = temps == 0
        if bool(greedy.any()):
            rows = greedy.nonzero().squeeze(1)
            out[rows] = torch.argmax(logits[rows], dim=-1)
        if not bool(greedy.all()):
            rows = (~greedy).nonzero().squeeze(1)
            rows_list = rows.tolist()
            out[rows] = self._draw(
                logits[rows] / temps[rows, None],
                torch.tensor([batch.top_ks[i] for i in rows_list], dtype=torch.int64, device=device),
                torch.tensor([batch.top_ps[i] for i in rows_list], dtype=torch.float32, device=device),
                [batch.generators[i] for i in rows_list],
            )
        token_ids = out.cpu()
        return SamplerOutput(token_ids, self._logprobs(logits, token_ids, batch.num_logprobs))

    @staticmethod
    def _draw(
        scaled: torch.Tensor,
        top_ks: torch.Tensor,
        top_ps: torch.Tensor,
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        n = scaled.shape[0]
        uniforms = []
        for g in generators:
            if g is None:
                raise ValueError("a non-greedy row needs a torch.Generator")
            uniforms.append(torch.rand(1, generator=g, dtype=torch.float64))
        u = torch.cat(uniforms).to(scaled.device)
        if bool(((top_ks > 0) | (top_ps < 1)).any()):
            sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
            keep = _keep_sorted(sorted_logits, top_ks, top_ps)
            probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        else:
            order = None
            probs = torch.softmax(scaled, dim=-1)
        cdf = torch.cumsum(probs.double(), dim=-1)
        idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        # u * total can round up to the total: clamp to the last token with non-zero probability
        last_nonzero = (probs > 0).cumsum(-1).argmax(-1)
        idx = torch.minimum(idx, last_nonzero)
        if order is None:
            return idx
        return order.gather(1, idx.view(n, 1)).squeeze(1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int | None]
    ) -> list[dict[int, float] | None]:
        result: list[dict[int, float] | None] = [None] * len(num_logprobs)
        rows = [i for i, k in enumerate(num_logprobs) if k is not None]
        if not rows:
            return result
        logp = torch.log_softmax(logits[rows], dim=-1).cpu()
        kmax = max(int(num_logprobs[i] or 0) for i in rows)
        top_vals, top_ids = torch.topk(logp, min(kmax, logp.shape[-1]), dim=-1) if kmax else (None, None)
        for j, i in enumerate(rows):
            k = int(num_logprobs[i] or 0)
            entry: dict[int, float] = {}
            if k and top_ids is not None:
                entry = dict(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True))
            tok = int(token_ids[i])
            entry[tok] = float(logp[j, tok])
            result[i] = entry
        return result
