"""DeepInfer backend for NVIDIA GPUs of compute capability 9.0 and newer (Hopper, Blackwell).

The hooks live in :mod:`deepinfer_cuda_sm100.plugin`; the availability probe in
:mod:`deepinfer_cuda_sm100.backend`.  Kernels will live in their own modules, imported only
when the backend is selected, so this package imports on machines without a GPU.
"""

MIN_COMPUTE_CAPABILITY = (9, 0)
