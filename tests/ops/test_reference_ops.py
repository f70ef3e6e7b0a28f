"""Reference ops against independent computations (the HF parity tests cover them in the model)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.ops import moe, moe_paths, rope
from deepinfer_core.ops.attention import indexer_topk, sparse_attention
from deepinfer_core.ops.modes import batch_invariant_mode


def test_sparse_attention_equals_dense_masked_softmax_with_sink():
    g = torch.Generator().manual_seed(0)
    t, h, d, n = 5, 3, 8, 11
    q, pool, sinks = (
        torch.randn(t, h, d, generator=g),
        torch.randn(n, d, generator=g),
        torch.randn(h, generator=g),
    )
    idx = torch.randint(-1, n, (t, 6), generator=g)
    idx[:, 0] = 2
    out = sparse_attention(
        q, [pool[:4], pool[4:]], [idx.where(idx < 4, -1), (idx - 4).where(idx >= 4, -1)], sinks, 0.5
    )
    for i in range(t):
        keys = pool[idx[i][idx[i] >= 0]]
        for j in range(h):
            logits = torch.cat([keys @ q[i, j] * 0.5, sinks[j : j + 1]])
            p = torch.softmax(logits, 0)[:-1]
            torch.testing.assert_close(out[i, j], p @ keys, atol=1e-6, rtol=1e-5)


def test_indexer_topk_breaks_ties_toward_earlier_candidates():
    keys = torch.zeros(6, 4)  # every score is exactly 0: all tie
    cand = torch.tensor([[5, 3, 1, 0, 2, -1]])
    picked = indexer_topk(torch.randn(1, 2, 4), torch.ones(1, 2), keys, cand, 3, 1.0)
    assert picked.tolist() == [[5, 3, 1]]


def test_indexer_topk_marks_missing_candidates():
    cand = torch.tensor([[0, -1, -1, -1]])
    picked = indexer_topk(torch.randn(1, 2, 4), torch.ones(1, 2), torch.randn(3, 4), cand, 3, 1.0)
    assert picked.tolist() == [[0, -1, -1]]


def _experts_loop_oracle(x, ids, w, gate_up, down, limit):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gate_up.shape[0]:  # no such expert: no contribution
                continue
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (down[e] @ (F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)))
    return out


@pytest.mark.parametrize("grouped_mm", [True, False])
def test_moe_experts_dense_grouped_and_loop_paths_equal_the_definition(monkeypatch, grouped_mm):
    monkeypatch.setattr(moe_paths, "HAS_GROUPED_MM", grouped_mm and moe_paths.HAS_GROUPED_MM)
    g = torch.Generator().manual_seed(1)
    d, i = 16, 8
    for e in (4, 40):  # 4 experts x top-2: dense path; 40: grouped GEMM (or per-expert loop)
        x = torch.randn(7, d, generator=g)
        ids = torch.randint(0, e, (7, 2), generator=g)
        ids[0] = torch.tensor([1, 1])  # a duplicated expert adds up twice
        ids[1, 1], ids[2, 0], ids[3] = -1, e, -1  # ids outside [0, e) add nothing
        w = torch.rand(7, 2, generator=g)
        gate_up, down = torch.randn(e, 2 * i, d, generator=g), torch.randn(e, d, i, generator=g)
        want = _experts_loop_oracle(x, ids, w, gate_up, down, 3.0)
        assert not want[3].any()
        for invariant in (False, True):  # the batch-invariant mode's per-expert tiles too
            with batch_invariant_mode(invariant):
                got = moe.moe_experts(x, ids, w, gate_up, down, 3.0)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_moe_route_bias_selects_but_does_not_weight():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    w, ids = moe.moe_route(logits, bias, None, 2, "sqrtsoftplus", 1.5)
    assert sorted(ids[0].tolist()) == [0, 2]
    s = F.softplus(logits).sqrt()[0]
    expect = torch.stack([s[ids[0, 0]], s[ids[0, 1]]])
    torch.testing.assert_close(w[0], expect / expect.sum() * 1.5)


def test_rope_is_a_rotation_of_interleaved_pairs_and_inverts():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 10, generator=g)
    inv = torch.tensor([1.0, 0.1])
    cos, sin = rope.rope_cos_sin(torch.tensor([0, 1, 7]), inv, 1.0, torch.float32)
    y = rope.apply_rope(x, cos, sin)
    assert torch.equal(y[..., :6], x[..., :6])  # leading channels pass through
    ang = torch.tensor([7.0 * 1.0])
    c, s = ang.cos(), ang.sin()
    a, b = x[2, :, 6], x[2, :, 7]
    torch.testing.assert_close(y[2, :, 6], a * c - b * s)
    torch.testing.assert_close(y[2, :, 7], a * s + b * c)
    torch.testing.assert_close(rope.apply_rope(y, cos, -sin), x, atol=1e-6, rtol=1e-6)
