"""The batched sampler against direct computations."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.sampling.sampler import (
    Sampler,
    SamplingBatch,
    derive_seed,
    make_generator,
    top_k_top_p_keep,
)


def batch(n, temperature=1.0, top_p=1.0, top_k=0, seeds=None, logprobs=None):
    seeds = seeds if seeds is not None else list(range(n))
    return SamplingBatch(
        temperatures=[temperature] * n if not isinstance(temperature, list) else temperature,
        top_ps=[top_p] * n if not isinstance(top_p, list) else top_p,
        top_ks=[top_k] * n if not isinstance(top_k, list) else top_k,
        generators=[make_generator(s) for s in seeds],
        num_logprobs=[logprobs] * n if not isinstance(logprobs, list) else logprobs,
    )


def brute_force_keep(row: list[float], top_k: int, top_p: float) -> set[int]:
    """Top-k then top-p over the renormalised top-k distribution, one token at a time in float64."""
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
    return keep


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


def test_top_k_top_p_mask_uses_each_rows_own_parameters():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    keep = top_k_top_p_keep(logits, torch.tensor([2, 0, 10]), torch.tensor([1.0, 0.3, 0.8]))
    for i, (k, p) in enumerate([(2, 1.0), (0, 0.3), (10, 0.8)]):
        assert set(keep[i].nonzero().squeeze(1).tolist()) == brute_force_keep(
            logits[i].double().tolist(), k, p
        )


def test_draws_follow_the_tempered_distribution():
    """Chi-square-style check: 20k draws of one row vs softmax(logits / T), each count within 5 sigma."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])
    temperature, draws = 0.7, 20_000
    expected = torch.softmax(logits[0].double() / temperature, -1)
    gen = make_generator(123)
    sampler = Sampler()
    counts = torch.zeros(6, dtype=torch.float64)
    rows = logits.expand(draws, 6).contiguous()
    b = SamplingBatch([temperature] * draws, [1.0] * draws, [0] * draws, [gen] * draws, [None] * draws)
    for t in sampler(rows, b).token_ids.tolist():
        counts[t] += 1
    sigma = (draws * expected * (1 - expected)).sqrt()
    assert ((counts - draws * expected).abs() <= 5 * sigma + 1).all(), (counts / draws, expected)


def test_draws_never_leave_the_top_k_top_p_set_and_cover_it():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, 2.7, -5.0, 1.0]])
    n = 4000
    rows = logits.expand(n, 8).contiguous()
    gen = make_generator(5)
    out = Sampler()(rows, SamplingBatch([1.0] * n, [0.6] * n, [4] * n, [gen] * n, [None] * n))
    allowed = brute_force_keep(logits[0].double().tolist(), 4, 0.6)
    assert set(out.token_ids.tolist()) == allowed


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    target = torch.randn(1, 300)
    sampler = Sampler()
    gen_alone = make_generator(42)
    seq_alone = [
        sampler(target, SamplingBatch([0.9], [0.95], [50], [gen_alone], [None])).token_ids.item()
        for _ in range(10)
    ]
    gen_mixed = make_generator(42)
    others = [make_generator(s) for s in (1, 2, 3)]
    seq_mixed = []
    for _step in range(10):
        noise = torch.randn(3, 300)
        logits = torch.cat(
            [noise[:2], target, noise[2:]]
        )  # target is row 2 of 4, with other params around it
        b = SamplingBatch(
            [1.5, 0.0, 0.9, 0.3],
            [0.5, 1.0, 0.95, 1.0],
            [0, 0, 50, 3],
            [others[0], None, gen_mixed, others[1]],
            [None, 2, None, None],
        )
        seq_mixed.append(sampler(logits, b).token_ids[2].item())
    assert seq_mixed == seq_alone


def test_same_seed_reproduces_and_different_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform: 20 draws collide by chance with negligible probability
    sampler = Sampler()

    def draws(seed):
        g = make_generator(seed)
        return [
            sampler(logits, SamplingBatch([1.0], [1.0], [0], [g], [None])).token_ids.item() for _ in range(20)
        ]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_logprobs_are_raw_log_softmax_topk_plus_sampled_token():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 30, generator=g)
    out = Sampler()(logits, batch(3, temperature=[0.0, 2.0, 1.0], top_k=[0, 2, 0], logprobs=[3, 0, None]))
    raw = torch.log_softmax(logits.double(), -1)
    # row 0: greedy, top-3 includes the sampled argmax
    top3 = raw[0].topk(3).indices.tolist()
    assert set(out.logprobs[0]) == set(top3)
    for tok, lp in out.logprobs[0].items():
        assert lp == pytest.approx(raw[0, tok].item(), abs=1e-5)
    # row 1: logprobs=0 -> only the sampled token, from the untempered distribution
    tok = out.token_ids[1].item()
    assert out.logprobs[1] == {tok: pytest.approx(raw[1, tok].item(), abs=1e-5)}
    assert out.logprobs[2] is None


def test_derive_seed_separates_neighbouring_seeds():
    seeds = {derive_seed(b, i) for b in range(50) for i in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(3, 4) == derive_seed(3, 4)
