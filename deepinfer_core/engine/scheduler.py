"""Continuous batching with chunked prefill.

Each :meth:`Scheduler.schedule` fills a budget of ``max_num_batched_tokens`` tokens over at
most ``max_num_seqs`` running requests, in this order:

1. running requests that decode (one token each), in admission order;
2. running requests still prefilling (or recomputing after preemption): one chunk each, as
   large as the remaining budget and the free cache pages allow;
3. waiting requests in FIFO order (preempted ones first), while a slot and the pages of their
   first chunk are free; admission stops at the first request that does not fit, so a long
   prompt is not starved by short ones behind it.

Pages are allocated as sequences grow.  When a running request cannot get even one token's
worth of pages, the most recently admitted request not yet scheduled this step is preempted:
its pages and slot are freed and it goes back to the front of the waiting queue with
``num_computed_tokens = 0``.  A request that cannot fit in the whole cache finishes with
``finish_reason="error"``.

Prefix caching and SWA bounded replay: on admission (a new request, or a preempted one being
resumed) the longest run of cached full pages matching its tokens (prompt and, when resumed,
its generated tokens) is reused: their compressed entries, indexer keys and page-end carry
are not recomputed.  The sliding-window KV is not cached; it is rebuilt by *replaying* only
the ``replay_tail`` tokens before the hit point ``H`` (the first chunk starts at
``H - replay_tail``, with ``window_from`` there and ``cached_until = H``), never the whole
prefix, and replayed tokens never rewrite cached pages.  Every page whose positions have all
been computed is registered in the prefix cache after the step, so a preempted request
usually resumes with a hit and recomputes only the replay tail.

Async scheduling: :meth:`schedule` may run while the previous step is still executing.  A
request whose last step sampled a token that is not processed yet (``num_pending``) gets a
decode chunk whose token is a placeholder filled on the device from that step's sampled
tokens (``SeqChunk.prev_row``); one whose pending token reaches ``max_tokens`` or
``max_model_len`` gets none.  ``num_computed_tokens`` advances when a chunk is scheduled;
:meth:`complete` appends the sampled tokens when the step's outputs are processed, finishes
requests (discarding the token of a step that ran after its request had already finished)
and registers newly full pages in the prefix cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.engine.kv_cache import KVCacheManager
from deepinfer_core.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What one step runs.

    Attributes:
        chunks: the :class:`SeqChunk` of each scheduled request, in order.
        requests: the request each chunk belongs to (same order).
        preempted: requests sent back to WAITING while scheduling this step.
        finished: requests that failed while scheduling (e.g. do not fit in the cache).
        num_prefix_hit_tokens: prompt positions served from the prefix cache at admission.
        num_replayed_tokens: of those, positions recomputed to rebuild the sliding windows.
        num_sampling: chunks that sample a token (rows of the step's sampled tokens).
        discarded: set by :meth:`Scheduler.complete`: requests that had finished before the
            step's outputs arrived, whose computed tokens were dropped.
    """

    chunks: list[SeqChunk] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0
    num_replayed_tokens: int = 0
    num_sampling: int = 0
    discarded: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled this step."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampling_requests(self) -> list[Request]:
        """Requests whose chunk samples a token, in chunk order (= rows of the logits)."""
        return [r for r, c in zip(self.requests, self.chunks, strict=True) if c.sample]

    @property
    def is_empty(self) -> bool:
        """Whether nothing runs this step."""
        return not self.chunks


