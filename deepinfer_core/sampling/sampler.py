"""Batched sampling: logits of the rows that sample -> next tokens (+ optional logprobs).

Order per row, as in vLLM:

1. ``allowed_token_ids`` (every other token -> ``-inf``), ``logit_bias`` (added), and while
   fewer than ``min_tokens`` tokens were generated, EOS and ``stop_token_ids`` -> ``-inf``;
2. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
3. greedy rows (``temperature == 0``) take the argmax of these processed logits
   (``torch.argmax`` returns the first maximum, so ties go to the lowest token id);
4. other rows: logits / temperature, then top-k, top-p over the renormalised top-k
   distribution (the mass *before* each token must be below ``top_p``; one token always
   survives), then min-p (probability >= ``min_p`` x the largest);
5. the draw: ``argmax(scaled + gumbel)`` over the surviving tokens, where the Gumbel noise is a
   pure function of (request seed, position of the token being sampled, token id)
   (:mod:`deepinfer_core.sampling.random`).  That is an exact sample of the renormalised
   filtered distribution, and a seeded row's token depends on nothing else: not on the other
   rows, its row index, prefill chunking, async scheduling or a preemption that recomputes it.

Logprobs are ``log_softmax`` of the raw fp32 logits (the model's distribution, before any of
the steps above), as vLLM returns them by default.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.penalties import apply_allowed_bias_bans, apply_penalties
from deepinfer_core.sampling.random import derive_seed, gumbel_noise

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "derive_seed", "top_k_top_p_keep"]


class SamplingRow(Protocol):
    """What :meth:`SamplingBatch.from_requests` reads from a request."""

    params: SamplingParams
    sampling_seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int: ...


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, in row order.

    Attributes:
        temperatures: ``[B]`` float; 0 = greedy.
        top_ps: ``[B]`` float in (0, 1].
        top_ks: ``[B]`` int; 0 or -1 = off.
        seeds: the row's sampling seed (ignored for greedy rows).
        positions: absolute position (prompt + output index) of the token each row samples.
        num_logprobs: per row, how many top logprobs to return, or ``None`` (default: none).
        min_ps: per row min-p (default: all 0).
        presence_penalties, frequency_penalties, repetition_penalties: per row (default: off).
        prompt_token_ids, output_token_ids: per row, for the penalties (needed only when a
            penalty is on).
        logit_bias: per row ``{token_id: bias}`` or ``None``.
        allowed_token_ids: per row list or ``None``.
        banned_token_ids: per row ids forced to ``-inf`` (min_tokens not reached yet).
    """

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    seeds: list[int]
    positions: list[int]
    num_logprobs: list[int | None] | None = None
    min_ps: list[float] | None = None
    presence_penalties: list[float] | None = None
    frequency_penalties: list[float] | None = None
    repetition_penalties: list[float] | None = None
    prompt_token_ids: list[Sequence[int]] | None = None
    output_token_ids: list[Sequence[int]] | None = None
    logit_bias: list[dict[int, float] | None] | None = None
    allowed_token_ids: list[list[int] | None] | None = None
    banned_token_ids: list[list[int]] | None = None

    @classmethod
    def from_requests(
        cls,
        rows: Sequence[SamplingRow],
        eos_token_ids: Collection[int],
        positions: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """The batch of requests about to sample.

        Args:
            rows: the sampling requests, in logits-row order.
            eos_token_ids: the model's EOS ids (banned while ``min_tokens`` is not reached).
            positions: absolute position of the token each row samples (the end of its chunk);
                default each request's ``num_tokens`` (right when its outputs are up to date).
        """
        params = [r.params for r in rows]
        penalised = any(p.has_penalties for p in params)
        return cls(
            temperatures=[p.temperature for p in params],
            top_ps=[p.top_p for p in params],
            top_ks=[p.top_k for p in params],
            seeds=[r.sampling_seed for r in rows],
            positions=list(positions) if positions is not None else [r.num_tokens for r in rows],
            num_logprobs=[p.logprobs for p in params],
            min_ps=[p.min_p for p in params],
            presence_penalties=[p.presence_penalty for p in params] if penalised else None,
            frequency_penalties=[p.frequency_penalty for p in params] if penalised else None,
            repetition_penalties=[p.repetition_penalty for p in params] if penalised else None,
            prompt_token_ids=[r.prompt_token_ids for r in rows] if penalised else None,
            output_token_ids=[r.output_token_ids for r in rows] if penalised else None,
            logit_bias=[p.logit_bias for p in params],
            allowed_token_ids=[p.allowed_token_ids for p in params],
            banned_token_ids=[
                min_tokens_banned(r.params, len(r.output_token_ids), eos_token_ids) for r in rows
            ],
        )


def min_tokens_banned(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Collection[int]
) -> list[int]:
    """Token ids a request may not sample yet: EOS (unless ``ignore_eos``) and ``stop_token_ids``
    while fewer than ``min_tokens`` tokens were generated."""
    if num_output_tokens >= params.min_tokens:
        return []
    eos = [] if params.ignore_eos else list(eos_token_ids)
    return list(dict.fromkeys([*eos, *params.stop_token_ids]))


@dataclass
class SamplerOutput:
    """Sampled tokens ``[B]`` (int64, on the logits' device) and per row ``{token_id: logprob}``
    or ``None``."""

    token_ids: torch.Tensor
    logprobs: list[dict[int, float] | None]


def top_k_top_p_keep(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Which tokens survive top-k then top-p, as a bool mask ``[B, V]`` in vocabulary order.

    Args:
        logits: ``[B, V]`` fp32 (already temperature-scaled).
        top_ks: ``[B]`` int64; ``<= 0`` = off.
        top_ps: ``[B]`` float; ``1`` = off.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    keep_sorted = _keep_sorted(sorted_logits, top_ks, top_ps)
    keep = torch.empty_like(keep_sorted)
    keep.scatter_(1, order, keep_sorted)
    return keep


def min_p_keep(scaled: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability under ``softmax(scaled)`` is at least ``min_p`` x the largest."""
    probs = torch.softmax(scaled, dim=-1)
    return probs >= min_ps[:, None] * probs.amax(dim=-1, keepdim=True)


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


def _rows_or(values: list | None, n: int, default: object) -> list:
    return list(values) if values is not None else [default] * n


class Sampler:
    """Samples one token per row of fp32 logits ``[B, V]``; see the module docstring."""

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Steps 1-2 of the module docstring: masks, bias and penalties, before temperature."""
        B = logits.shape[0]
        out = logits.float()
        allowed = _rows_or(batch.allowed_token_ids, B, None)
        bias = _rows_or(batch.logit_bias, B, None)
        banned = _rows_or(batch.banned_token_ids, B, [])
        if any(a is not None for a in allowed) or any(bias) or any(banned):
            out = apply_allowed_bias_bans(out, allowed, bias, banned)
        if batch.repetition_penalties is not None or batch.presence_penalties is not None:
            if batch.prompt_token_ids is None or batch.output_token_ids is None:
                raise ValueError("penalties need the rows' prompt_token_ids and output_token_ids")
            out = apply_penalties(
                out,
                batch.prompt_token_ids,
                batch.output_token_ids,
                _rows_or(batch.presence_penalties, B, 0.0),
                _rows_or(batch.frequency_penalties, B, 0.0),
                _rows_or(batch.repetition_penalties, B, 1.0),
            )
        return out

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits.float()
        B = raw.shape[0]
        processed = self.process_logits(raw, batch)
        device = raw.device
        if all(t == 0 for t in batch.temperatures):  # all greedy: no draw, no per-row routing
            out = torch.argmax(processed, dim=-1)
            return SamplerOutput(out, top_logprobs(raw, out, _rows_or(batch.num_logprobs, B, None)))
        out = torch.empty(B, dtype=torch.int64, device=device)
        temps = torch.tensor(batch.temperatures, dtype=torch.float32, device=device)
        greedy = temps == 0
        if bool(greedy.any()):
            rows = greedy.nonzero().squeeze(1)
            out[rows] = torch.argmax(processed[rows], dim=-1)
        if not bool(greedy.all()):
            rows = (~greedy).nonzero().squeeze(1)
            idx = rows.tolist()
            min_ps = _rows_or(batch.min_ps, B, 0.0)
            out[rows] = self._draw(
                processed[rows] / temps[rows, None],
                torch.tensor([batch.top_ks[i] for i in idx], dtype=torch.int64, device=device),
                torch.tensor([batch.top_ps[i] for i in idx], dtype=torch.float32, device=device),
                torch.tensor([min_ps[i] for i in idx], dtype=torch.float32, device=device),
                [batch.seeds[i] for i in idx],
                [batch.positions[i] for i in idx],
            )
        # token ids stay on the device: async scheduling feeds them to the next step without a
        # host round trip (only rows that asked for logprobs read them back here)
        return SamplerOutput(out, top_logprobs(raw, out, _rows_or(batch.num_logprobs, B, None)))

    @staticmethod
    def _draw(
        scaled: torch.Tensor,
        top_ks: torch.Tensor,
        top_ps: torch.Tensor,
        min_ps: torch.Tensor,
        seeds: list[int],
        positions: list[int],
    ) -> torch.Tensor:
        keep = None
        if bool(((top_ks > 0) | (top_ps < 1)).any()):
            keep = top_k_top_p_keep(scaled, top_ks, top_ps)
        if bool((min_ps > 0).any()):
            by_min_p = min_p_keep(scaled, min_ps)
            keep = by_min_p if keep is None else keep & by_min_p
        noisy = scaled.double() + gumbel_noise(seeds, positions, scaled.shape[1], scaled.device)
        if keep is not None:
            noisy = noisy.masked_fill(~keep, float("-inf"))
        return torch.argmax(noisy, dim=-1)


def top_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int | None]
) -> list[dict[int, float] | None]:
    """Per row ``{token_id: logprob}`` of the ``k`` most likely tokens plus ``token_ids[row]``
    (``log_softmax`` of ``logits``), or ``None`` for rows whose ``k`` is ``None``."""
    result: list[dict[int, float] | None] = [None] * len(num_logprobs)
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return result
    logp = torch.log_softmax(logits[rows].float(), dim=-1).cpu()
    token_ids = token_ids.cpu()
    kmax = max(int(num_logprobs[i] or 0) for i in rows)
    top_vals, top_ids = torch.topk(logp, min(kmax, logp.shape[-1]), dim=-1) if kmax else (None, None)
    for j, i in enumerate(rows):
        k = int(num_logprobs[i] or 0)
        entry: dict[int, float] = {}
        if k and top_ids is not None and top_vals is not None:
            entry = dict(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True))
        tok = int(token_ids[i])
        entry[tok] = float(logp[j, tok])
        result[i] = entry
    return result
