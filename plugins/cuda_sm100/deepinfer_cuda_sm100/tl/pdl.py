"""Programmatic dependent launch (PDL) for the TileLang kernels.

The Triton kernels' PDL (:mod:`deepinfer_cuda_sm100.kernels.pdl`) starts every kernel with a
wait for the kernel before it and then lets the next one be scheduled.  A TileLang kernel whose
body calls ``T.pdl_sync()`` is launched by TileLang's runtime with the programmatic
stream-serialisation attribute (on SM90 and later), so it takes part in the same chain: its
launch and its CTAs' set-up (barrier initialisation, descriptor prefetch) overlap the tail of
the kernel before it, and the kernel after it may be scheduled while it runs.  Without it, a
TileLang kernel waited for its predecessor to drain before its own launch began.  Before the
wait a kernel reads at most data that no kernel of a step writes (the FP8 GEMM: its weight's
block scales), so every result is what it was.  The kernels that take part: the FP8 GEMM and
its split combine (:mod:`~deepinfer_cuda_sm100.tl.fp8_gemm`), the sparse-attention decode
kernels (:mod:`~deepinfer_cuda_sm100.tl.sparse_attention`, :mod:`~deepinfer_cuda_sm100.tl.
sparse_attention_ws`) and their split combine, the FP4 MoE's gate / up and down GEMMs
(:mod:`~deepinfer_cuda_sm100.tl.moe`) and the indexer's scores
(:mod:`~deepinfer_cuda_sm100.tl.indexer`, :mod:`~deepinfer_cuda_sm100.tl.indexer_grouped`).

Whether the kernels are built with the prologue is :func:`tl_pdl_enabled`'s answer: where the
Triton kernels use PDL (:func:`~deepinfer_cuda_sm100.kernels.pdl.pdl_enabled`: a CUDA device of
compute capability 9 or more, ``DEEPINFER_CUDA_PDL`` not ``0``) unless ``DEEPINFER_TILELANG_PDL``
is ``0``; the prologue's kernels are separate compiled configurations, keyed by that flag.
"""

import os

from deepinfer_cuda_sm100.kernels.pdl import ENV as TRITON_ENV
from deepinfer_cuda_sm100.kernels.pdl import pdl_enabled

from .target import target_capability

ENV = "DEEPINFER_TILELANG_PDL"
"""Set to ``0`` to build and launch the TileLang kernels without PDL (the Triton kernels keep
theirs)."""


def tl_pdl_enabled() -> bool:
    """Whether TileLang kernels built now take the PDL prologue: where the Triton kernels use
    PDL, unless :data:`ENV` is ``0``; for a capability named by
    :data:`~deepinfer_cuda_sm100.tl.target.ARCH_ENV` (kernels built for a device that is not
    here), where that capability takes PDL (9.0 or later, ``DEEPINFER_CUDA_PDL`` not ``0``)."""
    if os.environ.get(ENV, "1") == "0":
        return False
    capability = target_capability()
    if capability is not None:
        return capability[0] >= 9 and os.environ.get(TRITON_ENV, "1") != "0"
    return pdl_enabled()


def prologue():
    """A TileLang macro, a kernel's first statement under PDL: wait for the kernel before it
    (its writes visible), then let the next kernel be scheduled."""
    import tilelang.language as T

    @T.macro
    def wait_then_release():
        T.pdl_sync()
        T.pdl_trigger()

    return wait_then_release