class Scheduler:
    """Decides which requests run each step and manages their cache pages and slots.

    Args:
        kv_cache: page and slot allocator (its ``num_slots`` bounds the running requests too).
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget per step.
        enable_chunked_prefill: when ``False`` a prompt is only scheduled whole.
        replay_tail: tokens recomputed before a prefix-cache hit to rebuild the sliding
            windows (a multiple of the page size; see :meth:`ModelRunner.replay_tail`).
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        replay_tail: int = 0,
        max_model_len: int | None = None,
    ):
        self.kv_cache = kv_cache
        self.replay_tail = replay_tail
        self.max_model_len = max_model_len if max_model_len is not None else 1 << 62
        self.max_num_seqs = min(max_num_seqs, kv_cache.num_slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request (FIFO)."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens fits in the whole cache."""
        return self.kv_cache.pages_needed(num_tokens) <= self.kv_cache.num_pages

    # ---- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        decoding, prefilling = [], []  # (request, its uncomputed tokens)
        max_model_len = self.max_model_len
        for r in self.running:
            if r.will_finish_by_length(max_model_len):
                continue
            uncomputed = r.num_uncomputed_tokens
            if uncomputed == 1:
                decoding.append((r, 1))
            elif uncomputed > 1:
                prefilling.append((r, uncomputed))
        running = RequestStatus.RUNNING
        for req, uncomputed in decoding + prefilling:
            if budget <= 0:
                break
            if req.status is not running:  # preempted earlier in this loop
                continue
            n = self._fit_running(req, budget, scheduled, out, uncomputed)
            if n:
                self._emit(req, n, out)
                scheduled.add(id(req))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:  # preempted while its last step ran: wait for its token
                break
            if not self.can_ever_fit(req.num_tokens):
                self.waiting.popleft()
                self._fail_too_long(req, out, req.num_tokens)
                continue
            hit = self._match_prefix(req)
            n = self._chunk_size(req, budget, req.num_uncomputed_tokens)
            need = self.kv_cache.pages_needed(req.num_computed_tokens + n) - len(req.block_table)
            if n == 0 or self.kv_cache.num_free_slots == 0 or not self.kv_cache.can_allocate(need):
                self._reset_progress(req)  # gives the matched pages back; retried next step
                break
            out.num_prefix_hit_tokens += hit
            out.num_replayed_tokens += hit - req.num_computed_tokens
            self.waiting.popleft()
            req.seq_slot = self.kv_cache.allocate_slot()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._grow(req, n)
            self._emit(req, n, out)
            scheduled.add(id(req))
            budget -= n
        return out

    def _match_prefix(self, req: Request) -> int:
        """Reuse the cached full pages that match ``req``'s tokens and position it for SWA
        bounded replay; returns the hit length ``H`` in tokens (0 without a hit)."""
        if req.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed
        tokens = req.token_slice(0, req.num_tokens)
        # keep at least the last token to compute: its logits give the next token
        pages, hashes = self.kv_cache.match_prefix(tokens, req.num_tokens - 1)
        hit = len(pages) * self.kv_cache.page_size
        req.block_table, req.page_hashes = pages, hashes
        req.table_version += 1
        req.cached_until = hit
        req.window_from = req.num_computed_tokens = max(0, hit - self.replay_tail)
        return hit

    def _reset_progress(self, req: Request) -> None:
        """Drop ``req``'s pages and computed state (it will be recomputed, or re-matched)."""
        self.kv_cache.free_pages(req.block_table)
        req.block_table, req.page_hashes = [], []
        req.table_version += 1
        req.num_computed_tokens = req.cached_until = req.window_from = 0

    def _register_full_pages(self, req: Request, computed: int) -> None:
        """Register each page of ``req`` below position ``computed`` (all computed)."""
        p = self.kv_cache.page_size
        while len(req.page_hashes) < min(computed, req.num_tokens) // p:
            j = len(req.page_hashes)
            prev = req.page_hashes[-1] if req.page_hashes else None
            tokens = req.token_slice(j * p, (j + 1) * p)
            req.page_hashes.append(self.kv_cache.register_page(req.block_table[j], prev, tokens))

    def _chunk_size(self, req: Request, budget: int, remaining: int) -> int:
        """Tokens of ``req`` to run within ``budget`` of its ``remaining`` uncomputed ones (0 if an
        unchunked prompt does not fit); a decode's drafts come on top of its token (cut to it)."""
        if remaining == 1 and req.draft_token_ids:
            return min(1 + len(req.draft_token_ids), budget)
        if remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill else 0

    def _fit_running(
        self, req: Request, budget: int, scheduled: set[int], out: SchedulerOutput, remaining: int
    ) -> int:
        """``req``'s chunk size (of its ``remaining`` tokens), its pages allocated (may preempt)."""
        n = self._chunk_size(req, budget, remaining)
        if n == 0:
            return 0
        if req.num_computed_tokens + n <= len(req.block_table) * self.kv_cache.page_size:
            return n  # its pages hold the chunk already (most decode steps)
        while True:
            free_tokens = (len(req.block_table) + self.kv_cache.num_free_pages) * self.kv_cache.page_size
            fit = min(n, free_tokens - req.num_computed_tokens)
            # a short cache cuts a prefill chunk (when chunking) or a decode's drafts, never more
            if fit == n or (fit >= 1 and (self.enable_chunked_prefill or req.draft_token_ids)):
                self._grow(req, fit)
                return fit
            victim = next(
                (r for r in reversed(self.running) if id(r) not in scheduled and r is not req), None
            )
            if victim is None:
                if not self.can_ever_fit(req.num_computed_tokens + n):
                    self._release(req)
                    self._fail_too_long(req, out, req.num_computed_tokens + n)
                else:
                    self._preempt(req, out)
                return 0
            self._preempt(victim, out)

    def _grow(self, req: Request, n: int) -> None:
        """Allocate the pages ``req`` needs to hold ``num_computed_tokens + n`` positions."""
        need = self.kv_cache.pages_needed(req.num_computed_tokens + n) - len(req.block_table)
        if need > 0:
            req.block_table.extend(self.kv_cache.allocate_pages(need))

    def _emit(self, req: Request, n: int, out: SchedulerOutput) -> None:
        """Add ``req``'s chunk of ``n`` tokens to ``out`` (the step's hot path: one per request)."""
        start = req.num_computed_tokens
        end = start + n
        num_tokens = req.num_tokens
        known = min(end, num_tokens)
        # beyond the known tokens: draft tokens to verify, or (async) the unprocessed sampled one
        drafts = req.draft_token_ids
        if drafts:
            drafts = req.draft_token_ids = drafts[: end - known] if known == num_tokens else []
        pending = end - known - len(drafts)
        assert req.seq_slot is not None and pending <= req.num_pending
        token_ids = req.token_slice(start, known) if known > start else []  # (async decode: none)
        if pending or drafts:
            token_ids += [0] * pending + drafts
        sample = end == num_tokens + req.num_pending + len(drafts)
        out.chunks.append(
            SeqChunk(
                seq_slot=req.seq_slot,
                token_ids=token_ids,
                start_pos=start,
                block_table=req.block_table.copy(),
                sample=sample,
                num_draft=len(drafts),
                all_logits=req.prompt_logprobs is not None and req.needs_prompt_logits(start, end),
                window_from=req.window_from,
                cached_until=req.cached_until,
                prev_row=req.pending_row if pending else -1,
                table_key=(req.request_id, req.table_version),
            )
        )
        out.requests.append(req)
        req.num_computed_tokens = end
        if sample:  # its token stays pending until :meth:`complete`
            req.num_pending += 1
            req.pending_row = out.num_sampling
            out.num_sampling += 1

    def _release(self, req: Request) -> None:
        """Free a running request's pages and slot and drop it from ``running``."""
        self._reset_progress(req)
        if req.seq_slot is not None:
            self.kv_cache.free_slot(req.seq_slot)
            req.seq_slot = None
        if req in self.running:
            self.running.remove(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _fail_too_long(self, req: Request, out: SchedulerOutput, num_tokens: int) -> None:
        """Fail ``req``: ``num_tokens`` positions (the count that did not fit) exceed the cache."""
        pages = self.kv_cache.pages_needed(num_tokens)
        req.finish(
            "error",
            f"request {req.request_id!r} needs {pages} cache pages for {num_tokens} tokens but the "
            f"cache has only {self.kv_cache.num_pages}; raise num_cache_pages to at least {pages} "
            "(or kv_cache_memory_gb) or lower max_model_len",
        )
        out.finished.append(req)

    # ---- after the step ------------------------------------------------------------------------
    def complete(
        self,
        out: SchedulerOutput,
        token_ids: list[int],
        logprobs: list[dict[int, float] | None],
        eos_token_ids: list[int],
    ) -> list[Request]:
        """Process a step's outputs; returns the requests that finished.

        Appends each sampling chunk's token (finish checks in :meth:`Request.append_token`),
        registers pages the step completed, and frees finished requests.  Requests that
        finished (or were aborted) before this step's outputs arrived keep their state: the
        token the step computed for them is discarded.

        Args:
            out: the step's schedule.
            token_ids, logprobs: sampled token (and logprobs) per sampling chunk, in chunk order.
        """
        if any(c.num_draft for c in out.chunks):
            return self.complete_tokens(
                out, [[t] for t in token_ids], [[lp] for lp in logprobs], eos_token_ids
            )
        # no drafts: one token per sampling chunk (complete_tokens' steps, without its draft cases)
        finished = []
        row = -1
        page_size = self.kv_cache.page_size
        max_model_len, running, done = self.max_model_len, RequestStatus.RUNNING, RequestStatus.FINISHED
        for req, chunk in zip(out.requests, out.chunks, strict=True):
            row += chunk.sample
            status = req.status
            if status is done:
                out.discarded.append(req)
                continue
            if status is running:
                # register the pages the step computed for the request as it is now (not ones
                # given up by a preemption while the step ran)
                computed = min(chunk.start_pos + len(chunk.token_ids), req.num_tokens)
                if len(req.page_hashes) < computed // page_size:
                    table = chunk.block_table
                    if req.block_table[: len(table)] == table:
                        self._register_full_pages(req, computed)
            if chunk.sample:
                req.num_pending -= 1
                if req.append_token(token_ids[row], logprobs[row], eos_token_ids, max_model_len):
                    if req in self.waiting:  # preempted while this step ran
                        self.waiting.remove(req)
                    self._release(req)
                    finished.append(req)
        return finished

    def complete_tokens(
        self,
        out: SchedulerOutput,
        token_ids: list[list[int]],
        logprobs: list[list[dict[int, float] | None]],
        eos_token_ids: list[int],
    ) -> list[Request]:
        """:meth:`complete` for steps that may emit several tokens per chunk (speculative
        decoding): ``token_ids[row]`` are the tokens a sampling chunk emits, in order — for a
        chunk that verified ``num_draft`` drafts, the accepted drafts then the target's own
        token, so ``1 .. 1 + num_draft`` of them.  The chunk's positions after the accepted
        ones were computed for rejected drafts: ``num_computed_tokens`` is set back to the
        accepted end (the next step overwrites what they wrote; see
        :mod:`deepinfer_core.models.deepseek_v4.metadata` for why nothing reads it before) and
        only pages of accepted positions are registered in the prefix cache.  Tokens after one
        that finishes the request are dropped.
        """
        finished = []
        row = -1
        for req, chunk in zip(out.requests, out.chunks, strict=True):
            row += chunk.sample
            if req.is_finished:
                out.discarded.append(req)
                continue
            # register the pages the step computed for the request as it is now (not ones
            # given up by a preemption while the step ran)
            held = req.block_table[: len(chunk.block_table)] == chunk.block_table
            computed = chunk.end_pos
            if chunk.num_draft and chunk.sample:
                computed = chunk.end_pos - chunk.num_draft - 1 + len(token_ids[row])
                if req.status is RequestStatus.RUNNING and held:
                    req.num_computed_tokens = computed
                req.draft_token_ids = []
            if req.status is RequestStatus.RUNNING and held and not chunk.num_draft:
                self._register_full_pages(req, computed)
            if chunk.sample:
                req.num_pending -= 1
                done = False
                for token, lp in zip(token_ids[row], logprobs[row], strict=True):
                    done = req.append_token(token, lp, eos_token_ids, self.max_model_len)
                    if done:
                        break
                if done:
                    if req in self.waiting:  # preempted while this step ran
                        self.waiting.remove(req)
                    self._release(req)
                    finished.append(req)
                elif chunk.num_draft and req.status is RequestStatus.RUNNING and held:
                    self._register_full_pages(req, computed)  # the accepted tokens are in now
        return finished

    def finish_requests(self, request_ids: Collection[str], reason: str) -> list[Request]:
        """Finish the waiting or running requests with these ids (``reason``, e.g. ``"abort"``),
        freeing their pages and slots; returns them.  Unknown ids are ignored."""
        done = [r for r in (*self.running, *self.waiting) if r.request_id in request_ids]
        for req in done:
            if req in self.waiting:
                self.waiting.remove(req)
            self._release(req)
            req.finish(reason)
        return done

    def abort_all(self, reason: str) -> list[Request]:
        """Finish every waiting and running request with ``finish_reason="error"``."""
        done = []
        for req in list(self.running) + list(self.waiting):
            self._release(req)
            req.finish("error", reason)
            done.append(req)
        self.waiting.clear()
        return done
