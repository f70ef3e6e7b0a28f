"""Logit processing before temperature: allowed tokens, logit bias, min-tokens bans, penalties.

All functions take fp32 logits ``[B, V]`` and return a new tensor (the input is not modified).
The ``*_padded`` ones are what the sampler runs: their per-row parameters are device tensors
(token id lists padded with the id ``V``, a column that is dropped) and they do pure device work,
with no host sync, so they can run inside a captured step.  The others take Python lists with
one entry per row (``None`` meaning "off"), pack them and call those.  The semantics are vLLM's:

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

from collections.abc import Iterable, Sequence

import torch


def pad_token_rows(rows: Sequence[Sequence[int] | None], pad: int, min_width: int = 1) -> list[list[int]]:
    """Ragged id lists as equal-length rows, padded with ``pad`` (at least ``min_width`` wide)."""
    width = max(min_width, max((len(r) for r in rows if r), default=0))
    return [[*r, *[pad] * (width - len(r))] if r else [pad] * width for r in rows]


def _id_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` bool: True at each row's ids (``ids`` padded with ``V``)."""
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab_size]


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a packed token bitmask over ``vocab_size`` ids."""
    return -(-vocab_size // 32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` bool from a packed ``[B, ceil(V/32)]`` int32 bitmask: bit ``t % 32`` of word
    ``t // 32`` set = token ``t`` allowed (llguidance's / xgrammar's layout)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def bitmask_of(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """``[ceil(V/32)]`` int32 packed bitmask with exactly ``token_ids`` set."""
    words = [0] * bitmask_words(vocab_size)
    for t in token_ids:
        words[t >> 5] |= 1 << (t & 31)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def bitmask_has(row: torch.Tensor, token_id: int) -> bool:
    """Whether the packed bitmask ``row`` (``[ceil(V/32)]`` int32, CPU) allows ``token_id``."""
    return bool((int(row[token_id >> 5]) >> (token_id & 31)) & 1)


def apply_allowed_bias_bans_padded(
    logits: torch.Tensor,
    allowed: tuple[torch.Tensor, torch.Tensor] | None,
    bias: tuple[torch.Tensor, torch.Tensor] | None,
    banned_ids: torch.Tensor | None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask to the allowed ids (and the token bitmask), add the logit bias, ban the min-tokens ids.

    Args:
        logits: ``[B, V]`` fp32.
        allowed: ``(ids [B, W] int64, on [B] bool)``: rows whose ``on`` is set keep only their
            ids; or ``None`` (no row restricts).
        bias: ``(ids [B, W] int64, values [B, W] fp32)`` (ids distinct within a row), or ``None``.
        banned_ids: ``[B, W]`` int64, or ``None``.
        bitmask: ``[B, ceil(V/32)]`` int32 packed allowed tokens (:func:`unpack_bitmask`; all
            bits set on rows it does not restrict), or ``None``.

    Masked tokens end at ``-inf`` whatever their bias (as masking first, then adding, does).
    """
    V = logits.shape[1]
    out = logits
    if bias is not None:
        ids, values = bias
        dense = torch.zeros(ids.shape[0], V + 1, dtype=logits.dtype, device=logits.device)
        dense = dense.scatter_(1, ids, values.to(logits.dtype))[:, :V]
        out = torch.where(_id_mask(ids, V), out + dense, out)  # biased tokens only: exact x + b
    drop = None
    if allowed is not None:
        ids, on = allowed
        drop = ~_id_mask(ids, V) & on[:, None]
    if banned_ids is not None:
        banned = _id_mask(banned_ids, V)
        drop = banned if drop is None else drop | banned
    if bitmask is not None:
        outside = ~unpack_bitmask(bitmask, V)
        drop = outside if drop is None else drop | outside
    if drop is not None:
        out = out.masked_fill(drop, float("-inf"))
    return out.clone() if out is logits else out


def apply_allowed_bias_bans(
    logits: torch.Tensor,
    allowed_token_ids: Sequence[Sequence[int] | None],
    logit_bias: Sequence[dict[int, float] | None],
    banned_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Mask to the allowed ids, add the logit bias, ban the min-tokens ids (in that order)."""
    B, V = logits.shape
    device = logits.device

    def ids(rows: Sequence[Sequence[int] | None]) -> torch.Tensor:
        return torch.tensor(pad_token_rows(rows, V), dtype=torch.int64, device=device)

    allowed = None
    if any(a is not None for a in allowed_token_ids):
        on = torch.tensor([a is not None for a in allowed_token_ids], device=device)
        allowed = (ids(allowed_token_ids), on)
    bias = None
    if any(logit_bias):
        rows = [list(b) if b else [] for b in logit_bias]
        values = [list(b.values()) if b else [] for b in logit_bias]
        width = max(1, max(len(r) for r in rows))
        values = [v + [0.0] * (width - len(v)) for v in values]
        bias = (ids(rows), torch.tensor(values, dtype=logits.dtype, device=device))
    banned = ids(banned_token_ids) if any(banned_token_ids) else None
    return apply_allowed_bias_bans_padded(logits, allowed, bias, banned)


def token_counts_padded(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences ``[B, V]`` (int64) of each token in each row of ``ids`` (``[B, W]`` int64,
    padded with ``V``), by one batched scatter."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Occurrences ``[B, V]`` (int64) of each token in each row's list, by one batched scatter."""
    padded = torch.tensor(pad_token_rows(token_ids, vocab_size), dtype=torch.int64)
    return token_counts_padded(padded.to(device), vocab_size)


def apply_penalties_padded(
    logits: torch.Tensor,
    output_ids: torch.Tensor,
    prompt_ids: torch.Tensor | None,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, vectorised over the batch.

    Args:
        logits: ``[B, V]`` fp32.
        output_ids, prompt_ids: ``[B, W]`` int64 padded with ``V``; ``prompt_ids`` only when the
            repetition penalty is applied.
        presence_penalties, frequency_penalties: ``[B]`` in the logits' dtype.
        repetition_penalties: ``[B]``, or ``None`` to skip that stage (every row's is 1).
    """
    B, V = logits.shape
    out_counts = token_counts_padded(output_ids, V)
    out_seen = out_counts > 0
    freq = frequency_penalties.to(logits.dtype)[:, None]
    pres = presence_penalties.to(logits.dtype)[:, None]
    out = logits
    if repetition_penalties is not None:
        if prompt_ids is None:
            raise ValueError("the repetition penalty needs the rows' prompt ids")
        rep = repetition_penalties.to(logits.dtype)[:, None]
        seen = out_seen | _id_mask(prompt_ids, V)
        factor = torch.where(seen, rep.expand(B, V), torch.ones_like(logits))
        out = torch.where(out > 0, out / factor, out * factor)
    return out - freq * out_counts.to(logits.dtype) - pres * out_seen.to(logits.dtype)


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

    def per_row(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=logits.dtype, device=device)

    rep = per_row(repetition_penalties)
    use_rep = bool((rep != 1).any())  # list API: the sampler decides this on the host
    prompt = torch.tensor(pad_token_rows(prompt_token_ids, V), dtype=torch.int64, device=device)
    return apply_penalties_padded(
        logits,
        torch.tensor(pad_token_rows(output_token_ids, V), dtype=torch.int64, device=device),
        prompt if use_rep else None,
        per_row(presence_penalties),
        per_row(frequency_penalties),
        rep if use_rep else None,
    )
