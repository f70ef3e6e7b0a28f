"""Write a kernel benchmark's measured paths into the backend's choice table
(:mod:`deepinfer_cuda_sm100.kernel_choice`): one function per benchmark, each replacing only
its own op's points of the shapes it measured (``--write-choices`` of ``bench_attention.py``,
``bench_fp8_gemm.py`` and ``bench_moe.py``)."""

from __future__ import annotations

import importlib
import shlex
import sys
import time
from pathlib import Path

import torch

HEADS, HEAD_DIM = 64, 512
"""The attention benchmark's shape (DeepSeek-V4-Flash)."""
GRAPH_FLUSHED = (
    "mean of the calls replayed in one CUDA graph, L2 flushed before each call "
    "(the flush's time subtracted), after warm-ups"
)
"""How ``bench_attention.py`` and ``bench_tilekernels.py`` time a call."""
GEMV_COLUMN = "triton_gemv_fp4_us"
"""``bench_moe.py``'s column of the decode-width GEMVs' times (language ``triton_gemv``)."""
DEQUANT_COLUMN = "triton_dequant_fp4_us"
"""``bench_moe.py``'s column of the dequantised experts' times (language ``triton_dequant``)."""
GROUPED_COLUMN = "cublas_grouped_fp4_us"
"""``bench_moe.py``'s column of the grouped GEMMs' times on FP4 stacks (language ``cublas_grouped``)."""
GROUPED_BF16_COLUMN = "cublas_grouped_bf16_us"
"""``bench_moe.py``'s column of the grouped GEMMs' times on bf16 stacks (kind ``bf16``)."""


def merge(points: list[dict], command: str, timing: str, packages: tuple[str, ...] = ("triton",)) -> Path:
    """Merge ``points`` into this GPU's table (:func:`~deepinfer_cuda_sm100.kernel_choice.
    merge_points`) with their source: the device, torch's and ``packages``' versions, the
    command that measured them (this process's own when it runs a benchmark script, with its
    arguments; else ``command``), today's date and how they were ``timing``-ed."""
    from deepinfer_cuda_sm100 import kernel_choice

    script = Path(sys.argv[0])
    if script.name.startswith("bench_") and script.suffix == ".py":
        command = shlex.join(["python", f"plugins/cuda_sm100/scripts/{script.name}", *sys.argv[1:]])

    major, minor = torch.cuda.get_device_capability()
    versions = [f"torch {torch.__version__}"]
    versions += [f"{name.replace('_', '-')} {importlib.import_module(name).__version__}" for name in packages]
    source = {
        "device": f"{torch.cuda.get_device_name()} (sm_{major}{minor})",
        "software": ", ".join(versions),
        "command": command,
        "measured": time.strftime("%Y-%m-%d"),
        "timing": timing,
    }
    return kernel_choice.merge_points(f"sm{major}{minor}", points, source)


def write_attention_choices(results: dict) -> Path:
    """The kernel-language table (:mod:`deepinfer_cuda_sm100.kernel_choice`) of the attention
    rows that timed both languages (and the seesaw TileLang kernel, ``tilelang_ws``, where it
    ran), written where the package reads it."""
    points = [
        {
            "op": "sparse_attention",
            "kind": r["choice_key"]["kind"],
            "dtype": "bfloat16",
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "tokens": r["batch"],
            "keys": r["choice_key"]["keys"],
            "ms": {"triton": round(r["ms"], 5), "tilelang": round(r["tilelang_ms"], 5)}
            | ({"tilelang_ws": round(r["tilelang_ws_ms"], 5)} if "tilelang_ws_ms" in r else {}),
        }
        for r in results["attention"]
        if "tilelang_ms" in r
    ]
    command = "python plugins/cuda_sm100/scripts/bench_attention.py --only attention --write-choices"
    return merge(points, command, GRAPH_FLUSHED, ("triton", "tilelang"))


