"""Penalty helpers: batched token counts against a direct count."""

from __future__ import annotations

import torch

from deepinfer_core.sampling.penalties import apply_allowed_bias_bans, token_counts


def test_token_counts_match_python_counts_with_ragged_rows():
    rows = [[3, 3, 1, 0, 3], [], [7], [2, 2]]
    counts = token_counts(rows, 8, "cpu")
    assert counts.shape == (4, 8)
    for i, r in enumerate(rows):
        assert counts[i].tolist() == [r.count(t) for t in range(8)]


def test_processing_does_not_modify_the_input():
    logits = torch.zeros(1, 4)
    out = apply_allowed_bias_bans(logits, [[1]], [{1: 2.0}], [[]])
    assert logits.tolist() == [[0.0] * 4] and out[0, 1].item() == 2.0
