"""Batched sampling: logits of the rows that sample -> next tokens (+ optional logprobs).

Order per row, as in vLLM:

1. ``allowed_token_ids`` and the structured-output token bitmask (every other token ->
   ``-inf``), ``logit_bias`` (added), and while fewer than ``min_tokens`` tokens were
   generated, EOS and ``stop_token_ids`` -> ``-inf``;
2. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
3. greedy rows (``temperature == 0``) take the argmax of these processed logits, the op
   ``argmax_rows`` of the sampler's op table (the backend's kernel, else ``torch.argmax``:
   the first maximum, so ties go to the lowest token id);
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

No host sync on the step's tensors.  :meth:`SamplingBatch.prepare` packs the per-row
parameters on the host (plain Python: which stages run, which rows are greedy or want logprobs
are host decisions) into one float64 buffer, moved to the device by a single non-blocking copy
from pinned memory; :meth:`Sampler.sample` is then pure device work on fixed shapes (no
``.item()``, ``nonzero``, boolean indexing or branch on a tensor value), so it can run inside a
captured step.  Logprobs (top-k values and ids, the sampled token's) stay on the device: the
host reads them only when :attr:`SamplerOutput.logprobs` is first read, when the engine
processes the step's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_core.ops import OpTable
from deepinfer_core.sampling.batch import SamplingBatch, SamplingTensors
from deepinfer_core.sampling.filters import min_p_keep, top_k_top_p_keep
from deepinfer_core.sampling.logprobs import Logprobs, device_top_logprobs
from deepinfer_core.sampling.penalties import apply_allowed_bias_bans_padded, apply_penalties_padded
from deepinfer_core.sampling.random import gumbel_noise_from_keys
from deepinfer_core.sampling.transfer import tensor_to_device

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",  # the engine loop imports it from here
    "tensor_to_device",  # the model runner imports it from here
]


@dataclass
class SamplerOutput:
    """Sampled tokens ``[B]`` (int64, on the logits' device) and per row ``{token_id: logprob}``
    or ``None`` (a :class:`Logprobs`: read from the device when first accessed)."""

    token_ids: torch.Tensor
    logprobs: Sequence[dict[int, float] | None]


class Sampler:
    """Samples one token per row of fp32 logits ``[B, V]``; see the module docstring.

    Args:
        ops: the op table whose ``argmax_rows`` picks the greedy rows' tokens (the engine
            passes its backend's); ``None``: the reference ops (``torch.argmax``).
    """

    def __init__(self, ops: OpTable | None = None) -> None:
        self.ops = OpTable.reference() if ops is None else ops

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch | SamplingTensors) -> torch.Tensor:
        """Steps 1-2 of the module docstring: masks, bias and penalties, before temperature."""
        raw = logits.float()
        return self._process(raw, _prepared(batch, raw))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch | SamplingTensors) -> SamplerOutput:
        raw = logits.float()
        prep = _prepared(batch, raw)
        token_ids, logprobs = self.sample(raw, prep)
        # token ids stay on the device: async scheduling feeds them to the next step without a
        # host round trip; logprobs are read back only when the engine processes the outputs
        return SamplerOutput(
            token_ids, Logprobs(prep.num_rows, prep.logprob_rows, prep.num_logprobs, logprobs)
        )

    def sample(self, raw: torch.Tensor, prep: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device part of a step (no host sync, shapes fixed by ``prep``): the sampled
        tokens ``[B]`` int64 and the packed logprobs of :func:`device_top_logprobs` (or
        ``None`` when no row wants logprobs)."""
        processed = self._process(raw, prep)
        if not prep.sample_rows:  # all greedy: no draw, no per-row routing
            out = self.ops.argmax_rows(processed)
        elif prep.sample_index is None:  # every row samples
            assert prep.temperatures is not None
            out = self._draw(processed.contiguous() / prep.temperatures[:, None], prep)
        else:  # greedy rows take the argmax, the others (gathered by a host-made index) draw
            assert prep.temperatures is not None
            rows = processed.index_select(0, prep.sample_index)
            drawn = self._draw(rows / prep.temperatures[:, None], prep)
            out = self.ops.argmax_rows(processed).index_copy_(0, prep.sample_index, drawn)
        logprobs = None
        if prep.logprob_rows:
            tokens = out if prep.logprob_index is None else out.index_select(0, prep.logprob_index)
            rows = raw if prep.logprob_index is None else raw.index_select(0, prep.logprob_index)
            logprobs = device_top_logprobs(rows, tokens, max(prep.num_logprobs))
        return out, logprobs

    def distribution(self, raw: torch.Tensor, prep: SamplingTensors) -> torch.Tensor:
        """The distribution each row's draw samples from, ``[B, V]`` float64: for sampling rows
        ``softmax`` of the processed, temperature-scaled logits over the tokens that survive
        top-k / top-p / min-p; for greedy rows one-hot on the argmax.  (Speculative decoding's
        rejection test compares it with the drafter's.)"""
        processed = self._process(raw, prep)
        probs = torch.zeros(processed.shape, dtype=torch.float64, device=processed.device)
        probs.scatter_(1, self.ops.argmax_rows(processed)[:, None], 1.0)
        if prep.sample_rows:
            assert prep.temperatures is not None
            index = prep.sample_index
            rows = processed if index is None else processed.index_select(0, index)
            scaled = rows / prep.temperatures[:, None]
            keep = self._keep(scaled, prep)
            if keep is not None:
                scaled = scaled.masked_fill(~keep, float("-inf"))
            sampled = torch.softmax(scaled.double(), dim=-1)
            probs = sampled if index is None else probs.index_copy_(0, index, sampled)
        return probs

    @staticmethod
    def _keep(scaled: torch.Tensor, prep: SamplingTensors) -> torch.Tensor | None:
        """The tokens of the sampled rows that survive top-k / top-p and min-p (``None``: all)."""
        keep = None
        if prep.use_top_k_top_p:
            assert prep.top_ks is not None and prep.top_ps is not None
            keep = top_k_top_p_keep(scaled, prep.top_ks, prep.top_ps)
        if prep.use_min_p:
            assert prep.min_ps is not None
            by_min_p = min_p_keep(scaled, prep.min_ps)
            keep = by_min_p if keep is None else keep & by_min_p
        return keep

    @staticmethod
    def _process(out: torch.Tensor, prep: SamplingTensors) -> torch.Tensor:
        allowed = (prep.allowed_ids, prep.allowed_on) if prep.allowed_ids is not None else None
        bias = (prep.bias_ids, prep.bias_values) if prep.bias_ids is not None else None
        if prep.masks_logits:
            out = apply_allowed_bias_bans_padded(out, allowed, bias, prep.banned_ids, prep.bitmask)  # type: ignore[arg-type]
        if prep.use_penalties:
            assert prep.output_ids is not None and prep.presence is not None and prep.frequency is not None
            out = apply_penalties_padded(
                out, prep.output_ids, prep.prompt_ids, prep.presence, prep.frequency, prep.repetition
            )
        return out

    @classmethod
    def _draw(cls, scaled: torch.Tensor, prep: SamplingTensors) -> torch.Tensor:
        assert prep.key1 is not None and prep.key2 is not None
        keep = cls._keep(scaled, prep)
        noisy = scaled.double() + gumbel_noise_from_keys(prep.key1, prep.key2, scaled.shape[1])
        if keep is not None:
            noisy = noisy.masked_fill(~keep, float("-inf"))
        return torch.argmax(noisy, dim=-1)


def _prepared(batch: SamplingBatch | SamplingTensors, logits: torch.Tensor) -> SamplingTensors:
    if isinstance(batch, SamplingTensors):
        return batch
    return batch.prepare(logits.device, logits.shape[1])