def select_times(row: dict) -> dict[str, float]:
    """An indexer row's selection paths in ms: the radix select (``triton``), the threshold
    path where the kernel's plan takes it at that shape, the row selection (``triton_rows``)
    where the rows are short enough for it, and the exact ``torch.topk``."""
    ms = {"torch": round(row["torch_exact_ms"], 5)}
    if "rows_select_ms" in row:
        ms["triton_rows"] = round(row["rows_select_ms"], 5)
    if row.get("select_segments"):  # select_ms timed the threshold path, radix_select_ms the radix
        ms["threshold"] = round(row["select_ms"], 5)
        ms["triton"] = round(row["radix_select_ms"], 5)
    else:
        ms["triton"] = round(row["select_ms"], 5)
    return ms


def write_select_choices(rows: list[dict]) -> Path:
    """The indexer selection's paths (:func:`select_times`) per ``T x C`` as ``indexer_select``
    points of the measured table (paged candidates, as measured)."""
    from deepinfer_cuda_sm100.indexer_select import OP

    points = [
        {
            "op": OP,
            "kind": "paged",
            "dtype": "float32",
            "heads": 0,
            "head_dim": 0,
            "tokens": r["T"],
            "keys": r["C"],
            "ms": select_times(r),
        }
        for r in rows
        if not r.get("causal")  # the table's points are full rows
    ]
    command = "python plugins/cuda_sm100/scripts/bench_attention.py --only indexer --write-choices"
    return merge(points, command, "mean of the calls replayed in one CUDA graph, L2 flushed before each call")


def write_score_choices(rows: list[dict]) -> Path | None:
    """The indexer scores' paths (Triton, and the TileLang kernels where they ran) per ``T x C`` as
    ``indexer_scores`` points of the measured table (paged candidates, bfloat16, 64 heads of
    128, as measured); ``None`` when no row timed TileLang."""
    from deepinfer_cuda_sm100.indexer_select import SCORE_OP

    def times(r: dict) -> dict[str, float]:
        ms = {"triton": r["score_ms"], "tilelang": r["tilelang_score_ms"]}
        if "grouped_score_ms" in r:
            ms["tilelang_grouped"] = r["grouped_score_ms"]
        return {path: round(v, 5) for path, v in ms.items()}

    points = [
        {"op": SCORE_OP, "kind": "paged", "dtype": "bfloat16", "heads": 64, "head_dim": 128,
         "tokens": r["T"], "keys": r["C"], "ms": times(r)}
        for r in rows
        if "tilelang_score_ms" in r and not r.get("causal")  # the table's points are full rows
    ]  # fmt: skip
    if not points:
        return None
    command = "python plugins/cuda_sm100/scripts/bench_attention.py --only indexer --write-choices"
    return merge(points, command, GRAPH_FLUSHED, ("triton", "tilelang"))


def dense_points(rows: list[dict]) -> list[dict]:
    """``bench_dense_gemv.py``'s rows as ``linear_dense`` points (dicts of
    :class:`~deepinfer_cuda_sm100.kernel_choice.Point`'s fields): per (N x K, M) cuBLAS
    (``cublas``) and the dense GEMV (``triton``) in ms, bf16 weights; a shape that lacks either
    (the GEMV refused it, a timing failed) is no point, and the sweep's rows are no path."""
    from deepinfer_cuda_sm100.gemm_dispatch import DENSE_OP

    by_shape: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["path"] in ("cublas", "gemv"):
            path = "triton" if r["path"] == "gemv" else "cublas"
            by_shape.setdefault((r["n"], r["k"], r["m"]), {})[path] = round(r["us"] / 1e3, 5)
    return [
        {"op": DENSE_OP, "kind": "w16", "dtype": "bfloat16", "heads": n, "head_dim": k,
         "tokens": m, "keys": k, "ms": ms}
        for (n, k, m), ms in by_shape.items()
        if len(ms) == 2
    ]  # fmt: skip


