"""The scheduler, run for real against KVCacheManager with a deterministic stand-in for the model.

The stand-in "model" predicts the next token as a hash of the whole sequence so far, so any
mistake in the chunks the scheduler hands out (wrong tokens, wrong positions, lost tokens after
a preemption) changes the generated tokens and is caught by comparing against a run with an
unconstrained cache.
"""

from __future__ import annotations

import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.engine.kv_cache import KVCacheManager
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.sampling.params import SamplingParams

VOCAB = 1000
EOS = [VOCAB]  # never produced by the stand-in model


def next_token(seq: list[int]) -> int:
    return zlib.crc32(bytes(str(seq), "ascii")) % VOCAB


def make_requests(prompt_lens: list[int], max_tokens: list[int]) -> list[Request]:
    reqs = []
    for i, (p, m) in enumerate(zip(prompt_lens, max_tokens, strict=True)):
        prompt = [(i * 31 + j * 7) % VOCAB for j in range(p)]
        reqs.append(Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=m)))
    return reqs


def run(
    reqs: list[Request],
    num_pages: int,
    page_size: int,
    max_num_seqs: int,
    budget: int,
    max_model_len: int = 10_000,
    chunked: bool = True,
    max_steps: int = 10_000,
) -> tuple[Scheduler, list[list]]:
    """Drive the scheduler to completion, checking per-step invariants; returns it and the steps."""
    kv = KVCacheManager(num_pages=num_pages, page_size=page_size, num_slots=max_num_seqs)
    sched = Scheduler(kv, max_num_seqs, budget, enable_chunked_prefill=chunked, max_model_len=max_model_len)
    for r in reqs:
        sched.add(r)
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.num_tokens <= budget
        assert len(out.chunks) <= max_num_seqs
        assert len({id(r) for r in out.requests}) == len(out.requests), "a request scheduled twice"
        pages_seen: set[int] = set()
        slots_seen: set[int] = set()
        for req in sched.running:
            assert not pages_seen & set(req.block_table), "two requests share a page"
            pages_seen |= set(req.block_table)
            assert req.seq_slot not in slots_seen
            slots_seen.add(req.seq_slot)
        assert len(pages_seen) + kv.num_free_pages == num_pages, "pages leaked or double-freed"
        tokens = []
        for req, chunk in zip(out.requests, out.chunks, strict=True):
            assert req.status is RequestStatus.RUNNING
            assert chunk.end_pos == req.num_computed_tokens  # advanced when scheduled
            assert chunk.token_ids == req.token_slice(chunk.start_pos, chunk.end_pos)
            assert chunk.block_table == req.block_table
            assert len(chunk.block_table) == kv.pages_needed(chunk.end_pos), (
                "pages not allocated incrementally"
            )
            assert chunk.seq_slot == req.seq_slot
            assert chunk.sample == (chunk.end_pos == req.num_tokens)  # sync flow: nothing pending before
            if chunk.sample:
                tokens.append(next_token(req.token_slice(0, chunk.end_pos)))
        steps.append(
            [
                (r.request_id, c.start_pos, c.num_tokens, c.sample)
                for r, c in zip(out.requests, out.chunks, strict=True)
            ]
        )
        sched.complete(out, tokens, [None] * len(tokens), EOS)
    else:
        raise AssertionError("scheduler did not finish all requests")
    assert kv.num_free_pages == num_pages and kv.num_free_slots == max_num_seqs
    assert all(r.is_finished for r in reqs)
    return sched, steps


def reference_outputs(reqs: list[Request]) -> dict[str, list[int]]:
    """What the stand-in model generates for each request, computed directly."""
    out = {}
    for r in reqs:
        seq = list(r.prompt_token_ids)
        for _ in range(r.params.max_tokens):
            seq.append(next_token(seq))
        out[r.request_id] = seq[len(r.prompt_token_ids) :]
    return out


def test_all_requests_finish_with_expected_tokens_and_pages_returned():
    reqs = make_requests([5, 17, 1, 40, 9], [3, 8, 12, 2, 20])
    sched, _ = run(reqs, num_pages=64, page_size=16, max_num_seqs=4, budget=32)
    assert {r.request_id: r.output_token_ids for r in reqs} == reference_outputs(reqs)
    assert all(r.finish_reason == "length" for r in reqs)
    assert sched.num_preemptions == 0


def test_long_prompt_is_split_into_budget_sized_chunks():
    reqs = make_requests([100], [2])
    _, steps = run(reqs, num_pages=16, page_size=16, max_num_seqs=2, budget=32)
    prefill = [s[0] for s in steps[:4]]
    assert prefill == [
        ("r0", 0, 32, False),
        ("r0", 32, 32, False),
        ("r0", 64, 32, False),
        ("r0", 96, 4, True),
    ]
    assert steps[4] == [("r0", 100, 1, True)]


