"""The batched sampler against direct computations."""

from __future__ import annotations

import math
import types

import pytest
import torch

from deepinfer_core.sampling.batch import SamplingBatch, min_tokens_banned
from deepinfer_core.sampling.filters import min_p_keep, top_k_top_p_keep
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.random import derive_seed
from deepinfer_core.sampling.sampler import Sampler


def batch(n, temperature=1.0, top_p=1.0, top_k=0, seeds=None, positions=None, **extra):
    def per_row(v):
        return v if isinstance(v, list) else [v] * n

    return SamplingBatch(
        temperatures=per_row(temperature),
        top_ps=per_row(top_p),
        top_ks=per_row(top_k),
        seeds=seeds if seeds is not None else list(range(n)),
        positions=positions if positions is not None else [0] * n,
        **extra,
    )


def brute_force_keep(row: list[float], top_k: int, top_p: float, min_p: float = 0.0) -> set[int]:
    """Top-k, top-p over the renormalised top-k distribution, then min-p; float64, token by token."""
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    if top_k > 0:
        order = order[:top_k]
    m = max(row[i] for i in order)
    weights = [math.exp(row[i] - m) for i in order]
    total = sum(weights)
    keep, cum = set(), 0.0
    for i, w in zip(order, weights, strict=True):
        if cum < top_p or not keep:
            keep.add(i)
        cum += w / total
    # min-p: p_i >= min_p * p_max, i.e. exp(row_i - max) >= min_p (the renormalisation cancels)
    return {i for i in keep if math.exp(row[i] - m) >= min_p}


