"""Speculative verify steps are rolled back by position alone, with no cache operation.

A verify step runs ``1+k`` tokens of a request (positions ``p..p+k``: the last sampled token
and ``k <= S`` drafts, ``S = num_spec_tokens``); the engine accepts ``p..p+a`` and runs the
next step from ``p+a+1``.  Runner A does exactly that, with draft tokens that do not match;
runner B (same weights, same ``S``) runs only the accepted tokens.  Every later step's logits
and the live cache state (the last ``W`` ring rows, the entries and indexer keys of the
windows the accepted positions closed, the buffered partial window, the last closed window's
CSA carry) must be bitwise equal.  Both runners are batch-invariant, so a key's bits do not
depend on the chunk it was computed in (B's chunks are shorter than A's verify chunks).

Cases on the built-in tiny model (window ``W = 8``; CSA ratio 4, HCA ratio 16; pages of 16)
have rejected tokens close one or more ratio-4 windows and a ratio-16 window, cross a page
boundary and wrap the window ring.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_core.config import EngineConfig, SpeculativeConfig
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.models.cache_spec import RingSpec
from deepinfer_core.models.deepseek_v4 import tiny
from deepinfer_core.ops import OpTable

W = tiny.TINY_CONFIG["sliding_window"]  # 8
SLOTS = 3
MAX_LEN = 160

Step = tuple[int, int]
"""One step of the request: ``(accepted tokens, rejected drafts)``; ``(n, 0)`` is a plain chunk."""


def _runner(path: Path, num_spec_tokens: int) -> ModelRunner:
    spec = SpeculativeConfig(max_draft_tokens=num_spec_tokens) if num_spec_tokens else None
    cfg = EngineConfig(
        model=str(path),
        dtype="float32",
        max_num_seqs=SLOTS,
        max_model_len=MAX_LEN,
        batch_invariant=True,
        speculative=spec,
    )
    return ModelRunner.load(path, cfg, OpTable.reference())


@pytest.fixture(scope="module")
def runners(tiny_dir: Path):
    """``runners(S)``: a fresh pair ``(A, B)`` of runners with ``num_spec_tokens = S``."""

    def make(num_spec_tokens: int) -> tuple[ModelRunner, ModelRunner]:
        return _runner(tiny_dir, num_spec_tokens), _runner(tiny_dir, num_spec_tokens)

    return make


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, tiny.TINY_VOCAB_SIZE, (n,), generator=g).tolist()


def _junk(seq: list[int], start: int, n: int, seed: int) -> list[int]:
    """``n`` draft tokens, each different from the true token at its position."""
    out = []
    for i, tok in enumerate(_ids(seed, n)):
        true = seq[start + i] if start + i < len(seq) else -1
        out.append(tok if tok != true else (tok + 1) % tiny.TINY_VOCAB_SIZE or 4)
    return out


def _buffer_windows(ratio: int, num_spec_tokens: int) -> int:
    return 1 + -(-num_spec_tokens // ratio)


def live_state(runner: ModelRunner, slot: int, table: list[int], end: int, window_from: int = 0) -> dict:
    """Every cache row a request at ``end`` computed positions reads later, by name:
    the ring rows of its last ``W`` positions, the entries and indexer keys of its closed
    windows, the buffer rows of its partial window and the carry of its last closed window."""
    s, p = runner.num_spec_tokens, runner.page_size
    rows = W + s
    out = {}
    for layer in runner.model.layers:
        i = layer.layer

        def get(name: str, i: int = i) -> torch.Tensor:
            return runner.cache.get(i, name)

        ring = [slot * rows + x % rows for x in range(max(window_from, end - W), end)]
        out[i, "window"] = get("window")[ring]
        for comp in (layer.attn.compressor, layer.attn.indexer):
            if comp is None:
                continue
            r, n = comp.ratio, comp.pool_name
            nb = _buffer_windows(r, s)
            closed = end // r
            entries = [table[w * r // p] * (p // r) + (w * r % p) // r for w in range(closed)]
            out[i, n] = get(n)[entries]
            buf = [slot * nb * r + x % (nb * r) for x in range(closed * r, end)]
            for b in ("buf_kv", "buf_gate"):
                out[i, f"{n}.{b}"] = get(f"{n}.{b}").view(-1, comp.width)[buf]
            if comp.overlap and closed:
                for c in ("carry_kv", "carry_gate"):
                    out[i, f"{n}.{c}"] = get(f"{n}.{c}").view(-1, r, comp.dim)[slot * nb + (closed - 1) % nb]
    return out


def assert_same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    bad = [key for key in a if not torch.equal(a[key], b[key])]
    assert not bad, f"{what}: live cache rows differ in {bad}"


def run_pair(
    a: ModelRunner,
    b: ModelRunner,
    seq: list[int],
    steps: list[Step],
    neighbour: list[int] | None = None,
    slots: tuple[int, int] = (1, 0),
    state=None,
) -> tuple[list[int], list[int]]:
    """Run ``steps`` of one request on A (with the rejected drafts) and B (without them);
    assert every step's accepted logits and the live state after it bitwise equal.

    ``neighbour``: another request (slot 2 on both) running one token per step beside it.
    ``state``: ``(runner, slot, table, end) -> {name: rows}``, the live state compared
    (default :func:`live_state`).  Returns the block tables of the request on A and B.
    """
    state = state or live_state
    total = sum(n + k for n, k in steps)
    tables = []
    for runner in (a, b):
        tables.append(runner.kv_cache.allocate_pages(runner.kv_cache.pages_needed(total)))
    n_tab = [
        r.kv_cache.allocate_pages(r.kv_cache.pages_needed(len(neighbour) if neighbour else 1)) for r in (a, b)
    ]
    done = 0
    for i, (n, k) in enumerate(steps):
        accepted = seq[done : done + n]
        drafts = _junk(seq, done + n, k, seed=1000 + i)
        logits = []
        for runner, slot, table, nt, extra in (
            (a, slots[0], tables[0], n_tab[0], drafts),
            (b, slots[1], tables[1], n_tab[1], []),
        ):
            chunks = [SeqChunk(slot, accepted + extra, done, table, sample=True, all_logits=True)]
            if neighbour is not None and i < len(neighbour):
                chunks.append(SeqChunk(2, [neighbour[i]], i, nt, sample=True))
            logits.append(runner.execute(chunks))
        la, lb = logits
        assert la.shape[0] == n + k + (neighbour is not None and i < len(neighbour))
        # the accepted positions' logits (the rejected rows have no counterpart in B)
        assert torch.equal(la[:n], lb[:n]), f"step {i} (start {done}): logits differ"
        if neighbour is not None and i < len(neighbour):
            assert torch.equal(la[-1], lb[-1]), f"step {i}: the neighbour's logits differ"
        done += n
        assert_same_state(
            state(a, slots[0], tables[0], done),
            state(b, slots[1], tables[1], done),
            f"after step {i}",
        )
        if neighbour is not None:
            m = min(i + 1, len(neighbour))
            assert_same_state(state(a, 2, n_tab[0], m), state(b, 2, n_tab[1], m), f"neighbour, step {i}")
    return tables[0], tables[1]


def _prefill(p: int, chunk: int = 16) -> list[Step]:
    return [(min(chunk, p - s), 0) for s in range(0, p, chunk)]


# (S, p, k, a): the verify step runs p..p+k and accepts p..p+a
CASES = {
    # rejected 31..34 close CSA window 7 and HCA window 1 (the end of page 1), cross page 2
    "close_r4_and_r16_page_end": (4, 30, 4, 0),
    # accepted 13, 14 stay buffered; rejected 15..18 close window 3 and HCA window 0, cross a page
    "accepted_part_of_closed_window": (5, 13, 5, 1),
    # rejected 58..65 close CSA windows 14 and 15 and HCA window 3, cross page 4, wrap the ring
    "close_two_r4_windows": (8, 57, 8, 0),
    # accepted 60, 61 of window 15, which rejected 62, 63 close; the ring wraps at 64
    "accepted_half_window": (8, 58, 7, 3),
    # rejected 46..56 close CSA windows 11..13 and HCA window 2 (page 2's end): nb = 5 and 2
    "close_many_windows": (16, 40, 16, 5),
    "fewer_drafts_than_S": (3, 22, 2, 1),
    "all_accepted": (4, 30, 4, 4),
    "before_window_fills": (2, 5, 2, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rolled_back_verify_step_equals_accepted_tokens_only(runners, case):
    s, p, k, a = CASES[case]
    a_runner, b_runner = runners(s)
    seq = _ids(7, p + a + 1 + 16)
    # a second verify step after the rollback, then plain decode steps
    steps = _prefill(p) + [(a + 1, k - a), (1, 0), (1, 0), (2, s - 1), (1, 0), (1, 0)]
    run_pair(a_runner, b_runner, seq, steps)


def test_repeated_verify_steps_beside_another_request(runners):
    """Twelve verify steps in a row with random acceptance, another request decoding in the
    same steps: each step's accepted logits and both requests' state stay bitwise equal."""
    s = 6
    a_runner, b_runner = runners(s)
    g = torch.Generator().manual_seed(3)
    verify = [(int(n) + 1, s - int(n)) for n in torch.randint(0, s + 1, (12,), generator=g)]
    steps = _prefill(21, chunk=9) + verify + [(1, 0)] * 3
    seq = _ids(8, sum(n for n, _ in steps))
    run_pair(a_runner, b_runner, seq, steps, neighbour=_ids(9, len(steps)), slots=(0, 1))


def test_prefix_hit_after_a_rolled_back_step(runners, tiny_dir):
    """Pages completed after a rolled-back verify step serve a prefix hit exactly: the hit
    (cached entries, indexer keys, page-end carry snapshot) gives the same logits as one
    after a run without rejected drafts, and matches a cold run."""
    s, hit = 4, 64
    a_runner, b_runner = runners(s)
    seq = _ids(11, 72)
    # rejected 61..64: junk at 61 (first half of window 15, page 3's carry snapshot) and in
    # the windows 15 / HCA 3 that end page 3; the decodes after the rollback close them again.
    # The carry restored at the hit goes to index (64//4 - 1) % nb = 1 of nb = 2.
    steps = _prefill(60) + [(1, s)] + [(1, 0)] * 6
    tables = run_pair(a_runner, b_runner, seq, steps)
    second = seq[:hit] + _ids(12, 10)
    start = hit - a_runner.replay_tail  # SWA bounded replay: window keys rebuilt from here
    assert start > 0
    logits = []
    for runner, table in zip((a_runner, b_runner), tables, strict=True):
        kv = runner.kv_cache
        t2 = table[: hit // runner.page_size] + kv.allocate_pages(kv.pages_needed(len(second) + 2) - 4)
        out = [
            runner.execute(
                [SeqChunk(2, second[start:], start, t2, all_logits=True, window_from=start, cached_until=hit)]
            )
        ]
        for j, tok in enumerate(_ids(13, 2)):
            out.append(runner.execute([SeqChunk(2, [tok], len(second) + j, t2, window_from=start)]))
        logits.append(torch.cat(out))
    assert torch.equal(logits[0], logits[1])
    cold = _runner(tiny_dir, s)
    kv = cold.kv_cache
    t3 = kv.allocate_pages(kv.pages_needed(len(second) + 2))
    want = [cold.execute([SeqChunk(0, second, 0, t3, all_logits=True)])[hit:]]
    for j, tok in enumerate(_ids(13, 2)):
        want.append(cold.execute([SeqChunk(0, [tok], len(second) + j, t3)]))
    # the replayed positions before the hit see a truncated window; those from it on are exact
    torch.testing.assert_close(logits[0][hit - start :], torch.cat(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize("s", [0, 1, 4, 5, 16])
def test_cache_geometry(runners, s):
    """``W + S`` ring rows, ``nb = 1 + ceil(S/r)`` buffered windows and carries per slot;
    with ``S = 0`` the plain layout."""
    runner = runners(s)[0]
    slots, pages = SLOTS + 1, runner.kv_cache.num_pages + 1  # with the trash slot / page
    specs = runner.model.cache_specs("auto", num_spec_tokens=s)
    assert runner.num_spec_tokens == s
    for layer, layer_specs in zip(runner.model.layers, specs, strict=True):
        ring = next(spec for spec in layer_specs if isinstance(spec, RingSpec))
        assert (ring.width, ring.spare, ring.rows) == (W, s, W + s)
        assert runner.cache.get(layer.layer, "window").shape[0] == slots * (W + s)
        for comp in (layer.attn.compressor, layer.attn.indexer):
            if comp is None:
                continue
            r, n, nb = comp.ratio, comp.pool_name, _buffer_windows(comp.ratio, s)
            assert nb == (1 if s == 0 else 1 + (s + r - 1) // r)
            assert runner.cache.get(layer.layer, n + ".buf_kv").shape == (slots, nb * r, comp.width)
            if comp.overlap:
                assert runner.cache.get(layer.layer, n + ".carry_gate").shape == (slots, nb, r, comp.dim)
                assert runner.cache.get(layer.layer, n + ".page_carry_kv").shape == (pages, r, comp.dim)


def test_graph_decode_steps_between_verify_steps_equal_eager(runners):
    """Decode steps through the fixed-shape graph path (emulated on CPU: bucket padding on the
    trash slot / page) between rolled-back verify steps give the eager runner's bits."""
    from deepinfer_core.engine.graphs import EmulatedGraph

    s = 4
    eager, graphed = runners(s)
    assert graphed.capture_graphs(EmulatedGraph) is None
    replays = []
    for b, graph in graphed.graph_manager.graphs("decode").items():
        graph.replay = lambda inner=graph.replay, b=b: replays.append(b) or inner()
    seqs = [_ids(20 + i, 60) for i in range(2)]
    tables = {}
    for runner in (eager, graphed):
        tables[runner] = [runner.kv_cache.allocate_pages(runner.kv_cache.pages_needed(70)) for _ in seqs]
    # per step, per request: (accepted tokens, rejected drafts)
    schedule = [[(19, 0), (26, 0)], [(1, 3), (2, 2)], [(1, 0), (1, 0)], [(1, 0), (1, 0)], [(3, 1), (1, 4)]]
    schedule += [[(1, 0), (1, 0)]] * 4
    done = [0, 0]
    for j, step in enumerate(schedule):
        logits = []
        for runner in (eager, graphed):
            chunks = []
            for i, (n, k) in enumerate(step):
                ids = seqs[i][done[i] : done[i] + n] + _junk(seqs[i], done[i] + n, k, seed=50 + j)
                chunks.append(SeqChunk(i, ids, done[i], tables[runner][i], all_logits=k > 0 or n > 1))
            logits.append(runner.execute(chunks))
        assert torch.equal(logits[0], logits[1])
        done = [d + n for d, (n, _) in zip(done, step, strict=True)]
        for i in range(2):
            assert_same_state(
                live_state(eager, i, tables[eager][i], done[i]),
                live_state(graphed, i, tables[graphed][i], done[i]),
                f"request {i} at {done[i]}",
            )
    assert replays.count(2) == 6  # every one-token step of both requests ran the graph
