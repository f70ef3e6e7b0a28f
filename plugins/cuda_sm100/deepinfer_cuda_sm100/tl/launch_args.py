"""What the TileLang kernels' host wrappers share to launch: the dtype names their kernels are
compiled for, a paged index's tensors in the form the kernels read, and the SM count their
launch plans size against.  Imports torch only (neither TileLang nor Triton)."""

import torch

TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""Activation dtypes the TileLang kernels are compiled for, by torch dtype."""


def index_int64(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read a paged index's tensors (block table, token rows, counts):
    contiguous int64, the contract's dtype (:class:`~deepinfer_core.ops.attention.PagedIndex`),
    so the engine's index goes in as it is (no conversion launch per call); another integer
    dtype or a strided view is copied."""
    return x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count
