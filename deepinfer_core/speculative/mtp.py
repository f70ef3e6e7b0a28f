"""The ``mtp`` drafter: the checkpoint's own multi-token-prediction layer (DeepSeek-V4's
``num_nextn_predict_layers`` block, native tensors ``mtp.0.*``).

The MTP layer reads, for a position ``t``, the target's last-layer hidden streams at ``t`` and
the embedding of the token at ``t + 1``, runs one V4 block over its own KV cache and predicts
the token at ``t + 2`` (:class:`~deepinfer_core.models.deepseek_v4.model.MtpLayer`).  So the
drafter keeps the MTP layer's cache in step with the target's:

* :meth:`MtpDrafter.observe` (after every step): one MTP forward over every position each
  running request computed and kept in the step (prompt chunks, the accepted part of verify
  steps), from the target's hidden states of that step (``ComputedChunk.hidden``: the rows the
  runner kept of it, so a step that ran asynchronously is observed after the next one was
  launched, without waiting for the device) and the token after each position.  The last
  such row of a request that decodes next gives its first draft (the argmax of the MTP
  logits: the guess for the token after the one the step emitted) and the MTP output streams
  the recursion starts from.
* :meth:`MtpDrafter.propose` (before the step): drafts ``2 .. k`` recursively, DeepSeek-V3
  style: depth ``j`` runs the MTP layer at the next position on the previous depth's output
  streams and the token it drafted, one batched single-row step per depth.

Drafts are greedy; :attr:`Draft.confidence` is the MTP's softmax probability of each drafted
token (DSpark schedules verify lengths on it).  The draft steps write the MTP cache at
speculative positions (at most ``k - 1`` past the accepted end, within the ``num_spec_tokens``
spare rows every cache keeps): the next catch-up rewrites them, a rollback by position as the
target's.  A compressed (CSA/HCA) MTP layer writes paged entries, so its drafts stop at the end
of the request's allocated pages; V4's MTP layer is sliding-window only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.sampling.transfer import tensor_to_device

from .drafter import ComputedChunk, Draft, DraftContext, Drafter
from .mtp_layers import MtpLayers


@dataclass
class _Next:
    """A request's first draft, from the MTP row at ``pos`` (its last computed position); the
    token and its probability stay on the device until a step drafts (read then, in one go:
    observing a step that ran asynchronously must not wait for the device)."""

    pos: int
    token: torch.Tensor  # [] int64
    prob: torch.Tensor  # [] float32
    hidden: torch.Tensor  # [N, D]: the MTP output streams of that row (depth 2's input)
    chunk: ComputedChunk  # cache geometry (slot, pages, window_from, cached_until)


class MtpDrafter(Drafter):
    """DeepSeek multi-token prediction (see the module docstring)."""

    uses_mtp_layers = True
    draft_model = MtpLayers

    def __init__(self, config: Any, vocab_size: int) -> None:
        super().__init__(config, vocab_size)
        self.runner: Any = None
        self.layers: Any = None  # the runner's MtpLayers
        self._next: dict[str, _Next] = {}

    def bind(self, runner: Any) -> None:
        if not isinstance(runner.draft_model, MtpLayers):
            raise RuntimeError("the mtp drafter needs a model runner built with draft_model=MtpLayers")
        self.runner, self.layers = runner, runner.draft_model

    # ---- after a step: catch the MTP cache up with the kept positions ---------------------------
    def observe(self, chunks: Sequence[ComputedChunk]) -> None:
        for c in chunks:
            self._next.pop(c.request_id, None)
        chunks = [c for c in chunks if c.num_rows]
        if not chunks:
            return
        runner = self.runner
        rows: list[int] = []
        seqs: list[SeqChunk] = []
        last_rows: list[int] = []
        for c in chunks:
            rows.extend(range(c.hidden_row, c.hidden_row + c.num_rows))
            seqs.append(_seq(c, c.start_pos, c.token_ids))
            if c.sampled:
                last_rows.append(len(rows) - 1)
        # pinned, non-blocking copies: a plain .to(device) waits for the stream (the step the
        # engine launched meanwhile), which would take the overlap of async scheduling away
        index = tensor_to_device(torch.tensor(rows, dtype=torch.int64), runner.device)
        hidden = chunks[0].hidden if chunks[0].hidden is not None else runner.hidden
        logits, streams = self.layers.execute(seqs, hidden.index_select(0, index), last_rows)
        if not last_rows:
            return
        prob, token = torch.softmax(logits, dim=-1).max(dim=-1)
        last_index = tensor_to_device(torch.tensor(last_rows, dtype=torch.int64), streams.device)
        last = streams.index_select(0, last_index)
        sampled = [c for c in chunks if c.sampled]
        for j, c in enumerate(sampled):
            self._next[c.request_id] = _Next(c.start_pos + c.num_rows - 1, token[j], prob[j], last[j], c)

    # ---- before a step: the drafts ------------------------------------------------------------
    def propose(self, contexts: Sequence[DraftContext]) -> list[Draft]:
        drafts: list[Draft] = [Draft([]) for _ in contexts]
        states: dict[int, _Next] = {}
        for i, ctx in enumerate(contexts):
            st = self._next.get(ctx.request_id)
            if st is not None and st.pos == len(ctx.token_ids) - 2:  # caught up: it drafts
                states[i] = st
        if states:  # the first drafts, read from the device in one go
            firsts = torch.stack(
                [torch.stack([st.token.double(), st.prob.double()]) for st in states.values()]
            )
            for i, (t, p) in zip(states, firsts.tolist(), strict=True):
                drafts[i] = Draft([int(t)], confidence=[p])
        hidden = {i: st.hidden for i, st in states.items()}
        depth = 1
        while True:
            active = [i for i in hidden if contexts[i].max_tokens > depth and self._fits(states[i], depth)]
            if not active:
                break
            seqs = [_seq(states[i].chunk, states[i].pos + depth, drafts[i].token_ids[-1:]) for i in active]
            h = torch.stack([hidden[i] for i in active])
            logits, streams = self.layers.execute(seqs, h, list(range(len(active))))
            prob, token = torch.softmax(logits, dim=-1).max(dim=-1)
            hidden = {}
            for j, (i, t, p) in enumerate(zip(active, token.tolist(), prob.tolist(), strict=True)):
                drafts[i].token_ids.append(t)
                assert drafts[i].confidence is not None
                drafts[i].confidence.append(p)
                hidden[i] = streams[j]
            depth += 1
        return drafts

    def _fits(self, st: _Next, depth: int) -> bool:
        """Whether the draft step at ``st.pos + depth`` may run: always for a sliding-window MTP
        layer; within the request's allocated pages for one that writes paged entries."""
        if not self.layers.paged:
            return True
        return st.pos + depth < len(st.chunk.block_table) * self.runner.page_size

    def on_finished(self, request_id: str) -> None:
        self._next.pop(request_id, None)


def _seq(c: ComputedChunk, start: int, next_tokens: list[int]) -> SeqChunk:
    """The MTP rows at positions ``start ..`` of ``c``'s request, embedding ``next_tokens``."""
    return SeqChunk(
        seq_slot=c.seq_slot,
        token_ids=list(next_tokens),
        start_pos=start,
        block_table=c.block_table,
        window_from=c.window_from,
        cached_until=c.cached_until,
        table_key=c.table_key,
    )
