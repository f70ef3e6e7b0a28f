"""``rejection`` acceptance is distribution-exact: the first token a verify step emits is
distributed as the target's filtered distribution ``p``, whatever the drafter's ``q``
(one-hot drafts or a sampled draft distribution) — a chi-square test over many seeds on a
6-token vocabulary, through the sampler's own distribution and counter-based keys."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.sampling.batch import SamplingBatch
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.random import row_keys
from deepinfer_core.sampling.sampler import Sampler
from deepinfer_core.speculative.verify import accept_rejection, acceptance_uniform, residual_draws

V = 6
TRIALS = 6000
# the 0.999 quantiles of the chi-square distribution by degrees of freedom
CHI2_P999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


class _Row:
    def __init__(self, params, seed):
        self.params, self.sampling_seed = params, seed
        self.prompt_token_ids, self.output_token_ids = [1], []

    @property
    def num_tokens(self):
        return 1


def _first_emitted(logits, params, q):
    """The first token of a one-draft verify for ``TRIALS`` seeds (one row per seed)."""
    rows = [_Row(params, seed) for seed in range(TRIALS)]
    positions = [7] * TRIALS
    batch = SamplingBatch.from_requests(rows, [], positions)
    raw = logits.expand(TRIALS, V).contiguous()
    probs = Sampler().distribution(raw, batch.prepare("cpu", V))
    g = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q.expand(TRIALS, V), 1, generator=g).squeeze(1)
    k1, k2 = row_keys([r.sampling_seed for r in rows], positions)
    resid = residual_draws(probs, drafts, q.expand(TRIALS, V), torch.tensor(k1), torch.tensor(k2))
    out = []
    for i in range(TRIALS):
        d = int(drafts[i])
        u = acceptance_uniform(rows[i].sampling_seed, positions[i])
        a = accept_rejection([float(probs[i, d])], [float(q[d])], [u])
        out.append(d if a else int(resid[i]))
    return torch.bincount(torch.tensor(out), minlength=V).double(), probs[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.9),
    ],
    ids=["plain", "top_k", "top_p"],
)
@pytest.mark.parametrize("draft", ["one_hot", "sampled", "disjoint"])
def test_rejection_sampling_emits_the_target_distribution(params, draft):
    logits = torch.tensor([[1.5, 0.3, -0.4, 0.9, 0.0, -2.0]])
    if draft == "one_hot":
        q = torch.zeros(V, dtype=torch.float64)
        q[3] = 1.0
    elif draft == "sampled":
        q = torch.softmax(torch.tensor([0.1, 1.2, 0.5, -0.3, 0.8, 0.2], dtype=torch.float64), 0)
    else:  # the drafter proposes tokens the target (top-k) may never emit
        q = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    counts, p = _first_emitted(logits, params, q)
    support = p > 0
    expected = p * TRIALS
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    df = int(support.sum()) - 1
    assert df >= 1
    assert chi2 < CHI2_P999[df], (chi2, counts.tolist(), expected.tolist())


@pytest.mark.slow
def test_greedy_rows_accept_exactly_the_argmax():
    """With ``temperature=0`` the distribution is one-hot: rejection acceptance is ``match``."""
    logits = torch.tensor([[0.1, 2.0, 0.3, 0.0, -1.0, 0.5]])
    q = torch.zeros(V, dtype=torch.float64)
    for d in range(V):
        q.zero_()
        q[d] = 1.0
        counts, _ = _first_emitted(logits, SamplingParams(temperature=0.0), q)
        assert counts.tolist() == [0, TRIALS, 0, 0, 0, 0][:V]
