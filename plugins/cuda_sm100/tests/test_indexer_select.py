"""``indexer_topk``'s exact ``torch.topk`` selection and the measured choice of the selection
path (:mod:`deepinfer_cuda_sm100.indexer_select`).

The ``torch`` path against the definition (a stable descending sort: equal scores rank by
column, ``-inf`` candidates are ``-1``) on scores with many ties, negative values and ``-inf``
holes, for explicit, paged and absent candidate lists; its 64-bit keys order exactly as the
scores do.  The interpreter report of ``test_attention_kernels.py`` checks it against the
Triton radix select on the conformance cases; the GPU tier runs the op through both paths.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

from deepinfer_cuda_sm100 import kernel_choice  # noqa: E402
from deepinfer_cuda_sm100.indexer_select import (  # noqa: E402
    OP,
    PATHS,
    choose_path,
    ordered_keys,
    select_topk_torch,
)

from deepinfer_core.ops.attention import PagedIndex  # noqa: E402


def _scores(t: int, c: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-4, 5, (t, c), generator=g).float() * 0.5  # many ties, negatives, zeros
    s[torch.rand(t, c, generator=g) < 0.2] = float("-inf")  # invalid candidates
    s[0, -5:] = torch.tensor([3.0e38, -3.0e38, 1e-45, -1e-45, 0.0])  # extremes and subnormals
    return s


def _definition(scores: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    cols = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    picked = rows.gather(1, cols)
    return picked.masked_fill(scores.gather(1, cols) == float("-inf"), -1)


def test_keys_order_like_the_scores_with_ties_to_the_earlier_column():
    s = _scores(3, 50)
    keys = ordered_keys(s)
    for r in range(3):
        by_key = torch.sort(keys[r], descending=True).indices
        by_score = torch.sort(s[r], descending=True, stable=True).indices
        assert torch.equal(by_key, by_score)


@pytest.mark.parametrize("k", [1, 7, 40, 64])
def test_torch_path_is_the_stable_descending_order(k):
    t, c = 5, 48
    s = _scores(t, c, seed=k)
    cols = torch.arange(c).expand(t, c)
    assert torch.equal(select_topk_torch(s, k, None), _definition(s, min(k, c), cols))
    g = torch.Generator().manual_seed(k)
    explicit = torch.randint(0, 1000, (t, c), generator=g)
    assert torch.equal(select_topk_torch(s, k, explicit), _definition(s, min(k, c), explicit))
    epp, pages = 8, c // 8
    table = torch.randperm(t * pages, generator=g).view(t, pages)
    paged = PagedIndex(table, torch.arange(t), torch.full((t,), c), epp, c)
    entries = table.repeat_interleave(epp, dim=1) * epp + torch.arange(c) % epp
    assert torch.equal(select_topk_torch(s, k, paged), _definition(s, min(k, c), entries))


def test_the_choice_keeps_triton_off_the_gpu_and_where_unmeasured():
    s = _scores(4, 64)
    assert choose_path(s, None) == "triton"
    points = (
        kernel_choice.Point(OP, "paged", "float32", 0, 0, 128, 262144, {"triton": 2.0, "torch": 1.0}),
        kernel_choice.Point(OP, "paged", "float32", 0, 0, 8192, 2048, {"triton": 1.0, "torch": 2.0}),
    )

    def pick(t, c, kind="paged"):
        return kernel_choice.choose(OP, kind, "float32", 0, 0, t, c, "sm90", PATHS, points=points)

    assert (pick(128, 200000), pick(8192, 4096), pick(128, 262144, "rows")) == ("torch", "triton", "triton")
