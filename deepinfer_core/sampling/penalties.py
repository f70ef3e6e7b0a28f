"""Logit processing before temperature: allowed tokens, logit bias, min-tokens bans, penalties.

All functions take fp32 logits ``[B, V]`` and return a new tensor (the input is not modified);
per-row parameters come as Python lists with one entry per row, ``None`` meaning "off".
The semantics are vLLM's:

- ``allowed_token_ids``: every other token gets ``-inf``.
- ``logit_bias``: ``{token_id: bias}`` added to the logits.
- min-tokens bans: the ids in the row's list (EOS / stop ids while fewer than ``min_tokens``
  tokens were generated) get ``-inf``.
- ``repetition_penalty`` (tokens seen in the prompt *or* the output): positive logits are
  divided by it, the others multiplied.
- ``frequency_penalty``: minus ``penalty * count`` of the token in the output.
- ``presence_penalty``: minus ``penalty`` if the token occurs in the output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_allowed_bias_bans(
    logits: torch.Tensor,
    allowed_token_ids: Sequence[Sequence[int] | None],
    logit_bias: Sequence[dict[int, float] | None],
    banned_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Mask to the allowed ids, add the logit bias, ban the min-tokens ids (in that order)."""
    out = logits.clone()
    device = logits.device
    for i, allowed in enumerate(allowed_token_ids):
        if allowed is not None:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=device)
            keep[torch.tensor(list(allowed), dtype=torch.int64, device=device)] = True
            out[i].masked_fill_(~keep, float("-inf"))
    for i, bias in enumerate(logit_bias):
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.int64, device=device)
            out[i, ids] += torch.tensor(list(bias.values()), dtype=out.dtype, device=device)
    for i, banned in enumerate(banned_token_ids):
        if banned:
            out[i, torch.tensor(list(banned), dtype=torch.int64, device=device)] = float("-inf")
    return out


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Occurrences ``[B, V]`` (int64) of each token in each row's list, by one batched scatter."""
    B = len(token_ids)
    width = max((len(t) for t in token_ids), default=0)
    counts = torch.zeros(B, vocab_size + 1, dtype=torch.int64, device=device)  # column V: padding
    if width:
        padded = torch.full((B, width), vocab_size, dtype=torch.int64)
        for i, t in enumerate(token_ids):
            if t:
                padded[i, : len(t)] = torch.tensor(list(t), dtype=torch.int64)
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    presence_penalties: Sequence[float],
    frequency_penalties: Sequence[float],
    repetition_penalties: Sequence[float],
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, vectorised over the batch."""
    B, V = logits.shape
    device = logits.device
    out_counts = token_counts(output_token_ids, V, device)
    out_seen = out_counts > 0
    rep = torch.tensor(list(repetition_penalties), dtype=logits.dtype, device=device)[:, None]
    freq = torch.tensor(list(frequency_penalties), dtype=logits.dtype, device=device)[:, None]
    pres = torch.tensor(list(presence_penalties), dtype=logits.dtype, device=device)[:, None]
    out = logits
    if bool((rep != 1).any()):
        seen = out_seen | (token_counts(prompt_token_ids, V, device) > 0)
        factor = torch.where(seen, rep.expand(B, V), torch.ones_like(logits))
        out = torch.where(out > 0, out / factor, out * factor)
    return out - freq * out_counts.to(logits.dtype) - pres * out_seen.to(logits.dtype)
