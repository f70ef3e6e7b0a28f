"""The compressor's window plan: an unpadded step plans exactly the windows its requests close
(counted on the host), a fixed-shape step a static bound; the live windows are the same."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.contract.step_inputs import REQ_FIELDS, StepInputBuffers
from deepinfer_core.models.deepseek_v4.metadata import buffer_windows, build_metadata

PAGE, SLOTS, PAGES = 16, 8, 16
TRASH_PAGE = SLOTS * PAGES


def _chunks(seed: int) -> list[SeqChunk]:
    rng = random.Random(seed)
    chunks = []
    for slot in range(rng.randint(1, SLOTS)):
        start = rng.choice([0, rng.randint(0, 150)])
        n = rng.choice([1, 1, rng.randint(1, 40)])
        # cached: none, a boundary already behind the chunk, one it reaches (a prefix hit's replay)
        # or one beyond it (a replay chunked before the boundary)
        cached = rng.choice(
            [0, (start // PAGE) * PAGE, ((start + n) // PAGE) * PAGE, ((start + n) // PAGE + 1) * PAGE]
        )
        pages = list(range(slot * PAGES, slot * PAGES + -(-(start + n) // PAGE)))
        chunks.append(SeqChunk(slot, [5] * n, start, pages, cached_until=cached))
    return chunks


@pytest.mark.parametrize("seed", range(12))
def test_unpadded_steps_plan_exactly_the_closed_windows(seed: int):
    chunks = _chunks(seed)
    bufs = StepInputBuffers(512, SLOTS + 1, SLOTS, PAGES, TRASH_PAGE, "cpu")
    inputs = bufs.prepare(chunks, [], None)
    exact = build_metadata(inputs, 8, [4, 16], PAGE, SLOTS, TRASH_PAGE)
    bound = build_metadata(replace(inputs, spans=None), 8, [4, 16], PAGE, SLOTS, TRASH_PAGE)
    for r in (4, 16):
        e, b = exact.plans[r], bound.plans[r]
        want = sum(max(0, c.end_pos // r - max(c.start_pos, c.cached_until) // r) for c in chunks)
        assert e.windows.shape[0] == want <= b.windows.shape[0]
        live = b.dest != TRASH_PAGE * (PAGE // r)  # the bound's padding windows go to the trash page
        assert int(live.sum()) == want
        # the count the compressor hands to compress_entries: the real windows come first
        assert e.live is None and b.live.tolist() == [want] and bool(live[:want].all())
        assert torch.equal(e.windows, b.windows[:want]) and torch.equal(e.dest, b.dest[:want])
        assert torch.equal(e.positions, b.positions[:want]) and torch.equal(e.carry_rows, b.carry_rows[:want])
        assert torch.equal(e.buf_rows, b.buf_rows)
        # prev indexes [carries of all slots ; the step's M windows ; empty]: empty moves with M
        carries, m_bound = (SLOTS + 1) * buffer_windows(r, 0), b.windows.shape[0]
        expected_prev = torch.where(b.prev == carries + m_bound, carries + want, b.prev)[:want]
        assert torch.equal(e.prev, expected_prev)
        # what the host knows is not needed is left out: restores when no chunk reaches its
        # cached boundary, page-end snapshots when no closed window ends a page
        resuming = any(c.start_pos < c.cached_until <= c.end_pos for c in chunks)
        assert (e.restore_rows is not None) == resuming == (e.restore_page is not None)
        if resuming:
            assert torch.equal(e.restore_rows, b.restore_rows) and torch.equal(e.restore_page, b.restore_page)
        else:  # the bound's restores all go to the trash slot
            assert bool((b.restore_rows == SLOTS * buffer_windows(r, 0)).all())
        page_ends = int((b.snap_page != TRASH_PAGE).sum())
        assert (e.snap_page is not None) == (page_ends > 0)
        if page_ends:
            assert torch.equal(e.snap_page, b.snap_page[:want])


def test_padded_steps_keep_the_fixed_shape():
    chunks = _chunks(3)
    bufs = StepInputBuffers(512, SLOTS + 1, SLOTS, PAGES, TRASH_PAGE, "cpu")
    inputs = bufs.prepare(chunks, [], None, num_tokens=sum(c.num_tokens for c in chunks) + 3)
    assert inputs.spans is None and inputs.windows_closed(4) is None
    md = build_metadata(inputs, 8, [4], PAGE, SLOTS, TRASH_PAGE)
    t, n = inputs.num_tokens, inputs.num_reqs
    assert md.plans[4].windows.shape[0] == min(t, t // 4 + n)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("decode", [False, True])
def test_unpadded_per_token_plans_equal_the_fixed_shape_ones(seed: int, decode: bool):
    """What an unpadded step skips on the host's word (a decode step's token-to-request gathers,
    the cached-boundary mask when no request replays) leaves every per-token plan as it is."""
    chunks = _chunks(seed)
    if decode:  # one token each, at its request's next position
        chunks = [
            SeqChunk(c.seq_slot, [5], c.end_pos, c.block_table, cached_until=c.cached_until) for c in chunks
        ]
        chunks = [c for c in chunks if len(c.block_table) * PAGE >= c.end_pos] or chunks[:0]
    bufs = StepInputBuffers(512, SLOTS + 1, SLOTS, PAGES, TRASH_PAGE, "cpu")
    inputs = bufs.prepare(chunks, [], None)
    assert inputs.one_token_each() == all(c.num_tokens == 1 for c in chunks)
    exact = build_metadata(inputs, 8, [4, 16], PAGE, SLOTS, TRASH_PAGE)
    general = build_metadata(replace(inputs, spans=None), 8, [4, 16], PAGE, SLOTS, TRASH_PAGE)
    for name in ("input_ids", "positions", "window_ring", "window_chunk", "ring_rows", "real_tokens"):
        assert torch.equal(getattr(exact, name), getattr(general, name)), name
    for r in (4, 16):
        e, g = exact.plans[r], general.plans[r]
        assert torch.equal(e.buf_rows, g.buf_rows)
        assert torch.equal(e.entries.token_rows, g.entries.token_rows)
        assert torch.equal(e.entries.counts, g.entries.counts)


@pytest.mark.parametrize("seed", range(6))
def test_a_decoding_fixed_shape_step_plans_no_restores_and_else_the_same(seed: int):
    """A decode graph's step (``decoding``: every chunk starts past its cached boundary) leaves
    out the prefix hits' carry restores, which in such a step all go to the trash slot, and
    the cached-boundary mask; every other plan is the fixed-shape step's."""
    chunks = [
        SeqChunk(c.seq_slot, [5], c.end_pos, c.block_table, cached_until=min(c.cached_until, c.end_pos))
        for c in _chunks(seed)
    ]
    chunks = [c for c in chunks if len(c.block_table) * PAGE > c.end_pos]
    bufs = StepInputBuffers(512, SLOTS + 1, SLOTS, PAGES, TRASH_PAGE, "cpu")
    t = len(chunks) + 1  # a padding token (the pad request's)
    fixed = bufs.prepare(chunks, [], None, num_tokens=t, num_reqs=t, max_end=PAGES * PAGE)
    inputs = replace(fixed, decoding=True)
    assert fixed.num_resuming() is None and inputs.num_resuming() == inputs.num_replaying() == 0
    plain = build_metadata(fixed, 8, [4, 16], PAGE, SLOTS, TRASH_PAGE)
    decoding = build_metadata(inputs, 8, [4, 16], PAGE, SLOTS, TRASH_PAGE)
    for name in ("input_ids", "positions", "window_ring", "window_chunk", "ring_rows", "real_tokens"):
        assert torch.equal(getattr(plain, name), getattr(decoding, name)), name
    for r in (4, 16):
        p, d = plain.plans[r], decoding.plans[r]
        assert d.restore_rows is None and d.restore_page is None
        assert bool((p.restore_rows == SLOTS * buffer_windows(r, 0)).all())  # the trash slot's
        for name in ("windows", "prev", "positions", "dest", "carry_rows", "buf_rows", "snap_page", "live"):
            assert torch.equal(getattr(p, name), getattr(d, name)), name


