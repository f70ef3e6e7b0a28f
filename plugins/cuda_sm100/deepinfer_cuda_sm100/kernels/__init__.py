"""Triton kernels of the ``cuda_sm100`` backend, one module per op family.

Importing this package imports Triton, so only :func:`deepinfer_cuda_sm100.ops.load_ops`
(reached when the backend is selected or checked) imports it.  Every kernel is a plain
``@triton.jit`` function: compiled for the GPU, or run by Triton's CPU interpreter on CPU
tensors when ``TRITON_INTERPRET=1`` was set before these modules were imported
(:data:`._common.INTERPRETED`).

All kernels share the same rules: fp32 arithmetic, one row (token) per reduction with a
fixed order whatever the number of rows (batch invariance), launch grids that depend only
on shapes and no host synchronisation (CUDA-graph capturable).
"""
