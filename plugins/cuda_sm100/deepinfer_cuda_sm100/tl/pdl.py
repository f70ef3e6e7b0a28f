"""Programmatic dependent launch (PDL) for the TileLang kernels, with a weight prefetch ahead of
the wait.

The Triton kernels' PDL (:mod:`deepinfer_cuda_sm100.kernels.pdl`) starts every kernel with a
wait for the kernel before it and then lets the next one be scheduled.  A TileLang kernel whose
body calls ``T.pdl_sync()`` is launched by TileLang's runtime with the programmatic
stream-serialisation attribute (on SM90 and later), so it takes part in the same chain: without
it, each TileLang kernel in a decode step waited for its predecessor to drain before its own
launch began, and its successor for it.

A kernel's prologue (:func:`prologue`) may do one thing before the wait: ask the L2 cache for
bytes that no kernel of the step writes -- a GEMM's weights -- with one bulk prefetch
(``cp.async.bulk.prefetch.L2``) per weight row of the CTA's slice.  While the kernel before it
finishes, the weight stream has started; no value read or written changes (a prefetch has no
architectural effect), so every result stays bitwise what it was.

Whether the kernels are built with the prologue is :func:`tl_pdl_enabled`'s answer: where the
Triton kernels use PDL (:func:`~deepinfer_cuda_sm100.kernels.pdl.pdl_enabled`: a CUDA device of
compute capability 9 or more, ``DEEPINFER_CUDA_PDL`` not ``0``) unless ``DEEPINFER_TILELANG_PDL``
is ``0``; the prologue's kernels are separate compiled configurations, keyed by that flag.
"""

import os

from deepinfer_cuda_sm100.kernels.pdl import pdl_enabled

ENV = "DEEPINFER_TILELANG_PDL"
"""Set to ``0`` to build and launch the TileLang kernels without PDL (the Triton kernels keep
theirs)."""

PREFETCH_FN = "deepinfer_prefetch_l2"
PREFETCH_SOURCE = r"""
#ifndef DEEPINFER_PREFETCH_L2
#define DEEPINFER_PREFETCH_L2
__device__ __forceinline__ void deepinfer_prefetch_l2(const void* ptr, unsigned bytes) {
  // bring [ptr, ptr + bytes) into L2 (16-byte aligned, a multiple of 16); no register result
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" : : "l"(ptr), "r"(bytes) : "memory");
}
#endif
"""
"""The device function of the weight prefetch (``T.import_source``)."""


def tl_pdl_enabled() -> bool:
    """Whether TileLang kernels built now take the PDL prologue: where the Triton kernels use
    PDL, unless :data:`ENV` is ``0``."""
    return os.environ.get(ENV, "1") != "0" and pdl_enabled()


def prologue(prefetch: bool):
    """A TileLang macro for a kernel's first statements under PDL.

    ``prefetch=False``: ``macro()`` waits for the kernel before it (its writes visible), then
    lets the next kernel be scheduled.  ``prefetch=True``: ``macro(w, row0, col0, rows,
    nbytes)`` first has thread ``t < rows`` prefetch ``nbytes`` bytes of row ``row0 + t`` of the
    2-D weight ``w`` from column ``col0`` into L2 (8-bit elements, 16-byte aligned rows), then
    waits and lets the next kernel be scheduled.  Nothing is read before the wait but the
    weights, which no kernel writes."""
    import tilelang.language as T

    @T.macro
    def wait_then_release():
        T.pdl_sync()
        T.pdl_trigger()

    @T.macro
    def prefetch_then_wait(w, row0, col0, rows, nbytes):
        T.import_source(PREFETCH_SOURCE)
        tx = T.get_thread_binding()
        if tx < rows:
            T.call_extern("handle", PREFETCH_FN, T.address_of(w[row0 + tx, col0]), nbytes)
        T.pdl_sync()
        T.pdl_trigger()

    return prefetch_then_wait if prefetch else wait_then_release
