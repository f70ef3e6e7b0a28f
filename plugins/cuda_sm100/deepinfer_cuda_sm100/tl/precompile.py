"""Compile the TileLang kernels of given shapes ahead of use, in parallel processes, into
TileLang's disk cache (``~/.tilelang/cache``), so that neither a test run nor an engine's
warm-up compiles them one after another.

    python -m deepinfer_cuda_sm100.tl.precompile [--heads 64] [--dim 512] [--hidden 4096]
        [--inter 2048] [--gemm-shapes 4096x1024,...] [--grouped-shapes 8x4096x1024]
        [--index-heads 64] [--index-dim 128] [--jobs 8] [--arch 9.0] [--sms 132] [--all-splits]

Compiles ``sparse_attention``'s configurations (plain and packed-FP8 pools, with and without
a paged source, direct and split-KV; the seesaw kernel's on plain pools) and the split
combine, bfloat16, and the FP4
``moe_experts`` GEMMs (gate / up and down, every tile height and scale format, one and two
consumer warpgroups), and the FP8
``linear`` GEMM (:mod:`deepinfer_cuda_sm100.tl.fp8_gemm`, ``M <= 256``: every token tile, both
scale formats, the split sums in the launch) of each ``K x N`` weight and each grouped ``G x K x N``
projection (``grouped_linear``), and the indexer's scores
(:mod:`deepinfer_cuda_sm100.tl.indexer`, explicit and paged candidates;
:mod:`deepinfer_cuda_sm100.tl.indexer_grouped`, several tokens a CTA), for
DeepSeek-V4-Flash's shapes by default (split plans for this machine's GPU, an H100 / H200's
132 SMs without one).
Prints each configuration's compile time; exits 1 naming what failed.

The FP8 GEMMs are compiled at the K split counts calls run (the measured table's,
:mod:`deepinfer_cuda_sm100.gemm_splits`, else the plan's rule); ``--all-splits`` at every
candidate count, which ``plugins/cuda_sm100/scripts/bench_gemm_splits.py`` times.

``--arch 9.0`` compiles for that compute capability on a machine without such a GPU (the CUDA
toolkit is enough; :mod:`deepinfer_cuda_sm100.tl.target`), with the PDL prologue where that
capability takes it and the GEMM plans sized for ``--sms`` SMs (default 132): the kernels land
under the same cache keys the GPU machine's processes look up, so a cache directory built so
(``TILELANG_CACHE_DIR``) and copied to ``~/.tilelang/cache`` there spares it the compiles.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from deepinfer_cuda_sm100.gemm_dispatch import V4_FLASH_GROUPED, V4_FLASH_SHAPES
from deepinfer_cuda_sm100.tl import compile_log
from deepinfer_cuda_sm100.tl.pdl import tl_pdl_enabled
from deepinfer_cuda_sm100.tl.target import ARCH_ENV, capability_problem


def _fp8_geometry(dim: int, rope_dim: int):
    """The packed FP8 pool's row geometry (``kv_cache_dtype="fp8"``) at these widths."""
    from deepinfer_core.ops.kv_format import fp8_row_layout
    from deepinfer_cuda_sm100.tl.sparse_attention import Fp8Geometry

    lay = fp8_row_layout(dim, rope_dim)
    return Fp8Geometry(lay.nope, lay.rope_offset, lay.scale_offset, lay.groups)


def configurations(heads: int, dim: int, rope_dim: int) -> list[tuple]:
    """``_kernel`` arguments of every configuration of the shape."""
    fp8 = _fp8_geometry(dim, rope_dim)
    pdl = tl_pdl_enabled()
    out = [("combine", False, False, heads, dim, "bfloat16", None, pdl)]
    for geometry in (None, fp8):
        for paged in (False, True):
            for split in (False, True):
                out.append(("attention", paged, split, heads, dim, "bfloat16", geometry, pdl))
    return out