def empirical(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """Token frequencies of ``n`` draws of one row: same seed, positions 0..n-1 (one batched call)."""
    rows = logits_row.expand(n, -1).contiguous()
    out = Sampler()(rows, batch(n, seeds=[11] * n, positions=list(range(n)), **kw))
    return torch.bincount(out.token_ids, minlength=logits_row.shape[-1]).double()


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[2, 7] = logits[2, 30] = 100.0  # tie
    out = Sampler()(logits, batch(6, temperature=0.0))
    expected = [max(range(50), key=lambda j: (logits[i, j].item(), -j)) for i in range(6)]
    assert out.token_ids.tolist() == expected
    assert out.token_ids[2].item() == 7


@pytest.mark.parametrize(
    "top_k,top_p", [(0, 0.5), (5, 1.0), (3, 0.9), (1, 1.0), (0, 1e-6), (200, 0.95), (-1, 0.7)]
)
def test_top_k_top_p_mask_matches_brute_force(top_k, top_p):
    g = torch.Generator().manual_seed(top_k + int(top_p * 1000))
    logits = torch.randn(8, 100, generator=g) * 3
    keep = top_k_top_p_keep(logits, torch.full((8,), top_k), torch.full((8,), top_p))
    for i in range(8):
        expected = brute_force_keep(logits[i].double().tolist(), top_k, top_p)
        assert set(keep[i].nonzero().squeeze(1).tolist()) == expected


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_mask_matches_brute_force(min_p):
    logits = torch.randn(6, 80, generator=torch.Generator().manual_seed(2)) * 2
    keep = min_p_keep(logits, torch.full((6,), min_p))
    for i in range(6):
        expected = brute_force_keep(logits[i].double().tolist(), 0, 1.0, min_p)
        assert set(keep[i].nonzero().squeeze(1).tolist()) == expected


def test_draws_follow_the_tempered_distribution():
    """20k draws (one seed, 20k positions) vs softmax(logits / T): each count within 5 sigma."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])
    temperature, draws = 0.7, 20_000
    expected = torch.softmax(logits[0].double() / temperature, -1)
    counts = empirical(logits, draws, temperature=temperature)
    sigma = (draws * expected * (1 - expected)).sqrt()
    assert ((counts - draws * expected).abs() <= 5 * sigma + 1).all(), (counts / draws, expected)


def test_draws_across_seeds_follow_the_filtered_renormalised_distribution():
    """Many seeds at one position, top-k + min-p filtering: the renormalised kept distribution."""
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0, 2.2, -4.0]])
    n = 20_000
    rows = logits.expand(n, -1).contiguous()
    out = Sampler()(rows, batch(n, top_k=5, seeds=list(range(n)), min_ps=[0.2] * n, positions=[7] * n))
    keep = brute_force_keep(logits[0].double().tolist(), 5, 1.0, 0.2)
    mask = torch.tensor([i in keep for i in range(8)])
    expected = torch.softmax(logits[0].double().masked_fill(~mask, float("-inf")), -1)
    counts = torch.bincount(out.token_ids, minlength=8).double()
    sigma = (n * expected * (1 - expected)).sqrt()
    assert ((counts - n * expected).abs() <= 5 * sigma + 1).all(), (counts / n, expected)
    assert set(out.token_ids.tolist()) == keep


def test_draws_never_leave_the_top_k_top_p_set_and_cover_it():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, 2.7, -5.0, 1.0]])
    counts = empirical(logits, 4000, top_p=0.6, top_k=4)
    allowed = brute_force_keep(logits[0].double().tolist(), 4, 0.6)
    assert set(counts.nonzero().squeeze(1).tolist()) == allowed


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch_or_its_row():
    torch.manual_seed(0)
    target = torch.randn(1, 300)
    sampler = Sampler()
    alone = [
        sampler(target, batch(1, 0.9, 0.95, 50, seeds=[42], positions=[p])).token_ids.item()
        for p in range(10)
    ]
    for row in range(4):
        mixed = []
        for p in range(10):
            logits = torch.randn(4, 300)
            logits[row] = target[0]
            b = batch(
                4,
                temperature=[1.5, 0.0, 0.3, 1.0],
                top_p=[0.5, 1.0, 1.0, 0.8],
                top_k=[0, 0, 3, 7],
                seeds=[1, 2, 3, 4],
                positions=[p + 5, p, 2 * p, 99],
                num_logprobs=[None, 2, None, 1],
            )
            b.temperatures[row], b.top_ps[row], b.top_ks[row] = 0.9, 0.95, 50
            b.seeds[row], b.positions[row] = 42, p
            mixed.append(sampler(logits, b).token_ids[row].item())
        assert mixed == alone


def test_same_seed_reproduces_and_different_seeds_differ():
    logits = torch.zeros(20, 1000)  # uniform: 20 draws collide by chance with negligible probability

    def draws(seed):
        return Sampler()(logits, batch(20, seeds=[seed] * 20, positions=list(range(20)))).token_ids.tolist()

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 15  # positions get different noise


def test_logprobs_are_raw_log_softmax_topk_plus_sampled_token():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 30, generator=g)
    out = Sampler()(
        logits,
        batch(
            3,
            temperature=[0.0, 2.0, 1.0],
            top_k=[0, 2, 0],
            num_logprobs=[3, 0, None],
            repetition_penalties=[1.5, 1.5, 1.5],
            prompt_token_ids=[[1, 2], [3], []],
            output_token_ids=[[4], [], []],
        ),
    )
    raw = torch.log_softmax(logits.double(), -1)  # not the penalised logits
    top3 = raw[0].topk(3).indices.tolist()
    assert set(out.logprobs[0]) == set(top3) | {out.token_ids[0].item()}
    for tok, lp in out.logprobs[0].items():
        assert lp == pytest.approx(raw[0, tok].item(), abs=1e-5)
    tok = out.token_ids[1].item()
    assert out.logprobs[1] == {tok: pytest.approx(raw[1, tok].item(), abs=1e-5)}
    assert out.logprobs[2] is None


def test_derive_seed_separates_neighbouring_seeds():
    seeds = {derive_seed(b, i) for b in range(50) for i in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(3, 4) == derive_seed(3, 4)


# ---- logit processing: against hand computations ------------------------------------------------


def test_penalties_match_a_direct_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0], [1.0, 1.0, -2.0, 4.0, -0.5, 3.0]])
    prompt = [[0, 1], [5]]
    output = [[2, 2, 3, 0], [3]]
    rep, freq, pres = [1.5, 2.0], [0.25, -0.5], [0.5, 1.0]
    b = batch(
        2,
        repetition_penalties=rep,
        frequency_penalties=freq,
        presence_penalties=pres,
        prompt_token_ids=prompt,
        output_token_ids=output,
    )
    got = Sampler().process_logits(logits, b)
    expected = logits.clone()
    for i in range(2):
        for t in range(6):
            x = expected[i, t].item()
            if t in prompt[i] or t in output[i]:
                x = x / rep[i] if x > 0 else x * rep[i]
            count = output[i].count(t)
            x -= freq[i] * count + pres[i] * (count > 0)
            expected[i, t] = x
    assert torch.allclose(got, expected)
    # row 0: token 0 (prompt and output once): 2/1.5 - 0.25 - 0.5; token 3: -3*1.5 - 0.25 - 0.5
    assert got[0, 0].item() == pytest.approx(2 / 1.5 - 0.75)
    assert got[0, 3].item() == pytest.approx(-4.5 - 0.75)


def test_allowed_ids_bias_and_min_tokens_bans():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    b = batch(
        2,
        allowed_token_ids=[[1, 2, 4], None],
        logit_bias=[{1: 10.0, 3: 5.0}, {0: -1.0}],
        banned_token_ids=[[4], [3]],
    )
    got = Sampler().process_logits(logits, b)
    inf = float("-inf")
    assert got[0].tolist() == [inf, 11.0, 2.0, inf, inf]
    assert got[1].tolist() == [-1.0, 1.0, 2.0, inf, 4.0]


def test_greedy_applies_penalties_bias_and_masks():
    logits = torch.tensor([[5.0, 4.9, 1.0, 0.0]] * 4)
    b = batch(
        4,
        temperature=0.0,
        repetition_penalties=[1.0, 2.0, 1.0, 1.0],
        presence_penalties=[0.0] * 4,
        frequency_penalties=[0.0] * 4,
        prompt_token_ids=[[0]] * 4,
        output_token_ids=[[]] * 4,
        logit_bias=[None, None, {2: 4.5}, None],
        allowed_token_ids=[None, None, None, [3]],
    )
    # plain argmax; repetition pushes token 0 to 2.5; bias lifts token 2 to 5.5; only token 3 allowed
    assert Sampler()(logits, b).token_ids.tolist() == [0, 1, 2, 3]


def test_sampled_rows_only_draw_allowed_tokens():
    logits = torch.zeros(500, 50)
    counts = torch.bincount(
        Sampler()(
            logits, batch(500, positions=list(range(500)), allowed_token_ids=[[3, 17, 40]] * 500)
        ).token_ids,
        minlength=50,
    )
    assert set(counts.nonzero().squeeze(1).tolist()) == {3, 17, 40}


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    p = SamplingParams(min_tokens=3, stop_token_ids=[7])
    assert min_tokens_banned(p, 0, [2]) == [2, 7]
    assert min_tokens_banned(p, 2, [2]) == [2, 7]
    assert min_tokens_banned(p, 3, [2]) == []
    assert min_tokens_banned(p.replace(ignore_eos=True), 1, [2]) == [7]


class _Row:
    def __init__(self, params, prompt, output, seed=0):
        self.params, self.prompt_token_ids, self.output_token_ids = params, prompt, output
        self.sampling_seed = seed

    @property
    def num_tokens(self):
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def test_batch_from_requests_positions_bans_and_penalty_inputs():
    rows = [
        _Row(SamplingParams(min_tokens=2, seed=1), [5, 6], [9], seed=77),
        _Row(SamplingParams(presence_penalty=0.5, temperature=0), [1], [], seed=3),
    ]
    b = SamplingBatch.from_requests(rows, eos_token_ids=[0])
    assert b.positions == [3, 1] and b.seeds == [77, 3]
    assert b.banned_token_ids == [[0], []]  # row 1 has min_tokens=0
    assert b.presence_penalties == [0.0, 0.5] and b.output_token_ids == [[9], []]
    assert SamplingBatch.from_requests(rows[:1], [0]).presence_penalties is None  # no penalty work


def test_token_bitmask_roundtrip_and_unpack_match_the_id_sets():
    from deepinfer_core.sampling.penalties import bitmask_has, bitmask_of, bitmask_words, unpack_bitmask

    vocab = 70  # three words, the last one partial
    g = torch.Generator().manual_seed(0)
    sets = [sorted(set(torch.randint(0, vocab, (n,), generator=g).tolist())) for n in (1, 5, 40)]
    sets.append([31, 63, 69])  # the sign bit of a word, and the last id
    rows = torch.stack([bitmask_of(s, vocab) for s in sets])
    assert rows.shape == (4, bitmask_words(vocab)) and rows.dtype == torch.int32
    dense = unpack_bitmask(rows, vocab)
    for i, s in enumerate(sets):
        assert dense[i].nonzero().flatten().tolist() == s
        assert [t for t in range(vocab) if bitmask_has(rows[i], t)] == s


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_token_bitmask_restricts_rows_and_leaves_full_rows_alone(temperature):
    """Rows with a bitmask sample only its tokens (greedy or drawn); an all-ones row samples as
    without a mask, bit for bit; the bitmask and allowed_token_ids intersect."""
    from deepinfer_core.sampling.penalties import bitmask_of, bitmask_words

    vocab, rows = 50, 4
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=g)
    allowed = [[7, 8, 31, 49], None, [2, 33], [5, 6, 7]]
    mask = torch.full((rows, bitmask_words(vocab)), -1, dtype=torch.int32)
    for i, a in enumerate(allowed):
        if a is not None:
            mask[i] = bitmask_of(a, vocab)

    def batch(bitmask, allowed_ids=None):
        return SamplingBatch(
            temperatures=[temperature] * rows,
            top_ps=[1.0] * rows,
            top_ks=[0] * rows,
            seeds=[11 + i for i in range(rows)],
            positions=[5] * rows,
            allowed_token_ids=allowed_ids,
            token_bitmask=bitmask,
        )

    sampler = Sampler()
    got = sampler(logits, batch(mask)).token_ids.tolist()
    plain = sampler(logits, batch(None)).token_ids.tolist()
    for i, a in enumerate(allowed):
        assert got[i] == plain[i] if a is None else got[i] in a
    both = sampler(logits, batch(mask, [[8, 49], None, [2], None])).token_ids.tolist()
    assert both[0] in (8, 49) and both[2] == 2
    with pytest.raises(ValueError, match="token_bitmask has shape"):
        sampler(logits, batch(mask[:, :1]))


def test_plain_greedy_only_where_no_stage_changes_the_logits():
    """``SamplingTensors.plain_greedy``: every row greedy and no mask, bias, ban or penalty."""
    from deepinfer_core.sampling.batch import SamplingBatch

    def prep(*params, outputs=()):
        rows = [
            types.SimpleNamespace(
                params=p, sampling_seed=1, prompt_token_ids=[1, 2], output_token_ids=list(outputs)
            )
            for p in params
        ]
        return SamplingBatch.from_requests(rows, [0], [3] * len(rows)).prepare(torch.device("cpu"), 16)

    greedy = SamplingParams(temperature=0.0)
    assert prep(greedy, greedy).plain_greedy
    assert not prep(greedy, SamplingParams(temperature=0.7, seed=1)).plain_greedy
    assert not prep(SamplingParams(temperature=0.0, presence_penalty=0.5)).plain_greedy
    assert not prep(SamplingParams(temperature=0.0, logit_bias={3: 1.0})).plain_greedy
    assert not prep(SamplingParams(temperature=0.0, min_tokens=4)).plain_greedy  # EOS banned so far
    assert prep(SamplingParams(temperature=0.0, min_tokens=2), outputs=(5, 6)).plain_greedy