def test_a_decoding_step_refuses_a_chunk_below_its_cached_boundary():
    chunk = SeqChunk(0, [5], 3, [0], cached_until=PAGE)
    bufs = StepInputBuffers(512, SLOTS + 1, SLOTS, PAGES, TRASH_PAGE, "cpu")
    with pytest.raises(ValueError, match="below their cached boundary"):
        bufs.prepare([chunk], [], None, num_tokens=2, num_reqs=3, max_end=PAGES * PAGE, decoding=True)
    assert bufs.prepare([chunk], [], None, num_tokens=2, num_reqs=3, max_end=PAGES * PAGE).decoding is False


def test_request_fields_are_one_view_of_the_packed_buffer():
    """``StepInputs.fields()``: the per-request fields as ``[F, R]`` rows, a view of the packed
    device buffer (no copy), and a stacked copy for fields that are not laid out that way."""
    bufs = StepInputBuffers(512, SLOTS + 1, SLOTS, PAGES, TRASH_PAGE, "cpu")
    inputs = bufs.prepare(_chunks(1), [], None, num_tokens=sum(c.num_tokens for c in _chunks(1)) + 2)
    want = torch.stack([inputs.req[name] for name in REQ_FIELDS])
    fields = inputs.fields()
    assert torch.equal(fields, want) and fields.data_ptr() == inputs.req["slot"].data_ptr()
    separate = replace(inputs, req={name: x.clone() for name, x in inputs.req.items()})
    assert torch.equal(separate.fields(), want)


@pytest.mark.parametrize("seed", range(6))
def test_speculative_geometry_agrees_padded_and_unpadded(seed: int):
    """With room for S = 5 draft tokens (ratio 4 buffers three windows a slot, ratio 16 two) an
    unpadded step plans the live windows of its fixed-shape form and the same per-token plans,
    and the buffer rows and carries it keeps are distinct rows (only the trash slot's repeat)."""
    spec = 5
    chunks = _chunks(seed)
    bufs = StepInputBuffers(512, SLOTS + 1, SLOTS, PAGES, TRASH_PAGE, "cpu")
    inputs = bufs.prepare(chunks, [], None)
    exact = build_metadata(inputs, 8, [4, 16], PAGE, SLOTS, TRASH_PAGE, spec)
    bound = build_metadata(replace(inputs, spans=None), 8, [4, 16], PAGE, SLOTS, TRASH_PAGE, spec)
    for name in ("positions", "window_ring", "window_chunk", "ring_rows"):
        assert torch.equal(getattr(exact, name), getattr(bound, name)), name
    for r in (4, 16):
        e, b, nb = exact.plans[r], bound.plans[r], buffer_windows(r, spec)
        assert nb == {4: 3, 16: 2}[r]
        assert torch.equal(e.buf_rows, b.buf_rows) and torch.equal(e.entries.counts, b.entries.counts)
        n = e.windows.shape[0]
        for name in ("windows", "positions", "dest", "carry_rows"):
            assert torch.equal(getattr(e, name), getattr(b, name)[:n]), name
        kept = e.buf_rows[e.buf_rows < SLOTS * nb * r]
        carried = e.carry_rows[e.carry_rows < SLOTS * nb]
        assert kept.unique().numel() == kept.numel() and carried.unique().numel() == carried.numel()