def moe_configurations(hidden: int, inter: int) -> list[tuple]:
    """``tl.moe._kernel`` arguments of every FP4 ``moe_experts`` configuration of the widths:
    both GEMMs, each tile height the layout uses (``kernels.moe.tile_rows``: 16, 32, 64; the
    wide variant also ``tl.moe.PREFILL_BLOCK_M``, ``tl.moe.tile_height``), both scale formats
    and both variants (``consumers`` 1 and 2; the wide one where its widths fit,
    ``tl.moe.wide_problem``), at the ring depth the op runs (``tl.moe.STAGES``), with the bf16
    routing weights ``moe_route`` gives, split registers, and the PDL prologue where this
    device takes it; and the one-warpgroup gate / up kernels reading the rows gathered first
    (``gathered``: calls of up to ``tl.moe.GATHER_MAX_TOKENS`` tokens)."""
    from deepinfer_cuda_sm100.tl.moe import CONSUMERS, PREFILL_BLOCK_M, SCALE_KINDS, STAGES, wide_problem

    variants = [c for c in CONSUMERS if c == 1 or wide_problem(hidden, inter) is None]
    pdl = tl_pdl_enabled()
    heights = (16, 32, 64)
    out = [
        (kind, hidden, inter, bm, scale, consumers, STAGES, "bfloat16", True, pdl)
        for consumers in variants
        for kind in ("gate_up", "down")
        for bm in heights + ((PREFILL_BLOCK_M,) if consumers != 1 else ())
        for scale in SCALE_KINDS
    ]
    gathered = ("gate_up", hidden, inter)  # the one-warpgroup kernel reading rows gathered first
    rest = (1, STAGES, "bfloat16", True, pdl, True)
    out += [(*gathered, bm, scale, *rest) for bm in heights for scale in SCALE_KINDS]
    return out


GEMM_SHAPES = V4_FLASH_SHAPES
"""``K x N`` of DeepSeek-V4-Flash's FP8 dense projections (as ``bench_fp8_gemm.py``)."""


GROUPED_SHAPES = V4_FLASH_GROUPED
"""``G x K x N`` of DeepSeek-V4-Flash's grouped output projection."""


def gemm_configurations(shapes: str, sms: int, grouped: str = "", all_splits: bool = False) -> list[tuple]:
    """``tl.fp8_gemm._kernel`` arguments of every launch (``M <= 256``) of the ``K x N`` weights
    and of the grouped ``G x K x N`` projections, at the K splits calls run
    (:mod:`deepinfer_cuda_sm100.gemm_splits`: the measured table's for the architecture
    compiled for, else the plan's rule), or at every candidate count (``all_splits``: what
    ``bench_gemm_splits.py`` times)."""
    from deepinfer_cuda_sm100.gemm_splits import measured_splits, table_arch
    from deepinfer_cuda_sm100.tl.fp8_gemm import configurations as fp8_configurations
    from deepinfer_cuda_sm100.tl.fp8_gemm import split_candidates

    arch = table_arch()
    out = []
    for g, k, n in weight_shapes(shapes, grouped):

        def splits_of(block_m: int, g=g, k=k, n=n) -> list[int | None]:
            return split_candidates(k) if all_splits else [measured_splits(block_m, g * n, k, sms, g, arch)]

        out += fp8_configurations(g * n, k, sms, groups=g, splits_of=splits_of)
    return list(dict.fromkeys(out))


def weight_shapes(shapes: str, grouped: str = "") -> list[tuple[int, int, int]]:
    """``(groups, K, N)`` of each ``K x N`` weight of ``shapes`` (groups 1) and each ``G x K x N``
    grouped projection of ``grouped`` (comma-separated; ``""`` for none)."""
    out = [(1, *(int(v) for v in s.split("x"))) for s in filter(None, shapes.split(","))]
    return out + [tuple(int(v) for v in s.split("x")) for s in filter(None, grouped.split(","))]


def indexer_configurations(heads: int, dim: int) -> list[tuple]:
    """``tl.indexer._kernel`` arguments of the indexer scores: both candidate forms, every
    blocks-per-CTA choice, bfloat16, with the PDL prologue where this device takes it."""
    from deepinfer_cuda_sm100.tl.indexer import BLOCK_CHOICES, KINDS

    pdl = tl_pdl_enabled()
    return [(kind, heads, dim, "bfloat16", blocks, pdl) for kind in KINDS for blocks in BLOCK_CHOICES]


def grouped_indexer_configurations(heads: int, dim: int) -> list[tuple]:
    """``tl.indexer_grouped._kernel`` arguments, as :func:`~deepinfer_cuda_sm100.tl.
    indexer_grouped.indexer_scores` passes them: every blocks-per-CTA choice at the default
    group size, warpgroups and overlap (the ones the dispatcher runs), bfloat16, with the PDL prologue
    where this device takes it."""
    from deepinfer_cuda_sm100.tl.indexer import BLOCK_CHOICES
    from deepinfer_cuda_sm100.tl.indexer_grouped import GROUP, WARPGROUPS, overlaps

    layout = (tl_pdl_enabled(), WARPGROUPS, overlaps(GROUP))
    return [(heads, dim, "bfloat16", blocks, GROUP, *layout) for blocks in BLOCK_CHOICES]


