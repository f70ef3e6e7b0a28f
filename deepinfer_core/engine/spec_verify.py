"""``rejection`` acceptance of a speculative step's verified rows (the target's distribution
against the drafters', :mod:`deepinfer_core.speculative.verify`), and the logprobs of the tokens
it emits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_core.sampling.batch import SamplingBatch
from deepinfer_core.sampling.logprobs import top_logprobs
from deepinfer_core.sampling.random import row_keys
from deepinfer_core.sampling.sampler import Sampler
from deepinfer_core.speculative.drafter import RowView
from deepinfer_core.speculative.verify import accept_rejection, acceptance_uniform, residual_draws

if TYPE_CHECKING:
    from deepinfer_core.engine.request import Request


def rejection(
    sampler: Sampler,
    draft_probs: dict[str, torch.Tensor | None],
    logits: torch.Tensor,
    batch: SamplingBatch,
    reqs: list[Request],
    rows: list[RowView],
    positions: list[int],
    owner: list[tuple[int, int]],
    drafts: list[list[int]],
    targets: list[int],
) -> list[list[int]]:
    """``rejection`` acceptance for every chunk (:mod:`deepinfer_core.speculative.verify`)."""
    device, vocab = logits.device, logits.shape[1]
    probs = sampler.distribution(logits.float(), batch.prepare(device, vocab))
    tested = torch.tensor(
        [drafts[ci][i] if i < len(drafts[ci]) else 0 for ci, i in owner], dtype=torch.int64
    ).to(device)
    k1, k2 = row_keys([r.sampling_seed for r in rows], positions)
    key1 = torch.tensor(k1, dtype=torch.int64).to(device)
    key2 = torch.tensor(k2, dtype=torch.int64).to(device)
    q = draft_q(draft_probs, reqs, owner, drafts, vocab, device)
    resid = residual_draws(probs, tested, q, key1, key2).tolist()
    p_d = probs.gather(1, tested[:, None]).squeeze(1).tolist()
    q_d = [1.0] * len(owner) if q is None else q.gather(1, tested[:, None]).squeeze(1).tolist()
    emitted: list[list[int]] = []
    base = 0
    for d in drafts:
        k = len(d)
        u = [acceptance_uniform(rows[base + i].sampling_seed, positions[base + i]) for i in range(k)]
        a = accept_rejection(p_d[base : base + k], q_d[base : base + k], u)
        last = resid[base + a] if a < k else targets[base + k]
        emitted.append(list(d[:a]) + [last])
        base += k + 1
    return emitted


def draft_q(
    draft_probs: dict[str, torch.Tensor | None],
    reqs: list[Request],
    owner: list[tuple[int, int]],
    drafts: list[list[int]],
    vocab: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The drafters' distributions ``q`` per row (``[n, V]``), or ``None`` when every draft
    is deterministic (one-hot ``q``)."""
    probs = [draft_probs.get(r.request_id) for r in reqs]
    if all(p is None for p in probs):
        return None
    q = torch.zeros(len(owner), vocab, dtype=torch.float64, device=device)
    for row, (ci, i) in enumerate(owner):
        if i < len(drafts[ci]):
            p = probs[ci]
            if p is None:
                q[row, drafts[ci][i]] = 1.0
            else:
                q[row] = p[i].to(device, torch.float64)
    return q


def emitted_logprobs(
    logits: torch.Tensor,
    batch: SamplingBatch,
    drafts: list[list[int]],
    emitted: list[list[int]],
) -> list[list[dict[int, float] | None]]:
    """Logprobs of the emitted tokens (rejection acceptance may emit a token other than the
    row's draw), from the raw logits of their rows."""
    n = sum(len(d) + 1 for d in drafts)
    ks = batch.num_logprobs or [None] * n
    pick, tokens, want = [], [], []
    base = 0
    for d, e in zip(drafts, emitted, strict=True):
        for i, t in enumerate(e):
            pick.append(base + i)
            tokens.append(t)
            want.append(ks[base + i])
        base += len(d) + 1
    if not any(k is not None for k in want):
        return [[None] * len(e) for e in emitted]
    index = torch.tensor(pick, dtype=torch.int64).to(logits.device)
    entries = top_logprobs(logits.float().index_select(0, index), torch.tensor(tokens), want)
    out: list[list[dict[int, float] | None]] = []
    j = 0
    for e in emitted:
        out.append([entries[j + i] for i in range(len(e))])
        j += len(e)
    return out