def test_decodes_go_first_and_prefill_fills_the_rest_of_the_budget():
    reqs = make_requests([4, 50], [6, 2])
    _, steps = run(reqs, num_pages=32, page_size=16, max_num_seqs=2, budget=16)
    # step 0: r0 whole prompt (4) + 12 tokens of r1; step 1: r0 decodes first, r1 gets 15 more
    assert steps[0] == [("r0", 0, 4, True), ("r1", 0, 12, False)]
    assert steps[1] == [("r0", 4, 1, True), ("r1", 12, 15, False)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    reqs = make_requests([4, 14], [3, 1])
    _, steps = run(reqs, num_pages=32, page_size=16, max_num_seqs=2, budget=16, chunked=False)
    assert steps[0] == [("r0", 0, 4, True)]  # r1's 14 tokens do not fit the remaining 12
    assert steps[1] == [("r0", 4, 1, True), ("r1", 0, 14, True)]


def test_admission_is_fifo_and_bounded_by_max_num_seqs():
    reqs = make_requests([3, 3, 3, 3, 3], [4, 1, 2, 1, 1])
    _, steps = run(reqs, num_pages=32, page_size=16, max_num_seqs=2, budget=64)
    first_seen: list[str] = []
    for step in steps:
        assert len(step) <= 2
        for rid, *_ in step:
            if rid not in first_seen:
                first_seen.append(rid)
    assert first_seen == ["r0", "r1", "r2", "r3", "r4"]


def test_admission_does_not_skip_a_waiting_request_that_lacks_pages():
    # r1 needs 3 pages while r0 holds 2 of 4: r2 (1 page) must not jump ahead of r1
    reqs = make_requests([20, 40, 2], [6, 1, 1])
    _, steps = run(reqs, num_pages=4, page_size=16, max_num_seqs=3, budget=100)
    assert [rid for rid, *_ in steps[0]] == ["r0"]
    order = []
    for step in steps:
        order += [rid for rid, *_ in step if rid not in order]
    assert order == ["r0", "r1", "r2"]


def test_decode_without_free_page_preempts_most_recently_admitted():
    reqs = make_requests([7, 7], [10, 10])
    kv = KVCacheManager(num_pages=4, page_size=4, num_slots=2)
    sched = Scheduler(kv, 2, 64)
    for r in reqs:
        sched.add(r)
    a, b = reqs
    for _ in range(2):  # prefill both (2 pages each), then one decode each within those pages
        out = sched.schedule()
        assert out.requests == [a, b] and not out.preempted
        sched.complete(out, [1] * len(out.chunks), [None] * len(out.chunks), EOS)
    out = sched.schedule()  # a needs a 3rd page for position 8: none free
    assert out.preempted == [b]
    assert out.requests == [a]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.seq_slot is None
    assert b.block_table == [] and list(sched.waiting) == [b]
    assert len(b.output_token_ids) == 2  # generated tokens are kept and recomputed, not lost


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=7),
    st.integers(4, 12),
    st.sampled_from([4, 8, 16]),
    st.integers(1, 4),
    st.integers(1, 48),
)
def test_tiny_pool_preempts_and_still_generates_the_unconstrained_tokens(
    specs, num_pages, page_size, seqs, budget
):
    reqs = make_requests([p for p, _ in specs], [m for _, m in specs])
    sched, _ = run(reqs, num_pages=num_pages, page_size=page_size, max_num_seqs=seqs, budget=budget)
    expected = reference_outputs(reqs)
    for r in reqs:
        if r.finish_reason == "error":  # the sequence outgrew the whole pool
            assert page_size * num_pages < r.num_prompt_tokens + r.params.max_tokens
            assert "cache pages" in r.error
        else:
            assert r.output_token_ids == expected[r.request_id]


def test_tiny_pool_forces_preemption():
    reqs = make_requests([20, 20, 20], [30, 30, 30])
    sched, _ = run(reqs, num_pages=8, page_size=16, max_num_seqs=3, budget=64)
    assert sched.num_preemptions > 0
    assert {r.request_id: r.output_token_ids for r in reqs} == reference_outputs(reqs)


def test_sequence_outgrowing_the_whole_cache_fails_without_hanging():
    reqs = make_requests([20, 3], [50, 4])
    run(reqs, num_pages=2, page_size=16, max_num_seqs=2, budget=64)
    assert reqs[0].finish_reason == "error" and "raise num_cache_pages" in reqs[0].error
    assert reqs[1].finish_reason == "length" and len(reqs[1].output_token_ids) == 4


def test_max_model_len_caps_the_sequence():
    reqs = make_requests([10], [100])
    run(reqs, num_pages=16, page_size=16, max_num_seqs=1, budget=64, max_model_len=16)
    assert reqs[0].finish_reason == "length" and reqs[0].num_tokens == 16


def test_abort_all_finishes_everything_and_returns_the_cache():
    reqs = make_requests([20, 20, 20], [5, 5, 5])
    kv = KVCacheManager(num_pages=8, page_size=16, num_slots=2)
    sched = Scheduler(kv, 2, 64)
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert len(out.requests) == 2 and kv.num_free_pages < 8
    done = sched.abort_all("stopped")
    assert done == [reqs[0], reqs[1], reqs[2]]
    assert all(r.finish_reason == "error" and r.error == "stopped" for r in reqs)
    assert kv.num_free_pages == 8 and kv.num_free_slots == 2 and not sched.has_unfinished()
