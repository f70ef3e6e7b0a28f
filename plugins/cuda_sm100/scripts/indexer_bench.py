"""``bench_attention.py``'s indexer rows: the fused ``indexer_topk`` op, its scores, each
selection path (the radix select, the threshold path where its plan takes it, the row selection
where the rows are short enough) against ``torch.topk`` on the same scores, and (``--tune``) the
tiles, the threshold path's segments and the row selection's width swept."""

from __future__ import annotations

import argparse

import indexer_tilelang
import torch
from attention_inputs import INDEX_TOPK, indexer_inputs, roofline_ms
from kernel_times import kernel_split


def bench_indexer(a: argparse.Namespace, timer, rows: list[dict], saved=lambda: None) -> None:
    """The indexer rows of ``a.indexer_shapes``, timed by ``timer`` (``bench_attention.Timer``):
    each appended to ``rows``, then ``saved()`` called (a run cut short keeps what it measured)."""
    from deepinfer_cuda_sm100.indexer_select import select_topk_torch
    from deepinfer_cuda_sm100.kernels import indexer as ki
    from deepinfer_cuda_sm100.kernels import indexer_rows as kr

    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in a.indexer_shapes.split(","):
        causal = shape.lower().endswith("c")  # e.g. 8192x2048c: a causal prefill chunk
        t, c = (int(x) for x in shape.lower().rstrip("c").split("x"))
        inp = indexer_inputs(t, c, torch.bfloat16, g, causal)
        args = inp["args"]
        q, w, keys, cand, k, scale = args
        row = {"op": "indexer_topk", "T": t, "C": c, "k": k, "causal": causal}
        scores = ki.indexer_scores(q, w, keys, cand, scale)
        if a.check:
            got = ki.select_topk(scores, k, cand)
            want = torch.topk(scores, k, dim=1, sorted=True)
            rows_want = cand.block_table[cand.token_rows[:, None], want.indices // cand.entries_per_page]
            rows_want = rows_want * cand.entries_per_page + want.indices % cand.entries_per_page
            rows_want = rows_want.masked_fill(want.values == float("-inf"), -1)  # unseen entries
            row["picks_equal_torch_topk_sets"] = bool(
                torch.equal(got.sort(dim=1).values, rows_want.sort(dim=1).values)
            )
        row["ms"] = timer.ms(lambda args=args: ki.indexer_topk(*args))
        row["score_ms"] = timer.ms(lambda args=args: ki.indexer_scores(*args[:4], args[5]))
        row["select_ms"] = timer.ms(lambda s=scores, c=cand: ki.select_topk(s, INDEX_TOPK, c))
        row["select_segments"] = ki.plan_select(t, c, INDEX_TOPK, ki.sm_count(scores.device))
        if row["select_segments"]:  # the threshold path; the one-program radix select beside it
            row["radix_select_ms"] = timer.ms(
                lambda s=scores, c=cand: ki.select_topk(s, INDEX_TOPK, c, segments=0)
            )
        fits = kr.supports(c)  # rows that fit a program: the row selection beside the others
        if fits:
            row["rows_select_ms"] = timer.ms(lambda s=scores, c=cand: kr.select_topk_rows(s, INDEX_TOPK, c))
        row["torch_topk_ms"] = timer.ms(lambda s=scores: torch.topk(s, INDEX_TOPK, dim=1, sorted=True))
        # the exact torch.topk path of the backend (64-bit keys: ties to the earlier column)
        row["torch_exact_ms"] = timer.ms(lambda s=scores, c=cand: select_topk_torch(s, INDEX_TOPK, c))
        if a.check:
            exact = select_topk_torch(scores, k, cand)
            row["torch_exact_equals_radix"] = bool(torch.equal(exact, ki.select_topk(scores, k, cand)))
            if fits:
                rows_picks = kr.select_topk_rows(scores, k, cand)
                row["torch_exact_equals_rows"] = bool(torch.equal(exact, rows_picks))
        row["roofline_ms"] = roofline_ms(inp["bytes"], inp["flops"], a.peak_bytes)
        indexer_tilelang.measure(row, args, scores, timer.ms, a.tune)
        if a.tune:
            row["tune"] = tune_indexer(args, scores, timer)
        rows.append(row)
        saved()
        print_indexer_row(row)


def tune_indexer(args: tuple, scores: torch.Tensor, timer) -> list[dict]:
    """``--tune`` of one indexer row: the Triton tiles, the row selection's warps, the threshold
    path's segments and its sorting programs' widths (each checked bit for bit against the
    default), and the selection's time by kernel."""
    from deepinfer_cuda_sm100.kernels import indexer as ki
    from deepinfer_cuda_sm100.kernels import indexer_rows as kr

    q, w, keys, cand, k, scale = args
    out = []
    for block_c, blocks, warps, sel_block, sel_warps in (
        (64, 8, 4, 2048, 8),
        (128, 4, 4, 1024, 4),
        (128, 4, 8, 4096, 8),
        (64, 4, 4, 2048, 4),
        (32, 8, 4, 1024, 8),
    ):
        cfg = ki.IndexerConfig(block_c, blocks, warps, sel_block, sel_warps)
        try:
            score_ms = timer.ms(lambda cfg=cfg: ki.indexer_scores(q, w, keys, cand, scale, config=cfg))
            select_ms = timer.ms(lambda cfg=cfg: ki.select_topk(scores, k, cand, config=cfg))
        except Exception as exc:  # out of resources, ...
            out.append({"config": list(cfg.__dict__.values()), "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        out.append({"config": list(cfg.__dict__.values()), "score_ms": score_ms, "select_ms": select_ms})
        print(f"    tune {cfg}: scores {score_ms:.4f} ms, select {select_ms:.4f} ms")
    if kr.supports(scores.shape[1]):
        for warps in kr.candidate_warps(scores.shape[1]):  # the row selection's program width
            ms = timer.ms(lambda w=warps: kr.select_topk_rows(scores, k, cand, warps=w))
            out.append({"rows_select_warps": warps, "select_ms": ms})
            print(f"    tune row selection, {warps} warps: select {ms:.4f} ms")
        best = kr.select_topk_rows(scores, k, cand)  # the default's picks, best first
        cap = kr.capped_registers(scores.shape[1])  # the default width's register cap, where offered
        if cap is not None:
            capped = lambda: kr.select_topk_rows(scores, k, cand, registers=cap)  # noqa: E731
            same = bool(torch.equal(capped(), best))
            ms = timer.ms(capped)
            out.append({"rows_select_registers": cap, "select_ms": ms, "bitwise": same})
            print(f"    tune row selection, at most {cap} registers: select {ms:.4f} ms, bitwise {same}")
        # the picks in column order (batch-invariant mode's): the same picks without their sort,
        # what best-first order costs
        column = lambda: kr.select_topk_rows(scores, k, cand, column_order=True)  # noqa: E731
        same = bool(torch.equal(column().sort(-1).values, best.sort(-1).values))
        ms = timer.ms(column)
        out.append({"rows_select_column_order": True, "select_ms": ms, "same_picks": same})
        print(f"    tune row selection in column order (no sort): select {ms:.4f} ms, same picks {same}")
    g, _ = ki.filter_groups(min(k, scores.shape[1]))
    segments = 1
    while segments * g <= scores.shape[1]:  # the threshold path's segments per row (a multiple of G each)
        ms = timer.ms(lambda n=segments: ki.select_topk(scores, k, cand, segments=n))
        out.append({"select_segments": segments, "select_ms": ms})
        print(f"    tune threshold x{segments}: select {ms:.4f} ms")
        segments *= 2
    want = ki.select_topk(scores, k, cand)
    for widths in ((4, 8), (8, 8), (16, 16), (32, 32), (16, 32), (32, 16)):  # the sorting programs
        same = bool(torch.equal(ki.select_topk(scores, k, cand, sort_warps=widths), want))
        ms = timer.ms(lambda w=widths: ki.select_topk(scores, k, cand, sort_warps=w))
        out.append({"select_sort_warps": list(widths), "select_ms": ms, "bitwise": same})
        how = f"{widths[0]} / {widths[1]} warps"
        print(f"    tune threshold sorts at {how}: select {ms:.4f} ms, bitwise {same}")
    split = kernel_split(lambda: ki.select_topk(scores, k, cand))
    out.append({"select_kernels_us": split})
    print("    select by kernel: " + ", ".join(f"{name} {us:.1f} us" for name, us in split.items()))
    return out


def _select_path(r: dict) -> str:
    rows = f"; rows {r['rows_select_ms']:.4f}" if "rows_select_ms" in r else ""
    if not r.get("select_segments"):
        return "radix" + rows
    return f"threshold x{r['select_segments']}; radix {r['radix_select_ms']:.4f}" + rows


def print_indexer_row(r: dict) -> None:
    """One indexer row of the benchmark's table."""
    print(
        f"indexer T {r['T']:5} C {r['C']:6} k {r['k']}: {r['ms']:8.4f} ms (scores {r['score_ms']:.4f}, "
        f"select {r['select_ms']:.4f} [{_select_path(r)}] = {r['torch_topk_ms'] / r['select_ms']:.2f}x "
        f"torch.topk {r['torch_topk_ms']:.4f}; exact torch.topk {r['torch_exact_ms']:.4f})  "
        f"roofline {r['roofline_ms']:.4f} ms "
        f"({100 * r['roofline_ms'] / r['ms']:5.1f}%)"
        + indexer_tilelang.describe(r)
        + (f"  sets==topk {r['picks_equal_torch_topk_sets']}" if "picks_equal_torch_topk_sets" in r else "")
    )
