"""Acceptance of draft tokens against the target's distribution at every verified position.

A verify step runs ``[t0, d1 .. dk]`` (the last sampled token and ``k`` drafts) through the
target; row ``i`` of its logits is the target's distribution for the token after ``d_i``
(``d_0 = t0``), at absolute position ``start + i + 1``.  Row ``i`` is processed exactly as
plain decoding would process it had ``d1 .. di`` been sampled (penalties, ``min_tokens``,
grammar masks and logits processors see them), so:

* ``match`` (default): the target's token ``y_i`` is drawn at every row with the
  counter-based randomness of plain decoding (keyed by the request's seed and the position),
  and drafts are accepted while ``d_{i+1} == y_i``.  The emitted tokens ``y_0 .. y_a`` are
  exactly the tokens plain decoding would have produced, greedy or sampled.
* ``rejection``: draft ``d_{i+1}`` (drawn by the drafter from ``q``; deterministic drafters
  have a one-hot ``q``) is accepted with probability ``min(1, p(d)/q(d))`` (``p``: the target's
  filtered distribution of row ``i``), else the step emits a draw from the residual
  ``max(0, p - q)`` renormalised and stops; when every draft is accepted the last row's
  draw is the bonus token.  Each emitted token is distributed exactly as ``p`` (Leviathan et
  al., 2023), but the tokens differ from plain decoding's.  The acceptance uniforms and the
  residual's Gumbel noise are counter-based too, so a seeded request is still reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_core.sampling.random import derive_seed, gumbel_noise_from_keys

ACCEPT_SALT = 0x5EC0DE
"""Mixed into a request's seed for the rejection test's uniforms (independent of the draw's)."""


def accept_match(targets: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens (``targets[i]`` is row ``i``'s)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def acceptance_uniform(seed: int, position: int) -> float:
    """The rejection test's uniform in (0, 1) for the draft at ``position``: a pure function of
    ``(seed, position)``, independent of the draw's Gumbel noise."""
    z = derive_seed(derive_seed(seed, ACCEPT_SALT), position)  # 63 bits
    return ((z >> 10) + 0.5) / 2.0**53


def residual_draws(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    key1: torch.Tensor,
    key2: torch.Tensor,
) -> torch.Tensor:
    """A draw per row from ``max(0, p - q)`` renormalised (Gumbel-max with the rows' keys).

    Args:
        probs: ``[n, V]`` the target's filtered distribution ``p`` per row.
        drafts: ``[n]`` the draft each row tests; ``draft_probs``: ``[n, V]`` its ``q``, or
            ``None`` for one-hot drafts (the residual is then ``p`` without the draft).
        key1, key2: ``[n]`` the rows' counter-based keys (:func:`~deepinfer_core.sampling.random.row_keys`).

    Where the residual is empty (``p`` is all on the draft: it would have been accepted) the
    row's argmax of ``p`` is returned.
    """
    if draft_probs is None:
        residual = probs.clone()
        residual.scatter_(1, drafts[:, None], 0.0)
    else:
        residual = (probs - draft_probs.to(probs.dtype)).clamp_(min=0)
    noisy = torch.log(residual.double()) + gumbel_noise_from_keys(key1, key2, probs.shape[1])
    empty = residual.sum(dim=1) <= 0
    return torch.where(empty, probs.argmax(dim=1), noisy.argmax(dim=1))


def accept_rejection(p_draft: Sequence[float], q_draft: Sequence[float], uniforms: Sequence[float]) -> int:
    """How many leading drafts pass the test ``u_i < p(d_i) / q(d_i)``."""
    a = 0
    for p, q, u in zip(p_draft, q_draft, uniforms, strict=True):
        if not (q > 0 and u < p / q):
            break
        a += 1
    return a
