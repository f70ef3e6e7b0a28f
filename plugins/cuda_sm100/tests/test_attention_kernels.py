"""The attention kernels of ``cuda_sm100`` (``sparse_attention``, ``indexer_topk``) against the
reference ops.

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported, and must not
leak into this pytest process (other tests here may import Triton compiled, or run on a GPU),
so the interpreter checks run in a child: ``python test_attention_kernels.py
--interpreter-report`` prints a JSON report and each test below reads one part of it.  On the
small shapes of :data:`deepinfer_cuda_sm100.attention_ops.SMALL` it runs

- the conformance suite (``check_backend``) on a CPU ``BackendSpec`` built from
  :func:`~deepinfer_cuda_sm100.attention_ops.attention_ops`: the ops' own cases and the
  backend's, in float32 and bfloat16, in the default and the batch-invariant mode;
- the indexer's tie rule: crafted score rows (equal values, ``-inf``, ``+-0``, fewer valid
  candidates than ``k``) and duplicated keys, against the reference exactly;
- batch invariance (bitwise, batch-invariant mode): a row alone and in a batch, with more or
  differently placed ``-1`` slots, with the window moved between sources, through the direct
  and the split-KV launch;
- every launch shape (direct, split-KV with several chunk sizes) against the reference;
- packed FP8 KV pools (``Fp8KVPool``, ``kv_cache_dtype="fp8"``): the conformance cases include
  them (every pool packed, and plain/packed mixes); batch invariance and every launch shape
  are checked on the all-packed cases too; and a key read alone (one valid key per query, a
  sink too low to count) must come back as exactly the reference's dequantised row, over row
  layouts with several scale groups, a partial group, an odd nope width, extreme and zero
  rows, through explicit and paged sources, both launch shapes and an unaligned buffer.

**Compiled for the GPU** (no GPU needed; skipped without Triton's NVIDIA backend): the host
wrapper's real launch arguments for packed and mixed pools at V4-Flash shapes, compiled for
SM90 and SM100, within a block's shared memory.

**GPU** (skipped without CUDA): the same checks at DeepSeek-V4-Flash shapes, and replay of a
captured CUDA graph (plain and packed pools).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from cuda_sm100_checks import compile_launch, compile_problem, failed_rows

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[triton]'")


# ---------------------------------------------------------------------------------------------
# checks shared by the interpreter child and the GPU tests


def _conformance(
    device: str, dtypes: tuple[torch.dtype, ...], bi_dtypes: tuple[torch.dtype, ...] | None = None
) -> list[dict]:
    """The conformance suite in the default mode (``dtypes``) and batch-invariant mode (``bi_dtypes``)."""
    from cuda_sm100_checks import conformance_rows
    from deepinfer_cuda_sm100.attention_ops import attention_ops

    from deepinfer_core.backends import BackendSpec

    spec = BackendSpec(name="cuda_sm100_attention", device_type=device, ops=attention_ops)
    return conformance_rows(spec, dtypes, bi_dtypes)


def _moved_conformance(device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    """The conformance comparison, with every input moved to ``device``.

    ``check_backend`` moves tensors but not the tensors inside a ``PagedIndex``, so on a GPU
    its paged cases reach ``supports`` with CPU block tables and are skipped; this loop moves
    them too and compares with the same tolerances (integer outputs exactly).
    """
    from deepinfer_cuda_sm100.attention_ops import attention_ops

    from deepinfer_core.ops.modes import batch_invariant_mode
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES, get_op
    from deepinfer_core.testing.compare import compare

    rows = []
    for op, impl in attention_ops().items():
        spec = get_op(op)
        for own, make in (("", spec.sample_cases), ("own", impl.sample_cases)):
            for dtype in dtypes:
                for i, (args, kwargs) in enumerate(make(torch.Generator().manual_seed(0), dtype)):
                    for bi in (False, True):
                        row = {"mode": "bi" if bi else "default", "op": op, "case": f"{dtype}#{own}{i}"}
                        call = _to(args, device)
                        with batch_invariant_mode(bi):
                            verdict = impl.supports(*call, **kwargs)
                            if verdict is not True:
                                rows.append({**row, "status": "skipped", "message": str(verdict)})
                                continue
                            got = impl.fn(*call, **kwargs)
                            want = spec.reference(*_to(args, device), **kwargs)
                        atol, rtol = spec.tolerances.get(dtype, DEFAULT_TOLERANCES[torch.float32])
                        problems: list[str] = []
                        err = compare(got, want, atol, rtol, "output", problems)
                        status = "failed" if problems else "passed"
                        rows.append({**row, "status": status, "message": "; ".join(problems), "err": err})
    return rows


def _to(args: tuple, device: str) -> tuple:
    from deepinfer_core.ops.attention import PagedIndex
    from deepinfer_core.ops.kv_format import Fp8KVPool

    def move(a):
        if isinstance(a, torch.Tensor):
            return a.to(device)
        if isinstance(a, Fp8KVPool):
            return Fp8KVPool(a.data.to(device), a.dim, a.rope_dim)
        if isinstance(a, PagedIndex):
            return PagedIndex(
                a.block_table.to(device),
                a.token_rows.to(device),
                a.counts.to(device),
                a.entries_per_page,
                a.max_count,
            )
        if isinstance(a, list):
            return [move(x) for x in a]
        return a

    return tuple(move(a) for a in args)


def _select_rows(index, rows: slice):
    from deepinfer_core.ops.attention import PagedIndex

    if isinstance(index, PagedIndex):
        r = torch.arange(index.counts.shape[0], device=index.counts.device)[rows]
        return index.select(r)
    return index[rows]


def _spread(index: torch.Tensor, extra: int, g: torch.Generator) -> torch.Tensor:
    """``index`` with ``extra`` more columns: each row's valid entries, in order, at random
    columns, ``-1`` elsewhere (the same valid key sequence, other padding)."""
    t, k = index.shape
    out = torch.full((t, k + extra), -1, dtype=index.dtype)
    cpu = index.cpu()
    for r in range(t):
        valid = cpu[r][cpu[r] >= 0]
        cols = torch.randperm(k + extra, generator=g)[: valid.numel()].sort().values
        out[r, cols] = valid
    return out.to(index.device)


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    return f"max |diff| {(a.double() - b.double()).abs().max().item():.3g}"


def _cat_pools(a, b):
    """Pool ``a``'s rows, then ``b``'s (both plain or both packed)."""
    from deepinfer_core.ops.kv_format import Fp8KVPool

    if isinstance(a, Fp8KVPool):
        return Fp8KVPool(torch.cat([a.data, b.data]), a.dim, a.rope_dim)
    return torch.cat([a, b])


def _packed(pools) -> bool:
    from deepinfer_core.ops.kv_format import Fp8KVPool

    return any(isinstance(p, Fp8KVPool) for p in pools)


def attention_invariance_problems(shapes, dtype: torch.dtype, device: str, kv: str = "plain") -> list[str]:
    """Batch-invariant mode: each query's output bitwise the same alone, with other padding,
    with the window in one source instead of two, and through either launch shape (``kv``:
    the plain or the packed-FP8 cases)."""
    from deepinfer_cuda_sm100.attention_ops import attention_cases
    from deepinfer_cuda_sm100.kernels import attention as ka

    from deepinfer_core.ops.modes import batch_invariant_mode

    g = torch.Generator().manual_seed(1)
    problems = []
    cases = attention_cases(shapes, kv)(torch.Generator().manual_seed(0), dtype)
    csa, hca = cases[-3], cases[-2]  # the largest batch: CSA, HCA
    with batch_invariant_mode():
        for name, (args, _) in ((f"{kv} csa", csa), (f"{kv} hca", hca)):
            q, pools, idx, sinks, scale = _to(args, device)
            t = q.shape[0]
            full = ka.sparse_attention(q, pools, idx, sinks, scale)
            for a, b in ((0, 1), (t - 2, t), (1, min(t, 4))):
                part = ka.sparse_attention(
                    q[a:b], pools, [_select_rows(i, slice(a, b)) for i in idx], sinks, scale
                )
                if not torch.equal(full[a:b], part):
                    problems.append(f"{name}: rows {a}:{b} of {t} differ alone ({_diff(full[a:b], part)})")
            spread = [_spread(i, 7, g) if isinstance(i, torch.Tensor) else i for i in idx]
            other = ka.sparse_attention(q, pools, spread, sinks, scale)
            if not torch.equal(full, other):
                problems.append(f"{name}: other -1 padding changes the output ({_diff(full, other)})")
            # the whole window in one pool (ring rows, then this step's rows appended)
            ring, rows = pools[0], pools[1]
            merged = _cat_pools(ring, rows)
            win = torch.cat([idx[0], torch.where(idx[1] >= 0, idx[1] + ring.shape[0], -1)], dim=1)
            one = ka.sparse_attention(q, [merged, *pools[2:]], [win, *idx[2:]], sinks, scale)
            if not torch.equal(full, one):
                problems.append(f"{name}: the window in one source changes the output ({_diff(full, one)})")
            cfg = ka.default_config(q.shape[1], q.shape[2], q.dtype, _packed(pools))
            chunk = ka.plan_launch(t, q.shape[1], ka.max_keys_of(idx), cfg, q.device).chunk
            nsplit = -(-ka.max_keys_of(idx) // chunk)
            for plan in (ka.Plan(True, chunk, nsplit), ka.Plan(False, chunk, 1)):
                got = ka.sparse_attention_impl(q, pools, idx, sinks, scale, plan=plan)
                if not torch.equal(full, got):
                    problems.append(f"{name}: launch {plan} changes the output ({_diff(full, got)})")
    return problems


def indexer_invariance_problems(shapes, dtype: torch.dtype, device: str) -> list[str]:
    """Batch-invariant mode: each query's picks the same alone, with more trailing padding and
    (valid picks) with ``-1`` slots spread differently."""
    from deepinfer_cuda_sm100.attention_ops import indexer_cases
    from deepinfer_cuda_sm100.kernels import indexer as ki

    from deepinfer_core.ops.modes import batch_invariant_mode

    g = torch.Generator().manual_seed(2)
    problems = []
    cases = indexer_cases(shapes)(torch.Generator().manual_seed(0), dtype)
    with batch_invariant_mode():
        for name, (args, _) in (("paged", cases[-3]), ("rows", cases[-2]), ("random", cases[-1])):
            q, w, keys, cand, k, scale = _to(args, device)
            t = q.shape[0]
            full = ki.indexer_topk(q, w, keys, cand, k, scale)
            for a, b in ((0, 1), (t - 2, t), (1, min(t, 4))):
                part = ki.indexer_topk(q[a:b], w[a:b], keys, _select_rows(cand, slice(a, b)), k, scale)
                if not torch.equal(full[a:b], part):
                    problems.append(f"{name}: rows {a}:{b} of {t} differ alone")
            if isinstance(cand, torch.Tensor):
                padded = torch.cat([cand, torch.full_like(cand[:, :5], -1)], dim=1)
                if not torch.equal(full, ki.indexer_topk(q, w, keys, padded, k, scale)):
                    problems.append(f"{name}: trailing -1 columns change the picks")
                spread = ki.indexer_topk(q, w, keys, _spread(cand, 9, g), k, scale)
                for r in range(t):
                    x, y = full[r][full[r] >= 0], spread[r][spread[r] >= 0]
                    if not torch.equal(x, y):
                        problems.append(f"{name}: row {r}'s valid picks change with other -1 slots")
    return problems


def tie_break_problems(device: str) -> list[str]:
    """Equal scores go to the earlier column, in both modes, exactly as the reference."""
    from deepinfer_cuda_sm100.attention_ops import SMALL, indexer_cases
    from deepinfer_cuda_sm100.kernels import indexer as ki

    from deepinfer_core.ops.attention import indexer_topk as reference
    from deepinfer_core.ops.modes import batch_invariant_mode

    problems = []
    inf = float("inf")
    scores = torch.tensor(
        [
            [1.0, 2.0, 2.0, 0.0, -0.0, 3.0, 2.0, -inf, 2.0, 1.0],
            [0.0] * 10,
            [-inf, -inf, 5.0, -inf, -inf, -inf, 4.0, -inf, -inf, -inf],
            [-1.5, -2.5, -1.5, -0.5, -2.5, 7.0, -0.5, -1.5, 1e-30, -1e-30],
        ]
    )
    for k in (1, 3, 4, 6, 10, 12):
        for column_order in (False, True):
            s = scores.where(scores != 0, 0.0)  # the score kernel never produces -0.0
            order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, : min(k, 10)]
            want = order.sort(dim=1).values if column_order else order
            got = ki.select_topk(s.to(device), k, column_order=column_order).cpu()
            if not torch.equal(got, want):
                problems.append(
                    f"select_topk k={k} column_order={column_order}: {got.tolist()} != {want.tolist()}"
                )
    # duplicated keys and integer data: many exactly equal scores
    args, _ = indexer_cases(SMALL)(torch.Generator().manual_seed(3), torch.float32)[3]
    q, w, keys, cand, k, scale = args
    keys = keys[torch.arange(keys.shape[0]) % 5]  # five distinct keys
    for dtype in (torch.float32, torch.bfloat16):
        for bi in (False, True):
            call = _to((q.to(dtype), w, keys.to(dtype), cand, k, scale), device)
            with batch_invariant_mode(bi):
                got = ki.indexer_topk(*call).cpu()
                want = reference(*_to(call, "cpu"))
            if not torch.equal(got, want):
                problems.append(f"duplicated keys, {dtype}, bi={bi}: picks differ from the reference")
    return problems


def launch_problems(shapes, dtype: torch.dtype, device: str, kv: str = "plain") -> list[str]:
    """Every launch shape (direct; split-KV with several chunk sizes) within the op's tolerance
    (``kv``: the plain or the packed-FP8 cases)."""
    from deepinfer_cuda_sm100.attention_ops import attention_cases
    from deepinfer_cuda_sm100.kernels import attention as ka

    from deepinfer_core.ops.attention import sparse_attention as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    atol, rtol = DEFAULT_TOLERANCES[dtype]
    problems = []
    cases = attention_cases(shapes, kv)(torch.Generator().manual_seed(4), dtype)
    for name, (args, _) in ((f"{kv} csa", cases[-3]), (f"{kv} long", cases[-1])):
        call = _to(args, device)
        want = reference(*call).float()
        q, pools, idx = call[0], call[1], call[2]
        cfg = ka.default_config(q.shape[1], q.shape[2], q.dtype, _packed(pools))
        top = ka.max_keys_of(idx)
        whole = -(-top // cfg.block_n) * cfg.block_n
        for split, chunk in (
            (False, whole),
            (False, cfg.block_n),
            (True, cfg.block_n),
            (True, 3 * cfg.block_n),
        ):
            plan = ka.Plan(split, chunk, -(-top // chunk) if split else 1)
            got = ka.sparse_attention_impl(*call, plan=plan).float()
            if not torch.allclose(got, want, atol=atol, rtol=rtol):
                problems.append(f"{name} {plan}: {_diff(got, want)}")
    return problems


FP8_LAYOUTS = ((160, 16), (75, 8), (32, 0), (24, 24))
"""``(dim, rope_dim)`` of the exactness check: three scale groups, the last partial; an odd
nope width (a padding byte before the rope values); no rope; no nope."""


def _extreme_rows(g: torch.Generator, n: int, d: int) -> torch.Tensor:
    """``n`` rows ``[n, d]`` (fp32): random magnitudes from 1e-30 to 1e4 per row and per
    channel, some zero rows and channels, huge next to tiny within one scale group."""
    x = torch.randn(n, d, generator=g) * torch.logspace(-30, 4, n).view(n, 1)
    x = x[torch.randperm(n, generator=g)]
    x[::5] = 0.0
    x[1::7, ::3] *= 1e-12
    x[:, 5] = 0.0
    return x


def _unaligned(pool, device: str):
    """``pool``'s rows on ``device`` at an odd byte offset of a wider buffer (rows neither
    8-byte aligned nor ``row_bytes`` apart): the host wrapper must re-lay them for the
    kernel's wide loads."""
    from deepinfer_core.ops.kv_format import Fp8KVPool

    n, rb = pool.data.shape
    buf = torch.zeros(n * (rb + 4) + 3, dtype=torch.uint8, device=device)
    rows = buf[3:].view(n, rb + 4)[:, :rb]
    rows.copy_(pool.data)
    return Fp8KVPool(rows, pool.dim, pool.rope_dim)


