"""What the host sends the device per step: O(batch) scalars and block-table deltas.

The scheduler's chunks become, per request, six integers (slot, start, length, cached-until,
window-from, previous-step token row) plus the step's known token ids and the rows of the
logits to sample; they are packed into one persistent host buffer (pinned on accelerators)
and copied with one non-blocking transfer into a persistent device buffer.  The block tables
live on the device, one row per sequence slot, and receive only the pages appended since
the last step (a slot whose request changed is rewritten whole).  Everything per token
(positions, window rows, compressor plans, entry counts) is derived from these on the
device by the model (:mod:`deepinfer_core.models.deepseek_v4.metadata`).

Padding (for fixed shapes, e.g. CUDA graphs): ``num_reqs``/``num_tokens`` may exceed the real
counts; the extra tokens belong to one pad request on the cache's trash slot, whose block-table
row points at the trash page, so every write they cause lands in rows no request reads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from .batch import SeqChunk

# per-request fields, in packing order
REQ_FIELDS = ("slot", "start", "len", "cached", "window_from", "prev_row")


@dataclass
class StepInputs:
    """One step's inputs on the device.  Tensors are views of persistent buffers.

    Attributes:
        input_ids: ``[T]`` int64 token ids (a pending async token is filled from
            ``prev_tokens`` by the model's metadata step).
        req: per-request ``[R]`` int64 fields by name: ``slot``, ``start`` (position of the
            first new token), ``len`` (new tokens), ``cached`` (prefix-cache boundary),
            ``window_from`` (first position whose window keys exist), ``prev_row`` (row of
            ``prev_tokens`` holding the request's first new token, ``-1`` none).
        block_tables: ``[num_slots + 1, max_pages]`` int64 page ids by slot (persistent).
        sample_rows: ``[N]`` int64 token rows whose logits are wanted.
        prev_tokens: the previous step's sampled tokens on the device (or ``None``).
        num_tokens, num_reqs: ``T`` and ``R`` (static ints, padding included).
        max_end: a static bound on ``start + len`` over the requests (shapes of entry lists).
        spans: per request, ``(start, cached, start + len)`` on the host, for an unpadded
            step (its shapes may follow the values: e.g. exactly the compressor windows the
            step closes, and it may leave out work none of its requests needs); ``None`` for a
            padded, fixed-shape step (graphs), whose shapes may depend only on ``num_tokens``
            and ``num_reqs``.
        decoding: a fixed-shape step whose every request decodes past its prefix-cache
            boundary (a decode or verify graph's): none replays or resumes, so the plans leave
            out the prefix hits' carry restores (as an unpadded step that knows it does).
    """

    input_ids: torch.Tensor
    req: dict[str, torch.Tensor]
    block_tables: torch.Tensor
    sample_rows: torch.Tensor
    prev_tokens: torch.Tensor | None
    num_tokens: int
    num_reqs: int
    max_end: int
    spans: list[tuple[int, int, int]] | None = None
    decoding: bool = False

    def fields(self) -> torch.Tensor:
        """The per-request fields as one ``[len(REQ_FIELDS), R]`` tensor, rows in
        :data:`REQ_FIELDS` order: a view of the packed buffer when the fields are its
        consecutive rows (as :class:`StepInputBuffers` lays them out), else a stacked copy.
        Not to be modified in place."""
        cols = [self.req[name] for name in REQ_FIELDS]
        first = cols[0]
        n, step = first.shape[0], first.element_size() * first.shape[0]
        packed = all(
            c.dim() == 1
            and c.shape[0] == n
            and c.dtype == first.dtype
            and c.device == first.device
            and (c.stride(0) == 1 or n <= 1)
            and c.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and c.data_ptr() == first.data_ptr() + i * step
            for i, c in enumerate(cols)
        )
        return first.as_strided((len(cols), n), (n, 1)) if packed and n else torch.stack(cols)

    def windows_closed(self, ratio: int) -> int | None:
        """How many windows of ``ratio`` tokens the step's requests close (each request's from
        its first uncached position on), or ``None`` for a fixed-shape step (see ``spans``)."""
        if self.spans is None:
            return None
        return sum(max(0, end // ratio - max(start, cached) // ratio) for start, cached, end in self.spans)

    def one_token_each(self) -> bool:
        """Whether this is an unpadded step in which every request runs exactly one token (a
        decode step): token ``i`` then belongs to request ``i``."""
        return self.spans is not None and all(end - start == 1 for start, _, end in self.spans)

    def num_replaying(self) -> int | None:
        """How many requests compute positions below their prefix-cache boundary this step
        (``start < cached``: a prefix hit's replay), or ``None`` for a fixed-shape step (0 for a
        ``decoding`` one)."""
        if self.spans is None:
            return 0 if self.decoding else None
        return sum(start < cached for start, cached, _ in self.spans)

    def num_resuming(self) -> int | None:
        """How many requests reach their prefix-cache boundary this step (``start < cached <=
        end``: state kept per page is restored there), or ``None`` for a fixed-shape step (0
        for a ``decoding`` one)."""
        if self.spans is None:
            return 0 if self.decoding else None
        return sum(start < cached <= end for start, cached, end in self.spans)


class StepInputBuffers:
    """Persistent host and device buffers for :class:`StepInputs`, and the block-table mirror.

    Args:
        max_tokens: most tokens of a step (padding included).
        max_reqs: most requests of a step (the pad request included).
        num_slots: sequence slots; slot ``num_slots`` is the cache's trash slot.
        max_pages: pages per block-table row (``ceil(max_model_len / page_size)``).
        trash_page: the cache's trash page id (initial value of every block-table entry).
        device: where the model runs.
    """

    def __init__(
        self, max_tokens: int, max_reqs: int, num_slots: int, max_pages: int, trash_page: int, device
    ):
        self.device = torch.device(device)
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        self.trash_slot, self.trash_page = num_slots, trash_page
        pin = self.device.type == "cuda"
        # layout: [ids (T) | request fields (6 x R) | sample rows (T)].  Two host buffers used in
        # turn: with async scheduling the host packs step N+1 while step N's copy may still be
        # queued behind step N-1, so a buffer is rewritten only once its last copy has run.
        size = 2 * max_tokens + len(REQ_FIELDS) * max_reqs
        self._hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in range(2 if pin else 1)]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._hosts)
        self._turn = 0
        self._dev = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.block_tables = torch.full((num_slots + 1, max(max_pages, 1)), trash_page, dtype=torch.int64)
        self.block_tables = self.block_tables.to(self.device)
        self._owner: list[tuple[str, int] | None] = [None] * num_slots  # (table key) per slot
        self._uploaded = [0] * num_slots
        self._pin = pin

    def prepare(
        self,
        chunks: list[SeqChunk],
        sample_rows: list[int],
        prev_tokens: torch.Tensor | None,
        num_tokens: int | None = None,
        num_reqs: int | None = None,
        max_end: int | None = None,
        block_tables: bool = True,
        decoding: bool = False,
    ) -> StepInputs:
        """Pack ``chunks`` (and padding up to ``num_tokens``/``num_reqs``) and send them.

        ``max_end`` overrides the bound on positions (CUDA graphs use ``max_model_len``).
        ``block_tables=False``: the step reads no page (a DSpark block), so the chunks' block
        tables are ignored and the device's are left as they are.  ``decoding``: a fixed-shape
        step none of whose chunks starts below its prefix-cache boundary (see
        :class:`StepInputs`); a chunk that does is refused.
        """
        if decoding and (stale := [c.seq_slot for c in chunks if c.start_pos < c.cached_until]):
            raise ValueError(f"a decoding step's chunks start below their cached boundary (slots {stale})")
        lens = [len(c.token_ids) for c in chunks]
        real_t = sum(lens)
        t = real_t if num_tokens is None else num_tokens
        r = len(chunks) + (t > real_t) if num_reqs is None else num_reqs
        if t > self.max_tokens or r > self.max_reqs or t < real_t or r < len(chunks) + (t > real_t):
            raise ValueError(f"step of {real_t} tokens / {len(chunks)} requests does not fit ({t}, {r})")
        turn = self._turn = (self._turn + 1) % len(self._hosts)
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # its previous copy has run (normally long ago)
        host_t = self._hosts[turn]
        host = host_t.numpy()
        ids = host[:t]
        fields = host[t : t + len(REQ_FIELDS) * r].reshape(len(REQ_FIELDS), r)
        rows = host[t + len(REQ_FIELDS) * r : t + len(REQ_FIELDS) * r + len(sample_rows)]
        ids[:real_t] = np.fromiter(
            itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, real_t
        )
        ids[real_t:] = 0
        n = len(chunks)
        # one pass over the chunks for everything per request (a decode step has one per slot)
        per_chunk = [
            (c.seq_slot, c.start_pos, m, c.cached_until, c.window_from, c.prev_row)
            for c, m in zip(chunks, lens, strict=True)
        ]
        fields[:, :n] = np.array(per_chunk, dtype=np.int64).reshape(n, len(REQ_FIELDS)).T
        fields[:, n:] = 0
        fields[0, n:] = self.trash_slot
        fields[5, n:] = -1
        if n < r:
            fields[2, n] = t - real_t  # the pad request holds every pad token
        rows[:] = sample_rows
        used = t + len(REQ_FIELDS) * r + len(sample_rows)
        self._dev[:used].copy_(host_t[:used], non_blocking=self._pin)
        if self._pin:
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        if block_tables:
            self._update_block_tables(chunks)
        dev = self._dev
        base = t
        req = {}
        for i, name in enumerate(REQ_FIELDS):
            req[name] = dev[base + i * r : base + (i + 1) * r]
        fixed_shape = num_tokens is not None or num_reqs is not None or max_end is not None
        spans = None if fixed_shape else [(p[1], p[3], p[1] + p[2]) for p in per_chunk]
        if max_end is None:
            max_end = max([p[1] + p[2] for p in per_chunk] + [t - real_t])
        return StepInputs(
            input_ids=dev[:t],
            req=req,
            block_tables=self.block_tables,
            sample_rows=dev[base + len(REQ_FIELDS) * r : used],
            prev_tokens=prev_tokens,
            num_tokens=t,
            num_reqs=r,
            max_end=max_end,
            spans=spans,
            decoding=decoding and fixed_shape,
        )

    def _update_block_tables(self, chunks: list[SeqChunk]) -> None:
        """Send the block-table entries that changed: new pages, or whole rows of slots that
        changed hands (one small transfer; none at all in most decode steps)."""
        slots: list[int] = []
        cols: list[int] = []
        pages: list[int] = []
        for c in chunks:
            s, table = c.seq_slot, c.block_table
            if self._owner[s] != c.table_key:
                self._owner[s], self._uploaded[s] = c.table_key, 0
            done = self._uploaded[s]
            if len(table) > done:
                new = len(table) - done
                slots += [s] * new
                cols += range(done, len(table))
                pages += table[done:]
                self._uploaded[s] = len(table)
        if not slots:
            return
        if max(cols) >= self.block_tables.shape[1]:
            width = self.block_tables.shape[1]
            raise ValueError(f"block table of {max(cols) + 1} pages exceeds the {width} pages of a row")
        delta = torch.tensor([slots, cols, pages], dtype=torch.int64)
        if self._pin:
            delta = delta.pin_memory()
        delta = delta.to(self.device, non_blocking=self._pin)
        self.block_tables.index_put_((delta[0], delta[1]), delta[2])