def write_dense_choices(rows: list[dict]) -> Path:
    """:func:`dense_points` merged into this GPU's measured table."""
    command = "python plugins/cuda_sm100/scripts/bench_dense_gemv.py --write-choices"
    return merge(dense_points(rows), command, "mean of the calls replayed in CUDA graphs (bf16 activations)")


def write_gemm_choices(rows: list[dict], grouped: list[dict] = ()) -> Path:
    """The W8A16 paths' times per (N x K, M) as ``linear_fp8`` points of the measured table (the
    TileLang GEMM's where it ran), the W8A8 prefill paths', and the grouped GEMM's per (G*N x K,
    G, M) as ``grouped_linear_fp8`` points (TileLang's where it ran)."""
    from deepinfer_cuda_sm100.gemm_dispatch import GROUPED_OP, OP

    def point(r: dict, math: str, ms: dict) -> dict:
        return {"op": OP, "kind": math, "dtype": "bfloat16", "heads": r["N"], "head_dim": r["K"],
                "tokens": r["M"], "keys": r["K"], "ms": ms}  # fmt: skip

    def w8a16(r: dict) -> dict:
        ms = {"triton": r["triton_w8a16_us"] / 1e3, "cublas": r["dequant_cublas_us"] / 1e3}
        if r.get("tilelang_us"):
            ms["tilelang"] = r["tilelang_us"] / 1e3
        return ms

    points = [point(r, "w8a16", w8a16(r)) for r in rows if r["triton_w8a16_us"] and r["dequant_cublas_us"]]
    points += [
        point(
            r,
            "w8a8",
            {"triton": r["triton_w8a8_prefill_us"] / 1e3, "scaled_mm": r["backend_scaled_mm_us"] / 1e3},
        )
        for r in rows
        if r.get("triton_w8a8_prefill_us") and r.get("backend_scaled_mm_us")
    ]
    points += [
        {"op": GROUPED_OP, "kind": "w8a16", "dtype": "bfloat16", "heads": r["G"] * r["N"],
         "head_dim": r["K"], "tokens": r["M"], "keys": r["G"],
         "ms": {p: r[f"{p}_us"] / 1e3 for p in ("triton", "cublas", "tilelang") if r.get(f"{p}_us")}}
        for r in grouped
        if r["triton_us"] and r["cublas_us"]
    ]  # fmt: skip
    command = "python plugins/cuda_sm100/scripts/bench_fp8_gemm.py --write-choices"
    packages = ("triton", "tilelang") if any("tilelang" in p["ms"] for p in points) else ("triton",)
    return merge(points, command, "mean of the calls replayed in CUDA graphs (bf16 activations)", packages)


def moe_points(
    rows: list[dict], hidden: int, inter: int, experts: int, top_k: int, kind: str = "fp4"
) -> list[dict]:
    """The FP4 ``moe_experts`` paths' times (Triton and, where timed, TileLang, the wide TileLang
    variant ``tilelang_wide``, the decode-width GEMVs ``triton_gemv``, the dequantised experts
    ``triton_dequant`` and the grouped GEMMs ``cublas_grouped``; bf16 activations;
    ``kind``: the scales' storage, see :func:`~deepinfer_cuda_sm100.moe_dispatch.choice_kind`) per
    token count as ``moe_experts`` points of the measured table: ``tokens`` = (token, slot)
    pairs, ``keys`` = experts, ``heads`` / ``head_dim`` = hidden / intermediate widths
    (:mod:`deepinfer_cuda_sm100.moe_dispatch`).  Rows with none of the other paths' times are left
    out (nothing to choose there)."""
    from deepinfer_cuda_sm100.moe_dispatch import DEQUANT, GEMV, GROUPED, WIDE

    def ms(r: dict) -> dict:
        out = {"triton": round(r["triton_fp4_us"] / 1e3, 5)}
        timed = (
            ("tilelang", "tilelang_fp4_us"),
            (WIDE, "tilelang_wide_fp4_us"),
            (GEMV, GEMV_COLUMN),
            (DEQUANT, DEQUANT_COLUMN),
            (GROUPED, GROUPED_COLUMN),
        )
        for language, column in timed:
            if r.get(column):
                out[language] = round(r[column] / 1e3, 5)
        return out

    return [
        _moe_point(kind, hidden, inter, r["T"] * top_k, experts, ms(r))
        for r in rows
        if r.get("triton_fp4_us")
        and any(r.get(c) for c in ("tilelang_fp4_us", GEMV_COLUMN, DEQUANT_COLUMN, GROUPED_COLUMN))
    ]


