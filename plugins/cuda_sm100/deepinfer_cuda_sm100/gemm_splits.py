"""The TileLang FP8 GEMM's K splits per weight shape and token tile, by measurement.

:func:`~deepinfer_cuda_sm100.tl.fp8_gemm.launch_plan` derives a split count from the shape: the
fewest whole-block splits of K whose CTAs fill the SMs.  The rule counts CTAs only; it does not
see what a split costs (each split writes an fp32 partial ``[M, N]`` that a second launch reads
back, at 64 tokens and K = 1024 half the weight's own bytes) nor what too few K steps a CTA cost
its pipeline.  Where the measured table of this GPU's architecture
(:mod:`deepinfer_cuda_sm100.kernel_choice`, op :data:`SPLITS_OP`, kind :func:`kind` -- a
grouped projection's apart --, dtype ``"bfloat16"``, keyed by the weight's ``N x K``, the token
tile ``BLOCK_M`` as the tokens and the groups as the keys) timed the candidate counts
(:func:`~deepinfer_cuda_sm100.tl.fp8_gemm.split_candidates`, each a "language" named by its
count), the fastest is taken, the rule's count kept unless another was faster by more than
:data:`~deepinfer_cuda_sm100.kernel_choice.MARGIN`.  ``python
plugins/cuda_sm100/scripts/bench_gemm_splits.py --write-choices`` measures it; precompile compiles
the counts the table picks.  Every count gives the contract's result, differing only in the
order of the fp32 accumulation; the choice depends on static shapes only (graph capturable),
and the batch-invariant mode never runs this GEMM.
"""

from __future__ import annotations

from deepinfer_cuda_sm100 import kernel_choice

SPLITS_OP = "linear_fp8_splits"
"""The op name of the split points in the measured table."""
DTYPE = "bfloat16"


def kind(groups: int) -> str:
    """The table kind of a weight of ``groups`` row blocks: ``"w8a16"`` for a plain weight,
    ``"w8a16-grouped"`` for a grouped projection (whose CTAs read their own group's inputs), so
    a plain weight never takes a grouped one's points."""
    return "w8a16" if groups == 1 else "w8a16-grouped"


def table_arch() -> str | None:
    """The architecture whose table decides (``"sm90"``): the one TileLang builds for where
    ``DEEPINFER_TILELANG_ARCH`` names it (precompile ``--arch``; ``tl.target.target_capability``),
    else the current CUDA device's, else ``None`` (no table: the rule)."""
    import torch

    from deepinfer_cuda_sm100.tl.target import target_capability

    capability = target_capability()
    if capability is not None:
        return "sm{}{}".format(*capability)
    return kernel_choice.device_arch(torch.device("cuda")) if torch.cuda.is_available() else None


def measured_splits(m: int, n: int, k: int, sms: int, groups: int, arch: str | None) -> int | None:
    """The split count the table picks for an ``M``-token call of an ``N x K`` weight
    (``groups``: 1, or a grouped projection's ``G``) on ``sms`` SMs, or ``None`` where it keeps
    the rule's (no table, no point for the shape, or no count faster by the margin)."""
    from deepinfer_cuda_sm100.tl.fp8_gemm import launch_plan, split_candidates

    if arch is None:
        return None
    plan = launch_plan(m, n, k, sms)
    available = frozenset(str(s) for s in split_candidates(k))
    rule = str(plan.splits)
    key = (SPLITS_OP, kind(groups), DTYPE, n, k, plan.block_m, groups)
    chosen = kernel_choice.choose(*key, arch, available, default=rule)
    return None if chosen == rule else int(chosen)
