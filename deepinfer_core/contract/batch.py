"""Plain data objects that cross the scheduler / model-runner boundary."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SeqChunk:
    """One request's share of a forward step.

    Attributes:
        seq_slot: the request's per-sequence state slot (window ring, compressor buffers),
            from :meth:`KVCacheManager.allocate_slot`.
        token_ids: the new tokens to run this step (a prefill chunk, or one decode token).
        start_pos: how many tokens of this request are already in the cache, i.e. the
            position of ``token_ids[0]``.
        block_table: page ids covering positions ``[0, start_pos + len(token_ids))``; page
            ``j`` holds positions ``[j*page_size, (j+1)*page_size)``.
        sample: whether the logits of the last token are needed (the chunk completes the
            prompt, or it is a decode step).
        all_logits: return the logits of every token of the chunk (prompt logprobs, tests),
            in order, instead of only the last one.
        window_from: first position whose sliding-window keys exist for this slot (the start
            of the request's computation since it was (re)admitted: 0, or the start of an SWA
            bounded replay); window keys of earlier positions are treated as absent.
        cached_until: positions below this already have their paged state in the cache (a
            prefix-cache hit): their compressor windows are neither recomputed nor rewritten,
            and the overlap carry at this boundary is restored from the page snapshot.
        prev_row: async scheduling: when ``>= 0`` the chunk is one decode token whose value
            the host does not know yet: it is row ``prev_row`` of the previous step's sampled
            tokens (still on the device), and ``token_ids`` holds a placeholder.
        num_draft: speculative decoding: the last ``num_draft`` of ``token_ids`` are draft
            tokens to verify; the logits of the chunk's last ``1 + num_draft`` rows are returned
            (each verified position's distribution).
        table_key: identifies ``block_table``'s lineage: it changes whenever the request's
            table is replaced rather than appended to (admission, preemption), so the model
            runner sends the device only the pages appended since it last saw the same key.
    """

    seq_slot: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool = True
    all_logits: bool = False
    window_from: int = 0
    cached_until: int = 0
    prev_row: int = -1
    num_draft: int = 0
    table_key: tuple[str, int] = ("", 0)

    @property
    def num_tokens(self) -> int:
        """Number of new tokens in this chunk."""
        return len(self.token_ids)

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits the chunk returns: all of them with ``all_logits``, else one per
        sampled position (``1 + num_draft``) when it samples, else none."""
        if self.all_logits:
            return self.num_tokens
        return 1 + self.num_draft if self.sample else 0

    @property
    def end_pos(self) -> int:
        """Number of tokens in the cache once this chunk has run."""
        return self.start_pos + len(self.token_ids)


def sample_rows(chunks: list[SeqChunk]) -> list[int]:
    """Token rows whose logits a step returns: every row of ``all_logits`` chunks, the last
    ``1 + num_draft`` rows (the verified positions) of the other sampling chunks, in chunk
    order."""
    rows: list[int] = []
    end = 0
    for c in chunks:
        end += len(c.token_ids)
        n = c.num_logit_rows
        if n == 1:  # a decode or a prompt's last chunk
            rows.append(end - 1)
        elif n:
            rows.extend(range(end - n, end))
    return rows