def fp8_dequant_problems(
    device: str, dtypes: tuple[torch.dtype, ...], layouts: tuple[tuple[int, int], ...] = FP8_LAYOUTS
) -> list[str]:
    """One valid key per query and a sink too low to count: the output is the key's row as the
    kernel dequantised it, which must equal the reference's dequantised row exactly (both are
    exact: e4m3 values times powers of two, bf16 rope values), through an explicit and a
    paged source, both launch shapes, and next to a plain pool (before and after it), for each
    ``(dim, rope_dim)`` of ``layouts`` (the first in every dtype and call, the others in the
    first dtype, after a plain pool and before one)."""
    from deepinfer_cuda_sm100.kernels import attention as ka

    from deepinfer_core.ops.attention import PagedIndex
    from deepinfer_core.ops.attention import sparse_attention as reference
    from deepinfer_core.ops.kv_format import Fp8KVPool

    g = torch.Generator().manual_seed(5)
    problems = []
    t, h, n, k, epp = 6, 4, 40, 5, 2
    for li, (d, rope) in enumerate(layouts):
        packed = Fp8KVPool.from_values(_extreme_rows(g, n, d), rope)
        pool = Fp8KVPool(torch.cat([packed.data, Fp8KVPool.zeros(2, d, rope).data]), d, rope)  # scale byte 0
        pick = 2 * torch.randperm((n + 2) // 2, generator=g)[:t]  # even rows: entry 0 of a 2-row page
        pick[-1] = n  # a row of Fp8KVPool.zeros
        explicit = torch.full((t, k), -1, dtype=torch.int64)
        explicit[torch.arange(t), torch.randint(0, k, (t,), generator=g)] = pick
        table = torch.randint(0, (n + 2) // epp, (t, 3), generator=g)
        table[:, 0] = pick // epp
        paged = PagedIndex(table, torch.arange(t), torch.ones(t, dtype=torch.int64), epp, 3 * epp)
        none = torch.full((t, 2), -1, dtype=torch.int64)
        for dtype in dtypes if li == 0 else dtypes[:1]:  # the edge layouts: one dtype
            exp = pool.dequantize_rows(pick, dtype).float().unsqueeze(1).expand(t, h, d)
            q = torch.randn(t, h, d, generator=g).to(dtype)
            plain = torch.randn(3, d, generator=g).to(dtype)
            calls = {
                "rows": ([pool], [explicit]),
                "paged": ([pool], [paged]),
                "plain, then rows": ([plain, pool], [none, explicit]),
                "paged, then plain": ([pool, plain], [paged, none]),
                "rows of an unaligned buffer": ([_unaligned(pool, device)], [explicit]),
            }
            if li:  # the edge layouts: each source kind once
                calls = {n: c for n, c in calls.items() if n in ("plain, then rows", "paged, then plain")}
            for name, (pools, idx) in calls.items():
                call = _to((q, pools, idx, torch.full((h,), -1e30), d**-0.5), device)
                want = reference(*_to(call, "cpu")).float()
                if not torch.equal(want, exp):
                    problems.append(f"d={d} rope={rope} {dtype} {name}: the reference {_diff(want, exp)}")
                for plan in (ka.Plan(True, 16, -(-k // 16)), ka.Plan(False, 16, 1)):
                    got = ka.sparse_attention_impl(*call, plan=plan).cpu().float()
                    if not torch.equal(got, exp):
                        problems.append(f"d={d} rope={rope} {dtype} {name} {plan}: {_diff(got, exp)}")
    return problems


def select_path_problems(device: str, shapes_name: str = "SMALL") -> list[str]:
    """The ``torch.topk`` selection path (:mod:`deepinfer_cuda_sm100.indexer_select`) against the
    Triton radix select on the scores of every ``indexer_topk`` case: the same picks, in the
    same order (integer data: many equal scores)."""
    from deepinfer_cuda_sm100 import attention_ops
    from deepinfer_cuda_sm100.indexer_select import select_topk_torch
    from deepinfer_cuda_sm100.kernels import indexer as ki

    from deepinfer_core.ops.attention import PagedIndex

    problems = []
    shapes = getattr(attention_ops, shapes_name)
    for dtype in (torch.float32, torch.bfloat16):
        cases = attention_ops.indexer_cases(shapes)(torch.Generator().manual_seed(0), dtype)
        for n, (args, _) in enumerate(cases):
            q, w, keys, cand, k, scale = _to(args, device)
            scores = ki.indexer_scores(q, w, keys, cand, scale)
            got, want = select_topk_torch(scores, k, cand), ki.select_topk(scores, k, cand)
            if not torch.equal(got, want):
                kind = "paged" if isinstance(cand, PagedIndex) else "rows"
                problems.append(f"{dtype} case {n} ({kind}): the torch selection differs from Triton's")
    return problems


def _wide_index_lists(g: torch.Generator) -> list[list]:
    """Index lists the conformance cases lack: one wider than the prologue's block
    (``kernels.attention.PROLOGUE_BLOCK``: read block after block) beside a paged source, and
    an empty list before an int32 one."""
    from deepinfer_cuda_sm100.kernels.attention import PROLOGUE_BLOCK

    from deepinfer_core.ops.attention import PagedIndex

    t = 5
    wide = torch.randint(-1, 50, (t, PROLOGUE_BLOCK + 300), generator=g)
    window = torch.randint(-1, 100, (t, 128), generator=g)
    table = torch.zeros(1, 4, dtype=torch.int64)
    paged = PagedIndex(table, torch.zeros(t, dtype=torch.int64), torch.tensor([3, -1, 70, 0, 64]), 16, 64)
    topk = torch.randint(-1, 1000, (t, 512), generator=g).to(torch.int32)
    return [[wide, paged, window], [torch.empty(t, 0, dtype=torch.int64), topk]]


def compaction_problems(device: str) -> list[str]:
    """The prologue's :func:`compact_sources` on every conformance case of ``sparse_attention``
    and on :func:`_wide_index_lists` against its definition: each source's valid-key count and
    the explicit lists' valid rows, list after list, each in its order."""
    from deepinfer_cuda_sm100.attention_ops import SMALL, attention_cases
    from deepinfer_cuda_sm100.kernels.attention import compact_sources

    from deepinfer_core.ops.attention import PagedIndex

    problems = []
    g = torch.Generator().manual_seed(0)
    cases = [args[2] for args, _ in attention_cases(SMALL)(g, torch.float32)] + _wide_index_lists(g)
    for n, lists in enumerate(cases):
        indices = [i if isinstance(i, PagedIndex) else i.to(device) for i in lists]
        nvalid, compact = compact_sources(indices)
        for t in range(nvalid.shape[0]):
            rows, counts = [], []
            for i in indices:
                if isinstance(i, PagedIndex):
                    counts.append(min(max(int(i.counts[t]), 0), int(i.max_count)))
                else:
                    valid = [int(r) for r in i[t].tolist() if r >= 0]
                    rows += valid
                    counts.append(len(valid))
            counts += [0] * (4 - len(counts))
            got_counts = nvalid[t].tolist()
            if got_counts != counts or compact[t, : len(rows)].tolist() != rows:
                problems.append(f"case {n} query {t}: counts {got_counts} (want {counts}) or rows differ")
    return problems


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.attention_ops import SMALL
    from deepinfer_cuda_sm100.kernels import _common

    report: dict = {"interpreted": _common.INTERPRETED}
    report["conformance"] = _conformance("cpu", (torch.float32, torch.bfloat16), (torch.bfloat16,))
    report["tie_break"] = tie_break_problems("cpu")
    report["attention_invariance"] = attention_invariance_problems(SMALL, torch.bfloat16, "cpu")
    report["attention_invariance"] += attention_invariance_problems(SMALL, torch.bfloat16, "cpu", "fp8")
    report["indexer_invariance"] = indexer_invariance_problems(SMALL, torch.bfloat16, "cpu")
    report["launches"] = launch_problems(SMALL, torch.float32, "cpu")
    report["launches"] += launch_problems(SMALL, torch.bfloat16, "cpu", "fp8")
    report["fp8_dequant"] = fp8_dequant_problems("cpu", (torch.float32, torch.bfloat16))
    report["fp8_cases"] = _fp8_case_count(SMALL)
    report["compaction"] = compaction_problems("cpu")
    report["select_paths"] = select_path_problems("cpu")
    return report


def _fp8_case_count(shapes) -> dict[str, int]:
    """How many of ``sparse_attention``'s conformance cases (the op's, the backend's) hold a
    packed pool: they must run, not be refused."""
    from deepinfer_cuda_sm100.attention_ops import attention_cases

    from deepinfer_core.ops.registry import get_op

    counts = {}
    for name, make in (("op", get_op("sparse_attention").sample_cases), ("own", attention_cases(shapes))):
        cases = make(torch.Generator().manual_seed(0), torch.float32)
        counts[name] = sum(_packed(args[1]) for args, _ in cases)
    return counts


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernels (~30 s)


@slow
def test_kernels_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
@pytest.mark.parametrize("op", ["sparse_attention", "indexer_topk"])
@pytest.mark.parametrize("mode", ["default", "bi"])
def test_interpreter_conformance(report, op, mode):
    from deepinfer_cuda_sm100.attention_ops import PACKED_KV_REFUSAL

    rows = [r for r in report["conformance"] if r["op"] == op and r["mode"] == mode]
    assert rows, f"no conformance case of {op} ran"
    # packed FP8 pools included: none is refused; V4.1's block-scaled pools are (the reference)
    bad = failed_rows(rows, PACKED_KV_REFUSAL)
    assert not bad, "\n".join(bad)
    if op == "sparse_attention":
        counts = report["fp8_cases"]
        assert counts["op"] >= 1 and counts["own"] >= 8, f"too few cases with packed FP8 pools: {counts}"


@slow
def test_interpreter_torch_selection_equals_the_radix_select(report):
    assert not report["select_paths"], "\n".join(report["select_paths"])


@slow
def test_interpreter_prologue_compacts_the_sources(report):
    assert not report["compaction"], "\n".join(report["compaction"])


@slow
def test_interpreter_fp8_dequantisation_is_exact(report):
    assert not report["fp8_dequant"], "\n".join(report["fp8_dequant"])


@slow
def test_interpreter_tie_break(report):
    assert not report["tie_break"], "\n".join(report["tie_break"])


@slow
def test_interpreter_attention_batch_invariance(report):
    assert not report["attention_invariance"], "\n".join(report["attention_invariance"])


@slow
def test_interpreter_indexer_batch_invariance(report):
    assert not report["indexer_invariance"], "\n".join(report["indexer_invariance"])


@slow
def test_interpreter_launch_shapes(report):
    assert not report["launches"], "\n".join(report["launches"])


# ---------------------------------------------------------------------------------------------
# supports (no kernel runs: the predicates only look at the arguments)


def _small_call(device: str = "cpu"):
    from deepinfer_core.ops.attention import PagedIndex

    q = torch.zeros(3, 4, 32, device=device)
    paged = PagedIndex(
        torch.zeros(1, 2, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int64),
        torch.ones(3, dtype=torch.int64),
        4,
        8,
    )
    att = (
        q,
        [torch.zeros(10, 32), torch.zeros(8, 32)],
        [torch.zeros(3, 5, dtype=torch.int64), paged],
        torch.zeros(4),
        0.1,
    )
    idx = (q, torch.zeros(3, 4), torch.zeros(10, 32), torch.zeros(3, 7, dtype=torch.int64), 4, 0.1)
    return att, idx


def test_supports_rejects_cpu_tensors_for_compiled_kernels():
    from deepinfer_cuda_sm100.attention_ops import make_supports

    supports = make_supports(interpreted=False)
    att, idx = _small_call()
    for op, call in (("sparse_attention", att), ("indexer_topk", idx)):
        verdict = supports[op](*call)
        assert isinstance(verdict, str) and "cpu" in verdict and "GPU" in verdict, verdict


def test_supports_reasons_name_the_problem():
    from deepinfer_cuda_sm100.attention_ops import make_supports

    from deepinfer_core.ops.attention import PagedIndex
    from deepinfer_core.ops.kv_format import Fp8KVPool

    att = make_supports(interpreted=True)["sparse_attention"]
    idx = make_supports(interpreted=True)["indexer_topk"]
    (q, pools, indices, sinks, scale), (iq, w, keys, cand, k, iscale) = _small_call()
    assert att(q, pools, indices, sinks, scale) is True
    assert idx(iq, w, keys, cand, k, iscale) is True
    # float counts in a paged index: rejected with the reason
    bad_paged = PagedIndex(
        torch.zeros(1, 2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.ones(3), 4, 8
    )
    assert "counts" in str(att(q, pools, [indices[0], bad_paged], sinks, scale))
    fp8 = Fp8KVPool.from_values
    for packed in (
        [pools[0], fp8(pools[1], 8)],
        [fp8(pools[0], 8), fp8(pools[1], 8)],
        [fp8(pools[0], 0), pools[1]],
    ):
        assert att(q, packed, indices, sinks, scale) is True  # kv_cache_dtype="fp8": the kernel reads them
    checks = {
        "head dim": att(torch.zeros(3, 4, 2048), [torch.zeros(10, 2048)], [indices[0]], sinks, scale),
        "differs from q": att(q, [pools[0].bfloat16()], [indices[0]], sinks, scale),
        "FP8": att(q, [pools[0].to(torch.float8_e4m3fn)], [indices[0]], sinks, scale),
        "values per row": att(q, [Fp8KVPool.zeros(10, 16, 8)], [indices[0]], sinks, scale),
        "one row layout": att(q, [fp8(pools[0], 8), fp8(pools[1], 16)], indices, sinks, scale),
        "pairs": att(q, pools * 3, indices * 3, sinks, scale),
        "sinks": att(q, pools[:1], indices[:1], torch.zeros(5), scale),
        "rows": att(q, pools[:1], [indices[0][:2]], sinks, scale),
        "integer": att(q, pools[:1], [indices[0].float()], sinks, scale),
        "indexer heads": idx(torch.zeros(3, 200, 32), torch.zeros(3, 200), keys, cand, k, iscale),
        "key_pool": idx(iq, w, torch.zeros(10, 16), cand, k, iscale),
        "weights": idx(iq, torch.zeros(3, 5), keys, cand, k, iscale),
        "exceeds": idx(iq, w, keys, torch.zeros(3, 9000, dtype=torch.int64), 5000, iscale),
        "non-negative int": idx(iq, w, keys, cand, 2.5, iscale),
    }
    for needle, verdict in checks.items():
        assert isinstance(verdict, str) and needle in verdict, (needle, verdict)


def test_fp8_kv_pools_reach_the_kernel(caplog):
    """``kv_cache_dtype="fp8"`` pools: an op table hands them to the kernel; only a call whose
    packed pools disagree on the row layout falls back to the reference (logged), and a packed
    pool's bytes on another device are named."""
    from deepinfer_cuda_sm100.attention_ops import make_supports

    from deepinfer_core.ops import OpImpl, OpTable
    from deepinfer_core.ops.attention import sparse_attention
    from deepinfer_core.ops.kv_format import Fp8KVPool

    seen = []

    def kernel(q, kv_pools, *args):
        seen.append([type(p).__name__ for p in kv_pools])
        return sparse_attention(q, kv_pools, *args)

    supports = make_supports(interpreted=True)["sparse_attention"]
    table = OpTable({"sparse_attention": OpImpl(fn=kernel, supports=supports)}, backend="cuda_sm100")
    (_, _, indices, sinks, scale), _ = _small_call()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 32, generator=g)
    pools = [Fp8KVPool.from_values(torch.randn(10, 32, generator=g), 8), torch.randn(8, 32, generator=g)]
    caplog.clear()
    with caplog.at_level("WARNING", logger="deepinfer.ops"):
        got = table.sparse_attention(q, pools, indices, sinks, scale)
    assert torch.equal(got, sparse_attention(q, pools, indices, sinks, scale))
    assert seen == [["Fp8KVPool", "Tensor"]] and "Fp8KVPool" not in caplog.text
    other = [pools[0], Fp8KVPool.from_values(pools[1], 16)]
    with caplog.at_level("WARNING", logger="deepinfer.ops"):
        got = table.sparse_attention(q, other, indices, sinks, scale)
    assert torch.equal(got, sparse_attention(q, other, indices, sinks, scale))
    assert len(seen) == 1 and "one row layout" in caplog.text
    elsewhere = [Fp8KVPool(pools[0].data.to("meta"), 32, 8), pools[1]]
    verdict = supports(q, elsewhere, indices, sinks, scale)
    assert isinstance(verdict, str) and "kv_pools[0].data is on meta" in verdict, verdict


def test_the_kernel_refuses_packed_pools_of_two_layouts():
    """The host wrapper's own check (``supports`` refuses these calls first)."""
    from deepinfer_cuda_sm100.kernels import attention as ka

    from deepinfer_core.ops.kv_format import Fp8KVPool

    q = torch.zeros(2, 4, 32)
    pools = [Fp8KVPool.zeros(4, 32, 8), Fp8KVPool.zeros(4, 32, 16)]
    idx = [torch.zeros(2, 1, dtype=torch.int64)] * 2
    with pytest.raises(ValueError, match="one row layout per call"):
        ka.sparse_attention(q, pools, idx, torch.zeros(4), 0.1)


def test_constants_match_the_kernels():
    from deepinfer_cuda_sm100 import attention_ops
    from deepinfer_cuda_sm100.kernels import attention, indexer

    assert attention_ops.MAX_SOURCES == attention.MAX_SOURCES
    assert attention_ops.MAX_HEAD_DIM == attention.MAX_HEAD_DIM
    assert attention_ops.MAX_INDEX_HEADS == indexer.MAX_HEADS
    assert attention_ops.MAX_INDEX_DIM == indexer.MAX_INDEX_DIM
    assert attention_ops.MAX_TOPK == indexer.MAX_TOPK


# ---------------------------------------------------------------------------------------------
# compile for the GPU (no GPU needed): the host wrapper's real launch arguments, intercepted

MAX_SHARED = 232448
"""Shared memory one block may use on SM90 and SM100 (227 KiB)."""


def _recorded_main_launches(call: tuple, monkeypatch) -> list[tuple[tuple, dict]]:
    """The ``(args, kwargs)`` the host wrapper passes ``_attn_kernel`` for ``call`` (CPU
    tensors; no kernel runs)."""
    from cuda_sm100_checks import record_launches
    from deepinfer_cuda_sm100.kernels import attention as ka

    main = ka._attn_kernel
    launches = record_launches(monkeypatch, ka, ("_attn_kernel", "_prologue_kernel", "_combine_kernel"))
    ka.sparse_attention(*call)
    monkeypatch.undo()
    return [(args, kwargs) for kernel, args, kwargs in launches if kernel is main]


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
def test_the_prologue_reads_every_source_before_its_first_store():
    """Compiled for sm_90 at V4's lists (a 128-row window, 512 top-k rows, int32 and int64),
    the prologue's global loads all come before its first global store: one round of load
    latency a query, where the lists wider than a block take one a source."""
    import re

    from deepinfer_cuda_sm100.kernels import attention as ka

    t, none = 64, torch.empty(1, dtype=torch.int64)
    window, topk = torch.zeros(t, 128, dtype=torch.int64), torch.zeros(t, 512, dtype=torch.int32)
    out = (torch.empty(t, 4, dtype=torch.int32), torch.empty(t, 640, dtype=torch.int32), 640)
    args = (*out, window, 128, 1, 128, topk, 512, 1, 512, none, 0, 0, 0, none, 0, 0, 0)
    kinds = {"KIND0": ka.SRC_ROWS, "KIND1": ka.SRC_ROWS, "KIND2": ka.SRC_NONE, "KIND3": ka.SRC_NONE}
    for one_block in (True, False):
        kw = {**kinds, "BLOCK_C": 512, "INTERP": False, "ONE_BLOCK": one_block, "num_warps": 4}
        ptx = compile_launch(ka._prologue_kernel, args, kw, 90).asm["ptx"]
        memory = re.findall(r"\b(ld\.global|st\.global)", ptx)
        first_store = memory.index("st.global")
        assert ("ld.global" not in memory[first_store:]) == one_block, (one_block, memory)


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_attention_kernel_compiles_for_the_gpu(arch, monkeypatch):
    """At V4-Flash shapes, packed FP8 pools (all packed; plain and packed mixed) through the
    direct and the split-KV launch, bf16 and fp32: the kernel compiles for ``sm_<arch>`` and
    fits in a block's shared memory (the fp32 tiles of packed rows take 16-key tiles)."""
    from deepinfer_cuda_sm100.attention_ops import V4_FLASH, attention_cases
    from deepinfer_cuda_sm100.kernels import attention as ka

    kernel = ka._attn_kernel
    problems = []
    for dtype in (torch.bfloat16, torch.float32):
        cases = attention_cases(V4_FLASH)(torch.Generator().manual_seed(0), dtype)
        # all packed: the largest batch's CSA (direct) and the long decode (split-KV); the mixes
        picks = {"fp8 csa": cases[-5], "fp8 long": cases[-3], "mixed hca": cases[-2], "mixed long": cases[-1]}
        if dtype == torch.float32:
            del picks["fp8 long"], picks["mixed long"]
        for name, (args, _) in picks.items():
            assert _packed(args[1])
            for a, kw in _recorded_main_launches(args, monkeypatch):
                compiled = compile_launch(kernel, a, kw, arch)
                where = f"{dtype} {name} split={kw['SPLIT']} BLOCK_N={kw['BLOCK_N']}"
                if compiled.metadata.shared > MAX_SHARED:
                    problems.append(f"{where}: {compiled.metadata.shared} bytes of shared memory")
                if dtype == torch.bfloat16 and "mma" not in compiled.asm["ptx"]:  # fp32: IEEE FMAs
                    problems.append(f"{where}: no tensor-core MMA")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@needs_cuda
@pytest.mark.parametrize("op", ["sparse_attention", "indexer_topk"])
def test_gpu_conformance_at_v4_flash_shapes(op):
    from deepinfer_cuda_sm100.attention_ops import PACKED_KV_REFUSAL

    rows = [r for r in _moved_conformance("cuda", (torch.float32, torch.bfloat16)) if r["op"] == op]
    assert rows
    bad = failed_rows(rows, PACKED_KV_REFUSAL)  # V4.1's block-scaled pools: the reference
    assert not bad, "\n".join(bad)


@needs_cuda
def test_gpu_batch_invariance():
    from deepinfer_cuda_sm100.attention_ops import V4_FLASH

    problems = attention_invariance_problems(V4_FLASH, torch.bfloat16, "cuda")
    problems += attention_invariance_problems(V4_FLASH, torch.bfloat16, "cuda", "fp8")
    problems += indexer_invariance_problems(V4_FLASH, torch.bfloat16, "cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_torch_selection_equals_the_radix_select():
    problems = select_path_problems("cuda", "V4_FLASH")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_tie_break_and_launch_shapes():
    from deepinfer_cuda_sm100.attention_ops import V4_FLASH

    problems = tie_break_problems("cuda") + launch_problems(V4_FLASH, torch.bfloat16, "cuda")
    problems += launch_problems(V4_FLASH, torch.bfloat16, "cuda", "fp8")
    problems += launch_problems(V4_FLASH, torch.float32, "cuda", "fp8")  # 16-key tiles, one stage
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_fp8_dequantisation_is_exact():
    problems = fp8_dequant_problems("cuda", (torch.float32, torch.bfloat16))
    assert not problems, "\n".join(problems)


@needs_cuda
@pytest.mark.parametrize("kv", ["plain", "fp8"])
@pytest.mark.parametrize("bi", [False, True])
def test_gpu_graph_replay(bi, kv):
    from deepinfer_cuda_sm100.attention_ops import V4_FLASH, attention_cases, indexer_cases
    from deepinfer_cuda_sm100.kernels import attention as ka
    from deepinfer_cuda_sm100.kernels import indexer as ki

    from deepinfer_core.ops.modes import batch_invariant_mode

    g = torch.Generator().manual_seed(0)
    att = _to(attention_cases(V4_FLASH, kv)(g, torch.bfloat16)[-1][0], "cuda")  # split-KV decode
    idx = _to(indexer_cases(V4_FLASH)(g, torch.bfloat16)[0][0], "cuda")
    with batch_invariant_mode(bi):
        ka.sparse_attention(*att), ki.indexer_topk(*idx)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_a = ka.sparse_attention(*att)
            out_i = ki.indexer_topk(*idx)
        for _ in range(2):
            att[0].copy_(torch.randn_like(att[0]))
            idx[0].copy_(torch.randint_like(idx[0], -3, 4))
            graph.replay()
            assert torch.equal(out_a, ka.sparse_attention(*att))
            assert torch.equal(out_i, ki.indexer_topk(*idx))


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
