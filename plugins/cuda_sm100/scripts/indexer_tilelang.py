"""The TileLang indexer scores in ``bench_attention.py``'s indexer rows: their time beside the
Triton scores', their agreement with them, the grouped kernel's time and bits beside the
one-token kernel's, the backend op as dispatched, and (``--tune``) the blocks (and tokens) a CTA
takes."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def measure(row: dict, args: tuple, triton_scores: torch.Tensor, ms: Callable, tune: bool) -> None:
    """Add the TileLang scores' figures to an indexer ``row`` (nothing where TileLang cannot
    serve the call): ``tilelang_score_ms``; ``tilelang_score_max_rel_err`` (largest difference
    from the Triton scores over the largest Triton score; ``-inf`` where both are);
    ``tilelang_rows_with_other_picks`` (query rows whose set of picks on the TileLang scores
    differs from that on the Triton scores: near-ties resolved by rounding); the backend's
    dispatched op, ``backend_ms``; with ``tune``, ``tilelang_tune`` (ms per blocks a CTA)."""
    from deepinfer_cuda_sm100 import indexer_select
    from deepinfer_cuda_sm100.kernels import indexer as ki
    from deepinfer_cuda_sm100.tl import indexer as tli
    from deepinfer_cuda_sm100.tl import tilelang_problem

    q, w, keys, cand, k, scale = args
    row["backend_ms"] = ms(lambda: indexer_select.indexer_topk(*args))
    if tilelang_problem() is not None or tli.supports(q, w, keys, cand) is not True:
        return
    got = tli.indexer_scores(q, w, keys, cand, scale)
    finite = torch.isfinite(triton_scores)
    if not torch.equal(finite, torch.isfinite(got)):
        row["tilelang_score_max_rel_err"] = float("inf")
    else:
        diff = (got[finite] - triton_scores[finite]).abs().max()
        row["tilelang_score_max_rel_err"] = float(diff / triton_scores[finite].abs().max())
    picks = ki.select_topk(got, k, cand).sort(dim=1).values
    other = (picks != ki.select_topk(triton_scores, k, cand).sort(dim=1).values).any(dim=1)
    row["tilelang_rows_with_other_picks"] = int(other.sum())
    row["tilelang_score_ms"] = ms(lambda: tli.indexer_scores(q, w, keys, cand, scale))
    if tune:
        row["tilelang_tune"] = {
            str(b): ms(lambda b=b: tli.indexer_scores(q, w, keys, cand, scale, blocks=b))
            for b in tli.BLOCK_CHOICES
        }
    measure_grouped(row, args, got, ms, tune)


def measure_grouped(row: dict, args: tuple, one_token: torch.Tensor, ms: Callable, tune: bool) -> None:
    """The grouped TileLang scores (several tokens of a request a CTA) beside the one-token
    kernel's ``one_token`` scores: ``grouped_bitwise`` (whether they are equal bit for bit, as
    promised), ``grouped_score_ms``; with ``tune``, ``grouped_tune`` (ms per group size and
    blocks a CTA) and ``grouped_variants``: the default group's time and bits at one and at two
    warpgroups a CTA, at two with the GEMMs overlapped (``tl.indexer_grouped.OVERLAP``), and
    overlapped with the epilogues' bookkeeping hoisted (``tl.indexer_grouped.HOIST``)."""
    from deepinfer_cuda_sm100.tl import indexer as tli
    from deepinfer_cuda_sm100.tl import indexer_grouped as tlg

    q, w, keys, cand, k, scale = args
    if tlg.supports(q, w, keys, cand) is not True:
        return
    row["grouped_bitwise"] = bool(torch.equal(tlg.indexer_scores(q, w, keys, cand, scale), one_token))
    row["grouped_score_ms"] = ms(lambda: tlg.indexer_scores(q, w, keys, cand, scale))
    if tune:
        row["grouped_tune"] = {
            f"{g}x{b}": ms(lambda g=g, b=b: tlg.indexer_scores(q, w, keys, cand, scale, blocks=b, group=g))
            for g in tlg.GROUP_CHOICES
            for b in tli.BLOCK_CHOICES
        }
        row["grouped_variants"] = {}
        for wgs, overlap, hoist in ((1, False, False), (2, False, False), (2, True, False), (2, True, True)):
            run = functools.partial(
                tlg.indexer_scores, q, w, keys, cand, scale, warpgroups=wgs, overlap=overlap, hoist=hoist
            )
            name = f"{wgs} warpgroup{'s' if wgs > 1 else ''}{', overlapped' if overlap else ''}"
            name += ", hoisted" if hoist else ""
            row["grouped_variants"][name] = {"bitwise": bool(torch.equal(run(), one_token)), "ms": ms(run)}


def describe(row: dict) -> str:
    """The TileLang part of an indexer row's printed line (empty where it did not run)."""
    if "tilelang_score_ms" not in row:
        return f"  backend {row['backend_ms']:.4f} ms" if "backend_ms" in row else ""
    tune = row.get("tilelang_tune")
    grouped = ""
    if "grouped_score_ms" in row:
        grouped = f"  grouped {row['grouped_score_ms']:.4f} ms (bitwise {row['grouped_bitwise']})"
        if "grouped_tune" in row:
            grouped += f"  grouped tune {row['grouped_tune']}"
            for name, v in row["grouped_variants"].items():
                grouped += f"  grouped at {name} {v['ms']:.4f} ms (bitwise {v['bitwise']})"
    return (
        f"  tilelang scores {row['tilelang_score_ms']:.4f} ms "
        f"(rel err {row['tilelang_score_max_rel_err']:.1e}, "
        f"rows with other picks {row['tilelang_rows_with_other_picks']})  backend {row['backend_ms']:.4f} ms"
        + (f"  tune {tune}" if tune else "")
        + grouped
    )
