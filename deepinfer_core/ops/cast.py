"""A dtype cast that costs nothing when there is nothing to cast.

``Tensor.to(dtype)`` returns the tensor itself when it already has ``dtype``, yet still goes
through the dispatcher (about a microsecond on a CPU); the reference ops run at batch sizes
where that shows (a small model's decode step is host-bound), so they compare the dtypes first.
"""

from __future__ import annotations

import torch


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``: ``x`` itself when it already has ``dtype``."""
    return x if x.dtype == dtype else x.to(dtype)
