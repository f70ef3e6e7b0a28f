"""DeepInfer backend for NVIDIA GPUs of compute capability 9.0 and newer (Hopper, Blackwell).

The hooks live in :mod:`deepinfer_cuda_sm100.plugin`; the availability probe in
:mod:`deepinfer_cuda_sm100.backend`; the op table in :mod:`deepinfer_cuda_sm100.ops`.  The
Triton kernels (:mod:`deepinfer_cuda_sm100.kernels`) are imported only when the backend's ops
are loaded, so this package imports on machines without Triton or a GPU.
"""

MIN_COMPUTE_CAPABILITY = (9, 0)
