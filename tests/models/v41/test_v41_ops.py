"""DeepSeek-V4.1's extension ops (``deepseek_v41.*``): contract semantics, conformance, batch invariance."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.models.deepseek_v41 import ops as v41_ops
from deepinfer_core.ops import OpTable, all_ops
from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.testing import check_backend
from tests.models.v41.oracle import fp4_qdq, fp8_qdq

NAMES = ("hc_mix", "hc_collapse", "candidate_blocks", "kv_qdq")


def test_the_ops_join_the_contract_namespaced_and_conform():
    ops = all_ops()
    for name in NAMES:
        assert f"deepseek_v41.{name}" in ops and ops[f"deepseek_v41.{name}"].doc
    report = check_backend(
        "reference", dtypes=(torch.float32, torch.bfloat16), ops=[f"deepseek_v41.{n}" for n in NAMES]
    )
    assert report.passed, report.summary()
    table = OpTable.reference()
    assert table["deepseek_v41.hc_mix"] is v41_ops.hc_mix.__wrapped__ or callable(
        table["deepseek_v41.hc_mix"]
    )
    assert v41_ops.op(table, "kv_qdq") is table["deepseek_v41.kv_qdq"]


@pytest.mark.parametrize(
    "fmt, block, oracle",
    [
        ("fp8_ue8m0", 32, lambda x: fp8_qdq(x, 32)),
        ("fp4_ue8m0", 32, lambda x: fp4_qdq(x, 32, False)),
        ("fp4_e4m3", 16, lambda x: fp4_qdq(x, 16, True)),
    ],
)
def test_kv_qdq_equals_the_oracle_bitwise_with_ties_and_extremes(fmt, block, oracle):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-8, 3, 64).view(64, 1)
    x[0] = 0.0
    # exact e2m1 ties (0.25, 0.75, ..., 5) and e4m3 halfway points, scaled so the block max is 6
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 16)
    x[1] = ties * torch.where(torch.arange(128) % 2 == 0, 1.0, -1.0)
    x[2, :] = 1.0 + 2.0**-4  # halfway between two e4m3 values (ties to even)
    ours = v41_ops.kv_qdq(x, fmt, block)
    assert torch.equal(ours, oracle(x))
    assert torch.equal(v41_ops.kv_qdq(x.bfloat16(), fmt, block), oracle(x.bfloat16()))
    # rows are independent; with power-of-two scales a projection onto the format
    assert torch.equal(v41_ops.kv_qdq(x[5:9], fmt, block), ours[5:9])
    if fmt.endswith("ue8m0"):
        assert torch.equal(v41_ops.kv_qdq(ours, fmt, block), ours)


def test_kv_qdq_builds_no_tensor_from_host_data(monkeypatch):
    """``kv_qdq`` runs in every V4.1 step: built from elementwise ops and scalars only (no
    ``torch.tensor`` of host data, which a CUDA graph cannot capture), with the same values."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3
    formats = (("fp8_ue8m0", 32), ("fp4_ue8m0", 32), ("fp4_e4m3", 16))
    want = [v41_ops.kv_qdq(x, f, b) for f, b in formats]

    def host_tensor(*args, **kwargs):
        raise AssertionError("kv_qdq built a tensor from host data")

    monkeypatch.setattr(torch, "tensor", host_tensor)
    for (f, b), w in zip(formats, want, strict=True):
        assert torch.equal(v41_ops.kv_qdq(x, f, b), w)


def test_kv_qdq_skips_shapes_that_are_not_whole_blocks():
    x = torch.randn(3, 24)
    assert v41_ops.kv_qdq(x, "fp8_ue8m0", 32) is x and v41_ops.kv_qdq(x, "fp4_e4m3", 16) is x


