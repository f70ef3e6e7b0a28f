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
- every launch shape (direct, split-KV with several chunk sizes) against the reference.

**GPU** (skipped without CUDA): the same checks at DeepSeek-V4-Flash shapes, and replay of a
captured CUDA graph.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[triton]'")


# ---------------------------------------------------------------------------------------------
# checks shared by the interpreter child and the GPU tests


def _conformance(
    device: str, dtypes: tuple[torch.dtype, ...], bi_dtypes: tuple[torch.dtype, ...] | None = None
) -> list[dict]:
    """The conformance suite in the default mode (``dtypes``) and batch-invariant mode (``bi_dtypes``)."""
    from deepinfer_cuda_sm100.attention_ops import attention_ops

    from deepinfer_core.backends import BackendSpec
    from deepinfer_core.ops.modes import batch_invariant_mode
    from deepinfer_core.testing import check_backend

    spec = BackendSpec(name="cuda_sm100_attention", device_type=device, ops=attention_ops)
    rows = []
    for bi in (False, True):
        with batch_invariant_mode(bi):
            report = check_backend(spec, dtypes=(bi_dtypes or dtypes) if bi else dtypes)
        rows += [
            {
                "mode": "bi" if bi else "default",
                "op": r.op,
                "case": r.label,
                "status": r.status,
                "message": r.message,
            }
            for r in report.results
        ]
        rows += [
            {
                "mode": "bi" if bi else "default",
                "op": op,
                "case": "*",
                "status": "failed",
                "message": "untested",
            }
            for op in report.untested_ops
        ]
        rows += [
            {
                "mode": "bi" if bi else "default",
                "op": op,
                "case": "*",
                "status": "failed",
                "message": str(why),
            }
            for op, why in report.never_ran.items()
        ]
    return rows


