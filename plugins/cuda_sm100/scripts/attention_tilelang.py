"""The TileLang attention kernels in ``bench_attention.py``'s attention rows: the two-consumer
kernel (``tilelang``) and, where it takes the pools, the warp-specialised seesaw kernel
(``tilelang_ws``), each timed beside Triton's and, with ``--check``, compared with the
reference op."""

from __future__ import annotations

from collections.abc import Callable

import torch
from kernel_times import kernel_split

KERNELS = (("tilelang", "sparse_attention"), ("tilelang_ws", "sparse_attention_ws"))
"""``(row prefix, module of deepinfer_cuda_sm100.tl)`` of each TileLang attention kernel."""


def measure(row: dict, args: tuple, reference: Callable, ms: Callable, check: bool) -> None:
    """Add ``<prefix>_ms`` (and with ``check`` ``<prefix>_max_abs_err``, the largest absolute
    difference from the reference op) for each TileLang kernel that takes the call; nothing
    where TileLang cannot compile here or the two-consumer kernel refuses the call."""
    import importlib

    from deepinfer_cuda_sm100.attention_dispatch import available_languages, tilelang_supports
    from deepinfer_cuda_sm100.tl import tilelang_problem

    if tilelang_problem() is not None or tilelang_supports(*args) is not True:
        return
    want = reference(*args).float() if check else None
    languages = available_languages(args[0], args[1])  # those the dispatcher may pick for it
    for prefix, name in KERNELS:
        if prefix not in languages:
            continue
        module = importlib.import_module(f"deepinfer_cuda_sm100.tl.{name}")
        if check:
            row[f"{prefix}_max_abs_err"] = (module.sparse_attention(*args).float() - want).abs().max().item()
        row[f"{prefix}_ms"] = ms(lambda m=module: m.sparse_attention(*args))


def describe(row: dict) -> str:
    """The TileLang kernels' times (and % of the roofline) of an attention ``row``."""
    out = ""
    for prefix, label in (("tilelang", "tilelang"), ("tilelang_ws", "seesaw")):
        t = row.get(f"{prefix}_ms")
        if t:
            out += f"{label} {t:8.4f} ms ({100 * row['roofline_ms'] / t:5.1f}%)  "
        elif prefix == "tilelang":
            out += "tilelang -  "
    return out


def errors(row: dict) -> str:
    """`` / <error>`` for each TileLang kernel checked against the reference."""
    return "".join(
        f" / {row[k]:.2e}" for k in ("tilelang_max_abs_err", "tilelang_ws_max_abs_err") if k in row
    )


def tune_seesaw(args: tuple, ms: Callable) -> list[dict]:
    """The seesaw kernel's :class:`~deepinfer_cuda_sm100.tl.sparse_attention_ws.Schedule`
    variants that apply to the call's pools, each timed and compared bit for bit with the
    default schedule's output (every variant promises the same bits), the split counts
    (:func:`tune_seesaw_splits`), and the op's device time by kernel (prologue, attention,
    combine; plain launches, so under PDL a kernel's time includes its wait for the one
    before)."""
    import dataclasses

    from deepinfer_cuda_sm100.tl import sparse_attention_ws as tlw

    from deepinfer_core.ops.kv_format import PackedKVPool

    out, want = [], tlw.sparse_attention(*args)
    for schedule in tlw.variants(isinstance(args[1][0], PackedKVPool)):
        entry = {"seesaw_schedule": dataclasses.asdict(schedule)}
        try:
            entry["bitwise"] = bool(torch.equal(tlw.sparse_attention(*args, schedule=schedule), want))
            entry["ms"] = ms(lambda schedule=schedule: tlw.sparse_attention(*args, schedule=schedule))
        except Exception as exc:  # a variant that does not compile or launch here
            entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
        out.append(entry)
        t = entry.get("ms", float("nan"))
        print(f"    tune seesaw {schedule}: {t:.4f} ms, bitwise {entry.get('bitwise')}")
    out += tune_seesaw_splits(args, ms)
    split = kernel_split(lambda: tlw.sparse_attention(*args))
    out.append({"seesaw_kernels_us": split})
    print("    seesaw by kernel: " + ", ".join(f"{name} {us:.1f} us" for name, us in split.items()))
    return out


def tune_seesaw_splits(args: tuple, ms: Callable) -> list[dict]:
    """The seesaw kernel at one split, two, four and the other kernel's split plan (those up
    to that plan's count), each with the combine kernel, beside the split count its own plan
    (:func:`~deepinfer_cuda_sm100.tl.sparse_attention_ws.plan_splits`) takes: what
    ``SPLIT_CTAS``, ``FEW_KEYS`` and the plan rest on.  Nothing where the other plan takes one split."""
    from deepinfer_cuda_sm100.tl import sparse_attention as tla
    from deepinfer_cuda_sm100.tl import sparse_attention_ws as tlw

    tokens, heads, keys = args[0].shape[0], args[0].shape[1], tla.max_keys(args[2])
    sms = tla.num_sms(args[0].device)
    other = tla.plan_splits(tokens, heads, keys, sms)
    if other == 1:
        return []
    planned = tlw.plan_splits(tokens, heads, keys, sms, tla.fp8_geometry(args[1]) is not None)
    out = []
    for splits in sorted({s for s in (1, 2, 4) if s < other} | {other}):
        label = "the other kernel's plan" if splits == other else "forced"
        t = ms(lambda splits=splits: tla.launch(*args, tlw._kernel, lambda *shape: splits))
        out.append({"seesaw_splits": splits, "planned": planned, "ms": t})
        print(f"    tune seesaw splits, {label} ({splits}, combined): {t:.4f} ms (its plan: {planned})")
    return out