def _moe_point(kind: str, hidden: int, inter: int, pairs: int, experts: int, ms: dict) -> dict:
    """One ``moe_experts`` point of the measured table (bf16 activations; the axes of
    :func:`moe_points`)."""
    from deepinfer_cuda_sm100.moe_dispatch import OP

    return {"op": OP, "kind": kind, "dtype": "bfloat16", "heads": hidden, "head_dim": inter,
            "tokens": pairs, "keys": experts, "ms": ms}  # fmt: skip


def moe_plain_points(rows: list[dict], hidden: int, inter: int, experts: int, top_k: int) -> list[dict]:
    """The bf16 stacks' ``moe_experts`` paths' times (Triton's ``triton_bf16_us`` and the grouped
    GEMMs' ``cublas_grouped``) as points of kind
    :data:`~deepinfer_cuda_sm100.moe_dispatch.PLAIN_KIND`, the axes of :func:`moe_points`; rows
    without both times are left out."""
    from deepinfer_cuda_sm100.moe_dispatch import GROUPED, PLAIN_KIND

    def ms(r: dict) -> dict:
        return {
            "triton": round(r["triton_bf16_us"] / 1e3, 5),
            GROUPED: round(r[GROUPED_BF16_COLUMN] / 1e3, 5),
        }

    return [
        _moe_point(PLAIN_KIND, hidden, inter, r["T"] * top_k, experts, ms(r))
        for r in rows
        if r.get("triton_bf16_us") and r.get(GROUPED_BF16_COLUMN)
    ]


def keeping_languages(points: list[dict], table) -> list[dict]:
    """``points`` without those that would replace a point of ``table`` (:class:`~deepinfer_cuda_sm100.
    kernel_choice.Point` s) of the same shape timed in a language they lack (a run where TileLang
    did not compile must not erase its times); each one left out is named on a line."""
    known = {(q.op, q.kind, q.dtype, q.heads, q.head_dim, q.tokens, q.keys): set(q.ms) for q in table}
    kept = []
    for p in points:
        key = (p["op"], p["kind"], p["dtype"], p["heads"], p["head_dim"], p["tokens"], p["keys"])
        lost = sorted(known.get(key, set()) - set(p["ms"]))
        if lost:
            print(
                f"{p['op']} at {p['tokens']} pairs / {p['keys']} experts not written: this run lacks {lost}"
            )
        else:
            kept.append(p)
    return kept


def write_moe_choices(
    rows: list[dict], hidden: int, inter: int, experts: int, top_k: int, kind: str = "fp4"
) -> Path:
    """:func:`moe_points` and :func:`moe_plain_points` of ``rows`` written into this GPU's table
    (replacing its ``moe_experts`` points of the same shapes and kinds, :func:`keeping_languages`)."""
    from deepinfer_cuda_sm100 import kernel_choice

    major, minor = torch.cuda.get_device_capability()
    table = kernel_choice.load_points(f"sm{major}{minor}")
    measured = moe_points(rows, hidden, inter, experts, top_k, kind) + moe_plain_points(
        rows, hidden, inter, experts, top_k
    )
    points = keeping_languages(measured, table)
    timing = "mean of the calls replayed in a CUDA graph (each call its own routing), after warm-ups"
    packages = ("triton", "tilelang") if any("tilelang" in p["ms"] for p in points) else ("triton",)
    return merge(points, "python plugins/cuda_sm100/scripts/bench_moe.py --write-choices", timing, packages)