def _brute_candidates(scores: torch.Tensor, count: int, nb: int, bs: int) -> list[int]:
    """Kept entry columns of one query, by the contract's words."""
    blocks = -(-len(scores) // bs)
    best = []
    for b in range(blocks):
        cols = [c for c in range(b * bs, min((b + 1) * bs, len(scores))) if c < count]
        if not cols:
            continue
        score = float("inf") if count - 1 in cols else max(float(scores[c]) for c in cols)
        best.append((-score, b))
    kept = sorted(b for _, b in sorted(best)[:nb])
    return [c for b in kept for c in range(b * bs, (b + 1) * bs) if c < count]


def test_candidate_blocks_keep_the_best_blocks_and_pin_the_newest():
    g = torch.Generator().manual_seed(3)
    t, h, d, n = 7, 8, 16, 40
    q, w, keys = (
        torch.randn(t, h, d, generator=g),
        torch.randn(t, h, generator=g),
        torch.randn(n, d, generator=g),
    )
    table = torch.randperm(10, generator=g).view(1, -1)  # 10 pages of 4 entries, shuffled
    counts = torch.tensor([0, 1, 5, 13, 21, 33, 40])
    entries = PagedIndex(table, torch.zeros(t, dtype=torch.long), counts, 4, 40)
    out = v41_ops.candidate_blocks(q, w, keys, entries, 3, 4, d**-0.5)
    assert out.shape == (t, 12)
    rows = entries.rows()
    kf = keys[rows.clamp(min=0)]
    scores = (torch.einsum("thd,tcd->thc", q, kf).relu() * d**-0.5 * w[:, :, None]).sum(1)
    for i in range(t):
        want = [int(rows[i, c]) for c in _brute_candidates(scores[i], int(counts[i]), 3, 4)]
        got = [int(r) for r in out[i] if r >= 0]
        assert got == want, i
    with batch_invariant_mode():
        assert torch.equal(v41_ops.candidate_blocks(q, w, keys, entries, 3, 4, d**-0.5), out)
        # a query's candidates do not depend on the other queries of the call
        alone = v41_ops.candidate_blocks(
            q[4:5], w[4:5], keys, entries.select(torch.tensor([4])), 3, 4, d**-0.5
        )
        assert torch.equal(alone, out[4:5])


def test_hc_mix_collapses_with_the_previous_pre_and_is_batch_invariant():
    g = torch.Generator().manual_seed(5)
    t, n, d = 9, 4, 16
    streams = torch.randn(t, n, d, generator=g)
    fn, base, scale = (
        torch.randn((2 + n) * n, n * d, generator=g) * 0.1,
        torch.randn((2 + n) * n, generator=g),
        1 + 0.1 * torch.randn(3, generator=g),
    )
    prev = torch.rand(t, n, generator=g)
    pre, post, comb, collapsed = v41_ops.hc_mix(streams, prev, fn, base, scale, 1e-20, 1e-6, 20)
    assert torch.allclose(collapsed, (prev[..., None] * streams).sum(1))
    assert torch.allclose(comb.sum(-2), torch.ones(t, n), atol=1e-5)  # doubly stochastic
    assert torch.allclose(comb.sum(-1), torch.ones(t, n), atol=1e-3)
    assert bool((post > 0).all() and (post < 2).all() and (pre > 0).all())
    # its own pre is the next site's: collapsing with it is hc_collapse
    assert torch.equal(
        v41_ops.hc_collapse(streams, pre), v41_ops.hc_mix(streams, pre, fn, base, scale, 1e-20, 1e-6, 20)[3]
    )
    with batch_invariant_mode():
        full = v41_ops.hc_mix(streams, prev, fn, base, scale, 1e-20, 1e-6, 20)
        part = v41_ops.hc_mix(streams[2:3], prev[2:3], fn, base, scale, 1e-20, 1e-6, 20)
    for a, b in zip(full, part, strict=True):
        assert torch.equal(a[2:3], b)


# row-indexed arguments of each batch-invariant op (the others are shared by every row)
ROW_ARGS = {
    "hc_mix": (0, 1),
    "hc_collapse": (0, 1),
    "candidate_blocks": (0, 1, 3),
    "engram_hash": (0,),
    "engram_rows": (1,),
    "engram_mix": (0, 1),
}


@pytest.mark.parametrize("name", sorted(ROW_ARGS))
def test_every_batch_invariant_op_gives_a_row_the_same_bits_alone(name):
    spec = all_ops()[f"deepseek_v41.{name}"]
    assert spec.batch_invariant
    for args, kwargs in spec.sample_cases(torch.Generator().manual_seed(7), torch.float32):
        with batch_invariant_mode():
            full = spec.reference(*args, **kwargs)
            outs = full if isinstance(full, tuple) else (full,)
            for i in range(outs[0].shape[0]):
                one = list(args)
                for p in ROW_ARGS[name]:
                    a = args[p]
                    one[p] = a.select(torch.tensor([i])) if isinstance(a, PagedIndex) else a[i : i + 1]
                alone = spec.reference(*one, **kwargs)
                for o, a in zip(outs, alone if isinstance(alone, tuple) else (alone,), strict=True):
                    assert torch.equal(o[i : i + 1], a), (name, i)


def test_batch_invariant_ops_are_exactly_those_checked():
    marked = {
        n.split(".", 1)[1]
        for n, s in all_ops().items()
        if n.startswith("deepseek_v41.") and s.batch_invariant
    }
    assert marked == set(ROW_ARGS)