def _moved_conformance(device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    """The conformance comparison, with every input moved to ``device``.

    ``check_backend`` moves tensors but not the tensors inside a ``PagedIndex``, so on a GPU
    its paged cases reach ``supports`` with CPU block tables and are skipped; this loop moves
    them too and compares with the same tolerances (integer outputs exactly).
    """
    from deepinfer_cuda_sm100.attention_ops import attention_ops

    from deepinfer_core.ops.modes import batch_invariant_mode
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES, get_op
    from deepinfer_core.testing.conformance import compare

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

    def move(a):
        if isinstance(a, torch.Tensor):
            return a.to(device)
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


def attention_invariance_problems(shapes, dtype: torch.dtype, device: str) -> list[str]:
    """Batch-invariant mode: each query's output bitwise the same alone, with other padding,
    with the window in one source instead of two, and through either launch shape."""
    from deepinfer_cuda_sm100.attention_ops import attention_cases
    from deepinfer_cuda_sm100.kernels import attention as ka

    from deepinfer_core.ops.modes import batch_invariant_mode

    g = torch.Generator().manual_seed(1)
    problems = []
    cases = attention_cases(shapes)(torch.Generator().manual_seed(0), dtype)
    csa, hca = cases[-3], cases[-2]  # the largest batch: CSA, HCA
    with batch_invariant_mode():
        for name, (args, _) in (("csa", csa), ("hca", hca)):
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
            ring, kv = pools[0], pools[1]
            merged = torch.cat([ring, kv])
            win = torch.cat([idx[0], torch.where(idx[1] >= 0, idx[1] + ring.shape[0], -1)], dim=1)
            one = ka.sparse_attention(q, [merged, *pools[2:]], [win, *idx[2:]], sinks, scale)
            if not torch.equal(full, one):
                problems.append(f"{name}: the window in one source changes the output ({_diff(full, one)})")
            cfg = ka.default_config(q.shape[1], q.shape[2], q.dtype)
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


def launch_problems(shapes, dtype: torch.dtype, device: str) -> list[str]:
    """Every launch shape (direct; split-KV with several chunk sizes) within the op's tolerance."""
    from deepinfer_cuda_sm100.attention_ops import attention_cases
    from deepinfer_cuda_sm100.kernels import attention as ka

    from deepinfer_core.ops.attention import sparse_attention as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    atol, rtol = DEFAULT_TOLERANCES[dtype]
    problems = []
    cases = attention_cases(shapes)(torch.Generator().manual_seed(4), dtype)
    for name, (args, _) in (("csa", cases[-3]), ("long", cases[-1])):
        call = _to(args, device)
        want = reference(*call).float()
        q, _, idx = call[0], call[1], call[2]
        cfg = ka.default_config(q.shape[1], q.shape[2], q.dtype)
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


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.attention_ops import SMALL
    from deepinfer_cuda_sm100.kernels import _common

    start = time.perf_counter()
    report: dict = {"interpreted": _common.INTERPRETED}
    report["conformance"] = _conformance("cpu", (torch.float32, torch.bfloat16), (torch.bfloat16,))
    report["tie_break"] = tie_break_problems("cpu")
    report["attention_invariance"] = attention_invariance_problems(SMALL, torch.bfloat16, "cpu")
    report["indexer_invariance"] = indexer_invariance_problems(SMALL, torch.bfloat16, "cpu")
    report["launches"] = launch_problems(SMALL, torch.float32, "cpu")
    report["seconds"] = time.perf_counter() - start
    return report


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernels (~20 s)


@pytest.fixture(scope="module")
def report() -> dict:
    from cuda_sm100_checks import interpreter_report

    return interpreter_report(HERE)


@slow
def test_kernels_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
@pytest.mark.parametrize("op", ["sparse_attention", "indexer_topk"])
@pytest.mark.parametrize("mode", ["default", "bi"])
def test_interpreter_conformance(report, op, mode):
    rows = [r for r in report["conformance"] if r["op"] == op and r["mode"] == mode]
    assert rows, f"no conformance case of {op} ran"
    bad = [f"{r['case']}: {r['status']} {r['message']}" for r in rows if not _passed_or_fp8_kv(r)]
    assert not bad, "\n".join(bad)
    if op == "sparse_attention":  # the op's packed-FP8-pool cases reach the reference
        assert any(r["status"] == "skipped" for r in rows)


def _passed_or_fp8_kv(row: dict) -> bool:
    """A conformance row that passed, or a packed FP8 KV pool case refused as designed."""
    from deepinfer_cuda_sm100.attention_ops import FP8_KV_REFUSAL

    return row["status"] == "passed" or (row["status"] == "skipped" and FP8_KV_REFUSAL in row["message"])


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


@slow
def test_interpreter_checks_are_quick(report):
    assert report["seconds"] < 60, f"the interpreter checks took {report['seconds']:.1f} s"


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
    checks = {
        "head dim": att(torch.zeros(3, 4, 2048), [torch.zeros(10, 2048)], [indices[0]], sinks, scale),
        "differs from q": att(q, [pools[0].bfloat16()], [indices[0]], sinks, scale),
        "FP8": att(q, [pools[0].to(torch.float8_e4m3fn)], [indices[0]], sinks, scale),
        "Fp8KVPool": att(q, [pools[0], Fp8KVPool.from_values(pools[1], 8)], indices, sinks, scale),
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


def test_fp8_kv_pools_fall_back_to_the_reference(caplog):
    """``kv_cache_dtype="fp8"`` pools: ``supports`` refuses them with the reason, so an op table
    runs the reference (logged) and the kernel never sees a packed pool."""
    from deepinfer_cuda_sm100.attention_ops import make_supports

    from deepinfer_core.ops import OpImpl, OpTable
    from deepinfer_core.ops.attention import sparse_attention
    from deepinfer_core.ops.kv_format import Fp8KVPool

    def kernel(*args):
        raise AssertionError("the kernel must not see a packed pool")

    for interpreted in (True, False):
        supports = make_supports(interpreted=interpreted)["sparse_attention"]
        table = OpTable({"sparse_attention": OpImpl(fn=kernel, supports=supports)}, backend="cuda_sm100")
        (_, _, indices, sinks, scale), _ = _small_call()
        g = torch.Generator().manual_seed(0)
        q = torch.randn(3, 4, 32, generator=g)
        pools = [Fp8KVPool.from_values(torch.randn(10, 32, generator=g), 8), torch.randn(8, 32, generator=g)]
        caplog.clear()
        with caplog.at_level("WARNING", logger="deepinfer.ops"):
            got = table.sparse_attention(q, pools, indices, sinks, scale)
        assert torch.equal(got, sparse_attention(q, pools, indices, sinks, scale))
        assert "kv_pools[0] is a packed Fp8KVPool" in caplog.text


def test_constants_match_the_kernels():
    from deepinfer_cuda_sm100 import attention_ops
    from deepinfer_cuda_sm100.kernels import attention, indexer

    assert attention_ops.MAX_SOURCES == attention.MAX_SOURCES
    assert attention_ops.MAX_HEAD_DIM == attention.MAX_HEAD_DIM
    assert attention_ops.MAX_INDEX_HEADS == indexer.MAX_HEADS
    assert attention_ops.MAX_INDEX_DIM == indexer.MAX_INDEX_DIM
    assert attention_ops.MAX_TOPK == indexer.MAX_TOPK


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")


@needs_cuda
@pytest.mark.parametrize("op", ["sparse_attention", "indexer_topk"])
def test_gpu_conformance_at_v4_flash_shapes(op):
    rows = [r for r in _moved_conformance("cuda", (torch.float32, torch.bfloat16)) if r["op"] == op]
    assert rows
    bad = [f"{r['mode']} {r['case']}: {r['status']} {r['message']}" for r in rows if not _passed_or_fp8_kv(r)]
    assert not bad, "\n".join(bad)


@needs_cuda
def test_gpu_batch_invariance():
    from deepinfer_cuda_sm100.attention_ops import V4_FLASH

    problems = attention_invariance_problems(V4_FLASH, torch.bfloat16, "cuda")
    problems += indexer_invariance_problems(V4_FLASH, torch.bfloat16, "cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_tie_break_and_launch_shapes():
    from deepinfer_cuda_sm100.attention_ops import V4_FLASH

    problems = tie_break_problems("cuda") + launch_problems(V4_FLASH, torch.bfloat16, "cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
@pytest.mark.parametrize("bi", [False, True])
def test_gpu_graph_replay(bi):
    from deepinfer_cuda_sm100.attention_ops import V4_FLASH, attention_cases, indexer_cases
    from deepinfer_cuda_sm100.kernels import attention as ka
    from deepinfer_cuda_sm100.kernels import indexer as ki

    from deepinfer_core.ops.modes import batch_invariant_mode

    g = torch.Generator().manual_seed(0)
    att = _to(attention_cases(V4_FLASH)(g, torch.bfloat16)[-1][0], "cuda")  # split-KV decode
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