def _sms(given: int = 0) -> int:
    """The SM count the GEMM plans are sized for: ``given``, else this machine's GPU's, else an
    H100 / H200's."""
    import torch

    from deepinfer_cuda_sm100.kernels.fp8_gemm import DEFAULT_SMS

    if given:
        return given
    if not torch.cuda.is_available():
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(0).multi_processor_count


def _compile(module: str, config: tuple) -> float:
    """Compile one configuration: ``deepinfer_cuda_sm100.tl.<module>._kernel(*config)`` (its time
    is printed here, so the engine's warning about a compile is not)."""
    compile_log.logger.setLevel(logging.ERROR)
    t0 = time.perf_counter()
    importlib.import_module(f"deepinfer_cuda_sm100.tl.{module}")._kernel(*config)
    return time.perf_counter() - t0


def seesaw_configurations(heads: int, dim: int, rope_dim: int) -> list[tuple]:
    """``sparse_attention_ws._kernel`` arguments: plain pools and the packed FP8 ones (where the
    kernel takes their row geometry), with and without a paged source, direct and split-KV."""
    from deepinfer_cuda_sm100.tl.sparse_attention_ws import fp8_supports

    fp8 = _fp8_geometry(dim, rope_dim)
    geometries = (None, fp8) if fp8_supports(fp8, dim) is True else (None,)
    pdl = tl_pdl_enabled()
    return [
        (paged, split, heads, dim, "bfloat16", geometry, pdl)
        for geometry in geometries
        for paged in (False, True)
        for split in (False, True)
    ]


def jobs(a: argparse.Namespace) -> list[tuple[str, tuple]]:
    """Every ``(module, configuration)`` the options name."""
    out = [("sparse_attention", c) for c in configurations(a.heads, a.dim, a.rope_dim)]
    out += [("sparse_attention_ws", c) for c in seesaw_configurations(a.heads, a.dim, a.rope_dim)]
    out += [("moe", c) for c in moe_configurations(a.hidden, a.inter)]
    out += [("indexer", c) for c in indexer_configurations(a.index_heads, a.index_dim)]
    out += [("indexer_grouped", c) for c in grouped_indexer_configurations(a.index_heads, a.index_dim)]
    gemms = gemm_configurations(a.gemm_shapes, _sms(a.sms), a.grouped_shapes, a.all_splits)
    return out + [("fp8_gemm", c) for c in gemms]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (the defaults: DeepSeek-V4-Flash's shapes)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=4096, help="MoE hidden width D")
    p.add_argument("--inter", type=int, default=2048, help="MoE expert intermediate width I")
    p.add_argument("--gemm-shapes", default=GEMM_SHAPES, help="FP8 linear weights, KxN comma-separated")
    p.add_argument(
        "--grouped-shapes", default=GROUPED_SHAPES, help="FP8 grouped projections, GxKxN comma-separated"
    )
    p.add_argument("--index-heads", type=int, default=64, help="indexer heads")
    p.add_argument("--index-dim", type=int, default=128, help="indexer head dim")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument(
        "--all-splits",
        action="store_true",
        help="compile the FP8 GEMMs at every K split count, not only those the calls run "
        "(what bench_gemm_splits.py times)",
    )
    p.add_argument(
        "--arch",
        default="",
        help="compute capability to compile for (e.g. 9.0) instead of this machine's GPU: a build "
        "host without that GPU fills the cache (TILELANG_CACHE_DIR) the GPU machine loads",
    )
    p.add_argument(
        "--sms",
        type=int,
        default=0,
        help="SMs the GEMM plans are sized for (default: the GPU's, else 132)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from deepinfer_cuda_sm100.tl import tilelang_problem

    arch_problem = capability_problem(a.arch) if a.arch else None
    problem = tilelang_problem() or (arch_problem and f"--arch {arch_problem}")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    if a.arch:  # the workers inherit it: every kernel built for that capability (tl.target)
        os.environ[ARCH_ENV] = a.arch
    failed = []
    # spawned workers: this process may have initialised CUDA (the SM count), which a fork cannot inherit
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=a.jobs, mp_context=spawn) as pool:
        futures = {pool.submit(_compile, module, c): c for module, c in jobs(a)}
        for future in as_completed(futures):
            config = futures[future]
            try:
                print(f"compiled {config} in {future.result():.1f} s", flush=True)
            except Exception as exc:  # reported, the others go on
                failed.append(f"{config}: {type(exc).__name__}: {str(exc).splitlines()[-1][:200]}")
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
